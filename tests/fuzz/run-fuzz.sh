#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time from its seed corpus.
#
#   run-fuzz.sh TARGET SEED_DIR WORK_DIR SECONDS [more libFuzzer options]
#
# New inputs go to WORK_DIR/corpus (the committed seeds are only read);
# crashing inputs to WORK_DIR/crash-*. Exit status: libFuzzer's, so any
# crash, leak, sanitizer report or per-input timeout (10 s) fails the test.
# -error_exitcode=1: libFuzzer's default, 77, is what meson reads as a
# skipped test, so a crash would not fail the suite.
# -print_funcs=0: printing newly covered functions starts the symbolizer,
# whose two pipes would look like descriptors leaked by fuzz-session.
set -uo pipefail
if [[ $# -lt 4 ]]; then
        echo "usage: $0 TARGET SEED_DIR WORK_DIR SECONDS [libFuzzer options]" >&2
        exit 2
fi
target=$1 seeds=$2 work=$3 seconds=$4
shift 4
mkdir -p "$work/corpus"
exec "$target" -max_total_time="$seconds" -timeout=10 -error_exitcode=1 -rss_limit_mb=2048 -max_len=4096 \
        -print_final_stats=1 -print_funcs=0 -artifact_prefix="$work/" "$@" "$work/corpus" "$seeds"
