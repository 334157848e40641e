"""moeep_fast (client/python/fast/moeep_fast.c), the low-latency calls in C,
without torch or a GPU: a stand-in torch (the attributes moeep_fast reads)
and a stand-in libmoeep (tests/fast_stub.c, which records what reaches it).
What the calls pass to libmoeep, what they return, every way a call is
handed back to the Python path (None, with no libmoeep call), errors, the
torch function mode and references. The Python path and the GPU results
are tests/gpu/test_python_buffer.py's.

Skipped unless meson built the extension (MOEEP_TEST_FAST, MOEEP_TEST_FAST_STUB).
"""

import ctypes
import os
import sys
import types
import unittest

from moeep import _fast, _lib

EXT = os.environ.get("MOEEP_TEST_FAST")
STUB = os.environ.get("MOEEP_TEST_FAST_STUB")
R, T, H, E, K, DEV = 2, 16, 256, 8, 4, 3
L = E // R


class Tensor:
    """torch.Tensor as moeep_fast reads it."""
    _next = 0x10000

    def __init__(self, dtype, shape, device=DEV, contiguous=True):
        self.dtype, self.shape, self.device, self.contiguous = dtype, tuple(shape), device, contiguous
        Tensor._next += 0x1000
        self.ptr = Tensor._next

    def get_device(self):
        return self.device

    def is_contiguous(self):
        return self.contiguous

    def data_ptr(self):
        return self.ptr


class SubTensor(Tensor):
    pass


class NoFunction:
    """torch._C.DisableTorchFunction: counts entries and exits."""
    entered = exited = 0

    def __enter__(self):
        NoFunction.entered += 1

    def __exit__(self, *exc):
        NoFunction.exited += 1


def make_torch(state):
    dt = types.SimpleNamespace
    torch = dt(bfloat16=dt(name="bf16"), float8_e4m3fn=dt(name="fp8"), float32=dt(name="f32"),
               int32=dt(name="i32"), int64=dt(name="i64"), Tensor=Tensor)

    def empty(*size, dtype=None, device=None):
        state["empty"].append((size, dtype, device))
        return Tensor(dtype, size, device[1])
    torch.empty = empty
    torch.device = lambda kind, index: (kind, index)
    torch._C = dt(_cuda_getCurrentRawStream=lambda index: state["stream"],
                  _is_torch_function_mode_enabled=lambda: state["mode"], DisableTorchFunction=NoFunction)
    return torch


class Check:
    def __init__(self):
        self.calls = []

    def __call__(self, r, what):
        self.calls.append((r, what))
        if r < 0:
            raise _lib.MoeepError(-r, "%s: stub failure" % what)
        return r


