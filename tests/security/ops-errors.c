/* moeep-ops-errors: errno values never pass for protocol refusals (issue
 * 15, item 9), against a real moeepd with its internode data path (libfabric
 * tcp on 127.0.0.1, ops-errors.sh):
 *
 * 1. A proxy region whose memfd the client opened read-only: the daemon's
 *    mmap() fails with EACCES, which used to reach the client as
 *    ERROR_BAD_SECRET. Now it is ERROR_BAD_FDS (-EBADF here) and the text
 *    says the fd cannot be mapped for writing.
 * 2. The same memfd writable registers (so 1 failed for the fd alone).
 * 3. A join with a wrong secret is ERROR_NO_SUCH_JOB (-ENOENT here), the
 *    answer an unknown job id gets (issue 27, item 8), from its explicit
 *    error kind.
 *
 *   moeep-ops-errors SOCKET
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client-internal.h"

#define SIZE (64u << 10)

static int failures;

static void check(int ok, const char *what, struct moeep_client *c, int r) {
        printf("%s: %s (r = %d %s; %s)\n", ok ? "ok" : "FAIL", what, r, r < 0 ? strerror(-r) : "",
               c ? moeep_client_error(c) : "");
        failures += !ok;
}

int main(int argc, char **argv) {
        struct moeep_client *c = NULL, *other = NULL;
        struct moeep_unique_id id, bad;
        char path[64];
        uint64_t region;
        int fd, ro, r;

        if (argc != 2) {
                fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
                return 2;
        }
        if (moeep_connect(argv[1], &c) < 0 || moeep_connect(argv[1], &other) < 0) {
                fprintf(stderr, "cannot connect to %s\n", argv[1]);
                return 1;
        }
        r = moeep_job_create(c, "ops-errors", 1, &id);
        if (r == 0)
                r = moeep_job_join(c, &id, 0, 1, NULL);
        if (r < 0) {
                fprintf(stderr, "job: %s\n", moeep_client_error(c));
                return 1;
        }
        fd = memfd_create("ops-errors", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0 || ftruncate(fd, SIZE) < 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0) {
                perror("memfd");
                return 1;
        }
        snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
        ro = open(path, O_RDONLY | O_CLOEXEC);
        if (ro < 0) {
                perror(path);
                return 1;
        }

        r = client_proxy_region_register(c, ro, SIZE, MOEEP_PROXY_RECV, 0, &region);
        check(r == -EBADF && strstr(moeep_client_error(c), "cannot be mapped for writing"),
              "a read-only proxy region is ERROR_BAD_FDS, not ERROR_BAD_SECRET", c, r);

        r = client_proxy_region_register(c, fd, SIZE, MOEEP_PROXY_RECV, 0, &region);
        check(r == 0, "the same memfd, writable, registers", c, r);

        bad = id;
        bad.bytes[9] ^= 0x5a; /* the secret's first byte (job.h: bytes 9..40) */
        r = moeep_job_join(other, &bad, 0, 1, NULL);
        check(r == -ENOENT && strstr(moeep_client_error(other), "no live job has this id and secret"),
              "a wrong secret is ERROR_NO_SUCH_JOB, as an unknown id is", other, r);

        close(ro);
        close(fd);
        moeep_client_free(other);
        moeep_client_free(c);
        return failures ? 1 : 0;
}
