"""`python3 -m moeep.bench`: the engine path, timed the way engines call it.

Engines (vLLM, SGLang) reach moeep through DeepEP's Python API and call it
back to back, without host synchronisation between calls. This benchmark
does the same at the standard shapes, one process per GPU (rank i on GPU
i % GPUs), through `moeep.Buffer` or, with --impl deep_ep, through whatever
`import deep_ep` gives (the real DeepEP, built on the same machine, for a
side-by-side run):

  normal mode   dispatch BF16 with fresh routing, the same with a cached
                handle, FP8 with a cached handle (scales column-major, as
                DeepEP's tests pass them), combine, and a dispatch with
                num_worst_tokens (no host wait) and its combine, eager and
                replayed from a CUDA graph (vLLM's graph prefill);
  low latency   FP8 dispatch + BF16 combine as one decode step, eager
                (back to back) and replayed from a CUDA graph, each also
                timed in groups of 8 steps between two events.

For each figure: the median and the mean of per-call CUDA-event times
taken as DeepEP's own bench() takes them (an event before and after every
call, the calls issued back to back, one synchronise at the end; when the
host is slower than the GPU these include the host's gaps), the wall time
per call over the whole series (host-bound or GPU-bound, whichever is
slower), and the median host CPU time inside the call (perf_counter; a
fresh normal dispatch waits for the token counts inside the call, in moeep
as in DeepEP). Bandwidths use DeepEP's tests' conventions. Every rank
measures; the table shows the slowest rank's medians.

Needs torch with CUDA and a moeepd ($MOEEP_SOCKET, --socket, or --moeepd
PATH to start a private one). --profile adds a cProfile of rank 0's fresh
normal dispatches and eager low-latency steps (where the host time goes).
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import socket as _socket
import statistics
import subprocess
import sys
import tempfile
import time


def _args(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m moeep.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=0, help="processes (default: the GPUs)")
    p.add_argument("--impl", choices=("moeep", "deep_ep"), default="moeep",
                   help="moeep.Buffer, or the Buffer of `import deep_ep` (the real DeepEP for a side-by-side run)")
    p.add_argument("--modes", default="normal,ll", help="normal, ll or both (default)")
    p.add_argument("--tokens", type=int, default=4096, help="normal mode: tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256, help="normal mode: experts")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-sms", type=int, default=24, help="normal mode: SMs (Buffer.set_num_sms)")
    p.add_argument("--nvl-bytes", type=int, default=int(1e9), help="normal mode: num_nvl_bytes")
    p.add_argument("--ll-tokens", type=int, default=128, help="low latency: tokens per rank")
    p.add_argument("--ll-experts", type=int, default=288, help="low latency: experts")
    p.add_argument("--iters", type=int, default=200, help="timed calls per figure")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--socket", help="moeepd's socket (default: $MOEEP_SOCKET)")
    p.add_argument("--moeepd", help="start a private moeepd from this binary for the run")
    p.add_argument("--profile", action="store_true",
                   help="cProfile rank 0's fresh normal dispatches and eager low-latency steps")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _routing(torch, T, E, K, seed, rank, device):
    """DeepEP's tests' routing: top-k of |randn| + 1, ten entries masked."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    scores = torch.randn(T, E, generator=g, device=device).abs() + 1
    idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1].to(torch.int64)
    if T:
        rows = torch.randint(0, T, (10,), generator=g, device=device)
        cols = torch.randint(0, K, (10,), generator=g, device=device)
        idx[rows, cols] = -1
    w = torch.randn(T, K, generator=g, device=device).abs()
    return idx.contiguous(), w.contiguous()


