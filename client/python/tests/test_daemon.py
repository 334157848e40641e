"""The control plane against no daemon and against this build's moeepd."""

import errno
import os
import tempfile
import unittest

from moeep import _endpoint, _job, _lib
from moeep.config import Plan

from .util import Daemon, ThreadGroup


class NoDaemonTest(unittest.TestCase):
    """Nothing listens: clear errors naming the socket, nothing started."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="moeep-py-nod-")
        self.missing = os.path.join(self.dir, "nobody-here.sock")
        self.saved = os.environ.get("MOEEP_SOCKET")

    def tearDown(self):
        os.environ.pop("MOEEP_SOCKET", None)
        if self.saved is not None:
            os.environ["MOEEP_SOCKET"] = self.saved
        os.rmdir(self.dir)

    def test_env_socket(self):
        os.environ["MOEEP_SOCKET"] = self.missing
        with self.assertRaises(_lib.MoeepError) as cm:
            _job.Client()
        e = cm.exception
        self.assertEqual(e.errno, errno.ENOENT)
        self.assertIn(self.missing, str(e))
        self.assertIn("$MOEEP_SOCKET", str(e))
        self.assertIn("is moeepd running", str(e))

    def test_argument_socket(self):
        with self.assertRaisesRegex(_lib.MoeepError, "nobody-here.sock.*the socket argument"):
            _job.Client(self.missing)

    def test_attach_all_ranks_fail(self):
        # Rank 0 cannot create the job: every rank raises, none waits.
        g = ThreadGroup(3)
        res = g.run(lambda r: _job.attach(r, 3, g.broadcast(r), g.all_gather(r), socket=self.missing))
        for rank, (client, exc) in enumerate(res):
            self.assertIsNone(client)
            self.assertIsInstance(exc, _lib.MoeepError, rank)
            self.assertEqual(exc.errno, errno.ENOENT)
            self.assertIn(self.missing, str(exc))
        self.assertIn("rank 0 could not create the job", str(res[1][1]))

    def test_attach_arguments(self):
        one = (lambda v: v, lambda v: [v])
        with self.assertRaises(ValueError):
            _job.attach(0, 9, *one, socket=self.missing)
        with self.assertRaises(ValueError):
            _job.attach(2, 2, *one, socket=self.missing)


class DaemonTest(unittest.TestCase):
    """This build's moeepd on a private socket."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        if rc != 0:
            raise AssertionError("moeepd exited %s" % rc)

    def test_one_rank_job(self):
        c = _job.attach(0, 1, lambda v: v, lambda v: [v], socket=self.daemon.socket, name="py-one",
                        gpu_uuid="GPU-00000000-0000-0000-0000-000000000000")
        try:
            job, rank, ws = c.info()
            self.assertGreater(job, 0)
            self.assertEqual((rank, ws), (0, 1))
            c.barrier()
        finally:
            c.close()
        with self.assertRaises(_lib.MoeepError):
            c.info()  # closed

    def test_four_ranks(self):
        g = ThreadGroup(4)

        def rank_fn(r):
            c = _job.attach(r, 4, g.broadcast(r), g.all_gather(r), socket=self.daemon.socket)
            try:
                info = c.info()
                c.barrier()
                return info
            finally:
                g.barrier.wait()
                c.close()

        res = g.run(rank_fn)
        self.assertEqual([e for _, e in res], [None] * 4)
        self.assertEqual({i[0] for i, _ in res}.__len__(), 1)  # one job
        self.assertEqual(sorted(i[1] for i, _ in res), [0, 1, 2, 3])

    def test_join_failure_reaches_every_rank(self):
        # Rank 1 joins with a gpu uuid the daemon refuses: every rank raises
        # with rank 1's reason, and no rank stays in the job.
        g = ThreadGroup(2)

        def rank_fn(r):
            return _job.attach(r, 2, g.broadcast(r), g.all_gather(r), socket=self.daemon.socket,
                               gpu_uuid="GPU-\x01bad" if r == 1 else None)

        res = g.run(rank_fn)
        for client, exc in res:
            self.assertIsNone(client)
            self.assertIsInstance(exc, _lib.MoeepError)
            self.assertIn("rank 1:", str(exc))
            self.assertIn("gpu uuid", str(exc))

    def test_bad_unique_id(self):
        with _job.Client(self.daemon.socket) as c:
            with self.assertRaises(_lib.MoeepError) as cm:
                c.join(bytes(128), 0, 1)
            self.assertIn("joining as rank 0 of 1", str(cm.exception))
            with self.assertRaises(ValueError):
                c.join(b"short", 0, 1)

    def test_endpoint_create_fails_cleanly(self):
        # No GPU here: moeep_ep_create must fail with libmoeep's reason (or,
        # in a build without CUDA, say that the library has no data plane);
        # the daemon goes on serving. On a GPU machine it may succeed.
        c = _job.attach(0, 1, lambda v: v, lambda v: [v], socket=self.daemon.socket, name="py-ep")
        try:
            cfg = Plan(1, hidden=1024, num_experts=8, max_tokens_per_rank=64).config()
            try:
                ep = _endpoint.Endpoint(c, cfg)
            except _lib.MoeepError as e:
                if c.lib.has_data_plane:
                    self.assertIn("moeep_ep_create (max_tokens_per_rank 64, hidden 1024", str(e))
                    reason = str(e).split("): ", 1)[1]
                    self.assertTrue(reason.strip(), "no reason in %r" % str(e))
                else:
                    self.assertEqual(e.errno, errno.ENOSYS)
                    self.assertIn("built without CUDA", str(e))
            else:
                self.assertGreater(ep.buffer_bytes(), 0)
                ep.destroy()
        finally:
            c.close()
        with _job.Client(self.daemon.socket) as again:
            self.assertEqual(again.create_job("after-ep", 1).__len__(), 128)

    def test_endpoint_invalid_config(self):
        # The endpoint's argument check runs before any CUDA call: its
        # message reaches Python on any machine.
        c = _job.attach(0, 1, lambda v: v, lambda v: [v], socket=self.daemon.socket, name="py-bad")
        try:
            if not c.lib.has_data_plane:
                self.skipTest("no data plane in this build")
            cfg = _lib.EpConfig(max_tokens_per_rank=64, hidden=1000, num_experts=8, max_topk=8)
            with self.assertRaises(_lib.MoeepError) as cm:
                _endpoint.Endpoint(c, cfg)
            self.assertEqual(cm.exception.errno, errno.EINVAL)
            self.assertIn("hidden 1000", str(cm.exception))
        finally:
            c.close()


if __name__ == "__main__":
    unittest.main()
