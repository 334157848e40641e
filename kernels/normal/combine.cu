/* Normal-mode combine: every rank sends each row it received back to the
 * row's source rank, into the slot (our rank, source token) of the source's
 * combine area, and counts it on the source's arrival counter of that
 * token's chunk; meanwhile every rank reduces its own tokens chunk by chunk
 * as their rows arrive, so the sum overlaps the transfer.
 *
 * Our own rows (those we received from ourselves) are not sent: the reduce
 * reads them from x where they are, so neither the copy nor its count
 * happens (MOEEP_DEBUG_COPY_SELF sends them like a peer's, to measure the
 * per-rank send work at one rank).
 *
 * Roles inside each block (one block per SM, all resident), from 2 ranks:
 *   warps 0..5              send: claim rows source by source (the warps
 *                           start evenly over the sources so that every
 *                           peer's ingress is busy at once and every peer's
 *                           tokens arrive at one pace), copy, count;
 *                           (the counts are COMBINE_* in params.h)
 *   warps 19..30            reduce consumers, in groups of 4 warps, each
 *                           group on its own stages: sum the staged rows of
 *                           a (token, slice of at most 8 KiB; a whole row
 *                           at 2 ranks) from shared memory, write out;
 *                           (warps 6..18 idle)
 *   warp 31                 reduce producer: waits for a chunk's counter and
 *                           bulk-copies (TMA) the slices of its rows into a
 *                           ring of shared-memory stages.
 * At one rank every token has at most one row, and the reduce is a copy:
 * one warp waits for the chunks, the others copy rows straight from global
 * memory (combine_copy), without the staging ring, which was the limit
 * there (see docs/benchmarks.md, "Normal combine at one rank").
 * Buffers: x (the caller's expert outputs) is read once; comb slots
 * (peers[s] + comb_x) are written only by their contributing rank and read
 * only by their owner after the chunk counter; out is written once. */
#include <cuda_bf16.h>

#include "common/launch.cuh"
#include "common/ptx.cuh"
#include "common/px.cuh"
#include "common/wait.cuh"
#include "kernels.h"

/* The warp roles and their sizes (COMBINE_*) are in params.h. */

struct stage_info {
        int token;
        int slice;
        int nrows;
        int bytes;
};

__device__ __forceinline__ void add_bf16x8(float *acc, int4 v) {
        const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
        for (int j = 0; j < 4; j++) {
                float2 f = __bfloat1622float2(h[j]);
                acc[2 * j] += f.x;
                acc[2 * j + 1] += f.y;
        }
}

__device__ __forceinline__ int4 pack_bf16x8(const float *acc) {
        int4 v;
        __nv_bfloat162 *h = (__nv_bfloat162 *)&v;
#pragma unroll
        for (int j = 0; j < 4; j++)
                h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
        return v;
}

