#!/usr/bin/env python3
"""The documentation against the code it describes (suite `docs`).

Each check takes what the code says (the configuration parser's table
through `moeepd --dump-config`, the getopt tables of main.c and ctl.c, the
metrics a running moeepd serves, meson's list of installed files and of
test suites) and fails naming every item a document lacks, and every item a
document names that the code does not have. So adding a configuration key,
a flag, a metric, an installed file or a suite fails here until the
documents say it.

  docs.py config-keys MOEEPD SOURCE_ROOT BUILD_ROOT
  docs.py flags MOEEPD MOEEPCTL SOURCE_ROOT BUILD_ROOT
  docs.py metrics MOEEPD MOEEPCTL SOURCE_ROOT
  docs.py install-paths SOURCE_ROOT BUILD_ROOT
  docs.py suites SOURCE_ROOT BUILD_ROOT
  docs.py links SOURCE_ROOT
  docs.py c-example SOURCE_ROOT INCLUDE_DIRS LIBMOEEP MOEEPD
  docs.py architecture SOURCE_ROOT
  docs.py names SOURCE_ROOT

Exit status 0 when everything agrees, 1 with the differences, 77 (skip)
when a check cannot apply to this build (named).
"""

import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import blocks  # noqa: E402

SKIP = 77


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


class Report:
    """Collects differences; done() prints them and gives the exit status."""

    def __init__(self, what):
        self.what = what
        self.problems = []

    def missing(self, items, where, kind):
        for item in sorted(items):
            self.problems.append("%s does not document the %s %s" % (where, kind, item))

    def extra(self, items, where, kind):
        for item in sorted(items):
            self.problems.append("%s documents the %s %s, which the code does not have" % (where, kind, item))

    def compare(self, code, doc, where, kind):
        self.missing(set(code) - set(doc), where, kind)
        self.extra(set(doc) - set(code), where, kind)

    def done(self, ok_message):
        if self.problems:
            print("%s: %d difference(s) between the code and the documentation:" % (self.what, len(self.problems)))
            for p in self.problems:
                print("  " + p)
            return 1
        print("ok: " + ok_message)
        return 0


def md_table_first_column(text, header_first_cell, section=None):
    """The backticked first cells of the rows of the markdown table(s) whose
    header row starts with `| header_first_cell |` (inside `section`, a
    heading's text, when given)."""
    if section is not None:
        text = md_section(text, section)
    return [name for row in md_table_rows(text, header_first_cell) for name in re.findall(r"`([^`]+)`", row[0])]


def md_table_rows(text, header_first_cell):
    """The rows (lists of stripped cells) of the markdown tables whose header
    row starts with `| header_first_cell |`."""
    rows, in_table = [], False
    for line in text.splitlines():
        if line.startswith("| %s |" % header_first_cell):
            in_table = True
            continue
        if in_table and line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if not set(cells[0]) <= set("-: "):
                rows.append(cells)
        else:
            in_table = False
    return rows


def md_section(text, heading):
    """The text under the heading whose title starts with `heading`, up to
    the next heading of the same or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(#+) (.*)", line)
        if m and m.group(2).startswith(heading):
            level = len(m.group(1))
            body = []
            for rest in lines[i + 1:]:
                n = re.match(r"(#+) ", rest)
                if n and len(n.group(1)) <= level:
                    break
                body.append(rest)
            return "\n".join(body)
    raise SystemExit("no heading '%s'" % heading)


def roff_text(text):
    """A man page's text with the escapes that matter here undone."""
    return text.replace("\\-", "-").replace("\\(dq", '"')


# ---------------------------------------------------------------- config-keys


