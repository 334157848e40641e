/* fail() of the rank programs of tests/mesh (mesh-rank.c, proxy-rank.c):
 * one line on stderr naming the program, the rank and the check that did
 * not hold, and 1, the programs' exit status for a mismatch. A program
 * defines RANK_PROGRAM ("mesh-rank") before it includes this, and sets
 * my_rank once it knows its rank (-1 until then). */
#ifndef MOEEP_TESTS_MESH_RANK_FAIL_H
#define MOEEP_TESTS_MESH_RANK_FAIL_H

#include <stdarg.h>
#include <stdio.h>

static int my_rank = -1;

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...) {
        va_list ap;

        fprintf(stderr, "%s %d: ", RANK_PROGRAM, my_rank);
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
        return 1;
}

#endif
