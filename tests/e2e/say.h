/* say(): one line of a test's progress on stdout, flushed at once so that
 * it comes before the output of a child forked or started after it. Shared
 * by badinput.c and isolation.c; test code. */
#ifndef MOEEP_E2E_SAY_H
#define MOEEP_E2E_SAY_H

#include <stdarg.h>
#include <stdio.h>

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        vprintf(fmt, ap);
        va_end(ap);
        putchar('\n');
        fflush(stdout);
}

#endif
