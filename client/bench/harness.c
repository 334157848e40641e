/* See harness.h. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
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
                if (snprintf(out, len, "%s%s", self, rel[i]) >= (int)len)
                        continue;
                if (access(out, X_OK) == 0)
                        return 0;
        }
        return -ENOENT;
}

/* GPUs counted by harness_gpu_count() (0: not counted yet). */
static int gpus_seen;

/* Whether an MPS control daemon serves this host's CUDA clients: its pipe
 * directory ($CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps) holds its
 * control socket. */
static bool mps_running(void) {
        const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
        char path[PATH_MAX];

        if (snprintf(path, sizeof(path), "%s/control", dir && *dir ? dir : "/tmp/nvidia-mps") >=
            (int)sizeof(path))
                return false;
        return access(path, F_OK) == 0;
}

/* The CUDA_MPS_ACTIVE_THREAD_PERCENTAGE each rank process gets when `share`
 * ranks run on one GPU under MPS: at most 100 / (share + 1). Without a
 * limit each MPS client sees every SM, the low-latency kernels size their
 * grids to fill the GPU and spin waiting for a peer whose kernel then
 * cannot start (a deadlock); with it the device reports that share of the
 * SMs and the grids fit side by side. Exactly 100 / share is not enough:
 * on one H100, 2 ranks at 50% and 4 at 25% deadlocked in the low-latency
 * tests and benchmark, 33% and 20% passed (2026-11-24). A smaller value
 * the user set is kept. 0: leave the environment alone (no sharing, or no
 * MPS: time-sliced contexts, which the variable would not affect). */
static int mps_percentage(int share) {
        const char *user = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
        int pct = 100 / (share + 1);

        if (share < 2 || !mps_running())
                return 0;
        if (user && atoi(user) >= 1 && atoi(user) < pct)
                pct = atoi(user);
        return pct;
}

static void sleep_ms(int ms) {
        struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L };
        nanosleep(&ts, NULL);
}

static int two_nodes_configure(struct harness *h);
static int daemon_spawn(struct harness *h, const char *socket, const char *node, pid_t *ret_pid);

int harness_init(struct harness *h, const char *moeepd, const char *socket, size_t shared_bytes) {
        char path[PATH_MAX];

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
        snprintf(h->moeepd, sizeof(h->moeepd), "%s", moeepd);
        h->nodes = getenv("MOEEP_HARNESS_NODES") && atoi(getenv("MOEEP_HARNESS_NODES")) == 2 ? 2 : 1;
        if (h->nodes == 2) {
                int r = two_nodes_configure(h);
                if (r < 0)
                        return r;
                snprintf(h->socket_b, sizeof(h->socket_b), "%s/moeepd-b.sock", h->dir);
                r = daemon_spawn(h, h->socket_b, "b", &h->daemon_b_pid);
                if (r < 0)
                        return r;
        }
        return harness_daemon_start(h);
}

/* A free TCP port on 127.0.0.1 (free when asked). */
static int free_port(void) {
        struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        socklen_t len = sizeof(a);
        int fd = socket(AF_INET, SOCK_STREAM, 0), port = -1;

        if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
            getsockname(fd, (struct sockaddr *)&a, &len) == 0)
                port = ntohs(a.sin_port);
        if (fd >= 0)
                close(fd);
        return port;
}

/* The cluster key and the two daemons' configuration files in h->dir. */
static int two_nodes_configure(struct harness *h) {
        const int port[2] = { free_port(), free_port() };
        char path[160];
        FILE *f;
        int fd;

        if (port[0] < 0 || port[1] < 0)
                return -EADDRNOTAVAIL;
        snprintf(path, sizeof(path), "%s/key", h->dir);
        fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0 || dprintf(fd, "moeep-harness-key-%d-%ld\n", (int)getpid(), (long)time(NULL)) < 0) {
                if (fd >= 0)
                        close(fd);
                return -errno;
        }
        close(fd);
        /* $MOEEP_HARNESS_TRANSPORT=cuda: the GPUDirect path (GPU memory to
         * GPU memory through the daemons' cuda transport, device 0), with
         * notices on, so that each daemon's byte totals reach stderr at
         * exit (tests/gpu/cuda-transport.sh checks them). */
        const char *tp = getenv("MOEEP_HARNESS_TRANSPORT");
        const bool cuda = tp && strcmp(tp, "cuda") == 0;

        for (int i = 0; i < 2; i++) {
                snprintf(path, sizeof(path), "%s/%s.conf", h->dir, i ? "b" : "a");
                if (!(f = fopen(path, "w")))
                        return -errno;
                fprintf(f,
                        "[moeepd]\nlog_level = %s\nmesh_listen = 127.0.0.1:%d\nmesh_peers = "
                        "127.0.0.1:%d\n"
                        "cluster_key_file = %s/key\n%s",
                        cuda ? "notice" : "warning", port[i], port[1 - i], h->dir,
                        cuda ? "transport = cuda\ntransport_device = 0\n"
                             : "transport = fabric\nfabric_provider = tcp\ntransport_address = 127.0.0.1\n");
                fclose(f);
        }
        return 0;
}

