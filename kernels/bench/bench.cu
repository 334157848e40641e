/* Kernels used only by the benchmarks: moeep-bench's references (the NVLink
 * floor, plain stores to every peer at once, a flag round trip between two
 * GPUs, and the pack/unpack a user would write around an NCCL all-to-all)
 * and moeep-proxy-bench's GPU producer. */
#include <errno.h>

#include <cuda_bf16.h>

#include "bench/bench_kernels.h"
#include "common/launch.cuh"
#include "common/ptx.cuh"
#include "common/ring.cuh"
#include "common/wait.cuh"

/* Every rank stores `bytes` into each peer's combine area at the slot of
 * its rank, reading from its own receive area, `passes` times over the
 * same bytes (a longer store than the area holds, to time the bandwidth
 * without the launch); blocks are split evenly over the peers. 16-byte
 * stores, as the data kernels use. */
__global__ void __launch_bounds__(MOEEP_BENCH_THREADS) p2p_put_kernel(struct moeep_ctx ctx, size_t bytes, int passes) {
        const int R = ctx.ranks, peers = R - 1;
        const int per = max(1, (int)gridDim.x / peers);
        const int k = blockIdx.x / per, b = blockIdx.x % per;
        if (k >= peers)
                return;
        const int d = (ctx.rank + 1 + k) % R;
        const size_t n16 = bytes / 16, chunk = (n16 + per - 1) / per;
        const size_t lo = chunk * b, hi = min(n16, lo + chunk);
        const int4 *src = (const int4 *)(ctx.peers[ctx.rank] + ctx.layout.recv_x);
        int4 *dst = (int4 *)(ctx.peers[d] + ctx.layout.comb_x + (size_t)ctx.rank * bytes);

        for (int p = 0; p < passes; p++)
                for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
                        st_na_v4(dst + i, ld_nc_v4(src + i));
}