def config_keys(moeepd, src, build):
    """The parser's keys (`moeepd --no-config --dump-config` writes every key
    of daemon/config.c's table) against moeepd.conf(5), the key table of
    docs/operations.md and the example file; the documented defaults
    against the dumped ones."""
    r = run([moeepd, "--no-config", "--dump-config"])
    if r.returncode != 0:
        print("moeepd --dump-config failed: " + r.stderr)
        return 1
    defaults = {}
    for line in r.stdout.splitlines():
        m = re.match(r"(\w+) = ?(.*)", line)
        if m:
            defaults[m.group(1)] = m.group(2)
    rep = Report("config-keys")
    table = set(re.findall(r'^\s*\{ "(\w+)", KEY_', read(os.path.join(src, "daemon", "config.c")), re.M))
    if not table:
        raise SystemExit("no key table found in daemon/config.c")
    rep.compare(table, defaults, "moeepd --dump-config", "key")
    man = roff_text(read(os.path.join(build, "docs", "man", "moeepd.conf.5")))
    man_keys = dict(re.findall(r'^\.BR (\w+) " = (.*?) \((?:reload|restart)\)"', man, re.M))
    rep.compare(defaults, man_keys, "moeepd.conf(5)", "key")
    ops = read(os.path.join(src, "docs", "operations.md"))
    ops_rows = {}
    for row in md_table_rows(md_section(ops, "4. Configuration"), "key"):
        for key in re.findall(r"`(\w+)`", row[0]):
            ops_rows[key] = row[1]
    rep.compare(defaults, ops_rows, "docs/operations.md (4. Configuration)", "key")
    example = read(os.path.join(src, "systemd", "moeepd.conf.example"))
    example_keys = set(re.findall(r"^#? ?(\w+) =", example, re.M))
    rep.missing(set(defaults) - example_keys, "systemd/moeepd.conf.example", "key")

    def same(doc, value):
        doc = doc.strip().strip("`")
        if doc.startswith("(empty") or doc == "(empty)":
            return value == ""
        return doc == value

    for key, value in defaults.items():
        for where, docs in (("moeepd.conf(5)", man_keys), ("docs/operations.md", ops_rows)):
            if key in docs and not same(docs[key], value):
                rep.problems.append("%s gives %s the default %s; moeepd's is '%s'" % (where, key, docs[key], value))
    return rep.done("%d configuration keys, with their defaults, in moeepd.conf(5), docs/operations.md and the "
                    "example" % len(defaults))


# ---------------------------------------------------------------------- flags


def longopts(source):
    """Long option names of a getopt_long table: { "name", ..._argument, ... }."""
    return re.findall(r'\{\s*"([a-z][a-z-]*)",\s*(?:no|required|optional)_argument', read(source))


def flags(moeepd, moeepctl, src, build):
    """Every long option of moeepd and moeepctl (their getopt tables) in their
    --help and man page; every moeepctl subcommand (ctl.c's table) in its
    --help, man page, bash completion and docs/operations.md."""
    rep = Report("flags")
    man = lambda page: roff_text(read(os.path.join(build, "docs", "man", page)))  # noqa: E731
    for prog, source, page in ((moeepd, "daemon/main.c", "moeepd.8"), (moeepctl, "client/ctl/ctl.c", "moeepctl.8")):
        name = os.path.basename(prog)
        opts = longopts(os.path.join(src, source))
        if not opts:
            raise SystemExit("no getopt_long table found in " + source)
        helptext = run([prog, "--help"]).stdout
        text = man(page)
        rep.missing([o for o in opts if "--" + o not in helptext], name + " --help", "option --")
        rep.missing([o for o in opts if "--" + o not in text], page, "option --")
        documented = set(re.findall(r"^\.BR? .*?--([a-z][a-z-]+)", text, re.M))
        rep.extra(documented - set(opts), page, "option --")
    ctl_src = read(os.path.join(src, "client", "ctl", "ctl.c"))
    table = ctl_src[ctl_src.index("subcommands[] = {"):]
    table = table[:table.index("};")]
    commands = re.findall(r'\{\s*"([a-z-]+)",\s*"', table)
    helptext = run([moeepctl, "--help"]).stdout
    completion = read(os.path.join(src, "client", "ctl", "ctl-completion.bash"))
    page = man("moeepctl.8")
    # The tag line after each .TP of COMMANDS: ".B status", ".BR drain ...".
    page_commands = re.findall(r"^\.TP\n\.B[IR]? ([a-z-]+)", md_roff_section(page, "COMMANDS"), re.M)
    ops = read(os.path.join(src, "docs", "operations.md"))
    ops_commands = [c.split()[0] for c in md_table_first_column(ops, "command", "6. moeepctl")]
    rep.missing([c for c in commands if not re.search(r"^  %s\b" % re.escape(c), helptext, re.M)],
                "moeepctl --help", "command")
    rep.compare(commands, page_commands, "moeepctl.8 (COMMANDS)", "command")
    rep.compare(commands, ops_commands, "docs/operations.md (6. moeepctl)", "command")
    words = set(re.findall(r"[a-z][a-z-]+", completion))
    rep.missing([c for c in commands if c not in words], "the bash completion", "command")
    rep.missing(["--" + o for o in longopts(os.path.join(src, "client/ctl/ctl.c")) if "--" + o not in completion],
                "the bash completion", "option")
    return rep.done("moeepd's and moeepctl's options and moeepctl's %d commands in --help, the man pages, the "
                    "completion and docs/operations.md" % len(commands))


