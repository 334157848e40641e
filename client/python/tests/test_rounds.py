"""Where the rows of a normal dispatch in rounds go (moeep/_normal.py:
_round_table), without a GPU, against a reference that sorts every row by
DeepEP's order: each round brings its rows by source rank, and the outputs
hold every source's rows together, source by source, each source's in the
order its rounds came (its tokens' order). The GPU test
(tests/gpu/test_deepep_semantics.py, rounds) checks the rows themselves."""

import random
import unittest

from moeep._normal import _round_table


def _places(per):
    """Output row of every row among the rounds' rows, by sorting."""
    rows = [(s, j, k) for j, r in enumerate(per) for s, c in enumerate(r) for k in range(c)]
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    place = [0] * len(rows)
    for out, i in enumerate(order):
        place[i] = out
    return place


def _expand(shift, rows):
    """What the GPU makes of the table: arange + repeat_interleave."""
    out, i = [], 0
    for sh, c in zip(shift, rows):
        out += [i + k + sh for k in range(c)]
        i += c
    return out


class RoundTableTest(unittest.TestCase):
    def test_small(self):
        # Source 0 sends 2, 0, 1 rows in rounds 0-2; source 1 sends 1, 3, 0.
        shift, rows, n = _round_table([[2, 1], [0, 3], [1, 0]])
        self.assertEqual(n, 7)
        self.assertEqual(_expand(shift, rows), [0, 1, 3, 4, 5, 6, 2])

    def test_random_against_sorting(self):
        rng = random.Random(7)
        for _ in range(500):
            ranks, rounds = rng.randint(1, 8), rng.randint(1, 5)
            per = [[rng.choice((0, rng.randint(0, 40))) for _ in range(ranks)] for _ in range(rounds)]
            shift, rows, n = _round_table(per)
            self.assertEqual(n, sum(map(sum, per)))
            self.assertEqual(rows, [c for r in per for c in r])
            self.assertEqual(_expand(shift, rows), _places(per), per)

    def test_nothing(self):
        self.assertEqual(_round_table([]), ([], [], 0))
        self.assertEqual(_round_table([[0, 0], [0, 0]]), ([0, 0, 0, 0], [0, 0, 0, 0], 0))


if __name__ == "__main__":
    unittest.main()
