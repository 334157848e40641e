/* Offsets inside the NVLink buffer; see buffers.h. */
#include "common/buffers.h"

static size_t align_up(size_t v, size_t a) {
        return (v + a - 1) / a * a;
}

void moeep_buffer_layout_compute(struct moeep_buffer_layout *l, int ranks, int max_tokens, int hidden, int max_topk,
                                 int areas) {
        size_t rows = (size_t)ranks * (size_t)max_tokens;
        size_t off = 0;

        /* MOEEP_BUFFER_ALIGN (4 KiB) keeps every array 16-byte aligned for
         * vector stores and separates the flags from the payload. */
#define PLACE(field, bytes)                                        \
        do {                                                       \
                l->field = off;                                    \
                off = align_up(off + (bytes), MOEEP_BUFFER_ALIGN); \
        } while (0)
        PLACE(sync, sizeof(struct moeep_sync));
        PLACE(recv_x, rows * (size_t)hidden * 2);
        PLACE(recv_scales, rows * (size_t)(hidden / MOEEP_SCALE_BLOCK) * sizeof(float));
        PLACE(recv_topk_idx, rows * (size_t)max_topk * sizeof(int64_t));
        PLACE(recv_topk_weights, rows * (size_t)max_topk * sizeof(float));
        PLACE(recv_src, rows * sizeof(int32_t));
        /* The other receive areas repeat area 0's arrays; every offset
         * stays a multiple of MOEEP_BUFFER_ALIGN. */
        l->areas = areas < 1 ? 1 : areas;
        l->area_bytes = off - l->recv_x;
        off += (size_t)(l->areas - 1) * l->area_bytes;
        PLACE(comb_x, rows * (size_t)hidden * 2);
        PLACE(comb_weights, rows * (size_t)max_topk * sizeof(float));
#undef PLACE
        l->total = off;
}

void moeep_ll_layout_compute(struct moeep_ll_layout *l, size_t start, int ranks, int max_tokens, int hidden,
                             int num_experts, int max_topk) {
        size_t slots = (size_t)num_experts * (size_t)max_tokens; /* local experts x ranks x max_tokens */
        size_t off = align_up(start, MOEEP_BUFFER_ALIGN);

        *l = (struct moeep_ll_layout){ .max_tokens = max_tokens };
        if (max_tokens == 0) {
                l->total = start;
                return;
        }
#define PLACE(field, bytes)                                        \
        do {                                                       \
                l->field = off;                                    \
                off = align_up(off + (bytes), MOEEP_BUFFER_ALIGN); \
        } while (0)
        PLACE(sync, sizeof(struct moeep_ll_sync));
        for (int b = 0; b < 2; b++) {
                PLACE(x[b], slots * (size_t)hidden * 2);
                PLACE(scales[b], slots * (size_t)(hidden / MOEEP_SCALE_BLOCK) * sizeof(float));
                PLACE(src[b], slots * sizeof(int32_t));
                PLACE(kinfo[b], slots * sizeof(int32_t));
                PLACE(range[b], (size_t)num_experts * sizeof(int64_t)); /* local experts x ranks */
                PLACE(comb[b], (size_t)max_tokens * (size_t)max_topk * (size_t)hidden * 2);
                PLACE(ref[b], (size_t)max_tokens * (size_t)max_topk * sizeof(int32_t));
                PLACE(pair_slot[b], (size_t)ranks * (size_t)max_tokens * (size_t)max_topk * sizeof(uint64_t));
                PLACE(weights[b], (size_t)ranks * (size_t)max_tokens * (size_t)max_topk * sizeof(float));
                PLACE(tok[b], (size_t)ranks * (size_t)max_tokens * MOEEP_LL_TOK_ROW(hidden));
        }
#undef PLACE
        l->total = off;
}

void moeep_px_layout_compute(struct moeep_px *px, int ranks, int max_tokens, int num_experts,
                             const struct moeep_ll_layout *ll, int hidden, int max_topk) {
        size_t off = 0;

        px->nm_pair = align_up((size_t)hidden * 2 + (size_t)(hidden / MOEEP_SCALE_BLOCK) * sizeof(float) +
                                       (size_t)max_topk * (sizeof(int64_t) + sizeof(float)) + sizeof(int32_t),
                               16);
        px->nm_row = align_up((size_t)hidden * 2 + (size_t)max_topk * sizeof(float) + sizeof(int32_t), 16);
        px->nm_sync_seg = align_up(MOEEP_PX_SEG_HDR + (size_t)(ranks + num_experts / ranks + 1) * sizeof(int32_t),
                                   MOEEP_BUFFER_ALIGN);
        px->nm_dispatch_seg = align_up(MOEEP_PX_SEG_HDR + (size_t)max_tokens * px->nm_pair, MOEEP_BUFFER_ALIGN);
        px->nm_combine_seg = align_up(MOEEP_PX_SEG_HDR + (size_t)max_tokens * px->nm_row, MOEEP_BUFFER_ALIGN);
        px->nm_sync = off;
        off += (size_t)ranks * px->nm_sync_seg;
        px->nm_dispatch = off;
        off += (size_t)ranks * px->nm_dispatch_seg;
        px->nm_combine = off;
        off += (size_t)ranks * px->nm_combine_seg;

        px->ll_slots = (uint32_t)(ll->max_tokens * max_topk);
        /* Dispatch: row (bf16 size, FP8 rows use half), scales, local expert and source info. */
        px->ll_pair = align_up((size_t)hidden * 2 + (size_t)(hidden / MOEEP_SCALE_BLOCK) * sizeof(float) + 8, 16);
        px->ll_row = (size_t)hidden * 2 + 16; /* combine: bf16 row, token, k */
        px->ll_dispatch_seg =
                align_up(MOEEP_PX_SEG_HDR + MOEEP_PX_LL_COUNTS + px->ll_slots * px->ll_pair, MOEEP_BUFFER_ALIGN);
        px->ll_combine_seg = align_up(MOEEP_PX_SEG_HDR + px->ll_slots * px->ll_row, MOEEP_BUFFER_ALIGN);
        for (int b = 0; b < 2; b++) {
                px->ll_dispatch[b] = off;
                off += (size_t)ranks * px->ll_dispatch_seg;
                px->ll_combine[b] = off;
                off += (size_t)ranks * px->ll_combine_seg;
        }
        px->ll_clean = off;
        off += align_up((size_t)ranks * MOEEP_PX_SEG_HDR, MOEEP_BUFFER_ALIGN);
        px->bytes = off;
}
