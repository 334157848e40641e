/* Client descriptors (daemon/state/clientfd.c): the kind table, the charges and
 * caps, and the closers. The attacks on a real daemon (SO_LINGER, FUSE)
 * are in tests/security/fdattack.c. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "errors.h"
#include "log.h"
#include "state/clientfd-internal.h"
#include "state/clientfd.h"
#include "unit.h"

#define MEMFD REGION_KIND_MEMFD
#define CUMEM REGION_KIND_CUMEM_FD
#define DMABUF REGION_KIND_DMABUF

/* Every open() of this program goes through here, the daemon's objects
 * linked into it included (open() is open64() with _FILE_OFFSET_BITS=64):
 * it counts the opens of a /proc/self/fdinfo/ file, which the kernel
 * writes under the locks of the file it describes (an epoll fd's mutex,
 * which a client can hold as long as it likes). */
static int fdinfo_opens;

int open64(const char *path, int flags, ...) {
        mode_t mode = 0;

        if (flags & (O_CREAT | __O_TMPFILE)) {
                va_list ap;

                va_start(ap, flags);
                mode = va_arg(ap, mode_t);
                va_end(ap);
        }
        if (strncmp(path, "/proc/self/fdinfo/", 18) == 0)
                fdinfo_opens++;
        return (int)syscall(SYS_openat, AT_FDCWD, path, flags, mode);
}

/* statx() likewise: how many calls came from the thread that runs the
 * loop (main()), how many from others (closers). */
static pthread_t loop_thread;
static int statx_on_loop, statx_off_loop;

int statx(int dirfd, const char *path, int flags, unsigned mask, struct statx *buf) {
        if (pthread_equal(pthread_self(), loop_thread))
                __atomic_add_fetch(&statx_on_loop, 1, __ATOMIC_SEQ_CST);
        else
                __atomic_add_fetch(&statx_off_loop, 1, __ATOMIC_SEQ_CST);
        return (int)syscall(SYS_statx, dirfd, path, flags, mask, buf);
}

/* close() likewise: a number at STUCK_FD or above is no descriptor but
 * stands for one whose close never returns (a FUSE file whose server does
 * not answer FLUSH): the closer that closes it waits until the test lets
 * it go (stuck_release()), at most STUCK_MAX_MS, and no signal ends the
 * wait (as FUSE's does not). */
#define STUCK_FD 1000000
#define STUCK_MAX_MS 5000
static pthread_mutex_t stuck_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t stuck_cond = PTHREAD_COND_INITIALIZER;
static bool stuck_released;
static int stuck_now; /* threads in such a close now */

int close(int fd) {
        struct timespec until;

        if (fd < STUCK_FD)
                return (int)syscall(SYS_close, fd);
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += STUCK_MAX_MS / 1000;
        pthread_mutex_lock(&stuck_lock);
        stuck_now++;
        pthread_cond_broadcast(&stuck_cond);
        while (!stuck_released && pthread_cond_timedwait(&stuck_cond, &stuck_lock, &until) == 0)
                ;
        stuck_now--;
        pthread_cond_broadcast(&stuck_cond);
        pthread_mutex_unlock(&stuck_lock);
        return 0;
}

/* Waits up to 2 s until `n` threads are in a stuck close; returns how
 * many are. */
static int stuck_wait(int n) {
        struct timespec until;
        int now;

        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 2;
        pthread_mutex_lock(&stuck_lock);
        while (stuck_now < n && pthread_cond_timedwait(&stuck_cond, &stuck_lock, &until) == 0)
                ;
        now = stuck_now;
        pthread_mutex_unlock(&stuck_lock);
        return now;
}

/* Lets every stuck close return, and the ones to come too until
 * stuck_hold(). */
static void stuck_release(void) {
        pthread_mutex_lock(&stuck_lock);
        stuck_released = true;
        pthread_cond_broadcast(&stuck_cond);
        pthread_mutex_unlock(&stuck_lock);
}

static void stuck_hold(void) {
        pthread_mutex_lock(&stuck_lock);
        stuck_released = false;
        pthread_mutex_unlock(&stuck_lock);
}

/* Whether the tests' runs wait (test_runs()). */
static bool gate_closed;

static void gate(bool closed) {
        pthread_mutex_lock(&stuck_lock);
        gate_closed = closed;
        pthread_cond_broadcast(&stuck_cond);
        pthread_mutex_unlock(&stuck_lock);
}

struct fixture {
        struct config config;
        struct event_base *base;
        struct clientfds *cf;
        int fds_before;
};

static int setup(void **state) {
        struct fixture *f = calloc(1, sizeof(*f));

        if (!f || config_init(&f->config) < 0)
                return -1;
        f->fds_before = unit_count_fds();
        f->base = event_base_new();
        if (!f->base || clientfds_new(f->base, &f->config, &f->cf) < 0)
                return -1;
        *state = f;
        return 0;
}

