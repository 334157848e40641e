"""DeepEP's Config, buffer-size hints, and how moeep sizes an endpoint.

moeep sizes its NVLink buffer from shapes (tokens per rank, hidden, experts,
top-k), DeepEP from byte counts. This module is the one place that maps one
onto the other (documented in client/python/README.md, "Sizing"). Free of
torch.
"""

from . import _lib

# Tokens per rank that Config.get_nvl_buffer_size_hint() sizes for, and the
# normal-mode default when neither max_tokens_per_rank nor num_nvl_bytes says.
DEFAULT_MAX_TOKENS_PER_RANK = 4096
# Low-latency tokens per rank when nothing else says (DeepEP's tests use 128).
DEFAULT_LL_MAX_TOKENS = 128
# Normal-mode receive areas: a dispatch's outputs are views into one area
# for as long as the caller holds them, and a dispatch lands in an area no
# one holds (README "Output lifetimes"); with one area left free the
# outputs are copies. Three let a caller keep one dispatch's outputs while
# it makes the next (`recv_x, ... = buffer.dispatch(...)` in a loop keeps
# the old outputs until the new ones replace them, as DeepEP's tests do)
# without a copy. The receive area a byte count (num_nvl_bytes) sizes is the
# first, the others come on top, as DeepEP's output tensors come on top of
# its buffer.
DEFAULT_RECV_AREAS = 3

_ALIGN = 4096
# struct moeep_sync / moeep_ll_sync (kernels/common/buffers.h), rounded up: the
# estimates below need not be exact, only never below the real size by more
# than these allowances.
_SYNC_BYTES = 128 << 10
_LL_SYNC_BYTES = 64 << 10


def _up(v):
    return (v + _ALIGN - 1) // _ALIGN * _ALIGN


