/* See harness.h. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "harness.h"

static int find_moeepd(char *out, size_t len) {
        char self[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
        static const char *const rel[] = { "/../daemon/moeepd", "/../../daemon/moeepd" };

        if (n <= 0)
                return -errno;
        self[n] = '\0';
        *strrchr(self, '/') = '\0';
        for (size_t i = 0; i < sizeof(rel) / sizeof(rel[0]); i++) {
                snprintf(out, len, "%s%s", self, rel[i]);
                if (access(out, X_OK) == 0)
                        return 0;
        }
        return -ENOENT;
}

static void sleep_ms(int ms) {
        struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L };
        nanosleep(&ts, NULL);
}

int harness_init(struct harness *h, const char *moeepd, const char *socket, size_t shared_bytes) {
        char path[PATH_MAX];
        struct moeep_client *probe = NULL;

        memset(h, 0, sizeof(*h));
        h->shared_bytes = shared_bytes ? shared_bytes : 4096;
        h->shared = mmap(NULL, h->shared_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (h->shared == MAP_FAILED) {
                h->shared = NULL;
                return -errno;
        }
        if (socket) {
                snprintf(h->socket, sizeof(h->socket), "%s", socket);
                return 0;
        }
        if (!moeepd) {
                if (find_moeepd(path, sizeof(path)) < 0) {
                        fprintf(stderr, "harness: cannot find moeepd next to this program; pass its path\n");
                        return -ENOENT;
                }
                moeepd = path;
        }
        snprintf(h->dir, sizeof(h->dir), "/tmp/moeep-harness-XXXXXX");
        if (!mkdtemp(h->dir))
                return -errno;
        snprintf(h->socket, sizeof(h->socket), "%s/moeepd.sock", h->dir);
        h->daemon_pid = fork();
        if (h->daemon_pid < 0)
                return -errno;
        if (h->daemon_pid == 0) {
                execl(moeepd, moeepd, "--socket", h->socket, "--foreground", "--log-level", "warning", (char *)NULL);
                fprintf(stderr, "harness: exec %s: %s\n", moeepd, strerror(errno));
                _exit(127);
        }
        for (int i = 0; i < 500; i++) {
                if (moeep_connect(h->socket, &probe) == 0) {
                        moeep_client_free(probe);
                        return 0;
                }
                if (waitpid(h->daemon_pid, NULL, WNOHANG) == h->daemon_pid) {
                        h->daemon_pid = 0;
                        fprintf(stderr, "harness: moeepd %s exited at start\n", moeepd);
                        return -ECHILD;
                }
                sleep_ms(10);
        }
        fprintf(stderr, "harness: moeepd did not listen on %s within 5 s\n", h->socket);
        return -ETIMEDOUT;
}

static int rank_main(struct harness *h, const struct moeep_unique_id *id, int rank, int ranks, harness_rank_fn fn,
                     void *arg) {
        struct moeep_client *c = NULL;
        char uuid[64] = "";
        struct cudaDeviceProp prop;
        int r, n = 0;

        if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
                fprintf(stderr, "rank %d: no CUDA device\n", rank);
                return 2;
        }
        if (cudaSetDevice(rank % n) != cudaSuccess)
                return 2;
        if (cudaGetDeviceProperties(&prop, rank % n) == cudaSuccess) {
                const unsigned char *u = (const unsigned char *)prop.uuid.bytes;
                snprintf(uuid, sizeof(uuid),
                         "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                         u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
        }
        r = moeep_connect(h->socket, &c);
        if (r < 0) {
                fprintf(stderr, "rank %d: connect %s: %s\n", rank, h->socket, strerror(-r));
                return 3;
        }
        r = moeep_job_join(c, id, rank, ranks, uuid);
        if (r < 0) {
                fprintf(stderr, "rank %d: join: %s\n", rank, moeep_client_error(c));
                moeep_client_free(c);
                return 3;
        }
        r = fn(c, rank, ranks, h->shared, arg);
        moeep_job_leave(c);
        moeep_client_free(c);
        return r ? 1 : 0;
}

int harness_run(struct harness *h, int ranks, const char *name, harness_rank_fn fn, void *arg, int timeout_s) {
        struct moeep_client *creator = NULL;
        struct moeep_unique_id id;
        pid_t pids[MOEEP_MAX_RANKS];
        int failed = 0, left, r;
        time_t deadline;

        if (ranks < 1 || ranks > MOEEP_MAX_RANKS)
                return -EINVAL;
        r = moeep_connect(h->socket, &creator);
        if (r < 0) {
                fprintf(stderr, "harness: connect %s: %s\n", h->socket, strerror(-r));
                return r;
        }
        r = moeep_job_create(creator, name, ranks, &id);
        if (r < 0) {
                fprintf(stderr, "harness: job create: %s\n", moeep_client_error(creator));
                moeep_client_free(creator);
                return r;
        }
        fflush(stdout);
        fflush(stderr);
        for (int i = 0; i < ranks; i++) {
                pids[i] = fork();
                if (pids[i] == 0) {
                        /* The creator's socket belongs to the parent. */
                        close(moeep_client_fd(creator));
                        _exit(rank_main(h, &id, i, ranks, fn, arg));
                }
                if (pids[i] < 0) {
                        failed += ranks - i;
                        ranks = i;
                        break;
                }
        }
        deadline = time(NULL) + timeout_s;
        left = ranks;
        while (left > 0) {
                int st;
                pid_t p = waitpid(-1, &st, WNOHANG);

                if (p > 0) {
                        for (int i = 0; i < ranks; i++)
                                if (pids[i] == p) {
                                        left--;
                                        pids[i] = 0;
                                        if (!WIFEXITED(st) || WEXITSTATUS(st)) {
                                                failed++;
                                                fprintf(stderr, "harness: rank %d %s %d\n", i,
                                                        WIFEXITED(st) ? "exited with" : "killed by signal",
                                                        WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
                                        }
                                }
                        continue;
                }
                if (time(NULL) > deadline) {
                        fprintf(stderr, "harness: ranks still running after %d s; killing them\n", timeout_s);
                        for (int i = 0; i < ranks; i++)
                                if (pids[i] > 0)
                                        kill(pids[i], SIGKILL);
                        deadline = time(NULL) + 3600;
                }
                sleep_ms(5);
        }
        moeep_client_free(creator);
        return failed;
}

int harness_gpu_count(void) {
        int fds[2], n = 0;
        pid_t p;

        if (pipe(fds) < 0)
                return 0;
        p = fork();
        if (p == 0) {
                int c = 0;
                if (cudaGetDeviceCount(&c) != cudaSuccess)
                        c = 0;
                (void)!write(fds[1], &c, sizeof(c));
                _exit(0);
        }
        close(fds[1]);
        if (p < 0 || read(fds[0], &n, sizeof(n)) != sizeof(n))
                n = 0;
        close(fds[0]);
        if (p > 0)
                waitpid(p, NULL, 0);
        return n;
}

void harness_fini(struct harness *h) {
        if (h->daemon_pid > 0) {
                kill(h->daemon_pid, SIGTERM);
                waitpid(h->daemon_pid, NULL, 0);
        }
        if (h->dir[0]) {
                char sock[160];
                snprintf(sock, sizeof(sock), "%s/moeepd.sock", h->dir);
                unlink(sock);
                rmdir(h->dir);
        }
        if (h->shared)
                munmap(h->shared, h->shared_bytes);
        memset(h, 0, sizeof(*h));
}
