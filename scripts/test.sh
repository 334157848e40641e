#!/usr/bin/env bash
# THE test command: installs what is missing, then builds and runs every test
# suite twice: as shipped (build-test, CUDA if nvcc is there; GPU tests skip
# without a GPU; the valgrind suite runs here) and under ASan+UBSan
# (build-asan, no CUDA). Then a bounded libFuzzer run (build-fuzz, clang,
# suite fuzz, about 90 s in all). Every build is made with -Dwerror=true: a
# compiler warning fails it. The tests run with TMPDIR set to a directory of
# this run's, which must be empty at the end (no test names /tmp itself: the
# unit test tmp-paths). Ends with exactly one line "N passed, N failed,
# N skipped" summing every run (the leftover check counts as one test), and
# exits non-zero when a build or a test failed.
#
# Usage: scripts/test.sh [extra `meson test` arguments, e.g. --suite e2e]
# With extra arguments the fuzz run happens only when they mention "fuzz".
set -uo pipefail

cd "$(dirname "$0")/.."
source scripts/install-deps.sh || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }

passed=0 failed=0 skipped=0

# The tests' temporary files go here (tests/tmpdir.h, tests/tmpdir.sh,
# mktemp, Python's tempfile); sticky and world-writable like /tmp, since
# some tests run clients as other uids.
tmp_before=$(mktemp "${TMPDIR:-/tmp}/moeep-test-before.XXXXXX")
ls -A /tmp | grep '^moeep' | sort >"$tmp_before"
test_tmpdir=$(mktemp -d /tmp/moeep-test.XXXXXX) || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
chmod 1777 "$test_tmpdir"
trap 'rm -rf "$test_tmpdir" "$tmp_before"' EXIT

# Nothing a test made may be left in its TMPDIR: fails (one test's worth)
# naming what is. New moeep* entries in /tmp itself are listed too, but do
# not fail the run: on a machine shared with other runs they may be theirs.
check_leftovers() {
        local left new
        left=$(cd "$test_tmpdir" && find . -mindepth 1 -maxdepth 2 | sed 's|^\./||' | sort | head -n 20)
        new=$(ls -A /tmp | grep '^moeep' | sort | comm -13 "$tmp_before" - |
                grep -vx -e "${test_tmpdir#/tmp/}" -e "${tmp_before#/tmp/}" | head -n 20)
        rm -rf "$test_tmpdir" "$tmp_before"
        if [[ -n $new ]]; then
                echo "=== leftovers: note: new in /tmp since the start (this run's, or another's on this machine):"
                printf '  %s\n' $new
        fi
        if [[ -n $left ]]; then
                echo "=== leftovers: FAILED: tests left files in their \$TMPDIR:"
                printf '  %s\n' $left
                failed=$((failed + 1))
        else
                echo "=== leftovers: none in the tests' \$TMPDIR"
                passed=$((passed + 1))
        fi
}

# Configures $1 with the remaining options, reusing an existing build dir.
configure() {
        local dir=$1
        shift
        if [[ -f $dir/build.ninja ]]; then
                meson setup --reconfigure "$dir" "$@" || meson setup --wipe "$dir" "$@"
        else
                rm -rf "$dir"
                meson setup "$dir" "$@"
        fi
}

# Adds the results in $1/meson-logs/testlog.json to the counters.
count_results() {
        local counts
        counts=$(python3 - "$1/meson-logs/testlog.json" <<'PY'
import json, sys
ok = bad = skip = 0
try:
    # Bytes, split on \n only: test output inside the records may hold \r
    # and other characters that text mode or splitlines() would split on.
    lines = open(sys.argv[1], "rb").read().split(b"\n")
except OSError:
    lines = []
for line in lines:
    if not line.strip():
        continue
    try:
        result = json.loads(line.decode("utf-8", "replace"), strict=False).get("result")
    except ValueError:
        # Two `meson test` runs writing the same log; count it as a failure.
        print("test.sh: unreadable record in " + sys.argv[1], file=sys.stderr)
        result = "ERROR"
    if result in ("OK", "EXPECTEDFAIL"):
        ok += 1
    elif result == "SKIP":
        skip += 1
    else:  # FAIL, TIMEOUT, ERROR, UNEXPECTEDPASS, and anything new
        bad += 1
print(ok, bad, skip)
PY
        ) || counts="0 1 0"
        read -r p f s <<<"$counts"
        passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
}

# Builds $1 with options $3.. and runs its tests; $2 names the run.
run_suite() {
        local dir=$1 name=$2
        shift 2
        echo "=== $name: configure $dir"
        if ! configure "$dir" "$@"; then
                echo "=== $name: configure FAILED"
                failed=$((failed + 1))
                return
        fi
        echo "=== $name: compile"
        if ! meson compile -C "$dir"; then
                echo "=== $name: build FAILED"
                failed=$((failed + 1))
                return
        fi
        echo "=== $name: test"
        rm -f "$dir/meson-logs/testlog.json"
        TMPDIR=$test_tmpdir meson test -C "$dir" --print-errorlogs "${test_args[@]}" ||
                echo "=== $name: some tests FAILED"
        count_results "$dir"
}

# The fuzz targets alone, from a clang build whose every object carries
# libFuzzer's coverage instrumentation (tests/fuzz/meson.build).
run_fuzz() {
        local dir=build-fuzz
        echo "=== libFuzzer build: configure $dir"
        if ! CC=clang-14 configure "$dir" -Dfuzz=true -Dcuda=disabled -Dtests=true -Dwerror=true \
                -Db_sanitize=address,undefined -Db_lundef=false -Dc_args=-fsanitize=fuzzer-no-link; then
                echo "=== libFuzzer build: configure FAILED"
                failed=$((failed + 1))
                return
        fi
        echo "=== libFuzzer build: compile"
        if ! meson compile -C "$dir" tests/fuzz/fuzz-record tests/fuzz/fuzz-session tests/fuzz/fuzz-config \
                tests/fuzz/fuzz-mesh tests/fuzz/fuzz-tpcuda; then
                echo "=== libFuzzer build: build FAILED"
                failed=$((failed + 1))
                return
        fi
        echo "=== libFuzzer build: fuzz"
        rm -f "$dir/meson-logs/testlog.json"
        TMPDIR=$test_tmpdir meson test -C "$dir" --no-rebuild --print-errorlogs --suite fuzz ||
                echo "=== libFuzzer build: some targets FAILED"
        count_results "$dir"
}

test_args=("$@")
run_suite build-test "default build" -Dcuda=auto -Dtests=true -Dwerror=true
# Sanitizer runs are slower; give every test three times its timeout.
test_args=(--timeout-multiplier 3 "$@")
run_suite build-asan "ASan+UBSan build" -Dcuda=disabled -Dtests=true -Dwerror=true \
        -Db_sanitize=address,undefined -Dbuildtype=debug
if [[ $# -eq 0 || " $* " == *fuzz* ]]; then
        run_fuzz
fi

check_leftovers
echo "$passed passed, $failed failed, $skipped skipped"
[[ $failed -eq 0 ]]
