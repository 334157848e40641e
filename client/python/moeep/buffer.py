"""moeep.Buffer: DeepEP's deep_ep.Buffer API over libmoeep (intranode).

torch is imported on first use, never at import time, so that `import moeep`
and the static methods work without it. See client/python/README.md for the
semantics and where they differ from DeepEP (output lifetimes, sizing).
"""

import collections
import ctypes
import errno as _errno
import sys
import weakref

from . import _lib
from ._endpoint import Endpoint
from ._job import attach
from ._lib import MoeepError
from .config import Config, Plan, check_num_sms, low_latency_buffer_bytes
from .event import EventOverlap, _torch

class LowLatencyHandle(collections.namedtuple(
        "LowLatencyHandle", ["src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                             "num_experts"])):
    """DeepEP's low-latency handle: (src_info int32 [local experts, slots]:
    the source token index of each slot; layout_range int64 [local experts,
    ranks]: begin << 32 | count of each source rank's run of slots;
    num_max_dispatch_tokens_per_rank, hidden, num_experts). moeep's routing
    rides along as attributes."""

    def __new__(cls, src_info, layout_range, num_max, hidden, num_experts, ll_handle, buffer_id, combine_buffer):
        self = super().__new__(cls, src_info, layout_range, num_max, hidden, num_experts)
        self.ll_handle = ll_handle
        self.buffer_id = buffer_id
        self.combine_buffer = combine_buffer
        return self


class _DevicePointer:
    """A device array for torch.as_tensor (__cuda_array_interface__ v2)."""

    def __init__(self, ptr, shape, typestr, owner):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (int(ptr), False),
                                         "version": 2, "strides": None}
        self._owner = owner  # keeps the Buffer (and so the mapping) referenced


class _Route:
    """The C handle (moeep_ep_handle) of one normal-mode dispatch; goes back
    to its Buffer when released or dropped. Weakly referenced by the Buffer
    (tuples cannot be), so destroy() can return every live one."""

    def __init__(self, buffer, ptr):
        self._buffer = weakref.ref(buffer)
        self._ep = buffer._ep
        self.ptr = ptr

    def release(self):
        if self.ptr:
            buf = self._buffer()
            if buf is not None and buf._ep is self._ep and self._ep is not None and self._ep._ptr:
                self._ep.lib.moeep_ep_handle_free(self.ptr)
            self.ptr = None

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


class DispatchHandle(tuple):
    """The routing of one normal-mode dispatch, for combine and for cached
    dispatch. As DeepEP's intranode handle it is a 6-tuple:
    (rank_prefix_matrix int32 [ranks, ranks], element [s][d] the rows ranks
    0..s send to rank d, so rank d's rows from source s are
    [s-1][d]..[s][d]; channel_prefix_matrix and recv_channel_prefix_matrix:
    None, moeep has no channels; recv_src_idx int32 [num_recv]: (source
    rank << 24) | source token; is_token_in_rank as given (or None);
    send_head int32 [tokens, ranks]: a token's row among ours at each rank,
    -1 = not sent). The tensors are views of the handle's memory, valid
    while the handle lives."""

    def __new__(cls, route, num_tokens, num_recv_tokens, num_topk, topk_idx, topk_weights, items):
        return super().__new__(cls, items)

    def __init__(self, route, num_tokens, num_recv_tokens, num_topk, topk_idx, topk_weights, items):
        self._route = route
        # A dispatch larger than one call runs in rounds: [(round's handle,
        # first token, end)] and, per round, the rows of the whole output
        # that are that round's (index into DeepEP's order).
        self.rounds = None
        self.round_index = None
        self._buffer = route._buffer
        self.num_tokens = num_tokens
        self.num_recv_tokens = num_recv_tokens  # rows of recv_x (num_worst_tokens when the count stayed on the GPU)
        self.num_topk = num_topk
        # A cached dispatch resends the same top-k (moeep_dispatch needs it when
        # the first call had it); kept so the caller need not pass them again.
        self.topk_idx = topk_idx
        self.topk_weights = topk_weights

    @property
    def ptr(self):
        return self._route.ptr

    def release(self):
        self._route.release()


_TYPESTR = None


def _view(torch, ptr, shape, dtype, owner, device):
    """A torch tensor over device memory at ptr, without copying."""
    global _TYPESTR
    if _TYPESTR is None:
        _TYPESTR = {torch.bfloat16: ("<i2", torch.int16), torch.float8_e4m3fn: ("|u1", torch.uint8),
                    torch.float32: ("<f4", None), torch.int32: ("<i4", None), torch.int64: ("<i8", None)}
    n = 1
    for s in shape:
        n *= s
    if n == 0 or not ptr:
        return torch.empty(shape, dtype=dtype, device=device)
    typestr, raw = _TYPESTR[dtype]
    t = torch.as_tensor(_DevicePointer(ptr, shape, typestr, owner), device=device)
    return t.view(dtype) if raw is not None else t


class Buffer:
    """DeepEP-compatible expert-parallel communication buffer over moeep.

    Arguments as deep_ep.Buffer; those that do not apply are accepted:
    num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
    use_fabric, enable_shrink and comm are ignored (one node, NVLink only);
    explicitly_destroy only decides whether destroy() is required (as DeepEP).
    num_nvl_bytes / num_rdma_bytes size the endpoint through the formulas of
    moeep.config (see README "Sizing"); keyword-only extras give the shapes
    directly: socket, hidden, num_experts, max_tokens_per_rank,
    num_max_dispatch_tokens_per_rank, max_topk, timeout_ms, job_name,
    copy_outputs (normal-mode outputs as owned tensors, default True).
    """

    num_sms = _lib.MOEEP_DEFAULT_NUM_SMS

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                 explicitly_destroy=False, enable_shrink=False, comm=None, *, socket=None, hidden=None,
                 num_experts=None, max_tokens_per_rank=None, num_max_dispatch_tokens_per_rank=None,
                 max_topk=None, timeout_ms=0, job_name=None, copy_outputs=True):
        self._ep = None
        self._client = None
        torch = _torch()
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_ranks = self.group_size
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = explicitly_destroy
        self.copy_outputs = bool(copy_outputs)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self._plan = Plan(self.group_size, num_nvl_bytes, num_rdma_bytes, low_latency_mode, hidden, num_experts,
                          max_tokens_per_rank, num_max_dispatch_tokens_per_rank, max_topk, timeout_ms)
        if not torch.cuda.is_available():
            raise MoeepError(_errno.ENODEV, "moeep.Buffer needs a CUDA device; torch sees none")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm_stream = torch.cuda.Stream(device=self.device)
        self._applied_num_sms = None

        src = 0
        if group is not None and group is not dist.group.WORLD:
            get_global = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
            src = get_global(group, 0)

        def broadcast(value):
            box = [value]
            dist.broadcast_object_list(box, src=src, group=group)
            return box[0]

        def all_gather(value):
            out = [None] * self.group_size
            dist.all_gather_object(out, value, group=group)
            return out

        self._client = attach(self.rank, self.group_size, broadcast, all_gather, socket=socket, name=job_name,
                              gpu_uuid=_gpu_uuid(torch, self.device))
        if self._plan.ready:
            self._create_endpoint()

    # ------------------------------------------------------------ endpoint

    def _create_endpoint(self):
        torch = _torch()
        if self._client is None:
            raise MoeepError(_errno.EBADF, "this Buffer was destroyed")
        if torch.cuda.is_current_stream_capturing():
            raise MoeepError(_errno.EBUSY, "the moeep endpoint is created at the first collective call, which "
                             "cannot be inside CUDA graph capture: pass hidden= and num_experts= to Buffer() "
                             "or make one call before capturing")
        cfg = self._plan.config(num_sms=type(self).num_sms)
        # libmoeep uses the calling thread's current device: make sure it is
        # ours and its primary context exists before the (collective) create.
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize(self.device)
        try:
            self._ep = Endpoint(self._client, cfg)
        except MoeepError:
            # Closing our session marks us lost, so that the other ranks'
            # barriers inside moeep_ep_create end instead of waiting for us.
            self._client.close()
            self._client = None
            raise
        self._applied_num_sms = cfg.num_sms
        self._handles = weakref.WeakSet()

    def _endpoint(self, hidden=None, num_experts=None, ll_tokens=None):
        """The endpoint, created on first use from what the call reveals."""
        if self._ep is not None:
            if hidden is not None and hidden != self._plan.hidden:
                raise ValueError("hidden %d differs from the %d this Buffer was created for" %
                                 (hidden, self._plan.hidden))
            if num_experts is not None and num_experts != self._plan.num_experts:
                raise ValueError("num_experts %d differs from the %d this Buffer was created for" %
                                 (num_experts, self._plan.num_experts))
            return self._ep
        if self._client is None:
            raise MoeepError(_errno.EBADF, "this Buffer was destroyed (or its creation failed)")
        if hidden is not None:
            self._plan.set_hidden(hidden)
        if num_experts is not None:
            self._plan.set_num_experts(num_experts)
        if ll_tokens is not None and self._plan.ll_max_tokens is None and not self._plan.num_rdma_bytes:
            self._plan.set_ll_max_tokens(ll_tokens)
        if not self._plan.ready:
            raise ValueError("num_experts is unknown at the first dispatch: pass num_tokens_per_expert "
                             "(get_dispatch_layout) or Buffer(..., num_experts=)")
        self._create_endpoint()
        return self._ep

    def _apply_num_sms(self, config):
        n = config.num_sms if config is not None else type(self).num_sms
        if n != self._applied_num_sms:
            check_num_sms(n)
            self._ep.check(self._ep.lib.moeep_ep_set_num_sms(self._ep.ptr, n), "set_num_sms")
            self._applied_num_sms = n

    def is_available(self):
        return self._ep is not None or self._client is not None

    def destroy(self):
        """Frees the endpoint (synchronising the device) and leaves the job.
        Collective in moeep as in DeepEP. Outputs that are views into the
        NVLink buffer must not be used afterwards."""
        if self._ep is not None:
            for h in list(getattr(self, "_handles", ())):
                h.release()
            self._ep.destroy()
            self._ep = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def __del__(self):
        if sys.is_finalizing():
            return  # the process is ending: the OS and moeepd clean up
        if getattr(self, "explicitly_destroy", False):
            return  # DeepEP: the owner calls destroy() (collective); never behind its back
        try:
            self.destroy()
        except Exception:
            pass

    def check(self):
        """Waits for the device and raises MoeepError if an earlier kernel
        failed (a device wait timed out, or the job was aborted because a rank
        was lost). moeep-only."""
        if self._ep is not None:
            self._ep.check(self._ep.lib.moeep_ep_check(self._ep.ptr), "device check")

    def get_comm_stream(self):
        return self.comm_stream

    # ------------------------------------------------------------ static

    @staticmethod
    def is_sm90_compiled():
        """True: moeep's kernels are built for sm_90 (DeepEP asks before
        using its SM90 features, e.g. FP8 dispatch)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms):
        """SMs (blocks) of normal dispatch/combine for every Buffer, applied at
        the next call (the same on every rank, as in DeepEP)."""
        check_num_sms(new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        """An EventOverlap recorded on the current stream."""
        torch = _torch()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return EventOverlap(ev)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """Bytes of moeep's low-latency buffers for these shapes (they live in
        the NVLink buffer; no RDMA memory is allocated). Passed back as
        num_rdma_bytes, it gives back num_max_dispatch_tokens_per_rank."""
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError("%s must be a positive int, not %r" % (name, v))
        return low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks):
        """Config with the current Buffer.num_sms; nothing else depends on
        num_ranks in moeep."""
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError("num_ranks must be a positive int, not %r" % (num_ranks,))
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks):
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError("num_ranks must be a positive int, not %r" % (num_ranks,))
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    # ------------------------------------------------------------ streams

    def _begin(self, previous_event, async_finish, allocate_on_comm_stream):
        torch = _torch()
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream needs previous_event and async_finish (as DeepEP)")
        compute = torch.cuda.current_stream(self.device)
        if previous_event is not None:
            previous_event.wait_on(self.comm_stream)
        else:
            self.comm_stream.wait_stream(compute)
        return compute

    def _finish(self, compute, stream, async_finish, allocate_on_comm_stream, tensors):
        """DeepEP's ending: an event on `stream` when async, else the compute
        stream waits for it."""
        torch = _torch()
        if async_finish:
            ev = torch.cuda.Event()
            ev.record(stream)
            for t in tensors:
                if t is not None:
                    _record(t, stream)
                    if allocate_on_comm_stream:
                        _record(t, compute)
            return EventOverlap(ev, tensors)
        if stream is not compute:
            compute.wait_stream(stream)
        return EventOverlap(None)

    def _alloc_stream(self, allocate_on_comm_stream):
        torch = _torch()
        return torch.cuda.stream(self.comm_stream if allocate_on_comm_stream else torch.cuda.current_stream())

    # ------------------------------------------------------------ normal mode

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """(num_tokens_per_rank int32 [ranks], None, num_tokens_per_expert
        int32 [num_experts], is_token_in_rank bool [tokens, ranks], event).
        Local (not collective). Before the endpoint exists it runs as torch
        ops; afterwards as moeep's layout kernel."""
        torch = _torch()
        _check_index(torch, topk_idx, "topk_idx", self.device)
        if self._ep is not None:
            self._endpoint(num_experts=num_experts)
        else:
            self._plan.set_num_experts(num_experts)
        T, K = topk_idx.shape
        R = self.group_size
        compute = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_stream(allocate_on_comm_stream):
            per_rank = torch.empty(R, dtype=torch.int32, device=self.device)
            per_expert = torch.empty(num_experts, dtype=torch.int32, device=self.device)
            in_rank = torch.empty(T, R, dtype=torch.bool, device=self.device)
        with torch.cuda.stream(self.comm_stream):
            if self._ep is not None:
                ep = self._ep
                ep.check(ep.lib.moeep_get_dispatch_layout(
                    ep.ptr, topk_idx.data_ptr(), _index_type(torch, topk_idx), T, K, per_rank.data_ptr(),
                    per_expert.data_ptr(), in_rank.data_ptr(), self.comm_stream.cuda_stream),
                    "get_dispatch_layout")
            else:
                _torch_layout(torch, topk_idx, num_experts, R, per_rank, per_expert, in_rank)
        event = self._finish(compute, self.comm_stream, async_finish, allocate_on_comm_stream,
                             [topk_idx, per_rank, per_expert, in_rank])
        return per_rank, None, per_expert, in_rank, event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """Sends each token to the ranks of its experts. Returns (recv_x,
        recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event) as DeepEP; recv_x is (fp8, scales) for an FP8 input.
        With a handle (cached): (recv_x, None, None, None, None, event)."""
        torch = _torch()
        x, x_scales = _split_x(torch, x, self.device)
        T, H = x.shape
        if handle is not None:
            if not isinstance(handle, DispatchHandle) or handle._buffer() is not self or not handle.ptr:
                raise ValueError("handle is not a live dispatch handle of this Buffer")
            if T != handle.num_tokens:
                raise ValueError("x has %d tokens, the handle's dispatch had %d" % (T, handle.num_tokens))
            topk_idx, topk_weights = handle.topk_idx, handle.topk_weights
        num_experts = None
        if num_tokens_per_expert is not None:
            _check_tensor(torch, num_tokens_per_expert, "num_tokens_per_expert", (torch.int32, torch.int64),
                          self.device, (num_tokens_per_expert.numel(),), need_contiguous=False)
            num_experts = int(num_tokens_per_expert.numel())
        if topk_idx is not None:
            _check_index(torch, topk_idx, "topk_idx", self.device, rows=T)
            if topk_weights is not None:
                _check_tensor(torch, topk_weights, "topk_weights", torch.float32, self.device, topk_idx.shape)
        elif topk_weights is not None:
            raise ValueError("topk_weights needs topk_idx")
        if is_token_in_rank is not None and handle is None:
            _check_tensor(torch, is_token_in_rank, "is_token_in_rank", (torch.bool, torch.uint8), self.device,
                          (T, self.group_size))
        if handle is None and topk_idx is None and is_token_in_rank is None:
            raise ValueError("dispatch needs a handle, or is_token_in_rank / topk_idx (get_dispatch_layout)")
        if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 0:
            raise ValueError("expert_alignment must be a non-negative int, not %r" % (expert_alignment,))
        if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ValueError("num_worst_tokens must be a non-negative int, not %r" % (num_worst_tokens,))
        ep = self._endpoint(hidden=H, num_experts=num_experts)
        self._apply_num_sms(config)
        K = topk_idx.shape[1] if topk_idx is not None else 0

        compute = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        per_expert = None
        with torch.cuda.stream(self.comm_stream):
            if x_scales is not None and not x_scales.is_contiguous():
                x_scales = x_scales.contiguous()
            if num_tokens_per_expert is not None and handle is None:
                # DeepEP sums the callers' per-expert counts (also when no
                # top-k travels), so moeep's notify does too.
                per_expert = num_tokens_per_expert.to(torch.int32).contiguous()
        if handle is not None and handle.rounds is not None:
            outs = self._cached_rounds(x, x_scales, handle, allocate_on_comm_stream)
            event = self._finish(compute, self.comm_stream, async_finish, allocate_on_comm_stream,
                                 [x, x_scales] + outs)
            return (tuple(outs) if x_scales is not None else outs[0]), None, None, None, None, event
        C = self._plan.max_tokens_per_rank  # rows per source per call: what the NVLink buffer holds
        if T > C and (handle is not None or num_worst_tokens):
            raise ValueError("%d tokens are more than the %d per call this Buffer holds; only a fresh dispatch "
                             "without num_worst_tokens runs in rounds" % (T, C))
        one = self._dispatch_call(ep, x, x_scales, 0, min(T, C), T, is_token_in_rank, topk_idx, topk_weights,
                                  per_expert, expert_alignment, num_worst_tokens, handle, K,
                                  allocate_on_comm_stream)
        if handle is None and one["max_total"] > C:
            # Some rank sends more tokens than one call holds: every rank runs
            # the same number of rounds of C tokens (DeepEP has no cap).
            return self._dispatch_rounds(compute, one, x, x_scales, T, C, is_token_in_rank, topk_idx,
                                         topk_weights, expert_alignment, K, async_finish, allocate_on_comm_stream,
                                         per_expert)
        outs = one["outs"]
        event = self._finish(compute, self.comm_stream, async_finish, allocate_on_comm_stream,
                             [x, x_scales, topk_idx, topk_weights, is_token_in_rank, per_expert] + outs)
        recv_x, recv_scales, recv_idx, recv_w = outs
        rx = (recv_x, recv_scales) if x_scales is not None else recv_x
        if handle is not None:
            return rx, None, None, None, None, event
        return rx, recv_idx, recv_w, one["counts"], one["handle"], event

    def _dispatch_call(self, ep, x, x_scales, t0, t1, total, is_token_in_rank, topk_idx, topk_weights, per_expert,
                       expert_alignment, num_worst_tokens, handle, K, allocate_on_comm_stream, copy=None):
        """One moeep_dispatch of tokens t0..t1 (a round of a dispatch of
        `total` tokens, or all of it); queued on the comm stream."""
        torch = _torch()
        H = x.shape[1]
        n = t1 - t0
        xs = x[t0:t1]
        sc = x_scales[t0:t1] if x_scales is not None else None
        ti = topk_idx[t0:t1] if topk_idx is not None else None
        tw = topk_weights[t0:t1] if topk_weights is not None else None
        ir = is_token_in_rank[t0:t1] if is_token_in_rank is not None and handle is None else None
        args = _lib.DispatchArgs(
            x=xs.data_ptr() if n else None, x_type=_lib.DTYPE_BF16 if sc is None else _lib.DTYPE_FP8_E4M3,
            x_scales=sc.data_ptr() if sc is not None and n else None, num_tokens=n,
            is_token_in_rank=ir.data_ptr() if ir is not None and n else None,
            topk_idx=ti.data_ptr() if ti is not None and n else None,
            topk_idx_type=_index_type(torch, topk_idx) if topk_idx is not None else _lib.INDEX_INT64,
            topk_weights=tw.data_ptr() if tw is not None and n else None, num_topk=K,
            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
            handle=handle.ptr if handle is not None else None,
            num_tokens_per_expert=per_expert.data_ptr() if per_expert is not None else None, total_tokens=total)
        res = _lib.DispatchResult()
        ep.check(ep.lib.moeep_dispatch(ep.ptr, ctypes.byref(args), ctypes.byref(res), self.comm_stream.cuda_stream),
                 "dispatch")
        new = None
        if handle is None:
            n_recv = res.num_recv_tokens if res.num_recv_tokens >= 0 else num_worst_tokens
            route = _Route(self, res.handle)
            self._handles.add(route)
            R = self.group_size
            items = (_view(torch, res.rank_prefix_matrix, (R, R), torch.int32, route, self.device), None, None,
                     _view(torch, res.recv_src_info, (n_recv,), torch.int32, route, self.device),
                     ir, _view(torch, res.send_pos, (n, R), torch.int32, route, self.device))
            new = DispatchHandle(route, n, n_recv, K, ti, tw, items)
        else:
            n_recv = handle.num_recv_tokens
        L = res.num_local_experts
        idx_dtype = topk_idx.dtype if topk_idx is not None else torch.int64
        recv_x = _view(torch, res.recv_x, (n_recv, H), x.dtype, self, self.device)
        recv_scales = None
        if x_scales is not None:
            recv_scales = _view(torch, res.recv_x_scales, (n_recv, H // _lib.SCALE_BLOCK), torch.float32, self,
                                self.device)
        recv_idx = recv_w = None
        if handle is None and topk_idx is not None:
            recv_idx = _view(torch, res.recv_topk_idx, (n_recv, K), idx_dtype, self, self.device)
            recv_w = _view(torch, res.recv_topk_weights, (n_recv, K), torch.float32, self, self.device)

        outs = [recv_x, recv_scales, recv_idx, recv_w]
        if copy or (copy is None and (self.copy_outputs or (num_worst_tokens and handle is None))):
            with self._alloc_stream(allocate_on_comm_stream):
                owned = [torch.empty_like(t) if t is not None else None for t in outs]
            with torch.cuda.stream(self.comm_stream):
                for o, t in zip(owned, outs):
                    if o is not None:
                        o.copy_(t)
                if num_worst_tokens and recv_idx is not None:
                    # Rows past the real count hold stale data: as DeepEP,
                    # they name no expert.
                    n_dev = _view(torch, res.num_recv_tokens_dev, (1,), torch.int32, self, self.device)
                    pad = (torch.arange(n_recv, device=self.device) >= n_dev).unsqueeze(1)
                    owned[2].masked_fill_(pad, -1)
                    owned[3].masked_fill_(pad, 0)
            outs = owned
        counts = []
        if handle is None and res.num_recv_tokens_per_expert:
            counts = [res.num_recv_tokens_per_expert[i] for i in range(L)]
        return {"outs": outs, "counts": counts, "handle": new, "max_total": res.max_total_tokens}

    def _round_order(self, handles):
        """For rounds' handles: rows per (round, source) on the host and the
        gather index that puts the rounds' rows into DeepEP's order (source
        ranks in order, each source's tokens in order)."""
        torch = _torch()
        R, me = self.group_size, self.rank
        # The notify of each round has finished (the host waited for its
        # counts), so its prefix matrix can be read without a stream wait.
        cols = torch.stack([h[0][:, me] for h in handles]).cpu().tolist()  # inclusive prefix per round
        per = [[c[s] - (c[s - 1] if s else 0) for s in range(R)] for c in cols]  # [round][source]
        starts, pos = [], 0
        for c in cols:
            starts.append(pos)
            pos += c[R - 1] if R else 0
        order = []
        for s in range(R):
            for j, c in enumerate(cols):
                b = starts[j] + (c[s - 1] if s else 0)
                order.append((b, per[j][s]))
        idx = torch.cat([torch.arange(b, b + n, dtype=torch.int64) for b, n in order]) if order else \
            torch.empty(0, dtype=torch.int64)
        return per, idx.to(self.device)

    def _dispatch_rounds(self, compute, first, x, x_scales, T, C, is_token_in_rank, topk_idx, topk_weights,
                         expert_alignment, K, async_finish, allocate_on_comm_stream, per_expert):
        torch = _torch()
        ep = self._ep
        rounds = (first["max_total"] + C - 1) // C
        parts = [first]
        if not self.copy_outputs:
            # The first round's outputs are views of the buffer the next round overwrites.
            with self._alloc_stream(allocate_on_comm_stream):
                owned = [torch.empty_like(t) if t is not None else None for t in first["outs"]]
            with torch.cuda.stream(self.comm_stream):
                for o, t in zip(owned, first["outs"]):
                    if o is not None:
                        o.copy_(t)
            first["outs"] = owned
        for j in range(1, rounds):
            t0, t1 = min(j * C, T), min((j + 1) * C, T)
            parts.append(self._dispatch_call(ep, x, x_scales, t0, t1, T, is_token_in_rank, topk_idx, topk_weights,
                                             None, 1, 0, None, K, allocate_on_comm_stream, copy=True))
        handles = [p["handle"] for p in parts]
        per, order = self._round_order(handles)
        with self._alloc_stream(allocate_on_comm_stream):
            outs = [torch.empty((order.numel(),) + tuple(t.shape[1:]), dtype=t.dtype, device=self.device)
                    if t is not None else None for t in first["outs"]]
        with torch.cuda.stream(self.comm_stream):
            for i, o in enumerate(outs):
                if o is not None:
                    torch.index_select(_raw(torch, torch.cat([p["outs"][i] for p in parts])), 0, order,
                                       out=_raw(torch, o))
            srcs = []
            for j, h in enumerate(handles):  # source token indices of the whole dispatch
                srcs.append(h[3] + j * C)
            src = torch.cat(srcs).index_select(0, order)
            prefix = sum(h[0] for h in handles)
            send_head = torch.cat([h[5] for h in handles])
        for t in (src, prefix, send_head):
            _record(t, compute)
        if per_expert is not None:
            counts = first["counts"]  # the callers' totals, summed over ranks by the first round
        else:
            counts = [sum(p["counts"][e] for p in parts) for e in range(len(first["counts"]))]
            if expert_alignment > 1:
                counts = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in counts]
        n_recv = int(order.numel())
        items = (prefix, None, None, src, is_token_in_rank, send_head)
        new = DispatchHandle(handles[0]._route, T, n_recv, K, topk_idx, topk_weights, items)
        new.rounds = [(h, min(j * C, T), min((j + 1) * C, T)) for j, h in enumerate(handles)]
        new.round_index = _inverse_rounds(torch, order, [sum(r) for r in per])
        event = self._finish(compute, self.comm_stream, async_finish, allocate_on_comm_stream,
                             [x, x_scales, topk_idx, topk_weights, is_token_in_rank, per_expert] + outs)
        recv_x, recv_scales, recv_idx, recv_w = outs
        rx = (recv_x, recv_scales) if x_scales is not None else recv_x
        return rx, recv_idx, recv_w, counts, new, event

    def _cached_rounds(self, x, x_scales, handle, allocate_on_comm_stream):
        """A cached dispatch of a dispatch that ran in rounds."""
        torch = _torch()
        # Each round resends its slice of the top-k (moeep_dispatch checks
        # that it matches the round's handle).
        parts = [self._dispatch_call(self._ep, x, x_scales, t0, t1, handle.num_tokens, None, handle.topk_idx,
                                     handle.topk_weights, None, 1, 0, h, handle.num_topk, allocate_on_comm_stream,
                                     copy=True)
                 for (h, t0, t1) in handle.rounds]
        keep = [i for i in (0, 1) if parts[0]["outs"][i] is not None]
        with self._alloc_stream(allocate_on_comm_stream):
            outs = [torch.empty((handle.num_recv_tokens,) + tuple(parts[0]["outs"][i].shape[1:]),
                                dtype=parts[0]["outs"][i].dtype, device=self.device) for i in keep]
        with torch.cuda.stream(self.comm_stream):
            order = torch.cat(handle.round_index)  # round rows (concatenated) -> output rows
            for i, o in zip(keep, outs):
                _raw(torch, o).index_copy_(0, order, _raw(torch, torch.cat([p["outs"][i] for p in parts])))
        return outs

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """Sends the received rows back and sums them per token: returns
        (combined_x bf16 [tokens, hidden], combined_topk_weights or None,
        event). bias (a tensor or a pair) is added to combined_x."""
        torch = _torch()
        if not isinstance(handle, DispatchHandle) or handle._buffer() is not self or not handle.ptr:
            raise ValueError("handle is not a live dispatch handle of this Buffer")
        ep = self._endpoint()
        H = self._plan.hidden
        _check_tensor(torch, x, "x", torch.bfloat16, self.device, (handle.num_recv_tokens, H))
        K = 0
        if topk_weights is not None:
            if topk_weights.dim() != 2 or topk_weights.shape[0] != handle.num_recv_tokens:
                raise ValueError("topk_weights must be [%d, num_topk], not %s" %
                                 (handle.num_recv_tokens, list(topk_weights.shape)))
            K = topk_weights.shape[1]
            _check_tensor(torch, topk_weights, "topk_weights", torch.float32, self.device,
                          (handle.num_recv_tokens, K))
        biases = () if bias is None else (bias if isinstance(bias, (tuple, list)) else (bias,))
        for b in biases:
            if b is not None:
                _check_tensor(torch, b, "bias", torch.bfloat16, self.device, (handle.num_tokens, H))
        self._apply_num_sms(config)
        compute = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_stream(allocate_on_comm_stream):
            out = torch.empty(handle.num_tokens, H, dtype=torch.bfloat16, device=self.device)
            out_w = torch.empty(handle.num_tokens, K, dtype=torch.float32, device=self.device) if K else None
        if handle.rounds is None:
            pieces = [(handle, x, topk_weights, 0, handle.num_tokens)]
        else:
            # Each round's rows, gathered from DeepEP's order, go back by the
            # round's own routing into that round's tokens of out.
            with torch.cuda.stream(self.comm_stream):
                pieces = [(h, x.index_select(0, ix), topk_weights.index_select(0, ix) if K else None, t0, t1)
                          for (h, t0, t1), ix in zip(handle.rounds, handle.round_index)]
        for h, xr, wr, t0, t1 in pieces:
            args = _lib.CombineArgs(x=xr.data_ptr() if xr.numel() else None,
                                    topk_weights=wr.data_ptr() if K and wr.numel() else None, num_topk=K,
                                    handle=h.ptr, out=out[t0:t1].data_ptr() if t1 > t0 else None,
                                    out_topk_weights=out_w[t0:t1].data_ptr() if out_w is not None and t1 > t0
                                    else None)
            ep.check(ep.lib.moeep_combine(ep.ptr, ctypes.byref(args), self.comm_stream.cuda_stream), "combine")
        if any(b is not None for b in biases):
            with torch.cuda.stream(self.comm_stream):
                for b in biases:
                    if b is not None:
                        out.add_(b)
        event = self._finish(compute, self.comm_stream, async_finish, allocate_on_comm_stream,
                             [x, topk_weights, out, out_w] + [p[1] for p in pieces] + [p[2] for p in pieces] +
                             [b for b in biases if b is not None])
        return out, out_w, event

    # ------------------------------------------------------------ low-latency mode

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Resets the low-latency counters (collective). No-op before the
        endpoint exists."""
        if not self.low_latency_mode:
            raise ValueError("clean_low_latency_buffer needs low_latency_mode=True")
        if self._ep is not None:
            self._ep.check(self._ep.lib.moeep_ll_clean(self._ep.ptr), "clean_low_latency_buffer")

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        """Decode dispatch into per-expert slots. Returns (recv_x, recv_count,
        handle, event, hook) as DeepEP: recv_x is bf16 [local experts,
        ranks * num_max_dispatch_tokens_per_rank, hidden] or, with use_fp8,
        (e4m3 tensor of that shape, float32 scales [.., .., hidden / 128]);
        with use_ue8m0 the scales are int32 [.., .., hidden / 512], four
        UE8M0 exponents each, in DeepEP's layout. The tensors are views into
        moeep's buffer set (README: lifetimes)."""
        torch = _torch()
        if not self.low_latency_mode:
            raise ValueError("low_latency_dispatch needs Buffer(..., low_latency_mode=True)")
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True (power-of-two scales)")
        if round_scale and not use_fp8:
            raise ValueError("round_scale needs use_fp8=True")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as DeepEP)")
        _check_tensor(torch, x, "x", torch.bfloat16, self.device)
        T, H = x.shape
        if use_ue8m0 and H % 512:
            raise ValueError("use_ue8m0 needs hidden divisible by 512, not %d" % H)
        _check_index(torch, topk_idx, "topk_idx", self.device, rows=T)
        K = topk_idx.shape[1]
        ep = self._endpoint(hidden=H, num_experts=num_experts, ll_tokens=num_max_dispatch_tokens_per_rank)
        ll_max = self._plan.ll_max_tokens
        if not 1 <= num_max_dispatch_tokens_per_rank <= ll_max:
            raise ValueError("num_max_dispatch_tokens_per_rank %d is outside 1..%d, what this Buffer was "
                             "created for (Buffer(..., num_max_dispatch_tokens_per_rank=))" %
                             (num_max_dispatch_tokens_per_rank, ll_max))
        if T > num_max_dispatch_tokens_per_rank:
            raise ValueError("x has %d tokens, more than num_max_dispatch_tokens_per_rank %d" %
                             (T, num_max_dispatch_tokens_per_rank))
        L = self._plan.num_experts // self.group_size
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            _check_tensor(torch, stats, "cumulative_local_expert_recv_stats", torch.int32, self.device, (L,))

        compute = torch.cuda.current_stream(self.device)
        stream = compute if return_recv_hook else self.comm_stream
        if not return_recv_hook:
            stream.wait_stream(compute)
        args = _lib.LlDispatchArgs(x=x.data_ptr() if T else None, num_tokens=T,
                                   topk_idx=topk_idx.data_ptr() if T else None,
                                   topk_idx_type=_index_type(torch, topk_idx), num_topk=K, use_fp8=use_fp8,
                                   round_scale=round_scale, return_recv_hook=return_recv_hook,
                                   cumulative_local_expert_recv_stats=stats.data_ptr() if stats is not None
                                   else None, num_max_tokens=num_max_dispatch_tokens_per_rank)
        res = _lib.LlDispatchResult()
        hook = _lib.LlHook()
        ep.check(ep.lib.moeep_ll_dispatch(ep.ptr, ctypes.byref(args), ctypes.byref(res), ctypes.byref(hook),
                                          stream.cuda_stream), "low_latency_dispatch")
        S = res.slots_per_expert  # ranks * num_max_dispatch_tokens_per_rank
        R = self.group_size
        xdt = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        recv_x = _view(torch, res.recv_x, (L, S, H), xdt, self, self.device)
        recv_count = _view(torch, res.recv_count, (L,), torch.int32, self, self.device)
        src_info = _view(torch, res.recv_src_info, (L, S), torch.int32, self, self.device)
        layout_range = _view(torch, res.layout_range, (L, R), torch.int64, self, self.device)
        scales = packed = None
        if use_fp8:
            # Column-major per expert, as DeepEP: [L][scale][slot] in memory.
            scales = _view(torch, res.recv_x_scales, (L, H // _lib.SCALE_BLOCK, S), torch.float32, self,
                           self.device).transpose(1, 2)
        if use_ue8m0:
            # Allocated on the compute stream, which reads it (as DeepEP's outputs).
            packed = torch.empty(L, H // 512, S, dtype=torch.int32, device=self.device).transpose(1, 2)
            if not return_recv_hook:
                with torch.cuda.stream(stream):
                    _pack_ue8m0(scales, packed)
        llh = _lib.LlHandle(res.handle.set, res.handle.num_tokens, res.handle.slots_per_expert)
        handle = LowLatencyHandle(src_info, layout_range, num_max_dispatch_tokens_per_rank, H, num_experts, llh,
                                  id(self), res.combine_buffer)
        keep = [x, topk_idx, stats, packed]
        event = self._finish(compute, stream, async_finish, False, keep if async_finish else [])
        fn = None
        if return_recv_hook:
            def fn():
                self._ep.check(self._ep.lib.moeep_ll_hook_run(self._ep.ptr, ctypes.byref(hook), stream.cuda_stream),
                               "low-latency dispatch receive hook")
                if packed is not None:
                    with torch.cuda.stream(stream):
                        _pack_ue8m0(scales, packed)
                del keep[:]
        rx = recv_x
        if use_fp8:
            rx = (recv_x, packed if use_ue8m0 else scales)
        return rx, recv_count, handle, event, fn

    def get_next_low_latency_combine_buffer(self, handle):
        """The bf16 [local experts, slots, hidden] buffer that
        low_latency_combine(..., zero_copy=True) reads the expert outputs
        from: write them there instead of passing x. It overlays the
        dispatch's received rows (as DeepEP's, valid until the next dispatch
        on the same buffer set)."""
        if not isinstance(handle, LowLatencyHandle) or handle.buffer_id != id(self):
            raise ValueError("handle is not a low-latency handle of this Buffer")
        torch = _torch()
        L = self._plan.num_experts // self.group_size
        return _view(torch, handle.combine_buffer, (L, handle.ll_handle.slots_per_expert, self._plan.hidden),
                     torch.bfloat16, self, self.device)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        """Sends expert outputs x (bf16 [local experts, slots, hidden], the
        dispatch's layout) back and reduces them with the top-k weights.
        Returns (combined_x bf16 [tokens, hidden], event, hook). With
        zero_copy the outputs are read from get_next_low_latency_combine_buffer
        (x is not read). use_logfmt changes nothing (BF16 on the wire);
        combine_wait_recv_cost_stats is accepted and left as is."""
        torch = _torch()
        if not self.low_latency_mode:
            raise ValueError("low_latency_combine needs Buffer(..., low_latency_mode=True)")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as DeepEP)")
        if not isinstance(handle, LowLatencyHandle) or handle.buffer_id != id(self):
            raise ValueError("handle is not a low-latency handle of this Buffer")
        ep = self._endpoint()
        H, L = self._plan.hidden, self._plan.num_experts // self.group_size
        S = handle.ll_handle.slots_per_expert
        n = S
        T = handle.ll_handle.num_tokens
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        _check_index(torch, topk_idx, "topk_idx", self.device, rows=T)
        K = topk_idx.shape[1]
        _check_tensor(torch, topk_weights, "topk_weights", torch.float32, self.device, (T, K))
        if x.dtype != torch.bfloat16 or x.dim() != 3 or tuple(x.shape[::2]) != (L, H) or x.shape[1] not in (n, S) \
                or x.device != self.device:
            raise ValueError("x must be bf16 [%d, %d, %d] on %s, not %s %s" %
                             (L, n, H, self.device, x.dtype, list(x.shape)))
        if out is not None:
            _check_tensor(torch, out, "out", torch.bfloat16, self.device, (T, H))
        compute = torch.cuda.current_stream(self.device)
        stream = compute if return_recv_hook else self.comm_stream
        if not return_recv_hook:
            stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            if x.stride() != (S * H, H, 1):
                # moeep reads slots with the dispatch's stride: stage.
                staged = torch.empty(L, S, H, dtype=torch.bfloat16, device=self.device)
                staged.copy_(x)
                x = staged
        if out is None:
            out = torch.empty(T, H, dtype=torch.bfloat16, device=self.device)
        llh = _lib.LlHandle(handle.ll_handle.set, T, S)
        args = _lib.LlCombineArgs(x=x.data_ptr(), topk_idx=topk_idx.data_ptr() if T else None,
                                  topk_idx_type=_index_type(torch, topk_idx),
                                  topk_weights=topk_weights.data_ptr() if T else None, num_topk=K,
                                  handle=ctypes.pointer(llh), out=out.data_ptr() if T else None,
                                  return_recv_hook=return_recv_hook)
        hook = _lib.LlHook()
        ep.check(ep.lib.moeep_ll_combine(ep.ptr, ctypes.byref(args), ctypes.byref(hook), stream.cuda_stream),
                 "low_latency_combine")
        keep = [x, topk_idx, topk_weights, out, llh]
        event = self._finish(compute, stream, async_finish, False, keep[:4] if async_finish else [])
        fn = None
        if return_recv_hook:
            def fn():
                self._ep.check(self._ep.lib.moeep_ll_hook_run(self._ep.ptr, ctypes.byref(hook), stream.cuda_stream),
                               "low-latency combine receive hook")
                del keep[:]
        return out, event, fn


# ---------------------------------------------------------------- helpers

def _raw(torch, t):
    """FP8 rows as bytes, for the index ops (which may lack float8)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _inverse_rounds(torch, order, sizes):
    """Splits `order` (for each output row, its row among the rounds' rows
    concatenated) into, per round, the output rows holding that round's rows
    in the round's own order."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return list(torch.split(inv, sizes))


def _gpu_uuid(torch, device):
    try:
        u = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return None
    u = u if u.startswith("GPU-") else "GPU-" + u
    return u if len(u) <= 64 and u.isprintable() else None


def _record(t, stream):
    try:
        t.record_stream(stream)
    except RuntimeError:
        pass  # not from the caching allocator (a view into moeep's buffer)


def _check_tensor(torch, t, name, dtypes, device, shape=None, need_contiguous=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s must be a torch.Tensor, not %s" % (name, type(t).__name__))
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        raise TypeError("%s must be %s, not %s" % (name, " or ".join(map(str, dtypes)), t.dtype))
    if t.device != device:
        raise ValueError("%s is on %s, this Buffer on %s" % (name, t.device, device))
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError("%s must have shape %s, not %s" % (name, list(shape), list(t.shape)))
    if shape is None and t.dim() != 2:
        raise ValueError("%s must be 2-D, not %s" % (name, list(t.shape)))
    if need_contiguous and not t.is_contiguous():
        raise ValueError("%s must be contiguous" % name)


def _check_index(torch, t, name, device, rows=None):
    _check_tensor(torch, t, name, (torch.int64, torch.int32), device)
    if rows is not None and t.shape[0] != rows:
        raise ValueError("%s has %d rows, x has %d" % (name, t.shape[0], rows))
    if not 1 <= t.shape[1] <= _lib.MAX_TOPK:
        raise ValueError("%s has top-k %d; moeep supports 1..%d" % (name, t.shape[1], _lib.MAX_TOPK))


def _index_type(torch, t):
    return _lib.INDEX_INT64 if t.dtype == torch.int64 else _lib.INDEX_INT32


def _split_x(torch, x, device):
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError("FP8 x must be a pair (e4m3 tensor, float32 scales)")
        x, scales = x
        _check_tensor(torch, x, "x", torch.float8_e4m3fn, device)
        if x.shape[1] % _lib.SCALE_BLOCK:
            raise ValueError("FP8 hidden %d is not a multiple of %d" % (x.shape[1], _lib.SCALE_BLOCK))
        # Scales may come column-major (DeepEP's TMA-aligned layout,
        # x[1].T.contiguous().T): dispatch makes a row-major copy on its stream.
        _check_tensor(torch, scales, "x scales", torch.float32, device,
                      (x.shape[0], x.shape[1] // _lib.SCALE_BLOCK), need_contiguous=False)
        return x, scales
    _check_tensor(torch, x, "x", torch.bfloat16, device)
    return x, None


def _torch_layout(torch, topk_idx, num_experts, num_ranks, per_rank, per_expert, in_rank):
    """get_dispatch_layout in torch ops (no host synchronisation)."""
    idx = topk_idx.long()
    valid = idx >= 0
    e = torch.where(valid, idx, torch.full_like(idx, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    counts.index_add_(0, e.flatten(), torch.ones_like(e.flatten()))
    per_expert.copy_(counts[:num_experts])
    r = torch.where(valid, idx // (num_experts // num_ranks), torch.full_like(idx, num_ranks))
    hit = torch.zeros(idx.shape[0], num_ranks + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(1, r, True)
    in_rank.copy_(hit[:, :num_ranks])
    per_rank.copy_(in_rank.sum(0))


def _pack_ue8m0(scales, packed):
    """Power-of-two float scales [L, n, H/128] -> UE8M0 bytes (the float's
    exponent field), four per int32, little-endian, into packed [L, n, H/512]."""
    torch = _torch()
    e = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    e = e.view(e.shape[0], e.shape[1], -1, 4)
    packed.copy_(e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24))
