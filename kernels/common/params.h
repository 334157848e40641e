/* Every limit, tunable and magic number of moeep's kernels, and the bit
 * packings of the words they exchange, with their pack/unpack helpers
 * (host and device). Plain C, no CUDA headers: included by the kernels
 * (through buffers.h and kernels.h), by the client library and by
 * client/python/tests/abi.c, which prints these values so that the Python
 * package's copies (moeep/_lib.py, moeep/config.py) are checked against
 * them. */
#ifndef MOEEP_KERNEL_PARAMS_H
#define MOEEP_KERNEL_PARAMS_H

#include <assert.h>
#include <stdint.h>

#include "moeep_job.h"

/* ---- Limits: the shapes the kernels' fixed arrays are sized for. */

#define MOEEP_KERNEL_MAX_RANKS 8
/* A job's ranks are a product limit (proto/moeep_job.h); the kernels' per-rank arrays
 * (flags, counts, peer pointers) must hold every one of them. */
static_assert(MOEEP_KERNEL_MAX_RANKS == MOEEP_MAX_RANKS, "kernel rank arrays must match the job's rank limit");
#define MOEEP_KERNEL_MAX_EXPERTS 512
#define MOEEP_KERNEL_MAX_TOPK 9
#define MOEEP_KERNEL_MAX_TOKENS 65536
/* Blocks of a normal-mode launch (moeep_ep_config.num_sms, moeep_ep_set_num_sms). */
#define MOEEP_KERNEL_MAX_SMS 1024
/* Hidden sizes: a multiple of MOEEP_HIDDEN_MULTIPLE so that a bf16 row is
 * a whole number of warp steps (32 lanes x 16 bytes of int4 pairs: the
 * low-latency kernels rely on H / 8 being a multiple of 32). */
#define MOEEP_HIDDEN_MULTIPLE 256
#define MOEEP_KERNEL_MAX_HIDDEN 16384
#define MOEEP_LL_FP8_MAX_HIDDEN 8192 /* low-latency FP8: largest hidden size supported (and tested) */
/* moeep_dispatch_args.expert_alignment: largest rounding of the per-expert counts. */
#define MOEEP_MAX_EXPERT_ALIGNMENT 4096
/* moeep_ep_config.recv_areas: normal-mode receive areas (buffers.h). */
#define MOEEP_MAX_RECV_AREAS 8

/* ---- Formats. */

#define MOEEP_SCALE_BLOCK 128 /* FP8: one float scale per 128 channels */
#define MOEEP_E4M3_MAX 448.0f /* largest finite float8 e4m3 value: FP8 scale = amax / this */
/* Every array of the NVLink buffer and every proxy segment starts at a
 * multiple of this: 16-byte aligned for vector stores, and the flags apart
 * from the payload. */
#define MOEEP_BUFFER_ALIGN 4096

/* ---- Tunables of the normal-mode combine. */

/* Tokens per combine arrival counter, and per chunk a reduce block takes
 * (moeep_combine_chunk): MOEEP_COMBINE_CHUNK up to 2 ranks,
 * MOEEP_COMBINE_CHUNK_MANY from 3. The host sizes arrays by the smaller
 * (buffers.h, client/lib/ep.c): an A/B build sets them in meson's c_args and
 * in NVCC_APPEND_FLAGS alike. */
#ifndef MOEEP_COMBINE_CHUNK
#define MOEEP_COMBINE_CHUNK 16
#endif
#ifndef MOEEP_COMBINE_CHUNK_MANY
#define MOEEP_COMBINE_CHUNK_MANY 8
#endif
#define MOEEP_COMBINE_CHUNK_MIN \
        (MOEEP_COMBINE_CHUNK < MOEEP_COMBINE_CHUNK_MANY ? MOEEP_COMBINE_CHUNK : MOEEP_COMBINE_CHUNK_MANY)
#define MOEEP_COMBINE_CHUNKS (MOEEP_KERNEL_MAX_TOKENS / MOEEP_COMBINE_CHUNK_MIN)

