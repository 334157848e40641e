#!/usr/bin/env python3
"""DeepEP 1.x's observable semantics of moeep.Buffer, and call sequences of
the engines that use it, on GPUs against torch references: 2 and 4 ranks,
rank i on GPU i % count (ranks may share one GPU), a CPU gloo group for the
test's own collectives, a private moeepd. Written from DeepEP's documented
behaviour; every output is poisoned before the call that fills it.

Normal mode: the handle is DeepEP's tuple, handle[0] the [R, R] inclusive
prefix over source ranks of the rows each rank receives, and the receive
order is grouped by source rank in rank order, each source's tokens in
token order; per-expert receive counts come from the caller's
num_tokens_per_expert even without top-k; FP8 scales are accepted
column-major; previous_event given an EventOverlap without event waits for
the current stream, EventOverlap(EventHandle()) for the recorded point;
cached dispatch; async_finish with current_stream_wait; expert_alignment;
a dispatch larger than the buffer runs in rounds (vLLM's 8192-token
prefill at hidden 7168) with the same results as one call; a dispatch with
num_worst_tokens and its combine captured in a CUDA graph and replayed,
with an eager dispatch held across the replays.
Low-latency mode: the handle (src_info, layout_range, num_max, hidden,
num_experts), src_info the source token, layout_range begin << 32 | count
with each source's tokens together in rank order; FP8 scales column-major;
zero-copy combine through get_next_low_latency_combine_buffer; two
dispatches with only the second combined, one handle combined twice;
hooks; out=; a decode step captured in a CUDA graph and replayed;
clean_low_latency_buffer; one profiled kernel named ...::dispatch and one
...::combine per call. Module names: topk_idx_t, is_sm90_compiled,
Config size hints with FP8 hidden_bytes, moeep.utils.EventHandle.

Exit 77 (meson: skipped) without torch or without a CUDA device.
Environment: MOEEP_LIBRARY, MOEEP_TEST_MOEEPD; MOEEP_TEST_RANKS ("2,4").
"""

import os
import sys
import time

from launch import check, exit_on_failure, free_port, no_cuda, with_moeepd  # first: exits 77 without torch
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import moeep  # noqa: E402
from moeep.utils import EventHandle, EventOverlap  # noqa: E402

POISON_BF16 = float("nan")


def allgather(t, group, R):
    """Every rank's tensor (first dims may differ), on every rank, through
    the CPU."""
    n = torch.tensor([t.shape[0]])
    ns = [torch.zeros_like(n) for _ in range(R)]
    dist.all_gather(ns, n, group=group)
    m = max(int(v.item()) for v in ns)
    c = torch.zeros((m,) + tuple(t.shape[1:]), dtype=t.dtype)
    c[:t.shape[0]] = t.detach().cpu()
    raw = c.view(torch.uint8) if c.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.bool) else c
    outs = [torch.empty_like(raw) for _ in range(R)]
    dist.all_gather(outs, raw.contiguous(), group=group)
    return [o.view(c.dtype)[:int(ns[i].item())].to(t.device) for i, o in enumerate(outs)]


def routing(T, E, K, gen, masked=8):
    scores = torch.rand(T, E, generator=gen, device="cuda") + 1
    idx = torch.topk(scores, K, dim=1).indices.to(moeep.topk_idx_t)
    for _ in range(masked):
        t = int(torch.randint(0, T, (1,), generator=gen, device="cuda").item())
        k = int(torch.randint(0, K, (1,), generator=gen, device="cuda").item())
        idx[t, k] = -1
    w = torch.rand(T, K, generator=gen, device="cuda") + 0.1
    return idx.contiguous(), w.contiguous()


