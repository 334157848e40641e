"""`import moeep` and everything that needs neither torch nor a daemon."""

import subprocess
import sys
import unittest

import moeep
from moeep import config
from moeep.config import Plan


class ImportTest(unittest.TestCase):
    def test_import_without_torch(self):
        # A fresh interpreter: importing moeep and using its torch-free parts
        # must not import torch.
        code = ("import sys, moeep; moeep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256); "
                "moeep.Config(24); moeep.EventOverlap(None); "
                "assert 'torch' not in sys.modules, 'torch was imported'; print('ok')")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "ok")

    def test_public_names(self):
        for name in ("Buffer", "Config", "EventOverlap", "MoeepError"):
            self.assertTrue(hasattr(moeep, name), name)
        self.assertTrue(issubclass(moeep.MoeepError, OSError))
        e = moeep.MoeepError(2, "cannot connect")
        self.assertEqual((e.errno, e.strerror), (2, "cannot connect"))

    def test_buffer_without_torch(self):
        try:
            import torch  # noqa: F401
            self.skipTest("torch is installed here")
        except ImportError:
            pass
        with self.assertRaisesRegex(ImportError, "needs PyTorch"):
            moeep.Buffer(None)

    def test_event_overlap(self):
        ev = moeep.EventOverlap(None)
        with ev:
            pass  # no event: nothing to wait for
        with self.assertRaises(AssertionError):
            ev.current_stream_wait()


class StaticTest(unittest.TestCase):
    def setUp(self):
        self.saved = moeep.Buffer.num_sms

    def tearDown(self):
        moeep.Buffer.num_sms = self.saved

    def test_set_num_sms(self):
        moeep.Buffer.set_num_sms(32)
        self.assertEqual(moeep.Buffer.num_sms, 32)
        self.assertEqual(moeep.Buffer.get_dispatch_config(8).num_sms, 32)
        self.assertEqual(moeep.Buffer.get_combine_config(2).num_sms, 32)
        for bad in (0, -1, 1025, 2.5, "24", True):
            with self.assertRaises(ValueError, msg=repr(bad)):
                moeep.Buffer.set_num_sms(bad)
        self.assertEqual(moeep.Buffer.num_sms, 32)

    def test_config(self):
        c = moeep.Config(20, 6, 256, 6, 128)
        self.assertEqual(c.num_sms, 20)
        self.assertEqual(c.num_max_nvl_chunked_recv_tokens, 256)
        self.assertEqual(c.get_rdma_buffer_size_hint(14336, 8), 0)
        with self.assertRaises(ValueError):
            moeep.Config(0)
        with self.assertRaises(ValueError):
            moeep.Buffer.get_dispatch_config(0)

    def test_rdma_size_hint_round_trip(self):
        for t, h, r, e in ((128, 7168, 8, 256), (1, 256, 1, 1), (1024, 2048, 4, 64), (77, 4096, 2, 32)):
            b = moeep.Buffer.get_low_latency_rdma_size_hint(t, h, r, e)
            self.assertGreater(b, 0)
            self.assertEqual(config.tokens_for_rdma_bytes(b, h, e), t)
            self.assertLess(config.tokens_for_rdma_bytes(b - 1, h, e), t)
            p = Plan(r, num_rdma_bytes=b, low_latency_mode=True, hidden=h, num_experts=e)
            self.assertEqual(p.config().ll_max_tokens, t)
        with self.assertRaises(ValueError):
            moeep.Buffer.get_low_latency_rdma_size_hint(0, 7168, 8, 256)

    def test_nvl_size_hint_round_trip(self):
        hint = moeep.Config().get_nvl_buffer_size_hint(7168 * 2, 8)
        p = Plan(8, num_nvl_bytes=hint, hidden=7168, num_experts=256)
        self.assertEqual(p.config().max_tokens_per_rank, config.DEFAULT_MAX_TOKENS_PER_RANK)
        # Twice the bytes: about twice the tokens.
        p = Plan(8, num_nvl_bytes=2 * hint, hidden=7168, num_experts=256)
        self.assertAlmostEqual(p.config().max_tokens_per_rank / 8192, 1, delta=0.01)


class PlanTest(unittest.TestCase):
    def test_defaults(self):
        c = Plan(4, hidden=7168, num_experts=256).config(num_sms=24)
        self.assertEqual((c.max_tokens_per_rank, c.hidden, c.num_experts, c.max_topk, c.num_sms, c.ll_max_tokens),
                         (4096, 7168, 256, 9, 24, 0))
        c = Plan(4, low_latency_mode=True, hidden=7168, num_experts=256).config()
        self.assertEqual((c.max_tokens_per_rank, c.ll_max_tokens), (128, 128))
        c = Plan(4, low_latency_mode=True, hidden=2048, num_experts=32, max_tokens_per_rank=512,
                 num_max_dispatch_tokens_per_rank=64, max_topk=4, timeout_ms=500).config()
        self.assertEqual((c.max_tokens_per_rank, c.ll_max_tokens, c.max_topk, c.timeout_ms), (512, 64, 4, 500))

    def test_unknown_shapes(self):
        p = Plan(2)
        self.assertFalse(p.ready)
        with self.assertRaises(ValueError):
            p.config()
        p.set_hidden(4096)
        p.set_num_experts(16)
        self.assertTrue(p.ready)
        with self.assertRaisesRegex(ValueError, "differs"):
            p.set_hidden(2048)

    def test_validation(self):
        bad = [
            dict(num_ranks=0), dict(num_ranks=9), dict(num_nvl_bytes=-1), dict(num_rdma_bytes=1.5),
            dict(hidden=100), dict(hidden=16640), dict(hidden=7000), dict(num_experts=6),  # 6 % 4
            dict(num_experts=0), dict(num_experts=516), dict(max_topk=0), dict(max_topk=10),
            dict(max_tokens_per_rank=0), dict(max_tokens_per_rank=65537),
            dict(num_max_dispatch_tokens_per_rank=128),  # needs low_latency_mode
            dict(low_latency_mode=True, num_max_dispatch_tokens_per_rank=1025), dict(timeout_ms=-5),
        ]
        for kw in bad:
            args = dict(num_ranks=4)
            args.update(kw)
            with self.assertRaises(ValueError, msg=repr(kw)):
                Plan(**args)

    def test_too_few_bytes(self):
        with self.assertRaisesRegex(ValueError, "num_nvl_bytes"):
            Plan(8, num_nvl_bytes=4096, hidden=7168, num_experts=256).config()
        with self.assertRaisesRegex(ValueError, "num_rdma_bytes"):
            Plan(8, num_rdma_bytes=4096, low_latency_mode=True, hidden=7168, num_experts=256).config()


if __name__ == "__main__":
    unittest.main()
