/* Memory-ordering primitives of moeep's kernels. Every cross-GPU flag goes
 * through these named wrappers so that the ordering each wait relies on is
 * visible at the call site. */
#pragma once

#include <stdint.h>

#include "kernels.h"

/* Store `v` so that every store this thread made before (and, through the
 * preceding fence or barrier, every store it observed) is visible to a
 * reader on any GPU or the host that acquires the flag. */
__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v) {
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) {
        uint64_t v;
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
        return v;
}

__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t *p) {
        uint32_t v;
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
}

/* Adds to a (possibly remote) counter after every store this thread made,
 * or observed, before it. */
__device__ __forceinline__ void red_release_sys_add(uint32_t *p, uint32_t v) {
        asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_release_sys_add_u64(uint64_t *p, uint64_t v) {
        asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* The same at GPU scope, for a flag of our own rank that only this GPU
 * reads: the release then orders the stores before it for this GPU's
 * readers only, and does not wait for the ones to other GPUs. */
__device__ __forceinline__ void st_release_gpu(uint64_t *p, uint64_t v) {
        asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_release_gpu_add_u64(uint64_t *p, uint64_t v) {
        asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* An add that orders nothing: a count whose readers read no data of ours. */
__device__ __forceinline__ void red_relaxed_gpu_add_u64(uint64_t *p, uint64_t v) {
        asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Orders this thread's generic-proxy accesses (e.g. an acquire) before its
 * later bulk-copy (async proxy) reads of global memory. */
__device__ __forceinline__ void fence_proxy_async_global(void) {
        asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* ---- Programmatic dependent launch (sm_90): a kernel launched with
 * launch_kernel's `after` (launch.cuh) may start while the kernel before
 * it in the stream still runs, once that one called grid_dep_launch (or its
 * blocks exited); grid_dep_wait waits until the kernel before finished and
 * its writes are visible. Without the launch attribute both are no-ops. */
__device__ __forceinline__ void grid_dep_wait(void) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void grid_dep_launch(void) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

/* ---- mbarrier and 1-D bulk copies (TMA) into shared memory, sm_90. */

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
        return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

/* Makes initialised mbarriers visible to the async proxy (the bulk copies
 * that complete on them). */
__device__ __forceinline__ void fence_mbar_init(void) {
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                     : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint64_t *bar, uint32_t parity) {
        uint32_t ok;
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(ok)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
        return ok != 0;
}

/* Copies `bytes` (multiple of 16, 16-byte aligned ends) from global memory
 * into shared memory; completion is counted on `bar` as transaction bytes. */
__device__ __forceinline__ void tma_load_1d(void *smem_dst, const void *src, uint32_t bytes, uint64_t *bar) {
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                             smem_addr(smem_dst)),
                     "l"(src), "r"(bytes), "r"(smem_addr(bar))
                     : "memory");
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const volatile uint32_t *p) {
        uint32_t v;
        asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const volatile uint64_t *p) {
        uint64_t v;
        asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
        return v;
}

__device__ __forceinline__ void fence_acq_rel_sys(void) {
        asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ __forceinline__ uint64_t globaltimer_ns(void) {
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
}

/* Thread 0 of the block stamps trace[i] ($MOEEP_KERNEL_TRACE), when
 * tracing. */
__device__ __forceinline__ void trace_stamp(uint64_t *trace, int i) {
        if (trace && threadIdx.x == 0)
                trace[i] = globaltimer_ns();
}

/* 16-byte global accesses. The loads of payload bypass L1 (read once). */
__device__ __forceinline__ int4 ld_nc_v4(const int4 *p) {
        int4 v;
        asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
        return v;
}

__device__ __forceinline__ void st_na_v4(int4 *p, int4 v) {
        asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                     "r"(v.w)
                     : "memory");
}

/* A 16-byte store that is not cached or merged away (mapped host memory). */
__device__ __forceinline__ void st_volatile_v4(int4 *p, int4 v) {
        asm volatile("st.volatile.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                     "r"(v.w)
                     : "memory");
}

/* Called by every thread of every block at the end of a data kernel;
 * true in the last block to get there, whose threads may then release
 * flags that cover every block's stores: the barrier orders the block's
 * stores before thread 0's release fence and block counter increment, the
 * last increment (and its acquire fence) orders every block's before the
 * flags (fence cumulativity, as in a cooperative grid sync). One fence per
 * block rather than one sequentially consistent fence per thread: release
 * and acquire are all the flags need. With ranks behind the proxy, whose
 * staging stores go to host memory over PCIe, each thread still fences its
 * own stores first. Resets the counter. */
__device__ __forceinline__ bool last_block_done(const struct moeep_ctx &ctx) {
        __shared__ int s_last;
        const int tid = threadIdx.x;

        if (ctx.px.remote)
                __threadfence_system();
        __syncthreads();
        if (tid == 0) {
                fence_acq_rel_sys();
                s_last = atomicAdd(&ctx.state->blocks_done, 1u) == gridDim.x - 1;
                fence_acq_rel_sys();
        }
        __syncthreads();
        if (!s_last)
                return false;
        if (tid == 0)
                ctx.state->blocks_done = 0;
        return true;
}
