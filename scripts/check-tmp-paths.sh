#!/bin/sh
# Fails when a test names /tmp itself instead of $TMPDIR: scripts/test.sh
# points TMPDIR at a directory of its own and checks that nothing is left
# in it, which only works when every test puts its files there (C:
# tests/tmpdir.h; shell: "${TMPDIR:-/tmp}", tests/tmpdir.sh; Python:
# tempfile). Lists each offending line.
#
# Usage: scripts/check-tmp-paths.sh [SOURCE_ROOT]
root=${1:-$(dirname "$0")/..}
cd "$root" || exit 2
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        files=$(git ls-files tests client/python/tests)
else
        files=$(find tests client/python/tests -type f)
fi
# /tmp as a path of its own: "/tmp/..." or '/tmp/...' or /tmp at a word
# start; the fallback of ${TMPDIR:-/tmp} and tests/tmpdir.h are allowed.
# shellcheck disable=SC2086
bad=$(grep -nE '(^|[^-A-Za-z0-9_.])/tmp(/|"|$)' $files /dev/null |
        grep -v -e 'TMPDIR:-/tmp' -e '/tmp/nvidia-mps' -e '^tests/tmpdir\.h:' -e '^tests/fuzz/corpus/')
if [ -n "$bad" ]; then
        echo "these test lines name /tmp; use \$TMPDIR (tests/tmpdir.h, \"\${TMPDIR:-/tmp}\", tempfile):"
        echo "$bad"
        exit 1
fi
echo "check-tmp-paths: no test names /tmp"
