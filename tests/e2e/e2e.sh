#!/usr/bin/env bash
# End-to-end test with the real moeepd on a private socket.
#
#   e2e.sh MOEEPD MOEEPCTL RANK [WORLD]
#
# 1. moeepd binds its own socket (--socket): a fake NOTIFY_SOCKET must see
#    READY=1; WORLD ranks (default 8) create/join a job, pass memfd regions
#    through the daemon and check every peer's contents; an outsider must be
#    refused every way it tries; while the ranks hold, moeepctl status, jobs
#    and clients (human and --json) show them and never the job's secret;
#    SIGTERM stops the daemon cleanly (exit 0, STOPPING=1).
# 2. The same under `systemd-socket-activate --seqpacket` (sd_listen_fds).
# 3. moeepctl with no daemon listening exits non-zero with a message.
#
# Everything it starts is killed and its temp dir removed on any exit; every
# wait is bounded.
set -uo pipefail

if [[ $# -lt 3 ]]; then
        echo "usage: $0 MOEEPD MOEEPCTL RANK [WORLD]" >&2
        exit 2
fi
moeepd=$(realpath "$1") moeepctl=$(realpath "$2") rank=$(realpath "$3") world=${4:-8}
here=$(dirname "$(realpath "$0")")
listen=$here/notify-listen.py
check=$here/ctl-check.py

test_name=e2e
# shellcheck source=../tmpdir.sh
source "$here/../tmpdir.sh" # $tmp, and pids: every background process this script started
daemon_pid=""               # the current moeepd (or systemd-socket-activate that becomes it)
daemon_log=""
phase="start"

fail() {
        echo "FAIL [$phase]: $*"
        if [[ -n $daemon_log && -s $daemon_log ]]; then
                echo "--- last lines of the moeepd log ($daemon_log)"
                tail -n 40 "$daemon_log"
        fi
        for f in "$tmp"/rank*.log "$tmp"/outsider.log; do
                [[ -s $f ]] && { echo "--- $(basename "$f")"; tail -n 10 "$f"; }
        done
        exit 1
}

# shellcheck source=../wait.sh
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../wait.sh"

# alive PID: running, and not a zombie waiting to be reaped (kill -0 says
# yes to those).
alive() {
        local st
        st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
        [[ -n $st && ${st:0:1} != Z ]]
}

# Sanitizer settings travel through systemd-socket-activate only with -E.
sanitizer_env=()
for v in ASAN_OPTIONS UBSAN_OPTIONS LSAN_OPTIONS MSAN_OPTIONS; do
        [[ -n ${!v:-} ]] && sanitizer_env+=(-E "$v")
done

# start_listener NAME: a fake NOTIFY_SOCKET at $tmp/NAME.notify, logging to
# $tmp/NAME.notify.log.
start_listener() {
        local log=$tmp/$1.notify.log
        python3 "$listen" "$tmp/$1.notify" "$log" 300 &
        pids+=($!)
        wait_until 10 "the notify listener" grep -q '^LISTENING$' "$log"
}

notified() { grep -q "$2" "$tmp/$1.notify.log"; }

# stop_daemon NAME: SIGTERM, then it must exit 0 within 15 s and have sent
# STOPPING=1.
stop_daemon() {
        local rc
        alive "$daemon_pid" || fail "moeepd (pid $daemon_pid) died before SIGTERM"
        kill -TERM "$daemon_pid"
        wait_until 15 "moeepd to exit after SIGTERM" eval '! alive "$daemon_pid"'
        wait "$daemon_pid"
        rc=$?
        [[ $rc -eq 0 ]] || fail "moeepd exited with status $rc after SIGTERM, want 0"
        notified "$1" '^STOPPING=1' || fail "the notify socket never got STOPPING=1"
        echo "ok: moeepd stopped cleanly on SIGTERM (exit 0, STOPPING=1)"
        daemon_pid=""
}

# ctl NAME ARGS...: runs moeepctl against $sock, output in $tmp/ctl-NAME.out.
ctl() {
        local name=$1 rc
        shift
        timeout 20 "$moeepctl" --socket "$sock" "$@" >"$tmp/ctl-$name.out" 2>"$tmp/ctl-$name.err"
        rc=$?
        if [[ $rc -ne 0 ]]; then
                cat "$tmp/ctl-$name.out" "$tmp/ctl-$name.err"
                fail "moeepctl $* exited with status $rc"
        fi
}

# run_job TAG: the job, the outsider and moeepctl checks against $sock.
run_job() {
        local tag=$1 name=e2e-$1 r i rc
        local -a rank_pids=()
        local idfile=$tmp/$tag.id

        for ((r = 0; r < world; r++)); do
                local role=--join
                ((r == 0)) && role=--create
                "$rank" --socket "$sock" --id-file "$idfile" --name "$name" --world "$world" --rank "$r" \
                        $role --hold --ready-file "$tmp/$tag.ready.$r" --timeout 90 \
                        >"$tmp/rank$r.log" 2>&1 &
                rank_pids+=($!)
                pids+=($!)
        done
        # Every rank verified every peer's region and now holds.
        for ((i = 0; i < 600; i++)); do
                local ready=0
                for ((r = 0; r < world; r++)); do
                        [[ -e $tmp/$tag.ready.$r ]] && ready=$((ready + 1)) && continue
                        alive "${rank_pids[r]}" || { wait "${rank_pids[r]}"; fail "rank $r exited early (status $?)"; }
                done
                ((ready == world)) && break
                sleep 0.05
        done
        ((ready == world)) || fail "only $ready of $world ranks got ready within 30s"
        echo "ok: $world ranks joined, exchanged memfd regions and verified every peer's contents"

        timeout 60 "$rank" --socket "$sock" --id-file "$idfile" --world "$world" --outsider --timeout 50 \
                >"$tmp/outsider.log" 2>&1
        rc=$?
        cat "$tmp/outsider.log"
        [[ $rc -eq 0 ]] || fail "the outsider was not refused everywhere (status $rc)"
        echo "ok: a client outside the job got none of its regions"

        ctl status status
        ctl jobs jobs
        ctl clients clients
        ctl status-json --json status
        ctl jobs-json --json jobs
        ctl clients-json --json clients
        for f in status jobs clients; do
                [[ -s $tmp/ctl-$f.out ]] || fail "moeepctl $f printed nothing"
                python3 -m json.tool "$tmp/ctl-$f-json.out" >/dev/null ||
                        fail "moeepctl --json $f is not valid JSON: $(head -c 300 "$tmp/ctl-$f-json.out")"
        done
        grep -q -- "$name" "$tmp/ctl-jobs.out" || fail "moeepctl jobs does not show job $name"
        for p in "${rank_pids[@]}"; do
                grep -qw -- "$p" "$tmp/ctl-clients.out" || fail "moeepctl clients does not show pid $p"
        done
        python3 "$check" status "$tmp/ctl-status-json.out" || fail "moeepctl --json status"
        python3 "$check" jobs "$tmp/ctl-jobs-json.out" "$name" "$world" || fail "moeepctl --json jobs"
        python3 "$check" clients "$tmp/ctl-clients-json.out" "${rank_pids[@]}" || fail "moeepctl --json clients"
        python3 "$check" secret "$idfile" "$tmp"/ctl-*.out "$tmp"/ctl-*.err "$daemon_log" ||
                fail "the job's secret leaked into moeepctl output or the daemon log"
        echo "ok: moeepctl status/jobs/clients (human and --json) show the job, its $world ranks, no secret"
        sed 's/^/    /' "$tmp/ctl-status.out" "$tmp/ctl-jobs.out"

        for p in "${rank_pids[@]}"; do
                kill -USR1 "$p"
        done
        for ((r = 0; r < world; r++)); do
                wait "${rank_pids[r]}"
                rc=$?
                [[ $rc -eq 0 ]] || fail "rank $r exited with status $rc"
        done
        echo "ok: every rank left the job cleanly"
}

# 1. moeepd binds its own socket.
phase="moeepd --socket"
sock=$tmp/moeepd.sock
daemon_log=$tmp/moeepd.log
start_listener direct
NOTIFY_SOCKET=$tmp/direct.notify "$moeepd" --socket "$sock" --foreground >"$daemon_log" 2>&1 &
daemon_pid=$!
pids+=($daemon_pid)
wait_until 20 "READY=1 from moeepd" notified direct '^READY=1'
alive "$daemon_pid" || fail "moeepd exited after READY=1"
[[ -S $sock ]] || fail "$sock is not a socket after READY=1"
mode=$(stat -c %a "$sock")
[[ $mode == 660 ]] || fail "$sock has mode $mode, want 660"
echo "ok: moeepd sent READY=1 and listens on $sock (mode 660)"
run_job direct
stop_daemon direct

# 2. Socket activation: the daemon starts on the first connection and takes
# the listening socket from LISTEN_FDS (so no --socket).
phase="systemd-socket-activate"
sock=$tmp/activated.sock
daemon_log=$tmp/moeepd-activated.log
start_listener activated
systemd-socket-activate --seqpacket -l "$sock" -E NOTIFY_SOCKET="$tmp/activated.notify" \
        "${sanitizer_env[@]}" "$moeepd" --foreground >"$daemon_log" 2>&1 &
daemon_pid=$!
pids+=($daemon_pid)
wait_until 10 "systemd-socket-activate to listen" test -S "$sock"
run_job activated
notified activated '^READY=1' || fail "the socket-activated moeepd never sent READY=1"
echo "ok: socket-activated moeepd served the job and sent READY=1"
stop_daemon activated

# 3. No daemon at all.
phase="moeepctl without a daemon"
for args in "status" "--json jobs" "clients"; do
        # shellcheck disable=SC2086
        timeout 20 "$moeepctl" --socket "$tmp/nobody.sock" $args >"$tmp/nodaemon.out" 2>"$tmp/nodaemon.err"
        rc=$?
        if [[ $rc -eq 0 || $rc -ge 124 ]]; then
                fail "moeepctl $args with no daemon exited with status $rc, want a plain failure (1..123)"
        fi
        [[ -s $tmp/nodaemon.err ]] || fail "moeepctl $args with no daemon failed without saying why on stderr"
done
echo "ok: moeepctl without a daemon fails: $(head -n 1 "$tmp/nodaemon.err")"

echo "e2e: all checks passed"