/* Warp roles of the combine kernel (kernels/normal/combine.cu describes them).
 * The role sizes and the slice can be set at build time (-D, for A/B runs
 * through NVCC_APPEND_FLAGS); senders, consumers and the producer must fit
 * the block's 32 warps. */
#ifndef MOEEP_COMBINE_SEND_WARPS
#define MOEEP_COMBINE_SEND_WARPS 6 /* up to 2 ranks */
#endif
#ifndef MOEEP_COMBINE_SEND_WARPS_MANY
#define MOEEP_COMBINE_SEND_WARPS_MANY 8 /* from 3 ranks */
#endif
#ifndef MOEEP_COMBINE_CONSUMER_WARPS
#define MOEEP_COMBINE_CONSUMER_WARPS 12
#endif
#ifndef MOEEP_COMBINE_GROUP_WARPS
#define MOEEP_COMBINE_GROUP_WARPS 4
#endif
#ifndef MOEEP_COMBINE_SLICE_MAX
#define MOEEP_COMBINE_SLICE_MAX 8192
#endif
#ifndef MOEEP_COMBINE_SLICE_FEW
#define MOEEP_COMBINE_SLICE_FEW 16384
#endif
#ifndef MOEEP_COMBINE_CLAIM_ROWS
#define MOEEP_COMBINE_CLAIM_ROWS 4
#endif
enum {
        COMBINE_THREADS = 1024,
        COMBINE_SEND_WARPS = MOEEP_COMBINE_SEND_WARPS,
        COMBINE_SEND_WARPS_MANY = MOEEP_COMBINE_SEND_WARPS_MANY,
        COMBINE_CONSUMER_WARPS = MOEEP_COMBINE_CONSUMER_WARPS, /* in groups of COMBINE_GROUP_WARPS, one per stage */
        COMBINE_GROUP_WARPS = MOEEP_COMBINE_GROUP_WARPS,
        COMBINE_CONSUMER_GROUPS = COMBINE_CONSUMER_WARPS / COMBINE_GROUP_WARPS,
        COMBINE_PRODUCER_WARP = 31,
        COMBINE_SLICE_MAX = MOEEP_COMBINE_SLICE_MAX, /* bytes of one row slice; a stage holds ranks of them */
        COMBINE_SLICE_FEW = MOEEP_COMBINE_SLICE_FEW, /* the same up to COMBINE_FEW_RANKS */
        COMBINE_FEW_RANKS = 4,
        COMBINE_MAX_STAGES = 16,
        COMBINE_STAGE_SMEM = 192 * 1024,               /* ring of stages */
        COMBINE_CLAIM_ROWS = MOEEP_COMBINE_CLAIM_ROWS, /* rows a send warp claims (and counts) at once */
        COMBINE_SEND_UNROLL = 4,                       /* 16-byte loads in flight per lane of a send warp */
        COMBINE_COPY_UNROLL = 8,                       /* loads in flight per lane of the one-rank copy (copy_row) */
};

static_assert(COMBINE_SEND_WARPS + COMBINE_CONSUMER_WARPS <= COMBINE_PRODUCER_WARP &&
                      COMBINE_SEND_WARPS_MANY + COMBINE_CONSUMER_WARPS <= COMBINE_PRODUCER_WARP &&
                      COMBINE_CONSUMER_WARPS % COMBINE_GROUP_WARPS == 0,
              "combine warp roles overlap, or consumers are not whole groups");

/* ---- Tunables of the other kernels. */

/* Blocks of a notify that routes, at most: one exchanging the counts, the
 * others walking the tokens. */
#define MOEEP_NOTIFY_MAX_BLOCKS 17

#ifndef MOEEP_DISPATCH_PARTS /* settable at build time for A/B (NVCC_APPEND_FLAGS) */
#define MOEEP_DISPATCH_PARTS 4
#endif

enum {
        DISPATCH_THREADS = 1024,
        DISPATCH_UNROLL = 4,                   /* 16-byte loads in flight per lane */
        DISPATCH_PARTS = MOEEP_DISPATCH_PARTS, /* units of work per token row, when more tokens than warps */
        DISPATCH_SRC_UNROLL = 8,               /* loads in flight per thread of the receive metadata pass */
};

