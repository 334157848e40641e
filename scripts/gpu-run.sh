#!/usr/bin/env bash
# Runs the GPU suite and moeep-bench on a GPU machine from a build folder made
# elsewhere (the device machine lacks some runtime libraries: .libs/, made by
# scripts/gpu-carry.sh, carries them). Usage: scripts/gpu-run.sh BUILD_DIR
# [tests|bench|sweep|all]...
# Logs go to $OUT (or /tmp/moeep-gpu-out).
set -u
B=${1:?build dir}; shift
OUT=${OUT:-/tmp/moeep-gpu-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rc=0
nvidia-smi -L | tee "$OUT/gpus.txt"
for what in "${@:-all}"; do
  case $what in
  tests|all)
    timeout 400 "$B/tests/gpu/ep_normal_test" --ranks "${RANKS:-1,2,4}" 2>&1 | tee "$OUT/tests.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;&
  bench|all)
    timeout 300 "$B/client/bench/moeep-bench" --ranks "${NRANKS:-4}" 2>&1 | tee "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
  sweep)
    timeout 500 "$B/client/bench/moeep-bench" --ranks "${NRANKS:-4}" --sweep --json > "$OUT/bench-sweep.json" 2> "$OUT/bench-sweep.err"
    [ $? = 0 ] || rc=1; tail -5 "$OUT/bench-sweep.err" ;;
  esac
done
exit $rc
