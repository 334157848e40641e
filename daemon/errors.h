/* Error kinds: refusals that mean something to the client, one per
 * MOEEP_ERROR_REFUSAL row of proto/errors.def, where each is declared once
 * with its protocol ErrorCode; both ways follow from that table.
 *
 * The daemon's functions return 0 or -errno. A refusal that the client must
 * be told as a particular ErrorCode is returned as -ERROR_KIND_*, a value
 * above every errno, so that an errno a system call produced can never pass
 * for one: EACCES from mmap() of a read-only fd is not "bad secret", EPERM
 * from a sealed fd is not "permission denied", ESHUTDOWN or EDOM from
 * anywhere is not "draining" or "world size mismatch". Those refusals exist
 * only as kinds: job.c, broker.c, datapath.c, membership.c, requests.c and
 * the rest return -ERROR_KIND_* for every refusal they decide (datapath.c
 * also for the transports' and the proxy's -EINVAL, which speak errno).
 * One errno value is still read as a kind (errors.c's `aliases`): EDQUOT,
 * the fd caps, a quota by its nature, which several paths meet
 * (LIMIT_EXCEEDED). Any other errno is ERROR_INTERNAL, and the message
 * that comes with it says what it was. */
#ifndef MOEEPD_ERRORS_H
#define MOEEPD_ERRORS_H

enum error_kind {
        ERROR_KIND_BEFORE_FIRST = (1 << 16) - 1, /* kinds are above every errno value */
#define MOEEP_ERROR_REFUSAL(CODE, ERRNO, TEXT) ERROR_KIND_##CODE,
#include "errors.def"
#undef MOEEP_ERROR_REFUSAL
        ERROR_KIND_AFTER_LAST,
};

#define ERROR_KIND_FIRST (ERROR_KIND_BEFORE_FIRST + 1)
#define ERROR_KIND_LAST (ERROR_KIND_AFTER_LAST - 1)

/* The protocol's ErrorCode (its value: moeep.proto's enum) for a return
 * value `r` (< 0): its kind's, or its errno alias's, else ERROR_INTERNAL. */
int error_code(int r);

/* The other way: the return value (-ERROR_KIND_*) for an ErrorCode a peer
 * daemon sent, or -EIO for codes that are no kind (framing, internal). */
int error_from_code(int code);

/* Text for a return value: the kind's name, or strerror() for an errno. */
const char *error_to_string(int r);

#endif
