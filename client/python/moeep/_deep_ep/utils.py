"""deep_ep.utils, served by moeep (see deep_ep.__doc__): EventOverlap and
EventHandle, as Megatron and torchtitan import them."""

from moeep.utils import EventHandle, EventOverlap  # noqa: F401

__all__ = ["EventHandle", "EventOverlap"]
