/* Error kinds: refusals that mean something to the client, and the
 * protocol ErrorCode of each, declared once, both ways.
 *
 * The daemon's functions return 0 or -errno. A refusal that the client must
 * be told as a particular ErrorCode is returned as -ERROR_KIND_*, a value
 * above every errno, so that an errno a system call produced can never pass
 * for one: EACCES from mmap() of a read-only fd is not "bad secret", EPERM
 * from a sealed fd is not "permission denied". The two kinds whose errno
 * spellings clash with what system calls say (ERROR_KIND_BAD_SECRET,
 * ERROR_KIND_PERMISSION_DENIED) exist only as kinds. For the others, the
 * errno value that job.c, broker.c, datapath.c and mesh.c return for that
 * refusal (documented in their headers) is still read as the kind (the
 * table's `alias`), until those modules return kinds too; any other errno
 * is ERROR_INTERNAL, and the message that comes with it says what it was. */
#ifndef MOEEPD_ERRORS_H
#define MOEEPD_ERRORS_H

#include "moeep.pb-c.h"

enum error_kind {
        ERROR_KIND_FIRST = 1 << 16, /* above every errno value */
        ERROR_KIND_INVALID_ARGUMENT = ERROR_KIND_FIRST,
        ERROR_KIND_NO_SUCH_JOB,
        ERROR_KIND_BAD_SECRET,
        ERROR_KIND_RANK_OUT_OF_RANGE,
        ERROR_KIND_RANK_TAKEN,
        ERROR_KIND_WORLD_SIZE_MISMATCH,
        ERROR_KIND_LIMIT_EXCEEDED,
        ERROR_KIND_PERMISSION_DENIED,
        ERROR_KIND_NOT_IN_JOB,
        ERROR_KIND_ALREADY_IN_JOB,
        ERROR_KIND_BAD_FDS,
        ERROR_KIND_PEER_LOST,
        ERROR_KIND_DRAINING,
        ERROR_KIND_NOT_READY,
        ERROR_KIND_LAST = ERROR_KIND_NOT_READY,
};

/* The ErrorCode for a return value `r` (< 0): its kind's, or its errno
 * alias's, else ERROR_INTERNAL. */
Moeep__V1__ErrorCode error_code(int r);

/* The other way: the return value (-ERROR_KIND_*) for an ErrorCode a peer
 * daemon sent, or -EIO for codes that are no kind (framing, internal). */
int error_from_code(Moeep__V1__ErrorCode code);

/* Text for a return value: the kind's name, or strerror() for an errno. */
const char *error_to_string(int r);

#endif
