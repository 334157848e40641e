#!/usr/bin/env python3
"""The command blocks of the documentation, run as written (test
docs-commands).

Every fenced block of shell (```sh), C (```c) or Python (```python) in a
markdown file of the repository is preceded by a comment that says what this
test does with it:

  <!-- docs-test: run -->          run it
  <!-- docs-test: run last: WHY --> run it after every other block (it
                                   undoes what they use: the uninstall)
  <!-- docs-test: skip REASON -->  leave it; REASON says why (it needs a GPU,
                                   systemd as PID 1, docker, ...)
  <!-- docs-test: file NAME -->    write it to NAME in the working directory,
                                   for a later block to compile or run

A block without one fails the test, so no block goes unchecked by accident.
Blocks without a language (``` alone: output, configuration snippets) are
not commands and need none.

  blocks.py list SOURCE_ROOT
  blocks.py run SOURCE_ROOT [MESON_SETUP_OPTION...]
  blocks.py script SOURCE_ROOT > FILE

`script` writes the blocks marked run (and file), in the order `run` takes,
as one bash script with nothing substituted and no stand-ins: the commands
exactly as a reader would type them, for a real machine (run it from the
repository root after the two commands, with systemd as PID 1).

`run` runs the blocks in order (README.md, docs/operations.md, then the other
files by name) in one bash, from a working directory that shows the source
tree (symbolic links) and a `build/` that it configures and compiles first
the way scripts/demo.sh leaves one (CPU only, no tests: the install is the
same), on a scratch root R, a new directory under $TMPDIR that goes at the
end with every process started:

- `build/` has --prefix=R/usr/local, and /usr/local and /run/moeep in a
  block's text read R/usr/local and R/run/moeep, so the commands and the
  installed programs (which name their prefix) agree;
- HOME=R/home, TMPDIR=R/tmp; pip takes no index (PIP_NO_INDEX: the only
  thing it would fetch is its own version check);
- what would act on the machine itself acts on R instead: `sudo` runs the
  command as it is (the test runs as root), systemd-sysusers and
  systemd-tmpfiles get --root=R, `ldconfig` adds R's libdir to
  LD_LIBRARY_PATH (the dynamic linker's cache), `usermod -aG GROUP USER`
  checks that the group exists in R and the user here, `sg GROUP CMD`
  that the group exists in R before it runs CMD, `moeepctl` (the installed
  one) is pointed at R's sockets, pkg-config looks in R;
- systemd is not PID 1 here, so `systemctl` stands in for it: daemon-reload
  runs `systemd-analyze verify` on the installed units (any complaint
  fails), enable runs `systemctl --root=R enable`, and --now, start,
  restart, stop and reload start the installed ExecStart= under
  systemd-socket-activate on the installed .socket units' paths (in R),
  with their FileDescriptorName=s, or signal it.

It needs root (the service blocks make root-owned directories and groups in
R); without it it exits 77 (skipped).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

LANGS = ("sh", "c", "python")
MARK = re.compile(r"<!-- docs-test: (run|skip|file)\b\s*(.*?)\s*-->")


class Block:
    def __init__(self, path, line, lang, action, arg, text):
        self.path, self.line, self.lang, self.action, self.arg, self.text = path, line, lang, action, arg, text

    def where(self):
        return "%s:%d" % (self.path, self.line)


class Unmarked(Exception):
    pass


def parse(path, name=None):
    """The fenced blocks of one markdown file that need a marker, with it.
    Raises Unmarked naming every block that has none, or a bad one."""
    name = name or path
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    out, bad = [], []
    i = 0
    while i < len(lines):
        m = re.match(r"```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        end = start + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if lang in LANGS:
            j = start - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            mark = MARK.search(lines[j]) if j >= 0 else None
            if not mark:
                bad.append("%s:%d: a ```%s block without a <!-- docs-test: run|skip REASON|file NAME --> line "
                           "before it" % (name, start + 1, lang))
            elif mark.group(1) != "run" and not mark.group(2):
                bad.append("%s:%d: docs-test: %s needs %s" % (name, start + 1, mark.group(1),
                                                              "a reason" if mark.group(1) == "skip" else "a name"))
            else:
                out.append(Block(name, start + 1, lang, mark.group(1), mark.group(2),
                                 "\n".join(lines[start + 1:end]) + "\n"))
        i = end + 1
    if bad:
        raise Unmarked("\n".join(bad))
    return out


def source_files(src):
    """The files of the source tree, relative to it: git's tracked files, or
    where there is no git (a tarball, a minimal root without git) every
    file but those of build directories, hidden ones and __pycache__."""
    try:
        r = subprocess.run(["git", "ls-files"], cwd=src, capture_output=True, text=True)
        if r.returncode == 0:
            return sorted(f for f in r.stdout.split() if os.path.isfile(os.path.join(src, f)))
    except FileNotFoundError:
        pass
    files = []
    for d, dirs, names in os.walk(src, followlinks=True):
        dirs[:] = sorted(x for x in dirs if not x.startswith(("build", ".")) and x != "__pycache__")
        files += [os.path.relpath(os.path.join(d, n), src) for n in names]
    return sorted(files)


def documents(src):
    """Every markdown file, README.md and docs/operations.md first (the
    later ones build on what those install and start)."""
    files = [f for f in source_files(src) if f.endswith(".md")]
    first = [f for f in ("README.md", "docs/operations.md") if f in files]
    return first + [f for f in files if f not in first]


def all_blocks(src):
    out, bad = [], []
    for f in documents(src):
        try:
            out += parse(os.path.join(src, f), f)
        except Unmarked as e:
            bad.append(str(e))
    if bad:
        raise Unmarked("\n".join(bad))
    return out


PROLOGUE = r"""
set -eE -o pipefail
R=@R@ W=@W@ LIBDIR=@LIBDIR@
units=$R/usr/local/lib/systemd/system
export HOME=$R/home TMPDIR=$R/tmp
export PATH=$R/usr/local/bin:$R/usr/local/sbin:$PATH
export MOEEP_SOCKET=$R/run/moeep/moeepd.sock
export PKG_CONFIG_PATH=$LIBDIR/pkgconfig:$R/usr/local/share/pkgconfig
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset MOEEP_LIBRARY MOEEP_ADMIN_SOCKET MOEEP_DEEP_EP LD_LIBRARY_PATH PYTHONPATH
__block=prologue
trap 'echo "docs-test: FAILED: $__block: \`$BASH_COMMAND\` exited $?" >&2' ERR

