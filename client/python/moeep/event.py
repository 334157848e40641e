"""EventHandle and EventOverlap, as deep_ep's (deep_ep.utils), over
torch.cuda.Event; and _torch(), _as_binding() and the raw-stream helpers
for the Buffer's calls."""

import functools


def _torch():
    """torch, imported on first use (moeep itself must import without it)."""
    try:
        import torch
    except ImportError as e:
        raise ImportError("moeep.Buffer needs PyTorch with CUDA (pip install torch); the control-plane "
                          "binding (moeep._lib, moeep._job) works without it") from e
    return torch


def _current_stream(torch, index):
    """The raw handle of the caller's current stream on device `index`."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def _stream_of(torch, raw, device):
    """The torch stream whose raw handle is `raw` (from _current_stream).
    torch.cuda.ExternalStream(0) is not the default stream, whose handle is
    0, but a new stream from torch's pool, unordered with the caller's
    work: the default stream is asked for by name."""
    return torch.cuda.default_stream(device) if raw == 0 else torch.cuda.ExternalStream(raw, device=device)


def _as_binding(method):
    """Runs a Buffer call with torch's __torch_function__ handling off, as
    DeepEP's C++ binding runs: no mode (torch.set_default_device's, which
    DeepEP's tests set) and no tensor subclass sees the tensor methods the
    call makes. Under such a mode every one of them goes through Python: a
    low-latency dispatch + combine took 85-90 us of host time in DeepEP's
    test, 27-34 us in moeep.bench on the same host. moeep's calls name every
    device they allocate on, so the default device is not needed inside."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        with _torch()._C.DisableTorchFunction():
            return method(*args, **kwargs)
    return call


class EventHandle:
    """A CUDA event recorded on the current stream when created (DeepEP's
    EventHandle): `EventOverlap(EventHandle())` marks "everything queued so
    far" for a later call's previous_event."""

    def __init__(self, stream=None):
        torch = _torch()
        self.event = torch.cuda.Event()
        self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self):
        """Makes the current stream wait for the event (no host wait)."""
        _torch().cuda.current_stream().wait_event(self.event)

    def wait_on(self, stream):
        stream.wait_event(self.event)


def _wait(event, stream):
    """Makes `stream` wait for an EventHandle or a torch.cuda.Event."""
    if isinstance(event, EventHandle):
        event.wait_on(stream)
    else:
        stream.wait_event(event)


class EventOverlap:
    """A CUDA event recorded after a communication call (async_finish=True),
    or None when the call already made the current stream wait. Holds the
    tensors the call used until the event is waited for, as DeepEP does.
    `event` may be an EventHandle or a torch.cuda.Event.

        _, _, _, _, handle, event = buffer.dispatch(..., async_finish=True)
        ...                      # overlap other work
        event.current_stream_wait()

    or `with event: ...` (waits at the end of the block). Given as a call's
    previous_event, the call waits for the event, or, when the event is
    None, for the current stream (DeepEP's rule)."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        """Makes the current stream wait for the event (no host wait)."""
        assert self.event is not None, "no event: the call ran with async_finish=False"
        _wait(self.event, _torch().cuda.current_stream())

    def wait_on(self, stream):
        """Makes `stream` wait for the event, or for the current stream when
        there is none (previous_event= of a call)."""
        if self.event is not None:
            _wait(self.event, stream)
        else:
            stream.wait_stream(_torch().cuda.current_stream())

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.event is not None:
            self.current_stream_wait()
