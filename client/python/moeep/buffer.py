"""moeep.Buffer: DeepEP's deep_ep.Buffer API over libmoeep (intranode).

torch is imported on first use, never at import time, so that `import moeep`
and the static methods work without it. See client/python/README.md for the
semantics and where they differ from DeepEP (output lifetimes, sizing).

The Buffer is this module's class; its normal-mode calls are in
_normal.py, its low-latency calls in _low_latency.py (mixins), the handles
they return in _handles.py and the tensor views and checks in _tensors.py.
Those names are importable from here too (moeep.buffer.DispatchHandle).
"""

import contextlib
import ctypes
import errno as _errno
import sys
import weakref

from . import _fast, _lib
from ._endpoint import Endpoint
from ._hosttime import install as _install_host_time
from ._handles import DispatchHandle, LowLatencyHandle, _Route  # noqa: F401
from ._job import attach
from ._lib import MoeepError
from ._low_latency import _NO_EVENT, _LowLatencyMode, _pack_ue8m0  # noqa: F401
from ._normal import _NormalMode, _split_x, _torch_layout  # noqa: F401
from ._shrink import _ShrinkMode, _shrink_config, _shrink_shapes
from ._tensors import _Areas, _DevicePointer, _check_index, _check_tensor, _index_type, _record, _view  # noqa: F401
from .config import (DEFAULT_RECV_AREAS, Config, LowLatencySizeHint, Plan, check_num_sms,  # noqa: F401
                     low_latency_buffer_bytes)
from .event import EventOverlap, _current_stream, _stream_of, _torch


