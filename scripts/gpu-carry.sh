#!/usr/bin/env bash
# Prepares .libs/ for a run on the lent GPU machine (Ubuntu 24.04), which
# lacks some of moeepd's runtime libraries: copies each library that a
# built program names directly (NEEDED) and that is not in the list the GPU
# image is known to have.
# Usage: scripts/gpu-carry.sh [BUILD_DIR]   (then carry BUILD_DIR and .libs)
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
mkdir -p .libs
# Present on the GPU machine (DESIGN/issue notes): libevent, libsystemd,
# libibverbs, librdmacm, libfabric, libnccl, glibc, libstdc++.
have='libevent|libsystemd|libibverbs|librdmacm|libfabric|libnccl|libc\.|libm\.|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux|linux-vdso|libcap|libgcrypt|liblzma|libzstd|liblz4|libgpg-error|libnl'
for prog in "$build"/daemon/moeepd "$build"/client/libmoeep.so "$build"/client/bench/moeep-bench; do
        [[ -e $prog ]] || continue
        for name in $(objdump -p "$prog" | awk '$1 == "NEEDED" {print $2}'); do
                [[ $name =~ ^($have) ]] && continue
                path=$(ldd "$prog" | awk -v n="$name" '$1 == n {print $3}')
                [[ -n $path ]] && cp -L "$path" .libs/
        done
done
ls .libs
