#!/usr/bin/env bash
# Installs what building and testing moeep needs on Debian 12, and nothing
# when it is all there already (apt-get update runs only if something is
# missing). CUDA is optional: when /usr/local/cuda/bin/nvcc exists, callers
# that source this file get it on PATH; meson's -Dcuda=auto does the rest.
#
# Usage: scripts/install-deps.sh        (or: source scripts/install-deps.sh)
# Sourcing it changes no shell options of the caller.

moeep_packages=(
        meson ninja-build pkg-config gcc
        # nvcc's host compiler, where CUDA is installed: without g++ it
        # stops at "cannot execute 'cc1plus'" (a minimal Debian 12 has none).
        g++
        # meson takes Debian's multiarch libdir (lib/x86_64-linux-gnu) from
        # dpkg-architecture; without it `meson install` puts libmoeep.so into
        # lib64, where Debian's dynamic linker does not look.
        dpkg-dev
        libevent-dev libprotobuf-c-dev protobuf-c-compiler
        libsystemd-dev libfabric-dev libibverbs-dev libinih-dev libcmocka-dev
        # The mesh's peer authentication (HMAC-SHA256, random nonces).
        libsodium-dev
        systemd python3
        # The Python package is installed into a venv (Debian 12 refuses pip
        # outside one, PEP 668); its install test makes venvs with pip.
        python3-venv python3-pip
        # Python's headers: the package's low-latency calls in C
        # (client/python/fast/moeep_fast.c, a CPython extension).
        python3-dev
        # /bin/kill (the unit's ExecReload=, the tests' signals) and ps; a
        # minimal Debian 12 (debootstrap --variant=minbase) lacks them.
        procps
        # Reliability runs: libFuzzer targets (clang + its runtimes) and memcheck.
        clang-14 libclang-rt-14-dev valgrind
        # The format check (scripts/check-format.sh, test "format").
        clang-format-14
        # What `meson install` puts in place must be usable: the man pages
        # need man, moeepctl's completion bash-completion; a minimal Debian
        # 12 has neither.
        man-db bash-completion
        # The README's commands say `sudo ...` so that they work as a user
        # with sudo; a minimal root has no sudo, and root may use it.
        sudo
)

moeep_missing_packages() {
        local p status
        for p in "${moeep_packages[@]}"; do
                status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
                [[ $status == installed ]] || printf '%s\n' "$p"
        done
}

moeep_install_deps() {
        local missing sudo=()

        if ! command -v dpkg-query >/dev/null; then
                echo "install-deps: not a Debian system; install by hand: ${moeep_packages[*]}" >&2
                return 1
        fi
        mapfile -t missing < <(moeep_missing_packages)
        if [[ ${#missing[@]} -gt 0 ]]; then
                [[ $(id -u) -eq 0 ]] || sudo=(sudo)
                echo "install-deps: installing ${missing[*]}"
                "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq || return 1
                "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
                        apt-get install -y -qq --no-install-recommends "${missing[@]}" || return 1
        fi
        if [[ -x /usr/local/cuda/bin/nvcc && :$PATH: != *:/usr/local/cuda/bin:* ]]; then
                export PATH=/usr/local/cuda/bin:$PATH
        fi
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
        set -euo pipefail
        moeep_install_deps
else
        moeep_install_deps || return
fi
