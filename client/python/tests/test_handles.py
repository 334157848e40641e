"""A normal-mode dispatch handle (moeep/_handles.py: DispatchHandle) is
DeepEP's 6-tuple whether its items were given or are made on first read:
indexing, slicing, unpacking, iteration, tuple() and repr see the made
items, the maker runs once, and a handle whose routing was released
refuses to make them. Without torch or a GPU."""

import unittest

from moeep._handles import DispatchHandle


class _Buffer:
    pass


class _Route:
    def __init__(self):
        self._buffer = _Buffer()
        self.ptr = 1234


ITEMS = ("prefix", None, None, "src", "in_rank", "send_head")


def _handle(items):
    return DispatchHandle(_Route(), 4, 6, 2, "idx", "weights", items)


class Handles(unittest.TestCase):
    def check_tuple(self, h):
        self.assertIsInstance(h, tuple)
        self.assertEqual(len(h), 6)
        self.assertEqual(h[0], "prefix")
        self.assertEqual(h[3], "src")
        self.assertEqual(h[-1], "send_head")
        self.assertEqual(h[3:5], ("src", "in_rank"))
        a, b, c, d, e, f = h
        self.assertEqual((a, b, c, d, e, f), ITEMS)
        self.assertEqual(tuple(h), ITEMS)
        self.assertEqual(list(h), list(ITEMS))
        self.assertEqual([x for x in h], list(ITEMS))
        self.assertIn("send_head", repr(h))
        self.assertEqual((h.num_tokens, h.num_recv_tokens, h.num_topk, h.ptr), (4, 6, 2, 1234))

    def test_given_items(self):
        self.check_tuple(_handle(ITEMS))

    def test_made_once_on_first_read(self):
        calls = []

        def make():
            calls.append(1)
            return ITEMS

        h = _handle(make)
        self.assertEqual(calls, [])  # nothing made until read
        self.check_tuple(h)
        self.check_tuple(h)
        self.assertEqual(calls, [1])

    def test_released_before_read(self):
        h = _handle(lambda: ITEMS)
        h._route.ptr = None
        with self.assertRaisesRegex(ValueError, "released"):
            h[0]
        with self.assertRaisesRegex(ValueError, "released"):
            tuple(h)


if __name__ == "__main__":
    unittest.main()