__fail() {
        echo "docs-test: FAILED: $__block: $*" >&2
        exit 1
}
sudo() {
        [[ $1 != -* ]] || __fail "sudo $1: the test knows plain sudo only"
        "$@"
}
ldconfig() {
        export LD_LIBRARY_PATH=$LIBDIR
        echo "(docs-test: ldconfig: the dynamic linker now looks in $LIBDIR)"
}
systemd-sysusers() { command systemd-sysusers --root="$R" "$@"; }
systemd-tmpfiles() { command systemd-tmpfiles --root="$R" "$@"; }
usermod() {
        [[ $# -eq 3 && $1 == -aG ]] || __fail "usermod $*: the test knows usermod -aG GROUP USER only"
        grep -q "^$2:" "$R/etc/group" 2>/dev/null || __fail "usermod: group '$2' does not exist"
        id "$3" >/dev/null || __fail "usermod: no user '$3'"
        echo "(docs-test: usermod: $3 would join group $2)"
}
moeepctl() { MOEEP_ADMIN_SOCKET=$R/run/moeep-admin/moeepd.sock command moeepctl "$@"; }
sg() {
        grep -q "^$1:" "$R/etc/group" 2>/dev/null || __fail "sg: group '$1' does not exist"
        shift
        [[ $1 != -c ]] || shift
        bash -c "$*"
}

__daemon=
__unit() { sed -n "s/^$2=//p" "$units/$1" | head -n 1; }
__start() {
        local exec client admin names i
        if [[ -n $__daemon ]] && kill -0 "$__daemon" 2>/dev/null; then
                return 0
        fi
        exec=$(__unit moeepd.service ExecStart)
        client=$R$(__unit moeepd.socket ListenSequentialPacket)
        admin=$R$(__unit moeepd-admin.socket ListenSequentialPacket)
        names=$(__unit moeepd.socket FileDescriptorName):$(__unit moeepd-admin.socket FileDescriptorName)
        [[ -n $exec && -x ${exec%% *} ]] || __fail "moeepd.service: ExecStart=$exec is not an installed program"
        for d in "${client%/*}" "${admin%/*}"; do
                [[ -d $d ]] || __fail "$d does not exist (systemd-tmpfiles --create makes it)"
        done
        # shellcheck disable=SC2086
        systemd-socket-activate --seqpacket -l "$client" -l "$admin" --fdname="$names" $exec \
                >>"$R/moeepd.log" 2>&1 &
        __daemon=$!
        for ((i = 0; i < 100; i++)); do
                [[ -S $client && -S $admin ]] && break
                sleep 0.1
        done
        [[ -S $client && -S $admin ]] ||
                __fail "systemd-socket-activate did not listen: $(tail -n 5 "$R/moeepd.log")"
        echo "(docs-test: systemctl: moeepd.socket and moeepd-admin.socket listen;" \
                "moeepd starts on the first connection)"
}
__stop() {
        if [[ -n $__daemon ]]; then
                kill -TERM "$__daemon" 2>/dev/null || true
                wait "$__daemon" || true
                __daemon=
                # The sockets go with the stand-in (systemd would keep them
                # across a restart of the service): __start waits for new ones.
                rm -f "$R$(__unit moeepd.socket ListenSequentialPacket)" \
                        "$R$(__unit moeepd-admin.socket ListenSequentialPacket)"
        fi
}
systemctl() {
        local now=0 out
        case $1 in
        daemon-reload)
                if [[ ! -e $units/moeepd.service ]]; then
                        echo "(docs-test: systemctl daemon-reload: no moeepd units installed)"
                        return 0
                fi
                out=$(cd "$units" && timeout 60 systemd-analyze verify --man=no moeepd.service moeepd.socket \
                        moeepd-admin.socket 2>&1) || __fail "systemd-analyze verify: $out"
                [[ -z $out ]] || __fail "systemd-analyze verify: $out"
                echo "(docs-test: systemctl daemon-reload: the installed units verify cleanly)"
                ;;
        enable)
                shift
                if [[ $1 == --now ]]; then
                        now=1
                        shift
                fi
                command systemctl --root="$R" enable "$@"
                ((now == 0)) || __start
                ;;
        disable)
                shift
                if [[ $1 == --now ]]; then
                        shift
                        __stop
                fi
                command systemctl --root="$R" disable "$@"
                ;;
        start) __start ;;
        restart) __stop; __start ;;
        stop) __stop ;;
        reload) kill -HUP "$__daemon" ;;
        *) __fail "systemctl $1: not known to the test" ;;
        esac
}
"""


# After the last block: with an uninstall among the blocks, what it leaves
# under the prefix is only what the documents say stays (the configuration
# and the cluster key in etc/moeep, and the directories).
EPILOGUE = r"""
__block=end
__stop
if [[ ! -e $R/usr/local/sbin/moeepd ]]; then
        left=$(cd "$R/usr/local" && find . ! -type d ! -path './etc/moeep/*' | sort)
        [[ -z $left ]] || __fail "the uninstall left files under the prefix: $left"
        echo "(docs-test: the uninstall removed everything but etc/moeep/:" \
                "$(ls "$R/usr/local/etc/moeep" | tr '\n' ' '))"
