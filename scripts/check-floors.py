#!/usr/bin/env python3
"""Fails when a file of daemon/ reaches a floor above its own, or when files
of daemon/ call (or include) each other in a circle.

The daemon is built in floors, one folder each (docs/architecture.md,
"moeepd"), from the bottom up:

    ground    config, log, errors, fdorder (at the root of daemon/)
    state/    jobs, the broker, client fds
    mesh/     the peer daemons and the jobs across them
    datapath/ the internode data path: transports, proxy, their glue
    ops/      metrics, the HTTP listener, systemd notification
    clients/  the client sockets, sessions, requests, a rank's lifecycle
    roof      daemon.c, main.c (at the root): makes every object

A file may include a header of, and call a function defined in, its own
floor or one below; never one above (a lower floor that must hear from a
higher one is handed a callback, and only where several implement it). An
internal header (NAME-internal.h) is included only from its own folder.
Inside the daemon no two files call each other, directly or around a
circle, and no two modules (a file stem: x.c, x.h and x-internal.h are
module x) include each other around a circle: a circle is one concept
split in files that cannot be read alone.

Includes are read from the sources. Calls are read from the static library
moeepd_lib when its path is given (nm: what each object references and
what each defines; a function stored in a table counts as a call, which is
what it becomes); without it only includes are checked.

Prints every problem with the file and line (includes) or the symbols
(calls) that make it. Exit status: 0 without problems, 1 with, 2 on a
usage error.

Usage: scripts/check-floors.py [DAEMON_DIR [LIBMOEEPD.a]]
Python 3 standard library and binutils' nm only.
"""

import os
import re
import subprocess
import sys
from collections import deque

# The floors from the bottom up, and which files of daemon/'s root are on
# which: a new file there must be placed here.
FLOORS = ["ground", "state", "mesh", "datapath", "ops", "clients", "roof"]
ROOT_FILES = {
    "config": "ground",
    "errors": "ground",
    "fdorder": "ground",
    "log": "ground",
    "daemon": "roof",
    "main": "roof",
}

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def floor_of(path):
    """The floor of a path relative to daemon/, or None when it is not placed."""
    parts = path.split("/")
    if len(parts) == 1:
        return ROOT_FILES.get(module_of(parts[0]))
    return parts[0] if parts[0] in FLOORS and len(parts) == 2 else None


def module_of(path):
    """A file's module: its path less the extension and any -internal."""
    stem = re.sub(r"\.[ch]$", "", path)
    return stem[: -len("-internal")] if stem.endswith("-internal") else stem


def rank(path):
    return FLOORS.index(floor_of(path))


def sources(src):
    return sorted(
        os.path.relpath(os.path.join(d, n), src)
        for d, _, names in os.walk(src)
        for n in names
        if n.endswith((".c", ".h"))
    )


