#!/usr/bin/env bash
# THE main job: installs what is missing, builds moeep into build/, starts
# moeepd on a private socket (embedded default config, no root needed),
# and runs the demo:
#
#   N client processes (default 8) join one job, each registers a memfd region
#   with the daemon, fetches every peer's region through it and checks the
#   contents; while they hold, `moeepctl status`, `jobs` and `clients` show
#   them; then they leave and the daemon is stopped cleanly.
#
# When GPUs are present, the GPU benchmark runs afterwards (see the hook
# below).
#
# Usage: scripts/demo.sh [-n RANKS]
#   -n RANKS       ranks in the job (1..8, default 8)
set -euo pipefail

ranks=8
while [[ $# -gt 0 ]]; do
        case $1 in
        -n | --ranks)
                ranks=${2:?-n needs a number}
                shift 2
                ;;
        -h | --help)
                sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
                exit 0
                ;;
        *)
                echo "demo: unknown argument '$1' (try --help)" >&2
                exit 2
                ;;
        esac
done
if ! [[ $ranks =~ ^[1-8]$ ]]; then
        echo "demo: -n must be 1..8, got '$ranks'" >&2
        exit 2
fi

cd "$(dirname "$0")/.."
source scripts/install-deps.sh

build=build
echo "=== building into $build/"
if [[ -f $build/build.ninja ]]; then
        meson setup --reconfigure "$build" -Dtests=true >/dev/null
else
        rm -rf "$build"
        meson setup "$build" -Dtests=true
fi
meson compile -C "$build"

moeepd=$build/daemon/moeepd
moeepctl=$build/client/moeepctl
rank=$build/tests/e2e/moeep-e2e-rank
for f in "$moeepd" "$moeepctl" "$rank"; do
        [[ -x $f ]] || { echo "demo: $f was not built" >&2; exit 1; }
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moeep-demo.XXXXXX")
sock=$tmp/moeepd.sock
pids=()
daemon_pid=""
cleanup() {
        local p
        for p in "${pids[@]}"; do
                kill -KILL "$p" 2>/dev/null || true
        done
        wait 2>/dev/null || true
        rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

die() {
        echo "demo: FAILED: $*" >&2
        if [[ -s $tmp/moeepd.log ]]; then
                echo "--- moeepd log (last lines)" >&2
                tail -n 30 "$tmp/moeepd.log" >&2
        fi
        exit 1
}

ctl() { timeout 20 "$moeepctl" --socket "$sock" "$@"; }

# alive PID: running and not a zombie (kill -0 says yes to those).
alive() {
        local st
        st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
        [[ -n $st && ${st:0:1} != Z ]]
}

echo "=== starting moeepd on $sock"
"$moeepd" --socket "$sock" --foreground >"$tmp/moeepd.log" 2>&1 &
daemon_pid=$!
pids+=("$daemon_pid")
for ((i = 0; i < 200; i++)); do
        ctl status >/dev/null 2>&1 && break
        alive "$daemon_pid" || die "moeepd exited at start-up"
        sleep 0.05
done
ctl status >/dev/null || die "moeepd does not answer on $sock"

echo "=== $ranks ranks join job 'demo', exchange memfd regions through moeepd and check them"
rank_pids=()
for ((r = 0; r < ranks; r++)); do
        role=--join
        ((r == 0)) && role=--create
        "$rank" --socket "$sock" --id-file "$tmp/job.id" --name demo --world "$ranks" --rank "$r" $role \
                --hold --ready-file "$tmp/ready.$r" --timeout 120 &
        rank_pids+=($!)
        pids+=($!)
done
for ((i = 0; i < 600; i++)); do
        ready=$(find "$tmp" -maxdepth 1 -name 'ready.*' | wc -l)
        ((ready == ranks)) && break
        for p in "${rank_pids[@]}"; do
                alive "$p" || { wait "$p" || true; die "a rank exited before it was ready"; }
        done
        sleep 0.05
done
((ready == ranks)) || die "only $ready of $ranks ranks got ready in 30 s"

echo "=== moeepctl status"
ctl status || die "moeepctl status"
echo "=== moeepctl jobs"
ctl jobs || die "moeepctl jobs"
echo "=== moeepctl clients"
ctl clients || die "moeepctl clients"

echo "=== ranks leave"
for p in "${rank_pids[@]}"; do
        kill -USR1 "$p"
done
for p in "${rank_pids[@]}"; do
        wait "$p" || die "a rank failed"
done

# ---------------------------------------------------------------------------
# HOOK: GPU benchmark. When this machine has GPUs (and the build has CUDA),
# moeep-bench (docs/benchmarks.md: moeep vs the NVLink floor vs NCCL, one run)
# runs here against the same daemon, one rank per GPU (at most 8).
gpu_benchmark() {
        local bench=$build/client/bench/moeep-bench ngpus
        if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
                echo "=== GPU benchmark: no GPU on this machine, skipped"
                return 0
        fi
        if [[ ! -x $bench ]]; then
                echo "=== GPU benchmark: GPUs present, but moeep-bench was not built (no nvcc?), skipped"
                return 0
        fi
        ngpus=$(nvidia-smi -L | grep -c '^GPU')
        ((ngpus > 8)) && ngpus=8
        echo "=== GPU benchmark: moeep-bench on $ngpus GPUs"
        # NVLink multicast stays off (shared GPU hosts).
        NCCL_NVLS_ENABLE=0 "$bench" --ranks "$ngpus" --socket "$sock" &&
                NCCL_NVLS_ENABLE=0 "$bench" ll --ranks "$ngpus" --socket "$sock"
}
gpu_benchmark || die "GPU benchmark"
# ---------------------------------------------------------------------------

echo "=== stopping moeepd"
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
pids=()
[[ $rc -eq 0 ]] || die "moeepd exited with status $rc on SIGTERM"
echo "demo: OK: $ranks ranks exchanged and verified memory regions through moeepd"
