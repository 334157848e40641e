#!/usr/bin/env bash
# Operator rights come from the admin socket, never from the uid (issue 15,
# item 5), against the real moeepd:
#
# 1. The admin socket is 0600 and root's.
# 2. Root on the client socket (a container running as root without a user
#    namespace) cannot drain, set the log level, list the mesh, or see the
#    job and the client of uid 65534; the admin socket sees both.
# 3. 70 idle uid-0 connections on the client socket (each says Hello, then
#    nothing; past max_sessions_per_uid = 64) do not stop the operator: status on the
#    admin socket answers within 100 ms, `moeepctl status` works; the
#    client caps still hold for uid 0 on the client socket.
# 4. The admin socket has its own small cap (16), separate from the client
#    caps.
# 5. Listings stay fast at the caps: 1,000 sessions, and status, clients and
#    jobs on the admin socket answer within 100 ms.
# 6. Where the admin socket goes (issue 27, item 5): beside a client socket
#    gpu0.sock in DIR it is DIR-admin/gpu0.sock (0600 in a 0700 directory
#    the daemon made and removes), never in DIR; an admin directory of
#    another uid stops the daemon, naming the owner, and moeepctl does not
#    use a socket another uid serves there; an admin socket named below the
#    client socket's directory is refused.
# 7. Under socket activation the two sockets are told apart by their fd
#    names (client, admin), whatever their paths; an admin socket that is
#    open to more than its owner, or beside the client socket, is warned
#    about.
# Then the daemon's fds are back to their baseline and SIGTERM exits 0.
#
#   ops-admin.sh MOEEPD MOEEPCTL RANK PROBE
source "$(dirname "$(realpath "$0")")/ops-lib.sh"

# uid 65534 runs copies of the probe and the rank, with their libmoeep,
# from $tmp (0755): the build tree may be where it cannot reach (a checkout
# under /root, mode 0700), and then exec or the loader would fail with
# "Permission denied", which check 1 below would take for the socket's.
mkdir "$tmp/bin"
cp "$probe" "$rank" "$tmp/bin/"
lib=$(ldd "$rank" | awk '$1 == "libmoeep.so.0" { print $3 }')
[[ -n $lib ]] && cp -L "$lib" "$tmp/bin/libmoeep.so.0"
probe=$tmp/bin/$(basename "$probe") rank=$tmp/bin/$(basename "$rank")
nobody=(env "LD_LIBRARY_PATH=$tmp/bin" setpriv --reuid=65534 --regid=65534 --clear-groups)

cat >"$conf" <<CONF
[moeepd]
socket = $sock
socket_mode = 0666
log_level = info
max_sessions_per_uid = 64
CONF

# 1. The sockets.
phase="sockets"
start_daemon
[[ $(stat -c '%a %u' "$admin") == "600 0" ]] || fail "admin socket is $(stat -c '%a %u' "$admin"), want 600 0"
[[ $(stat -c '%a' "$sock") == "666" ]] || fail "client socket is $(stat -c '%a' "$sock"), want 666"
if timeout 10 "${nobody[@]}" "$probe" "$admin" 1 100 >"$tmp/nobody.out" 2>&1; then
        fail "uid 65534 connected to the admin socket"
fi
grep -q "Permission denied" "$tmp/nobody.out" || fail "uid 65534 on the admin socket: $(cat "$tmp/nobody.out")"
base=$(fds)
echo "ok: admin socket 0600 root's, client socket 0666; uid 65534 cannot open the admin socket ($base fds)"

# 2. Root on the client socket.
phase="root on the client socket"
mkdir "$tmp/victim" && chown 65534:65534 "$tmp/victim"
"${nobody[@]}" "$rank" --socket "$sock" --id-file "$tmp/victim/id" --name victim --world 1 --rank 0 --create \
        --hold --ready-file "$tmp/victim/ready" --timeout 60 >"$tmp/victim.log" 2>&1 &
