"""Helpers of the CPU tests: a private moeepd, and ranks as threads."""

import os
import shutil
import subprocess
import tempfile
import threading
import time
import unittest

from moeep import _job, _lib


def moeepd_path():
    repo = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
    return os.environ.get("MOEEP_TEST_MOEEPD") or os.path.join(repo, "build", "daemon", "moeepd")


class Daemon:
    """This build's moeepd on a socket in a fresh temporary directory."""

    def __init__(self):
        path = moeepd_path()
        if not os.access(path, os.X_OK):
            raise unittest.SkipTest("no moeepd at %s (set MOEEP_TEST_MOEEPD)" % path)
        self.dir = tempfile.mkdtemp(prefix="moeep-py-")
        self.socket = os.path.join(self.dir, "moeepd.sock")
        self.log = open(os.path.join(self.dir, "moeepd.log"), "w+")
        self.proc = subprocess.Popen([path, "--socket", self.socket, "--foreground",
                                      "--log-level", "info"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                _job.Client(self.socket).close()
                return
            except _lib.MoeepError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moeepd did not start:\n" + self.text())
                time.sleep(0.05)

    def text(self):
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.proc.returncode


class ThreadGroup:
    """broadcast / all_gather among n threads, standing in for
    torch.distributed in attach()."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots = [None] * n

    def broadcast(self, rank):
        def fn(value):
            if rank == 0:
                self.slots[0] = value
            self.barrier.wait()
            v = self.slots[0]
            self.barrier.wait()
            return v
        return fn

    def all_gather(self, rank):
        def fn(value):
            self.slots[rank] = value
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return fn

    def run(self, target):
        """Runs target(rank) on n threads; returns [(result, exception)]."""
        results = [(None, None)] * self.n

        def body(rank):
            try:
                results[rank] = (target(rank), None)
            except BaseException as e:  # reported to the test
                results[rank] = (None, e)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            if t.is_alive():
                raise AssertionError("a rank thread hung")
        return results
