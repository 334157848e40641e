/* Internal interface of libmoeep's control plane, shared by the library's
 * other parts (the data plane), moeepctl and the client tests. Nothing here
 * is exported from libmoeep.so (see libmoeep.map). */
#ifndef MOEEP_CLIENT_INTERNAL_H
#define MOEEP_CLIENT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "moeep.h"
#include "record.h"

/* Events kept for moeep_event_next(); when the queue is full the oldest is
 * dropped and counted (client_events_dropped()). */
#define MOEEP_CLIENT_EVENT_QUEUE 64

/* How long moeep_connect() waits for the daemon's Welcome before giving up,
 * so that a socket nobody serves does not hang the caller. */
#define MOEEP_CLIENT_HELLO_TIMEOUT_MS 10000

/* Like moeep_connect(), but says Hello as `client_name` (NULL:
 * "libmoeep/VERSION"; moeepctl clients shows it) and on failure copies the
 * error text (which names the socket path and, when the daemon refused us,
 * its message) into `errbuf` when that is not NULL. moeepctl uses it to
 * explain failures. */
int client_connect(const char *socket_path, const char *client_name, struct moeep_client **ret_client,
                   char *errbuf, size_t errlen);

/* Sends `req` (its body case is the record type) with `fds` attached (they
 * stay owned by the caller) and waits for the Response carrying the same
 * request id; Events that arrive meanwhile are queued. The Response must be
 * of body case `expect`: an Error response becomes the matching -errno
 * (client_error_code_to_errno()) with the daemon's text as the handle's
 * error, anything else is -EPROTO. On success the handle's error text is
 * cleared and *ret_resp is the decoded
 * Response (free it with moeep__v1__response__free_unpacked(resp, NULL)) and
 * the descriptors that came with it are left in the handle: see
 * client_reply_fds().
 *
 * When the daemon closes the connection the call fails with -ECONNRESET, and
 * so does every later call on the handle. */
int client_call(struct moeep_client *client, const Moeep__V1__Request *req,
                Moeep__V1__Response__BodyCase expect, const int *fds, size_t nfds,
                Moeep__V1__Response **ret_resp);

/* 0 while the daemon's end of the connection is open, else -ECONNRESET
 * (the handle is then broken, as after a failed call). One poll(2) with no
 * wait and no read, at most once per CLIENT_ALIVE_POLL_NS: the data plane
 * calls it at every call (a few microseconds apart in a decode loop), so
 * that losing moeepd is an error within a millisecond rather than unseen
 * peer failures later, without a system call in every call. */
#define CLIENT_ALIVE_POLL_NS 1000000ull
int client_check_alive(struct moeep_client *client);

/* The descriptors received with the last successful client_call().
 * The handle owns them: a caller that keeps one sets its slot to -1; the
 * others are closed by the next call or by moeep_client_free(). */
int *client_reply_fds(struct moeep_client *client, size_t *ret_nfds);

/* Limits how long one call waits for the daemon's answer (SO_RCVTIMEO);
 * 0 waits for ever, which is the default, since a barrier legitimately
 * waits as long as the slowest rank. A call that times out fails with
 * -ETIMEDOUT and leaves the handle unusable (its answer may still come). */
int client_set_timeout(struct moeep_client *client, unsigned timeout_ms);

/* Sets the handle's error text and returns `r` (a -errno), so that error
 * paths read `return client_error_set(c, -EINVAL, "...", ...);`. */
