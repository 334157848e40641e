#!/usr/bin/env bash
# Errno values never pass for protocol refusals (issue 15, item 9): runs
# moeep-ops-errors (next to PROBE; see ops-errors.c) against a moeepd with
# its internode data path over libfabric tcp on 127.0.0.1.
#
#   ops-errors.sh MOEEPD MOEEPCTL RANK PROBE
source "$(dirname "$(realpath "$0")")/ops-lib.sh"

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$conf" <<CONF
[moeepd]
socket = $sock
mesh_listen = 127.0.0.1:$port
transport = fabric
fabric_provider = tcp
transport_address = 127.0.0.1
CONF

phase="start"
start_daemon
wait_until 10 "the data path" grep -q "proxy running" "$log"
phase="errors"
"$(dirname "$probe")/moeep-ops-errors" "$sock" || fail "moeep-ops-errors"
ctl metrics metrics
grep -qx 'moeepd_errors_total{code="ERROR_BAD_FDS"} 1' "$tmp/metrics.out" || fail "ERROR_BAD_FDS not counted once"
grep -qx 'moeepd_errors_total{code="ERROR_NO_SUCH_JOB"} 1' "$tmp/metrics.out" || fail "ERROR_NO_SUCH_JOB not counted once"
grep -q 'uid 0: 1 job joins named no job it may join' "$log" || fail "the failed join was not logged"
if grep -q 'moeepd_errors_total{code="ERROR_BAD_SECRET"} [1-9]' "$tmp/metrics.out"; then
        fail "ERROR_BAD_SECRET was sent"
fi
stop_daemon
echo "ops-errors: all checks passed"
