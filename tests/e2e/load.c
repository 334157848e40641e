/* moeep-e2e-load: many clients at once against a real moeepd.
 *
 *   1. CLIENTS threads (default 256) connect at the same moment (a barrier
 *      releases them together) and say Hello; the daemon must hold exactly
 *      one descriptor per session.
 *   2. They form CLIENTS/8 jobs of 8 ranks and run CYCLES (default 10,000)
 *      join / register a memfd region / leave cycles in all, concurrently;
 *      every call must succeed. The latency of each join is measured.
 *   3. Everyone disconnects: the daemon's descriptor count must come back
 *      to its baseline exactly, and its VmRSS to within RSS_TOLERANCE_KIB of
 *      it (allocator caching; not checked under AddressSanitizer, whose
 *      quarantine holds freed memory on purpose).
 *
 *   4. One client alone runs SOLO_JOINS join/leave cycles: the join latency
 *      without contention, for comparison with the loaded one.
 *
 * The baseline is taken after one warm-up cycle (the daemon's receive
 * buffer and libevent's tables are touched once). Prints one summary line
 * with the numbers docs/reliability.md quotes.
 *
 * usage: moeep-e2e-load MOEEPD [CLIENTS [CYCLES]] */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../cleanup.h"
#include "../tmpdir.h"
#include "isolation-proc.h"
#include "moeep.h"

#define RANKS_PER_JOB 8
#define REGION_BYTES 4096
#define RSS_TOLERANCE_KIB 1024
#define TOTAL_TIMEOUT_S 240
#define SOLO_JOINS 1000 /* <= CYCLES: they reuse the latency array */

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif
#ifndef UNDER_ASAN
#define UNDER_ASAN 0
#endif

static char tmpdir[64];
static char sock_path[96], conf_path[96], log_path[96];
static pid_t daemon_pid = -1;

struct worker {
        pthread_t thread;
        int index;
        int cycles;
        double *latency_us; /* one per cycle: the join's round trip */
        int error;          /* first failing call's -errno, 0 when none */
        char what[160];
};

static int nclients = 256, ncycles = 10000;
static struct worker *workers;
static struct moeep_unique_id *job_ids; /* one per job, written by its rank 0 */
static pthread_barrier_t start_line, connected, checked, created, done_cycles;
static atomic_int failures;
static atomic_int finished; /* workers done with their cycles */

