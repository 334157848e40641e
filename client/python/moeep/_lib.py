"""ctypes binding of libmoeep.so (client/lib/include/moeep.h and moeep_ep.h).

Pure Python and free of torch: the structures below mirror the C headers
field by field (tests/test_lib.py checks every size and offset against the
compiler's, through a small C program built with the library). Functions of
the data plane exist only in a libmoeep built with CUDA; `Library.has_data_plane`
says whether this one has them.
"""

import ctypes
import ctypes.util
import errno as _errno
import os

MOEEP_UNIQUE_ID_BYTES = 128
MOEEP_MAX_RANKS = 8
MOEEP_DEFAULT_NUM_SMS = 24
MOEEP_DEFAULT_TIMEOUT_MS = 10000
MOEEP_LL_MAX_TOKENS = 1024
MOEEP_DEFAULT_SHRINK_TIMEOUT_MS = 3000
DEFAULT_SOCKET = "/run/moeep/moeepd.sock"

# enum moeep_dtype, enum moeep_index_type
DTYPE_BF16 = 1
DTYPE_FP8_E4M3 = 2
INDEX_INT64 = 1
INDEX_INT32 = 2

# Limits the library checks (moeep_ep.h, "Supported shapes"); repeated here
# only so that Python can name the argument before any GPU work starts.
MAX_TOPK = 9
MAX_EXPERTS = 512
MAX_TOKENS_PER_RANK = 65536
SCALE_BLOCK = 128
MAX_RECV_AREAS = 8


class MoeepError(OSError):
    """An error reported by libmoeep, moeepd or the kernels.

    `errno` is the library's errno value (positive) and `strerror` its
    message, e.g. MoeepError(ENOENT, "cannot connect to moeepd at ...")."""

    def __init__(self, err, message):
        super().__init__(err, message)


# ---------------------------------------------------------------- structures
#
# Field order, types and names are those of the C headers; enums are C ints,
# bool is C99 _Bool.

_vp = ctypes.c_void_p
_int = ctypes.c_int


class UniqueId(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * MOEEP_UNIQUE_ID_BYTES)]


class Event(ctypes.Structure):
    _fields_ = [("type", _int), ("job_id", ctypes.c_uint64), ("rank", _int), ("reason", ctypes.c_char * 128)]


class EpConfig(ctypes.Structure):
    _fields_ = [
        ("max_tokens_per_rank", _int),
        ("hidden", _int),
        ("num_experts", _int),
        ("max_topk", _int),
        ("num_sms", _int),
        ("timeout_ms", _int),
        ("ll_max_tokens", _int),
        ("recv_areas", _int),
        ("ll_shrink", _int),
        ("shrink_timeout_ms", _int),
    ]


class DispatchArgs(ctypes.Structure):
    _fields_ = [
        ("x", _vp),
        ("x_type", _int),
        ("x_scales", _vp),
        ("num_tokens", _int),
        ("is_token_in_rank", _vp),
        ("topk_idx", _vp),
        ("topk_idx_type", _int),
        ("topk_weights", _vp),
        ("num_topk", _int),
        ("expert_alignment", _int),
        ("num_worst_tokens", _int),
        ("handle", _vp),
        ("num_tokens_per_expert", _vp),
        ("total_tokens", _int),
        ("recv_area", _int),
        ("x_scales_token_stride", ctypes.c_int64),
        ("x_scales_block_stride", ctypes.c_int64),
    ]


class DispatchResult(ctypes.Structure):
    _fields_ = [
        ("recv_x", _vp),
        ("recv_x_scales", _vp),
        ("recv_topk_idx", _vp),
        ("recv_topk_weights", _vp),
        ("recv_src_info", _vp),
        ("num_recv_tokens", _int),
        ("num_recv_tokens_dev", _vp),
        ("num_recv_tokens_per_expert", ctypes.POINTER(_int)),
        ("num_recv_tokens_per_expert_dev", _vp),
        ("num_local_experts", _int),
        ("handle", _vp),
        ("rank_prefix_matrix", _vp),
        ("send_pos", _vp),
        ("max_total_tokens", _int),
        ("num_recv_tokens_per_rank", ctypes.POINTER(_int)),
    ]


