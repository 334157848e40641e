/* Whether a low-latency launch doing both phases (send and receive, whose
 * blocks wait in the receive for every other rank's blocks) is launched
 * cooperatively or plain. Host code of the ll/ launchers.
 *
 * A cooperative launch is placed only where the whole grid fits at once,
 * and the runtime refuses a grid that cannot (MPS with fewer SMs, a green
 * context), where the call then runs as two launches (launch_phases).
 * Placed all at once, it never starts early as a programmatic dependent
 * on a stream (it does in a graph): each launch of an eager step then
 * pays the launch gap that the plain form hides. A plain launch of such a
 * grid is as safe as a cooperative one where it is the only grid of its
 * kind that can run on the GPU at a time: its blocks then take the SMs as
 * the kernel before them leaves them, and nothing of its kind holds any
 * SM that it waits for. So per device and process: the first launch is
 * cooperative (which checks that the grid fits in this context); once one
 * succeeded, the launches on that stream go plain, stream order keeping
 * them one at a time; a second stream (two endpoints or callers on two
 * streams, whose grids could each take part of the SMs and wait for the
 * rest) makes every later launch cooperative, as does MPS (other
 * processes' grids beside ours) and stream capture (a graph may be
 * replayed beside eager work; it places cooperative kernels early
 * anyway). MOEEP_DEBUG_LL_COOP keeps every launch cooperative, to time the
 * difference. */
#pragma once

#include <stdint.h>

#include <mutex>

#include <cuda_runtime.h>

#include "kernels.h"

/* Devices of one process the choice is kept for; above, always cooperative. */
#define LL_COOP_DEVICES 64

struct ll_coop_device {
        bool known;                /* mps was read */
        bool mps;                  /* contexts on the device are shared through MPS */
        bool mixed;                /* a second stream was seen: cooperative from now on */
        unsigned long long stream; /* the stream whose cooperative launch succeeded first (its id), or 0 */
};

struct ll_coop_state {
        std::mutex lock;
        struct ll_coop_device dev[LL_COOP_DEVICES];
};

/* One for the process: an inline function's static is one object. */
inline struct ll_coop_state &ll_coop_state_of(void) {
        static struct ll_coop_state s;
        return s;
}

/* What ll_coop_choose decided, for ll_coop_done. */
struct ll_coop_choice {
        int device; /* -1: nothing to record */
        unsigned long long stream;
        bool cooperative;
};

/* Decides the form of a launch of both phases on `stream`. */
static inline struct ll_coop_choice ll_coop_choose(const struct moeep_ctx *ctx, cudaStream_t stream) {
        struct ll_coop_choice c = { -1, 0, true };
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        int device = -1;

        if ((ctx->debug & MOEEP_DEBUG_LL_COOP) || cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
            capture != cudaStreamCaptureStatusNone || cudaGetDevice(&device) != cudaSuccess || device < 0 ||
            device >= LL_COOP_DEVICES || cudaStreamGetId(stream, &c.stream) != cudaSuccess) {
                (void)cudaGetLastError();
                return c;
        }
        struct ll_coop_state &s = ll_coop_state_of();
        std::lock_guard<std::mutex> hold(s.lock);
        struct ll_coop_device *d = &s.dev[device];
        if (!d->known) {
                int mps = 0;
                if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, device) != cudaSuccess) {
                        (void)cudaGetLastError();
                        mps = 1; /* unknown: as if shared */
                }
                d->mps = mps != 0;
                d->known = true;
        }
        if (d->mps || d->mixed)
                return c;
        if (d->stream && d->stream != c.stream) {
                d->mixed = true;
                return c;
        }
        c.device = device;
        c.cooperative = d->stream == 0;
        return c;
}

/* After the launch chosen by c: a cooperative launch that succeeded makes
 * its stream the one whose launches go plain. */
static inline void ll_coop_done(const struct ll_coop_choice &c, cudaError_t e) {
        if (c.device < 0 || !c.cooperative || e != cudaSuccess)
                return;
        struct ll_coop_state &s = ll_coop_state_of();
        std::lock_guard<std::mutex> hold(s.lock);
        struct ll_coop_device *d = &s.dev[c.device];
        if (!d->mixed && d->stream == 0)
                d->stream = c.stream;
        else if (d->stream != c.stream)
                d->mixed = true;
}