static double now_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void worker_fail(struct worker *w, int r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void worker_fail(struct worker *w, int r, const char *fmt, ...) {
        va_list ap;

        if (w->error)
                return;
        w->error = r ? r : -EIO;
        va_start(ap, fmt);
        vsnprintf(w->what, sizeof(w->what), fmt, ap);
        va_end(ap);
        atomic_fetch_add(&failures, 1);
}

/* One client: connect with the others, make or find its job, cycle. */
static void *worker_main(void *p) {
        struct worker *w = p;
        struct moeep_client *c = NULL;
        int job = w->index / RANKS_PER_JOB, rank = w->index % RANKS_PER_JOB;
        int memfd = memfd_create("load", MFD_CLOEXEC);
        int r;

        if (memfd < 0 || ftruncate(memfd, REGION_BYTES) < 0)
                worker_fail(w, -errno, "memfd");
        pthread_barrier_wait(&start_line);
        r = moeep_connect(sock_path, &c);
        if (r < 0)
                worker_fail(w, r, "connect: %s", strerror(-r));
        pthread_barrier_wait(&connected);
        pthread_barrier_wait(&checked); /* main counted the daemon's fds */
        if (c && rank == 0) {
                r = moeep_job_create(c, "load", RANKS_PER_JOB, &job_ids[job]);
                if (r < 0)
                        worker_fail(w, r, "create: %s", moeep_client_error(c));
        }
        pthread_barrier_wait(&created);
        for (int i = 0; c && !w->error && i < w->cycles; i++) {
                uint64_t region;
                double t0 = now_us();

                r = moeep_job_join(c, &job_ids[job], rank, RANKS_PER_JOB, NULL);
                w->latency_us[i] = now_us() - t0;
                if (r < 0) {
                        worker_fail(w, r, "join (cycle %d): %s", i, moeep_client_error(c));
                        break;
                }
                r = moeep_region_register(c, memfd, MOEEP_REGION_MEMFD, REGION_BYTES, (uint32_t)i, &region);
                if (r < 0)
                        worker_fail(w, r, "register (cycle %d): %s", i, moeep_client_error(c));
                r = moeep_job_leave(c);
                if (r < 0)
                        worker_fail(w, r, "leave (cycle %d): %s", i, moeep_client_error(c));
        }
        atomic_fetch_add(&finished, 1);
        /* Stay connected until everyone is done, then leave together. */
        pthread_barrier_wait(&done_cycles);
        moeep_client_free(c);
        if (memfd >= 0)
                close(memfd);
        return NULL;
}

static int start_daemon(const char *moeepd) {
        FILE *f = fopen(conf_path, "w");

        if (!f)
                return -1;
        /* One uid runs every client: its caps must fit the whole load. */
        fprintf(f,
                "socket = %s\n"
                "log_level = notice\n"
                "max_sessions = 4096\n"
                "max_sessions_per_uid = 4096\n"
                "max_jobs_per_uid = 4096\n"
                "max_fds_per_uid = 65536\n",
                sock_path);
        fclose(f);
        return proc_start_moeepd(moeepd, conf_path, log_path, sock_path, &daemon_pid);
}

/* One cycle as the workers do it, so that what is allocated once (receive
 * buffer, libevent's tables) is in the baseline. */
static int warm_up(void) {
        struct moeep_client *c = NULL;
        struct moeep_unique_id id;
        uint64_t region;
        int fd = memfd_create("warm", MFD_CLOEXEC), r;

        if (fd < 0 || ftruncate(fd, REGION_BYTES) < 0)
                return -1;
        r = moeep_connect(sock_path, &c);
        if (r == 0)
                r = moeep_job_create(c, "warm", 1, &id);
        if (r == 0)
                r = moeep_job_join(c, &id, 0, 1, NULL);
        if (r == 0)
                r = moeep_region_register(c, fd, MOEEP_REGION_MEMFD, REGION_BYTES, 0, &region);
        if (r == 0)
                r = moeep_job_leave(c);
        moeep_client_free(c);
        close(fd);
        return r;
}

/* Join latency without contention: one client, `n` join/leave cycles. */
static int solo_joins(double *lat, int n) {
        struct moeep_client *c = NULL;
        struct moeep_unique_id id;
        int r = moeep_connect(sock_path, &c);

        if (r == 0)
                r = moeep_job_create(c, "solo", 1, &id);
        for (int i = 0; r == 0 && i < n; i++) {
                double t0 = now_us();

                r = moeep_job_join(c, &id, 0, 1, NULL);
                lat[i] = now_us() - t0;
                if (r == 0)
                        r = moeep_job_leave(c);
        }
        moeep_client_free(c);
        return r;
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;

        return x < y ? -1 : x > y;
}

static void show_log(void) {
        char cmd[160];

        snprintf(cmd, sizeof(cmd), "tail -n 30 '%s'", log_path);
        (void)!system(cmd);
}

int main(int argc, char **argv) {
        struct rlimit rl;
        pthread_attr_t attr;
        double *lat, t_connect, t_cycles;
        int fds_base, fds_connected, fds_peak = 0, fds_after, njobs, st, rc = 0;
        long rss_base, rss_peak = 0, rss_after;
        size_t nlat = 0;

        if (argc < 2) {
                fprintf(stderr, "usage: %s MOEEPD [CLIENTS [CYCLES]]\n", argv[0]);
                return 2;
        }
        if (argc > 2)
                nclients = atoi(argv[2]);
        if (argc > 3)
                ncycles = atoi(argv[3]);
        if (nclients < RANKS_PER_JOB || nclients % RANKS_PER_JOB || ncycles < SOLO_JOINS) {
                fprintf(stderr, "load: CLIENTS must be a multiple of %d, CYCLES >= %d\n", RANKS_PER_JOB,
                        SOLO_JOINS);
                return 2;
        }
        setvbuf(stdout, NULL, _IOLBF, 0);
        /* The daemon and the temporary directory go on every way out
         * (tests/cleanup.h), within TOTAL_TIMEOUT_S. */
        cleanup_add_pid(&daemon_pid);
        cleanup_add_file(sock_path);
        cleanup_add_file(conf_path);
        cleanup_add_file(log_path);
        cleanup_arm(TOTAL_TIMEOUT_S, "load: timed out\n");
        signal(SIGPIPE, SIG_IGN);
        /* Each client holds a socket and a memfd here. */
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
                rl.rlim_cur = rl.rlim_max;
                setrlimit(RLIMIT_NOFILE, &rl);
        }
        test_tmp_path(tmpdir, sizeof(tmpdir), "moeep-load.XXXXXX");
        if (!mkdtemp(tmpdir)) {
                perror("load: mkdtemp");
                return 1;
        }
        cleanup_add_dir(tmpdir);
        snprintf(sock_path, sizeof(sock_path), "%s/moeepd.sock", tmpdir);
        snprintf(conf_path, sizeof(conf_path), "%s/moeepd.conf", tmpdir);
        snprintf(log_path, sizeof(log_path), "%s/moeepd.log", tmpdir);
        if (start_daemon(argv[1]) < 0) {
                printf("FAIL: moeepd did not start\n");
                show_log();
                return 1;
        }
        if (warm_up() < 0) {
                printf("FAIL: the warm-up cycle failed\n");
                show_log();
                return 1;
        }
        sleep_ms(100);
        fds_base = proc_count_fds(daemon_pid);
        rss_base = proc_rss_kib(daemon_pid);

        njobs = nclients / RANKS_PER_JOB;
        workers = calloc((size_t)nclients, sizeof(*workers));
        job_ids = calloc((size_t)njobs, sizeof(*job_ids));
        lat = calloc((size_t)ncycles, sizeof(*lat));
        if (!workers || !job_ids || !lat)
                return 1;
        pthread_barrier_init(&start_line, NULL, (unsigned)nclients + 1);
        pthread_barrier_init(&connected, NULL, (unsigned)nclients + 1);
        pthread_barrier_init(&checked, NULL, (unsigned)nclients + 1);
        pthread_barrier_init(&created, NULL, (unsigned)nclients + 1);
        pthread_barrier_init(&done_cycles, NULL, (unsigned)nclients + 1);
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 256 << 10);
        for (int i = 0; i < nclients; i++) {
                workers[i].index = i;
                workers[i].cycles = ncycles / nclients + (i < ncycles % nclients);
                workers[i].latency_us = lat + nlat;
                nlat += (size_t)workers[i].cycles;
                if (pthread_create(&workers[i].thread, &attr, worker_main, &workers[i]) != 0) {
                        printf("FAIL: pthread_create %d\n", i);
                        return 1;
                }
        }

        t_connect = now_us();
        pthread_barrier_wait(&start_line);
        pthread_barrier_wait(&connected);
        t_connect = now_us() - t_connect;
        fds_connected = proc_fds_settle(daemon_pid, fds_base + nclients);
        if (fds_connected != fds_base + nclients) {
                printf("FAIL: %d clients connected: moeepd holds %d fds, want %d\n", nclients, fds_connected,
                       fds_base + nclients);
                rc = 1;
        }
        pthread_barrier_wait(&checked);
        pthread_barrier_wait(&created);
        /* Sample the daemon while the cycles run. */
        t_cycles = now_us();
        while (atomic_load(&finished) < nclients) {
                int n = proc_count_fds(daemon_pid);
                long kib = proc_rss_kib(daemon_pid);

                fds_peak = n > fds_peak ? n : fds_peak;
                rss_peak = kib > rss_peak ? kib : rss_peak;
                sleep_ms(20);
        }
        t_cycles = now_us() - t_cycles;
        pthread_barrier_wait(&done_cycles);
        for (int i = 0; i < nclients; i++)
                pthread_join(workers[i].thread, NULL);

        for (int i = 0; i < nclients; i++)
                if (workers[i].error) {
                        printf("FAIL: client %d: %s (%s)\n", i, workers[i].what, strerror(-workers[i].error));
                        rc = 1;
                }
        fds_after = proc_fds_settle(daemon_pid, fds_base);
        sleep_ms(200);
        rss_after = proc_rss_kib(daemon_pid);
        qsort(lat, nlat, sizeof(*lat), cmp_double);

        printf("load: %d clients connected at once in %.1f ms; moeepd held %d fds with them (baseline %d)\n",
               nclients, t_connect / 1e3, fds_connected, fds_base);
        printf("load: %d join/register/leave cycles in %.2f s (%.0f cycles/s) over %d jobs of %d ranks\n",
               ncycles, t_cycles / 1e6, ncycles / (t_cycles / 1e6), njobs, RANKS_PER_JOB);
        printf("load: join latency p50 %.0f us, p99 %.0f us, max %.0f us (%zu joins)\n", lat[nlat / 2],
               lat[(size_t)(nlat * 0.99)], lat[nlat - 1], nlat);
        printf("load: moeepd fds baseline %d, peak %d, after %d; VmRSS baseline %ld KiB, peak %ld KiB, "
               "after %ld KiB (tolerance +%d KiB%s)\n",
               fds_base, fds_peak, fds_after, rss_base, rss_peak, rss_after, RSS_TOLERANCE_KIB,
               UNDER_ASAN ? ", not checked under ASan" : "");
        if (fds_after != fds_base) {
                printf("FAIL: moeepd holds %d fds after the load, %d before\n", fds_after, fds_base);
                rc = 1;
        }
        if (!UNDER_ASAN && (rss_after < 0 || rss_after > rss_base + RSS_TOLERANCE_KIB)) {
                printf("FAIL: moeepd VmRSS %ld KiB after the load, baseline %ld KiB + %d\n", rss_after,
                       rss_base, RSS_TOLERANCE_KIB);
                rc = 1;
        }
        if (solo_joins(lat, SOLO_JOINS) == 0) {
                qsort(lat, SOLO_JOINS, sizeof(*lat), cmp_double);
                printf("load: join latency of one client alone p50 %.0f us, p99 %.0f us, max %.0f us "
                       "(%d joins)\n",
                       lat[SOLO_JOINS / 2], lat[(size_t)(SOLO_JOINS * 0.99)], lat[SOLO_JOINS - 1],
                       SOLO_JOINS);
        } else {
                printf("FAIL: a lone client's join/leave cycles failed\n");
                rc = 1;
        }
        kill(daemon_pid, SIGTERM);
        if (waitpid(daemon_pid, &st, 0) == daemon_pid) {
                daemon_pid = -1;
                if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                        printf("FAIL: moeepd exited with status 0x%x after SIGTERM\n", st);
                        rc = 1;
                }
        }
        if (rc)
                show_log();
        printf("load: %s\n", rc ? "FAILED" : "all checks passed");
        return rc;
}
