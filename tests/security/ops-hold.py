"""Holds COUNT idle connections to a moeepd socket (no Hello), as a runaway
client or an attacker would, until the file RELEASE exists or SECONDS
passed; writes READY once every connect() returned. Bounded in count and
time.

    ops-hold.py SOCKET COUNT SECONDS READY RELEASE
"""
import os
import resource
import socket
import sys
import time

path, count, seconds, ready, release = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < count + 64:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 64), hard))
held = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    held.append(s)
open(ready, "w").close()
end = time.monotonic() + seconds
while time.monotonic() < end and not os.path.exists(release):
    time.sleep(0.05)
for s in held:
    s.close()