extern "C" int moeep_launch_p2p_put(const struct moeep_ctx *ctx, size_t bytes, int blocks, int passes,
                                    cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        if (ctx->ranks < 2)
                return 0;
        p2p_put_kernel<<<blocks, MOEEP_BENCH_THREADS, 0, stream>>>(*ctx, bytes, passes);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

/* Flag round trip between two GPUs, one thread on each: the pinging side
 * stores i into the other's flag word (`theirs`, mapped over NVLink) and
 * waits until its own word (`mine`) reads i; the answering side waits for
 * i in its word and stores i into the pinging side's. Both words start at
 * 0. Batches of `per` round trips are timed apart (globaltimer may tick
 * coarser than one round trip): out[1 + b] = ns of batch b, on the pinging
 * side; out[0] = 0, or -ETIMEDOUT when a wait passed timeout_ns from the
 * kernel's start (the other side did not answer). */
__global__ void flag_pingpong_kernel(uint64_t *mine, uint64_t *theirs, int ping, int batches, int per,
                                     uint64_t timeout_ns, int64_t *out) {
        const uint64_t start = globaltimer_ns();
        uint64_t i = 0;
        int err = 0;

        for (int b = 0; b < batches && !err; b++) {
                const uint64_t t0 = globaltimer_ns();
                for (int r = 0; r < per && !err; r++) {
                        uint32_t spins = 0;
                        i++;
                        if (ping)
                                st_release_sys(theirs, i);
                        if (!spin_until([&] { return ld_acquire_sys(mine) >= i; },
                                        [&] { return ++spins % 1024 == 0 && globaltimer_ns() - start > timeout_ns; }))
                                err = -ETIMEDOUT;
                        else if (!ping)
                                st_release_sys(theirs, i);
                }
                if (ping)
                        out[1 + b] = (int64_t)(globaltimer_ns() - t0);
        }
        out[0] = err;
}

extern "C" int moeep_launch_flag_pingpong(uint64_t *mine, uint64_t *theirs, int ping, int batches, int per,
                                          uint64_t timeout_ns, int64_t *out, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        flag_pingpong_kernel<<<1, 1, 0, stream>>>(mine, theirs, ping, batches, per, timeout_ns, out);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

/* Reference pack, step 1: per destination, the position of every token in
 * a send buffer grouped by destination (one block; exclusive scan over
 * tokens as torch.nonzero would give). offsets[d] = first row of d. */
__global__ void __launch_bounds__(MOEEP_BENCH_THREADS)
        ref_scan_kernel(const uint8_t *in_rank, int T, int R, int32_t *pos, int32_t *counts) {
        __shared__ int s_run[MOEEP_KERNEL_MAX_RANKS];
        __shared__ int s_warp[32][MOEEP_KERNEL_MAX_RANKS];
        const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

        if (tid < R)
                s_run[tid] = 0;
        __syncthreads();
        /* Walks the tokens in tiles of MOEEP_BENCH_THREADS, one token per thread. */
        for (int base = 0; base < T; base += MOEEP_BENCH_THREADS) {
                int t = base + tid;
                for (int d = 0; d < R; d++) {
                        int v = t < T ? in_rank[(size_t)t * R + d] : 0, x = v;
                        for (int o = 1; o < 32; o *= 2) {
                                int n = __shfl_up_sync(0xffffffffu, x, o);
                                if (lane >= o)
                                        x += n;
                        }
                        if (lane == 31)
                                s_warp[warp][d] = x;
                        __syncthreads();
                        int before = s_run[d];
                        for (int w = 0; w < warp; w++)
                                before += s_warp[w][d];
                        if (t < T)
                                pos[(size_t)t * R + d] = v ? before + x - 1 : -1;
                        __syncthreads();
                        if (tid == 0)
                                for (int w = 0; w < 32; w++)
                                        s_run[d] += s_warp[w][d];
                        __syncthreads();
                }
        }
        if (tid < R)
                counts[tid] = s_run[tid];
}

/* Step 2: copies token rows to pos + offset of each destination. */
__global__ void __launch_bounds__(MOEEP_BENCH_THREADS)
        ref_pack_kernel(const int4 *x, int n16, int T, int R, const int32_t *pos, const int32_t *offsets,
                        int4 *sendbuf) {
        const int lane = threadIdx.x % 32, warps = gridDim.x * 32;
        for (int t = blockIdx.x * 32 + threadIdx.x / 32; t < T; t += warps)
                for (int d = 0; d < R; d++) {
                        int p = pos[(size_t)t * R + d];
                        if (p < 0)
                                continue;
                        int4 *dst = sendbuf + (size_t)(offsets[d] + p) * n16;
                        for (int i = lane; i < n16; i += 32)
                                dst[i] = x[(size_t)t * n16 + i];
                }
}

/* Combine reference: every token sums the rows the all-to-all brought
 * back to its send positions (index_add over the destinations). */
__global__ void __launch_bounds__(MOEEP_BENCH_THREADS)
        ref_unpack_kernel(const int4 *back, int n16, int T, int R, const int32_t *pos, const int32_t *offsets,
                          int4 *out) {
        const int lane = threadIdx.x % 32, warps = gridDim.x * 32;
        for (int t = blockIdx.x * 32 + threadIdx.x / 32; t < T; t += warps)
                for (int i = lane; i < n16; i += 32) {
                        float acc[8] = {};
                        for (int d = 0; d < R; d++) {
                                int p = pos[(size_t)t * R + d];
                                if (p < 0)
                                        continue;
                                int4 v = back[(size_t)(offsets[d] + p) * n16 + i];
                                const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
                                for (int j = 0; j < 4; j++) {
                                        float2 f = __bfloat1622float2(h[j]);
                                        acc[2 * j] += f.x;
                                        acc[2 * j + 1] += f.y;
                                }
                        }
                        int4 o;
                        __nv_bfloat162 *h = (__nv_bfloat162 *)&o;
                        for (int j = 0; j < 4; j++)
                                h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
                        out[(size_t)t * n16 + i] = o;
                }
}

extern "C" int moeep_launch_ref_scan(const uint8_t *in_rank, int T, int R, int32_t *pos, int32_t *counts,
                                     cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        ref_scan_kernel<<<1, MOEEP_BENCH_THREADS, 0, stream>>>(in_rank, T, R, pos, counts);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_ref_pack(const void *x, size_t row_bytes, int T, int R, const int32_t *pos,
                                     const int32_t *offsets, void *sendbuf, int blocks, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        if (T == 0)
                return 0;
        ref_pack_kernel<<<blocks, MOEEP_BENCH_THREADS, 0, stream>>>((const int4 *)x, (int)(row_bytes / 16), T, R, pos,
                                                                    offsets, (int4 *)sendbuf);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_ref_unpack(const void *back, int hidden, int T, int R, const int32_t *pos,
                                       const int32_t *offsets, void *out, int blocks, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        if (T == 0)
                return 0;
        ref_unpack_kernel<<<blocks, MOEEP_BENCH_THREADS, 0, stream>>>((const int4 *)back, hidden * 2 / 16, T, R, pos,
                                                                      offsets, (int4 *)out);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

/* Keeps the stream busy for `ns` so that the host can queue the timed work
 * (events and kernels) behind it: the measurement then holds GPU time only,
 * not the host's launch latency. */
__global__ void delay_kernel(uint64_t ns) {
        const uint64_t start = globaltimer_ns();

        spin_until([&] { return globaltimer_ns() - start >= ns; }, [] { return false; });
}

extern "C" int moeep_launch_delay(uint64_t ns, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        delay_kernel<<<1, 1, 0, stream>>>(ns);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

/* moeep-proxy-bench --producer gpu: one GPU thread drives a descriptor ring
 * the way the data kernels will (kernels/common/ring.cuh). out[0] is 0 or -errno;
 * RATE: out[1] = ns from the first push until done = n, the tail published
 * every MOEEP_RING_BENCH_BATCH descriptors; LATENCY: out[1 + i]
 * = ns from pushing descriptor i (size bytes + signal) until its counter is
 * seen; PINGPONG: out[1 + i] = ns from storing ping = i + 1 to a host word
 * until a CPU thread's echo pong = i + 1 is seen (the host memory round trip
 * that any path through a CPU proxy pays). */
__global__ void ring_bench_kernel(struct proxy_ring_hdr *hdr, uint64_t *counters, uint64_t *ping, int mode, uint32_t n,
                                  uint32_t size, uint32_t region, int signal, int64_t *out) {
        struct ring_producer r = { hdr, (struct proxy_desc *)((char *)hdr + PROXY_RING_HDR_BYTES), hdr->capacity,
                                   ld_acquire_sys(&hdr->tail), ld_acquire_sys(&hdr->head) };
        const uint64_t timeout = MOEEP_RING_BENCH_TIMEOUT_NS;
        const uint64_t base = r.tail;
        int err = 0;

        if (mode == MOEEP_RING_BENCH_RATE) {
                const uint64_t t0 = globaltimer_ns();
                for (uint32_t i = 0; i < n && !err; i++) {
                        struct proxy_desc d = {};
                        d.src_offset = d.dst_offset = ((uint64_t)i * size) % (region / 2);
                        d.length = size;
                        d.flags = signal ? PROXY_DESC_SIGNAL : 0;
                        d.signal_id = i & 255;
                        d.signal_value = base + i + 1;
                        err = ring_put(r, d, timeout, NULL);
                        if (i % MOEEP_RING_BENCH_BATCH == MOEEP_RING_BENCH_BATCH - 1 || i + 1 == n)
                                ring_publish(r);
                }
                if (!err)
                        err = ring_wait(&hdr->done, base + n, hdr, timeout, NULL);
                out[1] = (int64_t)(globaltimer_ns() - t0);
        } else if (mode == MOEEP_RING_BENCH_LATENCY) {
                for (uint32_t i = 0; i < n && !err; i++) {
                        struct proxy_desc d = {};
                        d.length = size;
                        d.flags = PROXY_DESC_SIGNAL;
                        d.signal_id = 2;
                        d.signal_value = base + i + 1;
                        const uint64_t t0 = globaltimer_ns();
                        err = ring_push(r, d, timeout, NULL);
                        if (!err)
                                err = ring_wait(&counters[2], base + i + 1, hdr, timeout, NULL);
                        out[1 + i] = (int64_t)(globaltimer_ns() - t0);
                        if (!err) /* the slot is free again before the next round */
                                err = ring_wait(&hdr->done, base + i + 1, hdr, timeout, NULL);
                }
        } else {
                for (uint32_t i = 0; i < n && !err; i++) {
                        const uint64_t t0 = globaltimer_ns();
                        st_release_sys(&ping[0], i + 1);
                        err = ring_wait(&ping[8], i + 1, hdr, timeout, NULL);
                        out[1 + i] = (int64_t)(globaltimer_ns() - t0);
                }
        }
        out[0] = err;
}

extern "C" int moeep_launch_ring_bench(void *ring_hdr, uint64_t *counters, uint64_t *ping, int mode, uint32_t n,
                                       uint32_t size, uint32_t region, int signal, int64_t *out, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        ring_bench_kernel<<<1, 1, 0, stream>>>((struct proxy_ring_hdr *)ring_hdr, counters, ping, mode, n, size, region,
                                               signal, out);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
