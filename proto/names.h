/* Names both sides of the protocol check, declared once: the library
 * (client/lib/client-job.c) refuses before sending what the daemon
 * (daemon/job.c) would refuse on receipt. */
#ifndef MOEEP_PROTO_NAMES_H
#define MOEEP_PROTO_NAMES_H

#include <stdbool.h>
#include <string.h>

/* A job name: 1 to 64 bytes of printable ASCII (0x20..0x7e). */
#define MOEEP_JOB_NAME_MAX 64
/* A GPU UUID as a rank names its GPU: at most 64 bytes, empty allowed. */
#define MOEEP_GPU_UUID_MAX 64

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