/* Send role: rows back to their sources. */
__device__ __forceinline__ void combine_send(const struct moeep_ctx &ctx, const int4 *x, const float *weights, int K,
                                             const struct moeep_route &route, const int *s_prefix, bool self_in_place) {
        const int lane = threadIdx.x % 32, R = ctx.ranks, me = ctx.rank;
        const int sw = blockIdx.x * 32 + threadIdx.x / 32;
        const size_t row_bytes = (size_t)ctx.hidden * 2;
        const int n16 = (int)(row_bytes / 16);

        /* Our own rows stay when the reduce reads them from x: the warps
         * then start evenly over the other ranks. Starting over all ranks
         * and skipping ours gave the rank after us twice the warps of the
         * others, so its rows arrived early and the rest late: a receiver's
         * chunks, which wait for every source, completed slowly and then
         * all at once at the end, and the reduce finished that backlog
         * after the last row landed. */
        const int n = self_in_place ? R - 1 : R;
        for (int k = 0; k < n; k++) {
                const int s = self_in_place ? (me + 1 + (sw + k) % n) % R : (me + sw + k) % R;
                if (px_remote(ctx, s))
                        continue; /* staged by px_combine_stage, counted there by its relay */
                const int count = s_prefix[s + 1] - s_prefix[s];
                for (;;) {
                        int base = 0;
                        if (lane == 0)
                                base = (int)atomicAdd(&ctx.state->claim[s], (unsigned)COMBINE_CLAIM_ROWS);
                        base = __shfl_sync(0xffffffffu, base, 0);
                        if (base >= count)
                                break;
                        const int end = min(base + COMBINE_CLAIM_ROWS, count);
                        for (int q = base; q < end; q++) {
                                const int p = s_prefix[s] + q;
                                const int t = moeep_recv_src_token(route.recv_src[p]);
                                const size_t slot = (size_t)me * ctx.max_tokens + t;
                                int4 *dst = (int4 *)(ctx.peers[s] + ctx.layout.comb_x + slot * row_bytes);
                                const int4 *src = x + (size_t)p * n16;

                                for (int i = lane; i < n16; i += 32 * COMBINE_SEND_UNROLL) {
                                        int4 v[COMBINE_SEND_UNROLL];
#pragma unroll
                                        for (int u = 0; u < COMBINE_SEND_UNROLL; u++)
                                                if (i + u * 32 < n16)
                                                        v[u] = ld_nc_v4(src + i + u * 32);
#pragma unroll
                                        for (int u = 0; u < COMBINE_SEND_UNROLL; u++)
                                                if (i + u * 32 < n16)
                                                        st_na_v4(dst + i + u * 32, v[u]);
                                }
                                if (weights && lane < K)
                                        ((float *)(ctx.peers[s] +
                                                   ctx.layout.comb_weights))[slot * ctx.max_topk + lane] =
                                                weights[(size_t)p * K + lane];
                        }
                        /* Lane i counts row base + i: the warp barrier orders
                         * every lane's stores of the claimed rows before each
                         * lane's release. */
                        __syncwarp();
                        if (lane < end - base && !(ctx.debug & MOEEP_DEBUG_NO_COUNTS)) {
                                const int t = moeep_recv_src_token(route.recv_src[s_prefix[s] + base + lane]);
                                red_release_sys_add(&sync_of(ctx, s)->comb_chunk[t / moeep_combine_chunk(R)], 1);
                        }
                }
        }
}

/* Rows are reduced in slices of at most `slice` bytes (moeep_launch_combine()), 16-byte multiples. */
__device__ __forceinline__ void row_slices(int row_bytes, int slice, int *ret_n, int *ret_bytes) {
        const int n = (row_bytes + slice - 1) / slice;
        *ret_n = n;
        *ret_bytes = ((row_bytes + n - 1) / n + 15) / 16 * 16;
}

/* Block b reduces chunks b, b + grid, b + 2 grid, ... (moeep_combine_chunk
 * tokens each): exactly one block waits for (and resets) each chunk
 * counter, and every block's work follows the senders, who move through
 * each source's tokens in order. With 16-token chunks instead of 32 the
 * last round of chunks goes to more blocks (4096 tokens, 24 SMs: 2 x H200,
 * 2 ranks, combine 235 -> 226 us; 4 x H100, 4 ranks, 581 -> 565 us). */
#define FOR_EACH_BLOCK_CHUNK(c0, c1, num_tokens, chunk, rb, nrb)                               \
        for (int c0 = (rb) * (chunk), c1 = min(c0 + (chunk), (num_tokens)); c0 < (num_tokens); \
             c0 += (nrb) * (chunk), c1 = min(c0 + (chunk), (num_tokens)))

/* Waits, on lane 0, for the rows of the chunk at c0 to arrive, and zeroes
 * its counter: every row of this round arrived, no more adds come until our
 * next combine, which starts after a barrier. Lane i holds `self` when
 * token c0 + i's own row is read in place (not counted). Returns, on every
 * lane, `ok` and whether the wait did not give up. */
__device__ __forceinline__ bool wait_chunk(const struct moeep_ctx &ctx, const struct moeep_route &route, int c0,
                                           bool self, bool ok) {
        static_assert(MOEEP_COMBINE_CHUNK <= 32 && MOEEP_COMBINE_CHUNK_MANY <= 32,
                      "a chunk is at most a warp's 32 tokens, a lane each");
        const int own = __popc(__ballot_sync(0xffffffffu, self)), c = c0 / moeep_combine_chunk(ctx.ranks);

        if (threadIdx.x % 32 == 0) {
                uint32_t *counter = &sync_of(ctx, ctx.rank)->comb_chunk[c];
                const uint32_t want = (uint32_t)(route.chunk_expect[c] - own);
                ok = ok && wait_counter(ctx, counter, want, ctx.debug & MOEEP_DEBUG_NO_COUNTS, -1);
                *counter = 0;
        }
        return __shfl_sync(0xffffffffu, ok, 0);
}

