# Bounded waits of the shell tests (e2e.sh, ops.sh, mesh/lib.sh), sourced
# after the test defines fail().
# shellcheck shell=bash

# wait_until SECONDS DESCRIPTION COMMAND...: polls COMMAND every 50 ms.
wait_until() {
        local limit=$1 what=$2 i
        shift 2
        for ((i = 0; i < limit * 20; i++)); do
                "$@" && return 0
                sleep 0.05
        done
        fail "timed out after ${limit}s waiting for $what"
}
