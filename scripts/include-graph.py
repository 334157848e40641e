#!/usr/bin/env python3
"""Prints the include graph between the modules of daemon/ (x.c and x.h are
module x; only #include "y.h" of a y.h that exists in daemon/ counts), then
every cycle (strongly connected component of more than one module).

    scripts/include-graph.py [DIR]     (default: daemon)

Exits 1 when there is a cycle, so that it can become a CI check once the
last one is gone (issue 18)."""
import os
import re
import sys
from collections import defaultdict

root = sys.argv[1] if len(sys.argv) > 1 else "daemon"
headers = {f[:-2] for f in os.listdir(root) if f.endswith(".h")}
edges = defaultdict(set)
for f in sorted(os.listdir(root)):
    if not f.endswith((".c", ".h")):
        continue
    module = f[:-2]
    with open(os.path.join(root, f), encoding="utf-8") as src:
        for m in re.finditer(r'^#include "([^"]+)\.h"', src.read(), re.M):
            if m.group(1) in headers and m.group(1) != module:
                edges[module].add(m.group(1))

for a in sorted(edges):
    for b in sorted(edges[a]):
        print(f"{a} -> {b}")

# Tarjan's strongly connected components, iteratively.
index, low, on, stack, sccs, counter = {}, {}, set(), [], [], [0]
for start in sorted(set(edges) | {b for bs in edges.values() for b in bs}):
    if start in index:
        continue
    work = [(start, iter(sorted(edges[start])))]
    index[start] = low[start] = counter[0]
    counter[0] += 1
    stack.append(start)
    on.add(start)
    while work:
        v, it = work[-1]
        for w in it:
            if w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(edges[w]))))
                break
            if w in on:
                low[v] = min(low[v], index[w])
        else:
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    sccs.append(sorted(comp))
for comp in sccs:
    print("cycle: " + " ".join(comp))
sys.exit(1 if sccs else 0)