pids+=($!)
victim_pid=$!
wait_until 30 "the victim job" test -e "$tmp/victim/ready"
for args in "drain:Drain" "drain --off:Drain" "log-level debug:LogLevelSet" "mesh:MeshList"; do
        # shellcheck disable=SC2086
        if timeout 20 "$moeepctl" --socket "$sock" --client ${args%%:*} >"$tmp/root.out" 2>"$tmp/root.err"; then
                fail "root ran moeepctl ${args%%:*} through the client socket"
        fi
        grep -q "${args##*:} is an operator command: only the admin socket accepts it" "$tmp/root.err" ||
                fail "moeepctl --client ${args%%:*}: $(cat "$tmp/root.err")"
done
rc=0
"$probe" "$sock" 1 1000 drain >"$tmp/probe-drain.out" 2>&1 || rc=$?
[[ $rc -eq 3 ]] || fail "Drain through libmoeep on the client socket: exit $rc: $(cat "$tmp/probe-drain.out")"
ctl root-clients --client --json clients
json "$tmp/root-clients.out" 'all(c["uid"] == 0 for c in d) and not any(c["pid"] == '"$victim_pid"' for c in d)'
ctl root-jobs --client --json jobs
json "$tmp/root-jobs.out" 'd == []'
ctl root-status --client --json status
json "$tmp/root-status.out" 'd["jobs"] == 0 and d["sessions"] == 1 and d["socket"] == "'"$sock"'"'
ctl admin-status --json status
json "$tmp/admin-status.out" 'd["draining"] is False and d["log_level"] == "info" and d["jobs"] == 1 and d["socket"] == "'"$admin"'"'
ctl admin-clients --json clients
json "$tmp/admin-clients.out" 'any(c["uid"] == 65534 and c["rank"] == 0 for c in d)'
ctl admin-jobs --json jobs
json "$tmp/admin-jobs.out" '[j["name"] for j in d] == ["victim"] and d[0]["owner_uid"] == 65534'
echo "ok: root on the client socket is refused drain, log-level and mesh, and sees none of uid 65534's job; the admin socket sees it"

# 3. 70 idle uid-0 connections on the client socket.
phase="idle uid-0 flood"
python3 "$here/ops-hold.py" "$sock" 70 30 "$tmp/hold.ready" "$tmp/hold.release" &
pids+=($!)
hold_pid=$!
wait_until 20 "the idle connections" test -e "$tmp/hold.ready"
wait_until 10 "64 idle sessions of uid 0" eval 'ctl flood-clients --json clients && python3 -c "import json,sys; sys.exit(sum(c[\"uid\"] == 0 and c[\"state\"] == \"hello\" and c[\"name\"] == \"\" for c in json.load(open(\"$tmp/flood-clients.out\"))) != 64)"'
worst=$(probe "$admin" 20)
start=$(date +%s%N)
ctl flood-status status
took=$((($(date +%s%N) - start) / 1000000))
((took < 1000)) || fail "moeepctl status took $took ms during the flood"
if "$probe" "$sock" 1 1000 >"$tmp/flood-probe.out" 2>&1; then
        fail "a 65th uid-0 session on the client socket was accepted"
fi
grep -q "uid 0 has 64 sessions" "$tmp/flood-probe.out" || fail "65th client session: $(cat "$tmp/flood-probe.out")"
touch "$tmp/hold.release"
wait "$hold_pid"
echo "ok: 70 idle uid-0 client connections: status on the admin socket within ${worst} ms (20 tries), moeepctl status in $took ms; uid 0's 65th client session refused"

# 4. The admin socket's own cap.
phase="admin cap"
python3 "$here/ops-hold.py" "$admin" 16 30 "$tmp/hold16.ready" "$tmp/hold16.release" &
pids+=($!)
hold_pid=$!
wait_until 20 "the idle admin connections" test -e "$tmp/hold16.ready"
wait_until 10 "the admin cap" eval '! "$probe" "$admin" 1 1000 >"$tmp/cap.out" 2>&1'
grep -q "admin sessions connected (at most 16)" "$tmp/cap.out" || fail "17th admin session: $(cat "$tmp/cap.out")"
probe "$sock" 5 >/dev/null
touch "$tmp/hold16.release"
wait "$hold_pid"
wait_until 10 "the admin socket again" eval '"$probe" "$admin" 1 100 >/dev/null'
echo "ok: the admin socket takes 16 sessions and refuses the 17th; client sessions are not affected"

