# What the ops-* security tests share: arguments, a private directory, the
# daemon's start and its fd count, bounded waits. Sourced by ops-*.sh.
# shellcheck shell=bash
set -uo pipefail

if [[ $# -ne 4 ]]; then
        echo "usage: $0 MOEEPD MOEEPCTL RANK PROBE" >&2
        exit 2
fi
moeepd=$(realpath "$1") moeepctl=$(realpath "$2") rank=$(realpath "$3") probe=$(realpath "$4")
here=$(dirname "$(realpath "$0")")

test_name=sec-ops
# shellcheck source=../tmpdir.sh
source "$here/../tmpdir.sh"
chmod 0755 "$tmp" # uid 65534 must reach the client socket
sock=$tmp/moeepd.sock
admin=${tmp}-admin/moeepd.sock # proto/admin-socket.h: beside the client socket's directory
log=$tmp/moeepd.log
conf=$tmp/moeepd.conf
daemon_pid=""
phase=start

fail() {
        echo "FAIL [$phase]: $*"
        [[ -s $log ]] && { echo "--- moeepd log"; tail -n 30 "$log"; }
        exit 1
}

# shellcheck source=../wait.sh
source "$here/../wait.sh"
# shellcheck source=../ctl.sh
source "$here/../ctl.sh"

# start_daemon [PREFIX...]: moeepd on $conf, run under PREFIX (prlimit);
# waits for both sockets.
start_daemon() {
        "$@" "$moeepd" --config "$conf" --foreground >"$log" 2>&1 &
        daemon_pid=$!
        pids+=("$daemon_pid")
        wait_until 20 "the client socket" test -S "$sock"
        wait_until 20 "the admin socket" test -S "$admin"
}

# fds: how many descriptors moeepd holds.
fds() { ls "/proc/$daemon_pid/fd" | wc -l; }

# cpu_ticks: user + system clock ticks moeepd used so far.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$daemon_pid/stat"; }

# probe SOCKET COUNT [WHAT]: COUNT round trips, each within 100 ms.
probe() {
        local out
        out=$("$probe" "$1" "$2" 100 "${3:-status}" 2>&1) || fail "a well-behaved client on $1: $out"
        echo "$out"
}

stop_daemon() {
        kill -TERM "$daemon_pid"
        wait_until 15 "moeepd to exit" eval '! kill -0 "$daemon_pid" 2>/dev/null || grep -q "^Z" <(sed "s/.*) //" /proc/$daemon_pid/stat 2>/dev/null)'
        wait "$daemon_pid"
        local rc=$?
        [[ $rc -eq 0 ]] || fail "moeepd exited $rc after SIGTERM"
}

[[ $(id -u) -eq 0 ]] || { echo "skip: needs root (uids switch, root-on-the-client-socket attacks)"; exit 77; }
command -v setpriv >/dev/null || { echo "skip: needs setpriv"; exit 77; }
