#!/usr/bin/env bash
# Whether two trees build the same GPU code: builds the kernels of each
# (only the nvcc objects, meson -Dcuda=enabled -Dtests=false), dumps the SASS
# of every kernel with cuobjdump, one file per kernel named after its mangled
# name, and compares them kernel by kernel. For changes that must leave the
# device code alone (moving kernels between files, host-side refactors).
#
# A kernel's SASS is compared as cuobjdump prints it, instruction encodings
# and offsets included, from its "Function :" line to the next, with runs of
# blanks made one (cuobjdump pads its columns to the widest instruction of
# the object); what is outside the functions (the object's path, its fatbin
# header) is left out, and so are the kernels' object files: a kernel may
# move to another file. The device
# functions a kernel calls are in its own text, so they are compared with
# it. Also compared: each kernel's resource usage (registers, stack, shared
# and local memory, cuobjdump -res-usage).
#
# Usage: scripts/sass-diff.sh [-k] A B
#   A, B   a git revision of this repository (exported with git archive) or
#          a directory holding a source tree (built as it is)
#   -k     keep the work directory (printed) for a look at the dumps
# Needs nvcc (PATH, or /usr/local/cuda/bin) and cuobjdump with nvdisasm
# (PATH, $CUDA_HOME/bin, or the PyPI packages nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm installed with pip --target into $SASS_TOOLS).
# Exit status: 0 when every kernel is the same, 1 when one differs or
# exists in one tree only, 2 on a usage or build error.
set -euo pipefail

keep=0
if [ "${1:-}" = -k ]; then
        keep=1
        shift
fi
if [ $# -ne 2 ]; then
        sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
        exit 2
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
cuda=${CUDA_HOME:-/usr/local/cuda}
PATH=$PATH:$cuda/bin
if [ -n "${SASS_TOOLS:-}" ]; then
        for d in "$SASS_TOOLS"/*/nvidia/cu*/bin; do
                PATH=$d:$PATH
        done
fi
export PATH
for tool in nvcc cuobjdump nvdisasm meson ninja; do
        command -v "$tool" >/dev/null || {
                echo "sass-diff: $tool not found (see the usage)" >&2
                exit 2
        }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/sass-diff.XXXXXX")
if [ $keep = 1 ]; then
        echo "sass-diff: work directory $work"
else
        trap 'rm -rf "$work"' EXIT
fi

# The source tree of $1 in $2/src (a directory is used in place).
source_of() {
        if [ -d "$1" ]; then
                (cd "$1" && pwd)
                return
        fi
        mkdir "$2/src"
        git -C "$repo" archive "$1" | tar -x -C "$2/src"
        echo "$2/src"
}

# Builds the nvcc objects of tree $1 into $2/build and writes one SASS file
# and one resource-usage line per kernel into $2/sass.
dump_tree() {
        local src build objs obj
        mkdir -p "$2"
        src=$(source_of "$1" "$2")
        build=$2/build
        meson setup "$build" "$src" -Dcuda=enabled -Dtests=false >"$2/setup.log" 2>&1 || {
                echo "sass-diff: meson setup of $1 failed (log: $2/setup.log)" >&2
                return 1
        }
        objs=$(ninja -C "$build" -t targets all | sed -n 's/^\([^:]*\.cu\.o\): .*/\1/p')
        [ -n "$objs" ] || {
                echo "sass-diff: $1 builds no CUDA object" >&2
                return 1
        }
        # shellcheck disable=SC2086
        ninja -C "$build" $objs >"$2/build.log" 2>&1 || {
                echo "sass-diff: building the kernels of $1 failed (log: $2/build.log)" >&2
                return 1
        }
        mkdir -p "$2/sass"
        for obj in $objs; do
                cuobjdump -sass "$build/$obj" | awk -v dir="$2/sass" '
                        /^[ \t]*Function : / { f = dir "/" $3 ".sass"; if (seen[f]++) dup = dup " " $3; next }
                        /^[ \t]*(code for|Fatbin|arch =|code version|host =|compile_size|identifier|\.target|=+$)/ { f = ""; next }
                        f != "" && NF { gsub(/[ \t]+/, " "); print > f }
                        END { if (dup != "") { print "sass-diff: kernel twice:" dup > "/dev/stderr"; exit 1 } }'
                cuobjdump -res-usage "$build/$obj" |
                        awk '/^ *Function [^ ]*:$/ { name = $2; sub(/:$/, "", name); next }
                             name != "" && /REG:/ { print name ": " $0; name = "" }' >>"$2/res-usage"
        done
        sort -o "$2/res-usage" "$2/res-usage"
}

dump_tree "$1" "$work/a" || exit 2
dump_tree "$2" "$work/b" || exit 2

rc=0
same=0
for f in "$work/a/sass"/*.sass "$work/b/sass"/*.sass; do
        k=$(basename "$f" .sass)
        [ -e "$work/checked/$k" ] && continue
        mkdir -p "$work/checked" && : >"$work/checked/$k"
        if [ ! -e "$work/a/sass/$k.sass" ]; then
                echo "only in $2: $k"
                rc=1
        elif [ ! -e "$work/b/sass/$k.sass" ]; then
                echo "only in $1: $k"
                rc=1
        elif cmp -s "$work/a/sass/$k.sass" "$work/b/sass/$k.sass"; then
                same=$((same + 1))
        else
                echo "differs: $k ($(diff "$work/a/sass/$k.sass" "$work/b/sass/$k.sass" | grep -c '^[<>]') lines)"
                rc=1
        fi
done
if ! diff -u "$work/a/res-usage" "$work/b/res-usage" >"$work/res-usage.diff"; then
        echo "resource usage differs:"
        cat "$work/res-usage.diff"
        rc=1
fi
echo "sass-diff: $same kernel(s) the same, $(ls "$work/checked" | wc -l) in all"
exit $rc