# 5. Listings at the caps.
phase="listings at the caps"
sed -i 's/^max_sessions_per_uid = 64$/max_sessions_per_uid = 1024/' "$conf"
kill -HUP "$daemon_pid"
wait_until 10 "the reload" grep -q "configuration reloaded" "$log"
python3 "$here/ops-hold.py" "$sock" 1000 60 "$tmp/hold1k.ready" "$tmp/hold1k.release" &
pids+=($!)
hold_pid=$!
wait_until 30 "1,000 idle connections" test -e "$tmp/hold1k.ready"
wait_until 20 "1,000 sessions" eval 'ctl caps-status --json status && python3 -c "import json,sys; sys.exit(json.load(open(\"$tmp/caps-status.out\"))[\"sessions\"] < 1000)"'
for what in status clients jobs; do
        worst=$(probe "$admin" 5 "$what")
        echo "    $what with $(python3 -c "import json; print(json.load(open('$tmp/caps-status.out'))['sessions'])") sessions: slowest of 5 in $worst ms"
done
ctl caps-clients --json clients
json "$tmp/caps-clients.out" 'len(d) > 100'
touch "$tmp/hold1k.release"
wait "$hold_pid"
kill "$victim_pid"
wait "$victim_pid" 2>/dev/null
wait_until 10 "fds back to $base" eval '(( $(fds) <= base ))'
echo "ok: status, clients and jobs answer within 100 ms with 1,000 sessions; fds back to $(fds) (baseline $base)"
phase="stop"
stop_daemon

# 6. Where the admin socket goes (issue 27, item 5).
phase="admin socket placement"
mkdir "$tmp/place" && chmod 0755 "$tmp/place"
cat >"$tmp/place.conf" <<CONF
[moeepd]
socket = $tmp/place/gpu0.sock
socket_mode = 0666
CONF
"$moeepd" --config "$tmp/place.conf" --foreground >"$tmp/place.log" 2>&1 &
daemon_pid=$!
pids+=("$daemon_pid")
wait_until 20 "gpu0.sock" test -S "$tmp/place/gpu0.sock"
wait_until 20 "its admin socket" test -S "$tmp/place-admin/gpu0.sock"
[[ $(ls -A "$tmp/place") == gpu0.sock ]] || fail "the client socket's directory holds more than gpu0.sock: $(ls -A "$tmp/place")"
[[ $(stat -c '%a %u' "$tmp/place-admin") == "700 0" ]] || fail "the admin directory is $(stat -c '%a %u' "$tmp/place-admin")"
[[ $(stat -c '%a %u' "$tmp/place-admin/gpu0.sock") == "600 0" ]] || fail "the admin socket is $(stat -c '%a %u' "$tmp/place-admin/gpu0.sock")"
[[ $(stat -c '%a' "$tmp/place/gpu0.sock") == 666 ]] || fail "gpu0.sock is mode $(stat -c '%a' "$tmp/place/gpu0.sock")"
rc=0
"$probe" "$tmp/place/gpu0.sock" 1 1000 drain >"$tmp/place-drain.out" 2>&1 || rc=$?
[[ $rc -eq 3 ]] || fail "Drain through gpu0.sock: exit $rc: $(cat "$tmp/place-drain.out")"
timeout 10 "$moeepctl" --socket "$tmp/place/gpu0.sock" drain --off >/dev/null 2>"$tmp/place-ctl.err" ||
        fail "moeepctl drain --off through the derived admin socket: $(cat "$tmp/place-ctl.err")"
stop_daemon
[[ ! -e $tmp/place-admin ]] || fail "the admin directory the daemon made is left behind"
echo "ok: client socket gpu0.sock: the admin socket is $tmp/place-admin/gpu0.sock (0600 in 0700), nothing beside gpu0.sock; Drain refused there, moeepctl finds the admin socket"

# An admin directory someone else made first: the daemon refuses to start.
mkdir -m 0700 "$tmp/place-admin" && chown 65534:65534 "$tmp/place-admin"
if timeout 10 "$moeepd" --config "$tmp/place.conf" --foreground >"$tmp/place2.log" 2>&1; then
        fail "moeepd started with an admin directory of uid 65534"
