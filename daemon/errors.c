/* Error kinds and protocol ErrorCodes; see errors.h. */
#include <errno.h>
#include <stddef.h>
#include <string.h>

#include "errors.h"

/* One row per kind, in the order of enum error_kind. */
static const struct error_row {
        enum error_kind kind;
        Moeep__V1__ErrorCode code;
        int alias;  /* the errno that unconverted modules still return for it, 0 for none */
        int alias2; /* a second one, 0 for none */
        const char *name;
} error_rows[] = {
        { ERROR_KIND_INVALID_ARGUMENT, MOEEP__V1__ERROR_CODE__ERROR_INVALID_ARGUMENT, EINVAL, EALREADY,
          "invalid argument" },
        { ERROR_KIND_NO_SUCH_JOB, MOEEP__V1__ERROR_CODE__ERROR_NO_SUCH_JOB, ENOENT, 0, "no such job" },
        /* EACCES is what mmap() and open() say: never read as this. */
        { ERROR_KIND_BAD_SECRET, MOEEP__V1__ERROR_CODE__ERROR_BAD_SECRET, 0, 0, "bad secret" },
        { ERROR_KIND_RANK_OUT_OF_RANGE, MOEEP__V1__ERROR_CODE__ERROR_RANK_OUT_OF_RANGE, ERANGE, 0,
          "rank out of range" },
        { ERROR_KIND_RANK_TAKEN, MOEEP__V1__ERROR_CODE__ERROR_RANK_TAKEN, EEXIST, 0, "rank taken" },
        { ERROR_KIND_WORLD_SIZE_MISMATCH, MOEEP__V1__ERROR_CODE__ERROR_WORLD_SIZE_MISMATCH, EDOM, 0,
          "world size mismatch" },
        { ERROR_KIND_LIMIT_EXCEEDED, MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED, EDQUOT, E2BIG,
          "limit exceeded" },
        /* EPERM is what a sealed or read-only fd gives: never read as this. */
        { ERROR_KIND_PERMISSION_DENIED, MOEEP__V1__ERROR_CODE__ERROR_PERMISSION_DENIED, 0, 0,
          "permission denied" },
        { ERROR_KIND_NOT_IN_JOB, MOEEP__V1__ERROR_CODE__ERROR_NOT_IN_JOB, ENOTCONN, ECANCELED,
          "not in a job" },
        { ERROR_KIND_ALREADY_IN_JOB, MOEEP__V1__ERROR_CODE__ERROR_ALREADY_IN_JOB, EISCONN, 0,
          "already in a job" },
        { ERROR_KIND_BAD_FDS, MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, EBADF, 0, "bad file descriptors" },
        { ERROR_KIND_PEER_LOST, MOEEP__V1__ERROR_CODE__ERROR_PEER_LOST, EPIPE, 0, "peer lost" },
        { ERROR_KIND_DRAINING, MOEEP__V1__ERROR_CODE__ERROR_DRAINING, ESHUTDOWN, 0, "draining" },
        { ERROR_KIND_NOT_READY, MOEEP__V1__ERROR_CODE__ERROR_NOT_READY, EAGAIN, 0, "not ready" },
};

_Static_assert(sizeof(error_rows) / sizeof(error_rows[0]) == ERROR_KIND_LAST - ERROR_KIND_FIRST + 1,
               "one row per error kind");

static const struct error_row *error_row_of(int r) {
        int e = -r;

        if (e >= ERROR_KIND_FIRST && e <= ERROR_KIND_LAST)
                return &error_rows[e - ERROR_KIND_FIRST];
        for (size_t i = 0; e > 0 && i < sizeof(error_rows) / sizeof(error_rows[0]); i++)
                if (error_rows[i].alias == e || error_rows[i].alias2 == e)
                        return &error_rows[i];
        return NULL;
}

Moeep__V1__ErrorCode error_code(int r) {
        const struct error_row *row = error_row_of(r);

        return row ? row->code : MOEEP__V1__ERROR_CODE__ERROR_INTERNAL;
}

int error_from_code(Moeep__V1__ErrorCode code) {
        for (size_t i = 0; i < sizeof(error_rows) / sizeof(error_rows[0]); i++)
                if (error_rows[i].code == code)
                        return -(int)error_rows[i].kind;
        return -EIO;
}

const char *error_to_string(int r) {
        if (-r >= ERROR_KIND_FIRST && -r <= ERROR_KIND_LAST)
                return error_rows[-r - ERROR_KIND_FIRST].name;
        return strerror(-r);
}