def read_includes(src, files):
    """[(file, line, included file)] for every include of a daemon file,
    outside comments."""
    out = []
    known = set(files)
    for name in files:
        in_comment = False
        with open(os.path.join(src, name), encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if in_comment:
                    if "*/" not in line:
                        continue
                    line = line.split("*/", 1)[1]
                    in_comment = False
                m = INCLUDE.match(line)
                if m and m.group(1) in known:
                    out.append((name, lineno, m.group(1)))
                if "/*" in line and "*/" not in line.split("/*", 1)[1]:
                    in_comment = True
    return out


def read_calls(lib, files):
    """{(caller file, callee file): sorted symbols} from the archive's objects."""
    text = subprocess.run(["nm", "-A", lib], capture_output=True, text=True, check=True).stdout
    by_object = {}
    for f in files:
        if f.endswith(".c"):
            # meson names the object of folder/x.c folder_x.c.o
            by_object[f.replace("/", "_") + ".o"] = f
    defined, used = {}, {}
    for line in text.splitlines():
        m = re.match(r"^(?:.*:)?(?:.*/)?([^/:]+\.o):\s*[0-9a-fA-F]*\s+([A-Za-z])\s+(\S+)$", line)
        if not m or m.group(1) not in by_object:
            continue
        obj, kind, sym = by_object[m.group(1)], m.group(2), m.group(3)
        if kind == "U":
            used.setdefault(obj, set()).add(sym)
        elif kind in "TDBRG":
            defined[sym] = obj
    if not defined:
        raise SystemExit("check-floors: %s defines no symbol of daemon/'s files" % lib)
    calls = {}
    for obj, syms in used.items():
        for sym in syms:
            callee = defined.get(sym)
            if callee and callee != obj:
                calls.setdefault((obj, callee), set()).add(sym)
    return {k: sorted(v) for k, v in calls.items()}


def circles(edges):
    """Strongly connected components of more than one node (Tarjan,
    iterative), each with one shortest cycle through its smallest node."""
    nodes = sorted(set(edges) | {w for vs in edges.values() for w in vs})
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            advanced = False
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    out = []
    for comp in comps:
        start, allowed = comp[0], set(comp)
        prev, queue, cycle = {}, deque([start]), None
        while queue and cycle is None:
            v = queue.popleft()
            for w in sorted(edges.get(v, ())):
                if w == start:
                    cycle = [v]
                    while cycle[-1] != start:
                        cycle.append(prev[cycle[-1]])
                    cycle.reverse()
                    break
                if w in allowed and w not in prev:
                    prev[w] = v
                    queue.append(w)
        out.append((comp, cycle))
    return out


def main(argv):
    if len(argv) > 3 or (len(argv) > 1 and argv[1] in ("-h", "--help")):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    src = argv[1] if len(argv) > 1 else os.path.join(here, "..", "daemon")
    lib = argv[2] if len(argv) > 2 else None
    if not os.path.isdir(src):
        print("check-floors: %s is not a directory" % src, file=sys.stderr)
        return 2
    files = sources(src)
    problems = []
    for f in files:
        if f != "meson.build" and floor_of(f) is None:
            problems.append("%s is on no floor: put it in one of %s, or name it in ROOT_FILES of %s"
                            % (f, ", ".join(x + "/" for x in FLOORS[1:-1]), os.path.basename(__file__)))
    placed = [f for f in files if floor_of(f)]

    module_edges, module_where = {}, {}
    for f, line, inc in read_includes(src, placed):
        if floor_of(inc) is None:
            continue
        if rank(inc) > rank(f):
            problems.append("%s:%d (%s) includes %s (%s): a floor above" % (f, line, floor_of(f), inc,
                                                                          floor_of(inc)))
        if inc.endswith("-internal.h") and os.path.dirname(inc) != os.path.dirname(f):
            problems.append("%s:%d includes %s, internal to another folder" % (f, line, inc))
        x, y = module_of(f), module_of(inc)
        if x != y:
            module_edges.setdefault(x, set()).add(y)
            module_where.setdefault((x, y), "%s:%d" % (f, line))
    for comp, cycle in circles(module_edges):
        steps = ["%s -> %s (%s)" % (a, b, module_where[(a, b)]) for a, b in zip(cycle, cycle[1:] + cycle[:1])]
        problems.append("modules %s include each other in a circle: %s" % (" ".join(comp), ", ".join(steps)))

    ncalls = 0
    if lib:
        calls = read_calls(lib, placed)
        call_edges = {}
        for (a, b), syms in sorted(calls.items()):
            ncalls += 1
            if rank(b) > rank(a):
                problems.append("%s (%s) calls %s (%s), a floor above: %s" % (a, floor_of(a), b, floor_of(b),
                                                                            ", ".join(syms)))
            call_edges.setdefault(a, set()).add(b)
        for comp, cycle in circles(call_edges):
            steps = ["%s -> %s (%s)" % (a, b, ", ".join(calls[(a, b)])) for a, b in zip(cycle, cycle[1:] + cycle[:1])]
            problems.append("files %s call each other in a circle: %s" % (" ".join(comp), "; ".join(steps)))

    if problems:
        for p in problems:
            print(p)
        print("%d problem(s) with the floors of %s" % (len(problems), os.path.normpath(src)), file=sys.stderr)
        return 1
    print("the %d files of %s keep to their floors%s; no circles" % (
        len(placed), os.path.normpath(src),
        " (includes, and %d file-to-file calls from %s)" % (ncalls, os.path.basename(lib)) if lib
        else " (includes only: no library given)"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
