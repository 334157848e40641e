/* The inside of tp-cuda.c (the backend: CUDA context, regions, writes,
 * completions, and the Unix socket through which two daemons of one host
 * pass each other their regions' fds), for the unit tests, which open it
 * over a libcuda stand-in (tpc_open()). Not for any other file.
 *
 * Threads, as transport.h allows: the event loop calls open, close, mr_new,
 * mr_free, peer_new and peer_connect; the proxy thread calls write, poll,
 * peer_fail and peer_free; the backend's own server thread
 * (tpc_server_start()) answers the other daemons. `lock` guards what more
 * than one of them touches: the region list, the tokens, the server's
 * connections (every send on them), and a peer's fd and blob once another
 * index's peer_connect may look at them (peer_free closes and clears them
 * under it). The proxy thread alone owns the operation queue and each
 * peer's imports. */
#ifndef MOEEPD_TP_CUDA_INTERNAL_H
#define MOEEPD_TP_CUDA_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>

#include "datapath/tp-cuda-api.h"
#include "datapath/tp-cuda-wire.h"
#include "datapath/transport.h"
#include "log.h"

#define TPC_MAX_PEERS TP_MAX_PEERS
#define TPC_MAX_CONNS 64
/* Imports one peer's daemon may have us hold at once (its ranks' receive
 * and counter regions). */
#define TPC_MAX_REMOTES 1024
/* cuMem mappings are made in units of the allocation granularity, which is
 * 2 MiB for device memory on every NVIDIA GPU the driver API serves; a
 * region's length is rounded up to it, and cuMemMap refuses a length the
 * allocation behind the fd does not have. */
#define TPC_MAP_ALIGN (2ull << 20)
/* How long the proxy thread waits for a peer daemon's answer to a fetch. */
#define TPC_FETCH_TIMEOUT_MS 2000
/* How long a connection may stay unauthenticated. */
#define TPC_HELLO_TIMEOUT_MS 1000

/* Memory the daemon's CUDA context can address: an imported cuMem fd, or
 * host memory registered with CUDA (a memfd we mapped, or the caller's). */
struct tpc_mapping {
        tpc_devptr ptr; /* device address of offset 0 (for host memory, its mapped alias) */
        bool host;      /* host memory */
        tpc_mem_handle handle;
        size_t cumem_size; /* > 0 when ptr is our reservation with handle mapped */
        void *host_addr;   /* host memory: registered with cuMemHostRegister */
        void *map;         /* owns when not NULL: our mmap of a memfd */
        size_t map_len;
};

struct tp_mr {
        TAILQ_ENTRY(tp_mr) entry;
        uint64_t key; /* random, unique per transport: what the rkey names */
        enum tp_mem_kind kind;
        uint64_t length;
        struct tpc_mapping m;
        int fd; /* owns; a dup of the client's fd that peers fetch; -1 for TP_MEM_HOST */
};

/* A region of a peer daemon, imported here on the first write into it. */
struct tpc_remote {
        uint64_t key;
        uint64_t length;
        struct tpc_mapping m;
};

enum tpc_peer_state {
        TPC_PEER_FREE,      /* the index is not in use (never, or peer_free gave it back) */
        TPC_PEER_NEW,       /* peer_new made its token; no connection of ours yet */
        TPC_PEER_CONNECTED, /* our connection to its socket is up (HELLO sent) */
        TPC_PEER_DEAD,      /* the connection failed: writes to it fail */
};

/* Our side of one peer daemon. */
struct tpc_peer {
        _Atomic int state;          /* enum tpc_peer_state; set to CONNECTED (release) after fd */
        int fd;                     /* owns; our connection to the peer's socket */
        bool welcomed;              /* its WELCOME came (proxy thread) */
        struct tpc_blob blob;       /* what it sent */
        struct tpc_remote *remotes; /* owns; proxy thread */
        uint32_t nremotes;
};

/* One write in flight, in the order posted (one stream keeps that order). */
struct tpc_op {
        uint64_t cookie;
        uint32_t peer;
        int status;     /* set when the write failed before it reached the stream */
        bool has_event; /* events[slot] was recorded after it */
};

/* One connection to our socket (the server thread's). */
struct tpc_conn {
        int fd;
        int peer; /* the peer whose token it presented; -1 until HELLO */
        uint64_t since_ms;
        bool shut; /* shut down (a revocation it did not take): the server thread drops it */
};

struct tp {
        char who[64]; /* "transport cuda device N", for messages */
        struct tpc_api api;
        void *lib; /* owns: dlopen handle */
        int ordinal;
        tpc_device dev;
        tpc_context ctx; /* the primary context, retained */
        tpc_stream stream;

        /* The proxy thread's. */
        uint32_t depth; /* power of two */
        tpc_event *events;
        struct tpc_op *ops;
        uint64_t head, tail;
        uint64_t polls;
        int epoll_fd; /* our connections to peers, for REVOKE and failures */

        pthread_mutex_t lock;
        TAILQ_HEAD(, tp_mr) mrs;
        struct tpc_peer *peers;             /* owns; TPC_MAX_PEERS */
        uint8_t (*tokens)[TPC_TOKEN_BYTES]; /* owns; per peer, all zero while the index is free */
        bool *token_used;                   /* owns; per peer */
        struct tpc_conn conns[TPC_MAX_CONNS];
        uint32_t nconns;

        struct tpc_blob self; /* our pid, uid and socket name; token filled per peer */
        int listen_fd;
        int stop_fd;
        pthread_t server;
        bool server_started;

        struct {
                atomic_uint_fast64_t writes, device, host, daemon;
        } stats;
};

/* tp-cuda.c */
/* tp_cuda_ops.open with the driver's entry points from `api` (the unit
 * tests' stand-in for libcuda), or from libcuda.so.1 when NULL. */
int tpc_open(const struct tp_config *cfg, const struct tpc_api *api, struct tp **ret, char *errmsg);

#endif
