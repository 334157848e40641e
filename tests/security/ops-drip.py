"""The drip-feeding attacker of ops-http.sh: opens TOTAL connections to the
metrics listener on 127.0.0.1:PORT (at most 200 new ones every 100 ms), and
sends each one byte of a request that never ends every INTERVAL seconds,
for SECONDS in all; connections the daemon closes are counted, not
reopened. Prints one JSON object:

  attempts      connections opened
  refused       answered 503 by the daemon (displaced: its source held its
                quota, or the most when every slot was taken)
  deadline      closed by the daemon without an answer (the deadline)
  open_at_end   still open when we stopped (must be 0 past the deadline)
  max_life_s    the longest a connection lived before the daemon closed it

Connections come from 127.0.0.1, or with FIRST and COUNT from COUNT
source addresses from FIRST on (127.0.1.1 and 24: 127.0.1.1 .. 127.0.1.24),
in turn.

    ops-drip.py PORT TOTAL SECONDS INTERVAL [FIRST COUNT]
"""
import errno
import json
import resource
import select
import socket
import sys
import time

port, total, seconds, interval = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
first = sys.argv[5] if len(sys.argv) > 5 else None
nsources = int(sys.argv[6]) if len(sys.argv) > 6 else 1


def source(i):
    """The i-th source address, or None for the default one."""
    if first is None:
        return None
    a = [int(x) for x in first.split(".")]
    n = a[3] - 1 + i % nsources
    return "%d.%d.%d.%d" % (a[0], a[1], a[2] + n // 254, 1 + n % 254)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, total + 256), hard))

request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Drip: " + b"a" * 4000
conns = {}  # fd -> [socket, established (None until then), bytes sent, next drip]
stats = {"attempts": 0, "refused": 0, "deadline": 0, "open_at_end": 0, "max_life_s": 0.0}
poll = select.poll()
start = time.monotonic()
end = start + seconds

def closed(fd, now, busy):
    s, opened, sent, _ = conns.pop(fd)
    poll.unregister(fd)
    s.close()
    if busy:
        stats["refused"] += 1
    else:
        stats["deadline"] += 1
        # (A connection never established is one the daemon never held.)
        stats["max_life_s"] = max(stats["max_life_s"], now - opened if opened is not None else 0.0)

while time.monotonic() < end:
    now = time.monotonic()
    for _ in range(200):
        if stats["attempts"] >= total:
            break
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if source(stats["attempts"]):
            s.bind((source(stats["attempts"]), 0))
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            stats["attempts"] += 1
            stats["refused"] += 1
            continue
        stats["attempts"] += 1
        # Established once writable (a loaded daemon's full backlog can
        # leave a SYN to be retransmitted): its life and drips start then.
        conns[s.fileno()] = [s, None, 0, now + 0.2]
        poll.register(s.fileno(), select.POLLIN | select.POLLOUT)
    for fd, ev in poll.poll(100):
        if fd not in conns:
            continue
        if ev & select.POLLOUT and conns[fd][1] is None:
            conns[fd][1] = time.monotonic()
            poll.modify(fd, select.POLLIN)
        if not ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
            continue
        try:
            data = conns[fd][0].recv(4096)
        except OSError:
            data = b""
        # The daemon answers only the refused: the request never ends.
        closed(fd, time.monotonic(), data.startswith(b"HTTP/1.1 503 "))
    now = time.monotonic()
    for fd in list(conns):
        c = conns[fd]
        if c[1] is not None and now >= c[3] and c[2] < len(request):
            try:
                c[0].send(request[c[2]:c[2] + 1])
                c[2] += 1
            except BlockingIOError:
                pass  # no room now: the next drip tries again
            except OSError:
                closed(fd, now, False)
                continue
            c[3] = now + interval
stats["open_at_end"] = len(conns)
stats["max_life_s"] = round(stats["max_life_s"], 2)
for c in conns.values():
    c[0].close()
print(json.dumps(stats))
