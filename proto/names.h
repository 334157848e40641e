/* Names both sides of the protocol check, declared once: the library
 * (client/lib/client-job.c) refuses before sending what the daemon
 * (daemon/state/job.c) would refuse on receipt. */
#ifndef MOEEP_PROTO_NAMES_H
#define MOEEP_PROTO_NAMES_H

#include <stdbool.h>
#include <string.h>

/* A job name: 1 to 64 bytes of printable ASCII (0x20..0x7e). */
#define MOEEP_JOB_NAME_MAX 64
/* A GPU UUID as a rank names its GPU: at most 64 bytes, empty allowed. */
#define MOEEP_GPU_UUID_MAX 64

/* Whether the `n` bytes at `s` are a word: printable ASCII without spaces
 * (0x21..0x7e). GPU UUIDs and the mesh addresses in a unique id are words. */
static inline bool moeep_word_valid(const char *s, size_t n) {
        for (size_t i = 0; i < n; i++)
                if ((unsigned char)s[i] < 0x21 || (unsigned char)s[i] > 0x7e)
                        return false;
        return true;
}

/* A GPU UUID as the daemon accepts it: up to MOEEP_GPU_UUID_MAX bytes of a
 * word, empty allowed (the library checks only the length). */
static inline bool moeep_gpu_uuid_valid(const char *uuid) {
        size_t n = strlen(uuid);

        return n <= MOEEP_GPU_UUID_MAX && moeep_word_valid(uuid, n);
}

/* Whether `name` is a job name (spaces allowed, see above). */
static inline bool moeep_job_name_valid(const char *name) {
        size_t n = strlen(name);

        if (n < 1 || n > MOEEP_JOB_NAME_MAX)
                return false;
        for (size_t i = 0; i < n; i++)
                if ((unsigned char)name[i] < 0x20 || (unsigned char)name[i] > 0x7e)
                        return false;
        return true;
}

#endif
