#!/usr/bin/env bash
# A GPU suite across two daemons on this host joined by the cuda transport
# (the GPUDirect path: proxy regions in GPU memory, the daemons' copy
# engines as the NIC), then proof from the daemons' own byte counters that
# no payload byte went through host memory.
#
#   cuda-transport.sh [--failures] TEST [ARGS...]
#
# --failures: TEST kills ranks and daemons (ep_fail_test): a killed daemon
# logs no totals, so only "0 bytes through host memory" is required of the
# daemons that did.
#
# Runs TEST with MOEEP_HARNESS_NODES=2 MOEEP_HARNESS_TRANSPORT=cuda and
# MOEEP_PX_MEMORY=gpu (a rank that cannot use GPU memory fails instead of
# falling back), keeps its output, and then requires: TEST exited 0 (77,
# no GPU, is passed on as a skip); no daemon ran without its data path;
# every daemon that stopped cleanly logged "transport cuda totals" with 0
# bytes through client host memory, and together they copied more than 0
# bytes device to device.
set -uo pipefail

failures=0
if [[ ${1:-} == --failures ]]; then
        failures=1
        shift
fi
if [[ $# -lt 1 ]]; then
        echo "usage: $0 [--failures] TEST [ARGS...]" >&2
        exit 2
fi
out=$(mktemp "${TMPDIR:-/tmp}/moeep-cuda-transport.XXXXXX")
trap 'rm -f "$out"' EXIT

MOEEP_HARNESS_NODES=2 MOEEP_HARNESS_TRANSPORT=cuda MOEEP_PX_MEMORY=gpu "$@" 2>&1 | tee "$out"
st=${PIPESTATUS[0]}
((st == 77)) && exit 77
((st == 0)) || { echo "FAIL: $* exited $st"; exit 1; }

if ((failures == 0)) && grep -q "has no internode data path" "$out"; then
        echo "FAIL: a daemon ran without its data path:"
        grep "has no internode data path" "$out" | head -3
        exit 1
fi
lines=$(grep -c "datapath: transport cuda totals:" "$out")
((lines > 0 || failures)) || { echo "FAIL: no daemon logged its transport totals"; exit 1; }
host=$(grep -oE "[0-9]+ bytes through client host memory" "$out" | awk '{s += $1} END {print s + 0}')
device=$(grep -oE "[0-9]+ bytes device-to-device" "$out" | awk '{s += $1} END {print s + 0}')
((host == 0)) || { echo "FAIL: $host payload bytes went through host memory"; exit 1; }
((device > 0 || failures)) || { echo "FAIL: no byte was copied device to device"; exit 1; }
echo "ok: $lines daemon totals: $device bytes device-to-device, 0 through host memory"
