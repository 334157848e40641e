#!/usr/bin/env bash
# Attacks on the node mesh of a real moeepd on 127.0.0.1 (docs/protocol.md,
# "Mesh", threat model). A names B in mesh_peers; B is down unless said.
#
#   attack.sh MOEEPD MOEEPCTL MESH_ATTACK
#
# a. Reflection: an attacker without the key (uid 65534) listens on B's
#    port, takes A's dial and relays A's own nonces and proofs back to A.
#    Every connection is refused; A lists no peer up.
# b. Replay: a recorded handshake replayed without the key (uid 65534) is
#    refused; a sealed frame of an earlier session, a frame twice, two
#    frames reordered, one spliced from a concurrent connection, one in
#    clear, a sealed PeerHello and a sealed frame sealed again each end
#    their connection, unanswered.
# 0. A names 128 peers over 17 lines (the cap; 129 are refused at start):
#    B and 127 addresses where nobody listens, so listings run at the caps.
# c. Forged unique ids (uid 65534): 1,500 distinct home addresses, 240
#    spellings of one address with a listener behind it, spellings of A's
#    own address. No outbound connection (the listener sees none), no peer,
#    each join refused fast with an error naming the address; this daemon
#    in another spelling is local (a real job joined through it). A's fds
#    and RSS return to their baseline; `moeepctl mesh` stays fast.
# d. Pre-authentication flood (uid 65534) from one source, then from 20:
#    a key holder's handshake as B is done within 1 s (5 tries), and moeepd
#    B, started meanwhile, is up at A within 1 s of its mesh starting; `moeepctl
#    mesh` at the caps stays fast; ids naming B respelled reach B.
# e. Throughout, and after, a well-behaved client (connect, JobCreate,
#    JobJoin) is answered within 100 ms.
#
# Everything it starts is killed and its temp dir removed on any exit;
# every wait is bounded.
set -uo pipefail

