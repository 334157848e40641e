/* Whether a low-latency launch doing both phases (send and receive, whose
 * blocks wait in the receive for every other rank's blocks) is launched
 * cooperatively or plain. Host code of the launchers.
 *
 * A cooperative launch is placed only where the whole grid fits at once,
 * and the runtime refuses a grid that cannot (MPS with fewer SMs, a green
 * context), where the call then runs as two launches (launch_phases).
 * Placed all at once, it never starts early as a programmatic dependent
 * on a stream (it does in a graph): each launch of an eager step then
 * pays the launch gap that the plain form hides. A plain launch of such a
 * grid is as safe as a cooperative one where no other grid that waits for
 * other ranks can run beside it: its blocks then take the SMs as the
 * kernel before them leaves them, and nothing holds an SM that they wait
 * for. So, per device and process, every launch of a kernel that waits for
 * other ranks (the normal mode's kernels, the hook phases, relays, the
 * clean barrier: coop_note; both phases: coop_choose) must have been on
 * one stream, where stream order keeps them one at a time; the first
 * launch of both phases there is cooperative (which checks that the grid
 * fits in this context), and once one succeeded the later ones there go
 * plain. A second stream (another endpoint, a comm stream, a caller's
 * second stream: their grids could take part of the SMs and wait for the
 * rest), stream capture (a graph may be replayed on any stream, beside
 * eager work) and MPS (other processes' grids beside ours) make every
 * later launch cooperative. MOEEP_DEBUG_LL_COOP keeps every launch
 * cooperative, to time the difference. */
#pragma once

#include <stdint.h>

#include <mutex>

#include <cuda_runtime.h>

#include "common/coop-rule.h"
#include "kernels.h"

/* Devices of one process the choice is kept for; above, always cooperative. */
#define COOP_DEVICES 64

struct coop_state {
        std::mutex lock;
        struct coop_device dev[COOP_DEVICES];
};

/* One for the library: an inline function's static is one object. */
inline struct coop_state &coop_state_of(void) {
        static struct coop_state s;
        return s;
}

/* What coop_choose decided, for coop_done. */
struct coop_choice {
        int device; /* -1: nothing to record */
        unsigned long long stream;
        bool cooperative;
};

/* Notes a launch on `stream` of a kernel that waits for other ranks, and
 * returns its device's state (held under s.lock by the caller's `hold`),
 * or NULL where the stream cannot be told (then cooperative). */
static inline struct coop_device *coop_seen(struct coop_state &s, cudaStream_t stream, int *ret_device,
                                            unsigned long long *ret_id) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        int device = -1;

        if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || cudaGetDevice(&device) != cudaSuccess ||
            device < 0 || device >= COOP_DEVICES ||
            (capture == cudaStreamCaptureStatusNone && cudaStreamGetId(stream, ret_id) != cudaSuccess)) {
                (void)cudaGetLastError();
                return NULL;
        }
        struct coop_device *d = &s.dev[device];
        if (!d->known) {
                int mps = 0;
                if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, device) != cudaSuccess) {
                        (void)cudaGetLastError();
                        mps = 1; /* unknown: as if shared */
                }
                d->mps = mps != 0;
                d->known = true;
        }
        coop_rule_seen(d, capture != cudaStreamCaptureStatusNone, *ret_id);
        *ret_device = device;
        return d;
}

/* A launch on `stream` of a kernel that waits for other ranks, other than
 * a low-latency launch of both phases (coop_choose). */
static inline void coop_note(cudaStream_t stream) {
        struct coop_state &s = coop_state_of();
        std::lock_guard<std::mutex> hold(s.lock);
        unsigned long long id = 0;
        int device;

        (void)coop_seen(s, stream, &device, &id);
}

/* Decides the form of a low-latency launch of both phases on `stream`. */
static inline struct coop_choice coop_choose(const struct moeep_ctx *ctx, cudaStream_t stream) {
        struct coop_choice c = { -1, 0, true };
        struct coop_state &s = coop_state_of();
        std::lock_guard<std::mutex> hold(s.lock);
        int device;
        struct coop_device *d = coop_seen(s, stream, &device, &c.stream);

        if (!d)
                return c;
        c.device = device;
        c.cooperative = coop_rule_cooperative(d, ctx->debug & MOEEP_DEBUG_LL_COOP);
        return c;
}

/* After the launch chosen by c: a cooperative launch that succeeded lets
 * the later ones on its stream go plain. */
static inline void coop_done(const struct coop_choice &c, cudaError_t e) {
        if (c.device < 0 || !c.cooperative || e != cudaSuccess)
                return;
        struct coop_state &s = coop_state_of();
        std::lock_guard<std::mutex> hold(s.lock);
        coop_rule_done(&s.dev[c.device], c.stream, true);
}
