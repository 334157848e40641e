/* libmoeep: the client side of moeep, expert-parallel communication for
 * Mixture-of-Experts inference.
 *
 * Conventions: every function that can fail returns 0 (or a count) on
 * success and a negative errno value on failure; output parameters are named
 * ret_* and are written only on success. Objects are opaque. A client handle
 * is not thread-safe: use it from one thread at a time (two clients in one
 * process are independent). The text of the last error of a handle is
 * available from moeep_client_error() / moeep_ep_error().
 */
#ifndef MOEEP_H
#define MOEEP_H

#include <stddef.h>
#include <stdint.h>

/* The job's limits (MOEEP_MAX_RANKS, MOEEP_UNIQUE_ID_BYTES) and the layout
 * of its control page (struct moeep_control_page), which moeepd shares. */
#include "moeep_job.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ control plane */

struct moeep_client;

/* Opaque bytes naming a job and holding its secret. Rank 0 gets it from
 * moeep_job_create() and broadcasts it (e.g. with torch.distributed); never
 * log it. */
struct moeep_unique_id {
        unsigned char bytes[MOEEP_UNIQUE_ID_BYTES];
};

enum moeep_region_kind {
        MOEEP_REGION_CUMEM_FD = 1, /* cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) */
        MOEEP_REGION_DMABUF = 2,   /* cuMemGetHandleForAddressRange(DMA_BUF_FD) */
        MOEEP_REGION_MEMFD = 3,    /* memfd_create(), host memory */
};

/* A region another rank registered. `fd` belongs to the caller once
 * returned; moeep_regions_free() closes the fds still >= 0. A region of a
 * rank joined at another daemon of the mesh (a remote rank,
 * moeep_job_ranks()) comes with fd -1: only its metadata is known here, its
 * memory is reached through the daemons' transports. */
struct moeep_region {
        int rank;
        uint32_t tag;
        enum moeep_region_kind kind;
        uint64_t size;
        uint64_t id;
        int fd;
};

enum moeep_event_type {
        MOEEP_EVENT_PEER_LOST = 1, /* a rank of our job died; the job is aborted */
        MOEEP_EVENT_SHUTDOWN = 2,  /* the daemon is going away */
};

struct moeep_event {
        enum moeep_event_type type;
        uint64_t job_id;
        int rank; /* the lost rank, for MOEEP_EVENT_PEER_LOST */
        char reason[128];
};

/* Connects to moeepd and says Hello. `socket_path` NULL means $MOEEP_SOCKET,
 * or /run/moeep/moeepd.sock when that is unset. -ENOENT / -ECONNREFUSED when
 * no daemon listens there, -EPROTONOSUPPORT on a protocol major mismatch. */
int moeep_connect(const char *socket_path, struct moeep_client **ret_client);

/* Closes the connection (leaving the job implicitly) and frees everything,
 * including mapped control pages. Accepts NULL. */
void moeep_client_free(struct moeep_client *client);

/* Text of the last error on this handle ("" when none). Valid until the
 * next call on the handle. */
const char *moeep_client_error(const struct moeep_client *client);

/* The socket, for callers that want to poll for events. */
int moeep_client_fd(const struct moeep_client *client);

/* Creates a job of `world_size` ranks (1..MOEEP_MAX_RANKS) named `name`
 * (1..64 printable bytes). The caller still joins it as a rank. */
int moeep_job_create(struct moeep_client *client, const char *name, int world_size,
                     struct moeep_unique_id *ret_id);

/* Joins the job as `rank`. `gpu_uuid` may be NULL. On success the control
 * page is mapped (moeep_job_control_page()). Errors: -EACCES wrong secret,
 * -ENOENT no such job, -ERANGE rank out of range, -EEXIST rank taken,
 * -EINVAL world size mismatch or bad argument, -EISCONN already in a job. */
int moeep_job_join(struct moeep_client *client, const struct moeep_unique_id *id, int rank, int world_size,
                   const char *gpu_uuid);

/* Leaves the job; our regions go away at the daemon. */
int moeep_job_leave(struct moeep_client *client);

/* Blocks until every rank of the job entered the barrier. -ENOTCONN when a
 * rank was lost (moeep_client_error() names it). */
int moeep_job_barrier(struct moeep_client *client);

/* This session's job, rank and world size; -ENOTCONN when not in a job. */
int moeep_job_info(const struct moeep_client *client, uint64_t *ret_job_id, int *ret_rank,
                   int *ret_world_size);

/* Which ranks of this session's job are joined at this daemon
 * (`*ret_local`, this rank included: intranode peers, reached through the
 * regions' fds) and which at another daemon of the mesh (`*ret_remote`:
 * internode peers, reached through the daemon's transports, never as fds;
 * their regions are not listed by moeep_regions_fetch()). Bit r stands for
 * rank r; ranks not joined yet are in neither. Asks the daemon (JobsList),
 * so the answer is current. Either pointer may be NULL. -ENOTCONN when not
 * in a job. */
int moeep_job_ranks(struct moeep_client *client, uint32_t *ret_local, uint32_t *ret_remote);

/* The job's control page (NULL when not in a job). */
const volatile struct moeep_control_page *moeep_job_control_page(const struct moeep_client *client);

/* Registers a memory region with the job. `fd` stays owned by the caller
 * (the daemon keeps its own duplicate). */
int moeep_region_register(struct moeep_client *client, int fd, enum moeep_region_kind kind, uint64_t size,
                          uint32_t tag, uint64_t *ret_region_id);

/* Registers a memory region by naming descriptor `fd_number` of the calling
 * process instead of sending it: the daemon takes it with pidfd_getfd()
 * from exactly the process that connected `client` (SO_PEERPIDFD), checks
 * it like a sent fd, and peers receive it as from moeep_region_register().
 * Call it from the process that made the connection (not a child forked
 * afterwards); the daemon needs CAP_SYS_PTRACE and Linux 6.5+, this process
 * nothing. -EOPNOTSUPP when the daemon does not offer it (protocol 1.4),
 * -EBADF when `fd_number` is not open here or not of kind `kind`, -EPERM
 * when the daemon may not take it (moeep_client_error() names the
 * capability it lacks). */
int moeep_region_register_pidfd(struct moeep_client *client, int fd_number, enum moeep_region_kind kind,
                                uint64_t size, uint32_t tag, uint64_t *ret_region_id);

/* Releases a region registered by this client. -EINVAL when no region of
 * this session has that id. */
int moeep_region_release(struct moeep_client *client, uint64_t region_id);

/* Fetches the regions of `rank` (or of every other rank when rank == -1)
 * with tag `tag` (or every tag when tag == -1); those of remote ranks with
 * fd -1. The caller owns the array
 * and its fds; free with moeep_regions_free(). */
int moeep_regions_fetch(struct moeep_client *client, int rank, int64_t tag, struct moeep_region **ret_regions,
                        size_t *ret_count);

/* Closes the fds still >= 0 and frees the array. Accepts NULL. */
void moeep_regions_free(struct moeep_region *regions, size_t count);

/* Returns 1 with the next queued or arriving event, 0 when none is pending
 * (it does not block), or -errno (-ECONNRESET when the daemon is gone). */
int moeep_event_next(struct moeep_client *client, struct moeep_event *ret_event);

/* ------------------------------------------------------------------ data plane
 *
 * Declared in moeep_ep.h (needs the CUDA runtime headers for cudaStream_t). */

#ifdef __cplusplus
}
#endif

#endif
