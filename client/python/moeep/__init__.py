"""moeep: expert-parallel communication for MoE inference (Python package).

`moeep.Buffer` has deep_ep.Buffer's API for everything inside one node,
over libmoeep.so through ctypes: one build serves every torch version. torch
is imported only when a Buffer is used; `import moeep` and the control-plane
binding work without it. See client/python/README.md.
"""

from ._lib import MoeepError, load_library
from .buffer import Buffer, DispatchHandle, LowLatencyHandle
from .config import Config
from .event import EventHandle, EventOverlap
from . import utils  # noqa: F401  (deep_ep.utils' names)

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "MoeepError", "DispatchHandle", "LowLatencyHandle",
           "load_library"]


def __getattr__(name):
    # deep_ep.topk_idx_t: the dtype of top-k expert ids (torch.int64, as
    # DeepEP builds by default). A module attribute made on first use, since
    # `import moeep` must work without torch.
    if name == "topk_idx_t":
        from .event import _torch
        return _torch().int64
    raise AttributeError("module 'moeep' has no attribute %r" % (name,))
