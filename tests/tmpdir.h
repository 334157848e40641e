/* Where test programs put their temporary files, directories and sockets:
 * under $TMPDIR when it names an absolute path, else under /tmp, as
 * mktemp(1) and Python's tempfile do. scripts/test.sh points TMPDIR at a
 * directory of its own and fails when a test leaves anything in it, so no
 * test names /tmp itself (the unit test `tmp-paths` checks the sources).
 * Test code. */
#ifndef MOEEP_TESTS_TMPDIR_H
#define MOEEP_TESTS_TMPDIR_H

#include <stdio.h>
#include <stdlib.h>

static inline const char *test_tmpdir(void) {
        const char *t = getenv("TMPDIR");

        return t && t[0] == '/' ? t : "/tmp";
}

/* Writes "$TMPDIR/NAME" into `buf` (`len` bytes), e.g. a mkdtemp()
 * template "moeep-load.XXXXXX". A path that does not fit ends the test:
 * a cut template would make files nobody removes. */
static inline char *test_tmp_path(char *buf, size_t len, const char *name) {
        int n = snprintf(buf, len, "%s/%s", test_tmpdir(), name);

        if (n < 0 || (size_t)n >= len) {
                fprintf(stderr, "test: $TMPDIR/%s does not fit in %zu bytes (TMPDIR=%s)\n", name, len,
                        test_tmpdir());
                exit(1);
        }
        return buf;
}

#endif
