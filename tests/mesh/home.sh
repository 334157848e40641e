#!/usr/bin/env bash
# A cluster-key holder playing the home daemon B of jobs whose ranks join at
# a real moeepd A on 127.0.0.1 (mesh-attack.c's `mirrors` and `unread`; A
# names B in mesh_peers, and nothing else listens at B's address).
#
#   home.sh MOEEPD MOEEPCTL MESH_ATTACK
#
# a. Mirrors: A holds max_mirrors_per_peer (4) mirrors of B's jobs; the next
#    join is refused naming the cap and B gets PeerLeave of it. The mirrors
#    are nobody's: meanwhile this uid (root's when the test runs as root,
#    the uid they used to count against) creates max_jobs_per_uid (2) jobs
#    of its own, and `moeepctl jobs` lists the mirrors without an owner.
# b. A home that stops reading: a rank at A waits in a barrier while B
#    sends PeerPings (and a PeerPong now and then, so it never looks silent)
#    and reads nothing. A fails the connection once its answers fill the
#    4 MiB queue, logged with the bytes queued, rather than dropping
#    messages and keeping it; the rank's barrier ends with the home lost,
#    and A serves on.
#
# Everything it starts is killed and its temp dir removed on any exit;
# every wait is bounded.
set -uo pipefail

if [[ $# -ne 3 ]]; then
        echo "usage: $0 MOEEPD MOEEPCTL MESH_ATTACK" >&2
        exit 2
fi
moeepd=$(realpath "$1") moeepctl=$(realpath "$2") attack=$(realpath "$3")

test_name=mesh-home
# shellcheck source=lib.sh
source "$(dirname "$(realpath "$0")")/lib.sh"

read -r port_a port_b < <(free_ports 2) || fail "no free ports"
a=127.0.0.1:$port_a b=127.0.0.1:$port_b
printf '%s\n' "moeep-mesh-home-key-0b5c7e21d9a4f683" >"$tmp/good.key"
chmod 600 "$tmp/good.key"
cat >"$tmp/A.conf" <<CONF
[moeepd]
socket = $tmp/A.sock
log_level = info
max_jobs_per_uid = 2
max_mirrors_per_peer = 4
mesh_listen = $a
mesh_peers = $b
cluster_key_file = $tmp/good.key
CONF
"$moeepd" --config "$tmp/A.conf" --foreground >"$tmp/A.log" 2>&1 &
daemon_pid[A]=$!
wait_until 10 "moeepd A to listen" test -S "$tmp/A.sock"

# ------------------------------------------------------------ a. mirrors
phase=mirrors
"$attack" mirrors "$tmp/good.key" "$port_a" "$a" "$b" "$tmp/A.sock" 4 2 \
        "'$moeepctl' --socket '$tmp/A.sock' --json jobs >'$tmp/jobs.json'" >"$tmp/mirrors.out" 2>&1 ||
        fail "mirrors: $(cat "$tmp/mirrors.out")"
cat "$tmp/mirrors.out"
# The home names its jobs "home-test"; this uid's are "own-N".
python3 - "$tmp/jobs.json" "$(id -u)" <<'PY' || fail "moeepctl jobs while the mirrors were held: $(cat "$tmp/jobs.json")"
import json, sys
jobs, uid = json.load(open(sys.argv[1])), int(sys.argv[2])
mirrors = [j for j in jobs if j["name"] == "home-test"]
own = [j for j in jobs if j["name"].startswith("own-")]
assert len(mirrors) == 4 and all(j["owner_uid"] is None for j in mirrors), mirrors
assert len(own) == 2 and all(j["owner_uid"] == uid for j in own), own
PY
echo "ok: 4 mirrors of B's jobs at A (max_mirrors_per_peer), the fifth refused and B told; uid $(id -u) created its 2 jobs meanwhile; moeepctl jobs shows the mirrors without an owner"

# ------------------------------------------------------------ b. unread
phase=unread
"$attack" unread "$tmp/good.key" "$port_a" "$a" "$b" "$tmp/A.sock" 20 >"$tmp/unread.out" 2>&1 ||
        fail "unread: $(cat "$tmp/unread.out")"
cat "$tmp/unread.out"
grep -qE "mesh: peer $b \([^)]*\) down: it stopped reading: [0-9]+ bytes queued, no room for more \(at most 4194304\)" "$tmp/A.log" ||
        fail "A did not log the connection failed with the bytes queued"
grep -q "no PeerPong" "$tmp/A.log" && fail "A took the home down for silence, not for its queue"
grep -q "dropping a message" "$tmp/A.log" && fail "A dropped messages"
"$attack" probe "$tmp/A.sock" 1 200 >"$tmp/probe.out" 2>&1 || fail "A after the unread home: $(cat "$tmp/probe.out")"
echo "ok: A failed the connection of a home that stopped reading ($(grep -oE '[0-9]+ bytes queued' "$tmp/A.log" | head -n 1)), the waiting rank saw its home lost; then $(cat "$tmp/probe.out")"

kill -TERM "${daemon_pid[A]}"
wait_until 15 "A to exit after SIGTERM" eval '! alive '"${daemon_pid[A]}"
wait "${daemon_pid[A]}" || fail "A exited non-zero after SIGTERM"
echo "ok: mesh-home"
