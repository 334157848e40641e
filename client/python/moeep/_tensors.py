"""torch tensors for moeep.Buffer (part of moeep.buffer): views over moeep's
device memory without copying, and the checks of the tensors a caller
passes, each error naming the argument and what was wrong."""

from . import _lib


class _DevicePointer:
    """A device array for torch.as_tensor (__cuda_array_interface__ v2)."""

    def __init__(self, ptr, shape, typestr, owner):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (int(ptr), False),
                                         "version": 2, "strides": None}
        self._owner = owner  # keeps the Buffer (and so the mapping) referenced


class _Lease(_DevicePointer):
    """The device array of one dispatch's outputs in a receive area: every
    output tensor is a view of the one tensor made over it, so the area is
    held exactly as long as any of them lives (torch keeps this object until
    the storage they share is freed). Frees the area when it goes."""

    def __init__(self, ptr, nbytes, owner, areas, area):
        super().__init__(ptr, (nbytes,), "|u1", owner)
        self._areas, self._area = areas, area
        areas.held[area] = True

    def __del__(self):
        self._areas.held[self._area] = False


class _Areas:
    """An endpoint's normal-mode receive areas (moeep_ep_config.recv_areas)
    and which of them hold outputs a caller still references. A dispatch
    lands in a free area; its outputs are views of that area when another
    area stays free for the next dispatch, else copies (the area stays
    free). Where the outputs' arrays lie inside an area (offsets from its
    start) is the same for every area. A dispatch captured in a CUDA graph
    lands in a graph area: the graphs' replays write it whenever they run,
    so no outputs that outlive another dispatch's call are views of it (a
    dispatch that lands there copies). Captures share the graph areas as
    their replays run in order, each taking one whose captured outputs are
    gone (the outputs of two dispatches alive at once in a graph need two)."""

    def __init__(self, ep, n):
        import ctypes
        self.held = [False] * n
        self.graph = set()  # the graph areas
        self.base = []
        for a in range(n):
            res, nbytes = _lib.DispatchResult(), ctypes.c_size_t()
            ep.check(ep.lib.moeep_ep_recv_area(ep.ptr, a, ctypes.byref(res), ctypes.byref(nbytes)),
                     "receive area %d" % a)
            self.base.append(res.recv_x)
            self.nbytes = nbytes.value
            self.offsets = {name: getattr(res, name) - res.recv_x
                            for name in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights")}

    def pick(self, capturing=False):
        """(area, views): the area of a dispatch, and whether its outputs
        may be views of it. While a graph is captured: a graph area that no
        captured outputs hold (else a free area becomes one). Else the first
        free area but the graph areas, in place when another area stays for
        the next dispatch (which copies there); a free graph area, copied
        out, when no other is free."""
        free = [a for a, h in enumerate(self.held) if not h]
        if not free:
            raise RuntimeError("every receive area holds outputs a caller keeps (drop some, or pass a larger "
                               "recv_areas): captured outputs that outlive their graph's capture hold theirs")
        plain = [a for a in free if a not in self.graph]
        if capturing:
            a = next((a for a in free if a in self.graph), plain[-1] if plain else None)
            self.graph.add(a)
            return a, True
        return (plain[0], len(free) > 1) if plain else (free[0], False)

    def free(self):
        """How many areas no caller holds."""
        return self.held.count(False)

    def views(self, torch, area, owner, device, arrays):
        """Views of area `area`, one per (name, shape, dtype) of `arrays`
        (None entries give None), all over one tensor that holds the area."""
        _tables(torch)
        base = torch.as_tensor(_Lease(self.base[area], self.nbytes, owner, self, area), device=device)
        out = []
        for item in arrays:
            if item is None:
                out.append(None)
                continue
            name, shape, dtype = item
            n = 1
            for d in shape:
                n *= d
            off = self.offsets[name]
            size = n * _ELEMENT[dtype]
            out.append(base[off:off + size].view(dtype).view(shape))
        return out


_ELEMENT = {}

_TYPESTR = None


def _tables(torch):
    """The dtype tables, made once torch is imported."""
    global _TYPESTR
    if _TYPESTR is None:
        _TYPESTR = {torch.bfloat16: ("<i2", torch.int16), torch.float8_e4m3fn: ("|u1", torch.uint8),
                    torch.float32: ("<f4", None), torch.int32: ("<i4", None), torch.int64: ("<i8", None)}
        _ELEMENT.update({torch.bfloat16: 2, torch.float8_e4m3fn: 1, torch.float32: 4, torch.int32: 4,
                         torch.int64: 8})


def _view(torch, ptr, shape, dtype, owner, device):
    """A torch tensor over device memory at ptr, without copying."""
    _tables(torch)
    n = 1
    for s in shape:
        n *= s
    if n == 0 or not ptr:
        return torch.empty(shape, dtype=dtype, device=device)
    typestr, raw = _TYPESTR[dtype]
    t = torch.as_tensor(_DevicePointer(ptr, shape, typestr, owner), device=device)
    return t.view(dtype) if raw is not None else t


def _record(t, stream):
    try:
        t.record_stream(stream)
    except RuntimeError:
        pass  # not from the caching allocator (a view into moeep's buffer)


def _check_tensor(torch, t, name, dtypes, device, shape=None, need_contiguous=True):
    """Raises TypeError / ValueError naming `name` unless t is a tensor of
    one of `dtypes` on `device`, of `shape` (or 2-D when None), contiguous
    when asked. Called several times per call: the common case is a few
    attribute reads; the messages are made only on the way to an error."""
    try:
        if ((t.dtype is dtypes) if dtypes.__class__ is not tuple else (t.dtype in dtypes)) and \
                t.get_device() == device.index and (not need_contiguous or t.is_contiguous()) and \
                (t.dim() == 2 if shape is None else t.shape == shape):
            return
    except AttributeError:
        pass
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s must be a torch.Tensor, not %s" % (name, type(t).__name__))
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        raise TypeError("%s must be %s, not %s" % (name, " or ".join(map(str, dtypes)), t.dtype))
    if t.device != device:
        raise ValueError("%s is on %s, this Buffer on %s" % (name, t.device, device))
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError("%s must have shape %s, not %s" % (name, list(shape), list(t.shape)))
    if shape is None and t.dim() != 2:
        raise ValueError("%s must be 2-D, not %s" % (name, list(t.shape)))
    if need_contiguous and not t.is_contiguous():
        raise ValueError("%s must be contiguous" % name)


def _check_index(torch, t, name, device, rows=None):
    _check_tensor(torch, t, name, (torch.int64, torch.int32), device)
    if rows is not None and t.shape[0] != rows:
        raise ValueError("%s has %d rows, x has %d" % (name, t.shape[0], rows))
    if not 1 <= t.shape[1] <= _lib.MAX_TOPK:
        raise ValueError("%s has top-k %d; moeep supports 1..%d" % (name, t.shape[1], _lib.MAX_TOPK))


def _index_type(torch, t):
    return _lib.INDEX_INT64 if t.dtype is torch.int64 else _lib.INDEX_INT32
