# Shell helpers of the tests that drive moeepctl (ops.sh, security/ops-lib.sh),
# sourced after the test defines fail() and sets $moeepctl, $sock and $tmp.
# shellcheck shell=bash

# ctl NAME ARGS...: moeepctl --socket $sock (it tries the admin socket next
# to it first); stdout in $tmp/NAME.out, must exit 0.
ctl() {
        local name=$1 rc
        shift
        timeout 20 "$moeepctl" --socket "$sock" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"
        rc=$?
        [[ $rc -eq 0 ]] || fail "moeepctl $* exited $rc: $(cat "$tmp/$name.err")"
}

# json FILE PYTHON-EXPR: the expression, with `d` the parsed document, must
# hold.
json() {
        python3 - "$1" "$2" <<'PY' || fail "JSON check '$2' on $(basename "$1"): $(head -c 400 "$1")"
import json, sys
d = json.load(open(sys.argv[1]))
if not eval(sys.argv[2]):
    sys.exit(1)
PY
}
