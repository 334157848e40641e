#!/usr/bin/env bash
# One device call that checks and measures what the issues ask for, with
# a budget: the GPU suites, DeepEP 1.2.1's own tests against moeep and the
# real DeepEP built on the same machine, moeep-bench before and after, and
# the engine-path benchmark (python -m moeep.bench) for moeep and DeepEP.
# Steps that would pass the budget are skipped (and said so). Builds are
# made elsewhere and bundled (scripts/gpu-bundle.sh); DeepEP's source and
# tests are third-party and come from outside the repository.
#
# Usage (from the repository root, on the GPU machine):
#   scripts/gpu-session.sh NEW_BUNDLE [BASE_BUNDLE] [STEPS]
# Environment:
#   DEEPEP_SRC    DeepEP 1.x source (built in the background when set)
#   DEEPEP_TESTS  its tests/ folder (test_intranode.py, test_low_latency.py, utils.py)
#   DEEPEP_COMPAT the deepep-compat runner folder (run.sh)
#   BUDGET        seconds for the whole script (default 560)
#   RANKS         rank counts to measure (default: 2, and 4 when 4 GPUs are there)
# STEPS: a comma list of bench,pybench,suites,shrink,deepep (the default),
# sweep (moeep-bench's token and SM sweeps at the largest rank count),
# suites-more, shrink-more (the slower rest). While DeepEP builds (it takes
# every core for about two minutes) only the suites run: no figure is taken
# beside a compiler. Logs under $OUT (one tarball, logs.tgz, and summary.txt).
set -u
NEW=$(cd "${1:?NEW_BUNDLE}" && pwd)
BASE=${2:+$(cd "$2" && pwd)}
STEPS=${3:-bench,pybench,suites,shrink,deepep}
OUT=${OUT:-/tmp/moeep-gpu-session}
L=$OUT/logs
mkdir -p "$L"
export LD_LIBRARY_PATH=$PWD/.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUDGET=${BUDGET:-560}
NGPU=$(nvidia-smi -L | wc -l)
RANKS=${RANKS:-$([ "$NGPU" -ge 4 ] && echo "2 4" || echo 2)}
S=$OUT/summary.txt
nvidia-smi -L | tee "$L/gpus.txt" > "$S"
nvidia-smi topo -m >> "$L/gpus.txt" 2>&1
has() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# run NAME SECONDS CMD...: one step, bounded by its own limit and what is
# left of the budget; a line in the summary either way.
run() {
        local name=$1 lim=$2 left=$((BUDGET - SECONDS)) t0=$SECONDS rc
        shift 2
        if [ $left -lt 15 ]; then
                echo "SKIP $name (budget)" | tee -a "$S"
                return 0
        fi
        [ "$lim" -lt "$left" ] || lim=$left
        timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1
        rc=$?
        echo "$([ $rc = 0 ] && echo ok || echo "FAIL rc=$rc") $name $((SECONDS - t0))s" | tee -a "$S"
}

if [ -n "${DEEPEP_SRC:-}" ] && { has deepep || has pybench; }; then
        # The real DeepEP, built while the suites run.
        ( setsid bash "$DEEPEP_COMPAT/build-deepep.sh" "$DEEPEP_SRC" /tmp/deepep-build > "$L/deepep-build.log" 2>&1 ) &
        BUILD_PID=$!
fi
export MOEEP_LIBRARY=$NEW/client/libmoeep.so MOEEP_TEST_MOEEPD=$NEW/daemon/moeepd
T=$NEW/tests/gpu
two=$([ "$NGPU" -ge 4 ] && echo 2,4 || echo 2)

