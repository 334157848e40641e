#!/usr/bin/env bash
# Checks the generated systemd files the way systemd itself reads them.
#
#   verify-units.sh units SERVICE SOCKET ADMIN_SOCKET SBINDIR [MOEEPD]
#       `systemd-analyze verify` on the three units; the two sockets must
#       name their fds "client" and "admin" (moeepd tells them apart so),
#       and the admin socket must be 0600 outside /run/moeep. The service's ExecStart names
#       the installed path (SBINDIR/moeepd), which does not exist at test time,
#       so a copy points it at the built MOEEPD instead (or at a stub when the
#       daemon is not built). Any diagnostic systemd prints fails the test:
#       `verify` exits 0 on unknown keys and bad values, it only warns.
#       A deliberately broken copy must be rejected too, so this test cannot
#       pass by checking nothing.
#   verify-units.sh sysusers-tmpfiles SYSUSERS TMPFILES
#       Applies both to an empty root: the groups must be created and
#       /run/moeep must come out 0750 root:moeep. Skipped (77) when not run
#       as root, which the chown needs.
set -euo pipefail

die() { echo "verify-units: $*" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moeep-units.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# Runs `systemd-analyze verify` on the given units; succeeds only when it
# exits 0 and prints nothing.
analyze() {
        local out rc=0
        out=$(cd "$tmp" && timeout 60 systemd-analyze verify --man=no "$@" 2>&1) || rc=$?
        if [[ $rc -ne 0 || -n $out ]]; then
                printf '%s\n' "$out"
                return 1
        fi
}

mode=${1:-}
case $mode in
units)
        [[ $# -ge 5 ]] || die "usage: $0 units SERVICE SOCKET ADMIN_SOCKET SBINDIR [MOEEPD]"
        service=$2 socket=$3 admin_socket=$4 sbindir=$5 moeepd=${6:-}
        grep -qx 'FileDescriptorName=client' "$socket" || die "$socket: no FileDescriptorName=client"
        grep -qx 'FileDescriptorName=admin' "$admin_socket" || die "$admin_socket: no FileDescriptorName=admin"
        grep -qx 'SocketMode=0600' "$admin_socket" || die "$admin_socket: not SocketMode=0600"
        grep -q '^ListenSequentialPacket=/run/moeep/' "$admin_socket" &&
                die "$admin_socket: inside /run/moeep, which containers are given"
        command -v systemd-analyze >/dev/null || { echo "systemd-analyze not installed"; exit 77; }
        if [[ -z $moeepd ]]; then
                # The daemon is not part of this build yet: check everything
                # but the binary itself against a stand-in.
                echo "note: moeepd not built, ExecStart checked against a stub"
                moeepd=$tmp/stub-moeepd
                printf '#!/bin/sh\nexit 0\n' >"$moeepd"
                chmod +x "$moeepd"
        fi
        [[ -x $moeepd ]] || die "$moeepd is not an executable"
        moeepd=$(realpath "$moeepd")

        grep -q "^ExecStart=$sbindir/moeepd " "$service" ||
                die "$service: ExecStart does not start $sbindir/moeepd"
        sed "s|^ExecStart=$sbindir/moeepd |ExecStart=$moeepd |" "$service" >"$tmp/moeepd.service"
        cp "$socket" "$tmp/moeepd.socket"
        cp "$admin_socket" "$tmp/moeepd-admin.socket"
        analyze moeepd.service moeepd.socket moeepd-admin.socket || die "systemd-analyze verify rejected the units"
        echo "ok: moeepd.service, moeepd.socket and moeepd-admin.socket verify cleanly"

        # Self-test: a broken unit must be rejected, or this check is blind.
        mkdir "$tmp/broken"
        sed 's/^Type=notify$/Type=notify\nNoSuchKey=1/' "$tmp/moeepd.service" >"$tmp/broken/moeepd.service"
        cp "$tmp/moeepd.socket" "$tmp/moeepd-admin.socket" "$tmp/broken/"
        if analyze broken/moeepd.service broken/moeepd.socket >/dev/null; then
                die "a unit with an unknown key passed verification: the check is blind"
        fi
        sed "s|^ExecStart=$moeepd |ExecStart=$tmp/missing/moeepd |" "$tmp/moeepd.service" \
                >"$tmp/broken/moeepd.service"
        if analyze broken/moeepd.service broken/moeepd.socket >/dev/null; then
                die "a unit whose ExecStart does not exist passed verification: the check is blind"
        fi
        echo "ok: broken copies are rejected"
        ;;
sysusers-tmpfiles)
        [[ $# -eq 3 ]] || die "usage: $0 sysusers-tmpfiles SYSUSERS TMPFILES"
        sysusers=$(realpath "$2") tmpfiles=$(realpath "$3")
        for t in systemd-sysusers systemd-tmpfiles; do
                command -v $t >/dev/null || { echo "$t not installed"; exit 77; }
        done
        if [[ $(id -u) -ne 0 ]]; then
                echo "needs root: systemd-tmpfiles gives the directories to root and group moeep"
                exit 77
        fi
        root=$tmp/root
        mkdir -p "$root/etc"
        timeout 60 systemd-sysusers --root="$root" "$sysusers"
        grep -q '^moeep:' "$root/etc/group" || die "sysusers did not create group moeep"
        grep -q '^moeep-admin:' "$root/etc/group" || die "sysusers did not create group moeep-admin"
        timeout 60 systemd-tmpfiles --create --root="$root" "$tmpfiles"
        gid=$(awk -F: '$1 == "moeep" { print $3 }' "$root/etc/group")
        got=$(stat -c '%a %u %g' "$root/run/moeep")
        [[ $got == "750 0 $gid" ]] || die "/run/moeep is '$got', want '750 0 $gid'"
        got=$(stat -c '%a %u %g' "$root/run/moeep-admin")
        [[ $got == "700 0 0" ]] || die "/run/moeep-admin is '$got', want '700 0 0'"
        echo "ok: groups moeep, moeep-admin, /run/moeep 0750 root:moeep, /run/moeep-admin 0700 root:root"
        ;;
*)
        die "usage: $0 units|sysusers-tmpfiles ..."
        ;;
esac
