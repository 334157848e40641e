#!/usr/bin/env bash
# The internode mesh end to end: daemons on 127.0.0.1, each with its own
# socket, mesh port and log, talking only through TCP on loopback.
#
#   mesh.sh MOEEPD MOEEPCTL MESH_RANK
#
# 1. A and B share the cluster key and name each other in mesh_peers (A
#    names C and D too): one connection remains, both see each other up with
#    a measured round trip; the metrics count one peer up.
# 2. C holds another key, D none, and a raw client sends a frame too large
#    for an unauthenticated peer: A refuses each and logs one line naming the
#    address; no log holds the key.
# 3. A 4-rank job, ranks 0,1 at A (0 creates it) and 2,3 at B: every rank
#    joins, barriers pass across the daemons, moeep_job_ranks() says which
#    ranks are local and remote, region fds come only from local ranks and
#    remote ranks' regions are listed as metadata (fd -1).
# 4. The same job held in a barrier, then B is killed: ranks 0,1 at A get
#    -ENOTCONN, the abort word and PeerLost for a remote rank within 5 s.
# 5. B restarted; the job again, then A (the job's home) is killed: ranks 2,3
#    at B get the same.
#
# Everything it starts is killed and its temp dir removed on any exit; every
# wait is bounded.
set -uo pipefail

