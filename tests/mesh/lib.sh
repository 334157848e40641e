# Shared by the mesh tests (mesh.sh, proxy.sh, attack.sh), sourced after their
# argument checks with `test_name` set: a temp dir, the processes a test
# starts (pids, daemon_pid[NAME]) killed and the dir removed on any exit
# (../tmpdir.sh), fail() with the last lines of every *.out and *.log, free
# ports, whether a process is alive and bounded waits.
# shellcheck shell=bash

# shellcheck source=../tmpdir.sh
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../tmpdir.sh"
declare -A daemon_pid=()
phase=start

fail() {
        local f
        echo "FAIL [$phase]: $*"
        for f in "$tmp"/*.out "$tmp"/*.log; do
                [[ -s $f ]] || continue
                echo "--- last lines of $f"
                tail -n 25 "$f"
        done
        exit 1
}

# free_ports N: N free TCP ports on 127.0.0.1, on one line.
free_ports() {
        python3 - "$1" <<'PY'
import socket
import sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

# alive PID: the process runs (a zombie does not).
alive() {
        local st
        st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
        [[ -n $st && ${st:0:1} != Z ]]
}

# shellcheck source=../wait.sh
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../wait.sh"
