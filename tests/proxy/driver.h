/* The CPU producer of the proxy tests and benchmark: it writes descriptor
 * rings exactly as the kernels will (daemon/datapath/proxy.h, "Memory ordering"),
 * and waits on done, counters and the ring's error word the way a kernel
 * wait does: bounded, and watching the error. */
#ifndef MOEEP_TESTS_PROXY_DRIVER_H
#define MOEEP_TESTS_PROXY_DRIVER_H

#include <errno.h>
#include <stdint.h>
#include <time.h>

#include "datapath/proxy.h"

#define DRV_LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define DRV_STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static inline uint64_t drv_now_ns(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The producer's view of one ring: the mapping and its own tail. */
struct drv_ring {
        struct proxy_ring_hdr *hdr; /* mapping of the ring memfd */
        struct proxy_desc *desc;
        uint32_t cap;
        uint64_t tail; /* descriptors published */
};

static inline void drv_ring_init(struct drv_ring *r, void *map) {
        r->hdr = map;
        r->desc = (struct proxy_desc *)((char *)map + PROXY_RING_HDR_BYTES);
        r->cap = r->hdr->capacity;
        r->tail = r->hdr->tail;
}

/* Rules 1-2: wait for a free slot, write the descriptor, release the tail.
 * Returns 0, the ring's error, or -ETIMEDOUT at `deadline_ns`. */
static inline int drv_push(struct drv_ring *r, const struct proxy_desc *d, uint64_t deadline_ns) {
        unsigned spins = 0;
        int err;

        while (r->tail - DRV_LOAD_ACQ(&r->hdr->head) >= r->cap) {
                if ((err = DRV_LOAD_ACQ(&r->hdr->error)) != 0)
                        return err;
                if ((++spins & 1023) == 0 && drv_now_ns() > deadline_ns)
                        return -ETIMEDOUT;
        }
        r->desc[r->tail & (r->cap - 1)] = *d;
        DRV_STORE_REL(&r->hdr->tail, r->tail + 1);
        r->tail++;
        return 0;
}

/* Rule 4: wait until descriptors [0, n) are done. */
static inline int drv_wait_done(struct drv_ring *r, uint64_t n, uint64_t deadline_ns) {
        unsigned spins = 0;
        int err;

        while (DRV_LOAD_ACQ(&r->hdr->done) < n) {
                if ((err = DRV_LOAD_ACQ(&r->hdr->error)) != 0)
                        return err;
                if ((++spins & 1023) == 0 && drv_now_ns() > deadline_ns)
                        return -ETIMEDOUT;
        }
        return DRV_LOAD_ACQ(&r->hdr->error);
}

/* The receiving kernel's wait: counter >= value, watching the error word
 * of a ring served by the same proxy (`watch`, may be NULL). */
static inline int drv_wait_counter(uint64_t *counter, uint64_t value, struct proxy_ring_hdr *watch,
                                   uint64_t deadline_ns) {
        unsigned spins = 0;
        int err;

        while (DRV_LOAD_ACQ(counter) < value) {
                if (watch && (err = DRV_LOAD_ACQ(&watch->error)) != 0)
                        return err;
                if ((++spins & 1023) == 0 && drv_now_ns() > deadline_ns)
                        return -ETIMEDOUT;
        }
        return 0;
}

#endif
