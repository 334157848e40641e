"""The handles moeep.Buffer's dispatches return (part of moeep.buffer):
DeepEP's tuples, with moeep's routing riding along."""

import collections
import ctypes
import weakref


class LowLatencyHandle(collections.namedtuple(
        "LowLatencyHandle", ["src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                             "num_experts"])):
    """DeepEP's low-latency handle: (src_info int32 [local experts, slots]:
    the source token index of each slot; layout_range int64 [local experts,
    ranks]: begin << 32 | count of each source rank's run of slots;
    num_max_dispatch_tokens_per_rank, hidden, num_experts). moeep's routing
    rides along as attributes."""

    def __new__(cls, src_info, layout_range, num_max, hidden, num_experts, ll_handle, buffer_id, combine_buffer):
        self = super().__new__(cls, src_info, layout_range, num_max, hidden, num_experts)
        self.ll_handle = ll_handle
        self.ll_handle_ptr = ctypes.pointer(ll_handle)  # what moeep_ll_combine_args.handle takes
        self.buffer_id = buffer_id
        self.combine_buffer = combine_buffer
        return self


class _Route:
    """The C handle (moeep_ep_handle) of one normal-mode dispatch; goes back
    to its Buffer when released or dropped. Weakly referenced by the Buffer
    (tuples cannot be), so destroy() can return every live one."""

    def __init__(self, buffer, ptr):
        self._buffer = weakref.ref(buffer)
        self._ep = buffer._ep
        self.ptr = ptr

    def release(self):
        if self.ptr:
            buf = self._buffer()
            if buf is not None and buf._ep is self._ep and self._ep is not None and self._ep._ptr:
                self._ep.lib.moeep_ep_handle_free(self.ptr)
            self.ptr = None

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


class DispatchHandle(tuple):
    """The routing of one normal-mode dispatch, for combine and for cached
    dispatch. As DeepEP's intranode handle it is a 6-tuple:
    (rank_prefix_matrix int32 [ranks, ranks], element [s][d] the rows ranks
    0..s send to rank d, so rank d's rows from source s are
    [s-1][d]..[s][d]; channel_prefix_matrix and recv_channel_prefix_matrix:
    None, moeep has no channels; recv_src_idx int32 [num_recv]: (source
    rank << 24) | source token; is_token_in_rank as given (or None);
    send_head int32 [tokens, ranks]: a token's row among ours at each rank,
    -1 = not sent). The tensors are views of the handle's memory, valid
    while the handle lives. `items` is the tuple, or a function that makes
    it: the views are then made when the tuple is first read (engines pass
    the handle back without reading it; each view costs host time)."""

    def __new__(cls, route, num_tokens, num_recv_tokens, num_topk, topk_idx, topk_weights, items):
        return super().__new__(cls, items if isinstance(items, tuple) else (None,) * 6)

    def __init__(self, route, num_tokens, num_recv_tokens, num_topk, topk_idx, topk_weights, items):
        self._items = None if isinstance(items, tuple) else items
        self._tuple = items if isinstance(items, tuple) else None
        self._route = route
        # A dispatch larger than one call runs in rounds: [(round's handle,
        # first token, end)] and, per round, the rows of the whole output
        # that are that round's (index into DeepEP's order).
        self.rounds = None
        self.round_index = None
        self._buffer = route._buffer
        self.num_tokens = num_tokens
        self.num_recv_tokens = num_recv_tokens  # rows of recv_x (num_worst_tokens when the count stayed on the GPU)
        self.num_topk = num_topk
        # A cached dispatch resends the same top-k (moeep_dispatch needs it when
        # the first call had it); kept so the caller need not pass them again.
        self.topk_idx = topk_idx
        self.topk_weights = topk_weights

    def _made(self):
        """The tuple, made now if it was not yet."""
        if self._tuple is None:
            if not self._route.ptr:
                raise ValueError("the dispatch handle was released: its routing is gone")
            self._tuple, self._items = self._items(), None
        return self._tuple

    def __getitem__(self, i):
        return self._made().__getitem__(i)

    def __iter__(self):
        return iter(self._made())

    def __repr__(self):
        return "DispatchHandle%r" % (tuple(self),)

    @property
    def ptr(self):
        return self._route.ptr

    def release(self):
        self._route.release()