fi
grep -q "directory $tmp/place-admin is owned by uid 65534, not by the daemon's uid 0" "$tmp/place2.log" ||
        fail "no word of the admin directory's owner: $(tail -n 3 "$tmp/place2.log")"
# uid 65534 serving a socket there: moeepctl does not take it for the daemon's.
"${nobody[@]}" /usr/bin/python3 -c '
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o666); s.listen(8)
open(sys.argv[2], "w").close()
s.settimeout(10)
try:
    c, _ = s.accept(); time.sleep(2)
except OSError:
    pass' "$tmp/place-admin/gpu0.sock" "$tmp/place-admin/ready" &
pids+=($!)
wait_until 10 "the fake admin socket" test -e "$tmp/place-admin/ready"
if timeout 10 "$moeepctl" --socket "$tmp/place/gpu0.sock" drain >/dev/null 2>"$tmp/fake-ctl.err"; then
        fail "moeepctl drain succeeded against a socket of uid 65534"
fi
grep -q "is served by uid 65534, neither root nor you: not the daemon's, not used" "$tmp/fake-ctl.err" ||
        fail "moeepctl does not say why it did not use the fake admin socket: $(cat "$tmp/fake-ctl.err")"
rm -rf "$tmp/place-admin"
# admin_socket named inside the client socket's directory: refused.
printf 'admin_socket = %s\n' "$tmp/place/sub/admin.sock" >>"$tmp/place.conf"
mkdir -m 0700 "$tmp/place/sub"
if timeout 10 "$moeepd" --config "$tmp/place.conf" --foreground >"$tmp/place3.log" 2>&1; then
        fail "moeepd started with its admin socket below the client socket's directory"
fi
grep -q "is the client socket's directory or below it" "$tmp/place3.log" ||
        fail "no word of the admin socket inside the client socket's directory: $(tail -n 3 "$tmp/place3.log")"
echo "ok: an admin directory of uid 65534 stops the daemon (naming the owner), moeepctl does not use a socket uid 65534 serves there, and an admin socket below the client socket's directory is refused"
log=$tmp/moeepd.log

# 7. Socket activation: two sockets told apart by name.
phase="socket activation"
command -v systemd-socket-activate >/dev/null || { echo "skip: no systemd-socket-activate"; exit 0; }
log=$tmp/activated.log
umask 022 # systemd-socket-activate binds under it: the admin socket comes out 0644
systemd-socket-activate --seqpacket -l "$tmp/act.sock" -l "$tmp/operator.sock" --fdname=client:admin \
        "$moeepd" --no-config --foreground >"$log" 2>&1 &
daemon_pid=$!
pids+=("$daemon_pid")
wait_until 10 "the activated sockets" test -S "$tmp/act.sock" -a -S "$tmp/operator.sock"
"$probe" "$tmp/act.sock" 1 5000 >/dev/null || fail "the activated daemon does not answer"
if "$probe" "$tmp/act.sock" 1 1000 drain >"$tmp/act.out" 2>&1; then
        fail "Drain accepted on the activated client socket"
fi
"$probe" "$tmp/operator.sock" 1 1000 drain >"$tmp/act.out" 2>&1 || fail "Drain refused on the activated admin socket: $(cat "$tmp/act.out")"
grep -q "listening on the admin socket systemd passed (fd 4, 'admin')" "$log" || fail "no admin socket from systemd in the log"
[[ ! -e ${tmp}-admin/act.sock ]] || fail "the daemon bound an admin socket of its own besides systemd's"
grep -q "admin socket $tmp/operator.sock is mode 0644: anyone who can open it is an operator" "$log" ||
        fail "no warning about the admin socket's mode 0644"
grep -q "admin socket $tmp/operator.sock is in the client socket's directory or below it" "$log" ||
        fail "no warning about the admin socket beside the client socket"
stop_daemon
echo "ok: socket activation: the fd named admin is the admin socket, the one named client is not"
echo "ops-admin: all checks passed"
