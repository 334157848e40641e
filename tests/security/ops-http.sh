#!/usr/bin/env bash
# The metrics HTTP listener under a drip-feeding flood (issue 15, item 6),
# against the real moeepd, run with RLIMIT_NOFILE 256:
#
# 1. It still answers: GET and HEAD /metrics, 404 elsewhere, 405 for POST,
#    431 for a request head past 8 KiB.
# 2. 1,100 connections from one source that each send one byte a second
#    and never finish their request: at most 8 (its quota) are open at
#    once, each new one displacing the oldest (answered 503), none lives
#    past the 5 s deadline, the daemon's fds stay under baseline + 8 + a
#    few; meanwhile status on the admin and the client socket answers
#    within 100 ms and `moeepctl status` works.
# 3. Afterwards the fds are back to the baseline, a scrape works and the
#    metrics counted the closed connections.
# 4. A scraper on 127.0.0.1 (issue 27, item 7) while one source
#    (127.0.0.2) and 24 others (127.0.1.1 ..) keep every slot full of
#    dripping connections for 12 s: its 40 scrapes all answered 200, each
#    within a second; the daemon's fds stay under baseline + 32 + a few.
#
#   ops-http.sh MOEEPD MOEEPCTL RANK PROBE
source "$(dirname "$(realpath "$0")")/ops-lib.sh"

cat >"$conf" <<CONF
[moeepd]
socket = $sock
metrics_listen = 127.0.0.1:0
CONF

phase="start"
start_daemon prlimit --nofile=256:256
wait_until 10 "the metrics listener" grep -q 'metrics: listening on http://127.0.0.1:' "$log"
port=$(sed -n 's|.*metrics: listening on http://127.0.0.1:\([0-9]*\)/metrics.*|\1|p' "$log" | head -n 1)
[[ $(awk '/Max open files/ { print $4 }' "/proc/$daemon_pid/limits") == 256 ]] || fail "RLIMIT_NOFILE is not 256"

# raw REQUEST [half]: sends REQUEST (then shuts its write side with
# `half`, as `nc` does), prints the status line's code and the body's
# length.
raw() {
        python3 - "$port" "$1" "${2:-}" <<'PY'
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
s.sendall(sys.argv[2].encode().decode("unicode_escape").encode("latin-1"))
if sys.argv[3] == "half":
    s.shutdown(socket.SHUT_WR)
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
head, _, body = data.partition(b"\r\n\r\n")
print(head.split(b" ")[1].decode(), len(body))
PY
}

phase="requests"
read -r code len < <(raw 'GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n')
[[ $code == 200 && $len -gt 100 ]] || fail "GET /metrics: $code, $len bytes"
for i in 1 2 3 4 5; do
        read -r code len < <(raw 'GET /metrics HTTP/1.0\r\n\r\n' half)
        [[ $code == 200 && $len -gt 100 ]] || fail "GET /metrics, then the write side shut: $code, $len bytes"
done
read -r code len < <(raw 'HEAD /metrics HTTP/1.0\r\n\r\n')
[[ $code == 200 && $len == 0 ]] || fail "HEAD /metrics: $code, $len bytes"
read -r code len < <(raw 'GET /other HTTP/1.1\r\n\r\n')
[[ $code == 404 ]] || fail "GET /other: $code"
read -r code len < <(raw 'POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc')
[[ $code == 405 ]] || fail "POST /metrics: $code"
read -r code len < <(raw "GET /metrics HTTP/1.1\\r\\nX: $(head -c 9000 /dev/zero | tr '\0' a)\\r\\n\\r\\n")
[[ $code == 431 ]] || fail "a 9 KB request head: $code"
read -r code len < <(raw 'nonsense\r\n\r\n')
[[ $code == 400 ]] || fail "nonsense: $code"
wait_until 5 "the test connections to close" eval '(( $(fds) <= 12 ))'
base=$(fds)
echo "ok: GET/HEAD /metrics 200 (also from half-closing clients), /other 404, POST 405, 9 KB head 431, nonsense 400 ($base fds)"

