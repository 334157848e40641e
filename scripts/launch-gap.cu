/* What two kernels in a row cost on a stream against a CUDA graph, for each
 * way of launching them: the floor under the low-latency step's eager
 * figure (a step is a dispatch and a combine, each a grid of one 512-thread
 * block per SM; docs/benchmarks.md, "Eager against the graph").
 *
 * Each kernel spins `ns` on one thread per block, so a step holds 2 * ns of
 * work; the rest is the gaps. For every combination of cooperative launch,
 * programmatic dependence (the kernel waits for the one before with
 * griddepcontrol.wait and lets the next one be placed at once), and 200 KiB
 * of dynamic shared memory per block (two blocks can then never share an
 * SM), it prints the median step time:
 *   ev/step   back to back, an event pair around every step (DeepEP's bench)
 *   ev/8      back to back, an event pair around every 8 steps (an engine's
 *             loop records none)
 *   graph     a graph of 2 steps replayed, an event pair around each replay
 *   graph/4   the same, an event pair around every 4 replays
 *
 * Build and run on a GPU machine (one GPU, nothing else running on it):
 *   nvcc -O2 -gencode=arch=compute_90,code=sm_90 -o launch-gap scripts/launch-gap.cu
 *   ./launch-gap [SPIN_NS]          (default: 0 and 15000)
 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CHECK(x)                                                                             \
        do {                                                                                 \
                cudaError_t e_ = (x);                                                        \
                if (e_ != cudaSuccess) {                                                     \
                        fprintf(stderr, "launch-gap: %s: %s\n", #x, cudaGetErrorString(e_)); \
                        exit(1);                                                             \
                }                                                                            \
        } while (0)

enum {
        BLOCK_THREADS = 512,    /* the low-latency kernels' block */
        WIDE_SMEM = 200 * 1024, /* dynamic shared memory that keeps one block per SM */
        STEPS = 200             /* event pairs per figure */
};

__device__ __forceinline__ unsigned long long globaltimer_ns(void) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
}

/* One block's share of a step's kernel: wait for the kernel before (when a
 * programmatic dependent), let the next be placed, spin `ns`. */
__global__ void __launch_bounds__(BLOCK_THREADS, 1)
        spin_kernel(unsigned long long ns, int dependent, int *sink) {
        __shared__ char scratch[BLOCK_THREADS];

        if (dependent) {
                asm volatile("griddepcontrol.wait;" ::: "memory");
                asm volatile("griddepcontrol.launch_dependents;");
        }
        if (threadIdx.x == 0 && ns) {
                const unsigned long long t0 = globaltimer_ns();
                while (globaltimer_ns() - t0 < ns) {
                }
        }
        scratch[threadIdx.x] = (char)threadIdx.x;
        __syncthreads();
        if (threadIdx.x == 0 && scratch[5] != 5) /* never: keeps the block's work */
                *sink = 1;
}

struct launch_form {
        int cooperative;
        int dependent;
        size_t smem;
        unsigned long long ns;
};

static int sms, *sink;

static void launch(cudaStream_t s, const struct launch_form &f) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attrs[2] = {};

        cfg.gridDim = dim3((unsigned)sms);
        cfg.blockDim = dim3(BLOCK_THREADS);
        cfg.dynamicSmemBytes = f.smem;
        cfg.stream = s;
        attrs[0].id = cudaLaunchAttributeCooperative;
        attrs[0].val.cooperative = f.cooperative;
        attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[1].val.programmaticStreamSerializationAllowed = f.dependent;
        cfg.attrs = attrs;
        cfg.numAttrs = 2;
        CHECK(cudaLaunchKernelEx(&cfg, spin_kernel, f.ns, f.dependent, sink));
}

static void step(cudaStream_t s, const struct launch_form &f) {
        launch(s, f);
        launch(s, f);
}

/* A replay of `graph` (two steps), or one step. */
static void run(cudaStream_t s, const struct launch_form &f, cudaGraphExec_t graph) {
        if (graph)
                CHECK(cudaGraphLaunch(graph, s));
        else
                step(s, f);
}

/* Median µs per step of `n` samples, each an event pair around `per` steps
 * (or `per` replays of `graph`, two steps each). */
static double series(cudaStream_t s, const struct launch_form &f, int per, int n, cudaGraphExec_t graph) {
        std::vector<cudaEvent_t> start(n), end(n);
        std::vector<double> us(n);

        for (int i = 0; i < n; i++) {
                CHECK(cudaEventCreate(&start[i]));
                CHECK(cudaEventCreate(&end[i]));
        }
        for (int i = 0; i < 20; i++) /* warm-up */
                run(s, f, graph);
        CHECK(cudaStreamSynchronize(s));
        for (int i = 0; i < n; i++) {
                CHECK(cudaEventRecord(start[i], s));
                for (int j = 0; j < per; j++)
                        run(s, f, graph);
                CHECK(cudaEventRecord(end[i], s));
        }
        CHECK(cudaStreamSynchronize(s));
        for (int i = 0; i < n; i++) {
                float ms;
                CHECK(cudaEventElapsedTime(&ms, start[i], end[i]));
                us[i] = ms * 1e3 / per / (graph ? 2 : 1);
                CHECK(cudaEventDestroy(start[i]));
                CHECK(cudaEventDestroy(end[i]));
        }
        std::sort(us.begin(), us.end());
        return us[n / 2];
}

int main(int argc, char **argv) {
        std::vector<unsigned long long> spins = { 0, 15000 };
        cudaStream_t s;

        if (argc > 1)
                spins = { strtoull(argv[1], NULL, 10) };
        CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        CHECK(cudaMalloc(&sink, sizeof(int)));
        CHECK(cudaFuncSetAttribute(spin_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, WIDE_SMEM));
        CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        printf("%d blocks of %d threads per kernel, two kernels per step; median us per step\n", sms,
               BLOCK_THREADS);
        printf("%-11s %-9s %-7s %-8s %9s %9s %9s %9s\n", "cooperative", "dependent", "smem KB", "spin ns",
               "ev/step", "ev/8", "graph", "graph/4");
        for (unsigned long long ns : spins)
                for (size_t smem : { (size_t)0, (size_t)WIDE_SMEM })
                        for (int cooperative = 0; cooperative < 2; cooperative++)
                                for (int dependent = 0; dependent < 2; dependent++) {
                                        const struct launch_form f = { cooperative, dependent, smem, ns };
                                        cudaGraph_t g;
                                        cudaGraphExec_t exec;
                                        const double ev1 = series(s, f, 1, STEPS, NULL);
                                        const double ev8 = series(s, f, 8, STEPS / 5, NULL);

                                        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
                                        step(s, f);
                                        step(s, f);
                                        CHECK(cudaStreamEndCapture(s, &g));
                                        CHECK(cudaGraphInstantiate(&exec, g, 0));
                                        printf("%-11d %-9d %-7zu %-8llu %9.2f %9.2f %9.2f %9.2f\n",
                                               cooperative, dependent, smem / 1024, ns, ev1, ev8,
                                               series(s, f, 1, STEPS / 2, exec),
                                               series(s, f, 4, STEPS / 5, exec));
                                        CHECK(cudaGraphExecDestroy(exec));
                                        CHECK(cudaGraphDestroy(g));
                                }
        return 0;
}