@unittest.skipUnless(EXT and STUB, "moeep_fast not built (no Python headers, or no CUDA)")
class FastTest(unittest.TestCase):
    def setUp(self):
        self.stub = ctypes.CDLL(STUB)
        _fast._module = _fast._status = None
        lib = types.SimpleNamespace(path=os.path.join(os.path.dirname(EXT), "libmoeep.so"))
        self.mod = _fast.load(lib)
        self.assertIsNotNone(self.mod, _fast.status())
        self.state = {"stream": 0x77, "mode": False, "empty": []}
        self.torch = make_torch(self.state)
        self.check = Check()
        self.no_event = object()
        addr = lambda name: ctypes.cast(getattr(self.stub, name), ctypes.c_void_p).value  # noqa: E731
        self.f = self.mod.LowLatency(0x1234, addr("moeep_ll_dispatch"), addr("moeep_ll_combine"), self.check,
                                     self.torch, DEV, R, H, E, T, _lib.MAX_TOPK, self.no_event)
        tt = self.torch
        self.x = Tensor(tt.bfloat16, (T, H))
        self.idx = Tensor(tt.int64, (T, K))
        self.w = Tensor(tt.float32, (T, K))
        self.y = Tensor(tt.bfloat16, (L, R * T, H))
        self.stats = Tensor(tt.int32, (L,))
        # What the Python path hands over after its calls into sets 0 and 1.
        self.rx = {s: (Tensor(tt.float8_e4m3fn, (L, R * T, H)), Tensor(tt.float32, (L, R * T, H // 128)))
                   for s in (0, 1)}
        self.count = {s: Tensor(tt.int32, (L,)) for s in (0, 1)}
        self.handle = {s: ("handle", s) for s in (0, 1)}
        for s in (0, 1):
            self.f.remember(s, T, T, True, self.rx[s], self.count[s], self.handle[s])
        self.f.note_stream(0x77)
        self.calls = ctypes.c_int.in_dll(self.stub, "calls")
        self.calls.value = 0  # the next dispatch goes to set 0

    def last(self, cls, name):
        return cls.from_address(ctypes.addressof(ctypes.c_char.in_dll(self.stub, name)))

    def dispatch(self, *args, **over):
        a = dict(x=self.x, idx=self.idx, num_max=T, experts=E, stats=self.stats, fp8=True, round_scale=False)
        a.update(over)
        return self.f.dispatch(*(list(a.values()) + list(args)))

    def combine(self, handle, **over):
        a = dict(y=self.y, idx=self.idx, w=self.w, handle=handle, zero_copy=False, out=None)
        a.update(over)
        return self.f.combine(*a.values())

    def test_dispatch_and_combine(self):
        for s in (0, 1):
            r = self.dispatch()
            self.assertEqual(r, (self.rx[s], self.count[s], self.handle[s], self.no_event, None))
            a = self.last(_lib.LlDispatchArgs, "last_d")
            self.assertEqual((a.x, a.num_tokens, a.topk_idx, a.topk_idx_type, a.num_topk),
                             (self.x.ptr, T, self.idx.ptr, _lib.INDEX_INT64, K))
            self.assertEqual((a.use_fp8, a.round_scale, a.return_recv_hook, a.num_max_tokens),
                             (True, False, False, T))
            self.assertEqual((a.cumulative_local_expert_recv_stats, a.active_ranks, a.timeout_us),
                             (self.stats.ptr, None, 0))
            self.assertEqual(ctypes.c_void_p.in_dll(self.stub, "last_ds").value, 0x77)

            out, ev, hook = self.combine(r[2])
            self.assertIs(ev, self.no_event)
            self.assertIsNone(hook)
            self.assertEqual((out.dtype, out.shape), (self.torch.bfloat16, (T, H)))
            self.assertEqual(self.state["empty"][-1], ((T, H), self.torch.bfloat16, ("cuda", DEV)))
            c = self.last(_lib.LlCombineArgs, "last_c")
            h = self.last(_lib.LlHandle, "last_h")
            self.assertEqual((c.x, c.topk_idx, c.topk_idx_type, c.topk_weights, c.num_topk, c.out),
                             (self.y.ptr, self.idx.ptr, _lib.INDEX_INT64, self.w.ptr, K, out.ptr))
            self.assertEqual((h.set, h.num_tokens, h.slots_per_expert), (s, T, R * T))
            self.assertEqual((c.return_recv_hook, c.active_ranks, c.timeout_us), (False, None, 0))
        self.assertEqual(self.f.counts(), (2, 2))

    def test_options(self):
        tt = self.torch
        idx32 = Tensor(tt.int32, (T, K))
        self.dispatch(idx=idx32, stats=None, round_scale=True)
        a = self.last(_lib.LlDispatchArgs, "last_d")
        self.assertEqual((a.topk_idx_type, a.cumulative_local_expert_recv_stats, a.round_scale),
                         (_lib.INDEX_INT32, None, True))
        out = Tensor(tt.bfloat16, (T, H))
        r = self.dispatch()
        got = self.combine(r[2], idx=Tensor(tt.int64, (T, K)), out=out)
        self.assertIs(got[0], out)
        self.assertEqual(self.last(_lib.LlCombineArgs, "last_c").out, out.ptr)
        # BF16 outputs are the Python path's to make first.
        self.assertIsNone(self.dispatch(fp8=False))
        for s in (0, 1):
            self.f.remember(s, T, T, False, ("bf16", s), self.count[s], self.handle[s])
        self.assertEqual(self.dispatch(fp8=False)[0], ("bf16", self.calls.value - 1 & 1))

    def test_not_the_common_case(self):
        tt = self.torch
        r = self.dispatch()
        combines = ctypes.c_int.in_dll(self.stub, "combine_calls")
        n, nc = self.calls.value, combines.value
        cases = {
            "x float32": lambda: self.dispatch(x=Tensor(tt.float32, (T, H))),
            "x other hidden": lambda: self.dispatch(x=Tensor(tt.bfloat16, (T, H + 1))),
            "x 3-D": lambda: self.dispatch(x=Tensor(tt.bfloat16, (1, T, H))),
            "x on another GPU": lambda: self.dispatch(x=Tensor(tt.bfloat16, (T, H), device=DEV + 1)),
            "x not contiguous": lambda: self.dispatch(x=Tensor(tt.bfloat16, (T, H), contiguous=False)),
            "x a subclass": lambda: self.dispatch(x=SubTensor(tt.bfloat16, (T, H))),
            "x a list": lambda: self.dispatch(x=[1, 2]),
            "no tokens": lambda: self.dispatch(x=Tensor(tt.bfloat16, (0, H)), idx=Tensor(tt.int64, (0, K))),
            "tokens without a handle yet": lambda: self.dispatch(x=Tensor(tt.bfloat16, (T - 1, H)),
                                                                 idx=Tensor(tt.int64, (T - 1, K))),
            "more tokens than num_max": lambda: self.dispatch(num_max=T - 1),
            "num_max above the buffers'": lambda: self.dispatch(num_max=T + 1),
            "num_max a bool": lambda: self.dispatch(num_max=True),
            "num_max a float": lambda: self.dispatch(num_max=float(T)),
            "num_max past a long": lambda: self.dispatch(num_max=1 << 80),
            "other experts": lambda: self.dispatch(experts=E * 2),
            "ids rows": lambda: self.dispatch(idx=Tensor(tt.int64, (T - 1, K))),
            "ids float": lambda: self.dispatch(idx=Tensor(tt.float32, (T, K))),
            "top-10": lambda: self.dispatch(idx=Tensor(tt.int64, (T, 10))),
            "stats shape": lambda: self.dispatch(stats=Tensor(tt.int32, (L + 1,))),
            "stats int64": lambda: self.dispatch(stats=Tensor(tt.int64, (L,))),
            "round_scale without fp8": lambda: self.dispatch(fp8=False, round_scale=True),
            "combine zero_copy": lambda: self.combine(r[2], zero_copy=True),
            "combine an unknown handle": lambda: self.combine(("handle", 0)),
            "combine y slots": lambda: self.combine(r[2], y=Tensor(tt.bfloat16, (L, T, H))),
            "combine y float32": lambda: self.combine(r[2], y=Tensor(tt.float32, (L, R * T, H))),
            "combine weights float16": lambda: self.combine(r[2], w=Tensor(tt.bfloat16, (T, K))),
            "combine weights top-k": lambda: self.combine(r[2], w=Tensor(tt.float32, (T, K - 1))),
            "combine ids rows": lambda: self.combine(r[2], idx=Tensor(tt.int64, (T - 2, K))),
            "combine out shape": lambda: self.combine(r[2], out=Tensor(tt.bfloat16, (T, H - 1))),
            "combine out float32": lambda: self.combine(r[2], out=Tensor(tt.float32, (T, H))),
        }
        for what, call in cases.items():
            with self.subTest(what):
                self.assertIsNone(call())
                self.assertEqual((self.calls.value, combines.value), (n, nc), "%s reached libmoeep" % what)
        self.state["stream"] = 0x99  # another stream than the last call's: Python orders it
        self.assertIsNone(self.dispatch())
        self.assertIsNone(self.combine(r[2]))
        self.assertEqual(self.calls.value, n)
        self.f.note_stream(0x99)
        self.assertIsNotNone(self.combine(r[2]))
        self.f.close()
        self.assertIsNone(self.dispatch())
        self.assertIsNone(self.combine(r[2]))

    def test_errors(self):
        ctypes.c_int.in_dll(self.stub, "fail_next").value = 1
        with self.assertRaisesRegex(_lib.MoeepError, "low_latency_dispatch: stub failure"):
            self.dispatch()
        r = self.dispatch()
        ctypes.c_int.in_dll(self.stub, "fail_next").value = 1
        with self.assertRaisesRegex(_lib.MoeepError, "low_latency_combine: stub failure"):
            self.combine(r[2])
        with self.assertRaises(TypeError):
            self.f.dispatch(self.x)
        with self.assertRaises(ValueError):
            self.f.remember(2, T, T, True, None, None, None)
        with self.assertRaises(ValueError):
            self.f.remember(0, T, T + 1, True, None, None, None)

    def test_torch_function_mode(self):
        self.state["mode"] = True
        NoFunction.entered = NoFunction.exited = 0
        r = self.dispatch()
        self.combine(r[2])
        self.assertIsNone(self.dispatch(x=[1]))
        ctypes.c_int.in_dll(self.stub, "fail_next").value = 1
        with self.assertRaises(_lib.MoeepError):
            self.dispatch()
        self.assertEqual((NoFunction.entered, NoFunction.exited), (4, 4))
        self.state["mode"] = False
        self.dispatch()
        self.assertEqual(NoFunction.entered, 4)

    def test_references(self):
        held = [self.rx[0], self.rx[1], self.count[0], self.handle[0], self.no_event, self.x, self.y]
        before = [sys.getrefcount(o) for o in held]
        for _ in range(100):
            r = self.dispatch()
            self.combine(r[2])
            self.assertIsNone(self.dispatch(x=[1]))
        del r
        self.assertEqual([sys.getrefcount(o) for o in held], before)
        self.f.close()  # drops what remember() gave it
        self.assertEqual([sys.getrefcount(o) for o in held][:4], [before[0] - 1, before[1] - 1, before[2] - 1,
                                                                 before[3] - 1])


if __name__ == "__main__":
    unittest.main()
