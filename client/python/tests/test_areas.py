"""The normal-mode receive areas' bookkeeping (moeep/_tensors.py: _Areas,
_Lease) without a GPU: which area a dispatch gets, whether its outputs may
be views, and that an area comes back exactly when the last view of its
outputs goes. torch is replaced by a stand-in whose tensors keep what
torch.as_tensor was given alive for as long as any view of them lives, as
torch's storage does (its deleter drops the __cuda_array_interface__
object); the GPU tests check the same against real torch and kernels."""

import gc
import unittest

from moeep import _lib, _tensors


class _Storage:
    def __init__(self, owner):
        self.owner = owner  # what torch keeps alive: the _Lease


class _Tensor:
    """A view: shares its base's storage, as torch's views do."""

    def __init__(self, storage, nbytes):
        self.storage, self.nbytes = storage, nbytes

    def __getitem__(self, s):
        return _Tensor(self.storage, s.stop - s.start)

    def view(self, *args):
        return _Tensor(self.storage, self.nbytes)


class _Torch:
    bfloat16, float8_e4m3fn, float32, int32, int64, int16, uint8 = ("bf16", "fp8", "f32", "i32", "i64", "i16",
                                                                     "u8")

    @staticmethod
    def as_tensor(obj, device=None):
        shape = obj.__cuda_array_interface__["shape"]
        return _Tensor(_Storage(obj), shape[0])


class _Lib:
    """moeep_ep_recv_area of an endpoint with `n` areas of `nbytes` each."""

    def __init__(self, n, nbytes):
        self.n, self.nbytes = n, nbytes

    def moeep_ep_recv_area(self, ptr, area, res, nbytes):
        if not 0 <= area < self.n:
            return -22
        res = res._obj
        base = 0x10000000 + area * self.nbytes
        res.recv_x = base
        res.recv_x_scales = base + 4096
        res.recv_topk_idx = base + 8192
        res.recv_topk_weights = base + 12288
        nbytes._obj.value = self.nbytes
        return 0


class _Endpoint:
    def __init__(self, n):
        self.lib = _Lib(n, 1 << 20)
        self.ptr = 1

    def check(self, r, what):
        if r < 0:
            raise _lib.MoeepError(-r, what)
        return r


def _dispatch(areas, torch, rows=8, capturing=False):
    """What _dispatch_call does with the areas: pick one, make the outputs."""
    area, views = areas.pick(capturing)
    outs = areas.views(torch, area, object(), None,
                       [("recv_x", (rows, 256), torch.bfloat16), ("recv_x_scales", (rows, 2), torch.float32)])
    return area, views, outs


class AreasTest(unittest.TestCase):
    def setUp(self):
        # The dtype tables are made from the first torch the module sees.
        _tensors._TYPESTR = None
        _tensors._ELEMENT.clear()
        self.addCleanup(_tensors._ELEMENT.clear)
        self.addCleanup(setattr, _tensors, "_TYPESTR", None)
        self.torch = _Torch()
        # ctypes.byref() objects expose the structure as ._obj.
        self.areas = _tensors._Areas(_Endpoint(3), 3)

    def test_offsets(self):
        self.assertEqual(self.areas.nbytes, 1 << 20)
        self.assertEqual(self.areas.offsets, {"recv_x": 0, "recv_x_scales": 4096, "recv_topk_idx": 8192,
                                              "recv_topk_weights": 12288})
        self.assertEqual(self.areas.base, [0x10000000 + a * (1 << 20) for a in range(3)])

    def test_views_while_another_area_is_free(self):
        a0, v0, outs0 = _dispatch(self.areas, self.torch)
        self.assertEqual((a0, v0), (0, True))
        self.assertEqual(self.areas.held, [True, False, False])
        a1, v1, outs1 = _dispatch(self.areas, self.torch)
        self.assertEqual((a1, v1), (1, True))
        # One area left: the next dispatch lands there and copies.
        a2, v2 = self.areas.pick()
        self.assertEqual((a2, v2), (2, False))

    def test_last_view_frees_the_area(self):
        _, _, outs = _dispatch(self.areas, self.torch)
        x, scales = outs
        del outs
        self.assertEqual(self.areas.held[0], True)
        part = x[0:16]  # a view of a view
        del x, scales
        gc.collect()
        self.assertEqual(self.areas.held[0], True, "a view of a view must still hold the area")
        del part
        gc.collect()
        self.assertEqual(self.areas.held, [False, False, False])
        self.assertEqual(self.areas.pick(), (0, True))

    def test_areas_come_back_in_any_order(self):
        held = [_dispatch(self.areas, self.torch)[2] for _ in range(2)]
        self.assertEqual(self.areas.held, [True, True, False])
        del held[0]
        gc.collect()
        self.assertEqual(self.areas.held, [False, True, False])
        self.assertEqual(self.areas.pick(), (0, True))

    def test_captures_take_graph_areas(self):
        # A capture while a caller holds area 0: the last free area becomes a
        # graph area, read in place by the graph.
        eager = _dispatch(self.areas, self.torch)[2]
        a, v, captured = _dispatch(self.areas, self.torch, capturing=True)
        self.assertEqual((a, v, self.areas.graph), (2, True, {2}))
        # A second dispatch alive in the same capture needs a second one.
        a2, v2, captured2 = _dispatch(self.areas, self.torch, capturing=True)
        self.assertEqual((a2, v2, self.areas.graph), (1, True, {1, 2}))
        del captured, captured2
        gc.collect()
        # A later capture takes a graph area again, not the caller's.
        self.assertEqual(self.areas.pick(True), (1, True))
        self.assertEqual(self.areas.graph, {1, 2})
        del eager
        gc.collect()
        # Outside a capture: views only of the other areas, and a graph area,
        # copied out, where no other is free.
        self.assertEqual(self.areas.pick(), (0, True))
        held = _dispatch(self.areas, self.torch)[2]
        self.assertEqual(self.areas.pick(), (1, False))
        del held

    def test_every_area_held(self):
        held = [_dispatch(self.areas, self.torch, capturing=True)[2] for _ in range(3)]
        for capturing in (False, True):
            with self.assertRaisesRegex(RuntimeError, "every receive area holds outputs"):
                self.areas.pick(capturing)
        del held

    def test_area_out_of_range_is_refused(self):
        with self.assertRaises(_lib.MoeepError):
            _tensors._Areas(_Endpoint(2), 3)


if __name__ == "__main__":
    unittest.main()
