#!/usr/bin/env bash
# The GPU-memory transports on a host without their device (CI): moeepd
# keeps serving, without the internode data path, and a rank that asks for
# it is told why, naming the transport and what is missing.
#
#   transport-nodevice.sh MOEEPD MOEEPCTL PROXY_RANK
#
# 1. transport = cuda where libcuda.so.1 (or a GPU) is missing: the daemon
#    starts, logs "transport cuda: cannot load libcuda.so.1: ..." (or the
#    driver's "no CUDA device"), answers moeepctl, and a rank's proxy region
#    is refused with that text. Skipped (77) where the cuda transport opens.
# 2. transport = verbs without an RDMA device: the same with
#    "transport verbs: no RDMA device". Skipped where a device exists.
# 3. transport = cuda2: the configuration is refused at start, naming the
#    key and the backends there are.
set -uo pipefail

if [[ $# -ne 3 ]]; then
        echo "usage: $0 MOEEPD MOEEPCTL PROXY_RANK" >&2
        exit 2
fi
moeepd=$(realpath "$1") ctl=$(realpath "$2") rank=$(realpath "$3")

test_name="transport-nodevice"
# shellcheck source=lib.sh
source "$(dirname "$(realpath "$0")")/lib.sh"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') ||
        fail "no free port"
printf '%s\n' "moeep-transport-nodevice-key-3f0a" >"$tmp/key"
chmod 600 "$tmp/key"
skipped=0

# run_case NAME TRANSPORT WANT: a daemon with TRANSPORT; WANT is the text
# (a grep -E pattern) its log and the rank's refusal must hold.
run_case() {
        local name=$1 transport=$2 want=$3 st
        phase=$name
        cat >"$tmp/$name.conf" <<CONF
[moeepd]
socket = $tmp/$name.sock
log_level = info
mesh_listen = 127.0.0.1:$port
mesh_peers =
cluster_key_file = $tmp/key
transport = $transport
CONF
        "$moeepd" --config "$tmp/$name.conf" --foreground >>"$tmp/$name.log" 2>&1 &
        daemon_pid[$name]=$!
        wait_until 10 "moeepd $name to listen" test -S "$tmp/$name.sock"
        wait_until 5 "moeepd $name to say how its transport opened" \
                grep -qE "datapath: (transport $transport .*open|this daemon has no internode data path)" "$tmp/$name.log"
        if grep -q "datapath: transport $transport .*open" "$tmp/$name.log"; then
                echo "skip: $name: the $transport transport opened on this host"
                skipped=$((skipped + 1))
        else
                grep -qE "this daemon has no internode data path: $want" "$tmp/$name.log" ||
                        fail "$name: the log does not say '$want'"
                "$ctl" --socket "$tmp/$name.sock" status >"$tmp/$name-status.out" 2>&1 ||
                        fail "$name: moeepctl status failed: $(cat "$tmp/$name-status.out")"
                # Two ranks, both here: the first barrier needs them both.
                "$rank" --socket "$tmp/$name.sock" --id-file "$tmp/$name.id" --world 2 --rank 1 --join \
                        --mode data --timeout 10 >"$tmp/$name-rank1.out" 2>&1 &
                pids+=($!)
                "$rank" --socket "$tmp/$name.sock" --id-file "$tmp/$name.id" --world 2 --rank 0 --create \
                        --mode data --timeout 10 >"$tmp/$name-rank.out" 2>&1
                st=$?
                ((st == 1)) || fail "$name: the rank exited $st, not 1: $(cat "$tmp/$name-rank.out")"
                grep -qE "$want" "$tmp/$name-rank.out" ||
                        fail "$name: the rank's error does not say '$want': $(cat "$tmp/$name-rank.out")"
                echo "ok: $name: moeepd serves without a data path; the rank was told: $(grep -oE "$want[^)]*" "$tmp/$name-rank.out" | head -1)"
        fi
        kill -TERM "${daemon_pid[$name]}"
        wait "${daemon_pid[$name]}" || fail "$name: moeepd exited $? on SIGTERM"
        unset "daemon_pid[$name]"
}

run_case cuda cuda "transport cuda( device 0)?: (cannot load libcuda\.so\.1: |cuInit|no CUDA device)"
run_case verbs verbs "transport verbs: no RDMA device"

phase=config
cat >"$tmp/bad.conf" <<CONF
[moeepd]
socket = $tmp/bad.sock
transport = cuda2
CONF
timeout 10 "$moeepd" --config "$tmp/bad.conf" --foreground >"$tmp/bad.out" 2>&1 && fail "moeepd took transport = cuda2"
grep -q "transport 'cuda2': need fabric, verbs or cuda" "$tmp/bad.out" || fail "the refusal does not name the key: $(cat "$tmp/bad.out")"
echo "ok: transport = cuda2 refused at start: $(grep -o "transport 'cuda2'.*" "$tmp/bad.out" | head -1)"

((skipped == 2)) && exit 77
exit 0
