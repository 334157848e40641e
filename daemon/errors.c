/* Error kinds and protocol ErrorCodes; see errors.h. */
#include <errno.h>
#include <stddef.h>
#include <string.h>

#include "errors.h"

/* One row per kind, in the order of enum error_kind. */
static const struct error_row {
        Moeep__V1__ErrorCode code;
        const char *name;
} error_rows[] = {
#define MOEEP_ERROR_REFUSAL(CODE, ERRNO, TEXT) { MOEEP__V1__ERROR_CODE__ERROR_##CODE, TEXT },
#include "errors.def"
#undef MOEEP_ERROR_REFUSAL
};

_Static_assert(sizeof(error_rows) / sizeof(error_rows[0]) == ERROR_KIND_LAST - ERROR_KIND_FIRST + 1,
               "one row per error kind");

/* The errno values that unconverted modules still return for a refusal
 * (documented in their headers), read as the kind. Never EACCES or EPERM
 * (what mmap() and a sealed fd say), ESHUTDOWN or EDOM: those refusals are
 * returned only as kinds. */
static const struct error_alias {
        int errnum;
        enum error_kind kind;
} aliases[] = {
        { EINVAL, ERROR_KIND_INVALID_ARGUMENT }, { EALREADY, ERROR_KIND_INVALID_ARGUMENT },
        { ENOENT, ERROR_KIND_NO_SUCH_JOB },      { ERANGE, ERROR_KIND_RANK_OUT_OF_RANGE },
        { EEXIST, ERROR_KIND_RANK_TAKEN },       { EDQUOT, ERROR_KIND_LIMIT_EXCEEDED },
        { E2BIG, ERROR_KIND_LIMIT_EXCEEDED },    { ENOTCONN, ERROR_KIND_NOT_IN_JOB },
        { ECANCELED, ERROR_KIND_NOT_IN_JOB },    { EISCONN, ERROR_KIND_ALREADY_IN_JOB },
        { EBADF, ERROR_KIND_BAD_FDS },           { EPIPE, ERROR_KIND_PEER_LOST },
        { EAGAIN, ERROR_KIND_NOT_READY },
};

static const struct error_row *error_row_of(int r) {
        int e = -r;

        if (e >= ERROR_KIND_FIRST && e <= ERROR_KIND_LAST)
                return &error_rows[e - ERROR_KIND_FIRST];
        for (size_t i = 0; e > 0 && i < sizeof(aliases) / sizeof(aliases[0]); i++)
                if (aliases[i].errnum == e)
                        return &error_rows[aliases[i].kind - ERROR_KIND_FIRST];
        return NULL;
}

Moeep__V1__ErrorCode error_code(int r) {
        const struct error_row *row = error_row_of(r);

        return row ? row->code : MOEEP__V1__ERROR_CODE__ERROR_INTERNAL;
}

int error_from_code(Moeep__V1__ErrorCode code) {
        for (size_t i = 0; i < sizeof(error_rows) / sizeof(error_rows[0]); i++)
                if (error_rows[i].code == code)
                        return -(int)(ERROR_KIND_FIRST + i);
        return -EIO;
}

const char *error_to_string(int r) {
        if (-r >= ERROR_KIND_FIRST && -r <= ERROR_KIND_LAST)
                return error_rows[-r - ERROR_KIND_FIRST].name;
        return strerror(-r);
}
