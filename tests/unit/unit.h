/* Helpers shared by the unit tests. */
#ifndef MOEEP_UNIT_H
#define MOEEP_UNIT_H

#include <stddef.h>

/* Number of open descriptors of this process (entries of /proc/self/fd,
 * the directory's own descriptor not counted). */
int unit_count_fds(void);

/* A memfd of `size` bytes whose first bytes are `text`. */
int unit_memfd(size_t size, const char *text);

#endif
