"""MOEEP_HOST_TIME=1: every Buffer communication call times itself on the
host (time.perf_counter around the call), and the process writes, when it
exits, one line per method to stderr: calls, median, p90 and max in
microseconds. For finding where an engine's step spends host time without
a profiler; off (no wrapper at all) unless the variable is set. When it
names a folder, every call's time is written there too, as JSON
(hosttime-<pid>.json, one list per method, appended at each report). The lines
come at Buffer.destroy() too (processes that torch.multiprocessing starts
end without running atexit), and then start again from zero."""

import atexit
import functools
import json
import os
import statistics
import sys
import time

METHODS = ("dispatch", "combine", "low_latency_dispatch", "low_latency_combine", "get_dispatch_layout")


def install(cls):
    """Wraps cls's METHODS when MOEEP_HOST_TIME is set; returns cls."""
    if not os.environ.get("MOEEP_HOST_TIME"):
        return cls
    times = {}
    for name in METHODS:
        times[name] = []
        setattr(cls, name, _timed(getattr(cls, name), times[name]))
    destroy = cls.destroy

    @functools.wraps(destroy)
    def destroy_and_report(self):
        _report(times)
        return destroy(self)
    cls.destroy = destroy_and_report
    atexit.register(_report, times)
    return cls


def _timed(fn, out):
    clock = time.perf_counter

    @functools.wraps(fn)
    def call(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            out.append((clock() - t0) * 1e6)
    return call


def _report(times):
    folder = os.environ.get("MOEEP_HOST_TIME", "")
    if os.path.isdir(folder) and any(times.values()):
        with open(os.path.join(folder, "hosttime-%d.json" % os.getpid()), "a") as f:
            f.write(json.dumps(times) + "\n")
    for name, v in times.items():
        if v:
            v = v[:]
            times[name].clear()
            v.sort()
            sys.stderr.write("moeep host time, pid %d: %s: %d calls, median %.1f us, p90 %.1f, max %.1f\n" %
                             (os.getpid(), name, len(v), statistics.median(v), v[int(0.9 * (len(v) - 1))], v[-1]))