class CombineArgs(ctypes.Structure):
    _fields_ = [
        ("x", _vp),
        ("topk_weights", _vp),
        ("num_topk", _int),
        ("handle", _vp),
        ("out", _vp),
        ("out_topk_weights", _vp),
    ]


class LlHook(ctypes.Structure):
    _fields_ = [
        ("kind", _int),
        ("set", _int),
        ("stats", _vp),
        ("topk_idx", _vp),
        ("idx_is_int64", _int),
        ("topk_weights", _vp),
        ("num_tokens", _int),
        ("num_topk", _int),
        ("out", _vp),
        ("slots", _int),
        ("active_ranks", _vp),
        ("timeout_us", _int),
    ]


class LlHandle(ctypes.Structure):
    _fields_ = [("set", _int), ("num_tokens", _int), ("slots_per_expert", _int)]


class LlDispatchArgs(ctypes.Structure):
    _fields_ = [
        ("x", _vp),
        ("num_tokens", _int),
        ("topk_idx", _vp),
        ("topk_idx_type", _int),
        ("num_topk", _int),
        ("use_fp8", ctypes.c_bool),
        ("round_scale", ctypes.c_bool),
        ("return_recv_hook", ctypes.c_bool),
        ("cumulative_local_expert_recv_stats", _vp),
        ("num_max_tokens", _int),
        ("active_ranks", _vp),
        ("timeout_us", _int),
    ]


class LlDispatchResult(ctypes.Structure):
    _fields_ = [
        ("recv_x", _vp),
        ("recv_x_scales", _vp),
        ("recv_count", _vp),
        ("recv_src_info", _vp),
        ("num_local_experts", _int),
        ("slots_per_expert", _int),
        ("handle", LlHandle),
        ("layout_range", _vp),
        ("combine_buffer", _vp),
    ]


class LlCombineArgs(ctypes.Structure):
    _fields_ = [
        ("x", _vp),
        ("topk_idx", _vp),
        ("topk_idx_type", _int),
        ("topk_weights", _vp),
        ("num_topk", _int),
        ("handle", ctypes.POINTER(LlHandle)),
        ("out", _vp),
        ("return_recv_hook", ctypes.c_bool),
        ("active_ranks", _vp),
        ("timeout_us", _int),
    ]


# Every structure, by its C name, for the ABI test.
STRUCTS = {
    "moeep_unique_id": UniqueId,
    "moeep_event": Event,
    "moeep_ep_config": EpConfig,
    "moeep_dispatch_args": DispatchArgs,
    "moeep_dispatch_result": DispatchResult,
    "moeep_combine_args": CombineArgs,
    "moeep_ll_hook": LlHook,
    "moeep_ll_handle": LlHandle,
    "moeep_ll_dispatch_args": LlDispatchArgs,
    "moeep_ll_dispatch_result": LlDispatchResult,
    "moeep_ll_combine_args": LlCombineArgs,
}

