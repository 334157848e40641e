"""moeep: expert-parallel communication for MoE inference (Python package).

`moeep.Buffer` has deep_ep.Buffer's API for everything inside one node,
over libmoeep.so through ctypes: one build serves every torch version. torch
is imported only when a Buffer is used; `import moeep` and the control-plane
binding work without it. See client/python/README.md.
"""

from ._lib import MoeepError, load_library
from .buffer import Buffer, DispatchHandle, LowLatencyHandle
from .config import Config
from .event import EventOverlap

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventOverlap", "MoeepError", "DispatchHandle", "LowLatencyHandle", "load_library"]
