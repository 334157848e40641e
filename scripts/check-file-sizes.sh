#!/bin/sh
# Lists the source files longer than the limit (1,500 lines unless given),
# the longest first: what one concept may need, and past it a file usually
# holds two (docs/style.md, "One file per concept"). Source files are the
# tracked C, CUDA, Python, shell, meson and protobuf files (git ls-files;
# every such file under the tree when it is not a git checkout). Exit status: 0 when none is over, 1 when some
# are, 2 on a usage error.
#
# Usage: scripts/check-file-sizes.sh [LIMIT]
set -eu

cd "$(dirname "$0")/.."
limit=${1:-1500}
case $limit in
'' | *[!0-9]*)
        echo "check-file-sizes: LIMIT must be a number of lines, not '$limit'" >&2
        exit 2
        ;;
esac

list_sources() {
        if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
                git ls-files -- '*.c' '*.h' '*.cu' '*.cuh' '*.py' '*.sh' '*.proto' '*meson.build'
        else
                find . -path './build*' -prune -o -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' \
                        -o -name '*.cuh' -o -name '*.py' -o -name '*.sh' -o -name '*.proto' \
                        -o -name meson.build \) -print | sed 's|^\./||'
        fi
}

over=$(list_sources | while IFS= read -r f; do
        [ -f "$f" ] || continue
        n=$(wc -l <"$f")
        [ "$n" -gt "$limit" ] && printf '%6d %s\n' "$n" "$f"
        true
done | sort -rn)

if [ -z "$over" ]; then
        echo "no source file over $limit lines"
        exit 0
fi
printf '%s\n' "$over"
echo "$(printf '%s\n' "$over" | wc -l) source file(s) over $limit lines" >&2
exit 1