def md_roff_section(text, name):
    """A man page's section .SH NAME, up to the next .SH."""
    m = re.search(r"^\.SH %s\n(.*?)(?=^\.SH |\Z)" % re.escape(name), text, re.M | re.S)
    if not m:
        raise SystemExit("no .SH %s" % name)
    return m.group(1)


# -------------------------------------------------------------------- metrics


def metrics(moeepd, moeepctl, src):
    """The metric families a fresh moeepd serves (moeepctl --json metrics on
    its admin socket) against the table of docs/operations.md."""
    with tempfile.TemporaryDirectory(prefix="moeep-docs-metrics.") as tmp:
        sock = os.path.join(tmp, "moeepd.sock")
        log = open(os.path.join(tmp, "moeepd.log"), "w")
        daemon = subprocess.Popen([moeepd, "--no-config", "--socket", sock, "--log-level", "warning"], stdout=log,
                                  stderr=log)
        try:
            deadline = time.monotonic() + 20
            while True:
                r = run([moeepctl, "--socket", sock, "--json", "metrics"])
                if r.returncode == 0 or time.monotonic() > deadline or daemon.poll() is not None:
                    break
                time.sleep(0.1)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(20)
            log.close()
        if r.returncode != 0:
            print("moeepctl --json metrics failed: %s\nmoeepd's log:\n%s" % (r.stderr, read(log.name)))
            return 1
    served = {family["name"] for family in json.loads(r.stdout)}
    # Some families appear only with the mesh or a transport on; every one
    # is named by a string literal of the daemon's sources.
    named = set()
    for d, _, names in os.walk(os.path.join(src, "daemon")):
        for f in names:
            if f.endswith(".c"):
                named.update(re.findall(r'"(moeepd_[a-z_]+)', read(os.path.join(d, f))))
    ops = read(os.path.join(src, "docs", "operations.md"))
    documented = md_table_first_column(ops, "metric", "5. Metrics")
    rep = Report("metrics")
    rep.compare(named, documented, "docs/operations.md (5. Metrics)", "metric")
    for name in sorted(served - named):
        rep.problems.append("moeepd serves %s, which no string of daemon/**/*.c names: the check is blind" % name)
    if not served:
        rep.problems.append("moeepd served no metric at all")
    return rep.done("the %d metric families of daemon/**/*.c (%d served by a fresh moeepd) are the ones "
                    "docs/operations.md lists" % (len(named), len(served)))


# -------------------------------------------------------------- install-paths


