"""What torch's row index ops cost by element width: the copies that place
the rows of a normal dispatch in rounds (index_copy_) and gather them for
its combine (index_select), against a plain copy of the same bytes (the
floor). moeep moves rows as 8-byte words (client/python/moeep/_normal.py,
_copy_rows); docs/benchmarks.md has the figures.

Run on a GPU machine with torch: python3 scripts/index-copy.py [ROWS] [HIDDEN]
(default 2600 rows of 7168, scattered among twice as many)."""
import statistics
import sys

import torch


def median_us(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in pairs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in pairs)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2600
    hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 7168
    torch.manual_seed(0)
    index = torch.randperm(2 * n, device="cuda")[:n]
    print("%d rows of %d, median of 50; GB/s counts bytes read and written" % (n, hidden))
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        rows = torch.randn(n, hidden, device="cuda").to(dtype)
        big = torch.empty(2 * n, hidden, device="cuda", dtype=dtype)
        native = rows.view(torch.uint8) if dtype == torch.float8_e4m3fn else rows  # no float8 index kernels
        big_native = big.view(torch.uint8) if dtype == torch.float8_e4m3fn else big
        words, big_words = rows.view(torch.int64), big.view(torch.int64)
        forms = (("index_copy_, by element", lambda: big_native.index_copy_(0, index, native)),
                 ("index_copy_, 8-byte words", lambda: big_words.index_copy_(0, index, words)),
                 ("index_select, by element", lambda: big_native.index_select(0, index)),
                 ("index_select, 8-byte words", lambda: big_words.index_select(0, index)),
                 ("copy_ (the floor)", lambda: big[:n].copy_(rows)))
        nbytes = 2 * rows.numel() * rows.element_size()
        for label, fn in forms:
            us = median_us(fn)
            print("%-5s %-28s %8.1f us %7.0f GB/s" % (name, label, us, nbytes / us / 1e3))


if __name__ == "__main__":
    main()