int client_error_set(struct moeep_client *client, int r, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

/* Events dropped because the queue was full. */
uint64_t client_events_dropped(const struct moeep_client *client);

/* The uid of the process serving the handle's socket (SO_PEERCRED).
 * Returns 0 or -errno. */
int client_peer_uid(const struct moeep_client *client, uid_t *ret_uid);

/* The socket path the handle connected to (after the $MOEEP_SOCKET /
 * default resolution). */
const char *client_socket_path(const struct moeep_client *client);

/* Daemon's version string and the session id from Welcome. */
const char *client_daemon_version(const struct moeep_client *client);
uint64_t client_session_id(const struct moeep_client *client);

/* FEATURE_* bits agreed in Welcome: a request behind a bit may be sent only
 * when it is set. */
uint64_t client_features(const struct moeep_client *client);

/* The internode proxy path (protocol 1.3, FEATURE_PROXY; docs/protocol.md,
 * "Internode data path"). A rank that talks to ranks at other daemons
 * registers three host-memory regions, each a memfd sealed with
 * F_SEAL_SHRINK (memfd_create(MFD_ALLOW_SEALING), ftruncate, F_ADD_SEALS):
 *
 *   MOEEP_PROXY_SEND      its payloads; descriptor src_offset is into it.
 *   MOEEP_PROXY_RECV      where other ranks' payloads land; their
 *                         descriptor dst_offset is into it.
 *   MOEEP_PROXY_COUNTERS  uint64_t counter[size / 8]: a descriptor with
 *                         PROXY_DESC_SIGNAL sets the receiver's
 *                         counter[signal_id] = signal_value after its data.
 *
 * Then (after a job barrier, so that every rank's regions reached every
 * daemon) it opens a channel: a descriptor ring (layout and ordering rules
 * in daemon/datapath/proxy.h) that it maps MAP_SHARED read-write. Descriptor `peer`
 * is the destination's job rank; ranks at this daemon are not routed (a
 * descriptor naming one fails the ring), NVLink reaches them. */
enum moeep_proxy_role {
        MOEEP_PROXY_SEND = 1,
        MOEEP_PROXY_RECV = 2,
        MOEEP_PROXY_COUNTERS = 3,
};

/* Registers `memfd` (stays the caller's) of `size` bytes as the rank's
 * region of `role`; one region per role. -EOPNOTSUPP from a daemon before
 * 1.3, -EIO (ERROR_INTERNAL) from one without an internode transport, -EINVAL
 * for a memfd without F_SEAL_SHRINK or a second region of a role; the
 * handle's error names it. */
int client_proxy_region_register(struct moeep_client *client, int memfd, uint64_t size,
                                 enum moeep_proxy_role role, uint32_t tag, uint64_t *ret_region_id);

/* The same for GPU memory: `fd` is a cuMem POSIX fd (MOEEP_REGION_CUMEM_FD),
 * which only a daemon whose transport imports GPU memory (cuda) takes; the
 * others refuse it (an error naming the transport), and the caller falls
 * back to a memfd. */
int client_proxy_region_register_gpu(struct moeep_client *client, int fd, uint64_t size,
                                     enum moeep_proxy_role role, uint32_t tag, uint64_t *ret_region_id);

/* The same for GPU memory exported as a dma-buf (MOEEP_REGION_DMABUF,
 * cuMemGetHandleForAddressRange), which a NIC registers (verbs:
 * ibv_reg_dmabuf_mr; libfabric: FI_MR_DMABUF); `fd` stays the caller's. */
int client_proxy_region_register_dmabuf(struct moeep_client *client, int fd, uint64_t size,
                                        enum moeep_proxy_role role, uint32_t tag, uint64_t *ret_region_id);

/* Opens a channel of `capacity` descriptors (a power of two; 0 = 1024):
 * *ret_ring_fd is the ring memfd, the caller's to map and close. -EAGAIN
 * (ERROR_NOT_READY) while a rank at another daemon has not joined or not
 * registered its recv and counters regions: pass a job barrier and retry.
 * The ring goes away when the rank leaves the job or the session ends. */
int client_proxy_channel_open(struct moeep_client *client, uint32_t capacity, int *ret_ring_fd,
                              uint64_t *ret_ring_id, uint32_t *ret_capacity);

/* State the data plane keeps for the joined job on the handle (the proxy
 * path's regions and ring, client/lib/ep-px.c: registered once per rank and
 * job, reused by later endpoints). free_fn runs when the handle leaves the
 * job or is freed. */
void *client_job_data(const struct moeep_client *client);
void client_job_data_set(struct moeep_client *client, void *data, void (*free_fn)(void *data));

/* Maps a daemon ErrorCode to a negative errno value; unknown codes (a newer
 * daemon may add some) map to -EIO. */
int client_error_code_to_errno(int code);

/* Name of a daemon ErrorCode ("ERROR_RANK_TAKEN"), or "ERROR_UNKNOWN". */
const char *client_error_code_to_string(int code);

#endif
