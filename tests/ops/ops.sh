#!/usr/bin/env bash
# Operator end-to-end test: the real moeepd, configured from a file, with
# its metrics HTTP listener on a free localhost port.
#
#   ops.sh MOEEPD MOEEPCTL RANK
#
# 1. --check-config accepts a good file and names file, line, key and value
#    of a bad one; moeepd refuses to start on the bad one.
# 2. Every moeepctl subcommand, human and --json: each JSON document parses
#    and carries its fields; nics and mesh (off here) give honest empty answers.
# 3. Metrics: /metrics over HTTP and `moeepctl metrics` both pass a strict
#    Prometheus text-format parser (prom-parse.py), count what happened
#    (requests, errors, jobs, ranks, regions, barriers) and agree with each
#    other; other paths are 404.
# 4. Admin commands (log-level, drain) are refused for uid 65534 (setpriv),
#    which cannot open the admin socket and may still read status and
#    metrics, and for root on the client socket (--client).
# 5. drain: JobCreate is refused with ERROR_DRAINING, status shows it, a job
#    that exists goes on; drain --off accepts jobs again.
# 6. log-level changes the level at once; SIGHUP restores the file's level;
#    a bad file on SIGHUP is refused and the daemon goes on; SIGTERM exits 0.
set -uo pipefail

