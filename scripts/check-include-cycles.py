#!/usr/bin/env python3
"""Fails when modules of daemon/ include each other in a cycle.

A module is a file stem: daemon/session.c and daemon/session.h are the module
`session`; an internal header, x-internal.h, is the private half of module x's
interface and belongs to x (mesh.c, mesh.h and mesh-internal.h are `mesh`;
mesh-handshake.c is a module of its own that uses mesh's). Module x depends on module y when x.c or x.h includes "y.h" and
y.h is a file of daemon/ (system and other directories' headers are not
modules here). A cycle means that none of its modules can be read, changed
or tested without the others, which is what issue 18 removes.

Prints every group of modules that depend on each other (a strongly
connected component of the graph) and, for each dependency inside a group,
the shortest cycle through it, with the file and line that make each edge.
Exit status: 0 without cycles, 1 with, 2 on a usage error.

Usage: scripts/check-include-cycles.py [DIR]   (DIR defaults to daemon/)
Python 3 standard library only.
"""

import os
import re
import sys
from collections import deque

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def module_of(name):
    """The module of a file name of the directory: its stem, less -internal."""
    stem = name[:-2]
    return stem[: -len("-internal")] if stem.endswith("-internal") else stem


def read_graph(src):
    """Returns (edges, where): edges[x] is the set of modules x depends on,
    where[(x, y)] the first "file:line" that makes the edge."""
    paths = sorted(os.path.relpath(os.path.join(d, n), src) for d, _, ns in os.walk(src) for n in ns
                   if n.endswith((".c", ".h")))
    headers = {os.path.basename(n) for n in paths if n.endswith(".h")}
    edges, where = {}, {}
    for name in paths:
        x = module_of(os.path.basename(name))
        edges.setdefault(x, set())
        with open(os.path.join(src, name), encoding="utf-8", errors="replace") as f:
            in_comment = False
            for lineno, line in enumerate(f, 1):
                # An #include inside a /* */ comment is not one.
                if in_comment:
                    if "*/" not in line:
                        continue
                    line = line.split("*/", 1)[1]
                    in_comment = False
                m = INCLUDE.match(line)
                if m:
                    header = os.path.basename(m.group(1))
                    y = module_of(header)
                    if header in headers and y != x:
                        edges[x].add(y)
                        where.setdefault((x, y), f"{name}:{lineno}")
                if "/*" in line and "*/" not in line.split("/*", 1)[1]:
                    in_comment = True
    return edges, where


def components(edges):
    """Strongly connected components (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
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
                    work.append((w, iter(sorted(edges[w]))))
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
                out.append(sorted(comp))
    return out


def shortest_path(edges, start, goal, allowed):
    """Shortest path start -> goal inside `allowed` (breadth first), or None."""
    prev = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if v == goal:
            path = []
            while v is not None:
                path.append(v)
                v = prev[v]
            return path[::-1]
        for w in sorted(edges[v]):
            if w in allowed and w not in prev:
                prev[w] = v
                queue.append(w)
    return None


def cycles_of(edges, comp):
    """One shortest cycle through each edge of the component, each cycle
    once (rotated to start at its smallest module)."""
    allowed, seen, out = set(comp), set(), []
    for x in comp:
        for y in sorted(edges[x] & allowed):
            back = shortest_path(edges, y, x, allowed)
            cycle = [x] + back[:-1]
            i = cycle.index(min(cycle))
            key = tuple(cycle[i:] + cycle[:i])
            if key not in seen:
                seen.add(key)
                out.append(list(key))
    return sorted(out, key=lambda c: (len(c), c))


def main(argv):
    if len(argv) > 2 or (len(argv) == 2 and argv[1] in ("-h", "--help")):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    src = argv[1] if len(argv) == 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "daemon")
    if not os.path.isdir(src):
        print(f"check-include-cycles: {src} is not a directory", file=sys.stderr)
        return 2
    edges, where = read_graph(src)
    groups = [c for c in components(edges) if len(c) > 1]
    if not groups:
        print(f"no include cycles among the {len(edges)} modules of {os.path.normpath(src)}")
        return 0
    for comp in sorted(groups, key=lambda c: (-len(c), c)):
        print(f"include cycle among {len(comp)} modules: {' '.join(comp)}")
        for cycle in cycles_of(edges, comp):
            steps = [f"{a} -> {b} ({where[(a, b)]})" for a, b in zip(cycle, cycle[1:] + cycle[:1])]
            print("  " + ", ".join(steps))
    print(f"{len(groups)} group(s) of modules include each other in a cycle", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
