#!/usr/bin/env python3
"""Checks moeepctl's output for the e2e test.

  ctl-check.py status FILE              FILE is JSON, an object, reports >= 1 job
  ctl-check.py jobs FILE NAME WORLD     FILE is JSON; job NAME has WORLD joined ranks
  ctl-check.py clients FILE PID...      FILE is JSON; every PID is a client in a job
  ctl-check.py secret IDFILE FILE...    no part of the unique id's random bytes
                                        appears in any FILE (hex, HEX or base64)

Key names follow moeep.proto's messages (JobInfo, ClientInfo, Status); a few
spellings are accepted for the list wrappers. Exits 1 naming what is wrong.
"""
import base64
import binascii
import json
import sys


def fail(msg):
    print("ctl-check: " + msg, file=sys.stderr)
    sys.exit(1)


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        fail("%s is not valid JSON: %s" % (path, e))


def entries(doc, key):
    """The list of objects in `doc`: the document itself or doc[key]."""
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict) and isinstance(doc.get(key), list):
        return doc[key]
    fail("want a list or an object with a list %r, got %s" % (key, json.dumps(doc)[:200]))


def check_status(path):
    doc = load(path)
    if not isinstance(doc, dict):
        fail("status: want an object, got %s" % type(doc).__name__)
    jobs = doc.get("jobs")
    if not isinstance(jobs, int) or jobs < 1:
        fail("status: want jobs >= 1 while the job holds, got %r in %s" % (jobs, json.dumps(doc)))


def check_jobs(path, name, world):
    jobs = entries(load(path), "jobs")
    for job in jobs:
        if isinstance(job, dict) and job.get("name") == name:
            ranks = job.get("joined_ranks", job.get("ranks"))
            if isinstance(ranks, list):
                ranks = len(ranks)
            if ranks != world or job.get("world_size") != world:
                fail("jobs: job %r: world_size %r, joined ranks %r; want %d and %d"
                     % (name, job.get("world_size"), ranks, world, world))
            return
    fail("jobs: no job named %r in %s" % (name, json.dumps(jobs)[:400]))


def check_clients(path, pids):
    clients = entries(load(path), "clients")
    seen = {c.get("pid"): c for c in clients if isinstance(c, dict)}
    for pid in pids:
        c = seen.get(pid)
        if c is None:
            fail("clients: pid %d is not listed (pids listed: %s)" % (pid, sorted(p for p in seen if p)))
        rank = c.get("rank")
        if not isinstance(rank, int) or rank < 0:
            fail("clients: pid %d listed with rank %r, want its rank in the job" % (pid, rank))


def check_secret(idfile, paths):
    uid = open(idfile, "rb").read()
    text = "".join(open(p, errors="replace").read() for p in paths)
    # Random-looking 12-byte windows of the id: the secret is among them,
    # counters and zero padding are not.
    for i in range(len(uid) - 11):
        w = uid[i:i + 12]
        if len(set(w)) < 9:
            continue
        for form in (binascii.hexlify(w).decode(), binascii.hexlify(w).decode().upper(),
                     base64.b64encode(w).decode()[:12]):
            if form in text:
                fail("secret: bytes %d..%d of the unique id appear in moeepctl output as %r"
                     % (i, i + 11, form))


def main(argv):
    if len(argv) >= 3 and argv[1] == "status":
        check_status(argv[2])
    elif len(argv) == 5 and argv[1] == "jobs":
        check_jobs(argv[2], argv[3], int(argv[4]))
    elif len(argv) >= 4 and argv[1] == "clients":
        check_clients(argv[2], [int(p) for p in argv[3:]])
    elif len(argv) >= 4 and argv[1] == "secret":
        check_secret(argv[2], argv[3:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