def install_paths(src, build):
    """Every file `meson install` puts in place (meson introspect
    --installed) against the table of docs/operations.md, which is written
    for the default prefix, /usr/local."""
    info = json.loads(run(["meson", "introspect", "--buildoptions", build]).stdout)
    prefix = next(o["value"] for o in info if o["name"] == "prefix")
    if prefix != "/usr/local":
        print("docs/operations.md lists the paths of the default prefix /usr/local; this build has %s" % prefix)
        return SKIP
    installed = sorted(set(json.loads(run(["meson", "introspect", "--installed", build]).stdout).values()))
    # The Python package goes where that python3 reads: Debian's
    # python3.11/dist-packages, which the table names; another interpreter
    # (a pyenv, a newer Debian) names it otherwise.
    installed = [re.sub(r"/lib/python3[.\d]*/(site|dist)-packages/", "/lib/python3.11/dist-packages/", p)
                 for p in installed]
    ops = read(os.path.join(src, "docs", "operations.md"))
    section = md_section(ops, "1. Install")
    rows = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) >= 4 and "`/" in cells[2]:
            rows.append((cells[1], re.findall(r"`(/[^`]*)`", cells[2])))
    rep = Report("install-paths")
    used = set()

    def matches(path, pattern):
        if pattern.endswith("/"):  # a directory: itself and everything under it
            return path.startswith(pattern) or path == pattern[:-1]
        return fnmatch.fnmatchcase(path, pattern)

    for path in installed:
        hits = [(i, p) for i, (_, patterns) in enumerate(rows) for p in patterns if matches(path, p)]
        if not hits:
            rep.problems.append("docs/operations.md (1. Install) does not say where %s goes" % path)
        used.update(hits)
    for i, (what, patterns) in enumerate(rows):
        for p in patterns:
            if (i, p) not in used and "with CUDA" not in what:
                rep.problems.append("docs/operations.md (1. Install) lists %s, which meson does not install" % p)
    return rep.done("the %d files meson installs are where docs/operations.md says" % len(installed))


# --------------------------------------------------------------------- suites


def suites(src, build):
    """Every test suite of this build (meson introspect --tests) in the table
    of docs/testing.md."""
    tests = json.loads(run(["meson", "introspect", "--tests", build]).stdout)
    found = {s.split(":")[-1] for t in tests for s in t["suite"]}
    found.discard("moeep")  # meson adds the project's name to every test
    doc = md_table_first_column(read(os.path.join(src, "docs", "testing.md")), "suite")
    rep = Report("suites")
    rep.missing(found - set(doc), "docs/testing.md", "suite")
    return rep.done("the %d test suites of this build are in docs/testing.md" % len(found))


# ---------------------------------------------------------------------- links


def links(src):
    """Relative links of the markdown files point at files of the
    repository; no tracked file points outside it (a path of the machine
    it was written on) or at the documents the comments once cited; the
    README links every document of docs/ and names every folder of
    tests/."""
    files = blocks.source_files(src)
    rep = Report("links")
    checked = 0
    for f in files:
        path = os.path.join(src, f)
        if not os.path.isfile(path):
            continue
        try:
            text = read(path)
        except UnicodeDecodeError:
            continue
        if f.endswith(".md"):
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
                if re.match(r"[a-z]+:", target):
                    continue
                checked += 1
                if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), target))):
                    rep.problems.append("%s links to %s, which does not exist" % (f, target))
        if f.endswith(".md") or f.startswith("docs/man/"):
            for n, line in enumerate(text.split("\n"), 1):  # splitlines() would split at a form feed
                if re.search(r"[\x00-\x08\x0b-\x1f\x7f]", line):
                    rep.problems.append("%s:%d has a control character (troff and markdown show it as "
                                        "garbage)" % (f, n))
        if f == "tests/docs/docs.py":
            continue
        for bad in ("/work/", "../shared", "STYLE.md", "BENCHMARKS.md", "DESIGN.md"):
            for n, line in enumerate(text.splitlines(), 1):
                if bad in line:
                    rep.problems.append("%s:%d names %s, which is not in the repository" % (f, n, bad))
    # The README's map of the tree: every document of docs/ in its list, every
    # folder of tests/ in its layout.
    readme = read(os.path.join(src, "README.md"))
    for f in files:
        if re.fullmatch(r"docs/[^/]+\.md", f) and "(%s)" % f not in readme:
            rep.problems.append("README.md (Documentation) does not link %s" % f)
    layout = md_section(readme, "Layout")
    for d in sorted({f.split("/")[1] for f in files if f.startswith("tests/") and f.count("/") >= 2}):
        if "`%s/`" % d not in layout:
            rep.problems.append("README.md (Layout) does not name tests/%s/" % d)
    return rep.done("%d relative links resolve; nothing points outside the repository; README.md names every "
                    "document and test folder" % checked)