if [[ $# -ne 3 ]]; then
        echo "usage: $0 MOEEPD MOEEPCTL MESH_ATTACK" >&2
        exit 2
fi
moeepd=$(realpath "$1") moeepctl=$(realpath "$2") attack=$(realpath "$3")

test_name=mesh-attack
# shellcheck source=lib.sh
source "$(dirname "$(realpath "$0")")/lib.sh"

[[ $(id -u) -eq 0 ]] || { echo "SKIP: the attackers run as uid 65534, which needs root"; exit 77; }
chmod 0755 "$tmp" # uid 65534 must reach the socket (mode 0666 below)

read -r port_a port_b port_s < <(free_ports 3) || fail "no free ports"
a=127.0.0.1:$port_a b=127.0.0.1:$port_b
printf '%s\n' "moeep-mesh-attack-key-4e1d8b07c26a9f35" >"$tmp/good.key"
chmod 600 "$tmp/good.key"

# RSS may grow this much (KiB) and stay: allocator caches. Under ASan the
# quarantine keeps freed memory (256 MiB by default, filled by the floods'
# 100,000 connections): it is kept small, and its size allowed.
rss_slack=4096
if [[ $(ldd "$moeepd" 2>/dev/null) == *libasan* ]]; then
        export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}quarantine_size_mb=16
        rss_slack=$((64 * 1024))
fi

# launch NAME PORT PEERS: a daemon with its socket at $tmp/NAME.sock and
# its log at $tmp/NAME.log; start: and wait for its socket.
start() {
        launch "$@"
        wait_until 10 "moeepd $1 to listen" test -S "$tmp/$1.sock"
}
launch() {
        local name=$1 port=$2 peers=$3
        cat >"$tmp/$name.conf" <<CONF
[moeepd]
socket = $tmp/$name.sock
socket_mode = 0666
log_level = info
mesh_listen = 127.0.0.1:$port
mesh_peers = $peers
cluster_key_file = $tmp/good.key
CONF
        rm -f "$tmp/$name.sock"
        "$moeepd" --config "$tmp/$name.conf" --foreground >>"$tmp/$name.log" 2>&1 &
        daemon_pid[$name]=$!
}

ctl() {
        local name=$1
        shift
        timeout 10 "$moeepctl" --socket "$tmp/$name.sock" "$@"
}

# up_peers NAME: the addresses NAME lists up, space separated.
up_peers() {
        ctl "$1" --json mesh | python3 -c '
import json, sys
print(" ".join(p["address"] for p in json.load(sys.stdin)["peers"] if p["state"] == "up"))'
}

fds() { ls "/proc/${daemon_pid[A]}/fd" | wc -l; }
rss() { awk '/^VmRSS:/ { print $2 }' "/proc/${daemon_pid[A]}/status"; }

# back_to_baseline WHAT: A's fds return to the baseline within 5 s, its RSS
# within rss_slack of it.
# Conditions for wait_until, which runs its command again on every try: a
# "$(...)" in its arguments would be counted once, when it is called.
fds_at_most() { test "$(fds)" -le "$1"; }
no_peer_up() { test -z "$(up_peers "$1")"; }

back_to_baseline() {
        local f r
        wait_until 5 "A's fds back to $fds0 after $1 (it held $(fds) when the wait began)" fds_at_most "$fds0"
        r=$(rss)
        ((r <= rss0 + rss_slack)) || fail "A's RSS $r KiB after $1, baseline $rss0 KiB (+$rss_slack allowed)"
        echo "ok: after $1, A holds $(fds) fds (baseline $fds0) and $r KiB (baseline $rss0)"
}

# probe_start SECONDS: a well-behaved client in the background (pid in
# probe_pid); probe_check waits for it: every answer within 100 ms.
probe_start() {
        "$attack" probe "$tmp/A.sock" "$1" 100 >"$tmp/probe.out" 2>&1 &
        probe_pid=$!
        pids+=("$probe_pid")
}
probe_check() {
        wait "$probe_pid" || fail "the well-behaved client during $1: $(cat "$tmp/probe.out")"
        echo "ok: during $1, $(cat "$tmp/probe.out")"
}

log_count() { grep -cF -- "$2" "$tmp/$1.log"; }
log_has() { grep -qF -- "$2" "$tmp/$1.log"; }

# A names B and 127 more daemons at addresses nobody listens on (connection
# refused at once): the cap of mesh_peers, so that listings run at it. The
# list goes on over indented lines (a line holds 200 bytes).
others=$(for i in $(seq 1 127); do printf ',127.0.9.%d:%d' "$i" "$port_b"; done)
peer_lines() { # the mesh_peers value for B and $others, 8 a line
        local i list=($b ${others//,/ })
        printf '%s' "${list[0]}"
        for ((i = 1; i < ${#list[@]}; i++)); do
                ((i % 8 == 0)) && printf '\n   ' || printf ','
                printf '%s' "${list[$i]}"
        done
}

phase="peer cap"
{
        printf '[moeepd]\nsocket = %s\nmesh_listen = 127.0.0.1:0\ncluster_key_file = %s\nmesh_peers = ' \
                "$tmp/X.sock" "$tmp/good.key"
        peer_lines
        printf '\nmesh_peers = 127.0.9.200:1\n'
} >"$tmp/X.conf"
timeout 10 "$moeepd" --config "$tmp/X.conf" --foreground >"$tmp/X.out" 2>&1 && fail "moeepd started with 129 mesh_peers"
grep -q "mesh_peers: more than 128 daemons" "$tmp/X.out" || fail "129 mesh_peers: $(cat "$tmp/X.out")"
echo "ok: 129 mesh_peers (over 18 lines) are refused at start"

phase=start
start A "$port_a" "$(peer_lines)"
# A warm-up (first requests page code in), then the baseline.
"$attack" probe "$tmp/A.sock" 1 1000 >/dev/null || fail "the well-behaved client before any attack"
fds0=$(fds) rss0=$(rss)
echo "ok: A up, baseline $fds0 fds, $rss0 KiB"

# ------------------------------------------------------------ a. reflection
phase=reflection
probe_start 8
"$attack" --uid 65534 reflect "$port_a" "$a" "$b" "$port_b" >"$tmp/reflect.out" 2>&1 ||
        fail "reflection: $(cat "$tmp/reflect.out")"
cat "$tmp/reflect.out"
[[ -z $(up_peers A) ]] || fail "A lists peers up after the reflection: $(up_peers A)"
log_has A "it says it is this daemon ($a)" || fail "A did not log its own identity refused"
log_has A "peer $b ($b) refused: the acceptor's proof does not match" || fail "A did not log the reflected challenge"
log_has A "the dialler's proof does not match the cluster key" || fail "A did not log the reflected proof"
probe_check reflection
back_to_baseline reflection

# ------------------------------------------------------------ b. replay
phase=replay
probe_start 6
"$attack" replay "$tmp/good.key" "$port_a" "$a" "$b" >"$tmp/replay.out" 2>&1 || fail "replay: $(cat "$tmp/replay.out")"
cat "$tmp/replay.out"
n=$(log_count A "does not authenticate: forged, replayed, reordered or from another connection")
((n >= 4)) || fail "A logged $n sealed frames refused, want 4 (earlier session, replayed, reordered, spliced)"
log_has A "a frame in clear (message 196) after the handshake" || fail "A did not log the PeerPing in clear"
log_has A "message 192 not allowed after the handshake" || fail "A did not log the sealed PeerHello"
log_has A "message 208 not allowed after the handshake" || fail "A did not log the sealed frame sealed again"
wait_until 5 "A to list no peer up after the replays" no_peer_up A
probe_check replay
back_to_baseline replay

# ------------------------------------------------------------ c. forged unique ids
phase="forged ids"
# A listener at 127.0.0.1:port_s counts the connections it gets: none.
python3 - "$port_s" "$tmp/sentinel.count" <<'PY' &
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(64)
s.settimeout(0.2)
n, end = 0, time.time() + 120
while time.time() < end:
    try:
        c, _ = s.accept()
        n += 1
        c.close()
    except socket.timeout:
        pass
    open(sys.argv[2], "w").write(str(n))
PY
pids+=($!)
wait_until 5 "the sentinel listener" test -e "$tmp/sentinel.count"
probe_start 12
"$attack" --uid 65534 forge "$tmp/A.sock" distinct 1500 "$port_s" >"$tmp/forge.out" 2>&1 ||
        fail "forged ids: $(cat "$tmp/forge.out")"
"$attack" --uid 65534 forge "$tmp/A.sock" spellings 240 "$port_s" >>"$tmp/forge.out" 2>&1 ||
        fail "respelled ids: $(cat "$tmp/forge.out")"
"$attack" --uid 65534 forge "$tmp/A.sock" self 120 "$port_a" >>"$tmp/forge.out" 2>&1 ||
        fail "ids naming A: $(cat "$tmp/forge.out")"
for spelling in "localhost:$port_a" "127.0.0.1:00$port_a" "[::ffff:127.0.0.1]:$port_a" "$port_a"; do
        "$attack" --uid 65534 forge "$tmp/A.sock" selfjob 1 "$spelling" >>"$tmp/forge.out" 2>&1 ||
                fail "a job joined through '$spelling': $(cat "$tmp/forge.out")"
done
cat "$tmp/forge.out"
sleep 1.5 # a redial period: anything A were to dial would be dialled by now
[[ $(cat "$tmp/sentinel.count") == 0 ]] || fail "A connected to the address in forged ids $(cat "$tmp/sentinel.count") times"
ctl A --json mesh >"$tmp/mesh-a.json" || fail "moeepctl mesh"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
got = sorted(p["address"] for p in d["peers"])
sys.exit(got != sorted(sys.argv[2].split(",")) or any(p["state"] == "up" for p in d["peers"]))' \
        "$tmp/mesh-a.json" "$b$others" || fail "A's peers after forged ids: $(cat "$tmp/mesh-a.json")"
n=$(grep -cE "mesh: peer [^ ]*:0*$port_s( |$)" "$tmp/A.log")
((n == 0)) || fail "A logged $n lines about peers named in forged ids"
# mesh_ms: how long `moeepctl --json mesh` at A takes (process start
# included), in ms.
mesh_ms() {
        python3 - "$moeepctl" "$tmp/A.sock" <<'PY'
import subprocess, sys, time
t = time.monotonic()
subprocess.run([sys.argv[1], "--socket", sys.argv[2], "--json", "mesh"], check=True, capture_output=True, timeout=10)
print(int((time.monotonic() - t) * 1000))
PY
}
ms=$(mesh_ms) || fail "moeepctl mesh after the forged ids"
((ms < 500)) || fail "moeepctl mesh took $ms ms"
probe_check "forged ids"
back_to_baseline "forged ids"
echo "ok: 1,860 forged ids refused with the address named, none dialled (sentinel: 0 connections), A's own address in 4 spellings joined locally, moeepctl mesh in $ms ms"

# ------------------------------------------------------------ d. pre-auth flood
phase="pre-auth flood"
# flood_and_connect SOURCES: the flood runs 6 s. After 1 s a key holder
# connects as B five times, each handshake done within 1 s; then moeepd B
# starts and must be up with A within 1 s of its mesh starting (and then
# listed up at A).
flood_and_connect() {
        local sources=$1 t0 ms
        "$attack" --uid 65534 flood "$port_a" 2 "$sources" 6 >"$tmp/flood.out" 2>&1 &
        local flood_pid=$!
        pids+=("$flood_pid")
        probe_start 6
        sleep 1
        "$attack" peer "$tmp/good.key" "$port_a" "$a" "$b" 5 1000 >"$tmp/peer.out" 2>&1 ||
                fail "a key holder during a flood from $sources sources: $(cat "$tmp/peer.out")"
        cat "$tmp/peer.out"
        : >"$tmp/B.log"
        launch B "$port_b" "$a"
        # From B's mesh start (its process start-up, libfabric's probing
        # included, is not the mesh's doing) to the connection up.
        for ((i = 0; i < 1000; i++)); do
                grep -q "mesh: listening on" "$tmp/B.log" && break
                sleep 0.01
        done
        t0=$(date +%s%N)
        # B logs the connection up once A took its proof (A is up first).
        for ((i = 0; i < 300; i++)); do
                grep -q "mesh: peer $a up" "$tmp/B.log" && break
                sleep 0.01
        done
        ms=$((($(date +%s%N) - t0) / 1000000))
        ((ms <= 1000)) || fail "B took $ms ms from its mesh start to be up with A during a flood from $sources sources"
        wait_until 3 "A to list B up" eval '[[ $(up_peers A) == "$b" ]]'
        # The listing at the caps: 128 configured peers, 64 connections
        # authenticating.
        lms=$(mesh_ms) || fail "moeepctl mesh during a flood"
        ((lms < 500)) || fail "moeepctl mesh took $lms ms during a flood from $sources sources"
        # Ids naming B in other spellings are forwarded to B, which answers.
        "$attack" --uid 65534 forge "$tmp/A.sock" peer 12 "$port_b" >"$tmp/forge-peer.out" 2>&1 ||
                fail "ids naming B respelled: $(cat "$tmp/forge-peer.out")"
        wait "$flood_pid" || fail "flood: $(cat "$tmp/flood.out")"
        cat "$tmp/flood.out"
        probe_check "a flood from $sources sources"
        cat "$tmp/forge-peer.out"
        echo "ok: during a pre-auth flood from $sources sources, a key holder's handshakes took at most 1 s, B (started meanwhile) was up with A $ms ms after its mesh started, moeepctl mesh took $lms ms, joins naming B respelled went to B"
        kill -KILL "${daemon_pid[B]}"
        wait "${daemon_pid[B]}" 2>/dev/null
        wait_until 5 "A to see B gone" no_peer_up A
}
flood_and_connect 1
flood_and_connect 20
back_to_baseline "the floods"

# ------------------------------------------------------------ e. after
phase=after
"$attack" probe "$tmp/A.sock" 2 100 >"$tmp/probe.out" 2>&1 || fail "the well-behaved client after the attacks: $(cat "$tmp/probe.out")"
echo "ok: after every attack, $(cat "$tmp/probe.out")"
grep -qF "moeep-mesh-attack-key" "$tmp/A.log" && fail "the cluster key appears in A's log"
kill -TERM "${daemon_pid[A]}"
wait_until 15 "A to exit after SIGTERM" eval '! alive '"${daemon_pid[A]}"
wait "${daemon_pid[A]}" || fail "A exited non-zero after SIGTERM"
echo "ok: mesh-attack"