def _fp8(torch, x):
    """e4m3 with one float scale per 128 channels; scales column-major, as
    DeepEP's test_intranode passes them (x[1].T.contiguous().T)."""
    T, H = x.shape
    xv = x.float().view(T, H // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    q = (xv * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(T, H)
    return q, (amax / 448.0).T.contiguous().T


def _series(torch, fn, iters, warmup, cache, per=1, steps=1):
    """Runs fn back to back as DeepEP's bench(): warm-ups, an L2 flush, then
    `iters` calls each between two events, one synchronise at the end; with
    `per` > 1, `iters` groups of `per` calls, each group between two events
    (as an engine's loop, which records no event per call). Returns (event
    times us, host times us, wall us), each per step: a call of fn holds
    `steps` (a graph replay of two decode steps: 2)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    cache.zero_()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    host = []
    clock = time.perf_counter
    # Recorded on the stream fetched once: Event.record() with no stream
    # looks the current one up each time (7 us on the Xeon hosts), host
    # time of the harness that would show in the step where the GPU waits
    # for the host (2 ranks, low latency).
    stream = torch.cuda.current_stream()
    t0 = clock()
    for i in range(iters):
        starts[i].record(stream)
        h0 = clock()
        for _ in range(per):
            fn()
        host.append((clock() - h0) * 1e6 / (per * steps))
        ends[i].record(stream)
    torch.cuda.synchronize()
    wall = (clock() - t0) * 1e6 / (iters * per * steps)
    ev = [s.elapsed_time(e) * 1e3 / (per * steps) for s, e in zip(starts, ends)][1:]
    return ev, host[1:], wall


def _summary(ev, host, wall, nbytes=None):
    dump = os.environ.get("MOEEP_BENCH_DUMP")  # a folder: every series' per-call times, per rank
    if dump:
        with open(os.path.join(dump, "series-%d.jsonl" % os.getpid()), "a") as f:
            f.write(json.dumps({"event_us": ev, "host_us": host}) + "\n")
    med = statistics.median(ev)
    q = statistics.quantiles(ev, n=10)
    out = {"us_median": med, "us_mean": statistics.fmean(ev), "us_min": min(ev), "us_p90": q[-1],
           "us_max": max(ev), "wall_us": wall, "host_us": statistics.median(host)}
    if nbytes:
        out["GB/s"] = nbytes / med / 1e3
    return out


def _normal(torch, deep_ep, a, rank, R, group, device, cache):
    T, H, E, K = a.tokens, a.hidden, a.experts, a.topk
    buf = deep_ep.Buffer(group, a.nvl_bytes, 0, explicitly_destroy=True)
    deep_ep.Buffer.set_num_sms(a.num_sms)
    cfg = deep_ep.Buffer.get_dispatch_config(R)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    xq = _fp8(torch, x)
    idx, w = _routing(torch, T, E, K, a.seed, rank, device)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=cfg)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, **args)
    n_recv = recv_x.shape[0]
    res = {}
    res["dispatch BF16 (fresh routing)"] = _summary(
        *_series(torch, lambda: buf.dispatch(x, **args), a.iters, a.warmup, cache), n_recv * H * 2)
    if a.profile:
        res["_profile_normal"] = _profile(torch, lambda: buf.dispatch(x, **args), 50)
    res["dispatch BF16 (cached handle)"] = _summary(
        *_series(torch, lambda: buf.dispatch(x, handle=handle, config=cfg), a.iters, a.warmup, cache),
        n_recv * H * 2)
    res["dispatch FP8 (cached handle)"] = _summary(
        *_series(torch, lambda: buf.dispatch(xq, handle=handle, config=cfg), a.iters, a.warmup, cache),
        n_recv * (H + H // 128 * 4))
    ccfg = deep_ep.Buffer.get_combine_config(R)
    res["combine"] = _summary(
        *_series(torch, lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=ccfg), a.iters,
                 a.warmup, cache), n_recv * H * 2)
    # vLLM's graph prefill: a dispatch with num_worst_tokens (no host wait;
    # every rank's whole share of rows comes back) and its combine, eager
    # and replayed from a CUDA graph.
    W = R * T

    def worst():
        rx, _, rw, _, h, _ = buf.dispatch(x, num_worst_tokens=W, **args)
        buf.combine(rx, h, topk_weights=rw, config=ccfg)

    def replay():
        return _capture(torch, device, worst, 1).replay

    for name, fn in (("dispatch + combine, num_worst_tokens", lambda: worst),
                     ("dispatch + combine, num_worst_tokens, CUDA graph", replay)):
        try:  # (no rounds with num_worst_tokens, and a library may lack capture support)
            res[name] = _summary(*_series(torch, fn(), a.iters, a.warmup, cache), 2 * n_recv * H * 2)
        except Exception as e:
            res[name] = {"error": "%s: %s" % (type(e).__name__, e)}
        torch.cuda.synchronize()
    del recv_x, recv_idx, recv_w, handle
    torch.cuda.synchronize()
    buf.destroy()
    return res


# Low latency is also timed in groups of this many steps between two events
# (an even number: a graph replay is two steps).
_GROUP = 8


def _ll(torch, deep_ep, a, rank, R, group, device, cache):
    T, H, E, K = a.ll_tokens, a.hidden, a.ll_experts, a.topk
    nbytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buf = deep_ep.Buffer(group, 0, nbytes, low_latency_mode=True, num_qps_per_rank=max(E // R, 1),
                         explicitly_destroy=True)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device) * 0.1
    idx, w = _routing(torch, T, E, K, a.seed, rank, device)
    L = E // R
    stats = torch.zeros(L, dtype=torch.int32, device=device)
    y = torch.randn(L, R * T, H, dtype=torch.bfloat16, device=device)
    pairs = int((idx >= 0).sum().item())

    def dispatch():  # returns the handle
        return buf.low_latency_dispatch(x, idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=True,
                                        async_finish=False, return_recv_hook=False)[2]

    def combine(handle):
        buf.low_latency_combine(y, idx, w, handle, async_finish=False, return_recv_hook=False)

    def step():
        combine(dispatch())

    res = {}
    comm = pairs * ((H + H / 128 * 4 + 16) + H * 2)  # DeepEP's test: FP8 pairs out, BF16 pairs back
    res["LL dispatch + combine, eager"] = _summary(*_series(torch, step, a.iters, a.warmup, cache), comm)
    groups = max(a.iters // _GROUP, 10)  # event pairs of the grouped series
    res["LL eager, %d steps per event pair" % _GROUP] = _summary(
        *_series(torch, step, groups, a.warmup, cache, _GROUP), comm)
    if a.impl == "moeep":
        # The calls in C (moeep/_fast.py), where built: made with the
        # endpoint, at the first call; only these calls ran since.
        import moeep._fast
        fast = buf._fast
        res["_fast"] = "low-latency calls in C: %s; %d of the %d eager dispatches ran there" % (
            moeep._fast.status(), fast.counts()[0] if fast is not None else 0,
            a.iters + 2 * a.warmup + groups * _GROUP)
    if os.environ.get("MOEEP_BENCH_DUMP"):
        _ll_split(torch, dispatch, combine, rank, a.iters, cache)
    if a.profile:
        res["_profile"] = _profile(torch, step, 100)
        if a.impl == "moeep":
            res["_profile"] += _c_calls(torch, buf, step)
    # Two steps per graph: the buffer sets alternate per dispatch, so an even
    # number keeps every replay on the same pattern.
    graph_ok = True
    try:
        g = _capture(torch, device, step, 2)
        res["LL dispatch + combine, CUDA graph"] = _summary(
            *_series(torch, g.replay, max(a.iters // 2, 10), a.warmup // 2 + 1, cache, steps=2), comm)
        res["LL graph, %d steps per event pair" % _GROUP] = _summary(
            *_series(torch, g.replay, groups, a.warmup // 2 + 1, cache, _GROUP // 2, steps=2), comm)
    except Exception as e:  # a library without capture support still gets its eager figures
        graph_ok = False
        res["LL dispatch + combine, CUDA graph"] = {"error": "%s: %s" % (type(e).__name__, e)}
    torch.cuda.synchronize()
    if graph_ok:
        del g
    buf.destroy()
    return res


def _capture(torch, device, fn, n):
    """A CUDA graph of n calls of fn, after n calls on a side stream (what
    the calls allocate or set up on first use stays out of the graph)."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return g


def _ll_split(torch, dispatch, combine, rank, iters, cache):
    """MOEEP_BENCH_DUMP only: the eager step again, with an event between
    its dispatch and its combine, every step's two times dumped (where a
    tail is: dispatch or combine, which steps)."""
    cache.zero_()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for i in range(iters):
        ev[i][0].record()
        handle = dispatch()
        ev[i][1].record()
        combine(handle)
        ev[i][2].record()
    torch.cuda.synchronize()
    d = [e[0].elapsed_time(e[1]) * 1e3 for e in ev]
    c = [e[1].elapsed_time(e[2]) * 1e3 for e in ev]
    gap = [ev[i][2].elapsed_time(ev[i + 1][0]) * 1e3 for i in range(iters - 1)]
    with open(os.path.join(os.environ["MOEEP_BENCH_DUMP"], "ll-split-%d.jsonl" % rank), "a") as f:
        f.write(json.dumps({"rank": rank, "dispatch_us": d, "combine_us": c, "gap_us": gap}) + "\n")


def _profile(torch, fn, n):
    """cProfile of n back-to-back calls of fn, the 25 costliest functions by
    their own time. Every rank makes the calls (they are collective); rank
    0 reports."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    return s.getvalue()


def _c_calls(torch, buf, step):
    """Host time of libmoeep's two calls alone (the arguments the Python
    layer filled last; each combine with the handle of the dispatch before
    it), against the whole step: what the Python layer adds. Every rank
    makes the same calls."""
    import ctypes
    ep, hook = buf._ep, buf._ll_no_hook_ref
    ptr = torch.cuda.current_stream().cuda_stream
    step()  # fills the argument structures
    torch.cuda.synchronize()
    buf._ll_combine_args.handle = ctypes.pointer(buf._ll_dispatch_res.handle)
    times = []
    for _ in range(100):
        t0 = time.perf_counter()
        ep.lib.moeep_ll_dispatch(ep.ptr, buf._ll_dispatch_args_ref, buf._ll_dispatch_res_ref, hook, ptr)
        ep.lib.moeep_ll_combine(ep.ptr, buf._ll_combine_args_ref, hook, ptr)
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return "\nlibmoeep's dispatch + combine calls alone, host: median %.1f us per step\n" % statistics.median(times)


def _rank(local, a, port, sock, queue):
    import torch
    import torch.distributed as dist

    if a.impl == "deep_ep":
        import deep_ep
    else:
        import moeep as deep_ep
    ngpu = torch.cuda.device_count()
    torch.cuda.set_device(local % ngpu)
    device = torch.device("cuda", local % ngpu)
    if sock:
        os.environ["MOEEP_SOCKET"] = sock
    shared_gpu = a.ranks > ngpu
    dist.init_process_group("gloo" if shared_gpu else "nccl", init_method="tcp://127.0.0.1:%d" % port,
                            world_size=a.ranks, rank=local)
    group = dist.new_group(list(range(a.ranks)))
    cache = torch.empty(int(256e6 // 4), dtype=torch.int32, device=device)
    out = {}
    modes = a.modes.split(",")
    # Low latency first: the normal part captures a graph, after which
    # moeep's low-latency launches of both phases stay cooperative
    # (kernels/common/coop.cuh), as in an engine that captured one.
    if "ll" in modes:
        out.update(_ll(torch, deep_ep, a, local, a.ranks, group, device, cache))
    dist.barrier()
    if "normal" in modes:
        out.update(_normal(torch, deep_ep, a, local, a.ranks, group, device, cache))
    dist.barrier()
    queue.put((local, out))
    dist.destroy_process_group()


def _report(a, results, impl, info):
    R = a.ranks
    names = [k for k in results[0] if not k.startswith("_")]
    rows = []
    for name in names:
        per = [results[r][name] for r in range(R)]
        if "error" in per[0]:
            rows.append((name, per[0]["error"]))
            continue
        slow = max(per, key=lambda v: v["us_median"])
        rows.append((name, {k: max(v[k] for v in per) if k != "GB/s" else min(v[k] for v in per)
                            for k in slow}))
    if a.json:
        print(json.dumps({"impl": impl, "ranks": R, "info": info, "figures": dict(rows)}, indent=1))
        return
    print("moeep.bench: %s, %d ranks, %s" % (impl, R, info))
    print("%-34s %9s %9s %9s %9s %9s %9s %7s" % ("figure (slowest rank)", "median us", "mean us", "p90 us",
                                                 "max us", "wall us", "host us", "GB/s"))
    for name, v in rows:
        if isinstance(v, str):
            print("%-34s %s" % (name, v))
            continue
        print("%-34s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %7s" % (
            name, v["us_median"], v["us_mean"], v["us_p90"], v["us_max"], v["wall_us"], v["host_us"],
            "%.0f" % v["GB/s"] if "GB/s" in v else "-"))
    if "_fast" in results[0]:
        print("rank 0: " + results[0]["_fast"])
    if "_profile_normal" in results[0]:
        print("\ncProfile of rank 0, 50 fresh normal dispatches:\n" + results[0]["_profile_normal"])
    if "_profile" in results[0]:
        print("\ncProfile of rank 0, 100 eager low-latency steps:\n" + results[0]["_profile"])


def main(argv=None):
    a = _args(argv)
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        print("moeep.bench: no CUDA device")
        return 1
    a.ranks = a.ranks or torch.cuda.device_count()
    for v in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(v, "0" if v == "NCCL_NVLS_ENABLE" else "1")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    daemon, tmp = None, None
    sock = a.socket
    if a.impl == "moeep" and a.moeepd:
        tmp = tempfile.mkdtemp(prefix="moeep-bench-")
        sock = os.path.join(tmp, "moeepd.sock")
        daemon = subprocess.Popen([a.moeepd, "--socket", sock, "--foreground", "--no-config",
                                   "--log-level", "warning"])
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
    try:
        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, a, port, sock, queue)) for r in range(a.ranks)]
        for p in procs:
            p.start()
        results = {}
        while len(results) < a.ranks:
            try:
                r, out = queue.get(timeout=2)
                results[r] = out
            except Exception:  # queue.Empty: give up once a rank died
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.join(timeout=30 if len(results) == a.ranks else 1)
            if p.is_alive():
                p.kill()
        if len(results) < a.ranks:
            print("moeep.bench: ranks %s failed" % sorted(set(range(a.ranks)) - set(results)))
            return 1
        name = torch.cuda.get_device_name(0)
        info = "%s, tokens %d (LL %d), hidden %d, top-%d of %d (LL %d)" % (
            name, a.tokens, a.ll_tokens, a.hidden, a.topk, a.experts, a.ll_experts)
        impl = a.impl
        if a.impl == "deep_ep":
            import importlib.util
            spec = importlib.util.find_spec("deep_ep")
            impl = "deep_ep from %s" % (spec.origin if spec else "?")
        _report(a, results, impl, info)
        return 0 if all(p.exitcode == 0 for p in procs) else 1
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait()
        if tmp is not None:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
