/* Error kinds and protocol ErrorCodes; see errors.h. */
#include <errno.h>
#include <stddef.h>
#include <string.h>

#include "errors.h"
#include "moeep.pb-c.h"

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

/* The one errno value read as a kind: EDQUOT, the fd accounting's caps
 * (clientfd.c, session.c's send path), a quota by its nature, met by any
 * request whose reply carries a descriptor (JobJoined, Regions,
 * ChannelOpened) and by a RegionRegister that takes one. Every other
 * refusal is returned as its kind by the module that decides it; an errno
 * a system call produced is ERROR_INTERNAL (EINVAL from ftruncate() is no
 * client's invalid argument, EACCES from mmap() no bad secret). */
static const struct error_alias {
        int errnum;
        enum error_kind kind;
} aliases[] = {
        { EDQUOT, ERROR_KIND_LIMIT_EXCEEDED },
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

int error_code(int r) {
        const struct error_row *row = error_row_of(r);

        return row ? row->code : MOEEP__V1__ERROR_CODE__ERROR_INTERNAL;
}

int error_from_code(int code) {
        for (size_t i = 0; i < sizeof(error_rows) / sizeof(error_rows[0]); i++)
                if ((int)error_rows[i].code == code)
                        return -(int)(ERROR_KIND_FIRST + i);
        return -EIO;
}

const char *error_to_string(int r) {
        if (-r >= ERROR_KIND_FIRST && -r <= ERROR_KIND_LAST)
                return error_rows[-r - ERROR_KIND_FIRST].name;
        return strerror(-r);
}
