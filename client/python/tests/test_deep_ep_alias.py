"""The deep_ep alias (moeep.deep_ep_alias): the names the engines import, and
what the module says about itself. Each check runs in a fresh interpreter,
so that the alias never leaks into the other tests of this process.

The names are those used by vLLM (deepep_ht / deepep_ll prepare-finalize,
the DeepEP all2all managers), SGLang (token_dispatcher/deepep.py), Megatron
(moe/fused_a2a.py), torchtitan (distributed/deepep) and DeepEP's own tests.
"""

import os
import subprocess
import sys
import tempfile
import unittest

# Module-level names: `from deep_ep import ...` and `deep_ep.X`.
MODULE_NAMES = ["Buffer", "Config", "EventOverlap", "topk_idx_t", "__version__", "buffer", "utils"]
# `from deep_ep.utils import EventHandle, EventOverlap` (Megatron, torchtitan).
UTILS_NAMES = ["EventHandle", "EventOverlap"]
# Buffer's class-level names the engines call.
BUFFER_NAMES = ["capture", "set_num_sms", "num_sms", "get_dispatch_config", "get_combine_config",
                "get_low_latency_rdma_size_hint", "get_dispatch_layout", "dispatch", "combine",
                "low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer", "get_comm_stream",
                "destroy", "is_sm90_compiled", "get_next_low_latency_combine_buffer"]

PRELUDE = "import sys; from moeep import deep_ep_alias; deep_ep_alias.install()\n"


def python(code, env=None):
    e = {k: v for k, v in os.environ.items() if k != "MOEEP_DEEP_EP"}
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, env=e, timeout=60)
    return r


def have_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


class AliasTest(unittest.TestCase):
    def check(self, code, env=None):
        r = python(code, env)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout.strip()

    def test_says_it_is_moeep(self):
        out = self.check("import deep_ep, moeep; print(deep_ep.__moeep__, deep_ep.__version__, moeep.__version__); "
                         "print('NOT DeepEP' in deep_ep.__doc__, deep_ep.__file__.startswith("
                         "__import__('os').path.dirname(moeep.__file__)))")
        first, second = out.splitlines()
        is_moeep, version, moeep_version = first.split()
        self.assertEqual(is_moeep, "True")
        self.assertEqual(version, "1.2.1+moeep." + moeep_version)
        self.assertEqual(second, "True True")

    def test_module_names(self):
        torch_free = [n for n in MODULE_NAMES if n != "topk_idx_t"]
        out = self.check("import deep_ep, moeep\n"
                         "from deep_ep import Buffer, Config, EventOverlap\n"
                         "from deep_ep.utils import EventOverlap as E2\n"
                         "from deep_ep.buffer import Buffer as B2\n"
                         "assert Buffer is moeep.Buffer and B2 is Buffer and Config is moeep.Config\n"
                         "assert EventOverlap is moeep.EventOverlap and E2 is EventOverlap\n"
                         "print([n for n in %r if not hasattr(deep_ep, n)])\n"
                         "print('torch' in sys.modules)" % torch_free)
        missing, torch_loaded = out.splitlines()
        self.assertEqual(missing, "[]")
        if not have_torch():
            self.assertEqual(torch_loaded, "False", "import deep_ep imported torch")

    def test_missing_names_raise_import_error(self):
        # Engines probe optional names (Megatron: HybridEPBuffer) with
        # try/except ImportError.
        out = self.check("try:\n from deep_ep import HybridEPBuffer\nexcept ImportError as e:\n print('ImportError')\n"
                         "try:\n from deep_ep.utils import NoSuchName\nexcept ImportError as e:\n print('ImportError')")
        self.assertEqual(out, "ImportError\nImportError")

    def test_torch_names(self):
        if not have_torch():
            # Without torch they need it, and say so.
            r = python("import deep_ep; deep_ep.topk_idx_t")
            self.assertIn("No module named 'torch'", r.stderr)
            self.skipTest("torch is not installed: topk_idx_t and EventHandle checked only for their error")
        out = self.check("import torch, deep_ep; from deep_ep.utils import EventHandle\n"
                         "print(deep_ep.topk_idx_t == torch.int64, isinstance(EventHandle, type), "
                         "hasattr(EventHandle, 'current_stream_wait'))")
        self.assertEqual(out, "True True True")

    def test_buffer_names(self):
        out = self.check("import deep_ep; print([n for n in %r if not hasattr(deep_ep.Buffer, n)])" % BUFFER_NAMES)
        self.assertEqual(out, "[]")

    def test_real_deep_ep_is_not_shadowed(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "deep_ep"))
            open(os.path.join(d, "deep_ep", "__init__.py"), "w").close()
            r = python("import deep_ep", {"PYTHONPATH": os.pathsep.join([d] + sys.path)})
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("DeepEPConflictError", r.stderr)
        self.assertIn("will not shadow it", r.stderr)

    def test_install_is_idempotent_and_undone(self):
        out = self.check("deep_ep_alias.install(); print(sum(isinstance(f, deep_ep_alias._Finder) "
                         "for f in sys.meta_path)); deep_ep_alias.uninstall()\n"
                         "try:\n import deep_ep\nexcept ImportError:\n print('gone')")
        self.assertEqual(out, "1\ngone")


if __name__ == "__main__":
    unittest.main()