def fp8_cast(x):
    T, H = x.shape
    xv = x.float().view(T, H // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    q = (xv * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(T, H)
    return q, (amax / 448.0).contiguous()


def sim_diff(a, b):
    """1 - cosine-like similarity of two tensors (0 when equal)."""
    a, b = a.double() + 1, b.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def fp8_back(q, s):
    T, H = q.shape
    return (q.float().view(T, H // 128, 128) * s.reshape(T, H // 128, 1)).view(T, H)


def captured(step, group):
    """A CUDA graph of step(), called once first outside the capture (what
    it sets up on first use stays out of the graph), every rank together."""
    step()
    torch.cuda.synchronize()
    dist.barrier(group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def replay_new(graph, group, gen, E, inputs, outs):
    """New tokens and routing copied into the captured (x, topk_idx,
    topk_weights), the outputs poisoned, one replay on every rank together;
    returns the new inputs."""
    x, idx, w = inputs
    new = (torch.randn(x.shape, generator=gen, device="cuda").to(torch.bfloat16),) + \
        routing(x.shape[0], E, idx.shape[1], gen)
    for t, n in zip(inputs, new):
        t.copy_(n)
    for o in outs:
        o.fill_(POISON_BF16)
    torch.cuda.synchronize()
    dist.barrier(group)
    graph.replay()
    torch.cuda.synchronize()
    return new


# ---------------------------------------------------------------- module names

def test_names():
    check(moeep.Buffer.is_sm90_compiled() is True, "Buffer.is_sm90_compiled()")
    check(moeep.topk_idx_t == torch.int64, "topk_idx_t is torch.int64")
    check(moeep.EventOverlap is EventOverlap and moeep.EventHandle is EventHandle, "utils names")
    cfg = moeep.Config(24, 6, 256)
    bf16 = cfg.get_nvl_buffer_size_hint(7168 * 2, 8)
    fp8 = cfg.get_nvl_buffer_size_hint(7168, 8)  # SGLang passes hidden_bytes = hidden for FP8
    check(fp8 > 0 and bf16 > 0, "size hints")
    check(moeep.Buffer.get_dispatch_config(8).num_sms == moeep.Buffer.num_sms, "get_dispatch_config")
    check(moeep.Buffer.get_combine_config(8).num_sms == moeep.Buffer.num_sms, "get_combine_config")


# ---------------------------------------------------------------- normal mode

def reference_receive(all_x, all_in_rank, rank, R):
    """Rows rank receives: source ranks in order, each source's tokens in
    token order; and the [R, R] inclusive prefix matrix."""
    rows, counts = [], torch.zeros(R, R, dtype=torch.int32)
    for s in range(R):
        for d in range(R):
            counts[s, d] = int(all_in_rank[s][:, d].sum().item())
        rows.append(all_x[s][all_in_rank[s][:, rank]])
    return torch.cat(rows), counts.cumsum(0).to(torch.int32)


def test_normal(rank, R, group, sock, gen):
    H, E, K = 2048, 16 * R, 6
    L = E // R
    buf = moeep.Buffer(group, int(1e9), 0, explicitly_destroy=True, socket=sock)
    for T in (300 + 17 * rank, 64):
        x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
        idx, w = routing(T, E, K, gen)
        per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, E)
        check(per_rdma is None, "num_tokens_per_rdma_rank is None")
        all_x, all_idx = allgather(x, group, R), allgather(idx, group, R)
        all_in_rank = allgather(in_rank, group, R)
        ref_rows, ref_prefix = reference_receive(all_x, all_in_rank, rank, R)
        ref_expert = [sum(int((a == rank * L + e).sum().item()) for a in all_idx) for e in range(L)]

        for fmt in ("bf16", "fp8"):
            for with_topk in (False, True):
                for previous in ("none", "empty", "handle"):
                    async_finish = previous != "none"
                    cur = x if fmt == "bf16" else fp8_cast(x)
                    if fmt == "fp8":  # DeepEP's TMA-aligned scales: column-major
                        cur = (cur[0], cur[1].T.contiguous().T)
                    args = dict(x=cur, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, async_finish=async_finish)
                    if with_topk:
                        args.update(topk_idx=idx, topk_weights=w)
                    if previous == "empty":
                        args["previous_event"] = EventOverlap(None)
                    elif previous == "handle":
                        args["previous_event"] = EventOverlap(EventHandle())
                    rx, ridx, rw, counts, handle, event = buf.dispatch(**args)
                    if async_finish:
                        event.current_stream_wait()
                    check(isinstance(handle, tuple) and len(handle) == 6, "handle is a 6-tuple")
                    check(torch.equal(handle[0].cpu(), ref_prefix), "rank_prefix_matrix %s vs %s" %
                          (handle[0].tolist(), ref_prefix.tolist()))
                    check(counts == ref_expert, "per-expert counts %s vs %s (topk %s)" % (counts, ref_expert,
                                                                                         with_topk))
                    got = rx if fmt == "bf16" else fp8_back(*rx).to(torch.bfloat16)
                    want = ref_rows if fmt == "bf16" else fp8_back(*fp8_cast(ref_rows)).to(torch.bfloat16)
                    check(got.shape == want.shape and torch.equal(got, want), "%s rows in DeepEP's order" % fmt)
                    if with_topk:
                        check(ridx.shape == (want.shape[0], K), "recv_topk_idx shape")
                        for e in range(L):
                            check(int((ridx == e).sum().item()) == counts[e], "recv_topk_idx of expert %d" % e)
                    else:
                        # Cached dispatch: same rows, no routing work.
                        rx2, a, b, c, d, ev2 = buf.dispatch(cur, handle=handle, async_finish=async_finish)
                        if async_finish:
                            ev2.current_stream_wait()
                        check(a is None and b is None and c is None and d is None, "cached dispatch returns")
                        got2 = rx2 if fmt == "bf16" else fp8_back(*rx2).to(torch.bfloat16)
                        check(torch.equal(got2, want), "cached dispatch rows")
                    comb, cw, ev3 = buf.combine(got, handle, topk_weights=rw if with_topk else None,
                                                async_finish=async_finish,
                                                previous_event=EventOverlap(None) if async_finish else None)
                    if async_finish:
                        ev3.current_stream_wait()
                    reach = in_rank.sum(1, keepdim=True).float()
                    src = x.float() if fmt == "bf16" else fp8_back(*fp8_cast(x))
                    check(torch.allclose(comb.float(), src * reach, rtol=2e-2, atol=2e-2), "combine sums")
                    if with_topk:
                        # Each weight comes back from the rank of its expert (0 elsewhere).
                        check(torch.allclose(cw, w.masked_fill(idx < 0, 0), rtol=1e-5, atol=1e-6),
                              "combined top-k weights")
        # expert_alignment (SGLang's 128): aligned counts.
        _, _, _, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                                  expert_alignment=128)
        check(counts == [(c + 127) // 128 * 128 for c in ref_expert], "expert_alignment=128")
        torch.cuda.synchronize()
        dist.barrier(group)
    buf.destroy()


def test_rounds(rank, R, group, sock, gen):
    """A dispatch that receives more rows than the buffer holds runs in
    rounds, transparently: the same order, prefix matrix, counts, cached
    dispatch and combine as one call. Then vLLM's prefill: 8192 tokens at
    hidden 7168, top-8 of 256 experts, in a buffer that holds about half
    (at 8 ranks vLLM's 1 GiB does; here 256 MiB with fewer ranks)."""
    H, E, K = 2048, 16 * R, 6
    L = E // R
    # One receive area: each round but the last copies out of it, the last
    # and every cached round read it in place (the prefill below has three).
    buf = moeep.Buffer(group, explicitly_destroy=True, socket=sock, max_tokens_per_rank=96, recv_areas=1)
    T = 40 if rank == R - 1 else 250 + 31 * rank  # the largest decides the rounds; the small rank follows
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    idx, w = routing(T, E, K, gen)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    all_x, all_idx, all_in_rank = allgather(x, group, R), allgather(idx, group, R), allgather(in_rank, group, R)
    ref_rows, ref_prefix = reference_receive(all_x, all_in_rank, rank, R)
    ref_expert = [sum(int((a == rank * L + e).sum().item()) for a in all_idx) for e in range(L)]
    for fmt in ("bf16", "fp8"):
        cur = x if fmt == "bf16" else fp8_cast(x)
        if fmt == "fp8":
            cur = (cur[0], cur[1].T.contiguous().T)
        rx, ridx, rw, counts, handle, _ = buf.dispatch(cur, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=idx,
                                                       topk_weights=w, expert_alignment=4)
        check(handle.rounds is not None and len(handle.rounds) == (250 + 31 * (R - 2) + 95) // 96,
              "dispatch ran in rounds")
        check(torch.equal(handle[0].cpu(), ref_prefix), "rounds: rank_prefix_matrix")
        check(counts == [(c + 3) // 4 * 4 for c in ref_expert], "rounds: aligned counts %s" % counts)
        got = rx if fmt == "bf16" else fp8_back(*rx).to(torch.bfloat16)
        want = ref_rows if fmt == "bf16" else fp8_back(*fp8_cast(ref_rows)).to(torch.bfloat16)
        check(torch.equal(got, want), "rounds: %s rows in DeepEP's order" % fmt)
        for e in range(L):
            check(int((ridx == e).sum().item()) == ref_expert[e], "rounds: recv_topk_idx of expert %d" % e)
        rx2, _, _, _, _, _ = buf.dispatch(cur, handle=handle)
        got2 = rx2 if fmt == "bf16" else fp8_back(*rx2).to(torch.bfloat16)
        check(torch.equal(got2, want), "rounds: cached dispatch")
        comb, cw, _ = buf.combine(got, handle, topk_weights=rw)
        reach = in_rank.sum(1, keepdim=True).float()
        src = x.float() if fmt == "bf16" else fp8_back(*fp8_cast(x))
        check(torch.allclose(comb.float(), src * reach, rtol=2e-2, atol=2e-2), "rounds: combine")
        check(torch.allclose(cw, w.masked_fill(idx < 0, 0), rtol=1e-5, atol=1e-6), "rounds: combined weights")
    for align in (1, 4):  # without the callers' per-expert counts: moeep counts the whole dispatch's
        rx, _, _, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   topk_idx=idx, topk_weights=w, expert_alignment=align)
        check(handle.rounds is not None and torch.equal(rx, ref_rows), "rounds without num_tokens_per_expert")
        check(counts == [(c + align - 1) // align * align for c in ref_expert],
              "rounds without num_tokens_per_expert, expert_alignment=%d: counts %s" % (align, counts))
        del rx, handle
    torch.cuda.synchronize()
    dist.barrier(group)
    buf.destroy()

    H, E, K, T = 7168, 256, 8, 8192
    buf = moeep.Buffer(group, 256 << 20, 0, explicitly_destroy=True, socket=sock)
    x = (torch.randn(T, H, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    idx, w = routing(T, E, K, gen, masked=0)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    rx, ridx, rw, counts, handle, ev = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                                    async_finish=True)
    ev.current_stream_wait()
    check(handle.rounds is not None, "8192-token prefill in rounds (%d tokens per call)" % buf._plan.max_tokens_per_rank)
    total = allgather(in_rank.sum(0).to(torch.int32).view(1, R), group, R)
    check(rx.shape[0] == sum(int(t[0, rank].item()) for t in total), "prefill: received rows")
    comb, _, ev = buf.combine(rx, handle, async_finish=True)
    ev.current_stream_wait()
    check(torch.allclose(comb.float(), x.float() * in_rank.sum(1, keepdim=True).float(), rtol=2e-2, atol=3e-2),
          "prefill: combine")
    del rx, ridx, rw, comb
    torch.cuda.synchronize()
    dist.barrier(group)
    buf.destroy()


def test_normal_graph(rank, R, group, sock, gen):
    """vLLM's CUDA-graph prefill: get_dispatch_layout, dispatches with
    num_worst_tokens (no host wait; rows past the real count name no
    expert) and their combines, captured in one CUDA graph and replayed with
    new inputs copied into the captured tensors. Two dispatches are alive at
    once in the graph (a two-batch overlap; the second of other tokens), so
    they need two receive areas and, with an eager dispatch held through the
    capture, a routing handle allocated while capturing. Around every replay
    an eager dispatch whose outputs and handle the caller holds: the
    replays must not write its rows nor its routing."""
    H, E, K, T = 1024, 8 * R, 4, 48
    buf = moeep.Buffer(group, explicitly_destroy=True, socket=sock, max_tokens_per_rank=T)
    W = R * T
    x = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
    idx = torch.full((T, K), -1, dtype=moeep.topk_idx_t, device="cuda")
    w = torch.zeros(T, K, device="cuda")
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    out_w = torch.empty(T, K, device="cuda")

    def expert(rx):  # a rank-dependent expert
        return (rx.float() * (rank + 1)).to(torch.bfloat16)

    def step():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=idx, topk_weights=w, num_worst_tokens=W)
        rx, _, rw, _, handle, _ = buf.dispatch(x, **args)
        rx2, _, _, _, handle2, _ = buf.dispatch((x.float() * -0.5).to(torch.bfloat16), **args)
        comb2, _, _ = buf.combine(expert(rx2), handle2)
        comb, cw, _ = buf.combine(expert(rx), handle, topk_weights=rw)
        out.copy_(comb.float() + comb2.float())
        out_w.copy_(cw)

    def reached_scale(ni):  # sum of (r + 1) over the ranks a token reaches
        hit = torch.zeros(T, R + 1, dtype=torch.bool, device="cuda")
        hit.scatter_(1, torch.where(ni >= 0, ni // (E // R), R), True)
        return (hit[:, :R].float() * torch.arange(1, R + 1, device="cuda").float()).sum(1, keepdim=True)

    def eager():  # a dispatch the caller holds
        ex = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
        ei, ew = routing(T, E, K, gen)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ei, E)
        erx, _, erw, _, ehandle, _ = buf.dispatch(ex, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=ei, topk_weights=ew)
        return ex, ei, ew, erx, erw, ehandle, erx.clone()

    held = None
    for rep in range(3):
        if rep == 0:
            step()  # warm-up outside the capture, then an eager dispatch held through it
            held = eager()
            torch.cuda.synchronize()
            dist.barrier(group)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        else:
            held = eager()
        ex, ei, ew, erx, erw, ehandle, kept = held
        nx, ni, nw = replay_new(graph, group, gen, E, (x, idx, w), (out, out_w))
        check(torch.allclose(out.float(), 0.5 * nx.float() * reached_scale(ni), rtol=2e-2, atol=2e-2),
              "graph replay %d: combined rows" % rep)
        check(torch.allclose(out_w, nw.masked_fill(ni < 0, 0), rtol=1e-5, atol=1e-6),
              "graph replay %d: combined weights" % rep)
        check(torch.equal(erx, kept), "graph replay %d wrote the rows of an eager dispatch held across it" % rep)
        comb, cw, _ = buf.combine(expert(erx), ehandle, topk_weights=erw)
        check(torch.allclose(comb.float(), ex.float() * reached_scale(ei), rtol=2e-2, atol=2e-2),
              "graph replay %d changed the routing of an eager dispatch held across it" % rep)
        check(torch.allclose(cw, ew.masked_fill(ei < 0, 0), rtol=1e-5, atol=1e-6),
              "eager combine after graph replay %d: weights" % rep)
        del held, ex, erx, erw, ehandle, comb, cw
    torch.cuda.synchronize()
    dist.barrier(group)
    del graph
    buf.destroy()


def test_opaque_scales(rank, R, group, sock, gen):
    """SGLang on Blackwell: FP8 x with UE8M0 scales packed four to an int32,
    [tokens, hidden / 512]. DeepEP's normal mode moves scales as opaque
    4-byte words; so must moeep: every bit pattern (NaN patterns included)
    arrives unchanged, in int32, in DeepEP's row order, in one call, in
    rounds and in a cached dispatch. Float32 scales of fewer columns too."""
    H, E, K = 2048, 16 * R, 6
    for cap, T in ((None, 200 + 9 * rank), (96, 250 + 31 * rank)):  # one call; rounds
        kw = dict(max_tokens_per_rank=cap) if cap else {}
        buf = moeep.Buffer(group, int(1e9) if not cap else 0, 0, explicitly_destroy=True, socket=sock, **kw)
        x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
        q = fp8_cast(x)[0]
        idx, w = routing(T, E, K, gen)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        all_q, all_in_rank = allgather(q, group, R), allgather(in_rank, group, R)
        want_q, _ = reference_receive(all_q, all_in_rank, rank, R)
        for dtype, cols in ((torch.int32, H // 512), (torch.float32, 3)):
            bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (T, cols), generator=gen, device="cuda", dtype=torch.int32)
            sc = bits if dtype == torch.int32 else bits.view(torch.float32)
            sc = sc.T.contiguous().T  # column-major, as SGLang's TMA-aligned scales
            want_s, _ = reference_receive(allgather(bits, group, R), all_in_rank, rank, R)
            rx, _, _, _, handle, _ = buf.dispatch((q, sc), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
            what = "%s scales [T, %d]%s" % (dtype, cols, " in rounds" if cap else "")
            check(cap is None or handle.rounds is not None, "%s: dispatch ran in rounds" % what)
            check(rx[1].dtype == dtype and rx[1].shape == (want_q.shape[0], cols), "%s: %s %s" %
                  (what, rx[1].dtype, list(rx[1].shape)))
            check(torch.equal(rx[0].view(torch.uint8), want_q.view(torch.uint8)), "%s: fp8 rows" % what)
            check(torch.equal(rx[1].view(torch.int32), want_s), "%s: scale words bit for bit" % what)
            rx2, _, _, _, _, _ = buf.dispatch((q, sc), handle=handle)
            check(rx2[1].dtype == dtype and torch.equal(rx2[1].view(torch.int32), want_s),
                  "%s: cached dispatch scale words" % what)
        bad = torch.zeros(T, H // 128 + 1, dtype=torch.int32, device="cuda")
        try:
            buf.dispatch((q, bad), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
            check(False, "scales wider than hidden / 128 are refused")
        except ValueError as e:
            check("x scales" in str(e), "the error names x scales: %s" % e)
        torch.cuda.synchronize()
        dist.barrier(group)
        buf.destroy()


# ---------------------------------------------------------------- low-latency mode

def ll_reference(all_x, all_idx, rank, L, R):
    """Per local expert: [(source rank, token)] in rank order, token order."""
    out = []
    for e in range(L):
        ge = rank * L + e
        out.append([(s, t) for s in range(R) for t in (all_idx[s] == ge).any(1).nonzero().flatten().tolist()])
    return out


def check_ll_dispatch(recv, count, handle, ref, all_x, R, L, NT, H, fp8, what):
    rx = recv[0] if fp8 else recv
    check(rx.shape == (L, R * NT, H), "%s: recv_x shape %s" % (what, tuple(rx.shape)))
    check(len(handle) == 5 and handle[2] == NT and handle[3] == H, "%s: handle fields" % what)
    src, rng = handle[0], handle[1]
    check(src.shape == (L, R * NT) and rng.shape == (L, R) and rng.dtype == torch.int64, "%s: handle shapes" % what)
    if fp8:
        sc = recv[1]
        check(sc.shape == (L, R * NT, H // 128) and sc.stride() == (H // 128 * R * NT, 1, R * NT),
              "%s: scales column-major, strides %s" % (what, sc.stride()))
    for e in range(L):
        n = int(count[e].item())
        check(n == len(ref[e]), "%s expert %d: %d received, want %d" % (what, e, n, len(ref[e])))
        begin = 0
        for s in range(R):
            c = sum(1 for (q, _) in ref[e] if q == s)
            v = int(rng[e, s].item())
            check(v >> 32 == begin and v & 0xFFFFFFFF == c, "%s expert %d rank %d: layout_range (%d, %d), want "
                  "(%d, %d)" % (what, e, s, v >> 32, v & 0xFFFFFFFF, begin, c))
            toks = sorted(src[e, begin:begin + c].tolist())
            check(toks == [t for (q, t) in ref[e] if q == s], "%s expert %d rank %d: src_info tokens" % (what, e, s))
            if c:
                want = torch.stack([all_x[s][t] for t in src[e, begin:begin + c].tolist()])
                if fp8:
                    got = fp8_back(rx[e, begin:begin + c], recv[1][e, begin:begin + c].contiguous())
                    check(torch.allclose(got, want.float(), rtol=0.07, atol=2e-2), "%s fp8 rows" % what)
                else:
                    check(torch.equal(rx[e, begin:begin + c], want), "%s bf16 rows" % what)
            begin += c


def ll_ref_combine(x, idx, w, scale_of):
    ref = torch.zeros(x.shape, device="cuda")
    for k in range(idx.shape[1]):
        e = idx[:, k]
        f = torch.where(e >= 0, w[:, k] * scale_of[e.clamp(min=0)], torch.zeros_like(w[:, k]))
        ref += f.unsqueeze(1) * x.float()
    return ref


def expert_outputs(recv, count, fp8, rank, L, scale_of, H):
    rx = recv[0] if fp8 else recv
    y = torch.zeros(rx.shape, dtype=torch.bfloat16, device="cuda")
    for e in range(L):
        n = int(count[e].item())
        if n:
            rows = fp8_back(rx[e, :n], recv[1][e, :n].contiguous()) if fp8 else rx[e, :n].float()
            y[e, :n] = (rows * scale_of[rank * L + e]).to(torch.bfloat16)
    return y


def test_low_latency(rank, R, group, sock, gen):
    H, E, K, NT = 2048, 8 * R, 4, 64
    L = E // R
    # vLLM's constructor arguments for the low-latency path.
    buf = moeep.Buffer(group, num_nvl_bytes=0,
                       num_rdma_bytes=moeep.Buffer.get_low_latency_rdma_size_hint(NT, H, R, E),
                       low_latency_mode=True, num_qps_per_rank=L, allow_nvlink_for_low_latency_mode=True,
                       allow_mnnvl=False, explicitly_destroy=True, socket=sock)
    scale_of = 0.5 + (torch.arange(E, device="cuda") % 5).float() * 0.25
    stats = torch.zeros(L, dtype=torch.int32, device="cuda")
    total = torch.zeros(L, dtype=torch.int64)
    for it, (fp8, hook, twice) in enumerate([(False, False, False), (True, True, True), (True, False, True),
                                             (False, True, False)]):
        T = NT if rank == 0 else int(torch.randint(1, NT + 1, (1,), generator=gen, device="cuda").item())
        x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
        idx, w = routing(T, E, K, gen)
        all_x = allgather(torch.nn.functional.pad(x, (0, 0, 0, NT - T)), group, R)
        all_idx = allgather(torch.nn.functional.pad(idx, (0, 0, 0, NT - T), value=-1), group, R)
        ref = ll_reference(all_x, all_idx, rank, L, R)
        # Two dispatches in a row, only the second combined (DeepEP's test does this).
        for _ in range(2 if twice else 1):
            recv, count, handle, event, fn = buf.low_latency_dispatch(
                x, idx, NT, E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8, async_finish=not hook,
                return_recv_hook=hook)
            fn() if hook else event.current_stream_wait()
            for e in range(L):
                total[e] += len(ref[e])
        check_ll_dispatch(recv, count, handle, ref, all_x, R, L, NT, H, fp8, "ll it %d" % it)
        check(torch.equal(stats.cpu().long(), total), "cumulative_local_expert_recv_stats")
        y = expert_outputs(recv, count, fp8, rank, L, scale_of, H)
        # FP8: the reference sums the dequantised rows (e4m3 keeps 3 mantissa
        # bits; a rounding step apart from the kernel's cast at most).
        want = ll_ref_combine(fp8_back(*fp8_cast(x)) if fp8 else x, idx, w, scale_of)
        # One handle combined twice: x as given, then zero copy.
        for zero_copy in (False, True):
            if zero_copy:
                buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
            out = torch.full((T, H), POISON_BF16, dtype=torch.bfloat16, device="cuda")
            comb, event, fn = buf.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy,
                                                      async_finish=not hook, return_recv_hook=hook, out=out)
            fn() if hook else event.current_stream_wait()
            check(comb.data_ptr() == out.data_ptr(), "combine writes into out=")
            check(not bool(torch.isnan(comb).any()), "combine filled every row")
            if fp8:
                d = sim_diff(comb.float(), want)
                check(d < 1e-3, "ll combine (it %d, zero_copy %s): difference %g" % (it, zero_copy, d))
            else:
                check(torch.allclose(comb.float(), want, rtol=3e-2, atol=5e-2), "ll combine (it %d, zero_copy %s)" %
                      (it, zero_copy))
        torch.cuda.synchronize()
        dist.barrier(group)

    # SGLang: clean_low_latency_buffer between uses (collective).
    buf.clean_low_latency_buffer(NT, H, E)
    dist.barrier(group)

    # vLLM's decode step in a CUDA graph: dispatch, expert, combine; replayed
    # with new inputs copied into the captured tensors.
    x = torch.zeros(NT, H, dtype=torch.bfloat16, device="cuda")
    idx = torch.full((NT, K), -1, dtype=torch.int64, device="cuda")
    w = torch.zeros(NT, K, device="cuda")
    out = torch.empty(NT, H, dtype=torch.bfloat16, device="cuda")
    local_scale = scale_of[rank * L:(rank + 1) * L].view(L, 1, 1)

    def step():
        recv, count, handle, _, fn = buf.low_latency_dispatch(x, idx, NT, E, use_fp8=False, return_recv_hook=True)
        fn()
        y = (recv.float() * local_scale).to(torch.bfloat16)
        comb, _, fn2 = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True, out=out)
        fn2()

    graph = captured(step, group)
    for rep in range(3):
        nx, ni, nw = replay_new(graph, group, gen, E, (x, idx, w), (out,))
        check(torch.allclose(out.float(), ll_ref_combine(nx, ni, nw, scale_of), rtol=3e-2, atol=5e-2),
              "graph replay %d" % rep)
    dist.barrier(group)
    del graph

    # Profiling as DeepEP's test: one kernel name with "dispatch", one with
    # "combine"; with hooks every launch named ...::dispatch / ...::combine.
    from torch.profiler import ProfilerActivity, profile
    nx = torch.randn(NT, H, generator=gen, device="cuda").to(torch.bfloat16)
    ni, nw = routing(NT, E, K, gen)
    for hook in (False, True):
        dist.barrier(group)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                recv, count, handle, _, fn = buf.low_latency_dispatch(nx, ni, NT, E, use_fp8=True,
                                                                     return_recv_hook=hook)
                if hook:
                    fn()
                y = torch.zeros(L, R * NT, H, dtype=torch.bfloat16, device="cuda")
                _, _, fn2 = buf.low_latency_combine(y, ni, nw, handle, return_recv_hook=hook)
                if hook:
                    fn2()
            torch.cuda.synchronize()
        names = set(e.key for e in prof.key_averages())
        for word in ("dispatch", "combine"):
            hits = [n for n in names if word in n]
            check(len(hits) == 1, "profiled kernels named %r: %s" % (word, hits))
            check("::" + word in hits[0], "kernel %r has ::%s" % (hits[0], word))
    dist.barrier(group)
    buf.destroy()


# ---------------------------------------------------------------- engine sequences

def test_megatron_sglang(rank, R, group, sock, gen):
    """Megatron: EventOverlap(EventHandle()) as previous_event, async
    dispatch, cached dispatch; SGLang: size hints with FP8 hidden_bytes,
    previous_event chaining of layout -> dispatch -> combine."""
    H, E, K, T = 2048, 8 * R, 4, 200
    nvl = moeep.Config(24, 6, 256).get_nvl_buffer_size_hint(H, R)  # FP8: hidden_bytes = hidden
    buf = moeep.Buffer(group, nvl, 0, explicitly_destroy=True, socket=sock)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    idx, w = routing(T, E, K, gen)
    prev = EventOverlap(EventHandle())
    per_rank, _, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, E, previous_event=prev, async_finish=True,
                                                                   allocate_on_comm_stream=True)
    rx, ridx, rw, counts, handle, ev = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                                    previous_event=ev, async_finish=True,
                                                    allocate_on_comm_stream=True)
    ev.current_stream_wait()
    check(buf._plan.max_tokens_per_rank == 4096, "the FP8 size hint holds 4096 tokens, not %d" %
          buf._plan.max_tokens_per_rank)
    y = rx * 2
    comb, _, ev = buf.combine(y, handle, previous_event=EventOverlap(EventHandle()), async_finish=True)
    ev.current_stream_wait()
    reach = in_rank.sum(1, keepdim=True).float()
    check(torch.allclose(comb.float(), 2 * x.float() * reach, rtol=2e-2, atol=2e-2), "megatron/sglang combine")
    rx2, _, _, _, _, ev = buf.dispatch(x, handle=handle, previous_event=EventOverlap(EventHandle()),
                                       async_finish=True)
    ev.current_stream_wait()
    check(torch.equal(rx2, rx), "cached dispatch after combine")
    torch.cuda.synchronize()
    dist.barrier(group)
    buf.destroy()


def rank_main(rank, R, port, sock, which):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=R)
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(4321 + rank)
    with exit_on_failure():
        test_names()
        if "normal" in which:
            test_normal(rank, R, group, sock, gen)
        if "rounds" in which:
            test_rounds(rank, R, group, sock, gen)
        if "scales" in which:
            test_opaque_scales(rank, R, group, sock, gen)
        if "graph" in which:
            test_normal_graph(rank, R, group, sock, gen)
        if "ll" in which:
            test_low_latency(rank, R, group, sock, gen)
        if "engines" in which:
            test_megatron_sglang(rank, R, group, sock, gen)
        if rank == 0:
            print("deepep semantics: %d ranks OK (%s)" % (R, ",".join(which)), flush=True)
    dist.destroy_process_group()


def main():
    if no_cuda():
        return 77
    ranks = [int(r) for r in os.environ.get("MOEEP_TEST_RANKS", "2,4").split(",")]
    which = os.environ.get("MOEEP_TEST_PARTS", "normal,rounds,scales,graph,ll,engines").split(",")

    def run(sock):
        for R in ranks:
            t0 = time.monotonic()
            mp.spawn(rank_main, args=(R, free_port(), sock, which), nprocs=R, join=True)
            print("ranks=%d: %.1f s" % (R, time.monotonic() - t0), flush=True)
        return 0

    return with_moeepd("moeep-deepep-", run)


if __name__ == "__main__":
    sys.exit(main())
