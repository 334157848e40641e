"""moeep.Buffer's elastic ranks (part of moeep.buffer): DeepEP's shrink mode
(Buffer(..., enable_shrink=True) and the three mask calls), and what the
low-latency calls' active_ranks / timeout_us keywords check. A mixin of
Buffer; see client/lib/include/moeep_ep.h, "Elastic ranks", for the
semantics."""

import ctypes
import errno as _errno

from ._lib import MoeepError
from ._tensors import _check_tensor
from .config import LowLatencySizeHint
from .event import _torch


class _ShrinkMode:
    """Buffer's mask calls. They use what Buffer sets up: _ep, enable_shrink,
    device, group_size."""

    def _require_shrink(self, what):
        if not getattr(self, "enable_shrink", False):
            raise ValueError("%s needs Buffer(..., low_latency_mode=True, enable_shrink=True)" % what)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Masks (mask=True) or unmasks rank_to_mask for the low-latency calls
        (dispatch, combine and clean), on the current stream. A masked rank
        is neither sent to nor waited for: its tokens are dropped from
        dispatch and its experts left out of combine. Unmask only a rank that
        kept making the same low-latency calls (moeep_ep.h)."""
        self._require_shrink("low_latency_update_mask_buffer")
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) or \
                not 0 <= rank_to_mask < self.group_size:
            raise ValueError("rank_to_mask must be a rank in 0..%d, not %r" % (self.group_size - 1, rank_to_mask))
        if self._ep is None:
            if mask:
                raise MoeepError(_errno.EAGAIN, "low_latency_update_mask_buffer: the endpoint is made at the first "
                                 "call; pass hidden= and num_experts= to Buffer() to mask before it")
            return  # nothing is masked yet
        torch = _torch()
        self._ep.check(self._ep.lib.moeep_ll_mask_update(self._ep.ptr, rank_to_mask, bool(mask),
                                                         torch.cuda.current_stream(self.device).cuda_stream),
                       "low_latency_update_mask_buffer")

    def low_latency_query_mask_buffer(self, mask_status):
        """Writes the mask into mask_status (torch.int [num_ranks] on this
        Buffer's device; 1 = masked) on the current stream."""
        self._require_shrink("low_latency_query_mask_buffer")
        torch = _torch()
        _check_tensor(torch, mask_status, "mask_status", torch.int32, self.device, (self.group_size,))
        if self._ep is None:
            mask_status.zero_()
            return
        self._ep.check(self._ep.lib.moeep_ll_mask_query(self._ep.ptr, mask_status.data_ptr(),
                                                        torch.cuda.current_stream(self.device).cuda_stream),
                       "low_latency_query_mask_buffer")

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank, on the current stream."""
        self._require_shrink("low_latency_clean_mask_buffer")
        if self._ep is None:
            return
        torch = _torch()
        self._ep.check(self._ep.lib.moeep_ll_mask_clean(self._ep.ptr,
                                                        torch.cuda.current_stream(self.device).cuda_stream),
                       "low_latency_clean_mask_buffer")

    def low_latency_lost_ranks(self):
        """moeep-only: the ranks moeepd marked lost in the job (their process,
        daemon or mesh link died), read now on the host, as a sorted list.
        Every call needing one of them masks it."""
        if self._ep is None:
            return []
        lost = ctypes.c_uint32()
        self._ep.check(self._ep.lib.moeep_ep_lost_ranks(self._ep.ptr, ctypes.byref(lost)), "lost ranks")
        return [r for r in range(self.group_size) if lost.value >> r & 1]

    def _active_ranks_arg(self, active_ranks, timeout_us):
        """(pointer, timeout_us) for a low-latency call's active_ranks (int32
        [num_ranks] CUDA tensor, 1 = active; moeep writes 0 for the ranks it
        masks) and timeout_us (> 0: this call's shrink timeout), as Mooncake
        EP takes them."""
        if active_ranks is None and not timeout_us:
            return None, 0
        self._require_shrink("active_ranks and timeout_us")
        if isinstance(timeout_us, bool) or not isinstance(timeout_us, int):
            raise ValueError("timeout_us must be an int, not %r" % (timeout_us,))
        if active_ranks is None:
            return None, timeout_us
        torch = _torch()
        _check_tensor(torch, active_ranks, "active_ranks", torch.int32, self.device, (self.group_size,))
        return active_ranks.data_ptr(), timeout_us


def _shrink_shapes(num_rdma_bytes, hidden, num_experts):
    """(hidden, num_experts) of an elastic Buffer, which makes its endpoint
    at construction: making it is collective, and a rank that fails before
    its first call (DeepEP's shrink test makes one skip it) must not keep
    the others from making theirs. The keywords, else the shapes of a
    num_rdma_bytes from get_low_latency_rdma_size_hint; without either the
    endpoint is made at the first call."""
    if isinstance(num_rdma_bytes, LowLatencySizeHint):
        hidden = num_rdma_bytes.hidden if hidden is None else hidden
        num_experts = num_rdma_bytes.num_experts if num_experts is None else num_experts
    return hidden, num_experts


def _shrink_config(cfg, enable_shrink, shrink_timeout_ms):
    """Fills the elastic fields of a struct moeep_ep_config."""
    cfg.ll_shrink = 1 if enable_shrink else 0
    cfg.shrink_timeout_ms = shrink_timeout_ms
    return cfg

