#!/usr/bin/env python3
"""Elastic ranks through moeep.Buffer (issue 29), against torch references
that leave the lost rank out. One process per rank (rank i on GPU i % N),
a private moeepd; each part is a launch of its own, since its last rank
dies or stops.

  api      Buffer(enable_shrink=True): a full round; then the last rank
           stops calling and the others go on with active_ranks naming it
           inactive (the mask stays empty: active_ranks is the call's),
           then with it masked by low_latency_update_mask_buffer; query,
           unmask and clean of the mask.
  kill     the last rank is SIGKILLed while the others wait for it in a
           low-latency dispatch: their dispatch and combine complete without
           it, later rounds too, the mask holds it, low_latency_lost_ranks()
           says so. The time from the death to the daemon's word (a thread
           polls it) and to the end of the call in flight is printed; the
           first must be at most 10 ms.
  rebuild  normal mode: the last rank is SIGKILLed in a dispatch; the
           others' call raises MoeepError naming it within 100 ms; they
           destroy the Buffer and make a new one over a process group of the
           survivors (made beforehand: torch's new_group needs every rank),
           in the same processes, against the same moeepd, and dispatch and
           combine correctly (docs/reliability.md, "Rebuilding over the
           survivors").

Every low-latency round is checked per local expert: the slots in use hold
exactly the (rank, token) pairs of the sources not masked, from slot 0 on,
each source's run where layout_range says, rows bitwise (BF16) or within
the e4m3 tolerance (FP8); recv_count and the cumulative statistics agree;
combine is the top-k weighted sum of x * scale(expert) over the experts of
ranks not masked.

Usage: test_python_shrink.py [--ranks LIST] [--gpus N] [--parts LIST].
Exit 77 (meson: skipped) without torch or without a CUDA device.
Environment: MOEEP_LIBRARY, MOEEP_TEST_MOEEPD (meson sets both).
"""

import argparse
import os
import signal
import sys
import threading
import time

from launch import check, exit_on_failure, free_port, no_cuda, with_moeepd  # first: exits 77 without torch
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import moeep  # noqa: E402

H, EPR, K, NT = 2048, 8, 6, 64
MASK_LIMIT_MS = 10.0
DETECT_LIMIT_MS = 100.0


