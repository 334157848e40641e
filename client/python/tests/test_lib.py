"""Loading libmoeep.so and the ctypes structures against the C layout."""

import ctypes
import os
import subprocess
import tempfile
import unittest

from moeep import _lib, config


class LoadTest(unittest.TestCase):
    def setUp(self):
        self.saved = os.environ.get("MOEEP_LIBRARY")
        _lib.reset_library_cache()

    def tearDown(self):
        if self.saved is None:
            os.environ.pop("MOEEP_LIBRARY", None)
        else:
            os.environ["MOEEP_LIBRARY"] = self.saved
        _lib.reset_library_cache()

    def test_loads(self):
        if not self.saved:
            self.skipTest("MOEEP_LIBRARY is not set (run through meson test)")
        lib = _lib.load_library()
        self.assertEqual(lib.path, self.saved)
        self.assertIs(_lib.load_library(), lib)  # cached
        if os.environ.get("MOEEP_TEST_CUDA") == "1":
            self.assertTrue(lib.has_data_plane)
        elif os.environ.get("MOEEP_TEST_CUDA") == "0":
            self.assertFalse(lib.has_data_plane)
            with self.assertRaisesRegex(_lib.MoeepError, "built without CUDA") as cm:
                lib.require_data_plane()
            self.assertIn(lib.path, str(cm.exception))

    def test_missing_file(self):
        os.environ["MOEEP_LIBRARY"] = "/nonexistent/libmoeep.so"
        with self.assertRaises(OSError) as cm:
            _lib.load_library()
        msg = str(cm.exception)
        self.assertIn("/nonexistent/libmoeep.so", msg)
        self.assertIn("MOEEP_LIBRARY", msg)
        self.assertIn("no such file", msg)

    def test_not_a_library(self):
        with tempfile.NamedTemporaryFile(suffix=".so") as f:
            f.write(b"not an ELF file")
            f.flush()
            os.environ["MOEEP_LIBRARY"] = f.name
            with self.assertRaises(OSError) as cm:
                _lib.load_library()
            self.assertIn(f.name, str(cm.exception))

    def test_wrong_library(self):
        # A real shared library without moeep's symbols.
        libc = ctypes.util.find_library("c")
        if not libc:
            self.skipTest("no libc found")
        os.environ["MOEEP_LIBRARY"] = libc
        with self.assertRaisesRegex(OSError, "moeep_connect"):
            _lib.load_library()

    def test_search_order(self):
        os.environ.pop("MOEEP_LIBRARY", None)
        origins = [o for _, o in _lib.candidate_paths()]
        # Used from the checkout (PYTHONPATH=client/python): no _install.py,
        # and the checkout's build tree is a candidate, under this checkout.
        self.assertEqual(origins, ["next to the package", "the build tree of this checkout",
                                   "ctypes.util.find_library('moeep')"])
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(_lib.__file__)))))
        self.assertEqual(_lib.candidate_paths()[1][0], os.path.join(repo, "build", "client", "libmoeep.so"))
        os.environ["MOEEP_LIBRARY"] = "/x/libmoeep.so"
        self.assertEqual(_lib.candidate_paths(), [("/x/libmoeep.so", "$MOEEP_LIBRARY")])

    def test_socket_resolution(self):
        saved = os.environ.pop("MOEEP_SOCKET", None)
        try:
            self.assertEqual(_lib.resolve_socket(), ("/run/moeep/moeepd.sock", "the default"))
            os.environ["MOEEP_SOCKET"] = "/srv/a.sock"
            self.assertEqual(_lib.resolve_socket(), ("/srv/a.sock", "$MOEEP_SOCKET"))
            self.assertEqual(_lib.resolve_socket("/srv/b.sock"), ("/srv/b.sock", "the socket argument"))
        finally:
            os.environ.pop("MOEEP_SOCKET", None)
            if saved is not None:
                os.environ["MOEEP_SOCKET"] = saved


