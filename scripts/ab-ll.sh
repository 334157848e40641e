#!/usr/bin/env bash
# A/B of the low-latency kernels' fixed cost (issue 17, branch ll-fixed,
# rebased onto main's spin_until as ll-rebased) on one GPU in one call: base
# (main) against the branch alternated twice, correctness of the branch,
# each commit of the branch once, then (NCU=1) ncu on both; steps that would
# pass $BUDGET seconds (570) are skipped. Builds are made elsewhere (the
# device machine needs no compiler): AB_DIR/base and AB_DIR/c6 hold
# client/bench/moeep-bench, tests/gpu/ep_ll_test, tests/gpu/ep_normal_test,
# client/libmoeep.so.0.1.0 and daemon/moeepd; AB_DIR/c1 .. c5 only
# client/bench/moeep-bench, the branch's commits in order (c6 is its head);
# each may hold a file COMMIT naming the commit it was built from (copied
# into the logs). Run from the repository root with LD_LIBRARY_PATH=$PWD/.libs;
# logs under $OUT, a short table last.
# Usage: scripts/ab-ll.sh AB_DIR
set -u
AB=$(cd "${1:?AB_DIR}" && pwd)
OUT=${OUT:-/tmp/ab-ll-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
D=$AB/base/daemon/moeepd
BUDGET=${BUDGET:-570} # seconds for the whole script: a device command may run 600
rc=0
# A step's timeout: its own bound, or what is left of the budget (0: skip).
bound() {
        local left=$((BUDGET - SECONDS))
        [ $left -gt 10 ] || { echo 0; return; }
        [ "$1" -lt $left ] && echo "$1" || echo $left
}
nvidia-smi -L | tee "$OUT/gpus.txt"
for v in base c1 c2 c3 c4 c5 c6; do
        [ -f "$AB/$v/COMMIT" ] && echo "$v $(cat "$AB/$v/COMMIT")"
done | tee "$OUT/commits.txt"

# Timing first (the figures this call is for), base and branch alternated.
sweep() { # variant run
        local t
        t=$(bound 120)
        [ "$t" = 0 ] && { echo "sweep $1 $2 skipped: out of time"; return; }
        timeout "$t" "$AB/$1/client/bench/moeep-bench" ll --ranks 1 --no-nccl --sweep --moeepd "$D" \
                > "$OUT/sweep-$1-$2.txt" 2>&1 || { echo "sweep $1 $2 failed"; tail -3 "$OUT/sweep-$1-$2.txt"; rc=1; }
}
for run in 1 2; do
        sweep base $run
        sweep c6 $run
done

# Correctness of the branch: low-latency at 1 and 2 ranks (hooks, FP8,
# graphs), across two daemons, normal mode (last_block_done changed), and
# DeepEP's low-latency semantics from Python.
check() { # name timeout command...
        local name=$1 t
        t=$(bound "$2")
        shift 2
        [ "$t" = 0 ] && { echo "check $name skipped: out of time"; rc=1; return; }
        timeout "$t" "$@" > "$OUT/$name.log" 2>&1
        local r=$?
        echo "check $name: exit $r ($(grep -ciE 'fail' "$OUT/$name.log") lines naming a failure)"
        tail -3 "$OUT/$name.log"
        [ $r = 0 ] || [ $r = 77 ] || rc=1 # 77: skipped (no torch)
}
B=$AB/c6
check ll-test 180 "$B/tests/gpu/ep_ll_test" --ranks 1,2
check ll-test-2nodes 180 env MOEEP_HARNESS_NODES=2 "$B/tests/gpu/ep_ll_test" --ranks 2
check normal-test 180 "$B/tests/gpu/ep_normal_test" --ranks 1,2
check deepep-ll 240 env MOEEP_LIBRARY="$B/client/libmoeep.so.0.1.0" MOEEP_TEST_MOEEPD="$B/daemon/moeepd" \
        MOEEP_TEST_PARTS=ll MOEEP_TEST_RANKS=2 python3 tests/gpu/test_deepep_semantics.py

# Each commit of the branch once.
for v in c1 c2 c3 c4 c5; do
        [ -x "$AB/$v/client/bench/moeep-bench" ] && sweep $v 1
done

if [ "${NCU:-0}" = 1 ]; then
        for v in base c6; do
                t=$(bound 200)
                [ "$t" = 0 ] && { echo "ncu $v skipped: out of time"; continue; }
                timeout "$t" ncu --kernel-name-base demangled --kernel-name regex:'moeep_ll::(dispatch|combine)' \
                        --launch-skip 8 --launch-count 4 --section LaunchStats --section Occupancy \
                        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
                        --section SourceCounters -o "$OUT/ncu-$v" \
                        "$AB/$v/client/bench/moeep-bench" ll --ranks 1 --no-nccl --tokens 1 --iters 3 --warmup 2 \
                        --moeepd "$D" > "$OUT/ncu-$v.log" 2>&1
                ncu -i "$OUT/ncu-$v.ncu-rep" --print-summary per-kernel > "$OUT/ncu-$v-summary.txt" 2>&1
                ncu -i "$OUT/ncu-$v.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu-$v-sass.csv" 2>&1
                grep -E 'Duration|Stall|Membar|Barrier' "$OUT/ncu-$v-summary.txt" | head -20
        done
fi

# The table: median us per token count (1 rank: min = median = max).
echo "variant run | tokens: dispatch / combine / both"
for f in "$OUT"/sweep-*.txt; do
        awk -v name="$(basename "$f" .txt)" '
                { op = substr($0, 1, 34); sub(/ +$/, "", op); n = split(substr($0, 35), a, " ") }
                op == "ll dispatch fp8" { d[a[1]] = a[5]; if (!(a[1] in seen)) { seen[a[1]] = 1; order[++n_t] = a[1] } }
                op == "ll combine bf16" { c[a[1]] = a[5] }
                op == "ll dispatch + combine" { b[a[1]] = a[5] }
                END { s = name " |"; for (i = 1; i <= n_t; i++) { t = order[i]; s = s " " t ": " d[t] " / " c[t] " / " b[t] ";" }; print s }' "$f"
done
exit $rc
