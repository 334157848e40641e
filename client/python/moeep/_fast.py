"""The low-latency calls in C (client/python/fast/moeep_fast.c), where built.

moeep_fast.abi3.so is a CPython extension of the limited API that meson
builds and installs next to libmoeep.so; it is looked for next to the
libmoeep.so that was loaded, so that both always come from the same build.
Without it (no Python headers at build time, a libmoeep found by the
dynamic linker's name alone, or MOEEP_PY_FAST=0) every call runs in
Python: the same results, more host time per call. status() says which.
"""

import ctypes
import importlib.machinery
import importlib.util
import os

from . import _lib

FILE = "moeep_fast.abi3.so"
ABI = 1  # moeep_fast's ABI constant that this module speaks

_module = None
_status = None


def load(lib):
    """The extension module next to `lib` (a _lib.Library), or None; the
    reason is kept for status()."""
    global _module, _status
    if _status is not None:
        return _module
    if os.environ.get("MOEEP_PY_FAST", "1") == "0":
        _status = "off (MOEEP_PY_FAST=0)"
        return None
    if os.sep not in lib.path:
        _status = "not found (libmoeep was found by name, %s, not by path)" % lib.path
        return None
    path = os.path.join(os.path.dirname(os.path.realpath(lib.path)), FILE)
    if not os.path.exists(path):
        _status = "not found (%s: no such file)" % path
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader("moeep_fast", path)
        spec = importlib.util.spec_from_file_location("moeep_fast", path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as e:
        _status = "not loaded (%s: %s)" % (path, e)
        return None
    if getattr(module, "ABI", None) != ABI:
        _status = "not used (%s speaks ABI %r, this package %d)" % (path, getattr(module, "ABI", None), ABI)
        return None
    _module, _status = module, "on (%s)" % path
    return module


def status():
    """How this process runs low-latency calls: "on (path)", or why not."""
    return _status or "not loaded yet (no low-latency Buffer has made its endpoint)"


def make(torch, ep, device_index, ranks, hidden, num_experts, ll_max_tokens, no_event):
    """A moeep_fast.LowLatency for the endpoint `ep` (an _endpoint.Endpoint),
    or None without the extension."""
    module = load(ep.lib)
    if module is None or not ll_max_tokens:
        return None
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
    return module.LowLatency(ep.ptr.value, address(ep.lib.moeep_ll_dispatch), address(ep.lib.moeep_ll_combine),
                             ep.check, torch, device_index, ranks, hidden, num_experts, ll_max_tokens, _lib.MAX_TOPK,
                             no_event)
