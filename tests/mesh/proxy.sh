#!/usr/bin/env bash
# The internode proxy path end to end: two daemons on 127.0.0.1 (separate
# sockets, mesh ports and logs, one cluster key), libfabric tcp between
# them, and a job of four ranks (moeep-proxy-rank), 0 and 1 at A, 2 and 3
# at B, each a separate process writing its descriptor ring from the CPU.
#
#   proxy.sh MOEEPD MOEEPCTL PROXY_RANK MESH_ATTACK
#
# F. flap (before B starts): a cluster-key holder connects to A as B 1000
#    times (mesh-attack's `flap`), each time taking a transport peer
#    (PeerTransport both ways) and failing. A frees each and reuses its
#    index: every round's transport peer has an index below 4 (before,
#    round N took index N for good, and the 4097th got none), moeepctl
#    metrics shows none held after, and A's fds are as after the first
#    round and its resident memory within 8 MiB of it (64 under ASan, its
#    quarantine kept to 16 MiB). Then the real B
#    starts and every phase below runs over its fresh transport peer.
# 0. caps: uid 65534 registers and releases memfd recv regions at A until
#    max_proxy_bytes_per_uid (64M here) refuses the next, naming it: the
#    released ones, still mapped for DATAPATH_MR_LINGER_MS, count; root
#    registers one meanwhile, and past max_proxy_bytes (96M) is refused
#    naming that; 11 s later uid 65534 registers again.
# 1. data: every rank sends pseudo-random payloads with a counter each to
#    both ranks at the other daemon; every byte and counter is checked; the
#    descriptor rate and a one-descriptor round trip are printed
#    (informational).
# 2. bad-local: a descriptor naming a rank at the writer's own daemon fails
#    its ring (-EINVAL) and aborts the job naming the writer ("not routed").
# 3. bad-range: a descriptor past the receiver's region, the same ("range
#    outside a region"). The daemons serve the next job.
# 4. elastic: the ranks stream; rank 3 (at B) is SIGKILLed; the ranks at A
#    go on writing to it for 300 ms after its bit shows in their control
#    page, then only to rank 2, for 1.5 s: no ring ever fails (B keeps the
#    lost rank's receive and counters registered for DATAPATH_MR_LINGER_MS).
# 5. release (issue 27, item 4): rank 0 of job X releases its recv region
#    and rank 2 keeps writing to it while job V streams between the same
#    daemons: X's writer's ring fails ("released"), X is aborted naming it,
#    V streams on without an error and no transport connection fails.
# 6. flood (review finding 2): job F, uid 65534, one rank at each daemon,
#    both writing 30 MiB descriptors to each other as fast as their rings
#    take them for 6 s while job V streams between the same daemons: the
#    proxies hold F's rings back (at most 256 MiB of each in flight, the
#    rings full), F's writes go on without an error, V streams on without
#    an error, and no transport connection fails (before, F took every slot
#    and its writes queued past the 5 s write timeout, which failed the
#    connection and aborted V).
# 7. kill: the ranks stream; B is SIGKILLed; ranks 0 and 1 at A end with the
#    ring's error or the job's abort word within 10 s (the delay is printed).
# 8. A stops on SIGTERM with exit status 0.
#
# Everything it starts is killed and its temp dir removed on any exit; every
# wait is bounded.
set -uo pipefail