/* Starts moeepd on `socket` (with the configuration `node`.conf in h->dir
 * when two nodes run) and returns once it accepts connections. */
static int daemon_spawn(struct harness *h, const char *socket, const char *node, pid_t *ret_pid) {
        struct moeep_client *probe = NULL;
        char conf[160];
        pid_t pid;

        snprintf(conf, sizeof(conf), "%s/%s.conf", h->dir, node);
        pid = fork();
        if (pid < 0)
                return -errno;
        if (pid == 0) {
                if (h->nodes == 2)
                        execl(h->moeepd, h->moeepd, "--config", conf, "--socket", socket, "--foreground",
                              (char *)NULL);
                else
                        execl(h->moeepd, h->moeepd, "--socket", socket, "--foreground", "--log-level",
                              "warning", (char *)NULL);
                fprintf(stderr, "harness: exec %s: %s\n", h->moeepd, strerror(errno));
                _exit(127);
        }
        *ret_pid = pid;
        for (int i = 0; i < 500; i++) {
                if (moeep_connect(socket, &probe) == 0) {
                        moeep_client_free(probe);
                        return 0;
                }
                if (waitpid(pid, NULL, WNOHANG) == pid) {
                        *ret_pid = 0;
                        fprintf(stderr, "harness: moeepd %s exited at start\n", h->moeepd);
                        return -ECHILD;
                }
                sleep_ms(10);
        }
        fprintf(stderr, "harness: moeepd did not listen on %s within 5 s\n", socket);
        return -ETIMEDOUT;
}

int harness_daemon_start(struct harness *h) {
        return daemon_spawn(h, h->socket, "a", &h->daemon_pid);
}

int harness_daemon_stop(struct harness *h, int sig) {
        if (h->daemon_pid <= 0)
                return -ESRCH;
        if (kill(h->daemon_pid, sig) < 0)
                return -errno;
        for (int i = 0; i < 1000; i++) {
                if (waitpid(h->daemon_pid, NULL, WNOHANG) == h->daemon_pid) {
                        h->daemon_pid = 0;
                        return 0;
                }
                sleep_ms(10);
        }
        fprintf(stderr, "harness: moeepd ignored signal %d for 10 s; killing it\n", sig);
        kill(h->daemon_pid, SIGKILL);
        waitpid(h->daemon_pid, NULL, 0);
        h->daemon_pid = 0;
        return -ETIMEDOUT;
}

static int rank_main(struct harness *h, const struct moeep_unique_id *id, int rank, int ranks,
                     harness_rank_fn fn, void *arg) {
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
                         "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                         u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                         u[14], u[15]);
        }
        const char *sock = h->nodes == 2 && harness_node_of(rank, ranks) ? h->socket_b : h->socket;
        r = moeep_connect(sock, &c);
        if (r < 0) {
                fprintf(stderr, "rank %d: connect %s: %s\n", rank, sock, strerror(-r));
                return 3;
        }
        /* At the second node the join goes through the mesh, which may
         * still be connecting right after the daemons started. */
        for (int i = 0; (r = moeep_job_join(c, id, rank, ranks, uuid)) < 0 && sock == h->socket_b && i < 100;
             i++) {
                moeep_client_free(c);
                sleep_ms(100);
                if (moeep_connect(sock, &c) < 0)
                        break;
        }
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

int harness_run(struct harness *h, int ranks, const char *name, harness_rank_fn fn, void *arg,
                int timeout_s) {
        return harness_run_watched(h, ranks, name, fn, arg, timeout_s, NULL);
}

