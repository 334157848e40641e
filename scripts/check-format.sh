#!/usr/bin/env bash
# Fails when a C or CUDA source or header of the repository (.c, .h, .cu,
# .cuh) is not as its .clang-format wants it (clang-format-14, dry run): the
# nearest one up from the file, kernels/.clang-format for the kernels (the
# repository's style, wider).
# Exit status: 0 clean, 1 with the files that are not, 77 (skip) without
# clang-format-14.
#
# Usage: scripts/check-format.sh [SOURCE_ROOT]     (default: the repository)
set -uo pipefail
root=${1:-$(dirname "$0")/..}
cd "$root" || exit 2
command -v clang-format-14 >/dev/null || { echo "check-format: clang-format-14 is not installed"; exit 77; }
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        mapfile -t files < <(git ls-files '*.c' '*.h' '*.cu' '*.cuh')
else
        mapfile -t files < <(find . -path ./build\* -prune -o \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print)
fi
bad=0
for f in "${files[@]}"; do
        if ! clang-format-14 --dry-run --Werror "$f" >/dev/null 2>&1; then
                echo "not formatted: $f (clang-format-14 -i $f)"
                bad=1
        fi
done
[[ $bad == 0 ]] && echo "check-format: ${#files[@]} files formatted"
exit $bad