_P = ctypes.POINTER
_CONTROL = {
    "moeep_connect": (_int, [ctypes.c_char_p, _P(_vp)]),
    "moeep_client_free": (None, [_vp]),
    "moeep_client_error": (ctypes.c_char_p, [_vp]),
    "moeep_client_fd": (_int, [_vp]),
    "moeep_job_create": (_int, [_vp, ctypes.c_char_p, _int, _P(UniqueId)]),
    "moeep_job_join": (_int, [_vp, _P(UniqueId), _int, _int, ctypes.c_char_p]),
    "moeep_job_leave": (_int, [_vp]),
    "moeep_job_barrier": (_int, [_vp]),
    "moeep_job_info": (_int, [_vp, _P(ctypes.c_uint64), _P(_int), _P(_int)]),
    "moeep_event_next": (_int, [_vp, _P(Event)]),
}
_DATA = {
    "moeep_ep_create": (_int, [_vp, _P(EpConfig), _P(_vp)]),
    "moeep_ep_destroy": (None, [_vp]),
    "moeep_ep_error": (ctypes.c_char_p, [_vp]),
    "moeep_ep_buffer_bytes": (ctypes.c_size_t, [_vp]),
    "moeep_ep_rank": (_int, [_vp]),
    "moeep_ep_num_ranks": (_int, [_vp]),
    "moeep_ep_set_num_sms": (_int, [_vp, _int]),
    "moeep_ep_check": (_int, [_vp]),
    "moeep_get_dispatch_layout": (_int, [_vp, _vp, _int, _int, _int, _vp, _vp, _vp, _vp]),
    "moeep_dispatch": (_int, [_vp, _P(DispatchArgs), _P(DispatchResult), _vp]),
    "moeep_dispatch_copy_topk": (_int, [_vp, _vp, _int, _int, _int, _vp, _vp, _vp]),
    "moeep_combine": (_int, [_vp, _P(CombineArgs), _vp]),
    "moeep_ep_max_recv_tokens": (_int, [_vp]),
    "moeep_ep_recv_area": (_int, [_vp, _int, _P(DispatchResult), _P(ctypes.c_size_t)]),
    "moeep_ep_handle_num_tokens": (_int, [_vp]),
    "moeep_ep_handle_free": (None, [_vp]),
    "moeep_ll_dispatch": (_int, [_vp, _P(LlDispatchArgs), _P(LlDispatchResult), _P(LlHook), _vp]),
    "moeep_ll_combine": (_int, [_vp, _P(LlCombineArgs), _P(LlHook), _vp]),
    "moeep_ll_hook_run": (_int, [_vp, _P(LlHook), _vp]),
    "moeep_ll_clean": (_int, [_vp]),
    "moeep_ll_mask_query": (_int, [_vp, _vp, _vp]),
    "moeep_ll_mask_update": (_int, [_vp, _int, ctypes.c_bool, _vp]),
    "moeep_ll_mask_clean": (_int, [_vp, _vp]),
    "moeep_ep_lost_ranks": (_int, [_vp, _P(ctypes.c_uint32)]),
}


class Library:
    """A loaded libmoeep.so with typed entry points as attributes."""

    def __init__(self, path):
        self.path = path
        self.cdll = ctypes.CDLL(path)
        for name, (restype, argtypes) in _CONTROL.items():
            self._bind(name, restype, argtypes, required=True)
        self.has_data_plane = all(self._bind(n, r, a, required=False) for n, (r, a) in _DATA.items())

    def _bind(self, name, restype, argtypes, required):
        try:
            fn = getattr(self.cdll, name)
        except AttributeError:
            if required:
                raise OSError(_errno.ENOSYS, "%s has no symbol %s: not a libmoeep.so" % (self.path, name))
            return False
        fn.restype = restype
        fn.argtypes = argtypes
        setattr(self, name, fn)
        return True

    def require_data_plane(self):
        if not self.has_data_plane:
            raise MoeepError(
                _errno.ENOSYS,
                "%s was built without CUDA: it has the control plane only "
                "(rebuild with nvcc on PATH, meson -Dcuda=enabled)" % self.path,
            )


# ---------------------------------------------------------------- loading

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _checkout_build_library():
    """build/client/libmoeep.so of the repository checkout this package is
    used from (PYTHONPATH=client/python), or None when the package is not in
    a checkout (installed into a venv or site-packages): there the directory
    three levels up is no repository and a path under it would mean nothing."""
    python_dir = os.path.dirname(_PACKAGE_DIR)
    root = os.path.dirname(os.path.dirname(python_dir))
    if os.path.basename(python_dir) != "python" or not os.path.isfile(os.path.join(root, "meson.build")):
        return None
    return os.path.join(root, "build", "client", "libmoeep.so")


