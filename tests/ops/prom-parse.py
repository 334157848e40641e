#!/usr/bin/env python3
"""A small, strict parser of the Prometheus text exposition format (0.0.4),
for the ops e2e test: it refuses what a lenient scraper would let through.

  prom-parse.py FILE [NAME=VALUE ...]

FILE ("-" for stdin) must parse; each NAME=VALUE (NAME may carry labels in
the text format's own syntax, e.g. 'moeepd_jobs{state="ready"}=1') must be a
sample with that value. Prints "families N samples M" and exits 0, or prints
"prom-parse: LINE N: what is wrong" and exits 1.

Checked: every line is a "# HELP", "# TYPE", another comment or a sample;
metric and label names match their grammars; label values use only the
escapes \\\\, \\" and \\n; values are floats (NaN, +Inf, -Inf included) and an
optional integer timestamp follows; TYPE names a known type, comes at most
once per family and before its samples; HELP at most once per family; a
family's samples are contiguous; no (name, labels) pair repeats; counter
families end in _total and never go below 0; every family has HELP and TYPE
(moeepd's rule, stricter than the format's).
"""
import math
import re
import sys

METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


class ParseError(Exception):
    pass


def parse_value(text):
    if text in ("NaN", "+Inf", "-Inf", "Inf"):
        return float(text.replace("Inf", "inf"))
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        raise ParseError("value %r is not a float" % text)
    return float(text)


def parse_labels(s, i):
    """Parses '{a="b",...}' starting at s[i] == '{'; returns (labels, next index)."""
    labels = []
    i += 1
    while True:
        if i < len(s) and s[i] == "}":
            return tuple(labels), i + 1
        m = LABEL.match(s, i)
        if not m:
            raise ParseError("bad label name at column %d" % (i + 1))
        name = m.group(0)
        i = m.end()
        if s[i:i + 2] != '="':
            raise ParseError("label %s: want =\" after the name" % name)
        i += 2
        value = []
        while True:
            if i >= len(s):
                raise ParseError("label %s: unterminated value" % name)
            c = s[i]
            if c == "\\":
                nxt = s[i + 1:i + 2]
                if nxt not in ("\\", '"', "n"):
                    raise ParseError("label %s: bad escape \\%s" % (name, nxt))
                value.append("\n" if nxt == "n" else nxt)
                i += 2
            elif c == '"':
                i += 1
                break
            elif c == "\n":
                raise ParseError("label %s: raw newline in value" % name)
            else:
                value.append(c)
                i += 1
        if any(n == name for n, _ in labels):
            raise ParseError("label %s twice" % name)
        labels.append((name, "".join(value)))
        if i < len(s) and s[i] == ",":
            i += 1
            continue
        if i < len(s) and s[i] == "}":
            return tuple(labels), i + 1
        raise ParseError("want , or } after label %s" % name)


def family_of(name, types):
    """The family a sample belongs to (histogram/summary suffixes included)."""
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and types.get(base) in ("histogram", "summary"):
            return base
    return name


def parse(text):
    helps, types, samples = {}, {}, {}
    done, current = set(), None
    if text and not text.endswith("\n"):
        raise ParseError("the last line has no newline")
    for n, line in enumerate(text.split("\n")[:-1], 1):
        try:
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 2 and parts[1] in ("HELP", "TYPE"):
                    if len(parts) < 3 or not METRIC.fullmatch(parts[2]):
                        raise ParseError("%s without a valid metric name" % parts[1])
                    name = parts[2]
                    if name in done:
                        raise ParseError("%s %s after the family's samples ended" % (parts[1], name))
                    if parts[1] == "HELP":
                        if name in helps:
                            raise ParseError("second HELP for %s" % name)
                        helps[name] = parts[3] if len(parts) > 3 else ""
                    else:
                        if name in types:
                            raise ParseError("second TYPE for %s" % name)
                        if any(family_of(s[0], types) == name for s in samples):
                            raise ParseError("TYPE %s after its samples" % name)
                        if len(parts) != 4 or parts[3] not in TYPES:
                            raise ParseError("TYPE %s: unknown type %r" % (name, parts[3:]))
                        types[name] = parts[3]
                continue
            if not line.strip():
                continue
            m = METRIC.match(line)
            if not m:
                raise ParseError("not a comment and no metric name")
            name, i = m.group(0), m.end()
            labels = ()
            if i < len(line) and line[i] == "{":
                labels, i = parse_labels(line, i)
            rest = line[i:]
            if not rest.startswith(" "):
                raise ParseError("want a space before the value")
            fields = rest.split()
            if len(fields) not in (1, 2):
                raise ParseError("want VALUE [TIMESTAMP], got %r" % rest)
            value = parse_value(fields[0])
            if len(fields) == 2 and not re.fullmatch(r"-?\d+", fields[1]):
                raise ParseError("timestamp %r is not an integer" % fields[1])
            fam = family_of(name, types)
            if current is not None and fam != current:
                done.add(current)
            if fam in done:
                raise ParseError("samples of %s are not contiguous" % fam)
            current = fam
            key = (name, tuple(sorted(labels)))
            if key in samples:
                raise ParseError("sample %s%s repeats" % (name, dict(labels)))
            samples[key] = value
            if types.get(fam) == "counter":
                if not fam.endswith("_total"):
                    raise ParseError("counter %s does not end in _total" % fam)
                if math.isnan(value) or value < 0:
                    raise ParseError("counter %s has value %r" % (name, value))
        except ParseError as e:
            raise ParseError("line %d: %s: %r" % (n, e, line))
    for fam in {family_of(s[0], types) for s in samples}:
        if fam not in helps or fam not in types:
            raise ParseError("family %s lacks HELP or TYPE" % fam)
    return helps, types, samples


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    text = sys.stdin.read() if sys.argv[1] == "-" else open(sys.argv[1]).read()
    try:
        helps, types, samples = parse(text)
        for want in sys.argv[2:]:
            spec, _, value = want.rpartition("=")
            m = METRIC.match(spec)
            if not m:
                raise ParseError("expectation %r has no metric name" % want)
            labels = ()
            if m.end() < len(spec):
                labels, end = parse_labels(spec, m.end())
                if end != len(spec):
                    raise ParseError("expectation %r: junk after the labels" % want)
            key = (m.group(0), tuple(sorted(labels)))
            if key not in samples:
                raise ParseError("no sample %s" % spec)
            if samples[key] != parse_value(value):
                raise ParseError("%s is %r, want %s" % (spec, samples[key], value))
    except ParseError as e:
        print("prom-parse: %s" % e, file=sys.stderr)
        return 1
    print("families %d samples %d" % (len(types), len(samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