enum {
        NOTIFY_THREADS = 1024,      /* per block of notify */
        NOTIFY_BLOCK_TOKENS = 1024, /* tokens per block walking them (notify_blocks) */
        NOTIFY_HIST_LOADS = 8,      /* top-k ids in flight per thread of the expert histogram */
        NOTIFY_WARPS = NOTIFY_THREADS / 32
};

enum {
        LAYOUT_THREADS = 256 /* one token per thread */
};

enum {
        COPY_TOPK_THREADS = 256 /* moeep_launch_copy_topk: one top-k entry per thread */
};

enum {
        LL_THREADS = 512,
        LL_WARPS = LL_THREADS / 32,
        LL_SCAN_PAIRS = 4096,       /* low-latency dispatch: pairs whose positions are counted in shared memory */
        LL_NO_EXPERT = 0xffff,      /* ... and the id kept there for a masked pair */
        LL_RECV_PIECE = 64,         /* int4 of a row one warp of the combine receive sums: 512 channels */
        LL_COMBINE_SEND_UNROLL = 8, /* 16-byte loads in flight per lane of the combine send */
        LL_MAX_BLOCKS = 256,        /* blocks of a low-latency launch: one per SM, at most this many */
};

enum {
        PX_THREADS = 512, /* the normal-mode proxy kernels (kernels/normal/proxy.cu) */
        PX_WARPS = PX_THREADS / 32,
        PX_COPY_UNROLL = 4, /* 16-byte loads in flight per lane of px_copy (staged rows into the buffer) */
};

/* ---- Bounded device waits (kernels/common/ptx.cuh). */

/* Spins between the checks of spin_give_up (device memory and the clock). */
#define SPIN_CHECK_EVERY 32
/* The words the daemon sets live in host memory (the abort word, the
 * control page's lost ranks): a PCIe round trip, longer from the other
 * socket, and a read from every waiting thread of every block at once.
 * Read every 32 spins, they made low-latency dispatches wait 2-5 times as
 * long on some hosts (docs/benchmarks.md). A wait reads them only once it
 * has lasted SPIN_HOST_AFTER_NS, then every SPIN_HOST_EVERY_NS: the waits
 * of a healthy call never do, and a failure is still seen within a
 * fraction of a millisecond. */
#define SPIN_HOST_AFTER_NS 200000ull
#define SPIN_HOST_EVERY_NS 100000ull
/* mbarrier waits call spin_give_up once per this many tries. */
#define MBAR_SPINS 64

/* ---- Diagnostics. */

/* $MOEEP_KERNEL_TRACE: globaltimer stamps of the last normal-mode calls:
 * MOEEP_TRACE_STAMPS per block of combine (from word 0) and of dispatch
 * (from MOEEP_TRACE_DISPATCH), for every block a launch may have, then
 * notify's phases (from MOEEP_TRACE_NOTIFY, one block). */
#define MOEEP_TRACE_STAMPS 4
#define MOEEP_TRACE_DISPATCH (MOEEP_KERNEL_MAX_SMS * MOEEP_TRACE_STAMPS)
#define MOEEP_TRACE_NOTIFY (2 * MOEEP_TRACE_DISPATCH)
#define MOEEP_TRACE_NOTIFY_STAMPS 8
#define MOEEP_TRACE_WORDS (MOEEP_TRACE_NOTIFY + MOEEP_TRACE_NOTIFY_STAMPS)

/* ---- Packed words. Each has its pack and unpack helpers below; the
 * fields' widths are checked against the limits. */

#ifdef __CUDACC__
#define MOEEP_HD __host__ __device__ __forceinline__
#else
#define MOEEP_HD static inline
#endif

/* Normal mode, moeep_route.recv_src (and moeep_dispatch_result.recv_src_info,
 * DeepEP's): (source rank << 24) | source token, per received row. */