if [[ $# -ne 4 ]]; then
        echo "usage: $0 MOEEPD MOEEPCTL PROXY_RANK MESH_ATTACK" >&2
        exit 2
fi
moeepd=$(realpath "$1") moeepctl=$(realpath "$2") rank=$(realpath "$3") attack=$(realpath "$4")

test_name=proxy
# shellcheck source=lib.sh
source "$(dirname "$(realpath "$0")")/lib.sh"

read -r port_a port_b < <(free_ports 2) || fail "no free ports"
a=127.0.0.1:$port_a b=127.0.0.1:$port_b
printf '%s\n' "moeep-proxy-test-key-5b1e0c7d9a2f4e63" >"$tmp/key"
chmod 600 "$tmp/key"

# start NAME PORT PEERS: a daemon with the tcp transport on 127.0.0.1.
start() {
        local name=$1 port=$2 peers=$3
        cat >"$tmp/$name.conf" <<CONF
[moeepd]
socket = $tmp/$name.sock
log_level = debug
mesh_listen = 127.0.0.1:$port
mesh_peers = $peers
cluster_key_file = $tmp/key
transport = fabric
fabric_provider = tcp
transport_address = 127.0.0.1
socket_mode = 0666
max_proxy_bytes_per_uid = 64M
max_proxy_bytes = 96M
CONF
        rm -f "$tmp/$name.sock"
        "$moeepd" --config "$tmp/$name.conf" --foreground >>"$tmp/$name.log" 2>&1 &
        daemon_pid[$name]=$!
        wait_until 10 "moeepd $name to listen" test -S "$tmp/$name.sock"
}

log_has() { grep -qF -- "$2" "$tmp/$1.log"; }

# job MODE [ARGS...]: the ranks of a fresh job of $world (4 unless set),
# the first half at A, the rest at B, in the background; their pids in
# job_pids, their output in $tmp/${out}N.out (out=rank unless set). The
# id file is in $tmp/ids, which any uid may write (--uid).
job_no=0
mkdir -m 0777 "$tmp/ids"
job() {
        local mode=$1 n=${world:-4} r sock how
        shift
        job_no=$((job_no + 1))
        job_pids=()
        for ((r = 0; r < n; r++)); do
                sock=$tmp/A.sock how=--join
                ((r >= n / 2)) && sock=$tmp/B.sock
                ((r == 0)) && how=--create
                "$rank" --socket "$sock" --id-file "$tmp/ids/id.$job_no" --world "$n" --rank "$r" $how \
                        --mode "$mode" "$@" >"$tmp/${out:-rank}$r.out" 2>&1 &
                job_pids+=($!)
                pids+=($!)
        done
}

# job_wait SECONDS: every rank of the job exits 0 within SECONDS.
job_wait() {
        local limit=$1 r st
        for r in "${!job_pids[@]}"; do
                wait_until "$limit" "rank $r to exit" bash -c "! kill -0 ${job_pids[$r]} 2>/dev/null"
                wait "${job_pids[$r]}"
                st=$?
                ((st == 0)) || fail "rank $r exited $st: $(cat "$tmp/${out:-rank}$r.out")"
        done
        for r in "${!job_pids[@]}"; do
                cat "$tmp/${out:-rank}$r.out"
        done
}

# ------------------------------------------------------------ F. flap
phase="flap"
# RSS may grow this much (KiB) over the rounds: allocator caches. Under
# ASan the quarantine keeps freed memory (256 MiB by default): it is kept
# small, and its size allowed (as attack.sh does).
rss_slack=8192
if [[ $(ldd "$moeepd" 2>/dev/null) == *libasan* ]]; then
        export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}quarantine_size_mb=16
        rss_slack=$((64 * 1024))
fi
start A "$port_a" "$b"
# peers_held: A's transport peers held now (connected + draining), from
# moeepctl metrics.
peers_held() {
        "$moeepctl" --socket "$tmp/A.sock" --json metrics | python3 -c '
import json, sys
d = {f["name"]: f for f in json.load(sys.stdin)}
print(int(sum(s["value"] for s in d["moeepd_transport_peers"]["samples"])))'
}
none_held() { [[ $(peers_held) == 0 ]]; }
# transport_rounds: lines of A's log where a connection as B connected its
# transport, and the highest index they name.
transport_rounds() { grep -c "mesh: peer $b: transport connected" "$tmp/A.log"; }
highest_index() {
        grep -oE "mesh: peer $b: transport connected \(transport peer [0-9]+" "$tmp/A.log" | grep -oE "[0-9]+$" |
                sort -n | tail -n 1
}
# a_fds: A's open fds once the count held still for 200 ms (the session of
# the last moeepctl may be closing).
a_fds() {
        local n m i
        n=$(find "/proc/${daemon_pid[A]}/fd" -mindepth 1 | wc -l)
        for ((i = 0; i < 50; i++)); do
                sleep 0.2
                m=$(find "/proc/${daemon_pid[A]}/fd" -mindepth 1 | wc -l)
                ((m == n)) && break
                n=$m
        done
        echo "$n"
}
"$attack" flap "$tmp/key" "$port_a" "$a" "$b" 1 >"$tmp/flap1.out" 2>&1 || fail "flap: $(cat "$tmp/flap1.out")"
wait_until 10 "A to free the first round's transport peer" none_held
fds_first=$(a_fds)
rss_first=$(awk '/^VmRSS:/ { print $2 }' "/proc/${daemon_pid[A]}/status")
"$attack" flap "$tmp/key" "$port_a" "$a" "$b" 1000 >"$tmp/flap.out" 2>&1 || fail "flap: $(cat "$tmp/flap.out")"
cat "$tmp/flap.out"
wait_until 10 "A to free every transport peer of the rounds" none_held
fds_last=$(a_fds)
rss_last=$(awk '/^VmRSS:/ { print $2 }' "/proc/${daemon_pid[A]}/status")
rounds=$(transport_rounds) highest=$(highest_index)
echo "flap: $rounds rounds connected a transport peer, highest index $highest; A's fds $fds_first -> $fds_last, resident $rss_first -> $rss_last KiB"
((rounds >= 1001)) || fail "only $rounds rounds connected a transport peer at A"
((highest < 4)) || fail "a round's transport peer had index $highest: failed ones were not reused"
((fds_last <= fds_first)) || fail "A holds $((fds_last - fds_first)) more fds after 1000 rounds"
((rss_last - rss_first < rss_slack)) ||
        fail "A's resident memory grew by $((rss_last - rss_first)) KiB over 1000 rounds (at most $rss_slack)"
log_has A "freed" || fail "A's log does not tell a transport peer freed"
echo "ok: flap: 1000 connect-and-fail rounds reused A's transport peer indexes; no fd, no transport peer and no memory kept"

# ------------------------------------------------------------ set-up
phase="set-up"
rounds=$(transport_rounds)
b_connected() { (($(transport_rounds) > rounds)); }
start B "$port_b" "$a"
wait_until 10 "A's transport connection to B" b_connected
wait_until 10 "B's transport connection to A" log_has B "mesh: peer $a: transport connected"
log_has A "datapath: transport fabric provider tcp open, proxy running" || fail "A: no data path line"
echo "ok: both daemons opened fabric tcp and connected their transports over the mesh"

# ------------------------------------------------------------ 0. caps
phase="caps"
chmod 0711 "$tmp" # uid 65534 reaches A's socket
"$rank" --socket "$tmp/A.sock" --mode retire --uid 65534 --count 4 --size $((16 << 20)) \
        --duration 11000 --timeout 40 >"$tmp/retire.out" 2>&1 &
retire_pid=$!
pids+=("$retire_pid")
wait_until 20 "uid 65534 to reach its cap" grep -q refused "$tmp/retire.out"
"$rank" --socket "$tmp/A.sock" --mode victim --size $((16 << 20)) >"$tmp/victim.out" 2>&1 ||
        fail "root's regions: $(cat "$tmp/victim.out")"
wait_until 30 "uid 65534 to register again" bash -c "! kill -0 $retire_pid 2>/dev/null"
wait "$retire_pid" || fail "uid 65534: $(cat "$tmp/retire.out")"
cat "$tmp/retire.out" "$tmp/victim.out"
echo "ok: caps: released proxy regions count against max_proxy_bytes_per_uid until freed; another uid registers meanwhile; max_proxy_bytes holds"

# ------------------------------------------------------------ 1. data
phase="data"
job data --count 500 --size 1024
job_wait 60
grep -q "every byte and counter from 2 remote ranks checked" "$tmp/rank3.out" || fail "rank 3 checked nothing"
echo "ok: 4 ranks, 2 per daemon: every byte and counter from the other daemon's ranks arrived"

# ------------------------------------------------------------ 2, 3. bad descriptors
for mode in bad-local bad-range; do
        phase=$mode
        job "$mode"
        job_wait 30
        echo "ok: $mode: the writer's ring failed with a clear error, the job was aborted naming it"
done
log_has A "peer not routed: a rank at the ring's own daemon" || fail "A's log does not name the unrouted peer"
log_has B "range outside a region" || fail "B's log does not name the bad range"

# ------------------------------------------------------------ 4. elastic
phase="elastic"
job elastic --count 64 --size 4096 --ready-file "$tmp/ready-elastic" --timeout 30
wait_until 20 "rank 0 to stream" test -e "$tmp/ready-elastic"
sleep 0.2
kill -KILL "${job_pids[3]}"
wait "${job_pids[3]}" 2>/dev/null
for r in 0 1 2; do
        wait_until 20 "rank $r to end" bash -c "! kill -0 ${job_pids[$r]} 2>/dev/null"
        wait "${job_pids[$r]}" || fail "rank $r exited $?: $(cat "$tmp/rank$r.out")"
        cat "$tmp/rank$r.out"
done
echo "ok: rank 3 killed mid-transfer: writes to it for 300 ms more landed, no ring failed"
# ------------------------------------------------------------ 5. release
# A tenant's fault ends its own job only (issue 27, item 4): rank 0 of job X
# releases its recv region and rank 2 (at B) keeps writing to it, while job
# V streams both ways between the same two daemons. X's writer's ring fails
# ("released") and X is aborted naming it; V streams on to its end without
# an error, and neither daemon fails its transport connection.
phase="release"
peer_failures() { grep -c "transport peer [0-9]* ([^)]*) failed" "$tmp/A.log" "$tmp/B.log" | awk -F: '{ n += $2 } END { print n }'; }
failed_before=$(peer_failures)
out=v job stream-ok --count 64 --size 4096 --duration 5000 --ready-file "$tmp/v.ready" --timeout 30
v_pids=("${job_pids[@]}")
wait_until 20 "job V to stream" test -e "$tmp/v.ready"
out=x job release-write --count 64 --size 4096 --timeout 20
out=x job_wait 30
job_pids=("${v_pids[@]}")
out=v job_wait 30
(($(peer_failures) == failed_before)) || fail "a transport connection failed: $(grep "transport peer" "$tmp/A.log" "$tmp/B.log" | tail -n 3)"
log_has B "the receiving rank released its region" || fail "B's log does not name the released region"
echo "ok: release: job X's writer into a released region failed its own ring, X was aborted naming it; job V streamed on without an error, no transport connection failed"

# ------------------------------------------------------------ 6. flood
# One tenant floods the connection every job between the two daemons
# shares (review finding 2). Job F (uid 65534, one rank at each daemon:
# 60 MiB of regions each, under max_proxy_bytes_per_uid) has both ranks
# write their whole 30 MiB send region per descriptor to each other as fast
# as their rings take them, for 6 s, while job V (root) streams both ways.
# The proxies hold F's rings back instead of letting its writes queue past
# the write timeout (which failed the transport peer, aborting V too): F's
# writes go on without an error (F leaves with the rest queued), V streams
# on to its end without an error, no transport connection fails.
phase="flood"
failed_before=$(peer_failures)
out=v job stream-ok --count 64 --size 4096 --duration 9000 --ready-file "$tmp/v2.ready" --timeout 60
v_pids=("${job_pids[@]}")
wait_until 20 "job V to stream" test -e "$tmp/v2.ready"
world=2 out=f job flood --count 1 --size $((10 << 20)) --duration 6000 --timeout 60 --uid 65534
out=f job_wait 60
job_pids=("${v_pids[@]}")
out=v job_wait 60
(($(peer_failures) == failed_before)) || fail "a transport connection failed: $(grep "transport peer" "$tmp/A.log" "$tmp/B.log" | tail -n 3)"
echo "ok: flood: job F's rings were held back and their writes went on without an error; job V streamed on without an error, no transport connection failed"

# ------------------------------------------------------------ 7. kill
phase="kill"
job stream --count 64 --size 4096 --ready-file "$tmp/ready" --timeout 30
wait_until 20 "rank 0 to stream" test -e "$tmp/ready"
sleep 0.2
killed_ns=$(date +%s%N)
kill -KILL "${daemon_pid[B]}"
wait "${daemon_pid[B]}" 2>/dev/null
unset 'daemon_pid[B]'
for r in 0 1; do
        wait_until 10 "rank $r at A to see the loss" bash -c "! kill -0 ${job_pids[$r]} 2>/dev/null"
        wait "${job_pids[$r]}" || fail "rank $r exited $?: $(cat "$tmp/rank$r.out")"
        line=$(grep "stream ended" "$tmp/rank$r.out") || fail "rank $r: $(cat "$tmp/rank$r.out")"
        seen_ns=${line##* at }
        echo "$line"
        echo "rank $r: the loss of B reached it $(((seen_ns - killed_ns) / 1000000)) ms after the SIGKILL"
done
kill -KILL "${job_pids[2]}" "${job_pids[3]}" 2>/dev/null
kill -0 "${daemon_pid[A]}" || fail "A died"
echo "ok: B killed mid-transfer: both ranks at A ended with an error, not a hang; A serves on"

# ------------------------------------------------------------ 8. stop
phase="stop"
kill -TERM "${daemon_pid[A]}"
wait_until 10 "A to exit" bash -c "! kill -0 ${daemon_pid[A]} 2>/dev/null"
wait "${daemon_pid[A]}"
st=$?
unset 'daemon_pid[A]'
((st == 0)) || fail "A exited $st on SIGTERM"
echo "ok: A exits 0 on SIGTERM"
