"""What the Python GPU tests (test_python_buffer.py, test_deepep_semantics.py)
share: client/python of this tree on sys.path, exit 77 (meson: skipped)
without torch or without a CUDA device, a private moeepd for the run, and
rank processes that end at once when their tests fail. Imported before
torch and moeep; test code."""

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))

try:
    import torch
    import torch.multiprocessing as mp
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(77)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def no_cuda():
    """True, after saying SKIP, when torch sees no CUDA device."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("SKIP: no CUDA device")
        return True
    return False


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def exit_on_failure():
    """Around a rank's tests: a failure is printed and ends the process at
    once with status 1, so that it does not wait in a collective for the
    ranks that passed (torch.multiprocessing then reports it)."""
    try:
        yield
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)


def with_moeepd(prefix, body):
    """Starts a private moeepd ($MOEEP_TEST_MOEEPD, else build/daemon/moeepd)
    on a socket in a new temporary directory named prefix..., runs
    body(socket path) and stops the daemon. Returns what body returns, or 1
    after a FAIL line when a rank process failed."""
    moeepd = os.environ.get("MOEEP_TEST_MOEEPD") or os.path.join(REPO, "build", "daemon", "moeepd")
    tmp = tempfile.mkdtemp(prefix=prefix)
    sock = os.path.join(tmp, "moeepd.sock")
    daemon = subprocess.Popen([moeepd, "--socket", sock, "--foreground", "--no-config", "--log-level", "warning"])
    try:
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        return body(sock)
    except mp.ProcessExitedException as e:
        print("FAIL: %s" % e)
        return 1
    finally:
        daemon.terminate()
        daemon.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