/* Producer role (warp 31): the whole warp reads the chunk's routing, lane 0
 * waits for the chunk's rows and issues the bulk copies. */
__device__ __forceinline__ void combine_produce(const struct moeep_ctx &ctx, const struct moeep_route &route,
                                                const int4 *x, const int *s_prefix, bool self_in_place, char *stages,
                                                uint64_t *full, uint64_t *empty, struct stage_info *info, int nstages,
                                                size_t stage_bytes, int slice, int rb, int nrb) {
        const int lane = threadIdx.x % 32, R = ctx.ranks, me = ctx.rank;
        const int row_bytes = ctx.hidden * 2;
        const char *slots = ctx.peers[ctx.rank] + ctx.layout.comb_x;
        int stage = 0, slices, slice_bytes;
        uint32_t phase = 0;
        bool ok = true;

        row_slices(row_bytes, slice, &slices, &slice_bytes);
        FOR_EACH_BLOCK_CHUNK(c0, hi, route.num_tokens, moeep_combine_chunk(ctx.ranks), rb, nrb) {
                const int t = c0 + lane;
                uint32_t mask = 0;
                if (t < hi)
                        for (int r = 0; r < R; r++)
                                mask |= (route.send_pos[(size_t)t * R + r] >= 0 ? 1u : 0u) << r;
                /* Our own rows are not counted when they are read in place. */
                ok = wait_chunk(ctx, route, c0, self_in_place && ((mask >> me) & 1), ok);
                if (lane == 0)
                        fence_proxy_async_global();
                __syncwarp();
                /* One lane per row: lane k bulk-copies the k-th contributing
                 * rank's slice, so a stage's copies go out together. */
                for (int i = 0; c0 + i < hi; i++) {
                        const uint32_t m = __shfl_sync(0xffffffffu, mask, i);
                        const int tok = c0 + i, n = ok ? __popc(m) : 0;
                        const int r = lane < n ? (int)__fns(m, 0, lane + 1) : 0;
                        const char *row = self_in_place && r == me && lane < n
                                                  ? (const char *)x + (size_t)(s_prefix[me] +
                                                                               route.send_pos[(size_t)tok * R + me]) *
                                                                              row_bytes
                                                  : slots + ((size_t)r * ctx.max_tokens + tok) * row_bytes;
                        for (int j = 0; j < slices; j++) {
                                const int bytes = min(slice_bytes, row_bytes - j * slice_bytes);
                                if (lane == 0) {
                                        mbar_wait(ctx, &empty[stage], phase ^ 1);
                                        info[stage] = (struct stage_info){ tok, j, n, bytes };
                                        if (n == 0)
                                                mbar_arrive(&full[stage]);
                                        else
                                                mbar_arrive_expect_tx(&full[stage], (uint32_t)(n * bytes));
                                }
                                __syncwarp();
                                if (lane < n)
                                        tma_load_1d(stages + stage * stage_bytes + (size_t)lane * slice,
                                                    row + (size_t)j * slice_bytes, (uint32_t)bytes, &full[stage]);
                                if (++stage == nstages) {
                                        stage = 0;
                                        phase ^= 1;
                                }
                        }
                }
                __syncwarp();
        }
}

/* Consumer role: group g of COMBINE_GROUP_WARPS warps takes every
 * COMBINE_CONSUMER_GROUPS-th stage of the sequence the producer fills; its warps
 * split the slice's columns, sum the staged rows and write them out. The
 * weights of a token are summed with its first slice. */
