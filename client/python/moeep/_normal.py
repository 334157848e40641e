"""moeep.Buffer's normal mode (part of moeep.buffer): get_dispatch_layout,
dispatch (also cached, and in rounds when it is larger than one call holds)
and combine, as DeepEP's intranode calls. A mixin of Buffer, which owns the
endpoint, the streams and the plan that these methods use."""

import ctypes

from . import _lib
from ._handles import DispatchHandle, _Route
from ._tensors import _check_index, _check_tensor, _index_type, _record, _view
from .event import _as_binding, _torch


class _NormalMode:
    """Buffer's normal-mode calls. They use what Buffer sets up: _ep and
    _endpoint(), _plan, device, group_size, rank, copy_outputs, _areas,
    _handles, the reused ctypes structures (_dispatch_args, _combine_args),
    _apply_num_sms(), _begin(), _on(), _finish(), _alloc_stream()."""

    @_as_binding
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
        compute, side, ptr = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_stream(allocate_on_comm_stream):
            per_rank = torch.empty(R, dtype=torch.int32, device=self.device)
            per_expert = torch.empty(num_experts, dtype=torch.int32, device=self.device)
            in_rank = torch.empty(T, R, dtype=torch.bool, device=self.device)
        if self._ep is not None:
            ep = self._ep
            ep.check(ep.lib.moeep_get_dispatch_layout(
                ep.ptr, topk_idx.data_ptr(), _index_type(torch, topk_idx), T, K, per_rank.data_ptr(),
                per_expert.data_ptr(), in_rank.data_ptr(), ptr), "get_dispatch_layout")
        else:
            with self._on(side):
                _torch_layout(torch, topk_idx, num_experts, R, per_rank, per_expert, in_rank)
        event = self._finish(compute, side, allocate_on_comm_stream, [topk_idx, per_rank, per_expert, in_rank])
        return per_rank, None, per_expert, in_rank, event

    @_as_binding
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """Sends each token to the ranks of its experts. Returns (recv_x,
        recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event) as DeepEP; recv_x is (fp8, scales) for an FP8 input.
        With a handle (cached): (recv_x, None, None, None, None, event).
        The outputs are views of a receive area of moeep's buffer that stays
        theirs for as long as any of them lives, or owned copies when only
        one area is free (README: output lifetimes)."""
        torch = _torch()
        x, x_scales, scale_cols = _split_x(torch, x, self.device)
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
        if topk_idx is not None and handle is None:
            _check_index(torch, topk_idx, "topk_idx", self.device, rows=T)
            if topk_weights is not None:
                _check_tensor(torch, topk_weights, "topk_weights", torch.float32, self.device, topk_idx.shape)
        elif topk_weights is not None and topk_idx is None:
            raise ValueError("topk_weights needs topk_idx")
        if is_token_in_rank is not None and handle is None:
            _check_tensor(torch, is_token_in_rank, "is_token_in_rank", (torch.bool, torch.uint8), self.device,
                          (T, self.group_size))
        if handle is None and topk_idx is None and is_token_in_rank is None:
            raise ValueError("dispatch needs a handle, or is_token_in_rank / topk_idx (get_dispatch_layout)")
        if expert_alignment.__class__ is not int or expert_alignment < 0:
            raise ValueError("expert_alignment must be a non-negative int, not %r" % (expert_alignment,))
        if num_worst_tokens.__class__ is not int or num_worst_tokens < 0:
            raise ValueError("num_worst_tokens must be a non-negative int, not %r" % (num_worst_tokens,))
        ep = self._endpoint(hidden=H, num_experts=num_experts)
        self._apply_num_sms(config)
        K = topk_idx.shape[1] if topk_idx is not None else 0

        compute, side, ptr = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        per_expert = None
        if scale_cols is not None or (num_tokens_per_expert is not None and handle is None):
            with self._on(side):
                if scale_cols is not None:
                    x_scales = _pad_scales(torch, x_scales, H // _lib.SCALE_BLOCK)
                if num_tokens_per_expert is not None and handle is None:
                    # DeepEP sums the callers' per-expert counts (also when no
                    # top-k travels), so moeep's notify does too.
                    per_expert = num_tokens_per_expert.to(torch.int32).contiguous()
        call = (ep, side, ptr, allocate_on_comm_stream, scale_cols)
        if handle is not None and handle.rounds is not None:
            outs = self._cached_rounds(call, x, x_scales, handle)
            event = self._finish(compute, side, allocate_on_comm_stream, [x, x_scales] + outs)
            return (tuple(outs) if x_scales is not None else outs[0]), None, None, None, None, event
        C = self._plan.max_tokens_per_rank  # rows per source per call: what the NVLink buffer holds
        if T > C and (handle is not None or num_worst_tokens):
            raise ValueError("%d tokens are more than the %d per call this Buffer holds; only a fresh dispatch "
                             "without num_worst_tokens runs in rounds" % (T, C))
        one = self._dispatch_call(call, x, x_scales, 0, min(T, C), T, is_token_in_rank, topk_idx, topk_weights,
                                  per_expert, expert_alignment, num_worst_tokens, handle, K)
        if handle is None and one["max_total"] > C:
            # Some rank sends more tokens than one call holds: every rank runs
            # the same number of rounds of C tokens (DeepEP has no cap).
            return self._dispatch_rounds(call, compute, one, x, x_scales, T, C, is_token_in_rank, topk_idx,
                                         topk_weights, expert_alignment, K, per_expert)
        outs = one["outs"]
        event = self._finish(compute, side, allocate_on_comm_stream,
                             [x, x_scales, topk_idx, topk_weights, is_token_in_rank, per_expert] + outs)
        recv_x, recv_scales, recv_idx, recv_w = outs
        rx = (recv_x, recv_scales) if x_scales is not None else recv_x
        if handle is not None:
            return rx, None, None, None, None, event
        return rx, recv_idx, recv_w, one["counts"], one["handle"], event

    def _dispatch_call(self, call, x, x_scales, t0, t1, total, is_token_in_rank, topk_idx, topk_weights, per_expert,
                       expert_alignment, num_worst_tokens, handle, K, rows=None):
        """One moeep_dispatch of tokens t0..t1 (a round of a dispatch of
        `total` tokens, or all of it), on the call's stream, into a free
        receive area. rows: None, the rows are views of the area when
        another area stays free for the next dispatch, else owned copies;
        "owned": owned copies whatever the areas say; "area": every output
        (the top-k too) a view of the area, even the last free one (a round,
        whose rows leave the area before the dispatch returns)."""
        torch = _torch()
        ep, side, ptr, allocate_on_comm_stream, scale_cols = call
        H = x.shape[1]
        n = t1 - t0
        whole = t0 == 0 and t1 == x.shape[0]
        xs = x if whole else x[t0:t1]
        sc = x_scales if whole or x_scales is None else x_scales[t0:t1]
        ti = topk_idx if whole or topk_idx is None else topk_idx[t0:t1]
        tw = topk_weights if whole or topk_weights is None else topk_weights[t0:t1]
        ir = None
        if is_token_in_rank is not None and handle is None:
            ir = is_token_in_rank if whole else is_token_in_rank[t0:t1]
        area, views = self._areas.pick(torch.cuda.is_current_stream_capturing())
        views = rows == "area" or (views and rows != "owned" and not self.copy_outputs)
        args = self._dispatch_args
        args.x = xs.data_ptr() if n else None
        args.x_type = _lib.DTYPE_BF16 if sc is None else _lib.DTYPE_FP8_E4M3
        args.x_scales = sc.data_ptr() if sc is not None and n else None
        # DeepEP's callers pass FP8 scales column-major (x[1].T.contiguous().T): read in place.
        args.x_scales_token_stride, args.x_scales_block_stride = sc.stride() if sc is not None and n else (0, 0)
        args.num_tokens = n
        args.is_token_in_rank = ir.data_ptr() if ir is not None and n else None
        args.topk_idx = ti.data_ptr() if ti is not None and n else None
        args.topk_idx_type = _index_type(torch, topk_idx) if topk_idx is not None else _lib.INDEX_INT64
        args.topk_weights = tw.data_ptr() if tw is not None and n else None
        args.num_topk = K
        args.expert_alignment = expert_alignment
        args.num_worst_tokens = num_worst_tokens
        args.handle = handle.ptr if handle is not None else None
        args.num_tokens_per_expert = per_expert.data_ptr() if per_expert is not None else None
        args.total_tokens = total
        args.recv_area = area
        res = self._dispatch_res
        ep.check(ep.lib.moeep_dispatch(ep.ptr, self._dispatch_args_ref, self._dispatch_res_ref, ptr), "dispatch")
        new = None
        if handle is None:
            n_recv = res.num_recv_tokens if res.num_recv_tokens >= 0 else num_worst_tokens
            route = _Route(self, res.handle)
            self._handles.add(route)
            new = DispatchHandle(route, n, n_recv, K, ti, tw,
                                 self._handle_items(route, res.rank_prefix_matrix, res.recv_src_info, res.send_pos,
                                                    n, n_recv, ir))
        else:
            n_recv = handle.num_recv_tokens
        L = res.num_local_experts
        has_topk = handle is None and topk_idx is not None
        idx_dtype = topk_idx.dtype if topk_idx is not None else torch.int64
        # The top-k ids and weights (small, K words a row) never hold the
        # area unless the rows are a round's ("area"): a caller that keeps
        # them, as DeepEP's tests do under other names than recv_x, must not
        # hold it. libmoeep copies them out in one kernel, rows past the
        # real count of a num_worst_tokens dispatch as -1 and 0 (DeepEP's).
        topk_views = has_topk and rows == "area"
        arrays = [("recv_x", (n_recv, H), x.dtype),
                  ("recv_x_scales", (n_recv, H // _lib.SCALE_BLOCK), torch.float32) if x_scales is not None else None,
                  ("recv_topk_idx", (n_recv, K), idx_dtype) if topk_views else None,
                  ("recv_topk_weights", (n_recv, K), torch.float32) if topk_views else None]
        outs = self._areas.views(torch, area, self, self.device, arrays)
        if not views:
            # Owned copies of the rows too when no other area stays free
            # (the area then stays free: the next call on this stream comes
            # after the copies).
            with self._alloc_stream(allocate_on_comm_stream):
                owned = [torch.empty_like(t) if t is not None else None for t in outs[:2]]
            with self._on(side):
                for o, t in zip(owned, outs[:2]):
                    if o is not None:
                        o.copy_(t)
            outs[:2] = owned
        if has_topk and not topk_views:
            with self._alloc_stream(allocate_on_comm_stream):
                outs[2:] = [torch.empty((n_recv, K), dtype=idx_dtype, device=self.device),
                            torch.empty((n_recv, K), dtype=torch.float32, device=self.device)]
            ep.check(ep.lib.moeep_dispatch_copy_topk(ep.ptr, res.handle, area,
                                                     args.topk_idx_type, n_recv, outs[2].data_ptr(),
                                                     outs[3].data_ptr(), ptr), "dispatch's top-k copy")
        if scale_cols is not None:
            # Opaque 4-byte scales rode in the first columns: back in their own dtype.
            with self._alloc_stream(allocate_on_comm_stream):
                own = torch.empty((n_recv, scale_cols[0]), dtype=scale_cols[1], device=self.device)
            with self._on(side):
                own.view(torch.float32).copy_(outs[1][:, :scale_cols[0]])
            outs[1] = own
        counts, per_rank = [], None
        if handle is None and res.num_recv_tokens_per_expert:
            counts = res.num_recv_tokens_per_expert[:L]
            per_rank = res.num_recv_tokens_per_rank[:self.group_size]
        return {"outs": outs, "counts": counts, "per_rank": per_rank, "handle": new, "max_total": res.max_total_tokens}

    def _handle_items(self, route, prefix, src, send_pos, n, n_recv, in_rank):
        """What makes a new handle's DeepEP tuple (DispatchHandle), from the
        addresses this dispatch returned: views of the handle's memory,
        made when first read."""
        torch, R, device = _torch(), self.group_size, self.device
        return lambda: (_view(torch, prefix, (R, R), torch.int32, route, device), None, None,
                        _view(torch, src, (n_recv,), torch.int32, route, device), in_rank,
                        _view(torch, send_pos, (n, R), torch.int32, route, device))

    def _round_index(self, per):
        """For rounds of a dispatch, per[round][source] rows each (from the
        host): per round, the output rows of its rows, and the rows in all.
        A round's rows come by source, each source's in token order; the
        outputs are DeepEP's order, by source, each source's tokens in order
        (its rows of round 0, then of round 1, ...). Runs on the current
        stream."""
        torch = _torch()
        shift, rows, n = _round_table(per)
        table = torch.tensor([shift, rows], dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
        index = torch.arange(n, device=self.device) + torch.repeat_interleave(table[0], table[1], output_size=n)
        return list(torch.split(index, [sum(r) for r in per])), n

    def _dispatch_rounds(self, call, compute, first, x, x_scales, T, C, is_token_in_rank, topk_idx, topk_weights,
                         expert_alignment, K, per_expert):
        """A fresh dispatch of more tokens than one call holds, in rounds of
        C tokens (first: the first round's _dispatch_call). Each round's rows
        stay in its receive area (or in owned copies, where the next round
        needs the last free area) until every round's counts are known, then
        go straight to their places in the outputs."""
        torch = _torch()
        ep, side, ptr, allocate_on_comm_stream, scale_cols = call
        rounds = (first["max_total"] + C - 1) // C
        parts = [first]
        for j in range(1, rounds):
            t0, t1 = min(j * C, T), min((j + 1) * C, T)
            keep = j == rounds - 1 or self._areas.free() > 1
            parts.append(self._dispatch_call(call, x, x_scales, t0, t1, T, is_token_in_rank, topk_idx, topk_weights,
                                             None, 1, 0, None, K, rows="area" if keep else "owned"))
        handles = [p["handle"] for p in parts]
        with self._on(side):
            round_index, n_recv = self._round_index([p["per_rank"] for p in parts])
        with self._alloc_stream(allocate_on_comm_stream):
            outs = [torch.empty((n_recv,) + tuple(t.shape[1:]), dtype=t.dtype, device=self.device)
                    if t is not None else None for t in first["outs"]]
            src = torch.empty(n_recv, dtype=torch.int32, device=self.device)
        with self._on(side):
            for j, (p, ix) in enumerate(zip(parts, round_index)):  # each round's rows straight to their places
                for o, t in zip(outs, p["outs"]):
                    if o is not None:
                        _copy_rows(torch, o, ix, t)
                src.index_copy_(0, ix, handles[j][3] + j * C)  # source token indices of the whole dispatch
            prefix = sum(h[0] for h in handles)
            send_head = torch.cat([h[5] for h in handles])
        if per_expert is not None:
            counts = first["counts"]  # the callers' totals, summed over ranks by the first round
        elif expert_alignment <= 1 or outs[2] is None:
            counts = [sum(p["counts"][e] for p in parts) for e in range(len(first["counts"]))]
        else:
            # The first round's counts came aligned, and an aligned sum is not
            # the sum aligned: count the received ids (waits for the copies).
            with self._on(side):
                counts = [(c + expert_alignment - 1) // expert_alignment * expert_alignment
                          for c in _expert_counts(torch, outs[2], len(first["counts"])).tolist()]
        if side is not None:
            for t in [src, prefix, send_head] + round_index:
                _record(t, compute)
        items = (prefix, None, None, src, is_token_in_rank, send_head)
        new = DispatchHandle(handles[0]._route, T, n_recv, K, topk_idx, topk_weights, items)
        new.rounds = [(h, min(j * C, T), min((j + 1) * C, T)) for j, h in enumerate(handles)]
        new.round_index = round_index
        event = self._finish(compute, side, allocate_on_comm_stream,
                             [x, x_scales, topk_idx, topk_weights, is_token_in_rank, per_expert] + outs)
        recv_x, recv_scales, recv_idx, recv_w = outs
        rx = (recv_x, recv_scales) if x_scales is not None else recv_x
        return rx, recv_idx, recv_w, counts, new, event

    def _cached_rounds(self, call, x, x_scales, handle):
        """A cached dispatch of a dispatch that ran in rounds. The output
        rows of every round are known (handle.round_index): each round's
        rows go from its receive area straight to their places, on the
        call's stream before the next round, whose dispatch may reuse the
        area once the views are gone (as _dispatch_call's copies): a round
        reads its area in place even when it is the last free one."""
        torch = _torch()
        ep, side, ptr, allocate_on_comm_stream, scale_cols = call
        outs, present = None, None
        for (h, t0, t1), ix in zip(handle.rounds, handle.round_index):
            # Each round resends its slice of the top-k (moeep_dispatch
            # checks that it matches the round's handle).
            part = self._dispatch_call(call, x, x_scales, t0, t1, handle.num_tokens, None, handle.topk_idx,
                                       handle.topk_weights, None, 1, 0, h, handle.num_topk, rows="area")["outs"]
            if outs is None:
                present = [i for i in (0, 1) if part[i] is not None]
                with self._alloc_stream(allocate_on_comm_stream):
                    outs = [torch.empty((handle.num_recv_tokens,) + tuple(part[i].shape[1:]), dtype=part[i].dtype,
                                        device=self.device) for i in present]
            with self._on(side):
                for i, o in zip(present, outs):
                    _copy_rows(torch, o, ix, part[i])
            del part  # the area is free for the next round
        return outs

    @_as_binding
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
        compute, side, ptr = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_stream(allocate_on_comm_stream):
            out = torch.empty(handle.num_tokens, H, dtype=torch.bfloat16, device=self.device)
            out_w = torch.empty(handle.num_tokens, K, dtype=torch.float32, device=self.device) if K else None
        if handle.rounds is None:
            pieces = [(handle, x, topk_weights, 0, handle.num_tokens)]
        else:
            # Each round's rows, gathered from DeepEP's order, go back by the
            # round's own routing into that round's tokens of out.
            with self._on(side):
                pieces = [(h, x.index_select(0, ix), topk_weights.index_select(0, ix) if K else None, t0, t1)
                          for (h, t0, t1), ix in zip(handle.rounds, handle.round_index)]
        args = self._combine_args
        for h, xr, wr, t0, t1 in pieces:
            args.x = xr.data_ptr() if xr.numel() else None
            args.topk_weights = wr.data_ptr() if K and wr.numel() else None
            args.num_topk = K
            args.handle = h.ptr
            args.out = out[t0:t1].data_ptr() if t1 > t0 else None
            args.out_topk_weights = out_w[t0:t1].data_ptr() if out_w is not None and t1 > t0 else None
            ep.check(ep.lib.moeep_combine(ep.ptr, self._combine_args_ref, ptr), "combine")
        if biases:
            with self._on(side):
                for b in biases:
                    if b is not None:
                        out.add_(b)
        event = self._finish(compute, side, allocate_on_comm_stream,
                             [x, topk_weights, out, out_w] + [p[1] for p in pieces] + [p[2] for p in pieces] +
                             [b for b in biases if b is not None])
        return out, out_w, event


def _round_table(per):
    """For rounds of per[round][source] rows each, in the rounds' order (by
    round, then source): per (round, source), the shift from a row's place
    among the rounds' rows to its output row in DeepEP's order (by source,
    then round), and the rows; and the rows in all."""
    R = len(per[0]) if per else 0
    at, n = [], 0  # each source's next output row
    for s in range(R):
        at.append(n)
        n += sum(r[s] for r in per)
    shift, rows, row = [], [], 0
    for r in per:
        for s in range(R):
            shift.append(at[s] - row)
            rows.append(r[s])
            at[s] += r[s]
            row += r[s]
    return shift, rows, n


def _copy_rows(torch, dst, index, src):
    """dst[index] = src, row by row. torch's index_copy_ moves a row element
    by element, so the rows go as 8-byte words where both tensors allow it
    (eight bytes per element instead of one or two, and no float8 kernels
    needed), else as bytes."""
    def words(t):
        es = t.element_size()
        return t.stride(-1) == 1 and (t.shape[-1] * es) % 8 == 0 and \
            all(v * es % 8 == 0 for v in t.stride()[:-1] + (t.storage_offset(),))

    word = torch.int64 if words(dst) and words(src) else torch.uint8
    dst.view(word).index_copy_(0, index, src.view(word))


def _split_x(torch, x, device):
    """(x, scales, scale_cols): scale_cols is None for moeep's own FP8 scales
    (float32, one per 128 channels), else (columns, dtype) of scales that
    travel as opaque 4-byte words, as DeepEP's normal mode carries them:
    SGLang's UE8M0 scales on Blackwell are int32 [tokens, hidden / 512],
    four exponent bytes per word. Those ride in the first columns of a
    float32 row of the usual width and come back in their own dtype."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError("FP8 x must be a pair (e4m3 tensor, float32 or int32 scales)")
        x, scales = x
        _check_tensor(torch, x, "x", torch.float8_e4m3fn, device)
        if x.shape[1] % _lib.SCALE_BLOCK:
            raise ValueError("FP8 hidden %d is not a multiple of %d" % (x.shape[1], _lib.SCALE_BLOCK))
        width = x.shape[1] // _lib.SCALE_BLOCK
        # Scales may come column-major (DeepEP's TMA-aligned layout,
        # x[1].T.contiguous().T): dispatch makes a row-major copy on its stream.
        _check_tensor(torch, scales, "x scales", (torch.float32, torch.int32), device, need_contiguous=False)
        rows, cols = scales.shape
        if rows != x.shape[0] or not 1 <= cols <= width:
            raise ValueError("x scales must have shape [%d, %d] (or [%d, 1..%d] of opaque 4-byte scales, "
                             "e.g. int32 UE8M0), not %s" % (x.shape[0], width, x.shape[0], width, list(scales.shape)))
        if scales.dtype == torch.float32 and cols == width:
            return x, scales, None
        return x, scales, (cols, scales.dtype)
    _check_tensor(torch, x, "x", torch.bfloat16, device)
    return x, None, None


def _pad_scales(torch, scales, width):
    """Opaque 4-byte scales [T, cols] into the first columns of a float32
    [T, width] (bit for bit; the kernels only move scale words). Runs on the
    current stream."""
    padded = torch.zeros((scales.shape[0], width), dtype=torch.float32, device=scales.device)
    padded[:, :scales.shape[1]].copy_(scales.contiguous().view(torch.float32))
    return padded


def _expert_counts(torch, ids, n):
    """How many of ids (any shape) name each expert 0..n-1 (-1: none), int64
    on their device, without host synchronisation."""
    ids = ids.flatten().long()
    counts = torch.zeros(n + 1, dtype=torch.int64, device=ids.device)
    counts.index_add_(0, torch.where(ids >= 0, ids, n), torch.ones_like(ids))
    return counts[:n]


def _torch_layout(torch, topk_idx, num_experts, num_ranks, per_rank, per_expert, in_rank):
    """get_dispatch_layout in torch ops (no host synchronisation)."""
    idx = topk_idx.long()
    valid = idx >= 0
    per_expert.copy_(_expert_counts(torch, idx, num_experts))
    r = torch.where(valid, idx // (num_experts // num_ranks), torch.full_like(idx, num_ranks))
    hit = torch.zeros(idx.shape[0], num_ranks + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(1, r, True)
    in_rank.copy_(hit[:, :num_ranks])
    per_rank.copy_(in_rank.sum(0))