if [[ $# -ne 3 ]]; then
        echo "usage: $0 MOEEPD MOEEPCTL RANK" >&2
        exit 2
fi
moeepd=$(realpath "$1") moeepctl=$(realpath "$2") rank=$(realpath "$3")
here=$(dirname "$(realpath "$0")")
prom=$here/prom-parse.py

test_name=ops
# shellcheck source=../tmpdir.sh
source "$here/../tmpdir.sh"
daemon_pid=""
log=$tmp/moeepd.log
phase=start

fail() {
        echo "FAIL [$phase]: $*"
        [[ -s $log ]] && { echo "--- moeepd log"; tail -n 30 "$log"; }
        exit 1
}

# shellcheck source=../wait.sh
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../wait.sh"
# shellcheck source=../ctl.sh
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../ctl.sh"

# http PATH OUT: GET http://127.0.0.1:$port/PATH; prints the status code.
http() {
        python3 - "http://127.0.0.1:$port$1" "$2" <<'PY'
import sys, urllib.error, urllib.request
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=10)
    code, body, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
except urllib.error.HTTPError as e:
    code, body, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
open(sys.argv[2], "wb").write(body)
print(code, ctype)
PY
}

metric() { python3 "$prom" "$@" >/dev/null || fail "metrics: $(python3 "$prom" "$@" 2>&1)"; }

# 1. Configuration files.
phase="configuration"
sock=$tmp/moeepd.sock
cat >"$tmp/good.conf" <<EOF2
# moeepd for the ops test
[moeepd]
socket = $sock
socket_mode = 0666
log_level = info
metrics_listen = 127.0.0.1:0
max_jobs_per_uid = 4
EOF2
printf '[moeepd]\nlog_level = info\nmax_sessions = 0\n' >"$tmp/bad.conf"
"$moeepd" --config "$tmp/good.conf" --check-config >"$tmp/check.out" 2>&1 ||
        fail "--check-config refused a good file: $(cat "$tmp/check.out")"
grep -q "good.conf: configuration is valid" "$tmp/check.out" || fail "--check-config said: $(cat "$tmp/check.out")"
if "$moeepd" --config "$tmp/bad.conf" --check-config >"$tmp/check.out" 2>&1; then
        fail "--check-config accepted max_sessions = 0"
fi
grep -q "bad.conf:3: max_sessions '0': need a number from 1" "$tmp/check.out" ||
        fail "bad file message: $(cat "$tmp/check.out")"
if timeout 10 "$moeepd" --config "$tmp/bad.conf" --socket "$tmp/bad.sock" >"$tmp/bad.log" 2>&1; then
        fail "moeepd started on a bad file"
fi
grep -q "bad.conf:3: max_sessions" "$tmp/bad.log" || fail "start-up message: $(cat "$tmp/bad.log")"
"$moeepd" --config "$tmp/good.conf" --metrics-listen "nonsense:1" --check-config >"$tmp/check.out" 2>&1 &&
        fail "--metrics-listen nonsense:1 accepted"
grep -q "metrics_listen 'nonsense:1'" "$tmp/check.out" || fail "flag message: $(cat "$tmp/check.out")"
echo "ok: --check-config accepts a good file, names file:line, key and value of bad ones; flags are checked too"

# Every key, with its default, is in docs/operations.md and in the example.
"$moeepd" --no-config --dump-config >"$tmp/defaults.conf" || fail "--dump-config failed"
python3 - "$tmp/defaults.conf" "$here/../../docs/operations.md" "$here/../../systemd/moeepd.conf.example" <<'PY' ||
import re, sys
keys = [l.split("=", 1) for l in open(sys.argv[1]) if "=" in l and not l.startswith("#")]
doc, example = open(sys.argv[2]).read(), open(sys.argv[3]).read()
bad = []
for k, v in ((k.strip(), v.strip()) for k, v in keys):
    shown = "`%s`" % v if v else "(empty"
    if not re.search(r"^\| `%s` \| %s" % (re.escape(k), re.escape(shown)), doc, re.M):
        bad.append("operations.md lacks key %s with default %r" % (k, v))
    if not re.search(r"^#%s =%s$" % (re.escape(k), re.escape(" " + v if v else "")), example, re.M):
        bad.append("the example lacks '#%s = %s'" % (k, v))
print("\n".join(bad))
sys.exit(1 if bad else 0)
PY
        fail "documentation and defaults differ"
echo "ok: every key and its default is in docs/operations.md and moeepd.conf.example"

phase="start"
chmod 0755 "$tmp" # uid 65534 must reach the socket (mode 0666 from the file)
"$moeepd" --config "$tmp/good.conf" --foreground >"$log" 2>&1 &
daemon_pid=$!
pids+=($daemon_pid)
wait_until 20 "the metrics listener" grep -q 'metrics: listening on http://127.0.0.1:' "$log"
port=$(sed -n 's|.*metrics: listening on http://127.0.0.1:\([0-9]*\)/metrics.*|\1|p' "$log" | head -n 1)
[[ -n $port && $port != 0 ]] || fail "no port in the log"
wait_until 10 "the socket" test -S "$sock"
echo "ok: moeepd runs from the file; metrics on 127.0.0.1:$port"

# A job of 2 ranks that holds while we look.
phase="job"
for r in 0 1; do
        role=--join
        ((r == 0)) && role=--create
        "$rank" --socket "$sock" --id-file "$tmp/job.id" --name ops-job --world 2 --rank $r $role --hold \
                --ready-file "$tmp/ready.$r" --timeout 60 >"$tmp/rank$r.log" 2>&1 &
        pids+=($!)
        rank_pids[r]=$!
done
wait_until 30 "both ranks" test -e "$tmp/ready.0" -a -e "$tmp/ready.1"

# 2. Every subcommand, human and JSON.
phase="moeepctl"
for cmd in status jobs clients nics mesh metrics; do
        ctl "$cmd" "$cmd"
        ctl "$cmd-json" --json "$cmd"
        [[ -s $tmp/$cmd.out ]] || fail "moeepctl $cmd printed nothing"
        python3 -m json.tool "$tmp/$cmd-json.out" >/dev/null || fail "moeepctl --json $cmd: not JSON"
done
grep -q '^draining: *no$' "$tmp/status.out" || fail "status: no 'draining: no' line"
grep -q '^log level: *info$' "$tmp/status.out" || fail "status: no 'log level: info' line"
grep -q '^protocol: *1\.4$' "$tmp/status.out" || fail "status: protocol is not 1.4"
json "$tmp/status-json.out" 'd["draining"] is False and d["log_level"] == "info" and d["jobs"] == 1'
grep -q 'ops-job' "$tmp/jobs.out" || fail "jobs: ops-job missing"
json "$tmp/jobs-json.out" '[j["joined_ranks"] for j in d if j["name"] == "ops-job"] == [[0, 1]]'
json "$tmp/clients-json.out" 'sorted(c["rank"] for c in d if c["rank"] is not None) == [0, 1]'
head -n 1 "$tmp/nics.out" | grep -q '^NIC  *SOURCE  *PCI  *NUMA  *LINK$' || fail "nics: header: $(head -n 1 "$tmp/nics.out")"
grep -q '^GPU  *NUMA  *NIC  *DISTANCE$' "$tmp/nics.out" || fail "nics: no GPU table"
json "$tmp/nics-json.out" 'isinstance(d["nics"], list) and isinstance(d["gpus"], list) and isinstance(d["note"], str)'
json "$tmp/nics-json.out" '(len(d["nics"]) == 0) == (d["note"] != "") and all(set(n) == {"name", "source", "pci_address", "numa_node", "link"} for n in d["nics"])'
if python3 -c 'import json,sys; sys.exit(len(json.load(open(sys.argv[1]))["nics"]) != 0)' "$tmp/nics-json.out"; then
        grep -q '^no RDMA devices' "$tmp/nics.out" || fail "nics without devices: no 'no RDMA devices' note"
fi
# GDRCopy's /dev/gdrdrv: reported exactly where the node has it (1.4).
if [ -c /dev/gdrdrv ]; then
        grep -q '^gdrdrv: /dev/gdrdrv (module ' "$tmp/nics.out" || fail "nics: /dev/gdrdrv exists but is not shown"
        json "$tmp/nics-json.out" 'd["gdrdrv"]["path"] == "/dev/gdrdrv" and isinstance(d["gdrdrv"]["accessible"], bool)'
else
        grep -q '^gdrdrv: none$' "$tmp/nics.out" || fail "nics: no /dev/gdrdrv but no 'gdrdrv: none' line"
        grep -q 'containers never need it' "$tmp/nics.out" || fail "nics: the gdrdrv note is missing"
        json "$tmp/nics-json.out" 'd["gdrdrv"] is None'
fi
grep -q '^PEER  *STATE  *DIALLED  *RTT_US  *JOBS$' "$tmp/mesh.out" || fail "mesh: header"
grep -q '^internode mesh off' "$tmp/mesh.out" || fail "mesh: note"
json "$tmp/mesh-json.out" 'd == {"configured": False, "address": "", "keyed": False, "peers": [], "note": d["note"]} and d["note"].startswith("internode mesh off")'
json "$tmp/metrics-json.out" 'all(set(f) == {"name", "type", "help", "samples"} for f in d) and any(f["name"] == "moeepd_ranks" and f["samples"][0]["value"] == 2 for f in d)'
echo "ok: status, jobs, clients, nics, mesh and metrics print tables and parseable JSON"
echo "    nics: $(tail -n +2 "$tmp/nics.out" | head -n 1)"

# 3. Metrics, both ways.
phase="metrics"
read -r code ctype < <(http /metrics "$tmp/http.txt")
[[ $code == 200 ]] || fail "GET /metrics: $code"
[[ $ctype == "text/plain; version=0.0.4; charset=utf-8" ]] || fail "GET /metrics: Content-Type $ctype"
metric "$tmp/http.txt" 'moeepd_ranks=2' 'moeepd_jobs{state="ready"}=1' 'moeepd_jobs_created_total=1' \
        'moeepd_regions=2' 'moeepd_registered_bytes=131072' 'moeepd_regions_registered_total=2' \
        'moeepd_sessions{state="ready"}=2' 'moeepd_draining=0' 'moeepd_barriers_total=2' \
        'moeepd_requests_total{type="job_create"}=1' 'moeepd_requests_total{type="job_join"}=2' \
        'moeepd_requests_total{type="metrics_get"}=2' 'moeepd_errors_total{code="ERROR_DRAINING"}=0' \
        'moeepd_ranks_lost_total=0' 'moeepd_job_lost_ranks=0' 'moeepd_http_requests_total=1'
metric "$tmp/metrics.out" 'moeepd_ranks=2' 'moeepd_regions=2'
# Same families, same HELP and TYPE lines, both ways.
diff <(grep '^#' "$tmp/http.txt") <(grep '^#' "$tmp/metrics.out") >/dev/null ||
        fail "HTTP and moeepctl metrics differ in their families"
read -r code ctype < <(http /other "$tmp/other.txt")
[[ $code == 404 ]] || fail "GET /other: $code, want 404"
echo "ok: /metrics and moeepctl metrics pass the strict parser ($(python3 "$prom" "$tmp/http.txt")) and count the job"

# 4. Admin commands for a non-admin.
phase="non-admin"
if [[ $(id -u) -eq 0 ]] && command -v setpriv >/dev/null; then
        nobody=(setpriv --reuid=65534 --regid=65534 --clear-groups)
        for args in "log-level debug" "drain" "drain --off" "--json drain"; do
                # shellcheck disable=SC2086
                if timeout 20 "${nobody[@]}" "$moeepctl" --socket "$sock" $args >"$tmp/nobody.out" 2>"$tmp/nobody.err"; then
                        fail "uid 65534 ran moeepctl $args"
                fi
                grep -q "is an operator command: only the admin socket accepts it" "$tmp/nobody.err" ||
                        fail "moeepctl $args as uid 65534: $(cat "$tmp/nobody.err")"
                grep -q "the admin socket, which admin commands need: .*Permission denied" "$tmp/nobody.err" ||
                        fail "moeepctl $args as uid 65534 does not say why the admin socket was not used: $(cat "$tmp/nobody.err")"
        done
        # Root on the client socket (a container running as root without a
        # user namespace) is no admin either.
        if timeout 20 "$moeepctl" --socket "$sock" --client drain >"$tmp/root.out" 2>"$tmp/root.err"; then
                fail "root drained through the client socket"
        fi
        grep -q "Drain is an operator command" "$tmp/root.err" || fail "moeepctl --client drain as root: $(cat "$tmp/root.err")"
        timeout 20 "${nobody[@]}" "$moeepctl" --socket "$sock" --json status >"$tmp/nobody.out" 2>&1 ||
                fail "uid 65534 may not read status: $(cat "$tmp/nobody.out")"
        json "$tmp/nobody.out" 'd["draining"] is False and d["jobs"] == 0'
        timeout 20 "${nobody[@]}" "$moeepctl" --socket "$sock" metrics >"$tmp/nobody.out" 2>&1 ||
                fail "uid 65534 may not read metrics"
        metric "$tmp/nobody.out" 'moeepd_errors_total{code="ERROR_PERMISSION_DENIED"}=5' 'moeepd_draining=0'
        echo "ok: uid 65534, and root on the client socket, are refused log-level and drain (ERROR_PERMISSION_DENIED); uid 65534 reads status and metrics"
else
        echo "skip: not root or no setpriv: admin refusal not checked"
fi

# 5. Drain.
phase="drain"
ctl drain drain
grep -q '^draining: *yes$' "$tmp/drain.out" || fail "drain: $(cat "$tmp/drain.out")"
ctl status-json --json status
json "$tmp/status-json.out" 'd["draining"] is True'
if timeout 20 "$rank" --socket "$sock" --id-file "$tmp/drained.id" --name drained --world 1 --rank 0 --create \
        --timeout 15 >"$tmp/drained.log" 2>&1; then
        fail "a job was created while draining"
fi
grep -q "draining" "$tmp/drained.log" || fail "JobCreate while draining: $(cat "$tmp/drained.log")"
ctl metrics-drain metrics
metric "$tmp/metrics-drain.out" 'moeepd_errors_total{code="ERROR_DRAINING"}=1' 'moeepd_draining=1' \
        'moeepd_jobs{state="ready"}=1' 'moeepd_jobs_created_total=1'
ctl drain-off --json drain --off
json "$tmp/drain-off.out" 'd["draining"] is False'
timeout 30 "$rank" --socket "$sock" --id-file "$tmp/after.id" --name after --world 1 --rank 0 --create \
        --timeout 20 >"$tmp/after.log" 2>&1 || fail "no job after drain --off: $(cat "$tmp/after.log")"
echo "ok: drain refuses JobCreate with ERROR_DRAINING, status says so, the running job goes on; --off undoes it"

for p in "${rank_pids[@]}"; do kill -USR1 "$p"; done
for p in "${rank_pids[@]}"; do wait "$p" || fail "a rank of ops-job exited $?"; done

# 6. Log level and reload.
phase="log level"
ctl level --json log-level debug
json "$tmp/level.out" 'd["log_level"] == "debug"'
grep -q 'log level info -> debug' "$log" || fail "the change is not logged"
kill -HUP "$daemon_pid"
wait_until 10 "the reload" grep -q 'configuration reloaded' "$log"
ctl status-json --json status
json "$tmp/status-json.out" 'd["log_level"] == "info"'
sed -i 's/^log_level = info/log_level = loud/' "$tmp/good.conf"
kill -HUP "$daemon_pid"
wait_until 10 "the refused reload" grep -q "reload: .*good.conf:5: log_level 'loud'" "$log"
ctl metrics-reload metrics
metric "$tmp/metrics-reload.out" 'moeepd_config_reloads_total{result="ok"}=1' \
        'moeepd_config_reloads_total{result="failed"}=1' 'moeepd_ranks=0' 'moeepd_regions=0'
echo "ok: log-level takes effect at once, SIGHUP restores the file's level, a bad file is refused on SIGHUP"

phase="stop"
kill -TERM "$daemon_pid"
wait_until 15 "moeepd to exit" eval '! kill -0 "$daemon_pid" 2>/dev/null || grep -q "^Z" <(sed "s/.*) //" /proc/$daemon_pid/stat 2>/dev/null)'
wait "$daemon_pid"
rc=$?
[[ $rc -eq 0 ]] || fail "moeepd exited $rc after SIGTERM"
echo "ok: SIGTERM: exit 0"
echo "ops: all checks passed"
