"""The data-plane endpoint (struct moeep_ep) without torch: create, destroy,
error text. Buffer drives the calls that take device pointers."""

import contextlib
import ctypes
import os
import sys
import tempfile

from . import _lib
from ._lib import MoeepError


@contextlib.contextmanager
def _stderr_captured():
    """Captures file descriptor 2 (and copies it back to the real stderr
    afterwards). moeep_ep_create() frees a failed endpoint together with its
    error text and leaves that text on stderr only ("moeep: rank N: ..."),
    so this is the one way to put it into the exception."""
    box = []
    try:
        sys.stderr.flush()
    except Exception:
        pass
    saved = os.dup(2)
    tmp = tempfile.TemporaryFile()
    try:
        os.dup2(tmp.fileno(), 2)
        yield box
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        tmp.seek(0)
        data = tmp.read()
        tmp.close()
        if data:
            os.write(2, data)
        box.append(data.decode("utf-8", "replace"))


def _create_message(text):
    lines = [ln for ln in text.splitlines() if ln.startswith("moeep: rank")]
    return lines[-1][len("moeep: "):] if lines else ""


class Endpoint(_lib.Handle):
    """One rank's attachment to the job's NVLink buffers. Collective."""

    _error_fn = "moeep_ep_error"
    _gone = "the moeep endpoint was destroyed"

    def __init__(self, client, config):
        self.lib = client.lib
        self.lib.require_data_plane()
        self.client = client
        self.config = config
        self._ptr = ctypes.c_void_p()
        with _stderr_captured() as box:
            r = self.lib.moeep_ep_create(client.ptr, ctypes.byref(config), ctypes.byref(self._ptr))
        if r < 0:
            why = _create_message(box[0] if box else "") or client.error() or os.strerror(-r)
            raise MoeepError(-r, "moeep_ep_create (max_tokens_per_rank %d, hidden %d, %d experts, max_topk %d, "
                                 "ll_max_tokens %d): %s" %
                             (config.max_tokens_per_rank, config.hidden, config.num_experts, config.max_topk,
                              config.ll_max_tokens, why))

    def buffer_bytes(self):
        return self.lib.moeep_ep_buffer_bytes(self.ptr)

    def destroy(self):
        if self._ptr:
            self.lib.moeep_ep_destroy(self._ptr)
            self._ptr = ctypes.c_void_p()