static int teardown(void **state) {
        struct fixture *f = *state;

        stuck_release(); /* a test that failed left its stuck closes, */
        gate(false);     /* or its runs held */
        assert_int_equal(clientfds_settle(f->cf, 2000), 0);
        clientfds_free(f->cf, 1000);
        event_base_free(f->base);
        config_done(&f->config);
        assert_int_equal(unit_count_fds(), f->fds_before);
        free(f);
        return 0;
}

/* Checks `fd` as `kind`; returns the result, errmsg in `msg`. */
static int check(struct fixture *f, int fd, enum region_kind kind, uint64_t size, char *msg) {
        msg[0] = '\0';
        return clientfd_check(f->cf, fd, kind, size, msg);
}

static void expect_refused(struct fixture *f, int fd, enum region_kind kind, const char *is) {
        char msg[ERRMSG_MAX];

        assert_int_equal(check(f, fd, kind, 4096, msg), -ERROR_KIND_BAD_FDS);
        if (!strstr(msg, clientfd_kind_to_string(kind)) || !strstr(msg, is))
                fail_msg("%s: message '%s' does not say '%s'", clientfd_kind_to_string(kind), msg, is);
}

static void test_kinds(void **state) {
        struct fixture *f = *state;
        int p[2], sp[2], mem, sealed, small, dir, efd, zero, opath, shm, ep, tfd;
        char msg[ERRMSG_MAX], shm_path[64];

        assert_int_equal(pipe2(p, O_CLOEXEC), 0);
        assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp), 0);
        mem = unit_memfd(4096, NULL);
        small = unit_memfd(100, NULL);
        sealed = memfd_create("sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        assert_true(sealed >= 0 && ftruncate(sealed, 8192) == 0 &&
                    fcntl(sealed, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
        dir = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        efd = eventfd(0, EFD_CLOEXEC);
        zero = open("/dev/zero", O_RDONLY | O_CLOEXEC);
        opath = open("/dev/zero", O_PATH | O_CLOEXEC);
        snprintf(shm_path, sizeof(shm_path), "/dev/shm/moeep-unit-%d", (int)getpid());
        shm = open(shm_path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (shm >= 0) {
                unlink(shm_path);
                assert_int_equal(ftruncate(shm, 4096), 0);
        }
        ep = epoll_create1(EPOLL_CLOEXEC);
        tfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
        assert_true(dir >= 0 && efd >= 0 && zero >= 0 && opath >= 0 && ep >= 0 && tfd >= 0);
        /* The counter sees an open() compiled as the daemon's is. */
        fdinfo_opens = 0;
        close(open("/proc/self/fdinfo/0", O_RDONLY | O_CLOEXEC));
        assert_int_equal(fdinfo_opens, 1);
        fdinfo_opens = 0;

        /* memfds: any memfd of the size, sealed or not. */
        assert_int_equal(check(f, mem, MEMFD, 4096, msg), 0);
        assert_int_equal(check(f, sealed, MEMFD, 8192, msg), 0);
        assert_int_equal(check(f, small, MEMFD, 4096, msg), -ERROR_KIND_INVALID_ARGUMENT);
        assert_non_null(strstr(msg, "only 100 bytes"));
        for (int k = 0; k < 3; k++) {
                enum region_kind kind = k == 0 ? MEMFD : k == 1 ? CUMEM : DMABUF;

                expect_refused(f, p[0], kind, "a pipe or FIFO");
                expect_refused(f, sp[0], kind, "a socket");
                expect_refused(f, dir, kind, "a directory");
                expect_refused(f, efd, kind, "anon_inode:[eventfd]");
                expect_refused(f, zero, kind, "character device 1:5");
                expect_refused(f, opath, kind, "O_PATH");
                expect_refused(f, ep, kind, "anon_inode:[eventpoll]");
                expect_refused(f, tfd, kind, "anon_inode:[timerfd]");
                if (kind != MEMFD)
                        expect_refused(f, mem, kind, "a regular file ('/memfd:unit");
        }
        /* An anonymous inode that is no dma-buf is told by its filesystem,
         * never by its fdinfo: reading an epoll fd's would wait for its
         * mutex, held by any thread of the client in epoll_ctl (one that
         * waits on its own FUSE server's answer to POLL: for ever). */
        expect_refused(f, ep, DMABUF, "of filesystem magic 0x9041934");
        assert_int_equal(fdinfo_opens, 0);
        if (shm >= 0)
                expect_refused(f, shm, MEMFD, "on a tmpfs or hugetlbfs mount");
        assert_int_equal(check(f, mem, (enum region_kind)77, 4096, msg), -ERROR_KIND_INVALID_ARGUMENT);
        assert_non_null(strstr(msg, "region kind 77 is not known"));
        assert_int_equal(check(f, mem, REGION_KIND_UNSPECIFIED, 4096, msg), -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(check(f, -1, MEMFD, 4096, msg), -ERROR_KIND_BAD_FDS);

        {
                const int all[] = { p[0], p[1], sp[0], sp[1], mem, small, sealed,
                                    dir,  efd,  zero,  opath, ep,  tfd };

                for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
                        close(all[i]);
        }
        if (shm >= 0)
                close(shm);
}

/* clientfd_fdinfo_size() on `text`: the size, or -1 when refused (the
 * reason in *why). */
static int64_t fdinfo_size(const char *text, const char **why) {
        uint64_t size = 0;

        *why = NULL;
        if (clientfd_fdinfo_size(text, strlen(text), &size, why) < 0) {
                assert_non_null(*why);
                return -1;
        }
        return (int64_t)size;
}

/* The size of a dma-buf, from the fdinfo text the kernel writes
 * (fs/proc/fd.c: pos, flags, mnt_id, ino, locks; then
 * dma_buf_show_fdinfo(): size, count, exp_name, and name when set). */
static void test_fdinfo_size(void **state) {
        static const char head[] = "pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t1057\n";
        char text[512];
        const char *why;

        (void)state;
        snprintf(text, sizeof(text), "%ssize:\t2097152\ncount:\t1\nexp_name:\tnv_dmabuf\n", head);
        assert_int_equal(fdinfo_size(text, &why), 2097152);
        /* A name the client set (DMA_BUF_SET_NAME, newlines allowed) comes
         * last: its "size:" is not the buffer's. */
        snprintf(text, sizeof(text),
                 "%ssize:\t4096\ncount:\t1\nexp_name:\tnv_dmabuf\nname:\tx\nsize:\t99999999999\n", head);
        assert_int_equal(fdinfo_size(text, &why), 4096);
        /* Locks come before the dma-buf's lines. */
        snprintf(text, sizeof(text),
                 "%slock:\t1: FLOCK  ADVISORY  WRITE 77 00:0f:1057 0 EOF\nsize:\t8192\ncount:\t2\n"
                 "exp_name:\tudmabuf\n",
                 head);
        assert_int_equal(fdinfo_size(text, &why), 8192);
        assert_int_equal(fdinfo_size("size:\t18446744073709551615\n", &why), (int64_t)UINT64_MAX);

        /* Refused: no size line (a kernel before 5.3, an fd of another
         * kind), ... */
        assert_int_equal(fdinfo_size(head, &why), -1);
        assert_non_null(strstr(why, "no size line"));
        assert_int_equal(fdinfo_size("", &why), -1);
        /* ... a size after the lines that follow the kernel's (so
         * the client's), ... */
        assert_int_equal(fdinfo_size("pos:\t0\ncount:\t1\nexp_name:\tx\nname:\ty\nsize:\t9999\n", &why), -1);
        assert_non_null(strstr(why, "before the size line"));
        assert_int_equal(fdinfo_size("pos:\t0\nname:\tx\nsize:\t9999\n", &why), -1);
        /* ... and any size line not exactly "size:\t<decimal u64>". */
        {
                static const char *const bad[] = {
                        "size:\n",
                        "size:\t\n",
                        "size: 4096\n",
                        "size:\t 4096\n",
                        "size:\t4096 \n",
                        "size:\t-4096\n",
                        "size:\t0x1000\n",
                        "size:\t4096x\n",
                        "size:\t18446744073709551616\n",
                        "size:\t000000000000000000004096\n",
                        "size:\t4096", /* cut short: the read ended inside it */
                };

                for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                        if (fdinfo_size(bad[i], &why) != -1)
                                fail_msg("'%s' was taken as a size", bad[i]);
                        if (!strstr(why, "malformed") && !strstr(why, "no size line"))
                                fail_msg("'%s': %s", bad[i], why);
                }
        }
        /* A NUL does not end the text: the length does. */
        {
                static const char nul[] = "size:\t40\0"
                                          "96\n";

                assert_int_equal(clientfd_fdinfo_size(nul, sizeof(nul) - 1, &(uint64_t){ 0 }, &why), -EINVAL);
        }
}

static void test_charges(void **state) {
        struct fixture *f = *state;
        char msg[ERRMSG_MAX];

        f->config.max_fds_per_uid = 4;
        assert_int_equal(clientfds_charge(f->cf, 1000, 3, msg), 0);
        assert_int_equal(clientfds_charge(f->cf, 1000, 2, msg), -EDQUOT);
        assert_non_null(strstr(msg, "max_fds_per_uid = 4"));
        assert_int_equal(clientfds_charge(f->cf, 1001, 4, msg), 0); /* another uid's own cap */
        assert_int_equal(clientfds_held(f->cf, 1000), 3);
        /* What the daemon already holds is owed beyond the cap. */
        clientfds_charge_held(f->cf, 1000, 5);
        assert_int_equal(clientfds_held(f->cf, 1000), 8);
        clientfds_uncharge(f->cf, 1000, 8);
        clientfds_uncharge(f->cf, 1001, 4);
        assert_int_equal(clientfds_held(f->cf, 1000), 0);
        assert_int_equal(clientfds_budget_check(f->cf, 1, msg), 0);
        assert_int_equal(clientfds_budget_check(f->cf, UINT32_MAX / 2, msg), -EMFILE);
        assert_non_null(strstr(msg, "RLIMIT_NOFILE"));
}

static void test_closes(void **state) {
        struct fixture *f = *state;
        int p[2], mem = unit_memfd(4096, NULL);
        char msg[ERRMSG_MAX];

        f->config.max_fds_per_uid = 2;
        assert_int_equal(pipe2(p, O_CLOEXEC), 0);
        /* Every close is charged until it returned, a memfd's too, and
         * pending closes count for the gate on what the uid may send. */
        clientfds_charge_held(f->cf, 1000, 3);
        clientfd_close(f->cf, 1000, mem);
        clientfd_close(f->cf, 1000, p[0]);
        clientfd_close(f->cf, 1000, p[1]);
        assert_true(clientfds_held(f->cf, 1000) <= 3);
        assert_int_equal(clientfds_settle(f->cf, 2000), 0);
        assert_int_equal(clientfds_held(f->cf, 1000), 0);
        assert_int_equal(clientfds_closing_check(f->cf, 1000, msg), 0);
        /* Closed for real. */
        assert_int_equal(fcntl(p[0], F_GETFD), -1);
        assert_int_equal(fcntl(mem, F_GETFD), -1);
        clientfd_close(f->cf, 1000, -1); /* accepted, nothing happens */
}

/* What a take handed back. */
struct take_result {
        int calls, fd, error;
        char msg[ERRMSG_MAX];
};

static void take_cb(void *ctx, int fd, int error, const char *errmsg) {
        struct take_result *res = ctx;

        res->calls++;
        res->fd = fd;
        res->error = error;
        snprintf(res->msg, sizeof(res->msg), "%s", errmsg);
}

/* Pumps the loop until `res` was handed back (at most 2 s). */
static void wait_result(struct fixture *f, struct take_result *res) {
        for (int i = 0; i < 400 && res->calls == 0; i++) {
                event_base_loop(f->base, EVLOOP_NONBLOCK);
                if (res->calls == 0)
                        usleep(5000);
        }
        assert_int_equal(res->calls, 1);
}

/* Starts a take of `number` (a memfd region of `size` bytes) from the peer
 * of `sock` as `cred` and waits until it is handed back. */
static struct take_result take_as(struct fixture *f, int sock, const struct ucred *cred, int64_t number,
                                  enum region_kind kind, uint64_t size) {
        struct take_result res = { .fd = -1 };
        char msg[ERRMSG_MAX];

        assert_int_equal(clientfd_take(f->cf, sock, cred, number, kind, size, take_cb, &res, msg), 0);
        wait_result(f, &res);
        return res;
}

static struct take_result take(struct fixture *f, int sock, const struct ucred *cred, int64_t number) {
        return take_as(f, sock, cred, number, MEMFD, 4096);
}

/* Checks an attached fd (charged to uid 1000 as a receiver would) with
 * clientfd_check_async() and waits for the result. */
static struct take_result check_async(struct fixture *f, int fd, enum region_kind kind, uint64_t size) {
        struct take_result res = { .fd = -1 };
        char msg[ERRMSG_MAX];

        clientfds_charge_held(f->cf, 1000, 1);
        assert_int_equal(clientfd_check_async(f->cf, 1000, fd, kind, size, take_cb, &res, msg), 0);
        wait_result(f, &res);
        return res;
}

/* Attached fds are checked on a closer, never on the loop's thread: an fd
 * of the kind comes back, charged; any other is refused, named, and closed
 * (its charge returned). */
static void test_check_async(void **state) {
        struct fixture *f = *state;
        int mem = unit_memfd(4096, NULL), ep = epoll_create1(EPOLL_CLOEXEC), p[2];
        struct take_result res;
        struct stat st;

        assert_true(mem >= 0 && ep >= 0 && pipe2(p, O_CLOEXEC) == 0);
        statx_on_loop = statx_off_loop = 0;
        fdinfo_opens = 0;
        res = check_async(f, mem, MEMFD, 4096);
        assert_int_equal(res.error, 0);
        assert_int_equal(res.fd, mem);
        assert_int_equal(clientfds_held(f->cf, 1000), 1);
        assert_int_equal(statx_on_loop, 0);
        assert_true(statx_off_loop > 0);
        clientfd_close(f->cf, 1000, res.fd);
        statx_on_loop = 0; /* that close looked at the memfd's size on the loop (close_is_cheap) */

        res = check_async(f, ep, DMABUF, 4096);
        assert_int_equal(res.error, -ERROR_KIND_BAD_FDS);
        assert_int_equal(res.fd, -1);
        assert_non_null(
                strstr(res.msg, "dma-buf region: the fd is an anonymous inode ('anon_inode:[eventpoll]')"));
        assert_int_equal(statx_on_loop, 0);
        assert_int_equal(fdinfo_opens, 0);

        res = check_async(f, p[0], MEMFD, 4096);
        assert_int_equal(res.error, -ERROR_KIND_BAD_FDS);
        assert_non_null(strstr(res.msg, "memfd region: the fd is a pipe or FIFO"));
        assert_int_equal(statx_on_loop, 0);

        /* Closed, their charges returned. */
        assert_int_equal(clientfds_settle(f->cf, 2000), 0);
        assert_int_equal(clientfds_held(f->cf, 1000), 0);
        assert_int_equal(fstat(mem, &st), -1);
        assert_int_equal(fstat(ep, &st), -1);
        assert_int_equal(fstat(p[0], &st), -1);
        close(p[1]);
}

/* Closes that never return hold closers, never the kind checks of
 * attached fds: with the closers' cap lowered to 3 (CF_CLOSERS_MAX, 4096,
 * in the daemon) and 3 uids each with a close stuck, every closer is
 * taken, and another uid's RegionRegister check is still answered, at
 * once. */
static void test_checks_beside_stuck_closes(void **state) {
        struct fixture *f = *state;
        static struct take_result res; /* a check left queued outlives the test when it fails */
        int mem = unit_memfd(4096, NULL);

        f->cf->closers.max = 3;
        stuck_hold();
        for (uid_t uid = 2000; uid < 2003; uid++) {
                clientfds_charge_held(f->cf, uid, 1);
                clientfd_close(f->cf, uid, STUCK_FD + (int)uid);
        }
        assert_int_equal(stuck_wait(3), 3);

        res = (struct take_result){ .fd = -1 };
        clientfds_charge_held(f->cf, 1000, 1);
        assert_int_equal(clientfd_check_async(f->cf, 1000, mem, MEMFD, 4096, take_cb, &res, res.msg), 0);
        wait_result(f, &res);
        assert_int_equal(res.error, 0);
        assert_int_equal(res.fd, mem);
        /* The closes are still stuck: they hold their charges. */
        assert_int_equal(stuck_wait(3), 3);
        assert_int_equal(clientfds_held(f->cf, 2000), 1);
        clientfd_close(f->cf, 1000, res.fd);

        stuck_release();
        assert_int_equal(clientfds_settle(f->cf, 2000), 0);
        for (uid_t uid = 2000; uid < 2003; uid++)
                assert_int_equal(clientfds_held(f->cf, uid), 0);
}

/* A run (clientfd_run()) of the tests: `run` waits while the gate is
 * closed (at most STUCK_MAX_MS), noting whether it ran on the loop's
 * thread; `done` counts on which thread it was called. */
struct run {
        bool ran, on_loop;
        int done, done_on_loop;
};
static void run_fn(void *ctx) {
        struct run *r = ctx;
        struct timespec until;

        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += STUCK_MAX_MS / 1000;
        pthread_mutex_lock(&stuck_lock);
        r->on_loop = pthread_equal(pthread_self(), loop_thread);
        r->ran = true;
        stuck_now++;
        pthread_cond_broadcast(&stuck_cond);
        while (gate_closed && pthread_cond_timedwait(&stuck_cond, &stuck_lock, &until) == 0)
                ;
        stuck_now--;
        pthread_mutex_unlock(&stuck_lock);
}

static void run_done(void *ctx) {
        struct run *r = ctx;

        r->done++;
        r->done_on_loop += pthread_equal(pthread_self(), loop_thread);
}

/* Pumps the loop until `*n` reaches `want` (at most 2 s). */
static void wait_count(struct fixture *f, const int *n, int want) {
        for (int i = 0; i < 400 && *n < want; i++) {
                event_base_loop(f->base, EVLOOP_NONBLOCK);
                if (*n < want)
                        usleep(5000);
        }
        assert_int_equal(*n, want);
}

/* Runs happen on a checker and end on the loop; checkers are a pool of
 * their own, so that work that holds every one of them (lowered to 2
 * here) holds up no close: another uid's close returns, its charge with
 * it. */
static void test_runs(void **state) {
        struct fixture *f = *state;
        static struct run held[2], one;
        char msg[ERRMSG_MAX], c;
        int p[2];

        assert_int_equal(clientfd_run(f->cf, 1000, run_fn, run_done, &one, msg), 0);
        wait_count(f, &one.done, 1);
        assert_true(one.ran && !one.on_loop);
        assert_int_equal(one.done_on_loop, 1);

        f->cf->checkers.max = 2;
        gate(true);
        for (int i = 0; i < 2; i++) {
                held[i] = (struct run){ 0 };
                assert_int_equal(clientfd_run(f->cf, 3000 + i, run_fn, run_done, &held[i], msg), 0);
        }
        assert_int_equal(stuck_wait(2), 2);
        assert_int_equal(pipe2(p, O_CLOEXEC), 0);
        clientfds_charge_held(f->cf, 1000, 1);
        clientfd_close(f->cf, 1000, p[1]);
        for (int i = 0; i < 400 && clientfds_held(f->cf, 1000) > 0; i++) {
                event_base_loop(f->base, EVLOOP_NONBLOCK);
                usleep(5000);
        }
        assert_int_equal(clientfds_held(f->cf, 1000), 0);
        assert_int_equal(read(p[0], &c, 1), 0); /* closed for real */
        close(p[0]);
        assert_int_equal(held[0].done + held[1].done, 0);
        gate(false);
        wait_count(f, &held[0].done, 1);
        wait_count(f, &held[1].done, 1);
}

/* A uid's queue of checks and runs is bounded (CF_CHECKS_QUEUED_MAX,
 * lowered to 2 here): past it, a check or a run is refused with
 * ERROR_LIMIT_EXCEEDED naming the uid and the cap, the fd still the
 * caller's; another uid is served meanwhile, and what was queued is done. */
static void test_checks_queue_full(void **state) {
        struct fixture *f = *state;
        static struct run runs[4];
        static struct take_result res, other;
        int mem = unit_memfd(4096, NULL), mem2 = unit_memfd(4096, NULL);
        char msg[ERRMSG_MAX];

        f->cf->checkers.queued_max = 2;
        gate(true);
        memset(runs, 0, sizeof(runs));
        assert_int_equal(clientfd_run(f->cf, 1000, run_fn, run_done, &runs[0], msg), 0);
        assert_int_equal(stuck_wait(1), 1); /* running: no longer waiting */
        assert_int_equal(clientfd_run(f->cf, 1000, run_fn, run_done, &runs[1], msg), 0);
        assert_int_equal(clientfd_run(f->cf, 1000, run_fn, run_done, &runs[2], msg), 0);
        msg[0] = '\0';
        assert_int_equal(clientfd_run(f->cf, 1000, run_fn, run_done, &runs[3], msg),
                         -ERROR_KIND_LIMIT_EXCEEDED);
        assert_non_null(strstr(msg, "uid 1000 has 2 region checks and registrations waiting in its queue "
                                    "(at most 2)"));
        clientfds_charge_held(f->cf, 1000, 1);
        res = (struct take_result){ .fd = -1 };
        assert_int_equal(clientfd_check_async(f->cf, 1000, mem, MEMFD, 4096, take_cb, &res, msg),
                         -ERROR_KIND_LIMIT_EXCEEDED);
        assert_non_null(strstr(msg, "memfd region: uid 1000 has 2 region checks"));
        assert_int_equal(fcntl(mem, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC); /* still ours */

        /* Another uid's check is answered meanwhile. */
        other = (struct take_result){ .fd = -1 };
        clientfds_charge_held(f->cf, 1001, 1);
        assert_int_equal(clientfd_check_async(f->cf, 1001, mem2, MEMFD, 4096, take_cb, &other, msg), 0);
        wait_result(f, &other);
        assert_int_equal(other.error, 0);
        clientfd_close(f->cf, 1001, other.fd);

        gate(false);
        for (int i = 0; i < 3; i++)
                wait_count(f, &runs[i].done, 1);
        assert_int_equal(runs[3].done, 0);
        assert_false(runs[3].ran);
        /* Room again: the check is taken. */
        assert_int_equal(clientfd_check_async(f->cf, 1000, mem, MEMFD, 4096, take_cb, &res, msg), 0);
        wait_result(f, &res);
        assert_int_equal(res.error, 0);
        clientfd_close(f->cf, 1000, res.fd);
}

/* Takes (clientfd_take()) from this very process: the peer of a
 * socketpair is the process that made it. */
static void test_takes(void **state) {
        struct fixture *f = *state;
        struct ucred me = { .pid = getpid(), .uid = getuid(), .gid = getgid() };
        struct ucred changed = me;
        struct take_result res;
        struct stat a, b;
        char msg[ERRMSG_MAX];
        int sp[2], mem = unit_memfd(4096, "taken"), closed;

        assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp), 0);
        /* Not a descriptor number: refused before anything, nothing charged. */
        assert_int_equal(clientfd_take(f->cf, sp[0], &me, -1, MEMFD, 4096, take_cb, NULL, msg),
                         -ERROR_KIND_INVALID_ARGUMENT);
        assert_non_null(strstr(msg, "fd number -1 is outside 0..2147483647"));
        assert_int_equal(
                clientfd_take(f->cf, sp[0], &me, (int64_t)INT32_MAX + 1, MEMFD, 4096, take_cb, NULL, msg),
                -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(clientfds_held(f->cf, me.uid), 0);

        /* The memfd itself, charged while the daemon holds it, and of the
         * kind it is. */
        res = take(f, sp[0], &me, mem);
        assert_int_equal(res.error, 0);
        assert_true(res.fd >= 0 && res.fd != mem);
        assert_int_equal(fstat(mem, &a), 0);
        assert_int_equal(fstat(res.fd, &b), 0);
        assert_true(a.st_dev == b.st_dev && a.st_ino == b.st_ino);
        assert_true(fcntl(res.fd, F_GETFD) & FD_CLOEXEC);
        assert_int_equal(clientfd_check(f->cf, res.fd, MEMFD, 4096, msg), 0);
        assert_int_equal(clientfds_held(f->cf, me.uid), 1);
        clientfd_close(f->cf, me.uid, res.fd);
        assert_int_equal(clientfds_settle(f->cf, 2000), 0);
        assert_int_equal(clientfds_held(f->cf, me.uid), 0);

        /* Taken, but not of the kind asked, or smaller than asked: named
         * by number and refused, and the fd's charge returned once the
         * daemon's copy was closed. */
        {
                int p[2];

                assert_int_equal(pipe2(p, O_CLOEXEC), 0);
                res = take(f, sp[0], &me, p[0]);
                assert_int_equal(res.error, -ERROR_KIND_BAD_FDS);
                assert_int_equal(res.fd, -1);
                snprintf(msg, sizeof(msg), "fd %d of pid %d: memfd region: the fd is a pipe", p[0],
                         (int)me.pid);
                if (!strstr(res.msg, msg))
                        fail_msg("'%s' does not say '%s'", res.msg, msg);
                res = take_as(f, sp[0], &me, mem, MEMFD, 8192);
                assert_int_equal(res.error, -ERROR_KIND_INVALID_ARGUMENT);
                assert_non_null(strstr(res.msg, "the fd has only 4096 bytes"));
                res = take_as(f, sp[0], &me, mem, DMABUF, 4096);
                assert_int_equal(res.error, -ERROR_KIND_BAD_FDS);
                assert_non_null(strstr(res.msg, "dma-buf region"));
                assert_int_equal(clientfds_settle(f->cf, 2000), 0);
                assert_int_equal(clientfds_held(f->cf, me.uid), 0);
                close(p[0]);
                close(p[1]);
        }

        /* Nothing open at the number: named, and the charge returned. */
        /* (A high number: a low free one would be the pidfd the take
         * opens in this same process.) */
        closed = 900;
        assert_int_equal(fcntl(closed, F_GETFD), -1);
        res = take(f, sp[0], &me, closed);
        assert_int_equal(res.error, -ERROR_KIND_BAD_FDS);
        assert_int_equal(res.fd, -1);
        assert_non_null(strstr(res.msg, "no such open descriptor"));
        assert_int_equal(clientfds_held(f->cf, me.uid), 0);

        /* The process no longer has the ids it connected with (a set-id
         * program it exec'd): nothing is kept. */
        changed.uid = me.uid + 1;
        res = take(f, sp[0], &changed, mem);
        assert_int_equal(res.error, -ERROR_KIND_PERMISSION_DENIED);
        assert_int_equal(res.fd, -1);
        assert_non_null(strstr(res.msg, "are no longer the uid"));
        assert_int_equal(clientfds_settle(f->cf, 2000), 0);
        assert_int_equal(clientfds_held(f->cf, changed.uid), 0);

        /* The uid's cap counts the fd to come. */
        f->config.max_fds_per_uid = 1;
        clientfds_charge_held(f->cf, me.uid, 1);
        assert_int_equal(clientfd_take(f->cf, sp[0], &me, mem, MEMFD, 4096, take_cb, NULL, msg), -EDQUOT);
        clientfds_uncharge(f->cf, me.uid, 1);
        close(sp[0]);
        close(sp[1]);
        close(mem);
}

/* ------------------------------------------------------------ a client of another uid */

#define PEER_UID 65534

/* A client process of uid PEER_UID that this test (root) starts: it made
 * a session socket (a socketpair: SO_PEERPIDFD of either end names it) and
 * a 4096-byte memfd, and changes itself on command. */
struct peer {
        pid_t pid;
        int ctl;    /* commands: 'd' not dumpable, 'D' dumpable, 'c' no capabilities */
        int sock;   /* the session socket */
        int number; /* the memfd's number in the peer */
};

static void peer_main(int ctl, bool keep_caps) {
        union {
                char buf[CMSG_SPACE(sizeof(int))];
                struct cmsghdr align;
        } control = { 0 };
        struct __user_cap_header_struct head = { .version = _LINUX_CAPABILITY_VERSION_3 };
        struct __user_cap_data_struct none[2] = { 0 };
        int sp[2], mem;
        struct iovec iov = { .iov_base = &mem, .iov_len = sizeof(mem) };
        struct msghdr mh = { .msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = control.buf,
                             .msg_controllen = sizeof(control.buf) };
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        char cmd;

        /* With PR_SET_KEEPCAPS the permitted set outlives the uid change
         * (as a file-capability program's would); the change leaves the
         * process not dumpable, which it undoes. */
        if ((keep_caps && prctl(PR_SET_KEEPCAPS, 1) < 0) || setgroups(0, NULL) < 0 ||
            setresgid(PEER_UID, PEER_UID, PEER_UID) < 0 || setresuid(PEER_UID, PEER_UID, PEER_UID) < 0 ||
            prctl(PR_SET_DUMPABLE, 1) < 0)
                _exit(1);
        mem = unit_memfd(4096, "peer");
        if (mem < 0 || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) < 0)
                _exit(1);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &sp[0], sizeof(int));
        if (sendmsg(ctl, &mh, 0) != sizeof(mem))
                _exit(1);
        while (read(ctl, &cmd, 1) == 1) {
                if ((cmd == 'd' && prctl(PR_SET_DUMPABLE, 0) < 0) ||
                    (cmd == 'D' && prctl(PR_SET_DUMPABLE, 1) < 0) ||
                    (cmd == 'c' && syscall(SYS_capset, &head, none) < 0))
                        cmd = '!';
                if (write(ctl, &cmd, 1) != 1)
                        break;
        }
        _exit(0);
}

