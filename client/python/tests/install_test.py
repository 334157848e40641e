"""The Python package installed as a user installs it (client/python/README.md):
into venvs in a temporary directory, with pip and no package index, so that
nothing is downloaded. No torch, no GPU, no daemon.

Usage (meson, test python-install): install_test.py WHEEL LIBMOEEP
  WHEEL     the wheel meson built (it names the prefix's libdir)
  LIBMOEEP  this build's libmoeep.so
"""

import os
import subprocess
import sys
import tempfile
import unittest
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(HERE)  # client/python
sys.path.insert(0, os.path.join(SOURCE, "tools"))
import moeep_build  # noqa: E402

WHEEL = LIBMOEEP = None

# A spawned worker (multiprocessing's "spawn", as vLLM starts its workers):
# a fresh interpreter that inherits only the environment.
SPAWN = """
import multiprocessing as mp
def worker(q):
    import deep_ep, deep_ep.utils
    q.put((deep_ep.__version__, deep_ep.__moeep__, deep_ep.Buffer.__module__, deep_ep.utils.EventOverlap.__module__))
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(q,))
    p.start()
    print(q.get(timeout=60))
    p.join(60)
"""


def run(cmd, env=None, cwd=None):
    e = dict(os.environ)
    # Nothing that would find the library or packages for us: meson sets
    # LD_LIBRARY_PATH to the build tree for tests.
    for k in ("MOEEP_LIBRARY", "MOEEP_DEEP_EP", "PYTHONPATH", "LD_LIBRARY_PATH", "PIP_INDEX_URL",
              "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        e.pop(k, None)
    e.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1", PIP_NO_CACHE_DIR="1")
    e.update(env or {})
    return subprocess.run(cmd, env=e, cwd=cwd, capture_output=True, text=True, timeout=180)


def tree(root):
    """Every file and directory under root but __pycache__ (git ignores it)."""
    out = set()
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out.update(os.path.relpath(os.path.join(d, x), root) for x in dirs + files)
    return out


class Venv:
    def __init__(self, tmp, name):
        self.dir = os.path.join(tmp, name)
        r = run([sys.executable, "-m", "venv", self.dir])
        if r.returncode != 0:
            raise unittest.SkipTest("python3 -m venv failed (python3-venv missing?): " + r.stderr[-500:])
        self.python = os.path.join(self.dir, "bin", "python")

    def pip(self, *args):
        r = run([self.python, "-m", "pip", "install", "-q"] + list(args))
        if r.returncode != 0:
            raise AssertionError("pip install %s failed:\n%s%s" % (" ".join(args), r.stdout, r.stderr))

    def py(self, code, env=None, cwd=None):
        return run([self.python, "-c", code], env=env, cwd=cwd)


class InstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tempfile.TemporaryDirectory(prefix="moeep-install-")
        cls.tmp = cls.tmpdir.name
        cls.venv = Venv(cls.tmp, "wheel")
        cls.venv.pip(WHEEL)

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def candidates(self, venv):
        r = venv.py("import moeep._lib as l; print(repr(l.candidate_paths()))")
        self.assertEqual(r.returncode, 0, r.stderr)
        return eval(r.stdout)

    def test_meson_wheel_names_the_libdir(self):
        with zipfile.ZipFile(WHEEL) as z:
            names = z.namelist()
            install_py = z.read("moeep/_install.py").decode()
        self.assertIn("moeep-deep-ep.pth", names)
        self.assertIn("moeep/_deep_ep/__init__.py", names)
        ns = {}
        exec(install_py, ns)
        self.assertTrue(os.path.isabs(ns["LIBDIR"]), ns["LIBDIR"])
        # The installed package looks there first, and names no path
        # outside the venv but the libdir (the linker's search gives a bare
        # soname, or nothing).
        first = self.candidates(self.venv)[0]
        self.assertEqual(first, (os.path.join(ns["LIBDIR"], "libmoeep.so.0"),
                                 "the libdir of the meson build that made this package"))
        for path, origin in self.candidates(self.venv)[1:]:
            self.assertTrue(path is None or os.sep not in path or path.startswith(self.venv.dir), (path, origin))

    def test_finds_the_library_without_variables(self):
        # A wheel made as meson makes it, for a prefix whose libdir holds
        # this build's library: it loads with no variable set.
        libdir = os.path.join(self.tmp, "prefix-lib")
        os.makedirs(libdir, exist_ok=True)
        os.symlink(os.path.realpath(LIBMOEEP), os.path.join(libdir, "libmoeep.so.0"))
        outdir = os.path.join(self.tmp, "wheel-found")
        wheel = os.path.join(outdir, moeep_build.wheel(outdir, libdir))
        venv = Venv(self.tmp, "found")
        venv.pip(wheel)
        r = venv.py("import moeep; print(moeep.load_library().path)")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), os.path.join(libdir, "libmoeep.so.0"))
        r = run([venv.python, "-m", "moeep"])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("libmoeep: " + os.path.join(libdir, "libmoeep.so.0"), r.stdout)

    def test_missing_library_is_named(self):
        r = self.venv.py("import moeep._lib as l; l.Library(l.candidate_paths()[-1][0])")
        if r.returncode == 0:
            self.skipTest("a libmoeep.so is installed where the dynamic linker finds it: no library is missing here")
        libdir = os.path.join(self.tmp, "empty-lib")
        os.makedirs(libdir, exist_ok=True)
        outdir = os.path.join(self.tmp, "wheel-missing")
        wheel = os.path.join(outdir, moeep_build.wheel(outdir, libdir))
        venv = Venv(self.tmp, "missing")
        venv.pip(wheel)
        r = venv.py("import moeep; moeep.load_library()")
        self.assertNotEqual(r.returncode, 0)
        msg = r.stderr.strip().splitlines()[-1]
        self.assertIn(os.path.join(libdir, "libmoeep.so.0") + " (the libdir of the meson build", msg)
        self.assertIn("meson install", msg)
        self.assertIn("MOEEP_LIBRARY", msg)
        # No path made up from where the venv happens to be.
        self.assertNotIn("build/client", msg)
        r = run([venv.python, "-m", "moeep"])
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("cannot load libmoeep.so", r.stdout)

    def test_source_install_leaves_no_litter(self):
        before = tree(SOURCE)
        venv = Venv(self.tmp, "source")
        venv.pip(SOURCE)
        self.assertEqual(tree(SOURCE) - before, set(), "pip install client/python left files in the tree")
        r = venv.py("import moeep, os; print(moeep.__file__)", env={"MOEEP_LIBRARY": LIBMOEEP}, cwd=self.tmp)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(r.stdout.strip().startswith(venv.dir), r.stdout)
        # Built from source no libdir is known: the search starts next to
        # the package, and the library comes from $MOEEP_LIBRARY.
        self.assertEqual(self.candidates(venv)[0][1], "next to the package")
        r = venv.py("import moeep; print(moeep.load_library().path)", env={"MOEEP_LIBRARY": LIBMOEEP}, cwd=self.tmp)
        self.assertEqual((r.returncode, r.stdout.strip()), (0, LIBMOEEP), r.stderr)

    def test_deep_ep_alias_reaches_spawned_workers(self):
        script = os.path.join(self.tmp, "spawn.py")
        with open(script, "w") as f:
            f.write(SPAWN)
        r = run([self.venv.python, script], env={"MOEEP_DEEP_EP": "1"}, cwd=self.tmp)
        self.assertEqual(r.returncode, 0, r.stderr)
        version, is_moeep, buffer_module, event_module = eval(r.stdout.strip())
        self.assertTrue(version.startswith("1.2.1+moeep."), version)
        self.assertIs(is_moeep, True)
        self.assertEqual((buffer_module, event_module), ("moeep.buffer", "moeep.event"))

    def test_deep_ep_alias_is_opt_in(self):
        for value in (None, "", "0"):
            env = {} if value is None else {"MOEEP_DEEP_EP": value}
            r = self.venv.py("import deep_ep", env=env, cwd=self.tmp)
            self.assertNotEqual(r.returncode, 0, value)
            self.assertIn("No module named 'deep_ep'", r.stderr, value)

    def test_deep_ep_alias_never_shadows_deepep(self):
        # Any other deep_ep on the path counts as a real DeepEP.
        fake = os.path.join(self.tmp, "elsewhere", "deep_ep")
        os.makedirs(fake, exist_ok=True)
        with open(os.path.join(fake, "__init__.py"), "w") as f:
            f.write("REAL = True\n")
        env = {"MOEEP_DEEP_EP": "1", "PYTHONPATH": os.path.dirname(fake)}
        for code in ("import deep_ep", "import importlib.util; importlib.util.find_spec('deep_ep')",
                     "try:\n import deep_ep\nexcept ImportError:\n pass"):
            r = self.venv.py(code, env=env, cwd=self.tmp)
            self.assertNotEqual(r.returncode, 0, code)
            self.assertIn("DeepEPConflictError", r.stderr, code)
            self.assertIn(os.path.join(fake, "__init__.py"), r.stderr, code)
        # Without the variable the real one is imported, untouched.
        r = self.venv.py("import deep_ep; print(deep_ep.REAL)", env={"PYTHONPATH": os.path.dirname(fake)})
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "True"), r.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    WHEEL, LIBMOEEP = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    # Without venv or ensurepip (python3-venv) nothing here can run: say so
    # as a skip (77) rather than pass.
    with tempfile.TemporaryDirectory() as d:
        r = run([sys.executable, "-m", "venv", os.path.join(d, "probe")])
    if r.returncode != 0:
        print("SKIP: python3 -m venv does not work here (install python3-venv): " + r.stderr.strip()[-300:])
        sys.exit(77)
    unittest.main(argv=sys.argv[:1], verbosity=2)
