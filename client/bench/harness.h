/* Multi-process harness for GPU programs (moeep-bench, the GPU tests): starts
 * a private moeepd, creates a job and forks one process per rank, each
 * attached through the daemon exactly as an inference process would be. */
#ifndef MOEEP_HARNESS_H
#define MOEEP_HARNESS_H

#include <stddef.h>
#include <sys/types.h>

#include "moeep.h"

struct harness {
        char dir[64];     /* private temporary directory */
        char socket[128]; /* daemon socket in use */
        pid_t daemon_pid; /* our moeepd, 0 when attached to a running one */
        /* Two simulated nodes ($MOEEP_HARNESS_NODES=2): a second private
         * moeepd, meshed with the first over 127.0.0.1 (cluster key, libfabric
         * tcp transport); the upper half of the ranks attach to it. */
        int nodes; /* 1 or 2 */
        char socket_b[128];
        pid_t daemon_b_pid;
        char moeepd[4096]; /* its program, for starting the daemons (the second one too) */
        void *shared;      /* MAP_SHARED anonymous memory, seen by every rank */
        size_t shared_bytes;
};

/* With two nodes: the node of `rank` among `ranks` (0: the first daemon,
 * 1: the second, which holds the upper half). */
static inline int harness_node_of(int rank, int ranks) {
        return rank >= ranks - ranks / 2;
}

/* Called in each rank process after it joined the job and selected GPU
 * `rank`; returns 0 on success. */
typedef int (*harness_rank_fn)(struct moeep_client *client, int rank, int ranks, void *shared, void *arg);

/* Starts `moeepd` (path; NULL finds it next to this program in the build
 * tree) on a private socket, or attaches to `socket` when that is not NULL.
 * With $MOEEP_HARNESS_NODES=2 (and no `socket`) it starts two daemons as
 * two nodes: ranks [0, ranks - ranks / 2) join at the first, the others at
 * the second, over libfabric tcp (host-staged), or over the cuda transport
 * (GPU memory end to end) with $MOEEP_HARNESS_TRANSPORT=cuda. Must run
 * before any CUDA call in this process. */
int harness_init(struct harness *h, const char *moeepd, const char *socket, size_t shared_bytes);

/* Creates a job of `ranks` ranks and runs fn in one forked process per
 * rank, rank i on GPU i % (number of GPUs): with more ranks than GPUs the
 * ranks share them (time-sliced; a warning says that times measured then
 * are not performance figures) and, when an MPS daemon runs, each rank
 * process gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / (ranks a GPU). Returns the number of ranks that failed (exit code, signal, or a
 * hang past timeout_s, after which every rank is killed). */
int harness_run(struct harness *h, int ranks, const char *name, harness_rank_fn fn, void *arg, int timeout_s);

/* Called by harness_run_watched() in the parent every few milliseconds
 * while the ranks run (to act on requests the ranks leave in `shared`). */
typedef void (*harness_watch_fn)(struct harness *h, void *arg);

/* harness_run() with a watch function (NULL: none). */
int harness_run_watched(struct harness *h, int ranks, const char *name, harness_rank_fn fn, void *arg,
                        int timeout_s, harness_watch_fn watch);

/* Our (first) moeepd (parent only; 0 or -errno): _stop sends `sig` (SIGTERM,
 * SIGKILL) and reaps it (SIGKILL after 10 s: -ETIMEDOUT); _start starts it again on the same socket and
 * returns once it accepts connections. */
int harness_daemon_stop(struct harness *h, int sig);
int harness_daemon_start(struct harness *h);

/* Number of CUDA devices, counted in a child process so that this process
 * stays free of CUDA (fork after CUDA init is not allowed); 0 when none.
 * $MOEEP_HARNESS_GPUS=N first narrows CUDA_VISIBLE_DEVICES to N GPUs. */
int harness_gpu_count(void);

/* Free bytes of GPUs 0..n-1, measured like harness_gpu_count(): in a
 * child with a context on each (the same overhead every time). 0 or -1. */
int harness_gpu_free(size_t *ret_free, int n);

/* Stops our daemon and removes the temporary directory. */
void harness_fini(struct harness *h);

#endif
