/* Descriptor rings between a producer (the kernels of a client, or a CPU
 * test driver) and the daemon's proxy thread (daemon/datapath/proxy.h): the layout
 * in shared memory and the rules of who writes what, in which order. Plain
 * C and C++ (nvcc includes it from kernels/common/ring.cuh).
 *
 * Ring layout (one memfd per ring, PROXY_RING_BYTES(capacity) bytes, mapped
 * by the producer (the client, kernels through cudaHostRegister) and by the
 * daemon):
 *
 *   offset    0: struct proxy_ring_hdr, 4 cache lines
 *                line 0: magic, version, capacity (set once by proxy_ring_create)
 *                line 1: tail  - producer-owned: descriptors ever published
 *                line 2: head  - proxy-owned: descriptors ever consumed
 *                        done  - proxy-owned: descriptors whose writes ended
 *                line 3: error, error_peer, error_seq - proxy-owned
 *   offset  256: struct proxy_desc desc[capacity]; descriptor number s lives
 *                in desc[s & (capacity - 1)]
 *
 * Indices are free-running 64-bit counts; capacity is a power of two.
 * Each index has one writer and sits on its own cache line so the producer
 * and the proxy never write the same line.
 *
 * Memory ordering (C11 names; on the GPU st.release.sys / ld.acquire.sys or
 * __threadfence_system() around volatile accesses):
 *  1. The producer may fill slot s only when s - acquire(head) < capacity.
 *  2. It writes the payload into its send region and the descriptor into
 *     desc[s & mask], then release-stores tail = s + 1. One producer per
 *     ring (one ring per client channel).
 *  3. The proxy acquire-loads tail, copies descriptors [head, tail), then
 *     release-stores head past them: their slots may be reused at once.
 *  4. The payload of descriptor s may be reused once acquire(done) > s:
 *     done advances in descriptor order when every write of a descriptor has
 *     completed locally (or failed).
 *  5. Errors: the proxy writes error_peer and error_seq, then release-stores
 *     error (-errno, first failure only). Every wait on this ring (for head,
 *     done, or for counters fed by the same peers) must also watch error.
 *
 * Ordering at the receiver ("Ordering" in the docs): for a descriptor with
 * PROXY_DESC_SIGNAL the proxy posts the data write, then an 8-byte write of
 * signal_value into counter[signal_id] of the route's counter region, with
 * TP_WRITE_ORDERED on the same peer. The transport guarantees the counter
 * write is placed after the data (libfabric FI_ORDER_WAW, or FI_FENCE when
 * the provider lacks it; verbs RC in-order execution and placement on one
 * QP). A receiver that acquire-loads counter[id] >= value may read the data.
 * With libfabric tcp the target's provider copies both writes into memory
 * with the CPU, in order; that the receiver sees them in that order too
 * relies on the host's store ordering (x86 TSO). A NIC writes through PCIe
 * posted writes, which stay in order. */
#ifndef MOEEP_PROTO_RING_H
#define MOEEP_PROTO_RING_H

#include <stdint.h>

#ifdef __cplusplus
#define MOEEP_RING_ALIGN64 alignas(64)
#define MOEEP_RING_STATIC_ASSERT static_assert
#else
#define MOEEP_RING_ALIGN64 _Alignas(64)
#define MOEEP_RING_STATIC_ASSERT _Static_assert
#endif

#define PROXY_RING_MAGIC 0x676e697270656f6dull /* "moepring" little-endian */
#define PROXY_RING_VERSION 1
#define PROXY_RING_HDR_BYTES 256
#define PROXY_RING_MAX_CAPACITY (1u << 20)
#define PROXY_RING_BYTES(cap) (PROXY_RING_HDR_BYTES + (uint64_t)(cap) * sizeof(struct proxy_desc))

/* The shared header; see the layout above. */
struct proxy_ring_hdr {
        /* Line 0: written once by proxy_ring_create, read-only after. */
        uint64_t magic;    /* PROXY_RING_MAGIC */
        uint32_t version;  /* PROXY_RING_VERSION */
        uint32_t capacity; /* descriptors; a power of two */
        uint8_t pad0[48];
        /* Line 1: the producer's. */
        MOEEP_RING_ALIGN64 uint64_t tail; /* descriptors published; release-stored by the producer */
        uint8_t pad1[56];
        /* Line 2: the proxy's. */
        MOEEP_RING_ALIGN64 uint64_t head; /* descriptors consumed; release-stored by the proxy */
        uint64_t done;                    /* descriptors finished, in order; release-stored by the proxy */
        uint8_t pad2[48];
        /* Line 3: the proxy's; the first failure on this ring. */
        MOEEP_RING_ALIGN64 int32_t error; /* 0, or -errno; release-stored after the two below */
        uint32_t error_peer;              /* desc.peer (route index) that failed, UINT32_MAX when none */
        uint64_t error_seq;               /* descriptor number that failed */
        uint8_t pad3[48];
};
MOEEP_RING_STATIC_ASSERT(sizeof(struct proxy_ring_hdr) == PROXY_RING_HDR_BYTES,
                         "ring header is 4 cache lines");

/* desc.flags */
enum {
        /* After the data (if any), write signal_value into counter
         * signal_id of the route's counter region. */
        PROXY_DESC_SIGNAL = 1u << 0,
};

/* One descriptor: one cache line, written by the producer, read by the
 * proxy. A descriptor with length 0 and PROXY_DESC_SIGNAL is a pure signal. */
struct proxy_desc {
        uint64_t src_offset;   /* into the ring's send region */
        uint64_t dst_offset;   /* into the route's data region at the receiver */
        uint64_t signal_value; /* value the receiver's counter takes (64-bit, set, not added) */
        uint32_t length;       /* payload bytes; 0 = none */
        uint32_t peer;         /* route index (proxy_ring_add's routes), not a transport peer */
        uint32_t signal_id;    /* counter index in the route's counter region (8 bytes each) */
        uint32_t flags;        /* PROXY_DESC_* */
        uint8_t reserved[24];  /* zero */
};
MOEEP_RING_STATIC_ASSERT(sizeof(struct proxy_desc) == 64, "a descriptor is one cache line");

#endif
