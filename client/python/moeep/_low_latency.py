"""moeep.Buffer's low-latency mode (part of moeep.buffer): decode dispatch
into per-expert slots and combine back, with receive hooks, as DeepEP's
low_latency_* calls. A mixin of Buffer, which owns the endpoint, the
streams and the plan that these methods use."""

import ctypes

from . import _lib
from ._handles import LowLatencyHandle
from ._tensors import _check_index, _check_tensor, _index_type, _view
from .event import EventOverlap, _as_binding, _stream_of, _torch


class _LowLatencyMode:
    """Buffer's low-latency calls. They use what Buffer sets up: _ep and
    _endpoint(), _plan, device, group_size, low_latency_mode, the reused
    ctypes structures (_ll_dispatch_args, _ll_dispatch_res,
    _ll_combine_args, _ll_no_hook_ref), the view cache _ll_views, _begin(),
    _on(), _finish()."""

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
                             return_recv_hook=False, *, active_ranks=None, timeout_us=0):
        """Decode dispatch into per-expert slots. Returns (recv_x, recv_count,
        handle, event, hook) as DeepEP: recv_x is bf16 [local experts,
        ranks * num_max_dispatch_tokens_per_rank, hidden] or, with use_fp8,
        (e4m3 tensor of that shape, float32 scales [.., .., hidden / 128]);
        with use_ue8m0 the scales are int32 [.., .., hidden / 512], four
        UE8M0 exponents each, in DeepEP's layout. The tensors are views into
        moeep's buffer set (README: lifetimes). With enable_shrink,
        active_ranks / timeout_us as Mooncake EP (_shrink.py)."""
        fast = self._fast
        if fast is not None and not (use_ue8m0 or async_finish or return_recv_hook or timeout_us) and \
                active_ranks is None:
            # The common case in C (_fast.py); None: not that case after all.
            ret = fast.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                cumulative_local_expert_recv_stats, use_fp8, round_scale)
            if ret is not None:
                return ret
        return self._low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                          cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
                                          async_finish, return_recv_hook, active_ranks, timeout_us)

    @_as_binding
    def _low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                              cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0, async_finish,
                              return_recv_hook, active_ranks, timeout_us):
        """low_latency_dispatch in Python: every case, and every error."""
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

        active, timeout_us = self._active_ranks_arg(active_ranks, timeout_us)
        # DeepEP runs a call with a hook on the caller's stream; so does
        # _begin every call without async_finish.
        compute, side, ptr = self._begin(None, async_finish, False)
        args = self._ll_dispatch_args
        args.active_ranks = active
        args.timeout_us = timeout_us
        args.x = x.data_ptr() if T else None
        args.num_tokens = T
        args.topk_idx = topk_idx.data_ptr() if T else None
        args.topk_idx_type = _index_type(torch, topk_idx)
        args.num_topk = K
        args.use_fp8 = use_fp8
        args.round_scale = round_scale
        args.return_recv_hook = return_recv_hook
        args.cumulative_local_expert_recv_stats = stats.data_ptr() if stats is not None else None
        args.num_max_tokens = num_max_dispatch_tokens_per_rank
        res = self._ll_dispatch_res
        hook = _lib.LlHook() if return_recv_hook else None
        ep.check(ep.lib.moeep_ll_dispatch(ep.ptr, self._ll_dispatch_args_ref, self._ll_dispatch_res_ref,
                                          ctypes.byref(hook) if hook is not None else self._ll_no_hook_ref, ptr),
                 "low_latency_dispatch")
        S = res.slots_per_expert  # ranks * num_max_dispatch_tokens_per_rank
        recv_x, recv_count, src_info, layout_range, scales = self._ll_outputs(torch, res, L, S, H, use_fp8)
        packed = None
        if use_ue8m0:
            # Allocated on the compute stream, which reads it (as DeepEP's outputs).
            packed = torch.empty(L, H // 512, S, dtype=torch.int32, device=self.device).transpose(1, 2)
            if not return_recv_hook:
                with self._on(side):
                    _pack_ue8m0(scales, packed)
        # The handle depends on the set and the shapes only: made once each.
        key = (res.handle.set, T, S, num_max_dispatch_tokens_per_rank, num_experts)
        handle = self._ll_handles.get(key)
        if handle is None:
            llh = _lib.LlHandle(res.handle.set, res.handle.num_tokens, res.handle.slots_per_expert)
            handle = LowLatencyHandle(src_info, layout_range, num_max_dispatch_tokens_per_rank, H, num_experts, llh,
                                      id(self), res.combine_buffer)
            self._ll_handles[key] = handle
        event = self._finish(compute, side, False, [x, topk_idx, stats, packed, active_ranks]) \
            if side is not None else _NO_EVENT
        fn = None
        if return_recv_hook:
            keep = [x, topk_idx, stats, active_ranks]

            def fn():
                self._ep.check(self._ep.lib.moeep_ll_hook_run(self._ep.ptr, ctypes.byref(hook), ptr),
                               "low-latency dispatch receive hook")
                if packed is not None:
                    with torch.cuda.stream(_stream_of(torch, ptr, self.device)):  # the hook's stream
                        _pack_ue8m0(scales, packed)
                del keep[:]
        rx = (recv_x, scales) if use_fp8 else recv_x
        if self._fast is not None and T:
            # The same views and handle for the next dispatches into this set.
            self._fast.remember(res.handle.set, num_max_dispatch_tokens_per_rank, T, use_fp8, rx, recv_count, handle)
        if use_ue8m0:
            rx = (recv_x, packed)
        return rx, recv_count, handle, event, fn

    def _ll_outputs(self, torch, res, L, S, H, use_fp8):
        """The views of a dispatch's outputs in its buffer set: the same
        memory for the same set and shape every time, so made once."""
        key = (res.handle.set, S, use_fp8)
        views = self._ll_views.get(key)
        if views is None:
            # Held by the endpoint, not the Buffer: the cache must not keep
            # the Buffer alive (it is freed, and destroyed, when dropped).
            ep = self._ep
            xdt = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
            scales = None
            if use_fp8:
                # Column-major per expert, as DeepEP: [L][scale][slot] in memory.
                scales = _view(torch, res.recv_x_scales, (L, H // _lib.SCALE_BLOCK, S), torch.float32, ep,
                               self.device).transpose(1, 2)
            views = (_view(torch, res.recv_x, (L, S, H), xdt, ep, self.device),
                     _view(torch, res.recv_count, (L,), torch.int32, ep, self.device),
                     _view(torch, res.recv_src_info, (L, S), torch.int32, ep, self.device),
                     _view(torch, res.layout_range, (L, self.group_size), torch.int64, ep, self.device), scales)
            self._ll_views[key] = views
        return views

    @_as_binding
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
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None,
                            *, active_ranks=None, timeout_us=0):
        """Sends expert outputs x (bf16 [local experts, slots, hidden], the
        dispatch's layout) back and reduces them with the top-k weights.
        Returns (combined_x bf16 [tokens, hidden], event, hook). With
        zero_copy the outputs are read from get_next_low_latency_combine_buffer
        (x is not read). use_logfmt changes nothing (BF16 on the wire);
        combine_wait_recv_cost_stats is accepted and left as is. With
        enable_shrink, active_ranks / timeout_us as Mooncake EP (_shrink.py)."""
        fast = self._fast
        if fast is not None and not (async_finish or return_recv_hook or timeout_us) and active_ranks is None:
            ret = fast.combine(x, topk_idx, topk_weights, handle, zero_copy, out)  # as in low_latency_dispatch
            if ret is not None:
                return ret
        return self._low_latency_combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                         return_recv_hook, out, active_ranks, timeout_us)

    @_as_binding
    def _low_latency_combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out,
                             active_ranks, timeout_us):
        """low_latency_combine in Python: every case, and every error."""
        torch = _torch()
        if not self.low_latency_mode:
            raise ValueError("low_latency_combine needs Buffer(..., low_latency_mode=True)")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as DeepEP)")
        if not isinstance(handle, LowLatencyHandle) or handle.buffer_id != id(self):
            raise ValueError("handle is not a low-latency handle of this Buffer")
        ep = self._endpoint()
        H, L = self._plan.hidden, self._plan.num_experts // self.group_size
        llh = handle.ll_handle
        S, T = llh.slots_per_expert, llh.num_tokens
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        _check_index(torch, topk_idx, "topk_idx", self.device, rows=T)
        K = topk_idx.shape[1]
        _check_tensor(torch, topk_weights, "topk_weights", torch.float32, self.device, (T, K))
        if x.dtype is not torch.bfloat16 or x.dim() != 3 or x.shape[0] != L or x.shape[1] != S or x.shape[2] != H \
                or x.get_device() != self.device.index:
            raise ValueError("x must be bf16 [%d, %d, %d] on %s, not %s %s" %
                             (L, S, H, self.device, x.dtype, list(x.shape)))
        if out is not None:
            _check_tensor(torch, out, "out", torch.bfloat16, self.device, (T, H))
        active, timeout_us = self._active_ranks_arg(active_ranks, timeout_us)
        compute, side, ptr = self._begin(None, async_finish, False)
        if x.stride() != (S * H, H, 1):
            # moeep reads slots with the dispatch's stride: stage.
            with self._on(side):
                staged = torch.empty(L, S, H, dtype=torch.bfloat16, device=self.device)
                staged.copy_(x)
            x = staged
        if out is None:
            out = torch.empty(T, H, dtype=torch.bfloat16, device=self.device)
        args = self._ll_combine_args
        args.active_ranks = active
        args.timeout_us = timeout_us
        args.x = x.data_ptr()
        args.topk_idx = topk_idx.data_ptr() if T else None
        args.topk_idx_type = _index_type(torch, topk_idx)
        args.topk_weights = topk_weights.data_ptr() if T else None
        args.num_topk = K
        args.handle = handle.ll_handle_ptr
        args.out = out.data_ptr() if T else None
        args.return_recv_hook = return_recv_hook
        hook = _lib.LlHook() if return_recv_hook else None
        ep.check(ep.lib.moeep_ll_combine(ep.ptr, self._ll_combine_args_ref,
                                         ctypes.byref(hook) if hook is not None else self._ll_no_hook_ref, ptr),
                 "low_latency_combine")
        event = self._finish(compute, side, False, [x, topk_idx, topk_weights, out, active_ranks]) \
            if side is not None else _NO_EVENT
        fn = None
        if return_recv_hook:
            keep = [x, topk_idx, topk_weights, out, llh, active_ranks]

            def fn():
                self._ep.check(self._ep.lib.moeep_ll_hook_run(self._ep.ptr, ctypes.byref(hook), ptr),
                               "low-latency combine receive hook")
                del keep[:]
        return out, event, fn


# What a call without async_finish returns as its event (DeepEP's
# EventOverlap(None)): the same empty object every time.
_NO_EVENT = EventOverlap(None)


def _pack_ue8m0(scales, packed):
    """Power-of-two float scales [L, n, H/128] -> UE8M0 bytes (the float's
    exponent field), four per int32, little-endian, into packed [L, n, H/512]."""
    torch = _torch()
    e = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    e = e.view(e.shape[0], e.shape[1], -1, 4)
    packed.copy_(e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24))
