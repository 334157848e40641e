/* Layout: which ranks and experts each token goes to (DeepEP's
 * get_dispatch_layout), computed on the GPU from topk_idx. */
#include "common/launch.cuh"
#include "common/ptx.cuh"
#include "kernels.h"

/* One thread per token. Counts are accumulated per block in shared memory
 * and then added to the (zeroed) outputs with one atomic per block and bin. */
template <typename Idx>
__global__ void __launch_bounds__(LAYOUT_THREADS)
        layout_kernel(const Idx *topk_idx, int num_tokens, int num_topk, int num_experts, int ranks, int *per_rank,
                      int *per_expert, uint8_t *in_rank) {
        __shared__ int s_rank[MOEEP_KERNEL_MAX_RANKS];
        __shared__ int s_expert[MOEEP_KERNEL_MAX_EXPERTS];
        int experts_per_rank = num_experts / ranks;
        int t = blockIdx.x * blockDim.x + threadIdx.x;

        for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
                s_expert[i] = 0;
        if (threadIdx.x < MOEEP_KERNEL_MAX_RANKS)
                s_rank[threadIdx.x] = 0;
        __syncthreads();

        if (t < num_tokens) {
                uint32_t mask = 0;

                for (int k = 0; k < num_topk; k++) {
                        int64_t e = (int64_t)topk_idx[(size_t)t * num_topk + k];

                        if (e < 0 || e >= num_experts)
                                continue; /* -1 = masked; the API rejects other values */
                        atomicAdd(&s_expert[e], 1);
                        mask |= 1u << (e / experts_per_rank);
                }
                for (int r = 0; r < ranks; r++) {
                        in_rank[(size_t)t * ranks + r] = (mask >> r) & 1;
                        if ((mask >> r) & 1)
                                atomicAdd(&s_rank[r], 1);
                }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
                if (s_expert[i])
                        atomicAdd(&per_expert[i], s_expert[i]);
        if (threadIdx.x < ranks && s_rank[threadIdx.x])
                atomicAdd(&per_rank[threadIdx.x], s_rank[threadIdx.x]);
}

extern "C" int moeep_launch_layout(const void *topk_idx, int idx_is_int64, int num_tokens, int num_topk,
                                   int num_experts, int ranks, int *num_tokens_per_rank, int *num_tokens_per_expert,
                                   uint8_t *is_token_in_rank, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        cudaError_t e;

        if ((e = cudaMemsetAsync(num_tokens_per_rank, 0, sizeof(int) * ranks, stream)) != cudaSuccess)
                return (int)e;
        if ((e = cudaMemsetAsync(num_tokens_per_expert, 0, sizeof(int) * num_experts, stream)) != cudaSuccess)
                return (int)e;
        if (num_tokens == 0)
                return 0;
        int blocks = (num_tokens + LAYOUT_THREADS - 1) / LAYOUT_THREADS;
        with_index_type(idx_is_int64, [&](auto idx) {
                using Idx = decltype(idx);
                layout_kernel<Idx><<<blocks, LAYOUT_THREADS, 0, stream>>>((const Idx *)topk_idx, num_tokens, num_topk,
                                                                          num_experts, ranks, num_tokens_per_rank,
                                                                          num_tokens_per_expert, is_token_in_rank);
        });
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
