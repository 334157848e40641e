#!/bin/sh
# moeepctl against the fake moeepd of test-client: every subcommand, human
# and JSON; the JSON must parse and carry the fields, strings escaped.
# Usage: test-ctl.sh MOEEPCTL TEST-CLIENT
set -eu
ctl=$1
fake=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/moeep-test-ctl-XXXXXX")
sock=$dir/moeepd.sock
"$fake" --serve "$sock" &
pid=$!
trap 'kill $pid 2>/dev/null; rm -rf "$dir"' EXIT
i=0
while [ ! -S "$sock" ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i + 1)); done

fail() { echo "FAIL: $*" >&2; exit 1; }

"$ctl" --socket "$sock" status | grep -q '^protocol: *1\.0$' || fail "status: no protocol line"
"$ctl" --socket "$sock" | grep -q '^version: *fake$' || fail "no subcommand: not status"
"$ctl" --socket "$sock" jobs | grep -q '^7  *say "hi"\\? é?  *2  *0,1  *ready  *1000  *-$' || fail "jobs: table row"
"$ctl" --socket "$sock" jobs | grep -q '^8  *remote  *2  *1  *forming  *-  *-$' || fail "jobs: a mirror's row (no owner)"
"$ctl" --socket "$sock" clients | grep -q '^2  *4343  *0  *-  *-  *-  *ready  *0  *moeepctl$' ||
        fail "clients: row without a job"
MOEEP_SOCKET=$sock "$ctl" clients >/dev/null || fail "MOEEP_SOCKET is not used"

for cmd in status jobs clients; do
        "$ctl" --socket "$sock" --json $cmd >"$dir/$cmd.json" || fail "$cmd --json failed"
        "$ctl" --socket "$sock" $cmd --json | cmp -s - "$dir/$cmd.json" || fail "$cmd --json after the command"
done
python3 - "$dir" <<'PY' || fail "JSON checks"
import json, sys
d = sys.argv[1]
status = json.load(open(d + "/status.json"))
assert status["protocol"] == "1.0" and status["version"] == "fake", status
assert isinstance(status["uptime_ms"], int) and isinstance(status["pid"], int), status
jobs = json.load(open(d + "/jobs.json"))
assert jobs[0]["name"] == 'say "hi"\\\x01 \u00e9\ufffd', repr(jobs[0]["name"])
assert jobs[0]["joined_ranks"] == [0, 1] and jobs[0]["world_size"] == 2, jobs
assert jobs[0]["lost_ranks"] == [], jobs
assert jobs[0]["owner_uid"] == 1000 and jobs[1]["owner_uid"] is None, jobs
clients = json.load(open(d + "/clients.json"))
assert clients[0]["rank"] == 0 and clients[0]["job_id"] == 7, clients
assert clients[1]["rank"] is None and clients[1]["job_id"] is None, clients
assert clients[0]["gpu_uuid"].startswith("GPU-"), clients
PY

# The fake is a 1.0 daemon: operator commands (1.1) and mesh (1.2) say what
# they need.
for cmd in metrics nics drain "log-level debug"; do
        # shellcheck disable=SC2086
        if "$ctl" --socket "$sock" $cmd 2>"$dir/err"; then fail "$cmd against a 1.0 daemon: exit 0"; fi
        grep -q "does not offer '${cmd%% *}' (it needs protocol 1.1 or later)" "$dir/err" || fail "$cmd: $(cat "$dir/err")"
done
if "$ctl" --socket "$sock" mesh 2>"$dir/err"; then fail "mesh against a 1.0 daemon: exit 0"; fi
grep -q "does not offer 'mesh' (it needs protocol 1.2 or later)" "$dir/err" || fail "mesh: $(cat "$dir/err")"
"$ctl" --socket "$sock" status | grep -q '^draining: *no$' || fail "status: no draining line"
rc=0
"$ctl" --socket "$sock" log-level 2>/dev/null || rc=$?
[ $rc -eq 2 ] || fail "log-level without LEVEL: exit $rc, want 2 (usage)"
rc=0
"$ctl" --socket "$sock" jobs --off 2>/dev/null || rc=$?
[ $rc -eq 2 ] || fail "--off outside drain: exit $rc, want 2 (usage)"

if "$ctl" --socket "$dir/none.sock" status 2>"$dir/err"; then fail "no daemon: exit 0"; fi
grep -q "^moeepctl: cannot connect to moeepd at $dir/none.sock: No such file or directory (is moeepd running?)$" \
        "$dir/err" || fail "no daemon: message: $(cat "$dir/err")"
set +e
"$ctl" --socket "$sock" nonsense 2>/dev/null
[ $? -eq 2 ] || fail "unknown command: exit status is not 2"
echo "moeepctl checks passed"
