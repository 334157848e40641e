#!/usr/bin/env bash
# Copies what a GPU machine runs out of a build folder (the daemon, the
# library, moeepctl, moeep-bench, the GPU and proxy test programs) into DEST,
# under the same relative paths, so that several builds fit in one device
# call's carry (a whole build folder is ~45 MB). The GPU machine needs no
# compiler: build here, bundle, carry DEST and .libs (scripts/gpu-carry.sh).
# Usage: scripts/gpu-bundle.sh BUILD_DIR DEST
set -euo pipefail
b=${1:?build dir} dest=${2:?destination}
rm -rf "$dest" && mkdir -p "$dest"
for f in daemon/moeepd client/moeepctl client/libmoeep.so client/libmoeep.so.0 client/libmoeep.so.0.1.0 \
         client/moeep_fast.abi3.so \
         client/bench/moeep-bench tests/gpu/ep_normal_test tests/gpu/ep_ll_test tests/gpu/ep_fail_test \
         tests/gpu/ep_shrink_test tests/proxy/moeep-cuda-gpu-test tests/e2e/moeep-e2e-rank; do
        [[ -e $b/$f || -L $b/$f ]] || continue
        mkdir -p "$dest/$(dirname "$f")"
        cp -a "$b/$f" "$dest/$f"
done
find "$dest" -type f ! -name COMMIT -exec strip --strip-debug {} + 2>/dev/null || true
git -C "$(dirname "$0")/.." rev-parse --short HEAD > "$dest/COMMIT" 2>/dev/null || true
du -sh "$dest"
