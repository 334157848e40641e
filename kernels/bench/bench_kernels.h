/* Launchers of the kernels that only the benchmarks run (kernels/bench/bench.cu):
 * moeep-bench's references and moeep-proxy-bench's GPU producer. They are
 * built into their own static library (moeep-bench-kernels), linked by
 * those two programs and never by libmoeep. */
#ifndef MOEEP_BENCH_KERNELS_H
#define MOEEP_BENCH_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Threads of every benchmark kernel but the single-thread ones. */
#define MOEEP_BENCH_THREADS 1024

/* Busy-waits `ns` on the stream (timing: queue the measured work behind it). */
int moeep_launch_delay(uint64_t ns, cudaStream_t stream);

/* NVLink floor: every rank stores `bytes` into every peer at once, `passes`
 * times over (the peer's combine area holds `bytes` per source rank). */
int moeep_launch_p2p_put(const struct moeep_ctx *ctx, size_t bytes, int blocks, int passes, cudaStream_t stream);

/* NVLink flag round trip between two GPUs (one thread each): the side with
 * `ping` stores into `theirs` (the other's word, mapped) and waits for its
 * own word `mine` to answer, batches * per times; the other side answers.
 * Both words must read 0 at the start. out: device [1 + batches] int64,
 * out[0] = 0 or -ETIMEDOUT (no answer within timeout_ns of the start),
 * out[1 + b] = ns of batch b (per round trips; pinging side only). */
int moeep_launch_flag_pingpong(uint64_t *mine, uint64_t *theirs, int ping, int batches, int per, uint64_t timeout_ns,
                               int64_t *out, cudaStream_t stream);

/* What a user would run around an NCCL all-to-all: positions of each token
 * in a send buffer grouped by destination, the pack, and the sum of the
 * rows that come back (offsets: device [ranks], first row of each dst). */
int moeep_launch_ref_scan(const uint8_t *is_token_in_rank, int num_tokens, int ranks, int32_t *pos, int32_t *counts,
                          cudaStream_t stream);
int moeep_launch_ref_pack(const void *x, size_t row_bytes, int num_tokens, int ranks, const int32_t *pos,
                          const int32_t *offsets, void *sendbuf, int blocks, cudaStream_t stream);
int moeep_launch_ref_unpack(const void *back, int hidden, int num_tokens, int ranks, const int32_t *pos,
                            const int32_t *offsets, void *out, int blocks, cudaStream_t stream);

/* moeep-proxy-bench's GPU producer (see ring_bench_kernel). ring_hdr, counters
 * and ping are device pointers to mapped host memory; out is device memory
 * of 1 + n int64 (out[0]: 0 or -errno). */
enum {
        MOEEP_RING_BENCH_RATE,
        MOEEP_RING_BENCH_LATENCY,
        MOEEP_RING_BENCH_PINGPONG
};
#define MOEEP_RING_BENCH_BATCH 32 /* RATE: descriptors per published tail */
/* Bound of each of its ring waits (globaltimer ns). */
#define MOEEP_RING_BENCH_TIMEOUT_NS (10ull * 1000000000u)
int moeep_launch_ring_bench(void *ring_hdr, uint64_t *counters, uint64_t *ping, int mode, uint32_t n, uint32_t size,
                            uint32_t region, int signal, int64_t *out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