# The steps, each a function; the order is below.
figures() {
        if has bench; then
                for r in $RANKS; do
                        run "bench_new_$r" 90 "$NEW/client/bench/moeep-bench" --ranks "$r"
                        [ -z "$BASE" ] || run "bench_base_$r" 90 "$BASE/client/bench/moeep-bench" --ranks "$r" --no-nccl
                        run "bench_ll_new_$r" 90 "$NEW/client/bench/moeep-bench" ll --ranks "$r"
                        [ -z "$BASE" ] || run "bench_ll_base_$r" 90 "$BASE/client/bench/moeep-bench" ll --ranks "$r" --no-nccl
                done
        fi
        if has pybench; then
                for r in $RANKS; do
                        PYTHONPATH=$PWD/client/python run "pybench_moeep_$r" 120 \
                                python3 -m moeep.bench --ranks "$r" --moeepd "$NEW/daemon/moeepd"
                done
        fi
        if has sweep; then
                run "sweep_$TOP" 150 "$NEW/client/bench/moeep-bench" --ranks "$TOP" --sweep --no-nccl
                run "sweep_ll_$TOP" 90 "$NEW/client/bench/moeep-bench" ll --ranks "$TOP" --sweep --no-nccl
        fi
}
suites() {
        if has suites; then
                run normal_test 120 "$T/ep_normal_test" --ranks "1,$two"
                run ll_test 120 "$T/ep_ll_test" --ranks "$two"
                MOEEP_HARNESS_NODES=2 run fail_2nodes 150 "$T/ep_fail_test" --ranks 4
                run ll_cuda2nodes 150 bash tests/gpu/cuda-transport.sh "$T/ep_ll_test" --ranks 2
                run python_buffer 200 python3 tests/gpu/test_python_buffer.py --ranks "$two"
        fi
        if has shrink && [ -x "$T/ep_shrink_test" ]; then
                run shrink_test 150 "$T/ep_shrink_test" --ranks "$two"
                MOEEP_HARNESS_NODES=2 run shrink_2nodes 150 "$T/ep_shrink_test" --ranks "$two"
                run shrink_cuda2nodes 150 bash tests/gpu/cuda-transport.sh "$T/ep_shrink_test" --ranks 2
        fi
}
deepep() {
        has deepep || return 0
        for r in $RANKS; do
                # The real DeepEP, its own tests at their default sizes, then moeep by the same files.
                (cd "$DEEPEP_TESTS" && PYTHONPATH=/tmp/deepep-build MASTER_ADDR=127.0.0.1 WORLD_SIZE=1 RANK=0 \
                        MASTER_PORT=$((29600 + r)) run "deepep_intranode_$r" 150 python3 test_intranode.py --num-processes "$r")
                (cd "$DEEPEP_TESTS" && PYTHONPATH=/tmp/deepep-build MASTER_ADDR=127.0.0.1 WORLD_SIZE=1 RANK=0 \
                        MASTER_PORT=$((29700 + r)) run "deepep_ll_$r" 150 python3 test_low_latency.py --num-processes "$r")
                run "moeep_deepep_$r" 240 bash "$DEEPEP_COMPAT/run.sh" -n "$r" --moeep-python "$PWD/client/python" \
                        "$NEW" "$DEEPEP_TESTS" "$L/moeep_deepep_$r"
                PYTHONPATH=/tmp/deepep-build:$PWD/client/python run "pybench_deepep_$r" 120 \
                        python3 -m moeep.bench --impl deep_ep --ranks "$r"
        done
}
more() {
        if has suites-more; then
                run fail_test 150 "$T/ep_fail_test" --ranks "$two"
                run deepep_semantics 200 python3 tests/gpu/test_deepep_semantics.py
                MOEEP_HARNESS_NODES=2 run normal_2nodes 120 "$T/ep_normal_test" --ranks "$two"
                MOEEP_HARNESS_NODES=2 run ll_2nodes 120 "$T/ep_ll_test" --ranks "$two"
                run normal_cuda2nodes 150 bash tests/gpu/cuda-transport.sh "$T/ep_normal_test" --ranks 2
                MOEEP_HARNESS_GPUS=1 run shared_normal 150 "$T/ep_normal_test" --ranks 2,4
                MOEEP_HARNESS_GPUS=1 run shared_ll 150 "$T/ep_ll_test" --ranks 2,4
                MOEEP_HARNESS_GPUS=1 run shared_shrink 150 "$T/ep_shrink_test" --ranks 2,4
                run python_buffer_shared 200 python3 tests/gpu/test_python_buffer.py --gpus 1 --ranks 2,4
                if [ -n "${DEEPEP_COMPAT:-}" ]; then
                        for n in 2 4; do
                                run "moeep_deepep_shared_$n" 200 bash "$DEEPEP_COMPAT/run.sh" --one-gpu -n "$n" \
                                        --mps off --moeep-python "$PWD/client/python" "$NEW" "$DEEPEP_TESTS" \
                                        "$L/moeep_deepep_shared_$n"
                        done
                fi
        fi
        if has shrink-more && [ -x "$T/ep_shrink_test" ]; then
                run python_shrink 150 python3 tests/gpu/test_python_shrink.py --ranks "$two"
                run deepep_shrink 150 bash "$DEEPEP_COMPAT/run.sh" --one-gpu -n 8 --mps off --tests low_latency \
                        --moeep-python "$PWD/client/python" --ll-args \
                        "--num-tokens 128 --hidden 2048 --num-topk 8 --num-experts 64 --shrink-test" "$NEW" "$DEEPEP_TESTS" \
                        "$L/deepep_shrink"
        fi
}
# Waits for the DeepEP build (what is left of the budget less 30 s); drops
# the DeepEP steps when it failed.
await_build() {
        [ -n "${BUILD_PID:-}" ] || return 0
        local left=$((BUDGET - SECONDS - 30))
        while kill -0 "$BUILD_PID" 2>/dev/null && [ $left -gt 0 ]; do sleep 2; left=$((left - 2)); done
        if ls /tmp/deepep-build/deep_ep_cpp*.so > /dev/null 2>&1; then
                echo "ok deepep-build $(tail -1 "$L/deepep-build.log")" | tee -a "$S"
        else
                echo "FAIL deepep-build" | tee -a "$S"
                STEPS=${STEPS//deepep/}
        fi
        BUILD_PID=
}

TOP=${RANKS##* }
if [ -n "${BUILD_PID:-}" ]; then
        # The suites while DeepEP builds, the figures after.
        suites
        await_build
        figures
else
        figures
        suites
fi
deepep
more
# The lines the issues quote, from every log.
for f in "$L"/deepep_*.log "$L"/moeep_deepep_*/test_*.log; do
        [ -f "$f" ] || continue
        echo "--- $f" >> "$S"
        grep -hE "Best (dispatch|combine)|Dispatch \+ combine bandwidth|Dispatch bandwidth|Dispatch send" "$f" >> "$S"
done
for f in "$L"/bench_*.log "$L"/sweep_*.log "$L"/pybench_*.log; do
        [ -f "$f" ] || continue
        echo "--- $f" >> "$S"
        grep -hE "^(dispatch|combine|ll |nvlink)|^(figure|LL|dispatch|combine)" "$f" >> "$S"
done
tail -q -n 2 "$L"/*.log 2>/dev/null | grep -E "passed|failed|OK" >> "$S"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
cat "$S"
