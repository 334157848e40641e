#!/usr/bin/env python3
"""moeep.Buffer (client/python) on GPUs against torch references, as DeepEP's
tests: one process per GPU (up to 4) through torch.multiprocessing, a torch
process group, a private moeepd.

Normal mode: get_dispatch_layout against a torch layout; BF16 and FP8
dispatch (random top-k with masked -1 entries; rows, top-k ids and weights,
per-expert counts with expert_alignment) against the gathered inputs of
every rank; cached dispatch; async_finish with previous_event; dispatch with
num_worst_tokens; combine sums (x times the ranks a token reached, and the
top-k weights). Low-latency mode: BF16 and FP8 (tolerance of the e4m3 cast,
power-of-two scales with round_scale, UE8M0 packing) dispatch checked per
local expert as a set of (rank, token) slots, receive hooks (UE8M0 with a
hook included, its dispatch held back on the default stream), cumulative
stats, and combine of an expert-dependent function with the top-k weights.
The first call of each kind also runs under a torch function mode (as
torch.set_default_device sets, which DeepEP's tests do): it must see none of
the calls' tensor methods, and the results are checked as the others. Errors: a rank whose moeepd session ends without leaving makes the others'
next dispatch raise MoeepError naming it.

Usage: test_python_buffer.py [--ranks LIST] [--gpus N]: each rank count of
LIST (default: the GPUs, at most 4) on the first N GPUs (default: all).
Ranks beyond the GPUs share them, rank i on GPU i % N; then the ranks talk
through gloo (NCCL refuses two ranks on one GPU) and, when an MPS daemon
runs, each gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / (ranks a GPU + 1).

Exit 77 (meson: skipped) without torch or without a CUDA device.
Environment: MOEEP_LIBRARY, MOEEP_TEST_MOEEPD (meson sets both).
"""

import argparse
import contextlib
import os
import socket as _socket
import sys
import time

from launch import check, exit_on_failure, free_port, no_cuda, with_moeepd  # first: exits 77 without torch
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import moeep  # noqa: E402
import moeep._fast  # noqa: E402,F401