def inputs(s, rnd, R, seed=7):
    """Rank s's tokens of round rnd, the same on every rank (no collective
    needed after a rank died): x bf16 [T, H], top-k ids (-1 some), weights."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000003 + rnd * 101 + s)
    E = EPR * R
    T = int(torch.randint(1, NT + 1, (1,), generator=gen, device="cuda").item())
    x = (torch.randint(-16, 17, (T, H), generator=gen, device="cuda").float() / 16).to(torch.bfloat16)
    scores = torch.rand(T, E, generator=gen, device="cuda") + 1
    idx = torch.topk(scores, K, dim=1).indices.to(torch.int64)
    idx = torch.where(torch.rand(T, K, generator=gen, device="cuda") < 0.1, torch.full_like(idx, -1), idx)
    w = torch.rand(T, K, generator=gen, device="cuda")
    return x, idx.contiguous(), w.contiguous()


def scale_of(E):
    return 0.5 + (torch.arange(E, device="cuda") % 7).float() * 0.25


def ll_round(buf, rank, R, rnd, masked, fp8=False, hook=False, active=None, timeout_us=0, timed=None):
    """One checked dispatch + combine; `masked`: the ranks left out (masked
    before the call, or inactive). Returns the wall time when the dispatch
    had completed."""
    E, L = EPR * R, EPR
    x, idx, w = inputs(rank, rnd, R)
    ins = [inputs(s, rnd, R) for s in range(R)]
    stats = torch.zeros(L, dtype=torch.int32, device="cuda")
    kw = {} if active is None and not timeout_us else {"active_ranks": active, "timeout_us": timeout_us}
    recv, count, handle, _, fn = buf.low_latency_dispatch(x, idx, NT, E, cumulative_local_expert_recv_stats=stats,
                                                           use_fp8=fp8, return_recv_hook=hook, **kw)
    if hook:
        fn()
    torch.cuda.synchronize()
    done = time.monotonic()
    buf.check()
    rx = recv[0] if fp8 else recv
    src, rng = handle.src_info, handle.layout_range
    y = torch.zeros(L, R * NT, H, dtype=torch.bfloat16, device="cuda")
    sc = scale_of(E)
    for e in range(L):
        ge = rank * L + e
        n = int(count[e].item())
        check(int(stats[e].item()) == n, "expert %d: stats %d, recv_count %d" % (ge, int(stats[e].item()), n))
        begin, pairs = 0, []
        for s in range(R):
            c = int(rng[e, s].item()) & 0xFFFFFFFF
            want = int((ins[s][1] == ge).sum().item()) if s not in masked else 0
            check(c == want, "round %d expert %d: rank %d has %d slots, want %d" % (rnd, ge, s, c, want))
            if c:
                check(int(rng[e, s].item()) >> 32 == begin, "expert %d: rank %d's run starts at %d, want %d" %
                      (ge, s, int(rng[e, s].item()) >> 32, begin))
            toks = src[e, begin:begin + c].tolist()
            want_toks = (ins[s][1] == ge).any(1).nonzero().flatten().tolist() if c else []
            check(sorted(toks) == want_toks, "expert %d: rank %d's tokens" % (ge, s))
            pairs += [(s, t) for t in toks]
            begin += c
        check(n == begin, "expert %d: recv_count %d, runs %d" % (ge, n, begin))
        if not n:
            continue
        ref_rows = torch.stack([ins[s][0][t] for s, t in pairs])
        if fp8:
            deq = (rx[e, :n].float().view(n, H // 128, 128) * recv[1][e, :n].unsqueeze(2)).view(n, H)
            check(torch.allclose(deq, ref_rows.float(), rtol=0.07, atol=2e-2), "expert %d: fp8 rows" % ge)
        else:
            check(torch.equal(rx[e, :n], ref_rows), "expert %d: bf16 rows" % ge)
        y[e, :n] = (ref_rows.float() * sc[ge]).to(torch.bfloat16)
    out, _, fn2 = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook, **kw)
    if hook:
        fn2()
    torch.cuda.synchronize()
    buf.check()
    ref = torch.zeros(x.shape[0], H, device="cuda")
    for k in range(K):
        e = idx[:, k]
        ok = (e >= 0) & ~torch.isin(e.clamp(min=0) // L, torch.tensor(sorted(masked), dtype=torch.int64, device="cuda"))
        f = torch.where(ok, w[:, k] * sc[e.clamp(min=0)], torch.zeros_like(w[:, k]))
        ref += f.unsqueeze(1) * x.float()
    check(torch.allclose(out.float(), ref, rtol=3e-2, atol=5e-2), "round %d: combine (left out %s)" %
          (rnd, sorted(masked)))
    return done


def mask_of(buf, R):
    m = torch.full((R,), 7, dtype=torch.int32, device="cuda")
    buf.low_latency_query_mask_buffer(m)
    torch.cuda.synchronize()
    return {r for r in range(R) if int(m[r].item())}


def new_buffer(group, sock, R, timeout_ms=0):
    return moeep.Buffer(group, low_latency_mode=True, enable_shrink=True, socket=sock, explicitly_destroy=True,
                        hidden=H, num_experts=EPR * R, num_max_dispatch_tokens_per_rank=NT, max_topk=K,
                        shrink_timeout_ms=timeout_ms)


def part_api(rank, R, sock, survivors):
    victim = R - 1
    buf = new_buffer(dist.group.WORLD, sock, R, timeout_ms=500)
    check(mask_of(buf, R) == set(), "a fresh mask is empty")
    ll_round(buf, rank, R, 0, set())
    ll_round(buf, rank, R, 1, set(), fp8=True, hook=True)
    check(mask_of(buf, R) == set(), "nothing masked after full rounds")
    dist.barrier()
    if rank == victim:
        dist.barrier()  # the others are done with their calls
        buf.destroy()
        return
    active = torch.ones(R, dtype=torch.int32, device="cuda")
    active[victim] = 0
    ll_round(buf, rank, R, 2, {victim}, active=active, timeout_us=2000000)
    check(mask_of(buf, R) == set(), "active_ranks is the call's: the mask stays empty")
    check(active.tolist() == [0 if r == victim else 1 for r in range(R)], "active_ranks: %s" % active.tolist())
    buf.low_latency_update_mask_buffer(victim, True)
    check(mask_of(buf, R) == {victim}, "update_mask_buffer(%d, True)" % victim)
    ll_round(buf, rank, R, 3, {victim}, hook=True)
    ll_round(buf, rank, R, 4, {victim}, fp8=True)
    check(mask_of(buf, R) == {victim}, "the mask after rounds without rank %d" % victim)
    buf.low_latency_update_mask_buffer(victim, False)
    check(mask_of(buf, R) == set(), "update_mask_buffer(%d, False)" % victim)
    buf.low_latency_update_mask_buffer(victim, True)
    buf.low_latency_clean_mask_buffer()
    check(mask_of(buf, R) == set(), "clean_mask_buffer")
    dist.barrier()
    buf.destroy()


def poll_lost(buf, victim, box):
    t_end = time.monotonic() + 10
    while time.monotonic() < t_end and "lost" not in box:
        if victim in buf.low_latency_lost_ranks():
            box["lost"] = time.monotonic()
            return
        time.sleep(0.00002)


def part_kill(rank, R, sock, survivors, death):
    victim = R - 1
    buf = new_buffer(dist.group.WORLD, sock, R)
    ll_round(buf, rank, R, 0, set())
    torch.cuda.synchronize()
    dist.barrier()
    if rank == victim:
        time.sleep(0.05)
        death.value = time.monotonic()
        os.kill(os.getpid(), signal.SIGKILL)
    box = {}
    th = threading.Thread(target=poll_lost, args=(buf, victim, box))
    th.start()
    done = ll_round(buf, rank, R, 1, {victim})  # the victim never dispatches: none of its tokens come
    th.join()
    check("lost" in box, "rank %d never showed as lost" % victim)
    lost_ms, done_ms = (box["lost"] - death.value) * 1e3, (done - death.value) * 1e3
    print("python shrink: rank %d: death to mask %.2f ms, to the end of the call in flight %.1f ms" %
          (rank, lost_ms, done_ms), flush=True)
    check(lost_ms <= MASK_LIMIT_MS, "death to mask %.2f ms, limit %.0f" % (lost_ms, MASK_LIMIT_MS))
    check(mask_of(buf, R) == {victim}, "the mask after the death")
    check(buf.low_latency_lost_ranks() == [victim], "lost ranks %s" % buf.low_latency_lost_ranks())
    ll_round(buf, rank, R, 2, {victim}, hook=True)
    ll_round(buf, rank, R, 3, {victim}, fp8=True)
    buf.clean_low_latency_buffer(NT, H, EPR * R)
    check(mask_of(buf, R) == {victim}, "the mask after clean")
    ll_round(buf, rank, R, 4, {victim})
    dist.barrier(group=survivors)
    buf.destroy()


def normal_round(buf, rank, R, rnd):
    """Normal dispatch + combine of the identity: each token comes back as x
    times the ranks it reached."""
    x, idx, _ = inputs(rank, 100 + rnd, R)
    E = EPR * R
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=idx)
    out, _, _ = buf.combine(recv_x, handle)
    torch.cuda.synchronize()
    reached = torch.zeros(x.shape[0], R, dtype=torch.bool, device="cuda")
    for k in range(K):
        ok = idx[:, k] >= 0
        reached[ok, idx[ok, k] // EPR] = True
    ref = x.float() * reached.sum(1, keepdim=True).float()
    check(torch.equal(out.float(), ref), "normal round %d: combine" % rnd)


def part_rebuild(rank, R, sock, survivors, death):
    victim = R - 1
    buf = moeep.Buffer(dist.group.WORLD, socket=sock, explicitly_destroy=True, hidden=H, num_experts=EPR * R,
                       max_tokens_per_rank=NT, max_topk=K)
    normal_round(buf, rank, R, 0)
    dist.barrier()
    if rank == victim:
        time.sleep(0.05)
        death.value = time.monotonic()
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        normal_round(buf, rank, R, 1)
        buf.check()
    except moeep.MoeepError as e:
        ms = (time.monotonic() - death.value) * 1e3
        check("rank %d lost" % victim in str(e), "the error names the lost rank: %s" % e)
        check(ms <= DETECT_LIMIT_MS, "the error came %.1f ms after the death (limit %.0f)" % (ms, DETECT_LIMIT_MS))
        print("python shrink: rank %d: normal-mode error %.1f ms after the death" % (rank, ms), flush=True)
    else:
        raise AssertionError("a normal-mode call without rank %d did not raise" % victim)
    try:
        buf.destroy()
    except moeep.MoeepError:
        pass  # the job is gone; nothing else is left
    # The rebuild: a Buffer over the survivors, same processes, same daemon.
    R1 = R - 1
    buf = moeep.Buffer(survivors, socket=sock, explicitly_destroy=True, hidden=H, num_experts=EPR * R1,
                       max_tokens_per_rank=NT, max_topk=K)
    for rnd in (2, 3):
        normal_round(buf, rank, R1, rnd)
    dist.barrier(group=survivors)
    buf.destroy()


def rank_main(rank, R, ngpu, port, sock, backend, part, death):
    torch.cuda.set_device(rank % ngpu)
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=R)
    survivors = dist.new_group(list(range(R - 1)))  # every rank makes it; the last is not in it
    with exit_on_failure():
        if part == "api":
            part_api(rank, R, sock, survivors)
        elif part == "kill":
            part_kill(rank, R, sock, survivors, death)
        else:
            part_rebuild(rank, R, sock, survivors, death)
        if rank == 0:
            print("python shrink: %s, %d ranks OK" % (part, R), flush=True)
    # The last rank may be dead: no collective teardown.
    sys.stdout.flush()
    os._exit(0)


def launch(R, ngpu, sock, backend, part):
    """Runs one part; the last rank must end by SIGKILL in kill and rebuild,
    every other rank with status 0."""
    ctx = mp.get_context("spawn")
    death = ctx.Value("d", 0.0)
    procs = []
    port = free_port()
    for r in range(R):
        p = ctx.Process(target=rank_main, args=(r, R, ngpu, port, sock, backend, part, death))
        p.start()
        procs.append(p)
    bad = 0
    for r, p in enumerate(procs):
        p.join(600)
        if p.is_alive():
            p.kill()
            p.join()
        want = -signal.SIGKILL if part != "api" and r == R - 1 else 0
        if p.exitcode != want:
            print("FAIL: %s, %d ranks: rank %d exited with %s, want %d" % (part, R, r, p.exitcode, want), flush=True)
            bad = 1
    return bad


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts (2..8)")
    p.add_argument("--gpus", type=int, help="use only the first N GPUs")
    p.add_argument("--parts", default="api,kill,rebuild")
    a = p.parse_args()
    if a.gpus is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(a.gpus)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:a.gpus])
    if no_cuda():
        return 77
    ngpu = torch.cuda.device_count()
    counts = [int(x) for x in a.ranks.split(",")]
    parts = a.parts.split(",")

    def run(sock):
        bad = 0
        for R in counts:
            if not 2 <= R <= 8:
                print("SKIP ranks=%d: 2..8 ranks" % R)
                continue
            for part in parts:
                # gloo: the test's own collectives are barriers, and a
                # rank of the world group dies.
                bad |= launch(R, ngpu, sock, "gloo", part)
        print("python shrink: %s" % ("FAIL" if bad else "all parts passed"), flush=True)
        return 1 if bad else 0

    return with_moeepd("moeep-pyshrink-", run)


if __name__ == "__main__":
    sys.exit(main())
