"""The data-plane endpoint (struct moeep_ep) without torch: create, destroy,
error text. Buffer drives the calls that take device pointers."""

import ctypes
import os

from . import _lib
from ._lib import MoeepError


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
        r = self.lib.moeep_ep_create(client.ptr, ctypes.byref(config), ctypes.byref(self._ptr))
        if r < 0:
            # moeep_ep_create leaves its reason on the client handle.
            why = client.error() or os.strerror(-r)
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
