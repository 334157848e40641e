"""deep_ep, served by moeep: this is NOT DeepEP.

`import deep_ep` resolves here because MOEEP_DEEP_EP is set (see
moeep.deep_ep_alias). Every name is moeep's: deep_ep.Buffer is moeep.Buffer,
running over the node's moeepd and libmoeep.so, with DeepEP 1.x's API for
one node. `deep_ep.__moeep__` is True and `deep_ep.__version__` reads
"1.2.1+moeep.<version>". Unset MOEEP_DEEP_EP to get the real DeepEP back.
"""

import moeep as _moeep
from moeep import deep_ep_alias as _alias

from . import buffer, utils  # noqa: F401  (as DeepEP: deep_ep.buffer, deep_ep.utils)
from .utils import EventOverlap

Buffer = _moeep.Buffer
Config = _moeep.Config

__moeep__ = True
__version__ = "%s+moeep.%s" % (_alias.DEEPEP_API_VERSION, _moeep.__version__)
__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t", "__version__"]


def __getattr__(name):
    # topk_idx_t is a torch dtype: moeep makes it on first use, so that
    # `import deep_ep` does not import torch by itself.
    if name == "topk_idx_t":
        return _moeep.topk_idx_t
    raise AttributeError("module 'deep_ep' (moeep) has no attribute %r" % name)
