/* What every host launcher of kernels/ uses: the launch checks, the
 * switch over the top-k ids' type and the launch that may be cooperative.
 * Host code of the .cu files only; the launchers themselves are declared in
 * kernels.h (bench/bench_kernels.h for the benchmarks'). */
#pragma once

#include <stdint.h>

#include <utility>

#include <cuda_runtime.h>

#include "common/coop.cuh"

/* Launchers call this before a launch: cudaGetLastError() also returns
 * errors of earlier runtime calls, which are not ours to report. */
#define MOEEP_CUDA_LAUNCH_BEGIN() (void)cudaGetLastError()

/* After the launch: returns its error from the launcher (a cudaError_t as
 * an int, see kernels.h). */
#define MOEEP_CUDA_LAUNCH_CHECK()                    \
        do {                                         \
                cudaError_t e_ = cudaGetLastError(); \
                if (e_ != cudaSuccess)               \
                        return (int)e_;              \
        } while (0)

/* The kernels that read top-k ids are templates over their type, int64_t
 * (DeepEP's) or int32_t, which the caller says at run time: calls f with a
 * value of the type (f(int64_t()) when idx_is_int64, else f(int32_t())),
 * so that f instantiates its kernel for both, and returns what f returns.
 * In f, `using Idx = decltype(idx);` names the type. */
template <typename F> static auto with_index_type(bool idx_is_int64, F &&f) {
        return idx_is_int64 ? f(int64_t()) : f(int32_t());
}

/* Launches kernel(args...) on `blocks` blocks of `threads` threads with
 * `smem` bytes of dynamic shared memory. Cooperative when `cooperative`:
 * every block is then resident at once, so that blocks may wait for each
 * other, and the runtime refuses a grid that cannot be
 * (cudaErrorCooperativeLaunchTooLarge, or cudaErrorNotSupported where the
 * device has no cooperative launches) rather than run it. With `after`, a
 * programmatic dependent of the kernel before it in the stream: its blocks
 * may be placed while that kernel runs (once it called grid_dep_launch,
 * ptx.cuh), which hides the launch gap; the kernel must call grid_dep_wait
 * before it touches memory the kernel before writes. Returns the launch's
 * error. */
template <typename... Params, typename... Args>
static cudaError_t launch_kernel(void (*kernel)(Params...), unsigned blocks, unsigned threads, size_t smem,
                                 cudaStream_t stream, bool cooperative, bool after, Args &&...args) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attrs[2] = {};

        attrs[0].id = cudaLaunchAttributeCooperative;
        attrs[0].val.cooperative = cooperative;
        attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[1].val.programmaticStreamSerializationAllowed = after;
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = stream;
        cfg.attrs = attrs;
        cfg.numAttrs = 2;
        return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

/* Runs one call of a low-latency operation: launch(phases, cooperative),
 * where launch(p, c) launches the kernel for phases p (`send`, `recv`, or
 * both bits), cooperatively when c. With both phases and `waits` (every
 * block of the launch then waits for every other rank's blocks) the
 * launch is cooperative or plain as coop_choose says (common/coop.cuh);
 * otherwise plain, its stream noted (its phases wait for the other ranks
 * too). Where the runtime refuses a cooperative launch (too few SMs free
 * for the grid, or no cooperative launches here), one launch per phase,
 * send then receive: the same results, one launch more. Returns the
 * launches' error. */
template <typename F>
static cudaError_t launch_phases(const struct moeep_ctx *ctx, cudaStream_t stream, F &&launch, int phases, int send,
                                 int recv, bool waits) {
        const bool whole = waits && phases == (send | recv);
        struct coop_choice coop = { -1, 0, false };

        if (whole)
                coop = coop_choose(ctx, stream);
        else
                coop_note(stream);
        cudaError_t e = launch(phases, coop.cooperative);
        if (whole)
                coop_done(coop, e);
        if ((e == cudaErrorCooperativeLaunchTooLarge || e == cudaErrorNotSupported) && phases == (send | recv)) {
                (void)cudaGetLastError();
                e = launch(send, false);
                if (e == cudaSuccess)
                        e = launch(recv, false);
        }
        return e;
}