fi
echo "docs-test: every block ran"
"""


def script(blocks, root, work, libdir):
    out = [PROLOGUE.replace("@R@", root).replace("@W@", work).replace("@LIBDIR@", libdir)]
    for b in ordered(blocks):
        out.append("\n__block=%s\ncd \"$W\"\n" % b.where())
        if b.action == "skip":
            out.append("echo \"=== docs-test: %s: skipped: %s\"\n" % (b.where(), b.arg.replace('"', "'")))
            continue
        text = b.text.replace("/usr/local", root + "/usr/local").replace("/run/moeep", root + "/run/moeep")
        if b.action == "file":
            out.append("echo \"=== docs-test: %s: written to %s\"\n" % (b.where(), b.arg))
            out.append("cat >%s <<'__DOCS_TEST_EOF'\n%s__DOCS_TEST_EOF\n" % (b.arg, text))
        elif b.lang != "sh":
            raise SystemExit("%s: only ```sh blocks can run (mark a %s block file or skip)" % (b.where(), b.lang))
        else:
            out.append("echo \"=== docs-test: %s\"\n%s" % (b.where(), text))
    out.append(EPILOGUE)
    return "".join(out)


def ordered(blocks):
    """The blocks in the order they run: as they come, `run last` ones at
    the end."""
    last = [b for b in blocks if b.action == "run" and b.arg.startswith("last")]
    return [b for b in blocks if b not in last] + last


def plain_script(blocks):
    out = ["#!/usr/bin/env bash\n# The documents' command blocks as written (tests/docs/blocks.py script).\n"
           "set -eE -o pipefail\ntrap 'echo \"FAILED: $__block: \\`$BASH_COMMAND\\` exited $?\" >&2' ERR\n"]
    for b in ordered(blocks):
        if b.action == "skip":
            continue
        out.append("\n__block=%s\necho \"=== %s\"\n" % (b.where(), b.where()))
        if b.action == "file":
            out.append("cat >%s <<'__DOCS_TEST_EOF'\n%s__DOCS_TEST_EOF\n" % (b.arg, b.text))
        else:
            out.append(b.text)
    out.append("\necho \"every block ran\"\n")
    return "".join(out)


def run_all(src, setup_options):
    try:
        blocks = all_blocks(src)
    except Unmarked as e:
        print(e)
        return 1
    if os.geteuid() != 0:
        print("docs-commands needs root: the service blocks make groups and root-owned directories (in a "
              "scratch root)")
        return 77
    root = tempfile.mkdtemp(prefix="moeep-docs-run.")
    work = os.path.join(root, "work")
    proc = None
    try:
        for d in ("home", "tmp", "work", "etc"):
            os.makedirs(os.path.join(root, d))
        for entry in os.listdir(src):
            if entry != ".git" and not entry.startswith("build"):
                os.symlink(os.path.join(src, entry), os.path.join(work, entry))
        build = os.path.join(root, "build")
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "MESON_TEST_ITERATION")}
        env["TMPDIR"] = os.path.join(root, "tmp")
        for cmd in (["meson", "setup", build, src, "--prefix=" + root + "/usr/local", "-Dtests=false",
                     "-Dcuda=disabled"] + setup_options, ["meson", "compile", "-C", build]):
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
            if r.returncode != 0:
                print("docs-test: %s failed:\n%s" % (" ".join(cmd), (r.stdout + r.stderr)[-3000:]))
                return 1
        os.symlink(build, os.path.join(work, "build"))
        libdir = subprocess.run(["meson", "introspect", "--buildoptions", build], capture_output=True,
                                text=True).stdout
        libdir = re.search(r'"name": "libdir", "value": "([^"]+)"', libdir).group(1)
        path = os.path.join(root, "blocks.sh")
        with open(path, "w") as f:
            f.write(script(blocks, root, work, os.path.join(root, "usr/local", libdir)))
        print("docs-test: %d blocks (%d run, %d files, %d skipped) from %s" % (
            len(blocks), sum(b.action == "run" for b in blocks), sum(b.action == "file" for b in blocks),
            sum(b.action == "skip" for b in blocks), ", ".join(sorted({b.path for b in blocks}))), flush=True)
        proc = subprocess.Popen(["bash", path], cwd=work, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            print("docs-test: FAILED: the blocks did not finish in 900 s")
            rc = 1
        if os.path.exists(os.path.join(root, "moeepd.log")) and rc != 0:
            with open(os.path.join(root, "moeepd.log")) as f:
                print("--- moeepd started by systemctl, last lines:\n" + "".join(f.readlines()[-20:]))
        return rc
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def main(argv):
    if len(argv) >= 3 and argv[1] == "list":
        try:
            found = all_blocks(argv[2])
        except Unmarked as e:
            print(e)
            return 1
        for b in found:
            print("%s %s %s %s" % (b.where(), b.lang, b.action, b.arg))
        return 0 if found else 1
    if len(argv) == 3 and argv[1] == "script":
        try:
            found = all_blocks(argv[2])
        except Unmarked as e:
            print(e, file=sys.stderr)
            return 1
        print(plain_script(found), end="")
        return 0
    if len(argv) >= 3 and argv[1] == "run":
        return run_all(os.path.abspath(argv[2]), argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
