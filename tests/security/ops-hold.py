"""Holds COUNT idle connections to a moeepd socket, as a runaway client or
an attacker would, until the file RELEASE exists or SECONDS passed; writes
READY once every connect() returned. Each connection says Hello first (so
that a Hello deadline does not end it) and then nothing more; it never
reads. Bounded in count and time.

    ops-hold.py SOCKET COUNT SECONDS READY RELEASE
"""
import os
import resource
import socket
import struct
import sys
import time

# Request{hello: Hello{major: 1, minor: 3}} in a record (proto/record.h):
# magic "MEEP", major 1, type 1 (Hello), no fds, payload length, request id 1.
HELLO_BODY = bytes([0x08, 0x01, 0x10, 0x03])
PAYLOAD = bytes([0x0A, len(HELLO_BODY)]) + HELLO_BODY
HELLO = struct.pack("<IHHHHIQ", 0x5045454D, 1, 1, 0, 0, len(PAYLOAD), 1) + PAYLOAD

path, count, seconds, ready, release = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < count + 64:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 64), hard))
held = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.send(HELLO)
    held.append(s)
open(ready, "w").close()
end = time.monotonic() + seconds
while time.monotonic() < end and not os.path.exists(release):
    time.sleep(0.05)
for s in held:
    s.close()