def same(got, want, what):
    """Exact equality; on a mismatch the message names the first bad row."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError("%s: got %s %s, want %s %s" % (what, tuple(got.shape), got.dtype,
                                                         tuple(want.shape), want.dtype))
    bad = (got != want).view(got.shape[0], -1).any(1) if got.numel() else got.new_zeros(0, dtype=torch.bool)
    if bool(bad.any()):
        rows = bad.nonzero().flatten()
        r = int(rows[0].item())
        raise AssertionError("%s: %d of %d rows differ; row %d: got %s, want %s" % (
            what, rows.numel(), got.shape[0], r, got[r].tolist()[:16], want[r].tolist()[:16]))


def close(a, b, what, rtol=1e-2, atol=1e-2):
    a, b = a.float(), b.float()
    if not torch.allclose(a, b, rtol=rtol, atol=atol):
        diff = (a - b).abs().max().item()
        raise AssertionError("%s: max abs difference %g" % (what, diff))


def per_token_cast_to_fp8(x, round_scale=False):
    """e4m3 with one float scale per 128 channels (amax / 448), as DeepEP's tests."""
    T, H = x.shape
    xv = x.float().view(T, H // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    scale = amax / 448.0
    if round_scale:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    q = (xv / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(T, H)
    return q, scale.contiguous()


def dequant(q, scales):
    T, H = q.shape
    return (q.float().view(T, H // 128, 128) * scales.unsqueeze(2)).view(T, H)


def routing(T, E, K, gen, mask_p=0.1, device="cuda"):
    scores = torch.rand(T, E, generator=gen, device=device) + 1
    idx = torch.topk(scores, K, dim=1).indices.to(torch.int64)
    masked = torch.rand(T, K, generator=gen, device=device) < mask_p
    idx = torch.where(masked, torch.full_like(idx, -1), idx)
    w = torch.rand(T, K, generator=gen, device=device)
    return idx.contiguous(), w.contiguous()


def gather(t, group, R):
    """Every rank's tensor (first dims may differ), on every rank."""
    n = torch.tensor([t.shape[0]], device=t.device)
    ns = [torch.zeros_like(n) for _ in range(R)]
    dist.all_gather(ns, n, group=group)
    m = max(int(v.item()) for v in ns)
    pad = torch.zeros((m,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    pad[:t.shape[0]] = t
    raw = pad.view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float8_e4m3fn) else pad
    outs = [torch.empty_like(raw) for _ in range(R)]
    dist.all_gather(outs, raw.contiguous(), group=group)
    return [o.view(t.dtype)[:int(ns[i].item())] for i, o in enumerate(outs)]


class CountingMode(torch.overrides.TorchFunctionMode):
    """A torch function mode that notes what reaches it: moeep's calls
    must pass none of their tensor methods through one (they run as DeepEP's
    C++ binding does)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def counted(first):
    """A CountingMode for the first call of a kind, else no mode."""
    return CountingMode() if first else contextlib.nullcontext()


def check_unseen(mode, what):
    if isinstance(mode, CountingMode):
        check(not mode.seen, "%s under a torch function mode: it saw %s" % (what, mode.seen[:8]))


def test_normal(rank, R, group, sock):
    H, E, K = 4096, 64, 6
    L = E // R
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    buf = moeep.Buffer(group, num_nvl_bytes=moeep.Config().get_nvl_buffer_size_hint(H * 2, R), socket=sock,
                       explicitly_destroy=True)
    for T in (1000 + 37 * rank, 1 if rank == 1 else 513, 0 if rank == R - 1 else 64):
        x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
        idx, w = routing(T, E, K, gen)
        all_x, all_idx, all_w = gather(x, group, R), gather(idx, group, R), gather(w, group, R)

        # Layout against torch.
        per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, E)
        check(per_rdma is None and ev.event is None, "layout extras")
        ranks_of = torch.where(idx >= 0, idx // L, torch.full_like(idx, R))
        ref_in = torch.zeros(T, R + 1, dtype=torch.bool, device="cuda").scatter_(1, ranks_of, True)[:, :R]
        check(torch.equal(in_rank, ref_in), "is_token_in_rank")
        check(torch.equal(per_rank, ref_in.sum(0).int()), "num_tokens_per_rank")
        ref_pe = torch.bincount(idx[idx >= 0].flatten(), minlength=E).int()
        check(torch.equal(per_expert, ref_pe), "num_tokens_per_expert")

        # What this rank must receive: source rank, then token order.
        ref_rows, ref_idx, ref_w = [], [], []
        for s in range(R):
            si, sw = all_idx[s], all_w[s]
            local = (si >= rank * L) & (si < (rank + 1) * L)
            hit = local.any(1)
            ref_rows.append(all_x[s][hit])
            ref_idx.append(torch.where(local, si - rank * L, torch.full_like(si, -1))[hit])
            ref_w.append(torch.where(local, sw, torch.zeros_like(sw))[hit])
        ref_rows, ref_idx, ref_w = torch.cat(ref_rows), torch.cat(ref_idx), torch.cat(ref_w)
        n_recv = ref_rows.shape[0]

        for align in (1, 8):
            with counted(align == 1) as mode:
                rx, ridx, rw, counts, handle, ev = buf.dispatch(
                    x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=idx, topk_weights=w, expert_alignment=align)
            check_unseen(mode, "dispatch")
            check(rx.shape == (n_recv, H) and rx.dtype == torch.bfloat16, "recv_x shape %s" % (rx.shape,))
            check(torch.equal(rx, ref_rows), "recv_x rows (T=%d)" % T)
            same(ridx, ref_idx, "recv_topk_idx (T=%d, align %d)" % (T, align))
            same(rw, ref_w, "recv_topk_weights (T=%d, align %d)" % (T, align))
            exp = [int(((ref_idx == e).sum().item() + align - 1) // align * align) for e in range(L)]
            check(counts == exp, "num_recv_tokens_per_expert_list %s != %s" % (counts, exp))

        # Combine: each token comes back once from every rank it reached.
        hits = torch.stack([((idx >= r * L) & (idx < (r + 1) * L)).any(1) for r in range(R)], 1).sum(1)
        out, out_w, ev = buf.combine(rx, handle, topk_weights=rw)
        close(out, x.float() * hits.unsqueeze(1), "combined_x")
        close(out_w, torch.where(idx >= 0, w, torch.zeros_like(w)), "combined_topk_weights", 1e-6, 1e-6)

        # Cached dispatch, async with an event, on a side stream.
        prev = moeep.Buffer.capture()
        rx2, a, b, c, d, ev = buf.dispatch(x, handle=handle, previous_event=prev, async_finish=True)
        check(a is None and b is None and c is None and d is None, "cached dispatch returns")
        ev.current_stream_wait()
        check(torch.equal(rx2, ref_rows), "cached recv_x")
        out, _, ev = buf.combine(rx2, handle, async_finish=True)
        with ev:
            pass
        close(out, x.float() * hits.unsqueeze(1), "combined_x after cached dispatch")

        # FP8.
        q, s = per_token_cast_to_fp8(x)
        (rq, rs), ridx, rw, counts, h8, ev = buf.dispatch(
            (q, s), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w)
        check(rq.dtype == torch.float8_e4m3fn and rs.shape == (n_recv, H // 128), "fp8 recv shapes")
        check(torch.equal(rq.view(torch.uint8), per_token_cast_to_fp8(ref_rows)[0].view(torch.uint8)), "fp8 bytes")
        close(dequant(rq, rs), ref_rows, "fp8 dequantised", rtol=0.07, atol=1e-2)

        # num_worst_tokens: no host wait; padded rows name no expert.
        W = R * buf._plan.max_tokens_per_rank
        rx3, ridx3, rw3, counts3, h3, ev = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, num_worst_tokens=W)
        check(rx3.shape[0] == W and counts3 == [], "worst-case shapes")
        check(torch.equal(rx3[:n_recv], ref_rows) and torch.equal(ridx3[:n_recv], ref_idx), "worst-case rows")
        check(bool((ridx3[n_recv:] == -1).all()), "worst-case padding")
        y = rx3.clone()
        y[n_recv:] = 0
        out, _, _ = buf.combine(y, h3)
        close(out, x.float() * hits.unsqueeze(1), "combined_x after worst-case dispatch")
        del rx, ridx, rw, rx2, rq, rs, ridx3, rw3, rx3, y
        lifetimes(buf, group, R, rank, L, gen, idx, w, per_rank, in_rank, per_expert, x, ref_rows)
        torch.cuda.synchronize()
        dist.barrier(group)
    buf.check()
    buf.destroy()


def lifetimes(buf, group, R, rank, L, gen, idx, w, per_rank, in_rank, per_expert, x, ref_rows):
    """Normal-mode output lifetimes, whatever the number of receive areas:
    a dispatch's outputs are views of a free area and stay intact while
    held, through later dispatches; a dispatch that finds one area free
    returns owned copies (the area stays free); an area comes back when
    every output of its dispatch (or a view of one) is gone. Every other
    rank makes the same calls."""
    T, H = x.shape
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=w)
    areas = buf._areas.held
    n = len(areas)
    torch.cuda.synchronize()
    check(not any(areas), "areas still held after their outputs went: %s" % areas)
    # Another input with the same routing, and the rows it must bring here.
    x2 = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    all_x2, all_idx = gather(x2, group, R), gather(idx, group, R)
    ref2 = torch.cat([all_x2[s][((all_idx[s] >= rank * L) & (all_idx[s] < (rank + 1) * L)).any(1)]
                      for s in range(R)])
    held, want = [], []
    for i in range(n - 1):  # views, each of another area
        held.append(buf.dispatch(x if i % 2 == 0 else x2, **args))
        want.append(ref_rows if i % 2 == 0 else ref2)
        check(sum(areas) == i + 1, "dispatch %d: areas %s" % (i, areas))
    b = buf.dispatch(x2, **args)  # one area free: owned copies
    c = buf.dispatch(x2, handle=held[0][4])  # cached, still one free: copies
    check(sum(areas) == n - 1, "with one area free: areas %s" % areas)
    for i, (h, rows) in enumerate(zip(held, want)):
        check(torch.equal(h[0], rows), "held views of dispatch %d changed by later dispatches" % i)
    check(torch.equal(b[0], ref2) and torch.equal(c[0], ref2), "copied outputs")
    check(all(b[0].data_ptr() != h[0].data_ptr() for h in held), "copies are not the views")
    del b, c
    lone = held[0][0][:5]  # a view of a view still holds the area
    del held, h
    check(sum(areas) == 1, "a lone view holds its area: areas %s" % areas)
    d = buf.dispatch(x2, **args)
    check(sum(areas) == (2 if n > 2 else 1) and torch.equal(lone, ref_rows[:5]), "lone view after a dispatch")
    del d, lone
    check(not any(areas), "areas after every output went: %s" % areas)
    e = buf.dispatch(x2, **args)  # views again
    check(sum(areas) == 1 and torch.equal(e[0], ref2), "views after the areas came back")
    del e
    dist.barrier(group)


def test_low_latency(rank, R, group, sock):
    H, E, K, NT = 7168, 32 * R, 8, 128
    L = E // R
    gen = torch.Generator(device="cuda").manual_seed(99 + rank)
    buf = moeep.Buffer(group, low_latency_mode=True, socket=sock, explicitly_destroy=True,
                       num_rdma_bytes=moeep.Buffer.get_low_latency_rdma_size_hint(NT, H, R, E))
    stats = torch.zeros(L, dtype=torch.int32, device="cuda")
    ref_stats = torch.zeros(L, dtype=torch.int64, device="cuda")
    scale_of = 0.5 + (torch.arange(E, device="cuda") % 7).float() * 0.25  # expert function: x * scale
    shape = (H, E, K, NT, L, R, rank, group)
    for it, (fp8, round_scale, ue8m0, hook) in enumerate([(False, False, False, False), (True, False, False, True),
                                                          (True, True, True, False), (False, False, False, True),
                                                          (True, True, True, True)]):
        T = NT if rank == 0 else int(torch.randint(1, NT + 1, (1,), generator=gen, device="cuda").item())
        ll_round(buf, shape, gen, stats, ref_stats, scale_of, it, T, fp8, round_scale, ue8m0, hook, it == 0)

    # A decode loop: the same tokens per rank every step, the common case
    # (no hook, no async_finish). After one call into each buffer set, the
    # compiled path (moeep_fast, where built) takes the calls: the same
    # checks, and it must have run.
    fast = moeep._fast.status().startswith("on")
    counts0 = buf._fast.counts() if buf._fast is not None else (0, 0)
    T = NT - 3 * rank
    steps = [True] * 4 + [False] * 4 + [True] * 2  # use_fp8: each kind warms both sets first
    for it, fp8 in enumerate(steps):
        ll_round(buf, shape, gen, stats, ref_stats, scale_of, 10 + it, T, fp8, it == 9, False, False,
                 it == 2, idx32=it in (3, 7), given_out=it in (6, 8), no_stats=it == 2)
    if fast:
        counts = buf._fast.counts()
        done = (counts[0] - counts0[0], counts[1] - counts0[1])
        check(done[0] >= 6 and done[1] >= 6, "the compiled path took %d dispatches and %d combines of the "
              "decode loop's 10, expected 6 or more each" % done)
    buf.check()
    buf.destroy()


def ll_round(buf, shape, gen, stats, ref_stats, scale_of, it, T, fp8, round_scale, ue8m0, hook, counting,
             idx32=False, given_out=False, no_stats=False):
    """One low-latency dispatch + combine on fresh inputs, checked against
    the inputs gathered from every rank; both calls under a CountingMode
    when `counting`."""
    H, E, K, NT, L, R, rank, group = shape
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    idx, w = routing(T, E, K, gen)  # distinct experts per token (top-k)
    all_x, all_idx = gather(x, group, R), gather(idx, group, R)
    if idx32:
        idx = idx.to(torch.int32)
    if hook:
        # The dispatch starts late (about 10 ms): the hook's work (the
        # UE8M0 packing too) must follow it on the caller's stream, the
        # default one here, not run on another stream at once.
        torch.cuda._sleep(20_000_000)
    with counted(counting) as mode:
        recv, count, handle, ev, fn = buf.low_latency_dispatch(
            x, idx, NT, E, cumulative_local_expert_recv_stats=None if no_stats else stats, use_fp8=fp8,
            round_scale=round_scale, use_ue8m0=ue8m0, return_recv_hook=hook)
    check_unseen(mode, "low_latency_dispatch")
    if hook:
        check(fn is not None, "hook returned")
        fn()
    else:
        check(fn is None, "no hook without return_recv_hook")
    rx = recv[0] if fp8 else recv
    check(rx.shape == (L, R * NT, H), "ll recv_x shape %s" % (rx.shape,))
    src, rng = handle.src_info, handle.layout_range
    pairs_of = []  # per local expert: (source rank, token) of each slot in use
    for e in range(L):
        ge = rank * L + e
        exp = sorted((s, int(t)) for s in range(R) for t in (all_idx[s] == ge).any(1).nonzero().flatten().tolist())
        n = int(count[e].item())
        check(n == len(exp), "round %d, expert %d: %d slots, expected %d" % (it, ge, n, len(exp)))
        toks = src[e, :n].tolist()
        ranks = [s for s in range(R) for _ in range(int(rng[e, s].item()) & 0xFFFFFFFF)]
        pairs = list(zip(ranks, toks))
        pairs_of.append(pairs)
        check(sorted(pairs) == exp, "round %d, expert %d: received (rank, token) pairs" % (it, ge))
        ref_rows = torch.stack([all_x[s][t] for s, t in pairs]) if n else None
        if n and not fp8:
            check(torch.equal(rx[e, :n], ref_rows), "round %d, expert %d: bf16 rows" % (it, ge))
        elif n:
            if ue8m0:
                packed = recv[1]
                check(packed.dtype == torch.int32 and packed.shape == (L, R * NT, H // 512), "ue8m0 shape")
                ex = torch.stack([(packed[e, :n] >> (8 * i)) & 0xFF for i in range(4)], -1).view(n, H // 128)
                sc = torch.pow(2.0, ex.float() - 127)
            else:
                sc = recv[1][e, :n]
            if round_scale:
                check(bool((torch.log2(sc) == torch.round(torch.log2(sc))).all()), "round_scale powers of two")
            close(dequant(rx[e, :n], sc), ref_rows, "round %d, expert %d: fp8 dequantised" % (it, ge),
                  rtol=0.07, atol=2e-2)
        if not no_stats:
            ref_stats[e] += n
    check(torch.equal(stats.long(), ref_stats), "round %d: cumulative_local_expert_recv_stats" % it)

    # Expert outputs: x * scale of the expert, in the dispatch's layout.
    y = torch.zeros(L, R * NT, H, dtype=torch.bfloat16, device="cuda")
    deq = rx.float() if not fp8 else None
    for e in range(L):
        n = int(count[e].item())
        if not n:
            continue
        rows = deq[e, :n] if deq is not None else torch.stack(
            [all_x[s][t] for s, t in pairs_of[e]]).float()
        y[e, :n] = (rows * scale_of[rank * L + e]).to(torch.bfloat16)
    out_arg = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda") if given_out else None
    with counted(counting) as mode:
        out, ev, fn2 = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook, out=out_arg)
    check_unseen(mode, "low_latency_combine")
    if given_out:
        check(out is out_arg, "round %d: combine returns the out it was given" % it)
    if hook:
        fn2()
    ref = torch.zeros(T, H, device="cuda")
    for k in range(K):
        e = idx[:, k].long()
        ok = e >= 0
        f = torch.where(ok, w[:, k] * scale_of[e.clamp(min=0)], torch.zeros_like(w[:, k]))
        ref += f.unsqueeze(1) * x.float()
    close(out, ref, "ll combined_x (round %d)" % it, rtol=3e-2, atol=5e-2)
    torch.cuda.synchronize()
    dist.barrier(group)


def test_peer_lost(rank, R, group, sock):
    """The last rank's moeepd session ends without JobLeave (as when its
    process dies): every other rank's next dispatch raises MoeepError naming
    it, within seconds, and the Buffer can still be destroyed."""
    H, E, T = 1024, 8 * R, 32
    buf = moeep.Buffer(group, socket=sock, explicitly_destroy=True, hidden=H, num_experts=E,
                       max_tokens_per_rank=T, max_topk=2)
    x = torch.ones(T, H, device="cuda", dtype=torch.bfloat16)
    first = torch.arange(T, device="cuda", dtype=torch.int64) % E
    idx = torch.stack([first, (first + E // 2) % E], 1)

    def dispatch():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx)

    dispatch()
    torch.cuda.synchronize()
    dist.barrier(group)
    if rank == R - 1:
        fd = buf._client.lib.moeep_client_fd(buf._client.ptr)
        s = _socket.socket(fileno=fd)
        s.shutdown(_socket.SHUT_RDWR)  # the daemon reads EOF: this rank is lost
        s.detach()                     # the fd stays libmoeep's
    else:
        t0 = time.monotonic()
        try:
            dispatch()
            buf.check()
        except moeep.MoeepError as e:
            check("rank %d lost" % (R - 1) in str(e), "peer-lost error names the rank: %s" % e)
            check(time.monotonic() - t0 < 5, "peer-lost error after %.1f s" % (time.monotonic() - t0))
        else:
            raise AssertionError("dispatch after rank %d was lost did not raise" % (R - 1))
    dist.barrier(group)
    try:
        buf.destroy()
    except moeep.MoeepError:
        pass  # leaving a job that is gone may report it; nothing else is left


def rank_main(rank, R, ngpu, port, sock, backend):
    torch.cuda.set_device(rank % ngpu)
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=R)
    with exit_on_failure():
        test_normal(rank, R, dist.group.WORLD, sock)
        test_low_latency(rank, R, dist.group.WORLD, sock)
        test_peer_lost(rank, R, dist.group.WORLD, sock)
        if rank == 0:
            print("python buffer: %d ranks OK" % R, flush=True)
    dist.destroy_process_group()


def limit_gpus(n):
    """Only the first n GPUs (of CUDA_VISIBLE_DEVICES when set) for this
    process and the ranks it spawns; before torch counts the devices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(n)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:n])


def mps_running():
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return os.path.exists(os.path.join(pipe, "control"))


def share_gpus(R, ngpu):
    """Ranks a GPU holds with R ranks on ngpu GPUs; warns and sets the MPS
    share when they share (as the C harness, client/bench/harness.c)."""
    share = -(-R // ngpu)
    if share < 2:
        return share
    print("python buffer: %d ranks share %d GPU(s), rank i on GPU i %% %d: times here are not performance figures"
          % (R, ngpu, ngpu), flush=True)
    if mps_running():
        pct = 100 // (share + 1)  # 100 / share deadlocks (client/bench/harness.c)
        user = _mps_user
        if user and user.isdigit() and 1 <= int(user) < pct:
            pct = int(user)
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
        _mps_set.append(pct)
        print("python buffer: MPS is running: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%d for each rank" % pct, flush=True)
    return share


# The user's own value (kept when smaller), and the values set here for
# the current rank count (taken back before the next one).
_mps_user = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
_mps_set = []


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", help="comma-separated rank counts (1..8)")
    p.add_argument("--gpus", type=int, help="use only the first N GPUs")
    a = p.parse_args()
    if a.gpus is not None:
        if a.gpus < 1:
            p.error("--gpus must be at least 1")
        limit_gpus(a.gpus)
    if no_cuda():
        return 77
    ngpu = torch.cuda.device_count()
    try:
        counts = [int(x) for x in a.ranks.split(",")] if a.ranks else [min(4, ngpu)]
    except ValueError:
        p.error("--ranks takes comma-separated numbers, got %r" % a.ranks)
    for R in counts:
        if not 1 <= R <= 8:
            p.error("--ranks: %d is not in 1..8" % R)

    def run(sock):
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        for R in counts:
            shared = share_gpus(R, ngpu) > 1
            # NCCL refuses two ranks on one GPU: gloo carries the test's own
            # collectives then (moeep's data path does not use them).
            backend = "nccl" if dist.is_nccl_available() and not shared else "gloo"
            mp.spawn(rank_main, args=(R, ngpu, free_port(), sock, backend), nprocs=R, join=True)
            if _mps_set:
                os.environ.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
                if _mps_user is not None:
                    os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = _mps_user
                _mps_set.clear()
        return 0

    return with_moeepd("moeep-pybuf-", run)


if __name__ == "__main__":
    sys.exit(main())
