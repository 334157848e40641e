/* The GPU side of a proxy descriptor ring (proto/ring.h): the ring header,
 * its descriptors and the counters the proxy's signals set all live in host
 * memory that the client mapped for the device (cudaHostRegister), so every
 * access below is a PCIe round trip or a posted write. One thread produces
 * on a ring (rule 2); any thread may wait on a counter. */
#pragma once

#include <errno.h>
#include <stdint.h>

#include "ring.h"
#include "common/ptx.cuh"
#include "common/wait.cuh"

/* The producer's view of one ring. */
struct ring_producer {
        struct proxy_ring_hdr *hdr; /* device pointer to the mapped header */
        struct proxy_desc *desc;    /* hdr + PROXY_RING_HDR_BYTES */
        uint32_t cap;               /* hdr->capacity, a power of two */
        uint64_t tail;              /* descriptors this producer published */
        uint64_t head;              /* the proxy's head as last read: re-read only when the ring looks full */
};

__device__ __forceinline__ int32_t ring_error(const struct proxy_ring_hdr *hdr) {
        return (int32_t)ld_volatile_u32((const volatile uint32_t *)&hdr->error);
}

/* Waits until *p >= want (a counter a signal sets, or the ring's done),
 * bounded by timeout_ns, watching the ring's error word and the job's abort
 * word (host memory the daemon sets; NULL: none). Returns 0, the ring's
 * error, -ENOTCONN (aborted) or -ETIMEDOUT. */
__device__ __forceinline__ int ring_wait(const uint64_t *p, uint64_t want, const struct proxy_ring_hdr *hdr,
                                         uint64_t timeout_ns, const volatile uint32_t *abort_word) {
        const uint64_t start = globaltimer_ns();
        int err = 0;

        /* The ring's give-up policy (wait.cuh): checked on every spin. */
        spin_until([&] { return ld_acquire_sys(p) >= want; },
                   [&] {
                           const int32_t e = ring_error(hdr);
                           if (e)
                                   err = e;
                           else if (abort_word && ld_volatile_u32(abort_word))
                                   err = -ENOTCONN;
                           else if (globaltimer_ns() - start > timeout_ns)
                                   err = -ETIMEDOUT;
                           return err != 0;
                   });
        return err;
}

/* Rule 1 and the first half of rule 2: waits for a free slot (bounded by
 * timeout_ns, watching the ring's error word; the head is read over PCIe
 * only when the cached one says the ring is full) and writes the descriptor
 * with four 16-byte stores. The proxy sees it after ring_publish. Returns 0,
 * the ring's error (-errno) or -ETIMEDOUT. */
__device__ __forceinline__ int ring_put(struct ring_producer &r, const struct proxy_desc &d, uint64_t timeout_ns,
                                        const volatile uint32_t *abort_word) {
        if (r.tail - r.head >= r.cap) {
                /* Slot tail is free once head > tail - cap. */
                const int e = ring_wait(&r.hdr->head, r.tail - r.cap + 1, r.hdr, timeout_ns, abort_word);
                if (e)
                        return e;
                r.head = ld_acquire_sys(&r.hdr->head); /* the proxy may be well past it by now */
        }
        int4 *dst = (int4 *)&r.desc[r.tail & (r.cap - 1)];
        const int4 *src = (const int4 *)&d;
#pragma unroll
        for (int i = 0; i < (int)(sizeof(struct proxy_desc) / sizeof(int4)); i++)
                st_volatile_v4(dst + i, src[i]);
        r.tail++;
        return 0;
}

/* The second half of rule 2: release-stores the tail, which orders this
 * thread's earlier stores (payloads, descriptors) before it. Payload written
 * by other threads must be fenced (__threadfence_system) and synchronised
 * with this one before. One release covers every ring_put before it, so a
 * batch costs one ordering round trip over PCIe, not one per descriptor. */
__device__ __forceinline__ void ring_publish(struct ring_producer &r) {
        st_release_sys(&r.hdr->tail, r.tail);
}

/* ring_put, then ring_publish. */
__device__ __forceinline__ int ring_push(struct ring_producer &r, const struct proxy_desc &d, uint64_t timeout_ns,
                                         const volatile uint32_t *abort_word) {
        const int e = ring_put(r, d, timeout_ns, abort_word);
        if (e == 0)
                ring_publish(r);
        return e;
}