__device__ __forceinline__ void combine_consume(const struct moeep_ctx &ctx, const struct moeep_route &route,
                                                const float *weights, const int *s_prefix, bool self_in_place,
                                                const char *stages, uint64_t *full, uint64_t *empty,
                                                const struct stage_info *info, int nstages, size_t stage_bytes,
                                                int slice, int4 *out, float *out_weights, int K, int cw, int rb,
                                                int nrb) {
        const int lane = threadIdx.x % 32, R = ctx.ranks, g = cw / COMBINE_GROUP_WARPS, wg = cw % COMBINE_GROUP_WARPS;
        const int row_bytes = ctx.hidden * 2;
        const float *wslots = (const float *)(ctx.peers[ctx.rank] + ctx.layout.comb_weights);
        int slices, slice_bytes, u = 0;

        row_slices(row_bytes, slice, &slices, &slice_bytes);
        FOR_EACH_BLOCK_CHUNK(c0, c1, route.num_tokens, moeep_combine_chunk(ctx.ranks), rb, nrb)
        for (int t = c0; t < c1; t++)
                for (int j = 0; j < slices; j++, u++) {
                        if (u % COMBINE_CONSUMER_GROUPS != g)
                                continue;
                        const int stage = u % nstages;
                        mbar_wait(ctx, &full[stage], (uint32_t)(u / nstages) & 1);
                        const struct stage_info si = info[stage];
                        const char *buf = stages + stage * stage_bytes;
                        for (int i = wg * 32 + lane; i * 16 < si.bytes; i += COMBINE_GROUP_WARPS * 32) {
                                float acc[8] = {};
                                for (int k = 0; k < si.nrows; k++)
                                        add_bf16x8(acc, *(const int4 *)(buf + (size_t)k * slice + i * 16));
                                out[((size_t)t * row_bytes + (size_t)j * slice_bytes) / 16 + i] = pack_bf16x8(acc);
                        }
                        const int nrows = si.nrows;
                        __syncwarp();
                        if (lane == 0)
                                mbar_arrive(&empty[stage]);
                        /* The weights read no stage: the stage is the
                         * producer's again first, and every rank's
                         * position, then weight, is loaded before any is
                         * added (not a chain of 2R loads per token). */
                        if (j == 0 && out_weights && wg == 0 && lane < K) {
                                int pos[MOEEP_KERNEL_MAX_RANKS];
                                float wr[MOEEP_KERNEL_MAX_RANKS];
#pragma unroll
                                for (int r = 0; r < MOEEP_KERNEL_MAX_RANKS; r++)
                                        pos[r] = r < R && nrows > 0 ? route.send_pos[(size_t)t * R + r] : -1;
#pragma unroll
                                for (int r = 0; r < MOEEP_KERNEL_MAX_RANKS; r++)
                                        wr[r] = pos[r] < 0 ? 0.0f
                                                : self_in_place && r == ctx.rank
                                                        ? weights[(size_t)(s_prefix[r] + pos[r]) * K + lane]
                                                        : __ldcg(wslots +
                                                                 ((size_t)r * ctx.max_tokens + t) * ctx.max_topk +
                                                                 lane);
                                float w = 0.0f;
#pragma unroll
                                for (int r = 0; r < MOEEP_KERNEL_MAX_RANKS; r++)
                                        if (pos[r] >= 0) /* in rank order, as the sum always was */
                                                w += wr[r];
                                out_weights[(size_t)t * K + lane] = w;
                        }
                }
}

/* Loads of rows written during this kernel by other SMs or GPUs: through
 * L2 (never the non-coherent path), not kept in L1 (read once). */
__device__ __forceinline__ int4 ld_cg_v4(const int4 *p) {
        int4 v;
        asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p)
                     : "memory");
        return v;
}

/* Copies one row of n16 16-byte columns, COMBINE_COPY_UNROLL loads in flight per
 * lane. Not inlined: inside the kernel its 32 registers of loads pushed
 * the kernel's other live values (64 registers at 1024 threads) into local
 * memory; as a call, the spills happen once per row, not per load. */
static __device__ __noinline__ void copy_row(const int4 *src, int4 *dst, int n16, int lane) {
        for (int i = lane; i < n16; i += 32 * COMBINE_COPY_UNROLL) {
                int4 v[COMBINE_COPY_UNROLL];
#pragma unroll
                for (int u = 0; u < COMBINE_COPY_UNROLL; u++)
                        if (i + u * 32 < n16)
                                v[u] = ld_cg_v4(src + i + u * 32);
#pragma unroll
                for (int u = 0; u < COMBINE_COPY_UNROLL; u++)
                        if (i + u * 32 < n16)
                                st_na_v4(dst + i + u * 32, v[u]);
        }
}

