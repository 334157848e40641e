"""Control plane: a connection to moeepd and the job a group of ranks joins.

Free of torch: Buffer passes torch.distributed collectives to attach(), the
tests pass threads' collectives. Every failure is a MoeepError that carries
libmoeep's message; a failure on one rank is made known to every rank through
the same collectives, so that no rank is left waiting for another.
"""

import ctypes
import errno as _errno
import os

from . import _lib
from ._lib import MoeepError


class Client(_lib.Handle):
    """One session with moeepd (struct moeep_client). Not thread-safe."""

    _error_fn = "moeep_client_error"
    _gone = "the moeepd connection is closed"

    def __init__(self, socket=None, library=None):
        self.lib = library or _lib.load_library()
        self.socket, origin = _lib.resolve_socket(socket)
        self._ptr = ctypes.c_void_p()
        r = self.lib.moeep_connect(os.fsencode(self.socket), ctypes.byref(self._ptr))
        if r < 0:
            hint = ""
            if -r in (_errno.ENOENT, _errno.ECONNREFUSED):
                hint = "; is moeepd running? (pass socket= or set MOEEP_SOCKET)"
            elif -r in (_errno.EACCES, _errno.EPERM):
                hint = "; is this user in the socket's group (moeep)?"
            raise MoeepError(
                -r,
                "cannot connect to moeepd at %s (%s): %s%s" % (self.socket, origin, os.strerror(-r), hint),
            )

    def create_job(self, name, world_size):
        """moeep_job_create: returns the 128-byte unique id (never log it)."""
        uid = _lib.UniqueId()
        self.check(self.lib.moeep_job_create(self.ptr, name.encode(), int(world_size), ctypes.byref(uid)),
                   "creating job %r of %d ranks" % (name, world_size))
        return bytes(uid.bytes)

    def join(self, unique_id, rank, world_size, gpu_uuid=None):
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != _lib.MOEEP_UNIQUE_ID_BYTES:
            raise ValueError("unique id must be %d bytes" % _lib.MOEEP_UNIQUE_ID_BYTES)
        uid = _lib.UniqueId()
        ctypes.memmove(uid.bytes, bytes(unique_id), _lib.MOEEP_UNIQUE_ID_BYTES)
        self.check(self.lib.moeep_job_join(self.ptr, ctypes.byref(uid), int(rank), int(world_size),
                                           gpu_uuid.encode() if gpu_uuid else None),
                   "joining as rank %d of %d" % (rank, world_size))

    def barrier(self):
        self.check(self.lib.moeep_job_barrier(self.ptr), "job barrier")

    def info(self):
        """(job id, rank, world size) of the job this session joined."""
        job, rank, ws = ctypes.c_uint64(), ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.moeep_job_info(self.ptr, ctypes.byref(job), ctypes.byref(rank), ctypes.byref(ws)),
                   "job info")
        return job.value, rank.value, ws.value

    def leave(self):
        self.check(self.lib.moeep_job_leave(self.ptr), "leaving the job")

    def close(self):
        """Closes the session; a job it joined sees the rank as lost."""
        if self._ptr:
            self.lib.moeep_client_free(self._ptr)
            self._ptr = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def attach(rank, world_size, broadcast, all_gather, socket=None, name=None, gpu_uuid=None, library=None):
    """Makes rank `rank` of `world_size` a member of one fresh job.

    Collective: every rank calls it. Rank 0 connects and creates the job;
    broadcast(value) (rank 0's value, None elsewhere; returns rank 0's value)
    hands the unique id, or rank 0's error, to the others; every rank joins;
    all_gather(value) -> list tells every rank whether every join worked.
    Returns the joined Client, or raises MoeepError on every rank when any
    rank failed (naming it)."""
    if not 1 <= world_size <= _lib.MOEEP_MAX_RANKS:
        raise ValueError("moeep jobs have 1..%d ranks (one node), not %d" % (_lib.MOEEP_MAX_RANKS, world_size))
    if not 0 <= rank < world_size:
        raise ValueError("rank %d is outside 0..%d" % (rank, world_size - 1))
    name = name or "python-%d" % os.getpid()
    client = None
    payload = None
    if rank == 0:
        try:
            client = Client(socket, library)
            payload = ("ok", client.create_job(name, world_size))
        except (MoeepError, OSError) as e:
            payload = ("error", getattr(e, "errno", None) or _errno.EIO, str(e))
            if client:
                client.close()
                client = None
    payload = broadcast(payload)
    if payload[0] != "ok":
        raise MoeepError(payload[1], payload[2] if rank == 0 else "rank 0 could not create the job: " + payload[2])

    status = ("ok",)
    try:
        if client is None:
            client = Client(socket, library)
        client.join(payload[1], rank, world_size, gpu_uuid)
    except (MoeepError, OSError) as e:
        status = ("error", getattr(e, "errno", None) or _errno.EIO, str(e))
    statuses = all_gather(status)
    failed = [(r, s) for r, s in enumerate(statuses) if s[0] != "ok"]
    if failed:
        if client:
            client.close()
        err = status[1] if status[0] != "ok" else failed[0][1][1]
        raise MoeepError(err, "attaching to moeepd failed on " +
                         "; ".join("rank %d: %s" % (r, s[2]) for r, s in failed))
    return client
