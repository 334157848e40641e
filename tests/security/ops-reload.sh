#!/usr/bin/env bash
# SIGHUP reads only a regular file of bounded size (issue 15, item 8),
# against the real moeepd. The configuration is a symlink, as configuration
# management makes it; it is pointed at /dev/zero, /dev/urandom, a FIFO
# nobody writes, a directory, a 100 MiB file and a file with a NUL byte.
# After each SIGHUP:
# - the refusal is logged, naming the path and what was wrong;
# - a well-behaved client is served within 100 ms (admin and client socket);
# - the daemon used less than 0.3 s of CPU in the second after it;
# - the running configuration stays (log level notice from the good file,
#   a cap that the bad reload would not have changed) and the failed reload
#   is counted.
# Then the good file, changed, is reloaded: reloading still works.
#
#   ops-reload.sh MOEEPD MOEEPCTL RANK PROBE
source "$(dirname "$(realpath "$0")")/ops-lib.sh"

good=$tmp/good.conf
cat >"$good" <<CONF
[moeepd]
socket = $sock
log_level = notice
max_jobs_per_uid = 3
CONF
ln -s "$good" "$conf"

phase="start"
start_daemon
ctl status --json status
json "$tmp/status.out" 'd["log_level"] == "notice"'
base=$(fds)

mkfifo "$tmp/fifo"
mkdir "$tmp/dir"
truncate -s 100M "$tmp/huge.conf"
printf '[moeepd]\nlog_level = debug\n\0\n' >"$tmp/nul.conf"
# A file past 1 MiB that would parse: only its size is wrong.
{ echo "[moeepd]"; for ((i = 0; i < 40000; i++)); do echo "# comment line number $i, padding"; done; echo "log_level = debug"; } >"$tmp/big.conf"

failed=0
for case in "/dev/zero:is a character device (through a symbolic link), not a regular file" \
        "/dev/urandom:is a character device (through a symbolic link), not a regular file" \
        "$tmp/fifo:is a FIFO (through a symbolic link), not a regular file" \
        "$tmp/dir:is a directory (through a symbolic link), not a regular file" \
        "$tmp/huge.conf:104857600 bytes (through a symbolic link): larger than the 1048576 bytes a configuration may have" \
        "$tmp/big.conf: bytes (through a symbolic link): larger than the 1048576 bytes a configuration may have" \
        "$tmp/nul.conf:a NUL byte at offset 27: not a text file"; do
        target=${case%%:*} why=${case#*:}
        phase="SIGHUP with the configuration -> $target"
        ln -sfn "$target" "$conf"
        before=$(cpu_ticks)
        kill -HUP "$daemon_pid"
        failed=$((failed + 1))
        worst=$(probe "$admin" 10)
        probe "$sock" 3 >/dev/null
        wait_until 5 "refusal $failed in the log" eval '(( $(grep -c "keeping the previous configuration" "$log") == failed ))'
        grep "keeping the previous configuration" "$log" | tail -n 1 | grep -qF "reload: $conf: " ||
                fail "the refusal does not name $conf: $(tail -n 1 "$log")"
        grep "keeping the previous configuration" "$log" | tail -n 1 | grep -qF "$why: keeping" ||
                fail "the refusal does not say '$why': $(tail -n 1 "$log")"
        sleep 1
        used=$(($(cpu_ticks) - before))
        ((used < 30)) || fail "moeepd used $used clock ticks of CPU in the second after SIGHUP"
        ctl status --json status
        json "$tmp/status.out" 'd["log_level"] == "notice"'
        ctl metrics metrics
        grep -qx "moeepd_config_reloads_total{result=\"failed\"} $failed" "$tmp/metrics.out" ||
                fail "failed reloads: $(grep reloads_total "$tmp/metrics.out")"
        echo "ok: $target refused ($why); served within $worst ms, $used CPU ticks in the next second"
done
# The cap the good file set is still in force: uid 0 may create 3 jobs.
phase="the configuration stays"
for i in 1 2 3 4; do
        "$rank" --socket "$sock" --id-file "$tmp/job$i.id" --name "job$i" --world 2 --rank 0 --create --hold \
                --ready-file "$tmp/job$i.ready" --timeout 30 >"$tmp/job$i.log" 2>&1 &
        pids+=($!)
        job_pids[i]=$!
done
wait_until 20 "three jobs" eval 'ctl jobs --json jobs && python3 -c "import json,sys; sys.exit(len(json.load(open(\"$tmp/jobs.out\"))) != 3)"'
wait_until 20 "the fourth job to be refused" eval 'grep -q "max_jobs_per_uid" "$tmp"/job*.log'
for i in 1 2 3 4; do kill -KILL "${job_pids[i]}" 2>/dev/null; wait "${job_pids[i]}" 2>/dev/null; done
echo "ok: max_jobs_per_uid = 3 of the good file still holds"

phase="good reload"
ln -sfn "$good" "$conf"
sed -i 's/^log_level = notice$/log_level = info/' "$good"
kill -HUP "$daemon_pid"
wait_until 5 "the reload" grep -q "configuration reloaded from $conf, log level info" "$log"
ctl status --json status
json "$tmp/status.out" 'd["log_level"] == "info"'
wait_until 10 "fds back to $base" eval '(( $(fds) <= base ))'
stop_daemon
echo "ok: the good file reloads (log level info); fds back to baseline; SIGTERM exits 0"
echo "ops-reload: all checks passed"
