/* Bounded device waits. Every wait loop of moeep's kernels is spin_until():
 * spin on a condition and, after each try that failed, ask a give-up
 * policy whether to stop. Each wait keeps its own bound, set by its policy:
 *
 *   spin_give_up   the job's waits: on other GPUs' flags (wait_flag), the
 *                  chunk counters of combine (wait_counter), the block's
 *                  own copy pipeline (mbar_wait, checking once per
 *                  MBAR_SPINS tries) and, adding the ring's error word, a
 *                  remote rank's proxy signal (px_wait, px.cuh). It looks,
 *                  every SPIN_CHECK_EVERY spins, at a failure of another
 *                  wait of the launch and ctx.timeout_ns and, once the
 *                  wait is long (spin_host_due), at the job's abort word,
 *                  and records the failure in the local state
 *                  (record_error) for the host to report.
 *   ring_wait      the proxy ring's producer (ring.cuh): the ring's error
 *                  word, the abort word and a timeout, on every spin,
 *                  returned to the producer as -errno.
 *   none           a wait on another warp of the block that is itself
 *                  bounded (combine_copy on combine_wait), and the
 *                  benchmarks' timed delay.
 *   spin_give_up_peer   an elastic endpoint's low-latency wait for a peer
 *                  (wait_peer): ends, masking the peer, when the daemon
 *                  marked it lost (the control page's lost_ranks) or the
 *                  shrink timeout passed, or when another wait masked it
 *                  already; only the daemon stopping, or another wait's
 *                  failure, is an error.
 *   spin_give_up_block  an elastic endpoint's wait for another block of the
 *                  same launch (wait_decision): the daemon stopping, a
 *                  failure of another wait, ctx.timeout_ns.
 *
 * A wait that gives up returns false; the kernel goes on, its results are
 * wrong and the recorded error says so: a lost peer never hangs the GPU. */
#pragma once

#include <stdint.h>

#include "kernels.h"
#include "common/ptx.cuh"

/* The one wait loop: true once done() holds, false as soon as give_up()
 * (called after every try that failed) says so. */
template <typename Done, typename GiveUp> __device__ __forceinline__ bool spin_until(Done done, GiveUp give_up) {
        while (!done())
                if (give_up())
                        return false;
        return true;
}

/* Records the first failure of a device wait in the local state; sticky
 * until the host clears it. */
__device__ __forceinline__ void record_error(const struct moeep_ctx &ctx, uint32_t err, int peer) {
        if (atomicCAS(&ctx.state->error, 0u, err) == 0u)
                ctx.state->error_rank = peer;
}

/* The state of one bounded device wait; see spin_give_up. */
struct spin {
        uint64_t start;     /* globaltimer at the first spin */
        uint64_t host_next; /* when the wait next reads host memory */
        uint32_t n;         /* spins so far */
};

__device__ __forceinline__ struct spin spin_begin(void) {
        const uint64_t now = globaltimer_ns();
        return { now, now + SPIN_HOST_AFTER_NS, 0 };
}

/* Whether the wait reads the daemon's words in host memory at `now`
 * (SPIN_HOST_AFTER_NS, params.h): true at most once per
 * SPIN_HOST_EVERY_NS, never in the wait's first SPIN_HOST_AFTER_NS. */
__device__ __forceinline__ bool spin_host_due(struct spin &s, uint64_t now) {
        if (now < s.host_next)
                return false;
        s.host_next = now + SPIN_HOST_EVERY_NS;
        return true;
}

/* The give-up policy of the job's waits, called once per spin: true when
 * the wait must end without its condition, because the job's abort word is
 * set, another wait of this launch already failed, or the timeout passed
 * (the error is recorded, naming `peer`, -1 when unknown). It looks only
 * every SPIN_CHECK_EVERY spins, and at the abort word (host memory) only
 * when spin_host_due says so (params.h). */
__device__ __forceinline__ bool spin_give_up(const struct moeep_ctx &ctx, struct spin &s, int peer) {
        if (++s.n % SPIN_CHECK_EVERY)
                return false;
        if (*(volatile uint32_t *)&ctx.state->error)
                return true;
        const uint64_t now = globaltimer_ns();
        if (ctx.abort_word && !(ctx.debug & MOEEP_DEBUG_NO_ABORT_POLL) && spin_host_due(s, now) &&
            ld_volatile_u32(ctx.abort_word)) {
                record_error(ctx, MOEEP_KERR_ABORT, peer);
                return true;
        }
        if (now - s.start > ctx.timeout_ns) {
                record_error(ctx, MOEEP_KERR_TIMEOUT, peer);
                return true;
        }
        return false;
}

/* Bounded wait until *flag >= want; false when it gave up (see
 * spin_give_up). */
__device__ __forceinline__ bool wait_flag(const struct moeep_ctx &ctx, const uint64_t *flag, uint64_t want, int peer) {
        struct spin s = spin_begin();

        return spin_until([&] { return ld_acquire_sys(flag) >= want; }, [&] { return spin_give_up(ctx, s, peer); });
}

/* Bounded wait until the 32-bit counter reaches want, or at once when
 * `skip` (combine's chunk counters; see spin_give_up). */
__device__ __forceinline__ bool wait_counter(const struct moeep_ctx &ctx, const uint32_t *counter, uint32_t want,
                                             bool skip, int peer) {
        struct spin s = spin_begin();

        return spin_until([&] { return skip || ld_acquire_sys_u32(counter) >= want; },
                          [&] { return spin_give_up(ctx, s, peer); });
}