# --------------------------------------------------------------- architecture

# The folders of daemon/, its floors (scripts/check-floors.py).
DAEMON_FLOORS = ("state", "mesh", "datapath", "ops", "clients")


def architecture(src):
    """docs/architecture.md places every file of daemon/: each
    daemon/**/*.c is named there by its path from daemon/ (`state/job.c`;
    a file of the root by its name), and each such path it names exists."""
    doc = read(os.path.join(src, "docs", "architecture.md"))
    daemon = os.path.join(src, "daemon")
    cfiles = sorted(os.path.relpath(os.path.join(d, n), daemon)
                    for d, _, names in os.walk(daemon) for n in names if n.endswith(".c"))
    rep = Report("architecture")
    for f in cfiles:
        if not re.search(r"(?<![\w/.-])%s(?!\w)" % re.escape(f), doc):
            rep.problems.append("docs/architecture.md does not place daemon/%s (name it as %s)" % (f, f))
    named = set(re.findall(r"(?<![\w/.-])((?:%s)/[\w-]+\.[ch])(?!\w)" % "|".join(DAEMON_FLOORS), doc))
    for f in sorted(named):
        if not os.path.isfile(os.path.join(daemon, f)):
            rep.problems.append("docs/architecture.md names %s, which daemon/ does not have" % f)
    return rep.done("docs/architecture.md places the %d files of daemon/**/*.c and names no other" % len(cfiles))


# ---------------------------------------------------------------------- names

# Library functions that a comment or document names and whose prefix is
# also one of ours (so that they look like ours).
EXTERNAL_FUNCTIONS = {"ini_parse", "sd_listen_fds"}


def names(src):
    """Every function that a comment of the C and CUDA sources, or a
    document of docs/, names (`name()`) exists: the code calls or defines
    it. Only names with a prefix of ours (the part before the first `_` of a
    function the code calls or defines: `session_`, `mesh_`, `moeep_`, ...)
    are checked; a renamed or removed function leaves none behind. And
    every path under daemon/ that a tracked file names exists."""
    files = blocks.source_files(src)
    code_files = [f for f in files if f.endswith((".c", ".h", ".cu", ".cuh", ".def"))]
    known, comments = set(), []
    for f in code_files:
        text = read(os.path.join(src, f))
        comments += [(f, c) for c in re.findall(r"/\*.*?\*/", text, re.S) + re.findall(r"//[^\n]*", text)]
        code = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
        code = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', code)
        known.update(re.findall(r"\b([A-Za-z_]\w*)\s*\(", code))
        known.update(re.findall(r"#\s*define\s+([A-Za-z_]\w*)", code))
    ours = {n.split("_")[0] for n in known if "_" in n.strip("_")}
    comments += [(f, read(os.path.join(src, f))) for f in files if re.fullmatch(r"docs/[^/]+\.md", f)]
    rep = Report("names")
    checked = set()
    for f, text in comments:
        for name in re.findall(r"(?<![\w.>])([A-Za-z_]\w*)\(\)", text):
            if "_" not in name.strip("_") or name.split("_")[0] not in ours or name in EXTERNAL_FUNCTIONS:
                continue
            checked.add(name)
            if name not in known:
                rep.problems.append("%s names %s(), which no code calls or defines" % (f, name))
    paths = 0
    for f in files:
        if f.startswith("tests/docs/") or not f.endswith((".c", ".h", ".cu", ".cuh", ".def", ".proto", ".md",
                                                         ".py", ".sh", "meson.build")):
            continue
        text = read(os.path.join(src, f))
        for m in re.finditer(r"(?<![\w/.-])daemon/([\w./{},*-]+)", text):
            name = m.group(1).rstrip(".,")
            if "*" in name or name in ("moeepd", "meson.build"):
                continue
            brace = re.fullmatch(r"(.*)\{(.*)\}(.*)", name)
            alts = [brace.group(1) + a + brace.group(3) for a in brace.group(2).split(",")] if brace else [name]
            for a in alts:
                paths += 1
                if not os.path.exists(os.path.join(src, "daemon", a)):
                    rep.problems.append("%s names daemon/%s, which does not exist" % (f, a))
    return rep.done("the %d functions the comments and docs/ name exist, and the %d daemon/ paths named"
                    % (len(checked), paths))


