"""EventOverlap, as deep_ep.EventOverlap, over torch.cuda.Event."""


def _torch():
    """torch, imported on first use (moeep itself must import without it)."""
    try:
        import torch
    except ImportError as e:
        raise ImportError("moeep.Buffer needs PyTorch with CUDA (pip install torch); the control-plane "
                          "binding (moeep._lib, moeep._job) works without it") from e
    return torch


class EventOverlap:
    """A CUDA event recorded after a communication call (async_finish=True),
    or None when the call already made the current stream wait. Holds the
    tensors the call used until the event is waited for, as DeepEP does.

        _, _, _, _, handle, event = buffer.dispatch(..., async_finish=True)
        ...                      # overlap other work
        event.current_stream_wait()

    or `with event: ...` (waits at the end of the block)."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        """Makes the current stream wait for the event (no host wait)."""
        assert self.event is not None, "no event: the call ran with async_finish=False"
        _torch().cuda.current_stream().wait_event(self.event)

    def wait_on(self, stream):
        """Makes `stream` wait for the event (previous_event= of a call)."""
        if self.event is not None:
            stream.wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.event is not None:
            self.current_stream_wait()