/* Bounded wait for an mbarrier phase (the producer/consumer pipeline of a
 * block); false when it gave up (see spin_give_up): a failed wait elsewhere
 * in the launch, the job's abort, or the timeout end it, so a broken
 * pipeline never hangs the GPU. The caller goes on, the result is wrong and
 * the recorded error says so. */
__device__ __forceinline__ bool mbar_wait(const struct moeep_ctx &ctx, uint64_t *bar, uint32_t parity) {
        if (mbar_try_wait(bar, parity)) /* the common case: no clock read */
                return true;
        struct spin s = spin_begin();
        uint32_t n = 0;

        /* These waits are short and frequent (a block's own copy pipeline):
         * spin_give_up reads the clock, so it is called once per MBAR_SPINS
         * tries, not on every one. */
        return spin_until([&] { return mbar_try_wait(bar, parity); },
                          [&] { return ++n % MBAR_SPINS == 0 && spin_give_up(ctx, s, -1); });
}

/* ---- Elastic endpoints (ctx.shrink; docs/reliability.md, "Elastic
 * ranks"). */

/* Whether `rank` is masked (DeepEP's mask buffer, state->mask). A volatile
 * load: other blocks of the launch may mask it. */
__device__ __forceinline__ bool ll_masked(const struct moeep_ctx &ctx, int rank) {
        return *(volatile int32_t *)&ctx.state->mask[rank] != 0;
}

/* Masks `rank`: in the endpoint's mask, and in this call's active_ranks
 * (the caller's view, which moeep keeps up to date). */
__device__ __forceinline__ void ll_mask(const struct moeep_ctx &ctx, int rank) {
        atomicExch(&ctx.state->mask[rank], 1);
        if (ctx.active)
                ctx.active[rank] = 0;
}

/* The control page's lost_ranks (low 32 bits) and stopping (high), one
 * PCIe read; 0 without a version 2 page. */
__device__ __forceinline__ uint64_t ll_lost_word(const struct moeep_ctx &ctx) {
        return ctx.lost_word ? ld_volatile_u64(ctx.lost_word) : 0;
}

/* The give-up policy of an elastic wait for `peer`, called once per spin
 * and looking every SPIN_CHECK_EVERY spins (at the control page only when
 * spin_host_due says so): true when the wait must end. It
 * ends quietly when the peer is masked (by another wait, or now: the
 * daemon marked it lost, or the wait is older than bound_ns), with an error
 * when the daemon is stopping (recorded) or another wait failed. */
__device__ __forceinline__ bool spin_give_up_peer(const struct moeep_ctx &ctx, struct spin &s, int peer,
                                                  uint64_t bound_ns) {
        if (++s.n % SPIN_CHECK_EVERY)
                return false;
        if (*(volatile uint32_t *)&ctx.state->error || ll_masked(ctx, peer))
                return true;
        const uint64_t now = globaltimer_ns();
        const uint64_t w = spin_host_due(s, now) ? ll_lost_word(ctx) : 0;
        if (w >> 32) {
                record_error(ctx, MOEEP_KERR_ABORT, peer);
                return true;
        }
        if (((uint32_t)w >> peer & 1) || now - s.start > bound_ns) {
                ll_mask(ctx, peer);
                return true;
        }
        return false;
}

/* Bounded wait until *flag >= want, set by `peer`; false when it gave up:
 * the peer is masked then, unless an error was recorded. */
__device__ __forceinline__ bool wait_peer(const struct moeep_ctx &ctx, const uint64_t *flag, uint64_t want, int peer,
                                          uint64_t bound_ns) {
        struct spin s = spin_begin();

        return spin_until([&] { return ld_acquire_sys(flag) >= want; },
                          [&] { return spin_give_up_peer(ctx, s, peer, bound_ns); });
}

/* The give-up policy of an elastic endpoint's wait for another block of
 * its own launch (which is itself bounded: its waits for peers take at
 * most three shrink timeouts): the daemon stopping, another wait's failure,
 * or ctx.timeout_ns past those (recorded as a timeout). */
__device__ __forceinline__ bool spin_give_up_block(const struct moeep_ctx &ctx, struct spin &s) {
        if (++s.n % SPIN_CHECK_EVERY)
                return false;
        if (*(volatile uint32_t *)&ctx.state->error)
                return true;
        const uint64_t now = globaltimer_ns();
        if (spin_host_due(s, now) && ll_lost_word(ctx) >> 32) {
                record_error(ctx, MOEEP_KERR_ABORT, -1);
                return true;
        }
        if (now - s.start > ctx.timeout_ns + 3 * ctx.shrink_timeout_ns) {
                record_error(ctx, MOEEP_KERR_TIMEOUT, ctx.rank);
                return true;
        }
        return false;
}

/* A decision one block takes for the others (the state's ll_*_view words):
 * (seq & 0xffffffff) << 32 | bits, released at GPU scope after everything
 * it decided on was acquired, so that a block that acquires it sees that
 * too. */
__device__ __forceinline__ void publish_decision(uint64_t *word, uint64_t seq, uint32_t bits) {
        st_release_gpu(word, (seq & 0xffffffffull) << 32 | bits);
}

/* Waits for the decision of sequence number seq in *word; returns its bits,
 * or 0 when the wait gave up (an error is recorded). */
__device__ __forceinline__ uint32_t wait_decision(const struct moeep_ctx &ctx, const uint64_t *word, uint64_t seq) {
        struct spin s = spin_begin();
        uint64_t w = 0;

        if (!spin_until([&] { return ((w = ld_acquire_sys(word)) >> 32) == (seq & 0xffffffffull); },
                        [&] { return spin_give_up_block(ctx, s); }))
                return 0;
        return (uint32_t)w;
}
