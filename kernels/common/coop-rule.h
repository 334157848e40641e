/* The rule of kernels/common/coop.cuh on plain values, apart from the CUDA
 * calls that feed it, so that a test checks it without a GPU
 * (tests/unit/test-coop.c): per device, the one stream of the launches of
 * kernels that wait for other ranks, and whether a low-latency launch of
 * both phases may go plain on it. Plain C; host code. */
#ifndef MOEEP_COOP_RULE_H
#define MOEEP_COOP_RULE_H

#include <stdbool.h>

struct coop_device {
        bool known;                /* mps was read */
        bool mps;                  /* contexts on the device are shared through MPS */
        bool mixed;                /* a second stream or a capture was seen: cooperative from now on */
        bool validated;            /* a cooperative launch of both phases succeeded on `stream` */
        unsigned long long stream; /* the one stream of the launches that wait for other ranks (its id), or 0 */
};

/* A launch of a kernel that waits for other ranks on stream `id`, or into
 * a stream capture (`capturing`: a graph may be replayed on any stream). */
static inline void coop_rule_seen(struct coop_device *d, bool capturing, unsigned long long id) {
        if (capturing)
                d->mixed = true;
        else if (!d->stream)
                d->stream = id;
        else if (d->stream != id)
                d->mixed = true;
}

/* Whether a launch of both phases, after coop_rule_seen, is cooperative
 * (`force`: MOEEP_DEBUG_LL_COOP). */
static inline bool coop_rule_cooperative(const struct coop_device *d, bool force) {
        return force || d->mps || d->mixed || !d->validated;
}

/* After a cooperative launch of both phases on stream `id`: one that
 * succeeded on the one stream lets the later ones there go plain. */
static inline void coop_rule_done(struct coop_device *d, unsigned long long id, bool ok) {
        if (ok && !d->mixed && d->stream == id)
                d->validated = true;
}

#endif