static void peer_start(struct peer *p, bool keep_caps) {
        union {
                char buf[CMSG_SPACE(sizeof(int))];
                struct cmsghdr align;
        } control;
        struct iovec iov = { .iov_base = &p->number, .iov_len = sizeof(p->number) };
        struct msghdr mh = { .msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = control.buf,
                             .msg_controllen = sizeof(control.buf) };
        int ctl[2];

        assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ctl), 0);
        p->pid = fork();
        assert_true(p->pid >= 0);
        if (p->pid == 0) {
                close(ctl[0]);
                peer_main(ctl[1], keep_caps);
        }
        close(ctl[1]);
        p->ctl = ctl[0];
        assert_int_equal(recvmsg(p->ctl, &mh, MSG_CMSG_CLOEXEC), sizeof(p->number));
        assert_non_null(CMSG_FIRSTHDR(&mh));
        memcpy(&p->sock, CMSG_DATA(CMSG_FIRSTHDR(&mh)), sizeof(int));
}

static void peer_say(struct peer *p, char cmd) {
        char back = 0;

        assert_int_equal(write(p->ctl, &cmd, 1), 1);
        assert_int_equal(read(p->ctl, &back, 1), 1);
        assert_int_equal(back, cmd);
}

static void peer_stop(struct peer *p) {
        int st = 0;

        close(p->ctl);
        close(p->sock);
        assert_int_equal(waitpid(p->pid, &st, 0), p->pid);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* A take from `p` of its memfd: kept (and closed here) or refused
 * with ERROR_PERMISSION_DENIED and a message naming the fd and `why`. */
static void peer_take(struct fixture *f, struct peer *p, const char *why) {
        struct ucred cred = { .pid = p->pid, .uid = PEER_UID, .gid = PEER_UID };
        struct take_result res = take(f, p->sock, &cred, p->number);
        char named[64];

        if (!why) {
                if (res.error != 0)
                        fail_msg("take refused: %s", res.msg);
                assert_true(res.fd >= 0);
                clientfd_close(f->cf, PEER_UID, res.fd);
                return;
        }
        assert_int_equal(res.error, -ERROR_KIND_PERMISSION_DENIED);
        assert_int_equal(res.fd, -1);
        snprintf(named, sizeof(named), "fd %d of pid %d: ", p->number, (int)p->pid);
        if (!strstr(res.msg, named) || !strstr(res.msg, why))
                fail_msg("'%s' does not say '%s' and '%s'", res.msg, named, why);
}

/* The daemon takes only what the client's uid could take itself without
 * privilege: not from a process that is not dumpable, nor from one that
 * holds capabilities (what a file-capability program is). */
static void test_take_process(void **state) {
        struct fixture *f = *state;
        struct peer p;

        if (getuid() != 0) {
                print_message("test_take_process: needs root (a client process of uid %d); skipped\n",
                              PEER_UID);
                skip();
        }
        peer_start(&p, false);
        peer_take(f, &p, NULL);
        peer_say(&p, 'd');
        peer_take(f, &p, "the process is not dumpable (/proc/");
        peer_say(&p, 'D');
        peer_take(f, &p, NULL);
        peer_stop(&p);

        peer_start(&p, true);
        peer_take(f, &p, "the process holds capabilities (CapPrm ");
        peer_say(&p, 'c');
        peer_take(f, &p, NULL);
        peer_stop(&p);

        assert_int_equal(clientfds_settle(f->cf, 2000), 0);
        assert_int_equal(clientfds_held(f->cf, PEER_UID), 0);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test_setup_teardown(test_kinds, setup, teardown),
                cmocka_unit_test(test_fdinfo_size),
                cmocka_unit_test_setup_teardown(test_charges, setup, teardown),
                cmocka_unit_test_setup_teardown(test_closes, setup, teardown),
                cmocka_unit_test_setup_teardown(test_check_async, setup, teardown),
                cmocka_unit_test_setup_teardown(test_checks_beside_stuck_closes, setup, teardown),
                cmocka_unit_test_setup_teardown(test_runs, setup, teardown),
                cmocka_unit_test_setup_teardown(test_checks_queue_full, setup, teardown),
                cmocka_unit_test_setup_teardown(test_takes, setup, teardown),
                cmocka_unit_test_setup_teardown(test_take_process, setup, teardown),
        };

        log_set_level(LOG_ERR);
        loop_thread = pthread_self();
        return cmocka_run_group_tests(tests, NULL, NULL);
}
