/* Device side of the internode proxy path (kernels.h, "The internode
 * proxy path"), shared by the low-latency and the normal-mode kernels:
 * staging segments, shipping them through the ring, and waiting for the
 * segments remote ranks shipped to us. */
#pragma once

#include "kernels.h"
#include "common/ptx.cuh"
#include "common/ring.cuh"
#include "common/wait.cuh"

/* Ships what the kernel staged for every remote rank (claim[d] slots of
 * `slot` bytes in our segment d of `area`; claim[d] is zeroed) into our
 * segment at d, with the header `info` (count set here) and the signal
 * counter0 + our rank = info.value; nothing goes to the ranks in `skip`
 * (an elastic call leaves them out). One thread,
 * after every staging store of the grid was fenced (last_block_done, or a
 * block's own __threadfence_system and barrier); the ring's release orders
 * them, and the headers, before the tail. */
static __device__ __noinline__ void px_ship(const struct moeep_ctx &ctx, size_t area, size_t seg, uint32_t *claim,
                                            size_t slot, uint32_t counter0, struct moeep_px_seg info, size_t lead = 0,
                                            uint32_t skip = 0) {
        struct moeep_px_state *st = ctx.px.state;
        struct ring_producer r = { (struct proxy_ring_hdr *)st->ring_hdr,
                                   (struct proxy_desc *)((char *)st->ring_hdr + PROXY_RING_HDR_BYTES), st->ring_cap,
                                   st->ring_tail, st->ring_head };

        for (int d = 0; d < ctx.ranks; d++) {
                if (!px_remote(ctx, d))
                        continue;
                const uint32_t n = *(volatile uint32_t *)&claim[d];
                claim[d] = 0;
                if (skip >> d & 1) /* elastic: a rank the call leaves out gets nothing */
                        continue;
                volatile struct moeep_px_seg *h = (volatile struct moeep_px_seg *)px_send_seg(ctx, area, seg, d);
                h->count = n;
                h->row_bytes = info.row_bytes;
                h->value = info.value;
                h->topk = info.topk;
                h->scales = info.scales;
                struct proxy_desc desc = {};
                desc.src_offset = area + (size_t)d * seg;
                desc.dst_offset = area + (size_t)ctx.rank * seg;
                desc.signal_value = info.value;
                desc.length = (uint32_t)(MOEEP_PX_SEG_HDR + lead + n * slot); /* lead: bytes before the slots */
                desc.peer = (uint32_t)d;
                desc.signal_id = counter0 + (uint32_t)ctx.rank;
                desc.flags = PROXY_DESC_SIGNAL;
                /* An elastic endpoint goes on after a rank's abort; only
                 * the daemon stopping (the page's stopping word, right after
                 * lost_ranks) ends its wait for ring space. */
                const int e = ring_put(r, desc, ctx.timeout_ns,
                                       ctx.shrink && ctx.lost_word ? (const volatile uint32_t *)ctx.lost_word + 1
                                                                   : ctx.abort_word);
                if (e != 0) {
                        record_error(ctx, e == -ENOTCONN ? MOEEP_KERR_ABORT : MOEEP_KERR_PROXY, d);
                        break;
                }
        }
        ring_publish(r);
        st->ring_tail = r.tail;
        st->ring_head = r.head;
}

/* Bounded wait for a remote source's signal (one thread): also ends on the
 * ring's error (the proxy lost the route) and the job's abort word. */
static __device__ __noinline__ bool px_wait(const struct moeep_ctx &ctx, uint32_t counter, uint64_t want, int peer) {
        const struct proxy_ring_hdr *hdr = (const struct proxy_ring_hdr *)ctx.px.state->ring_hdr;
        struct spin s = spin_begin();

        return spin_until([&] { return ld_acquire_sys(&ctx.px.counters[counter]) >= want; },
                          [&] {
                                  if (spin_give_up(ctx, s, peer))
                                          return true;
                                  if (s.n % SPIN_CHECK_EVERY == 0 && ring_error(hdr)) {
                                          record_error(ctx, MOEEP_KERR_PROXY, peer);
                                          return true;
                                  }
                                  return false;
                          });
}

__device__ __forceinline__ struct moeep_px_seg px_seg_info(uint64_t value, uint32_t row_bytes, uint32_t topk,
                                                           uint32_t scales) {
        struct moeep_px_seg h = {};
        h.value = value;
        h.row_bytes = row_bytes;
        h.topk = topk;
        h.scales = scales;
        return h;
}

/* Every thread of the block: waits for source s's segment (thread 0) and
 * returns its header, or NULL when the wait failed. */
__device__ __forceinline__ const struct moeep_px_seg *px_block_wait(const struct moeep_ctx &ctx, size_t area,
                                                                    size_t seg, uint32_t counter, uint64_t value,
                                                                    int s) {
        __shared__ int s_ok;
        if (threadIdx.x == 0)
                s_ok = px_wait(ctx, counter, value, s);
        __syncthreads();
        const bool ok = s_ok;
        __syncthreads();
        return ok ? (const struct moeep_px_seg *)px_recv_seg(ctx, area, seg, s) : NULL;
}

/* Copies `bytes` (a multiple of 16) from staged host memory into the
 * buffer, one warp. The loads bypass the caches: the segment was written
 * by the daemon after the last use of these lines. */
__device__ __forceinline__ void px_copy(int4 *dst, const int4 *src, size_t bytes) {
        const int lane = threadIdx.x % 32, n16 = (int)(bytes / 16);
        for (int i = lane; i < n16; i += 32 * PX_COPY_UNROLL) {
                int4 v[PX_COPY_UNROLL];
#pragma unroll
                for (int u = 0; u < PX_COPY_UNROLL; u++)
                        if (i + u * 32 < n16)
                                v[u] = __ldcv(src + i + u * 32);
#pragma unroll
                for (int u = 0; u < PX_COPY_UNROLL; u++)
                        if (i + u * 32 < n16)
                                dst[i + u * 32] = v[u];
        }
}
