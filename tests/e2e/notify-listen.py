#!/usr/bin/env python3
"""A stand-in for systemd's notification socket (sd_notify(3)).

Binds an AF_UNIX datagram socket at PATH, writes each datagram it receives to
OUTFILE (one per line, newlines inside a datagram shown as spaces; flushed at
once) and stops after TIMEOUT seconds or on SIGTERM. The e2e test points a
daemon's NOTIFY_SOCKET at PATH and looks for READY=1 and STOPPING=1.
"""
import os
import signal
import socket
import sys


def main():
    if len(sys.argv) not in (3, 4):
        print("usage: notify-listen.py PATH OUTFILE [TIMEOUT]", file=sys.stderr)
        return 2
    path, outfile = sys.argv[1], sys.argv[2]
    timeout = float(sys.argv[3]) if len(sys.argv) == 4 else 300.0

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock.bind(path)
    sock.settimeout(timeout)
    with open(outfile, "a", buffering=1) as out:
        # Tells whoever started us that the socket exists.
        out.write("LISTENING\n")
        while True:
            try:
                data = sock.recv(65536)
            except socket.timeout:
                return 0
            out.write(data.decode("utf-8", "replace").replace("\n", " ").strip() + "\n")


if __name__ == "__main__":
    sys.exit(main())