if [[ $# -ne 3 ]]; then
        echo "usage: $0 MOEEPD MOEEPCTL MESH_RANK" >&2
        exit 2
fi
moeepd=$(realpath "$1") moeepctl=$(realpath "$2") rank=$(realpath "$3")

test_name=mesh
# shellcheck source=lib.sh
source "$(dirname "$(realpath "$0")")/lib.sh"

read -r port_a port_b port_c port_d < <(free_ports 4) || fail "no free ports"

key_text="moeep-mesh-test-key-7f3a9c21d5e8b046"
printf '%s\n' "$key_text" >"$tmp/good.key"
printf '%s\n' "moeep-mesh-other-key-00112233445566" >"$tmp/other.key"
chmod 600 "$tmp/good.key" "$tmp/other.key"

# start NAME PORT KEYFILE PEERS: a daemon with its socket at $tmp/NAME.sock
# and its log at $tmp/NAME.log.
start() {
        local name=$1 port=$2 key=$3 peers=$4
        cat >"$tmp/$name.conf" <<CONF
[moeepd]
socket = $tmp/$name.sock
log_level = debug
mesh_listen = 127.0.0.1:$port
mesh_peers = $peers
cluster_key_file = $key
CONF
        rm -f "$tmp/$name.sock"
        "$moeepd" --config "$tmp/$name.conf" --foreground >>"$tmp/$name.log" 2>&1 &
        daemon_pid[$name]=$!
        wait_until 10 "moeepd $name to listen" test -S "$tmp/$name.sock"
}

ctl() {
        local name=$1
        shift
        timeout 10 "$moeepctl" --socket "$tmp/$name.sock" "$@"
}

# peer_state NAME ADDRESS STATE: moeepctl mesh of NAME lists ADDRESS in STATE.
peer_state() {
        ctl "$1" --json mesh 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
sys.exit(not any(p["address"] == sys.argv[1] and p["state"] == sys.argv[2] for p in d["peers"]))' "$2" "$3"
}

json_check() { # json_check FILE EXPR: EXPR over d = the file's JSON
        python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); sys.exit(not eval(sys.argv[2]))' "$1" "$2" ||
                fail "$1 does not satisfy: $2 ($(cat "$1"))"
}

log_has() { grep -qF -- "$2" "$tmp/$1.log"; }

a=127.0.0.1:$port_a b=127.0.0.1:$port_b c=127.0.0.1:$port_c d=127.0.0.1:$port_d

# ------------------------------------------------------------ 1. key accepted
phase="key accepted"
# Each names the other in mesh_peers: one connection must remain.
start A "$port_a" "$tmp/good.key" "$b,$c,$d"
start B "$port_b" "$tmp/good.key" "$a"
wait_until 10 "A to see B up" peer_state A "$b" up
wait_until 10 "B to see A up" peer_state B "$a" up
sleep 2.5 # a ping or two, and A's redial timer
ctl A --json mesh >"$tmp/mesh-a.json" || fail "moeepctl mesh on A"
json_check "$tmp/mesh-a.json" '[(p["address"], p["state"]) for p in d["peers"] if p["state"] == "up" or p["address"] == "'"$b"'"] == [("'"$b"'", "up")]'
ctl B --json mesh >"$tmp/mesh-b.json" || fail "moeepctl mesh on B"
json_check "$tmp/mesh-b.json" 'd["configured"] and d["keyed"] and d["address"] == "'"$b"'" and len(d["peers"]) == 1 and d["peers"][0]["state"] == "up" and d["peers"][0]["rtt_us"] > 0'
ctl A mesh >"$tmp/mesh-a.txt" || fail "moeepctl mesh on A"
grep -q "^PEER  *STATE  *DIALLED  *RTT_US  *JOBS$" "$tmp/mesh-a.txt" || fail "mesh: header: $(cat "$tmp/mesh-a.txt")"
grep -q "^$b  *up  *\(yes\|no\)  *[0-9][0-9]*  *0$" "$tmp/mesh-a.txt" || fail "mesh: no row for B: $(cat "$tmp/mesh-a.txt")"
ctl A metrics >"$tmp/metrics-a.txt" || fail "moeepctl metrics on A"
grep -q '^moeepd_mesh_peers{state="up"} 1$' "$tmp/metrics-a.txt" || fail "metrics: moeepd_mesh_peers up is not 1"
echo "ok: A and B authenticated each other; moeepctl mesh shows state and RTT"

# ------------------------------------------------------------ 2. refused
phase="wrong key"
start C "$port_c" "$tmp/other.key" "$a"
wait_until 10 "A to log the refusal of C" log_has A "peer $c ($c) refused: "
grep -F "peer $c ($c) refused: " "$tmp/A.log" | grep -q "does not match the cluster key" || fail "A's line about C does not say why"
wait_until 10 "C to log the mismatch" log_has C "does not match the cluster key"
peer_state A "$c" up && fail "A lists C as up"
kill -KILL "${daemon_pid[C]}"

phase="no key"
start D "$port_d" "" "$a"
wait_until 10 "A to log the refusal of D" log_has A "peer $d ($d) refused: "
grep -F "peer $d ($d) refused: " "$tmp/A.log" | grep -q "no cluster key" || fail "A's line about D does not say why"
peer_state A "$d" up && fail "A lists D as up"
kill -KILL "${daemon_pid[D]}"

phase="bad frame"
python3 - "$port_a" <<'PY' || fail "raw client"
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
s.sendall(b"\x7f\xff\xff\xff")  # a 2 GiB frame before authenticating
s.settimeout(5)
assert s.recv(16) == b"", "the daemon kept the connection"
PY
wait_until 10 "A to log the oversized frame" log_has A "bytes (at most 1024 now)"
ctl A --json metrics | python3 -c '
import json, sys
d = {f["name"]: f for f in json.load(sys.stdin)}
sys.exit(not d["moeepd_mesh_refused_total"]["samples"][0]["value"] >= 3)' || fail "moeepd_mesh_refused_total < 3"
for n in A B C D; do
        grep -qF "$key_text" "$tmp/$n.log" && fail "the cluster key appears in $n's log"
done
peer_state A "$b" up || fail "B is no longer up at A after the refusals"
echo "ok: another key, no key and an oversized frame are refused and logged with the peer's address, never the key"

# ------------------------------------------------------------ 3. a job across A and B
# run_ranks TAG [SURVIVOR]: ranks 0,1 at A and 2,3 at B, in the background;
# their pids in rank_pids. With SURVIVOR (A or B) the ranks stay in the job:
# those at SURVIVOR wait for the other daemon's death (--expect-lost), the
# others hold until they die with it.
run_ranks() {
        local tag=$1 survivor=${2:-} r sock local remote mode extra
        rank_pids=()
        rm -f "$tmp/$tag.id" "$tmp/$tag".ready.*
        for r in 0 1 2 3; do
                if ((r < 2)); then sock=A local=0x3 remote=0xc; else sock=B local=0xc remote=0x3; fi
                mode=--join
                ((r == 0)) && mode=--create
                extra=()
                if [[ -n $survivor ]]; then
                        extra=(--ready-file "$tmp/$tag.ready.$r" --hold)
                        [[ $sock == "$survivor" ]] && extra[2]=--expect-lost
                fi
                "$rank" --socket "$tmp/$sock.sock" --id-file "$tmp/$tag.id" --world 4 --rank "$r" $mode \
                        --local $local --remote $remote --timeout 40 "${extra[@]}" >"$tmp/$tag-rank$r.out" 2>&1 &
                rank_pids+=($!)
                pids+=($!)
        done
}

# expect_ok PID...: each exits 0 within 20 s.
expect_ok() {
        local p rc
        for p in "$@"; do
                wait_until 20 "rank (pid $p) to finish" eval '! alive '"$p"
                wait "$p"
                rc=$?
                [[ $rc -eq 0 ]] || { cat "$tmp"/*-rank*.out; fail "a rank exited with status $rc"; }
        done
}

phase="job across daemons"
run_ranks job1
expect_ok "${rank_pids[@]}"
grep -q "local 0x3 remote 0xc, region fds of 0x2, remote regions of 0xc" "$tmp/job1-rank0.out" || fail "rank 0: $(cat "$tmp/job1-rank0.out")"
grep -q "local 0xc remote 0x3, region fds of 0x4, remote regions of 0x3" "$tmp/job1-rank3.out" || fail "rank 3: $(cat "$tmp/job1-rank3.out")"
echo "ok: 4 ranks over 2 daemons joined, passed barriers, told local from remote; region fds only between local ranks, remote regions as metadata"

# kill_and_expect TAG VICTIM SURVIVING_RANKS LOST_RANKS: the ranks of job
# TAG hold (run_ranks TAG SURVIVOR); VICTIM is killed; the surviving ranks
# (pattern, e.g. "[01]") must end well within 5 s, having seen PeerLost for
# one of LOST_RANKS. Sets $ms.
kill_and_expect() {
        local tag=$1 victim=$2 surviving=$3 lost=$4 r killed pids=()
        for r in 0 1 2 3; do
                wait_until 20 "rank $r to hold" test -e "$tmp/$tag.ready.$r"
        done
        for r in 0 1 2 3; do
                [[ $r == $surviving ]] && pids+=("${rank_pids[$r]}")
        done
        killed=$(date +%s%N)
        kill -KILL "${daemon_pid[$victim]}"
        expect_ok "${pids[@]}"
        ms=$((($(date +%s%N) - killed) / 1000000))
        ((ms < 5000)) || fail "the survivors took $ms ms to learn of $victim's death"
        for r in 0 1 2 3; do
                [[ $r == $surviving ]] || continue
                grep -q "PeerLost rank $lost " "$tmp/$tag-rank$r.out" || fail "rank $r: $(cat "$tmp/$tag-rank$r.out")"
        done
}

# ------------------------------------------------------------ 4. B dies
phase="peer daemon killed"
run_ranks job2 A
for r in 0 1 2 3; do
        wait_until 20 "rank $r to hold" test -e "$tmp/job2.ready.$r"
done
ctl A --json jobs >"$tmp/jobs-a.json" || fail "moeepctl jobs on A"
json_check "$tmp/jobs-a.json" 'len(d) == 1 and d[0]["joined_ranks"] == [0, 1, 2, 3]'
ctl A --json mesh >"$tmp/mesh-a.json" || fail "moeepctl mesh on A"
json_check "$tmp/mesh-a.json" '[p["jobs"] for p in d["peers"] if p["address"] == "'"$b"'"] == [1]'
kill_and_expect job2 B "[01]" "[23]"
log_has A "peer $b (" || fail "A did not log B going down"
echo "ok: B killed: ranks 0,1 at A got -ENOTCONN, the abort word and PeerLost within $ms ms"

# ------------------------------------------------------------ 5. the home dies
phase="home daemon killed"
start B "$port_b" "$tmp/good.key" "$a"
wait_until 10 "B to see A up again" peer_state B "$a" up
run_ranks job3 B
kill_and_expect job3 A "[23]" "[01]"
echo "ok: A (the job's home) killed: ranks 2,3 at B got -ENOTCONN, the abort word and PeerLost within $ms ms"

phase="stop"
kill -TERM "${daemon_pid[B]}"
wait_until 15 "B to exit after SIGTERM" eval '! alive '"${daemon_pid[B]}"
wait "${daemon_pid[B]}" || fail "B exited non-zero after SIGTERM"
echo "ok: mesh"