phase="drip flood"
python3 "$here/ops-drip.py" "$port" 1100 9 1 >"$tmp/drip.json" &
pids+=($!)
drip_pid=$!
most=0 tries=0
while kill -0 "$drip_pid" 2>/dev/null && ((tries < 200)); do
        n=$(fds)
        ((n > most)) && most=$n
        probe "$admin" 2 >/dev/null
        probe "$sock" 1 >/dev/null
        ((tries % 10 == 0)) && ctl status status
        tries=$((tries + 1))
        sleep 0.05
done
wait "$drip_pid" || fail "the attacker failed: $(cat "$tmp/drip.json")"
((most <= base + 8 + 4)) || fail "the daemon held $most fds during the flood (baseline $base, one source's quota 8)"
json "$tmp/drip.json" 'd["attempts"] == 1100 and d["refused"] > 500 and d["max_life_s"] <= 6.5'
echo "ok: 1,100 drip-feeding connections: $(cat "$tmp/drip.json"); at most $most fds (baseline $base); status served within 100 ms ${tries}x on each socket"

phase="after"
wait_until 8 "fds back to $base" eval '(( $(fds) <= base ))'
read -r code len < <(raw 'GET /metrics HTTP/1.1\r\n\r\n')
[[ $code == 200 ]] || fail "GET /metrics after the flood: $code"
ctl metrics metrics
refused=$(sed -n 's/^moeepd_http_closed_total{reason="cap"} //p' "$tmp/metrics.out")
deadline=$(sed -n 's/^moeepd_http_closed_total{reason="deadline"} //p' "$tmp/metrics.out")
((refused > 500)) || fail "closed connections counted: cap $refused, deadline $deadline"
echo "ok: fds back to $base, a scrape works, metrics count $refused displaced and $deadline past the deadline"

phase="scraper during a flood from many sources"
python3 "$here/ops-drip.py" "$port" 3000 12 1 127.0.0.2 1 >"$tmp/drip1.json" &
pids+=($!)
drip1=$!
python3 "$here/ops-drip.py" "$port" 3000 12 1 127.0.1.1 24 >"$tmp/drip24.json" &
pids+=($!)
drip24=$!
sleep 2 # every slot taken
python3 - "$port" >"$tmp/scrape.out" <<'PY' &
import socket, sys, time
ok, worst = 0, 0.0
for _ in range(40):
    t0 = time.monotonic()
    try:
        s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5, source_address=("127.0.0.1", 0))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
        ok += data.startswith(b"HTTP/1.1 200 ")
    except OSError:
        pass
    worst = max(worst, time.monotonic() - t0)
    time.sleep(0.2)
print(ok, round(worst, 3))
PY
scraper=$!
pids+=($scraper)
most=0 tries=0
while kill -0 "$scraper" 2>/dev/null && ((tries < 400)); do
        n=$(fds)
        ((n > most)) && most=$n
        tries=$((tries + 1))
        sleep 0.05
done
wait "$scraper" || fail "the scraper failed"
read -r got worst <"$tmp/scrape.out"
((got == 40)) || fail "the scraper got $got of 40 answers 200 during the flood (slowest $worst s)"
python3 -c "import sys; sys.exit(float(sys.argv[1]) > 1.0)" "$worst" || fail "a scrape took $worst s"
((most <= base + 32 + 4)) || fail "the daemon held $most fds during the flood (baseline $base, cap 32)"
wait "$drip1" "$drip24" || fail "the attackers failed"
json "$tmp/drip24.json" 'd["refused"] > 100'
echo "ok: 40 of 40 scrapes from 127.0.0.1 answered 200 (slowest $worst s) while 25 sources kept every slot full ($(cat "$tmp/drip1.json"), $(cat "$tmp/drip24.json")); at most $most fds"
wait_until 8 "fds back to $base" eval '(( $(fds) <= base ))'
stop_daemon
echo "ops-http: all checks passed"