# ------------------------------------------------------------------ c-example


def c_example(src, include, libmoeep, moeepd):
    """README.md's C example compiles against this build's headers (the
    directories of `include`, separated by os.pathsep, the public headers'
    where meson installs them from), links this build's libmoeep, and runs
    against a private moeepd."""
    doc = blocks.parse(os.path.join(src, "README.md"))
    example = [b for b in doc if b.action == "file" and b.lang == "c"]
    if len(example) != 1:
        print("README.md has %d C blocks marked docs-test: file NAME, want 1" % len(example))
        return 1
    b = example[0]
    with tempfile.TemporaryDirectory(prefix="moeep-docs-c.") as tmp:
        source = os.path.join(tmp, b.arg)
        with open(source, "w") as f:
            f.write(b.text)
        exe = os.path.join(tmp, "example")
        cc = os.environ.get("CC", "cc")
        includes = ["-I" + d for d in include.split(os.pathsep)]
        r = run([cc, "-std=gnu11", "-Wall", "-Wextra", "-Werror"] + includes + [source, "-o", exe,
                 libmoeep, "-Wl,-rpath," + os.path.dirname(libmoeep)])
        if r.returncode != 0:
            print("README.md:%d: %s does not compile:\n%s" % (b.line, b.arg, r.stdout + r.stderr))
            return 1
        sock = os.path.join(tmp, "moeepd.sock")
        daemon = subprocess.Popen([moeepd, "--no-config", "--socket", sock, "--log-level", "warning"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(200):
                if os.path.exists(sock):
                    break
                time.sleep(0.05)
            r = run([exe], env=dict(os.environ, MOEEP_SOCKET=sock))
        finally:
            daemon.send_signal(signal.SIGTERM)
            err = daemon.communicate(timeout=20)[1]
    if r.returncode != 0:
        print("README.md:%d: %s exited %d:\n%s%s\nmoeepd:\n%s" % (b.line, b.arg, r.returncode, r.stdout, r.stderr,
                                                                 err))
        return 1
    print(r.stdout, end="")
    return print_ok("README.md:%d: %s compiles with -Wall -Wextra -Werror and runs" % (b.line, b.arg))


def print_ok(message):
    print("ok: " + message)
    return 0


def main(argv):
    checks = {
        "config-keys": (config_keys, 3),
        "flags": (flags, 4),
        "metrics": (metrics, 3),
        "install-paths": (install_paths, 2),
        "suites": (suites, 2),
        "links": (links, 1),
        "c-example": (c_example, 4),
        "architecture": (architecture, 1),
        "names": (names, 1),
    }
    if len(argv) < 2 or argv[1] not in checks or len(argv) - 2 != checks[argv[1]][1]:
        print(__doc__, file=sys.stderr)
        return 2
    return checks[argv[1]][0](*argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