/* Flags in shared memory between the warps of one block. */
__device__ __forceinline__ void st_release_cta(int *p, int v) {
        asm volatile("st.release.cta.shared::cta.s32 [%0], %1;" ::"r"(smem_addr(p)), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_acquire_cta(const int *p) {
        int v;
        asm volatile("ld.acquire.cta.shared::cta.s32 %0, [%1];" : "=r"(v) : "r"(smem_addr(p)) : "memory");
        return v;
}

/* s_ready past every chunk: the wait failed (the error is recorded), the
 * copy writes zeros. */
#define READY_FAILED (1 << 30)

/* Waiter role of the one-rank reduce (one warp per block): lane 0 waits
 * for each of the block's chunks in turn (only rows copied through the
 * comb slots are counted), zeroes its counter and tells the block's copy
 * warps through s_ready, the count of the block's chunks that arrived.
 * One poller per block: when every copy warp polled the counter itself (16
 * warps per SM), the polls slowed the senders on the same SMs 25-fold
 * (5.8 ms instead of 0.25). */
__device__ __forceinline__ void combine_wait(const struct moeep_ctx &ctx, const struct moeep_route &route,
                                             bool self_in_place, int rb, int nrb, int *s_ready) {
        const int lane = threadIdx.x % 32;
        int ci = 0;
        bool ok = true;

        FOR_EACH_BLOCK_CHUNK(c0, c1, route.num_tokens, moeep_combine_chunk(ctx.ranks), rb, nrb) {
                const bool row = c0 + lane < c1 && route.send_pos[c0 + lane] >= 0;
                ok = wait_chunk(ctx, route, c0, self_in_place && row, ok);
                if (lane == 0)
                        st_release_cta(s_ready, ok ? ci + 1 : READY_FAILED);
                ci++;
        }
}

/* Copy role of the one-rank reduce: each token has at most one row, ours,
 * which is its sum. The block's tokens, over all its chunks, are dealt to
 * the copy warps in turn (token j of the block to warp j % nw): dealt per
 * chunk, 32 tokens over 31 warps gave one warp two tokens each time, and
 * that warp set the pace. A token without rows gets zeros. */
__device__ __forceinline__ void combine_copy(const struct moeep_ctx &ctx, const struct moeep_route &route,
                                             const int4 *x, const float *weights, int K, const int *s_prefix, int4 *out,
                                             float *out_weights, bool self_in_place, int w, int nw, int rb, int nrb,
                                             const int *s_ready) {
        const int lane = threadIdx.x % 32;
        const int n16 = ctx.hidden * 2 / 16;
        const int4 *slots = (const int4 *)(ctx.peers[ctx.rank] + ctx.layout.comb_x);
        const float *wslots = (const float *)(ctx.peers[ctx.rank] + ctx.layout.comb_weights);
        int ci = 0, before = 0;

        FOR_EACH_BLOCK_CHUNK(c0, c1, route.num_tokens, moeep_combine_chunk(ctx.ranks), rb, nrb) {
                const int first = ((w - before) % nw + nw) % nw;
                int ready;
                before += c1 - c0;
                /* Bounded by the waiter warp (combine_wait), whose waits are: it
                 * stores to s_ready for every chunk, READY_FAILED once one gave up. */
                spin_until([&] { return (ready = ld_acquire_cta(s_ready)) > ci; },
                           [] {
                                   __nanosleep(64);
                                   return false;
                           });
                __syncwarp();
                ci++;
                for (int i = first; i < c1 - c0; i += nw) {
                        const int t = c0 + i, pos = ready != READY_FAILED ? route.send_pos[t] : -1;
                        /* Our row: in x at its receive position, or in the slot. */
                        const int4 *src =
                                self_in_place ? x + (size_t)(s_prefix[0] + pos) * n16 : slots + (size_t)t * n16;
                        const float *wsrc = self_in_place ? weights + (size_t)(s_prefix[0] + pos) * K
                                                          : wslots + (size_t)t * ctx.max_topk;
                        int4 *dst = out + (size_t)t * n16;
                        if (pos >= 0)
                                copy_row(src, dst, n16, lane);
                        else
                                for (int j = lane; j < n16; j += 32)
                                        st_na_v4(dst + j, make_int4(0, 0, 0, 0));
                        if (out_weights && lane < K)
                                out_weights[(size_t)t * K + lane] = pos >= 0 ? __ldcg(wsrc + lane) : 0.0f;
                }
        }
}

__global__ void __launch_bounds__(COMBINE_THREADS, 1)
        combine_kernel(struct moeep_ctx ctx, const int4 *x, const float *weights, int num_topk,
                       struct moeep_route route, int4 *out, float *out_weights, int nstages, int send_blocks,
                       int send_warps, int slice, bool direct, bool self_in_place) {
        extern __shared__ __align__(1024) char stages[];
        __shared__ uint64_t full[COMBINE_MAX_STAGES], empty[COMBINE_MAX_STAGES];
        __shared__ struct stage_info info[COMBINE_MAX_STAGES];
        __shared__ int s_prefix[MOEEP_KERNEL_MAX_RANKS + 1];
        __shared__ int s_ready;
        const int tid = threadIdx.x, warp = tid / 32;
        const size_t stage_bytes = (size_t)ctx.ranks * slice;

        grid_dep_wait(); /* the barrier before us */
        if (ctx.trace && tid == 0)
                ctx.trace[blockIdx.x * MOEEP_TRACE_STAMPS] = globaltimer_ns();
        if (tid <= ctx.ranks)
                s_prefix[tid] = route.rank_prefix[tid];
        if (tid < nstages) {
                mbar_init(&full[tid], 1);
                mbar_init(&empty[tid], COMBINE_GROUP_WARPS); /* every warp of the stage's group */
        }
        if (tid == 0)
                s_ready = 0;
        fence_mbar_init();
        __syncthreads();

        /* send_blocks == 0: every block mixes the roles (warps
         * 0..send_warps-1 send); else blocks below send_blocks only send
         * and the others only reduce. */
        const bool split = send_blocks > 0;
        const bool sender = split ? (int)blockIdx.x < send_blocks : warp < send_warps;
        const int rb = split ? (int)blockIdx.x - send_blocks : (int)blockIdx.x;
        const int nrb = split ? (int)gridDim.x - send_blocks : (int)gridDim.x;
        const int nsend = split ? send_blocks : (int)gridDim.x;

        if (sender) {
                if (!*(volatile uint32_t *)&ctx.state->error && !(ctx.debug & MOEEP_DEBUG_NO_SEND))
                        combine_send(ctx, x, weights, num_topk, route, s_prefix, self_in_place);
                /* Last sender block resets the claim counters for the next call. */
                if (split)
                        __syncthreads();
                else
                        asm volatile("bar.sync 1, %0;" ::"r"(send_warps * 32));
                if (ctx.trace && tid == 0)
                        ctx.trace[blockIdx.x * MOEEP_TRACE_STAMPS + 1] = globaltimer_ns();
                if (tid == 0 && atomicAdd(&ctx.state->blocks_done, 1u) == (unsigned)nsend - 1) {
                        for (int s = 0; s < ctx.ranks; s++)
                                ctx.state->claim[s] = 0;
                        ctx.state->blocks_done = 0;
                }
        } else if (ctx.debug & MOEEP_DEBUG_NO_REDUCE) {
                return;
        } else if (direct) {
                /* Warp `first` waits, the warps after it copy. */
                const int first = split ? 0 : send_warps;
                if (warp == first)
                        combine_wait(ctx, route, self_in_place, rb, nrb, &s_ready);
                else
                        combine_copy(ctx, route, x, weights, num_topk, s_prefix, out, out_weights, self_in_place,
                                     warp - first - 1, COMBINE_THREADS / 32 - first - 1, rb, nrb, &s_ready);
                if (ctx.trace && tid % 32 == 0)
                        atomicMax((unsigned long long *)&ctx
                                          .trace[blockIdx.x * MOEEP_TRACE_STAMPS + (warp == first ? 2 : 3)],
                                  (unsigned long long)globaltimer_ns());
        } else if (warp == COMBINE_PRODUCER_WARP) {
                combine_produce(ctx, route, x, s_prefix, self_in_place, stages, full, empty, info, nstages, stage_bytes,
                                slice, rb, nrb);
                if (ctx.trace && tid % 32 == 0)
                        ctx.trace[blockIdx.x * MOEEP_TRACE_STAMPS + 2] = globaltimer_ns();
        } else if (warp >= COMBINE_PRODUCER_WARP - COMBINE_CONSUMER_WARPS) {
                combine_consume(ctx, route, weights, s_prefix, self_in_place, stages, full, empty, info, nstages,
                                stage_bytes, slice, out, out_weights, num_topk,
                                warp - (COMBINE_PRODUCER_WARP - COMBINE_CONSUMER_WARPS), rb, nrb);
                if (ctx.trace && tid % 32 == 0)
                        atomicMax((unsigned long long *)&ctx.trace[blockIdx.x * MOEEP_TRACE_STAMPS + 3],
                                  (unsigned long long)globaltimer_ns());
        }
}

extern "C" int moeep_kernels_init(void) {
        return (int)cudaFuncSetAttribute(combine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         COMBINE_STAGE_SMEM);
}

extern "C" int moeep_launch_combine(const struct moeep_ctx *ctx, const void *x, const float *topk_weights, int num_topk,
                                    const struct moeep_route *route, void *out, float *out_weights,
                                    cudaStream_t stream) {
        /* Up to 4 ranks a stage holds every row of a token whole: one bulk
         * copy a row (2 ranks, 24 SMs, H200: the reduce alone 221 -> 171
         * us against 8 KiB slices, combine 374 -> 326; 4 x H200, 4 ranks,
         * 3 stages instead of 6 of half rows: 553-556 -> 544-546 us). With
         * more ranks a stage of whole rows would leave too few stages. */
        const int slice = ctx->ranks <= COMBINE_FEW_RANKS ? COMBINE_SLICE_FEW : COMBINE_SLICE_MAX;
        const size_t stage_bytes = (size_t)ctx->ranks * slice;
        const bool self_in_place = !(ctx->debug & MOEEP_DEBUG_COPY_SELF);
        /* One rank: the reduce is a copy, straight from global memory (1 rank,
         * 24 SMs: 89 us against 191 us through the staging ring). From 2
         * ranks the ring stays: reduce alone on one GPU, 2 / 4 / 8 rows per
         * token, the direct sum measured 270 / 551 / 981 us against 234 /
         * 579 / 1204 us staged, no clear gain for a path the multi-GPU
         * figures have not seen. See docs/benchmarks.md. */
        const bool direct = ctx->ranks == 1;
        /* With nothing to send, every warp but the waiter copies. */
        const int send_warps = direct && self_in_place ? 0
                               : ctx->ranks <= 2       ? COMBINE_SEND_WARPS
                                                       : COMBINE_SEND_WARPS_MANY;
        /* A multiple of the consumer groups: group g takes the uses u of
         * the ring with u % groups == g, so each stage's uses all go to one
         * group, in order. A group that took a stage's next use could wait
         * for its fill's phase while the previous fill, another group's,
         * was still under way, and an mbarrier's parity wait would take
         * that previous phase for its own (wrong sums with 4 stages and 3
         * groups, 4 ranks on one GPU). */
        const int nstages = direct ? 0
                                   : (int)min((size_t)COMBINE_MAX_STAGES, COMBINE_STAGE_SMEM / stage_bytes) /
                                             COMBINE_CONSUMER_GROUPS * COMBINE_CONSUMER_GROUPS;

        MOEEP_CUDA_LAUNCH_BEGIN();
        coop_note(stream); /* it waits for the other ranks' rows */
        /* Every block both sends, with its first COMBINE_SEND_WARPS warps,
         * and reduces: with few send warps the remote stores hold up the
         * reduce's loads on the same SM little, and they still carry the
         * sends (24 SMs, 4096 tokens; 2 x H200, 2 ranks: 3 / 4 / 5 / 6 / 8
         * send warps 333 / 275 / 246 / 235 / 266 us; 4 x H100, 4 ranks: 583
         * us with 6, against 653-674 us with half the blocks only sending
         * and half only reducing, the default from 4 ranks until then).
         * MOEEP_COMBINE_SEND_BLOCKS=N (combine_send_blocks) makes N blocks
         * only send, for A/B. See docs/benchmarks.md. */
        int send_blocks = ctx->combine_send_blocks > 0 ? ctx->combine_send_blocks : 0;
        if (send_blocks >= ctx->num_sms || ctx->combine_send_blocks < 0)
                send_blocks = 0;
        /* A programmatic dependent of the barrier launched just before. */
        const cudaError_t e = launch_kernel(
                combine_kernel, (unsigned)ctx->num_sms, COMBINE_THREADS, nstages * stage_bytes, stream, false,
                !(ctx->debug & MOEEP_DEBUG_NO_PDL), *ctx, (const int4 *)x, topk_weights, num_topk, *route, (int4 *)out,
                out_weights, nstages, send_blocks, send_warps, slice, direct, self_in_place);
        if (e != cudaSuccess)
                return (int)e;
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
