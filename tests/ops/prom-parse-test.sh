#!/bin/sh
# The strict Prometheus parser of the ops test refuses what it must refuse,
# so that its "ok" on moeepd's output means something.
# Usage: prom-parse-test.sh PROM-PARSE.PY
set -u
parse=$1
n=0
good() {
        printf "$1" | python3 "$parse" - >/dev/null 2>&1 || { echo "FAIL: refused: $1"; exit 1; }
        n=$((n + 1))
}
bad() {
        if printf "$1" | python3 "$parse" - >/dev/null 2>&1; then
                echo "FAIL: accepted: $1"
                exit 1
        fi
        n=$((n + 1))
}
good '# HELP a_total Things.\n# TYPE a_total counter\na_total 1\n'
good '# HELP g A gauge.\n# TYPE g gauge\ng{x="a\\\\b\\"c\\nd",y=""} -1.5e3\ng{x="2"} NaN\ng{x="3"} +Inf 1700000000\n'
bad '# HELP a_total Things.\n# TYPE a_total counter\na_total 1'
bad '# HELP a Things.\n# TYPE a counter\na 1\n'
bad '# HELP a_total x\n# TYPE a_total counter\na_total -1\n'
bad '# HELP g x\n# TYPE g gauge\ng 1\ng 2\n'
bad '# HELP g x\n# TYPE g gauge\ng{x="\\q"} 1\n'
bad '# HELP g x\n# TYPE g gauge\ng{x="1"} 1\n# HELP h x\n# TYPE h gauge\nh 1\ng{x="2"} 1\n'
bad '# HELP g x\n# TYPE g gauge\ng 1\n# TYPE g gauge\n'
bad '# HELP g x\n# TYPE g gauge\ng one\n'
bad '# HELP g x\n# TYPE g gauge\n9g 1\n'
bad '# HELP g x\n# TYPE g wobbly\ng 1\n'
bad 'g 1\n'
bad '# HELP g x\n# TYPE g gauge\ng{x="1",x="2"} 1\n'
bad '# HELP g x\n# TYPE g gauge\ng{x="1" 1\n'
good '# HELP g x\n# TYPE g gauge\ng 1\n'
printf '# HELP g x\n# TYPE g gauge\ng{s="a"} 2\n' | python3 "$parse" - 'g{s="a"}=2' >/dev/null || { echo "FAIL: expectation"; exit 1; }
if printf '# HELP g x\n# TYPE g gauge\ng 2\n' | python3 "$parse" - 'g=3' >/dev/null 2>&1; then
        echo "FAIL: wrong expected value accepted"
        exit 1
fi
echo "prom-parse: $n cases as expected"
