"""deep_ep.utils' names for code that imports them from there (Megatron,
torchtitan): EventHandle, EventOverlap."""

from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