class Buffer(_NormalMode, _LowLatencyMode, _ShrinkMode):
    """DeepEP-compatible expert-parallel communication buffer over moeep.

    Arguments as deep_ep.Buffer; those that do not apply are accepted:
    num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
    use_fabric and comm are ignored (one node, NVLink only);
    explicitly_destroy only decides whether destroy() is required (as DeepEP).
    enable_shrink makes the low-latency calls elastic (DeepEP's shrink mode:
    the low_latency_*_mask_buffer calls, and active_ranks / timeout_us on
    the calls as Mooncake EP takes them; README "Elastic ranks").
    num_nvl_bytes / num_rdma_bytes size the endpoint through the formulas of
    moeep.config (see README "Sizing"); keyword-only extras give the shapes
    directly: socket, hidden, num_experts, max_tokens_per_rank,
    num_max_dispatch_tokens_per_rank, max_topk, timeout_ms, job_name,
    recv_areas (normal-mode receive areas, default 3: a dispatch's outputs
    are views of one for as long as the caller holds any of them),
    copy_outputs (normal-mode outputs always as owned copies, default
    False), shrink_timeout_ms (enable_shrink: how long a call waits for a
    rank that neither comes nor is known lost before masking it; 0 =
    $MOEEP_SHRINK_TIMEOUT_MS, else 3000).
    """

    num_sms = _lib.MOEEP_DEFAULT_NUM_SMS

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                 explicitly_destroy=False, enable_shrink=False, comm=None, *, socket=None, hidden=None,
                 num_experts=None, max_tokens_per_rank=None, num_max_dispatch_tokens_per_rank=None,
                 max_topk=None, timeout_ms=0, job_name=None, copy_outputs=False, recv_areas=DEFAULT_RECV_AREAS,
                 shrink_timeout_ms=0):
        self._ep = None
        self._fast = None  # the low-latency calls in C (_fast.py), from the endpoint's creation
        self._client = None
        torch = _torch()
        import torch.distributed as dist

        # The mask is the low-latency calls': without them there is nothing
        # to shrink (the mask calls then say so).
        self.enable_shrink = bool(enable_shrink) and bool(low_latency_mode)
        if isinstance(shrink_timeout_ms, bool) or not isinstance(shrink_timeout_ms, int) or shrink_timeout_ms < 0:
            raise ValueError("shrink_timeout_ms must be an int >= 0, not %r" % (shrink_timeout_ms,))
        self._shrink_timeout_ms = shrink_timeout_ms
        if self.enable_shrink:
            hidden, num_experts = _shrink_shapes(num_rdma_bytes, hidden, num_experts)

        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_ranks = self.group_size
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = explicitly_destroy
        self.copy_outputs = bool(copy_outputs)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self._plan = Plan(self.group_size, num_nvl_bytes, num_rdma_bytes, low_latency_mode, hidden, num_experts,
                          max_tokens_per_rank, num_max_dispatch_tokens_per_rank, max_topk, timeout_ms, recv_areas)
        if not torch.cuda.is_available():
            raise MoeepError(_errno.ENODEV, "moeep.Buffer needs a CUDA device; torch sees none")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm_stream = torch.cuda.Stream(device=self.device)
        self._applied_num_sms = None
        self._last_stream = None  # raw handle of the stream of the last call (_begin)
        # ctypes structures every call refills instead of making anew.
        self._dispatch_args, self._dispatch_res = _lib.DispatchArgs(), _lib.DispatchResult()
        self._dispatch_args_ref = ctypes.byref(self._dispatch_args)
        self._dispatch_res_ref = ctypes.byref(self._dispatch_res)
        self._combine_args = _lib.CombineArgs()
        self._combine_args_ref = ctypes.byref(self._combine_args)
        self._ll_dispatch_args, self._ll_dispatch_res = _lib.LlDispatchArgs(), _lib.LlDispatchResult()
        self._ll_dispatch_args_ref = ctypes.byref(self._ll_dispatch_args)
        self._ll_dispatch_res_ref = ctypes.byref(self._ll_dispatch_res)
        self._ll_combine_args = _lib.LlCombineArgs()
        self._ll_combine_args_ref = ctypes.byref(self._ll_combine_args)
        self._ll_no_hook = _lib.LlHook()  # the hook out-parameter of calls that ask for none
        self._ll_no_hook_ref = ctypes.byref(self._ll_no_hook)
        self._ll_views = {}  # (buffer set, slots, fp8) -> the low-latency output views
        self._ll_handles = {}  # (buffer set, tokens, slots, max tokens, experts) -> LowLatencyHandle

        src = 0
        if group is not None and group is not dist.group.WORLD:
            get_global = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
            src = get_global(group, 0)

        def broadcast(value):
            box = [value]
            dist.broadcast_object_list(box, src=src, group=group)
            return box[0]

        def all_gather(value):
            out = [None] * self.group_size
            dist.all_gather_object(out, value, group=group)
            return out

        self._client = attach(self.rank, self.group_size, broadcast, all_gather, socket=socket, name=job_name,
                              gpu_uuid=_gpu_uuid(torch, self.device))
        if self._plan.ready:
            self._create_endpoint()

    # ------------------------------------------------------------ endpoint

    def _create_endpoint(self):
        torch = _torch()
        if self._client is None:
            raise MoeepError(_errno.EBADF, "this Buffer was destroyed")
        if torch.cuda.is_current_stream_capturing():
            raise MoeepError(_errno.EBUSY, "the moeep endpoint is created at the first collective call, which "
                             "cannot be inside CUDA graph capture: pass hidden= and num_experts= to Buffer() "
                             "or make one call before capturing")
        cfg = _shrink_config(self._plan.config(num_sms=type(self).num_sms), self.enable_shrink,
                             self._shrink_timeout_ms)
        # libmoeep uses the calling thread's current device: make sure it is
        # ours and its primary context exists before the (collective) create.
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize(self.device)
        try:
            self._ep = Endpoint(self._client, cfg)
        except MoeepError:
            # Closing our session marks us lost, so that the other ranks'
            # barriers inside moeep_ep_create end instead of waiting for us.
            self._client.close()
            self._client = None
            raise
        self._applied_num_sms = cfg.num_sms
        self._handles = weakref.WeakSet()
        self._areas = _Areas(self._ep, cfg.recv_areas)
        if self.low_latency_mode and not self.enable_shrink:
            # Its calls run after the Python path's first ones, whose _begin
            # tells it their stream.
            self._fast = _fast.make(torch, self._ep, self.device.index, self.group_size, self._plan.hidden,
                                    self._plan.num_experts, self._plan.ll_max_tokens, _NO_EVENT)

    def _endpoint(self, hidden=None, num_experts=None, ll_tokens=None):
        """The endpoint, created on first use from what the call reveals."""
        if self._ep is not None:
            if hidden is not None and hidden != self._plan.hidden:
                raise ValueError("hidden %d differs from the %d this Buffer was created for" %
                                 (hidden, self._plan.hidden))
            if num_experts is not None and num_experts != self._plan.num_experts:
                raise ValueError("num_experts %d differs from the %d this Buffer was created for" %
                                 (num_experts, self._plan.num_experts))
            return self._ep
        if self._client is None:
            raise MoeepError(_errno.EBADF, "this Buffer was destroyed (or its creation failed)")
        if hidden is not None:
            self._plan.set_hidden(hidden)
        if num_experts is not None:
            self._plan.set_num_experts(num_experts)
        if ll_tokens is not None and self._plan.ll_max_tokens is None and not self._plan.num_rdma_bytes:
            self._plan.set_ll_max_tokens(ll_tokens)
        if not self._plan.ready:
            raise ValueError("num_experts is unknown at the first dispatch: pass num_tokens_per_expert "
                             "(get_dispatch_layout) or Buffer(..., num_experts=)")
        self._create_endpoint()
        return self._ep

    def _apply_num_sms(self, config):
        n = config.num_sms if config is not None else type(self).num_sms
        if n != self._applied_num_sms:
            check_num_sms(n)
            self._ep.check(self._ep.lib.moeep_ep_set_num_sms(self._ep.ptr, n), "set_num_sms")
            self._applied_num_sms = n

    def is_available(self):
        return self._ep is not None or self._client is not None

    def destroy(self):
        """Frees the endpoint (synchronising the device) and leaves the job.
        Collective in moeep as in DeepEP. Outputs that are views into the
        NVLink buffer must not be used afterwards."""
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        if self._ep is not None:
            for h in list(getattr(self, "_handles", ())):
                h.release()
            self._ll_views.clear()
            self._ll_handles.clear()
            self._ep.destroy()
            self._ep = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def __del__(self):
        if sys.is_finalizing():
            return  # the process is ending: the OS and moeepd clean up
        if getattr(self, "explicitly_destroy", False):
            return  # DeepEP: the owner calls destroy() (collective); never behind its back
        try:
            self.destroy()
        except Exception:
            pass

    def check(self):
        """Waits for the device and raises MoeepError if an earlier kernel
        failed (a device wait timed out, or the job was aborted because a rank
        was lost). moeep-only."""
        if self._ep is not None:
            self._ep.check(self._ep.lib.moeep_ep_check(self._ep.ptr), "device check")

    def get_comm_stream(self):
        return self.comm_stream

    # ------------------------------------------------------------ static

    @staticmethod
    def is_sm90_compiled():
        """True: moeep's kernels are built for sm_90 (DeepEP asks before
        using its SM90 features, e.g. FP8 dispatch)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms):
        """SMs (blocks) of normal dispatch/combine for every Buffer, applied at
        the next call (the same on every rank, as in DeepEP)."""
        check_num_sms(new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        """An EventOverlap recorded on the current stream."""
        torch = _torch()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return EventOverlap(ev)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """Bytes of moeep's low-latency buffers for these shapes (they live in
        the NVLink buffer; no RDMA memory is allocated). Passed back as
        num_rdma_bytes, it gives back num_max_dispatch_tokens_per_rank (and to
        an elastic Buffer the shapes too, LowLatencySizeHint)."""
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError("%s must be a positive int, not %r" % (name, v))
        return LowLatencySizeHint(low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts),
                                  num_max_dispatch_tokens_per_rank, hidden, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks):
        """Config with the current Buffer.num_sms; nothing else depends on
        num_ranks in moeep."""
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError("num_ranks must be a positive int, not %r" % (num_ranks,))
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks):
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError("num_ranks must be a positive int, not %r" % (num_ranks,))
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    # ------------------------------------------------------------ streams

    def _begin(self, previous_event, async_finish, allocate_on_comm_stream):
        """Where a call runs: (compute, side, ptr). Without async_finish the
        caller's stream would wait for the call at once (DeepEP's rule), so
        the call runs on that stream: side None, ptr its raw handle, no
        events. With async_finish it runs on the comm stream (side), after
        previous_event or else after the caller's stream (compute), and
        _finish records the event, as DeepEP. A call on another stream than
        the last one is ordered after it too: the buffers the last call used
        may be reused (receive areas, low-latency sets), and DeepEP's calls,
        all on its comm stream, are ordered among themselves that way."""
        torch = _torch()
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream needs previous_event and async_finish (as DeepEP)")
        if not async_finish:
            if previous_event is not None and previous_event.event is not None:
                previous_event.current_stream_wait()
            compute = side = None
            ptr = _current_stream(torch, self.device.index)
        else:
            compute, side = torch.cuda.current_stream(), self.comm_stream
            if previous_event is not None:
                previous_event.wait_on(side)
            else:
                side.wait_stream(compute)
            ptr = side.cuda_stream
        last, self._last_stream = self._last_stream, ptr
        if self._fast is not None:
            self._fast.note_stream(ptr)
        if last is not None and last != ptr and not torch.cuda.is_current_stream_capturing():
            # (A graph being captured is replayed later, after whatever runs
            # before the replay; waiting on a stream outside the capture
            # would end the capture.)
            prev = self.comm_stream if last == self.comm_stream.cuda_stream else _stream_of(torch, last, self.device)
            (side if side is not None else torch.cuda.current_stream()).wait_stream(prev)
        return compute, side, ptr

    def _finish(self, compute, side, allocate_on_comm_stream, tensors):
        """DeepEP's ending: for a call on the comm stream (async_finish) an
        event recorded there, holding the call's tensors; else none (the
        call ran on the caller's stream)."""
        if side is None:
            return EventOverlap(None)
        ev = _torch().cuda.Event()
        ev.record(side)
        for t in tensors:
            if t is not None:
                _record(t, side)
                if allocate_on_comm_stream:
                    _record(t, compute)
        return EventOverlap(ev, tensors)

    def _on(self, side):
        """The context in which torch ops of a call run on its stream."""
        return _torch().cuda.stream(side) if side is not None else contextlib.nullcontext()

    def _alloc_stream(self, allocate_on_comm_stream):
        """Where a call's outputs are allocated: the caller's stream, or the
        comm stream (DeepEP's allocate_on_comm_stream)."""
        return _torch().cuda.stream(self.comm_stream) if allocate_on_comm_stream else contextlib.nullcontext()


_install_host_time(Buffer)  # MOEEP_HOST_TIME=1 only (_hosttime.py)


def _gpu_uuid(torch, device):
    try:
        u = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return None
    u = u if u.startswith("GPU-") else "GPU-" + u
    return u if len(u) <= 64 and u.isprintable() else None