def normal_buffer_bytes(num_ranks, max_tokens_per_rank, hidden, max_topk=_lib.MAX_TOPK):
    """About the bytes of moeep's normal-mode NVLink buffer (per rank), as
    kernels/common/buffer_layout.c lays it out: receive rows of every rank (x in
    bf16, FP8 scales, top-k ids and weights, source) and the combine area."""
    rows = num_ranks * max_tokens_per_rank
    parts = [
        rows * hidden * 2,                    # recv_x
        rows * (hidden // _lib.SCALE_BLOCK) * 4,  # recv_scales
        rows * max_topk * 8,                  # recv_topk_idx
        rows * max_topk * 4,                  # recv_topk_weights
        rows * 4,                             # recv_src
        rows * hidden * 2,                    # comb_x
        rows * max_topk * 4,                  # comb_weights
    ]
    return _SYNC_BYTES + sum(_up(p) for p in parts)


def low_latency_buffer_bytes(max_tokens_per_rank, hidden, num_experts, max_topk=_lib.MAX_TOPK):
    """About the bytes of moeep's low-latency buffers (two sets) for
    max_tokens_per_rank tokens per rank per call; 0 tokens = none."""
    if max_tokens_per_rank <= 0:
        return 0
    slots = num_experts * max_tokens_per_rank
    one_set = (_up(slots * hidden * 2) + _up(slots * (hidden // _lib.SCALE_BLOCK) * 4) + 2 * _up(slots * 4) +
               _up(num_experts * 8) + _up(max_tokens_per_rank * max_topk * hidden * 2) +
               _up(max_tokens_per_rank * max_topk * 4))
    return _LL_SYNC_BYTES + 2 * one_set


def _largest(fits, hi):
    """Largest n in 1..hi with fits(n) (fits is monotonic), 0 when none."""
    lo, best = 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def tokens_for_nvl_bytes(num_nvl_bytes, num_ranks, hidden, max_topk=_lib.MAX_TOPK):
    """max_tokens_per_rank whose normal-mode buffer fits num_nvl_bytes."""
    return _largest(lambda t: normal_buffer_bytes(num_ranks, t, hidden, max_topk) <= num_nvl_bytes,
                    _lib.MAX_TOKENS_PER_RANK)


def tokens_for_rdma_bytes(num_rdma_bytes, hidden, num_experts, max_topk=_lib.MAX_TOPK):
    """Low-latency tokens per rank whose buffers fit num_rdma_bytes (the
    inverse of Buffer.get_low_latency_rdma_size_hint)."""
    return _largest(lambda t: low_latency_buffer_bytes(t, hidden, num_experts, max_topk) <= num_rdma_bytes,
                    _lib.MOEEP_LL_MAX_TOKENS)


class SizeHint(int):
    """A byte count from Config.get_nvl_buffer_size_hint that remembers the
    tokens per rank it was computed for."""

    def __new__(cls, nbytes, tokens):
        self = super().__new__(cls, nbytes)
        self.tokens = tokens
        return self


class LowLatencySizeHint(int):
    """A byte count from Buffer.get_low_latency_rdma_size_hint that remembers
    the shapes it was computed for: an elastic Buffer given it
    (enable_shrink) makes its endpoint at construction with them."""

    def __new__(cls, nbytes, tokens, hidden, num_experts):
        self = super().__new__(cls, nbytes)
        self.tokens, self.hidden, self.num_experts = tokens, hidden, num_experts
        return self


class Config:
    """DeepEP's performance config. Only num_sms means something to moeep
    (blocks of dispatch/combine, moeep_ep_set_num_sms); the chunk sizes are
    kept for code that reads them and otherwise ignored: moeep has no chunked
    NVLink queues and no RDMA path."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256):
        check_num_sms(num_sms)
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Bytes of moeep's normal-mode buffer for DEFAULT_MAX_TOKENS_PER_RANK
        (4096) tokens per rank. moeep keeps rows at bf16 width, so the bytes
        are those of hidden_bytes / 2 bf16 channels when hidden_bytes is a
        bf16 row, which an FP8 row of hidden_bytes = hidden (SGLang's) would
        read as half the channels: the returned int therefore also carries
        the token count (SizeHint.tokens), and a Buffer given it (or the
        larger of several, max() keeps it) sizes for 4096 tokens of its
        actual hidden size, whatever the element size. A plain byte count
        (vLLM's 1 GiB) is read as bytes; a dispatch larger than what it
        holds runs in rounds."""
        hidden = max(int(hidden_bytes) // 2, 1)
        return SizeHint(normal_buffer_bytes(int(num_ranks), DEFAULT_MAX_TOKENS_PER_RANK, hidden),
                        DEFAULT_MAX_TOKENS_PER_RANK)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """0: moeep has no internode RDMA buffer in the client."""
        return 0

    def __repr__(self):
        return "Config(num_sms=%d)" % self.num_sms


def check_num_sms(n):
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
        raise ValueError("num_sms must be an int in 1..1024, not %r" % (n,))


class Plan:
    """What an endpoint will be created with, from Buffer's arguments; the
    shapes still unknown (None) are taken from the first collective call.
    Validation here needs no torch and no GPU."""

    def __init__(self, num_ranks, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, hidden=None,
                 num_experts=None, max_tokens_per_rank=None, num_max_dispatch_tokens_per_rank=None,
                 max_topk=None, timeout_ms=0, recv_areas=DEFAULT_RECV_AREAS):
        def nonneg_int(name, v):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError("%s must be a non-negative int, not %r" % (name, v))
            return v

        if not isinstance(num_ranks, int) or not 1 <= num_ranks <= _lib.MOEEP_MAX_RANKS:
            raise ValueError("moeep serves groups of 1..%d ranks on one node, not %r" %
                             (_lib.MOEEP_MAX_RANKS, num_ranks))
        self.num_ranks = num_ranks
        self.num_nvl_bytes = nonneg_int("num_nvl_bytes", num_nvl_bytes)
        self.num_rdma_bytes = nonneg_int("num_rdma_bytes", num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.timeout_ms = nonneg_int("timeout_ms", timeout_ms)
        if isinstance(recv_areas, bool) or not isinstance(recv_areas, int) or \
                not 1 <= recv_areas <= _lib.MAX_RECV_AREAS:
            raise ValueError("recv_areas must be an int in 1..%d, not %r" % (_lib.MAX_RECV_AREAS, recv_areas))
        self.recv_areas = recv_areas
        self.hidden = None
        self.num_experts = None
        self.max_topk = _lib.MAX_TOPK
        self.max_tokens_per_rank = None
        self.ll_max_tokens = None
        if max_topk is not None:
            if isinstance(max_topk, bool) or not isinstance(max_topk, int) or not 1 <= max_topk <= _lib.MAX_TOPK:
                raise ValueError("max_topk must be in 1..%d, not %r" % (_lib.MAX_TOPK, max_topk))
            self.max_topk = max_topk
        if hidden is not None:
            self.set_hidden(hidden)
        if num_experts is not None:
            self.set_num_experts(num_experts)
        if max_tokens_per_rank is not None:
            if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int) or \
                    not 1 <= max_tokens_per_rank <= _lib.MAX_TOKENS_PER_RANK:
                raise ValueError("max_tokens_per_rank must be in 1..%d, not %r" %
                                 (_lib.MAX_TOKENS_PER_RANK, max_tokens_per_rank))
            self.max_tokens_per_rank = max_tokens_per_rank
        if num_max_dispatch_tokens_per_rank is not None:
            self.set_ll_max_tokens(num_max_dispatch_tokens_per_rank)

    def set_hidden(self, hidden):
        if isinstance(hidden, bool) or not isinstance(hidden, int) or not 256 <= hidden <= 16384 or hidden % 256:
            raise ValueError("hidden must be a multiple of 256 in 256..16384 (moeep_ep.h), not %r" % (hidden,))
        if self.hidden is not None and hidden != self.hidden:
            raise ValueError("hidden %d differs from this Buffer's %d" % (hidden, self.hidden))
        self.hidden = hidden

    def set_num_experts(self, num_experts):
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or \
                not 1 <= num_experts <= _lib.MAX_EXPERTS or num_experts % self.num_ranks:
            raise ValueError("num_experts must be in 1..%d and divisible by the %d ranks, not %r" %
                             (_lib.MAX_EXPERTS, self.num_ranks, num_experts))
        if self.num_experts is not None and num_experts != self.num_experts:
            raise ValueError("num_experts %d differs from this Buffer's %d" % (num_experts, self.num_experts))
        self.num_experts = num_experts

    def set_ll_max_tokens(self, n):
        if not self.low_latency_mode:
            raise ValueError("num_max_dispatch_tokens_per_rank needs low_latency_mode=True")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= _lib.MOEEP_LL_MAX_TOKENS:
            raise ValueError("num_max_dispatch_tokens_per_rank must be in 1..%d, not %r" %
                             (_lib.MOEEP_LL_MAX_TOKENS, n))
        self.ll_max_tokens = n

    @property
    def ready(self):
        return self.hidden is not None and self.num_experts is not None

    def config(self, num_sms=0):
        """The struct moeep_ep_config, once hidden and num_experts are known.
        Order of choice: explicit keyword arguments, then the byte counts
        (num_nvl_bytes, num_rdma_bytes) read through the hint formulas, then
        the call that creates the endpoint, then the defaults."""
        if not self.ready:
            raise ValueError("hidden and num_experts are still unknown")
        ll = 0
        if self.low_latency_mode:
            ll = self.ll_max_tokens
            if ll is None and self.num_rdma_bytes:
                ll = tokens_for_rdma_bytes(self.num_rdma_bytes, self.hidden, self.num_experts, self.max_topk)
                if ll < 1:
                    raise ValueError("num_rdma_bytes %d is too small for one low-latency token of hidden %d "
                                     "and %d experts; pass num_max_dispatch_tokens_per_rank=" %
                                     (self.num_rdma_bytes, self.hidden, self.num_experts))
            if ll is None:
                ll = DEFAULT_LL_MAX_TOKENS
            self.ll_max_tokens = ll
        t = self.max_tokens_per_rank
        if t is None and isinstance(self.num_nvl_bytes, SizeHint):
            t = self.num_nvl_bytes.tokens  # sized by the hint: its tokens, at the real hidden size
        if t is None and self.num_nvl_bytes:
            t = tokens_for_nvl_bytes(self.num_nvl_bytes, self.num_ranks, self.hidden, self.max_topk)
            if t < 1:
                raise ValueError("num_nvl_bytes %d is too small for one token per rank of hidden %d; "
                                 "pass max_tokens_per_rank=" % (self.num_nvl_bytes, self.hidden))
        if t is None:
            t = ll if self.low_latency_mode else DEFAULT_MAX_TOKENS_PER_RANK
        self.max_tokens_per_rank = t
        return _lib.EpConfig(max_tokens_per_rank=t, hidden=self.hidden, num_experts=self.num_experts,
                             max_topk=self.max_topk, num_sms=num_sms, timeout_ms=self.timeout_ms,
                             ll_max_tokens=ll, recv_areas=self.recv_areas)
