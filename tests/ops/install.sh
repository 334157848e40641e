#!/usr/bin/env bash
# `meson install` into a staging directory (DESTDIR) puts every file an
# operator needs where it belongs, and the installed pieces work.
#
#   install.sh BUILD_ROOT CUDA(true|false) PATH...
#
# PATH... are the absolute installed paths (as meson computed them) that
# must exist under DESTDIR.
set -uo pipefail

if [[ $# -lt 3 ]]; then
        echo "usage: $0 BUILD_ROOT CUDA PATH..." >&2
        exit 2
fi
build=$1 cuda=$2
shift 2
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moeep-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
dest=$tmp/root

fail() {
        echo "FAIL: $*"
        exit 1
}

meson install -C "$build" --destdir "$dest" --no-rebuild --quiet >"$tmp/install.log" 2>&1 ||
        fail "meson install: $(tail -n 20 "$tmp/install.log")"

missing=0
for p in "$@"; do
        if [[ ! -e $dest$p ]]; then
                echo "missing: $p"
                missing=$((missing + 1))
        fi
done
((missing == 0)) || fail "$missing expected files were not installed (installed: $(cd "$dest" && find . -type f | sort | tr '\n' ' '))"

# Header of the data plane only with CUDA.
ep=$(find "$dest" -name moeep_ep.h | head -n 1)
if [[ $cuda == true ]]; then
        [[ -n $ep ]] || fail "built with CUDA but moeep_ep.h is not installed"
else
        [[ -z $ep ]] || fail "built without CUDA but ${ep#"$dest"} is installed"
fi

# The installed pieces work.
for p in "$@"; do
        case $p in
        */completions/moeepctl) completion=$dest$p ;;
        */moeepd) moeepd=$dest$p ;;
        */moeepctl) moeepctl=$dest$p ;;
        */moeepd.conf.example) example=$dest$p ;;
        */moeep.pc) pc=$dest$p ;;
        esac
done
"$moeepd" --config "$example" --check-config >/dev/null || fail "the installed example configuration is not valid"
"$moeepctl" --version | grep -q '^moeepctl ' || fail "the installed moeepctl does not run"
grep -q '^Name: moeep$' "$pc" || fail "moeep.pc has no 'Name: moeep'"
grep -q -- '-lmoeep' "$pc" || fail "moeep.pc does not link -lmoeep"
bash -c "source '$completion' && complete -p moeepctl" >/dev/null || fail "the bash completion does not load"
for m in $(find "$dest" -name '*.[58]*' -path '*/man/*'); do
        head -n 1 "$m" | grep -q '^\.TH ' || fail "${m#"$dest"} is not a man page"
done
echo "ok: meson install put $# files in place; moeepd, moeepctl, the example config, moeep.pc and the completion work"
