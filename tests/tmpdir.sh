# The private directory of a shell test and the processes it starts in the
# background (e2e.sh, ops.sh, mesh/lib.sh, security/ops-lib.sh). Sourced
# with test_name set, it makes $tmp, a new directory
# moeep-$test_name.XXXXXX under $TMPDIR (or /tmp), and the array pids, to
# which the test adds every process it starts. On any exit each process in
# pids and in daemon_pid (one pid, or an array of them, where the test
# has it) is killed with SIGKILL and reaped, and $tmp is removed with
# ${tmp}-admin, where a daemon with its client socket in $tmp puts its admin
# socket (proto/admin-socket.h); INT and TERM exit with 130.
# shellcheck shell=bash

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moeep-$test_name.XXXXXX")
pids=()

cleanup() {
        local p all=("${pids[@]}")
        if declare -p daemon_pid &>/dev/null; then
                all+=("${daemon_pid[@]}")
        fi
        for p in "${all[@]}"; do
                [[ -n $p ]] && kill -KILL "$p" 2>/dev/null
        done
        for p in "${all[@]}"; do
                [[ -n $p ]] && wait "$p" 2>/dev/null
        done
        rm -rf "$tmp" "${tmp}-admin"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