int harness_run_watched(struct harness *h, int ranks, const char *name, harness_rank_fn fn, void *arg,
                        int timeout_s, harness_watch_fn watch) {
        struct moeep_client *creator = NULL;
        struct moeep_unique_id id;
        pid_t pids[MOEEP_MAX_RANKS];
        int failed = 0, left, r, ngpu, share, mps_pct;
        time_t deadline;

        if (ranks < 1 || ranks > MOEEP_MAX_RANKS)
                return -EINVAL;
        /* More ranks than GPUs: rank i runs on GPU i % ngpu (rank_main). */
        ngpu = gpus_seen ? gpus_seen : harness_gpu_count();
        share = ngpu > 0 && ranks > ngpu ? (ranks + ngpu - 1) / ngpu : 1;
        mps_pct = mps_percentage(share);
        if (share > 1)
                fprintf(stderr,
                        "harness: WARNING: %d ranks share %d GPU%s (rank i on GPU i %% %d, up to %d a GPU): "
                        "times "
                        "measured in this run are not performance figures\n",
                        ranks, ngpu, ngpu > 1 ? "s" : "", ngpu, share);
        if (mps_pct)
                fprintf(stderr,
                        "harness: MPS is running: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%d for each rank\n",
                        mps_pct);
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
                        if (mps_pct) {
                                char v[16];
                                snprintf(v, sizeof(v), "%d", mps_pct);
                                setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", v, 1);
                        }
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
                if (watch)
                        watch(h, arg);
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

/* Runs fn in a child process (CUDA stays out of this one) and returns
 * what it wrote, up to len bytes; the byte count read, or -1. */
static ssize_t in_child(void (*fn)(void *out, size_t len), void *out, size_t len) {
        int fds[2];
        ssize_t n = -1;
        pid_t p;

        if (pipe(fds) < 0)
                return -1;
        p = fork();
        if (p == 0) {
                char buf[len];
                memset(buf, 0, len);
                fn(buf, len);
                (void)!write(fds[1], buf, len);
                _exit(0);
        }
        close(fds[1]);
        if (p > 0)
                n = read(fds[0], out, len);
        close(fds[0]);
        if (p > 0)
                waitpid(p, NULL, 0);
        return n;
}

static void count_gpus(void *out, size_t len) {
        if (cudaGetDeviceCount((int *)out) != cudaSuccess)
                *(int *)out = 0;
}

/* $MOEEP_HARNESS_GPUS=N: use only the first N GPUs (of
 * $CUDA_VISIBLE_DEVICES when that is set), so that ranks share GPUs even on
 * a machine with more (the gpu suite's *_shared tests). Narrows
 * CUDA_VISIBLE_DEVICES, which every CUDA process started later inherits. */
static void limit_gpus(void) {
        const char *want = getenv("MOEEP_HARNESS_GPUS"), *vis = getenv("CUDA_VISIBLE_DEVICES");
        char list[256] = "";
        size_t len = 0;
        int n = want ? atoi(want) : 0;

        if (n < 1)
                return;
        if (vis && *vis) {
                const char *p = vis;
                for (int i = 0; i < n && *p && len < sizeof(list) - 1; i++) {
                        size_t k = strcspn(p, ",");
                        if (len + k + 2 > sizeof(list))
                                break;
                        len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%.*s", i ? "," : "",
                                                (int)k, p);
                        p += k + (p[k] == ',');
                }
        } else {
                for (int i = 0; i < n && len < sizeof(list) - 8; i++)
                        len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%d", i ? "," : "", i);
        }
        setenv("CUDA_VISIBLE_DEVICES", list, 1);
}

int harness_gpu_count(void) {
        int n = 0;

        limit_gpus();
        gpus_seen = in_child(count_gpus, &n, sizeof(n)) == sizeof(n) ? n : 0;
        return gpus_seen;
}

static void free_per_gpu(void *out, size_t len) {
        size_t *v = out, total;
        int n = 0;

        if (cudaGetDeviceCount(&n) != cudaSuccess)
                return;
        for (int i = 0; i < n && (size_t)(i + 1) * sizeof(size_t) <= len; i++)
                if (cudaSetDevice(i) != cudaSuccess || cudaMemGetInfo(&v[i], &total) != cudaSuccess)
                        v[i] = 0;
}

int harness_gpu_free(size_t *ret_free, int n) {
        return in_child(free_per_gpu, ret_free, sizeof(size_t) * (size_t)n) ==
                               (ssize_t)(sizeof(size_t) * (size_t)n)
                       ? 0
                       : -1;
}

void harness_fini(struct harness *h) {
        const pid_t pids[2] = { h->daemon_pid, h->daemon_b_pid };

        for (int i = 0; i < 2; i++)
                if (pids[i] > 0) {
                        kill(pids[i], SIGTERM);
                        waitpid(pids[i], NULL, 0);
                }
        if (h->dir[0]) {
                static const char *const files[] = { "moeepd.sock", "moeepd-b.sock", "key", "a.conf",
                                                     "b.conf" };
                char path[160];
                for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
                        snprintf(path, sizeof(path), "%s/%s", h->dir, files[i]);
                        unlink(path);
                }
                rmdir(h->dir);
        }
        if (h->shared)
                munmap(h->shared, h->shared_bytes);
        memset(h, 0, sizeof(*h));
}