class AbiTest(unittest.TestCase):
    """Every ctypes structure has the C compiler's size and offsets."""

    def test_layout(self):
        prog = os.environ.get("MOEEP_TEST_ABI")
        if not prog:
            self.skipTest("MOEEP_TEST_ABI is not set (run through meson test)")
        out = subprocess.run([prog], capture_output=True, text=True, check=True).stdout
        seen = set()
        for line in out.splitlines():
            struct, field, value = line.split()
            cls = _lib.STRUCTS[struct]
            seen.add(struct)
            if field == "sizeof":
                self.assertEqual(ctypes.sizeof(cls), int(value), struct)
            else:
                self.assertEqual(getattr(cls, field).offset, int(value), "%s.%s" % (struct, field))
        expected = {"moeep_unique_id", "moeep_event"}
        if os.environ.get("MOEEP_TEST_CUDA") == "1":
            expected = set(_lib.STRUCTS)
        self.assertEqual(seen, expected)
        # Every field the C program names exists in ctypes, and none is missing.
        for struct in seen:
            names = [ln.split()[1] for ln in out.splitlines() if ln.split()[0] == struct and ln.split()[1] != "sizeof"]
            self.assertEqual(names, [f[0] for f in _lib.STRUCTS[struct]._fields_], struct)

    def test_constants(self):
        """The constants moeep/_lib.py and moeep/config.py repeat have the C
        headers' values (moeep.h, moeep_ep.h, kernels/common/params.h), and the
        sync areas fit the allowances config.py sizes buffers with."""
        prog = os.environ.get("MOEEP_TEST_ABI")
        if not prog:
            self.skipTest("MOEEP_TEST_ABI is not set (run through meson test)")
        out = subprocess.run([prog, "--constants"], capture_output=True, text=True, check=True).stdout
        c = {name: int(value) for name, value in (line.split() for line in out.splitlines())}
        mirrors = {
            "MOEEP_UNIQUE_ID_BYTES": _lib.MOEEP_UNIQUE_ID_BYTES,
            "MOEEP_MAX_RANKS": _lib.MOEEP_MAX_RANKS,
            "MOEEP_KERNEL_MAX_TOPK": _lib.MAX_TOPK,
            "MOEEP_KERNEL_MAX_EXPERTS": _lib.MAX_EXPERTS,
            "MOEEP_KERNEL_MAX_TOKENS": _lib.MAX_TOKENS_PER_RANK,
            "MOEEP_SCALE_BLOCK": _lib.SCALE_BLOCK,
            "MOEEP_BUFFER_ALIGN": config._ALIGN,
            "MOEEP_MAX_RECV_AREAS": _lib.MAX_RECV_AREAS,
        }
        if os.environ.get("MOEEP_TEST_CUDA") == "1":
            mirrors.update({
                "MOEEP_DEFAULT_NUM_SMS": _lib.MOEEP_DEFAULT_NUM_SMS,
                "MOEEP_DEFAULT_TIMEOUT_MS": _lib.MOEEP_DEFAULT_TIMEOUT_MS,
                "MOEEP_LL_MAX_TOKENS": _lib.MOEEP_LL_MAX_TOKENS,
                "MOEEP_DEFAULT_SHRINK_TIMEOUT_MS": _lib.MOEEP_DEFAULT_SHRINK_TIMEOUT_MS,
            })
        for name, py in mirrors.items():
            self.assertIn(name, c)
            self.assertEqual(py, c[name], "%s: Python has %d, the C header %d" % (name, py, c[name]))
        self.assertLessEqual(c["sizeof_moeep_sync"], config._SYNC_BYTES, "struct moeep_sync outgrew _SYNC_BYTES")
        self.assertLessEqual(c["sizeof_moeep_ll_sync"], config._LL_SYNC_BYTES,
                             "struct moeep_ll_sync outgrew _LL_SYNC_BYTES")


if __name__ == "__main__":
    unittest.main()