#define MOEEP_RECV_SRC_RANK_SHIFT 24
#define MOEEP_RECV_SRC_TOKEN_MASK 0xffffff
static_assert(MOEEP_KERNEL_MAX_TOKENS - 1 <= MOEEP_RECV_SRC_TOKEN_MASK, "recv_src: token field too narrow");
static_assert(MOEEP_KERNEL_MAX_RANKS - 1 <= INT32_MAX >> MOEEP_RECV_SRC_RANK_SHIFT, "recv_src: rank field too narrow");

MOEEP_HD int moeep_recv_src_pack(int rank, int token) {
        return (rank << MOEEP_RECV_SRC_RANK_SHIFT) | token;
}

MOEEP_HD int moeep_recv_src_token(int recv_src) {
        return recv_src & MOEEP_RECV_SRC_TOKEN_MASK;
}

MOEEP_HD int moeep_recv_src_rank(int recv_src) {
        return recv_src >> MOEEP_RECV_SRC_RANK_SHIFT;
}

/* Low-latency, moeep_ll_layout.kinfo: (source rank << 8) | k, per slot, for
 * combine to find the row (token, k) of the token's rank. */
#define MOEEP_LL_KINFO_RANK_SHIFT 8
#define MOEEP_LL_KINFO_MASK 0xff
static_assert(MOEEP_KERNEL_MAX_TOPK - 1 <= MOEEP_LL_KINFO_MASK, "kinfo: k field too narrow");
static_assert(MOEEP_KERNEL_MAX_RANKS - 1 <= MOEEP_LL_KINFO_MASK, "kinfo: rank field too narrow");

MOEEP_HD int moeep_ll_kinfo_pack(int rank, int k) {
        return (rank << MOEEP_LL_KINFO_RANK_SHIFT) | k;
}

MOEEP_HD int moeep_ll_kinfo_rank(int kinfo) {
        return (kinfo >> MOEEP_LL_KINFO_RANK_SHIFT) & MOEEP_LL_KINFO_MASK;
}

MOEEP_HD int moeep_ll_kinfo_k(int kinfo) {
        return kinfo & MOEEP_LL_KINFO_MASK;
}

/* Low-latency proxy path, the source info of a staged dispatch pair:
 * (source rank << 28) | (k << 20) | source token, one int32 that the
 * receiver's relay splits into its src and kinfo words. */
#define MOEEP_PX_SRC_RANK_SHIFT 28
#define MOEEP_PX_SRC_RANK_MASK 0xf
#define MOEEP_PX_SRC_K_SHIFT 20
#define MOEEP_PX_SRC_K_MASK 0xff
#define MOEEP_PX_SRC_TOKEN_MASK 0xfffff
static_assert(MOEEP_KERNEL_MAX_RANKS - 1 <= MOEEP_PX_SRC_RANK_MASK, "px source info: rank field too narrow");
static_assert(MOEEP_KERNEL_MAX_TOPK - 1 <= MOEEP_PX_SRC_K_MASK, "px source info: k field too narrow");

MOEEP_HD int moeep_px_src_pack(int rank, int k, int token) {
        return (rank << MOEEP_PX_SRC_RANK_SHIFT) | (k << MOEEP_PX_SRC_K_SHIFT) | token;
}

MOEEP_HD int moeep_px_src_token(int src_info) {
        return src_info & MOEEP_PX_SRC_TOKEN_MASK;
}

MOEEP_HD int moeep_px_src_rank(int src_info) {
        return (src_info >> MOEEP_PX_SRC_RANK_SHIFT) & MOEEP_PX_SRC_RANK_MASK;
}

MOEEP_HD int moeep_px_src_k(int src_info) {
        return (src_info >> MOEEP_PX_SRC_K_SHIFT) & MOEEP_PX_SRC_K_MASK;
}

/* Low-latency, moeep_ll_layout.range (DeepEP's layout_range): the first
 * slot << 32 | the count of slots of each source rank at a local expert. */
MOEEP_HD int64_t moeep_ll_range_pack(int64_t begin, int32_t count) {
        return begin << 32 | (uint32_t)count;
}

#endif
