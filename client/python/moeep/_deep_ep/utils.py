"""deep_ep.utils, served by moeep (see deep_ep.__doc__): EventOverlap and
EventHandle, as Megatron and torchtitan import them."""

from moeep import EventOverlap  # noqa: F401
from moeep import event as _event


def _event_handle_class():
    """DeepEP's EventHandle: a CUDA event recorded on the current stream when
    made, with current_stream_wait(). moeep's own class where it has one;
    else a torch.cuda.Event subclass, so that moeep's EventOverlap and
    previous_event take it as any event."""
    own = getattr(_event, "EventHandle", None)
    if own is not None:
        return own
    torch = _event._torch()

    class EventHandle(torch.cuda.Event):
        def __init__(self):
            super().__init__()
            self.record(torch.cuda.current_stream())

        def current_stream_wait(self):
            torch.cuda.current_stream().wait_event(self)

    return EventHandle


def __getattr__(name):
    # Made on first use: defining it needs torch, and `import deep_ep` must
    # not import torch by itself (moeep's rule).
    if name == "EventHandle":
        cls = _event_handle_class()
        globals()["EventHandle"] = cls
        return cls
    raise AttributeError("module 'deep_ep.utils' (moeep) has no attribute %r" % name)