def _install_libdir():
    """The libdir `meson install` puts libmoeep.so in, when the meson build
    made this package (moeep/_install.py, written by tools/moeep_build.py);
    None for a package installed from source."""
    try:
        from . import _install
    except ImportError:
        return None
    return _install.LIBDIR


def candidate_paths():
    """Where load_library() looks, in order, as (path or None, origin).

    1. $MOEEP_LIBRARY (nothing else when it is set); 2. the libdir of the
    meson build that made this package (moeep/_install.py), where `meson
    install` puts the library; 3. libmoeep.so next to the package (a copy put
    there by hand); 4. the build tree of the repository checkout the package
    is used from (build/client/libmoeep.so), only in a checkout; 5.
    ctypes.util.find_library('moeep'): the dynamic linker's cache, which
    holds the library after `meson install` into a system libdir."""
    out = []
    env = os.environ.get("MOEEP_LIBRARY")
    if env:
        out.append((env, "$MOEEP_LIBRARY"))
        return out
    libdir = _install_libdir()
    if libdir:
        out.append((os.path.join(libdir, "libmoeep.so.0"), "the libdir of the meson build that made this package"))
    out.append((os.path.join(_PACKAGE_DIR, "libmoeep.so"), "next to the package"))
    build = _checkout_build_library()
    if build:
        out.append((build, "the build tree of this checkout"))
    out.append((ctypes.util.find_library("moeep"), FIND_LIBRARY))
    return out


# The last place tried, and what to do when it finds nothing: `meson install`
# does not update the dynamic linker's cache.
FIND_LIBRARY = "ctypes.util.find_library('moeep')"
FIND_LIBRARY_HINT = "not in the dynamic linker's cache (after `meson install` into a system libdir, run `sudo ldconfig`)"

_loaded = None


def load_library():
    """Loads libmoeep once (see candidate_paths()); raises OSError naming every
    place it looked and why each failed."""
    global _loaded
    if _loaded is not None:
        return _loaded
    tried = []
    for path, origin in candidate_paths():
        if path is None:
            tried.append("%s: %s" % (origin, FIND_LIBRARY_HINT if origin == FIND_LIBRARY else "not found"))
            continue
        if os.sep in path and not os.path.exists(path):
            tried.append("%s (%s): no such file" % (path, origin))
            continue
        try:
            _loaded = Library(path)
            return _loaded
        except OSError as e:
            tried.append("%s (%s): %s" % (path, origin, e))
            if origin == "$MOEEP_LIBRARY":
                break
    raise OSError(
        _errno.ENOENT,
        "cannot load libmoeep.so: build and install it (meson setup build && meson compile -C build && "
        "sudo meson install -C build && sudo ldconfig), or set MOEEP_LIBRARY to its path. Tried: " + "; ".join(tried),
    )


def reset_library_cache():
    """Forgets the loaded library, so that the next load_library() searches
    again (tests change MOEEP_LIBRARY)."""
    global _loaded
    _loaded = None


def resolve_socket(socket=None):
    """The daemon socket and where it came from: the argument, else
    $MOEEP_SOCKET, else /run/moeep/moeepd.sock."""
    if socket:
        return os.fspath(socket), "the socket argument"
    env = os.environ.get("MOEEP_SOCKET")
    if env:
        return env, "$MOEEP_SOCKET"
    return DEFAULT_SOCKET, "the default"


def decode(msg):
    return msg.decode("utf-8", "replace") if msg else ""


class Handle:
    """A libmoeep object behind a pointer (_ptr), with its last error text
    (the function named by _error_fn) and a checker for return values."""

    _error_fn = None
    _gone = "the object is closed"

    @property
    def ptr(self):
        if not self._ptr:
            raise MoeepError(_errno.EBADF, self._gone)
        return self._ptr

    def error(self):
        return decode(getattr(self.lib, self._error_fn)(self._ptr)) if self._ptr else ""

    def check(self, r, what):
        """Raises MoeepError for r < 0 with the object's error text."""
        if r < 0:
            raise MoeepError(-r, "%s: %s" % (what, self.error() or os.strerror(-r)))
        return r
