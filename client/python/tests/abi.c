/* Prints the size and field offsets of every structure the ctypes binding
 * (moeep/_lib.py) mirrors, as "struct field offset" and "struct sizeof N"
 * lines, for tests/test_lib.py. With MOEEP_ABI_EP (a CUDA build) the data
 * plane's structures of moeep_ep.h too. With --constants, instead, the
 * C values of the constants that the Python package repeats, as
 * "NAME value" lines: the public ones and the kernels' (kernels/common/params.h,
 * kernels/common/buffers.h, plain C, so also in a build without CUDA). */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "common/buffers.h"
#include "common/params.h"
#include "moeep.h"
#ifdef MOEEP_ABI_EP
#include "moeep_ep.h"
#endif

#define S(s) printf("moeep_" #s " sizeof %zu\n", sizeof(struct moeep_##s))
#define F(s, f) printf("moeep_" #s " " #f " %zu\n", offsetof(struct moeep_##s, f))

#define C(name) printf(#name " %lld\n", (long long)(name))

static void constants(void) {
        C(MOEEP_UNIQUE_ID_BYTES);
        C(MOEEP_MAX_RANKS);
        C(MOEEP_KERNEL_MAX_TOPK);
        C(MOEEP_KERNEL_MAX_EXPERTS);
        C(MOEEP_KERNEL_MAX_TOKENS);
        C(MOEEP_SCALE_BLOCK);
        C(MOEEP_BUFFER_ALIGN);
        C(MOEEP_MAX_RECV_AREAS);
        printf("sizeof_moeep_sync %zu\n", sizeof(struct moeep_sync));
        printf("sizeof_moeep_ll_sync %zu\n", sizeof(struct moeep_ll_sync));
#ifdef MOEEP_ABI_EP
        C(MOEEP_DEFAULT_NUM_SMS);
        C(MOEEP_DEFAULT_TIMEOUT_MS);
        C(MOEEP_LL_MAX_TOKENS);
        C(MOEEP_DEFAULT_SHRINK_TIMEOUT_MS);
#endif
}

int main(int argc, char **argv) {
        if (argc > 1 && strcmp(argv[1], "--constants") == 0) {
                constants();
                return 0;
        }
        S(unique_id);
        F(unique_id, bytes);
        S(event);
        F(event, type);
        F(event, job_id);
        F(event, rank);
        F(event, reason);
#ifdef MOEEP_ABI_EP
        S(ep_config);
        F(ep_config, max_tokens_per_rank);
        F(ep_config, hidden);
        F(ep_config, num_experts);
        F(ep_config, max_topk);
        F(ep_config, num_sms);
        F(ep_config, timeout_ms);
        F(ep_config, ll_max_tokens);
        F(ep_config, recv_areas);
        F(ep_config, ll_shrink);
        F(ep_config, shrink_timeout_ms);
        S(dispatch_args);
        F(dispatch_args, x);
        F(dispatch_args, x_type);
        F(dispatch_args, x_scales);
        F(dispatch_args, num_tokens);
        F(dispatch_args, is_token_in_rank);
        F(dispatch_args, topk_idx);
        F(dispatch_args, topk_idx_type);
        F(dispatch_args, topk_weights);
        F(dispatch_args, num_topk);
        F(dispatch_args, expert_alignment);
        F(dispatch_args, num_worst_tokens);
        F(dispatch_args, handle);
        F(dispatch_args, num_tokens_per_expert);
        F(dispatch_args, total_tokens);
        F(dispatch_args, recv_area);
        F(dispatch_args, x_scales_token_stride);
        F(dispatch_args, x_scales_block_stride);
        S(dispatch_result);
        F(dispatch_result, recv_x);
        F(dispatch_result, recv_x_scales);
        F(dispatch_result, recv_topk_idx);
        F(dispatch_result, recv_topk_weights);
        F(dispatch_result, recv_src_info);
        F(dispatch_result, num_recv_tokens);
        F(dispatch_result, num_recv_tokens_dev);
        F(dispatch_result, num_recv_tokens_per_expert);
        F(dispatch_result, num_recv_tokens_per_expert_dev);
        F(dispatch_result, num_local_experts);
        F(dispatch_result, handle);
        F(dispatch_result, rank_prefix_matrix);
        F(dispatch_result, send_pos);
        F(dispatch_result, max_total_tokens);
        F(dispatch_result, num_recv_tokens_per_rank);
        S(combine_args);
        F(combine_args, x);
        F(combine_args, topk_weights);
        F(combine_args, num_topk);
        F(combine_args, handle);
        F(combine_args, out);
        F(combine_args, out_topk_weights);
        S(ll_hook);
        F(ll_hook, kind);
        F(ll_hook, set);
        F(ll_hook, stats);
        F(ll_hook, topk_idx);
        F(ll_hook, idx_is_int64);
        F(ll_hook, topk_weights);
        F(ll_hook, num_tokens);
        F(ll_hook, num_topk);
        F(ll_hook, out);
        F(ll_hook, slots);
        F(ll_hook, active_ranks);
        F(ll_hook, timeout_us);
        S(ll_handle);
        F(ll_handle, set);
        F(ll_handle, num_tokens);
        F(ll_handle, slots_per_expert);
        S(ll_dispatch_args);
        F(ll_dispatch_args, x);
        F(ll_dispatch_args, num_tokens);
        F(ll_dispatch_args, topk_idx);
        F(ll_dispatch_args, topk_idx_type);
        F(ll_dispatch_args, num_topk);
        F(ll_dispatch_args, use_fp8);
        F(ll_dispatch_args, round_scale);
        F(ll_dispatch_args, return_recv_hook);
        F(ll_dispatch_args, cumulative_local_expert_recv_stats);
        F(ll_dispatch_args, num_max_tokens);
        F(ll_dispatch_args, active_ranks);
        F(ll_dispatch_args, timeout_us);
        S(ll_dispatch_result);
        F(ll_dispatch_result, recv_x);
        F(ll_dispatch_result, recv_x_scales);
        F(ll_dispatch_result, recv_count);
        F(ll_dispatch_result, recv_src_info);
        F(ll_dispatch_result, num_local_experts);
        F(ll_dispatch_result, slots_per_expert);
        F(ll_dispatch_result, handle);
        F(ll_dispatch_result, layout_range);
        F(ll_dispatch_result, combine_buffer);
        S(ll_combine_args);
        F(ll_combine_args, x);
        F(ll_combine_args, topk_idx);
        F(ll_combine_args, topk_idx_type);
        F(ll_combine_args, topk_weights);
        F(ll_combine_args, num_topk);
        F(ll_combine_args, handle);
        F(ll_combine_args, out);
        F(ll_combine_args, return_recv_hook);
        F(ll_combine_args, active_ranks);
        F(ll_combine_args, timeout_us);
#endif
        return 0;
}
