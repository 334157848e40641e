"""Builds the moeep wheel: the PEP 517 backend of client/python and the tool
meson runs (client/python/meson.build).

Why not setuptools: an in-tree setuptools build leaves build/ and
moeep.egg-info/ in the source tree, and under pip's build isolation it
downloads setuptools first. The package is pure Python (its one compiled
part, moeep_fast.abi3.so, is built by meson and installed next to
libmoeep.so, where the package looks for it), so a wheel is a zip of moeep/
plus three metadata files; this module writes exactly that, with the
standard library only, into the directory it is given and nowhere else.

What goes into the wheel:
  - moeep/ (every .py file; caches and anything else are left out);
  - moeep/_install.py when a libdir is given (meson passes
    `prefix / libdir`): where `meson install` puts libmoeep.so, the first
    place moeep looks after $MOEEP_LIBRARY (moeep/_lib.py);
  - moeep-deep-ep.pth: one line, run at every interpreter start-up of the
    environment, that does nothing unless MOEEP_DEEP_EP=1 is set, and then
    lets `import deep_ep` resolve to moeep (moeep/deep_ep_alias.py);
  - the .dist-info (METADATA, WHEEL, RECORD).

Command line (meson): moeep_build.py wheel --outdir DIR [--libdir DIR]
"""

import base64
import hashlib
import io
import os
import re
import sys
import tarfile
import zipfile

sys.dont_write_bytecode = True

NAME = "moeep"
SUMMARY = "DeepEP-compatible expert-parallel communication for MoE inference over moeepd/libmoeep"
REQUIRES_PYTHON = ">=3.8"
TAG = "py3-none-any"
SOURCE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# The start-up hook (tools/moeep-deep-ep.pth, also installed by meson). A
# .pth line that begins with "import" is executed by site.py in every
# interpreter of the environment (spawned workers included), so it must be
# cheap and must never fail: it reads one variable and imports moeep only
# when asked to.
PTH_NAME = "moeep-deep-ep.pth"


def version(source=SOURCE):
    """The version in moeep/__init__.py (the one place it is written)."""
    with open(os.path.join(source, "moeep", "__init__.py"), encoding="utf-8") as f:
        m = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if not m:
        raise RuntimeError("moeep/__init__.py has no __version__ line")
    return m.group(1)


def package_files(source=SOURCE):
    """(path in the wheel, path on disk) of every .py file under moeep/."""
    out = []
    root = os.path.join(source, "moeep")
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                full = os.path.join(d, f)
                out.append((os.path.relpath(full, source).replace(os.sep, "/"), full))
    return out


def metadata(ver, source=SOURCE):
    with open(os.path.join(source, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: %s\nLicense: MIT\n"
            "Requires-Python: %s\nProvides-Extra: torch\nRequires-Dist: torch>=2.1; extra == \"torch\"\n"
            "Description-Content-Type: text/markdown\n\n%s" % (NAME, ver, SUMMARY, REQUIRES_PYTHON, readme))


def install_py(libdir):
    """moeep/_install.py: written by the build that knows the install libdir."""
    return ('"""Written when this wheel was built by meson: where `meson install` puts\n'
            'libmoeep.so (moeep/_lib.py looks there after $MOEEP_LIBRARY)."""\n\n'
            "LIBDIR = %r\n" % libdir)


def _digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_wheel(outdir, entries, ver):
    """Writes the wheel of `entries` ([(name, bytes)]) into outdir; returns
    its file name. Entries get a fixed time stamp, so equal inputs give equal
    wheels."""
    distinfo = "%s-%s.dist-info" % (NAME, ver)
    wheel_name = "%s-%s-%s.whl" % (NAME, ver, TAG)
    entries = list(entries)
    entries.append((distinfo + "/METADATA", metadata(ver).encode()))
    entries.append((distinfo + "/WHEEL", ("Wheel-Version: 1.0\nGenerator: moeep_build\nRoot-Is-Purelib: true\n"
                                          "Tag: %s\n" % TAG).encode()))
    record = "".join("%s,%s,%d\n" % (n, _digest(d), len(d)) for n, d in entries) + distinfo + "/RECORD,,\n"
    entries.append((distinfo + "/RECORD", record.encode()))
    os.makedirs(outdir, exist_ok=True)
    tmp = os.path.join(outdir, wheel_name + ".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in entries:
            info = zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, d)
    os.replace(tmp, os.path.join(outdir, wheel_name))
    return wheel_name


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _pth(source=SOURCE):
    return _read(os.path.join(source, "tools", PTH_NAME))


def wheel(outdir, libdir=None, source=SOURCE):
    entries = [(n, _read(p)) for n, p in package_files(source) if n != "moeep/_install.py"]
    if libdir:
        entries.append(("moeep/_install.py", install_py(libdir).encode()))
    entries.append((PTH_NAME, _pth(source)))
    return _write_wheel(outdir, entries, version(source))


# ---------------------------------------------------------------- PEP 517

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """`pip install ./client/python`: no libdir is known here, so moeep
    searches for libmoeep.so (moeep/_lib.py, candidate_paths)."""
    return wheel(wheel_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """`pip install -e ./client/python`: a .pth that puts this source
    directory on sys.path, and the start-up hook."""
    # site.py reads .pth files in sorted order: this one must come before
    # the hook's, which imports moeep from the directory it adds.
    entries = [("__editable__.moeep.pth", (SOURCE + "\n").encode()), (PTH_NAME, _pth())]
    return _write_wheel(wheel_directory, entries, version())


def build_sdist(sdist_directory, config_settings=None):
    ver = version()
    base = "%s-%s" % (NAME, ver)
    names = ["pyproject.toml", "README.md", "tools/moeep_build.py", "tools/" + PTH_NAME] + [n for n, _ in package_files()]
    out = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(out, "w:gz", format=tarfile.PAX_FORMAT) as t:
        for n in names:
            t.add(os.path.join(SOURCE, n), arcname=base + "/" + n, recursive=False)
        pkg_info = metadata(ver).encode()
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size = len(pkg_info)
        t.addfile(info, io.BytesIO(pkg_info))
    return os.path.basename(out)


def main(argv):
    import argparse

    p = argparse.ArgumentParser(prog="moeep_build.py", description="Builds the moeep wheel.")
    p.add_argument("command", choices=["wheel", "version"])
    p.add_argument("--outdir", default=".")
    p.add_argument("--libdir", help="where `meson install` puts libmoeep.so (absolute)")
    a = p.parse_args(argv)
    if a.command == "version":
        print(version())
        return 0
    if a.libdir and not os.path.isabs(a.libdir):
        p.error("--libdir must be absolute, got %r" % a.libdir)
    print(os.path.join(a.outdir, wheel(a.outdir, a.libdir)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
