/* The shared side of moeep-sec-fdattack (fdattack.c): its bounds and caps,
 * the run's state, say() and CHECK(), cleanup on every exit path, a
 * connection spoken to with raw records, the well-behaved client whose
 * service time and the daemon's fds and RSS are checked against their
 * bounds, and the forked attacker that drops to ATTACK_UID. Included by
 * fdattack.c only; test code. */
#ifndef MOEEP_SEC_FDATTACK_CLIENT_H
#define MOEEP_SEC_FDATTACK_CLIENT_H

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../tmpdir.h"
#include "fuse-stub.h"
#include "isolation-proc.h"
#include "record.h"

#define ATTACK_UID 65534
#define CAP_FDS_PER_UID 48     /* max_fds_per_uid in the daemon's configuration */
#define SERVE_MS 100           /* a well-behaved request's bound */
#define HELLO_DEADLINE_MS 5000 /* session.c's SESSION_HELLO_DEADLINE_MS */
#define IDLE_CONNECTIONS 70
/* malloc may keep a few pages of what it freed; ASan's quarantine keeps
 * every freed block for a while, so its builds get more room (leaks are
 * caught there instead by LeakSanitizer when the daemon exits). */
#if defined(__SANITIZE_ADDRESS__)
#define RSS_SLACK_KIB 16384
#else
#define RSS_SLACK_KIB 2048
#endif
#define TOTAL_TIMEOUT_S 280

static char tmpdir[64];
static char sock_path[sizeof(tmpdir) + 32], conf_path[sizeof(tmpdir) + 32], log_path[sizeof(tmpdir) + 32];
static char fuse_dir[sizeof(tmpdir) + 32], reg_path[sizeof(tmpdir) + 32];
static bool have_tmpdir;
static pid_t daemon_pid = -1;
static const char *moeepctl;
static int failures;
static int fds_base;
static long rss_base;

#define CHECK(cond, ...)                                            \
        do {                                                        \
                if (!(cond)) {                                      \
                        printf("FAIL %s:%d: ", __FILE__, __LINE__); \
                        printf(__VA_ARGS__);                        \
                        putchar('\n');                              \
                        failures++;                                 \
                }                                                   \
        } while (0)

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        vprintf(fmt, ap);
        va_end(ap);
        putchar('\n');
}

static long now_ms(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void cleanup(void) {
        if (daemon_pid > 0) {
                kill(daemon_pid, SIGKILL);
                waitpid(daemon_pid, NULL, 0);
                daemon_pid = -1;
        }
        fuse_stub_stop();
        if (have_tmpdir) {
                char cmd[2 * sizeof(tmpdir) + 32];

                /* With the admin socket's directory (proto/admin-socket.h). */
                snprintf(cmd, sizeof(cmd), "rm -rf '%s' '%s-admin'", tmpdir, tmpdir);
                (void)!system(cmd);
                have_tmpdir = false;
        }
}

static void on_alarm(int sig) {
        static const char msg[] = "fdattack: timed out\n";

        (void)!write(STDOUT_FILENO, msg, sizeof(msg) - 1);
        if (daemon_pid > 0)
                kill(daemon_pid, SIGKILL);
        _exit(1);
}

/* ------------------------------------------------------------ records */

struct conn {
        int fd;
        uint64_t rid;
        int send_error; /* of the last conn_call(): 0 or -errno (-EPERM: fds before Welcome) */
        struct moeep_record rec;
};

static struct conn *conn_open(void) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        struct timeval tv = { .tv_sec = 5 };
        struct conn *c = calloc(1, sizeof(*c));

        if (!c)
                return NULL;
        c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock_path);
        if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                if (c->fd >= 0)
                        close(c->fd);
                free(c);
                return NULL;
        }
        setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        return c;
}

static void conn_close(struct conn *c) {
        if (!c)
                return;
        moeep_record_release(&c->rec);
        close(c->fd);
        free(c);
}

/* The next Response (events skipped), or NULL once the daemon closed. */
static Moeep__V1__Response *conn_response(struct conn *c) {
        for (int i = 0; i < 16; i++) {
                moeep_record_release(&c->rec);
                if (moeep_record_recv(c->fd, &c->rec, NULL) < 0)
                        return NULL;
                if (c->rec.hdr.type < MOEEP_TYPE_EVENT_MIN)
                        return moeep_record_decode_response(&c->rec);
        }
        return NULL;
}

/* Set by attackers whose fds block their last close: the fds are closed
 * right after sending, while the daemon still holds them, so that the
 * daemon's close is the last one. */
static bool give_fds;

static Moeep__V1__Response *conn_call(struct conn *c, Moeep__V1__Request *req, const int *fds, size_t nfds) {
        int r = moeep_record_send(c->fd, (uint16_t)req->body_case, ++c->rid, &req->base, fds, nfds);

        c->send_error = r;
        if (give_fds)
                for (size_t i = 0; i < nfds; i++) {
                        /* Not sent (the socket takes no fds before Welcome):
                         * our close is the last; a socket of ours resets
                         * rather than lingers. */
                        if (r < 0)
                                setsockopt(fds[i], SOL_SOCKET, SO_LINGER,
                                           &(struct linger){ .l_onoff = 1, .l_linger = 0 },
                                           sizeof(struct linger));
                        close(fds[i]);
                }
        /* A daemon that turned the connection away may have said why
         * before closing it (as libmoeep, read that). */
        if (r < 0 && r != -EPIPE && r != -ECONNRESET)
                return NULL;
        return conn_response(c);
}

/* Error code of `resp` (0 when not an Error, -1 for none); copies its
 * message into `msg`; frees it. */
static int code_of(Moeep__V1__Response *resp, char *msg, size_t size) {
        int code;

        if (msg)
                msg[0] = '\0';
        if (!resp)
                return -1;
        code = 0;
        if (resp->body_case == MOEEP__V1__RESPONSE__BODY_ERROR) {
                code = (int)resp->error->code;
                if (msg)
                        snprintf(msg, size, "%s", resp->error->message ? resp->error->message : "");
        }
        moeep__v1__response__free_unpacked(resp, NULL);
        return code;
}

static int hello_with(struct conn *c, const int *fds, size_t nfds, char *msg, size_t size) {
        Moeep__V1__Hello h = MOEEP__V1__HELLO__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;

        h.major = MOEEP_PROTOCOL_MAJOR;
        h.client_name = "fdattack";
        req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
        req.hello = &h;
        resp = conn_call(c, &req, fds, nfds);
        if (resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_WELCOME) {
                moeep__v1__response__free_unpacked(resp, NULL);
                return 0;
        }
        if (!resp && c->send_error == -EPERM) {
                if (msg)
                        snprintf(msg, size, "the kernel refused the send: no fds before Welcome");
                return -EPERM;
        }
        return code_of(resp, msg, size) ?: -1;
}

/* Whether a Hello carrying fds was refused: by the kernel, where the
 * client socket takes no fds before Welcome (SO_PASSRIGHTS, Linux 6.16+),
 * or else by the daemon (ERROR_BAD_FDS). */
static inline bool hello_fds_refused(int code) {
        return code == -EPERM || code == MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS;
}

/* After the Hello: a job of one rank of its own, named `name`. Returns 0
 * or -1. */
static int create_and_join(struct conn *c, const char *name) {
        Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
        Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        uint8_t uid[256];
        size_t len;
        int ok;

        jc.name = (char *)name;
        jc.world_size = 1;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
        req.job_create = &jc;
        resp = conn_call(c, &req, NULL, 0);
        if (!resp || resp->body_case != MOEEP__V1__RESPONSE__BODY_JOB_CREATED ||
            resp->job_created->unique_id.len > sizeof(uid)) {
                code_of(resp, NULL, 0);
                return -1;
        }
        len = resp->job_created->unique_id.len;
        memcpy(uid, resp->job_created->unique_id.data, len);
        moeep__v1__response__free_unpacked(resp, NULL);
        jj.unique_id.data = uid;
        jj.unique_id.len = len;
        jj.rank = 0;
        jj.world_size = 1;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
        req.job_join = &jj;
        resp = conn_call(c, &req, NULL, 0);
        ok = resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_JOB_JOINED;
        code_of(resp, NULL, 0);
        return ok ? 0 : -1;
}

/* Hello, then a job of one rank of its own. Returns 0 or -1. */
static int enter_job(struct conn *c) {
        return hello_with(c, NULL, 0, NULL, 0) == 0 ? create_and_join(c, "fdattack") : -1;
}

/* RegionRegister: 0 with *ret_id, the error code with `msg`, or -1. */
static int region_register(struct conn *c, Moeep__V1__RegionKind kind, uint64_t size, int fd,
                           uint64_t *ret_id, char *msg, size_t msize) {
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;

        rr.kind = kind;
        rr.size = size;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        resp = conn_call(c, &req, &fd, 1);
        if (resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED) {
                if (ret_id)
                        *ret_id = resp->region_registered->region_id;
                moeep__v1__response__free_unpacked(resp, NULL);
                return 0;
        }
        return code_of(resp, msg, msize);
}

static int region_release(struct conn *c, uint64_t id) {
        Moeep__V1__RegionRelease rl = MOEEP__V1__REGION_RELEASE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        rl.region_id = id;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_RELEASE;
        req.region_release = &rl;
        return code_of(conn_call(c, &req, NULL, 0), NULL, 0);
}

static int memfd_of(size_t size) {
        int fd = memfd_create("fdattack", MFD_CLOEXEC | MFD_ALLOW_SEALING);

        if (fd >= 0 && ftruncate(fd, (off_t)size) < 0) {
                close(fd);
                return -1;
        }
        return fd;
}

/* ------------------------------------------------------------ the well-behaved client */

/* One full flow as root: Hello, job, region, fetch-free release, leave.
 * Returns the slowest request's round trip in ms, or -1 when one failed. */
static long served_ms(void) {
        struct conn *c;
        uint64_t id = 0;
        long t0, worst = 0, t;
        int fd, ok = 1;

        t0 = now_ms();
        c = conn_open();
        if (!c)
                return -1;
        ok = hello_with(c, NULL, 0, NULL, 0) == 0;
        t = now_ms() - t0;
        worst = t > worst ? t : worst;
        /* enter_job repeats Hello: fine on a fresh connection only, so use a
         * second one for the job flow. */
        conn_close(c);
        t0 = now_ms();
        c = conn_open();
        ok = ok && c && enter_job(c) == 0;
        t = (now_ms() - t0) / 4; /* four requests */
        worst = t > worst ? t : worst;
        fd = memfd_of(4096);
        t0 = now_ms();
        ok = ok && region_register(c, MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD, 4096, fd, &id, NULL, 0) == 0;
        t = now_ms() - t0;
        worst = t > worst ? t : worst;
        close(fd);
        t0 = now_ms();
        ok = ok && region_release(c, id) == 0;
        t = now_ms() - t0;
        worst = t > worst ? t : worst;
        conn_close(c);
        return ok ? worst : -1;
}

/* Checks that a well-behaved client is served within SERVE_MS, `rounds`
 * times, 20 ms apart. */
static void check_served(const char *when, int rounds) {
        long worst = 0;

        for (int i = 0; i < rounds; i++) {
                long t = served_ms();

                CHECK(t >= 0, "%s: the well-behaved client was not served", when);
                if (t < 0)
                        return;
                worst = t > worst ? t : worst;
                sleep_ms(20);
        }
        CHECK(worst <= SERVE_MS, "%s: the well-behaved client waited %ld ms for one request", when, worst);
}

/* moeepctl status within 2 s, exit 0. */
static void check_ctl(const char *when) {
        char cmd[512];
        long t0 = now_ms();
        int st;

        snprintf(cmd, sizeof(cmd), "timeout 2 '%s' --socket '%s' status >/dev/null 2>&1", moeepctl,
                 sock_path);
        st = system(cmd);
        CHECK(st == 0, "%s: moeepctl status failed (status %d, %ld ms)", when, st, now_ms() - t0);
}

/* The daemon's fds and RSS are back to the baseline. */
static void check_baseline_slack(const char *when, long slack_kib) {
        int n = proc_fds_settle(daemon_pid, fds_base);
        long rss = proc_rss_kib(daemon_pid);

        CHECK(n == fds_base, "%s: the daemon holds %d fds, %d at the baseline", when, n, fds_base);
        CHECK(rss >= 0 && rss <= rss_base + slack_kib, "%s: daemon RSS %ld KiB, %ld KiB at the baseline",
              when, rss, rss_base);
}

static void check_baseline(const char *when) {
        check_baseline_slack(when, RSS_SLACK_KIB);
}

/* Whether the daemon's log has a line containing `text`. */
static bool log_has(const char *text) {
        char line[1024];
        bool found = false;
        FILE *f = fopen(log_path, "r");

        if (!f)
                return false;
        while (!found && fgets(line, sizeof(line), f))
                found = strstr(line, text) != NULL;
        fclose(f);
        return found;
}

/* ------------------------------------------------------------ attackers */

/* In a child: no supplementary groups, `uid` as its uid and gid (which
 * leaves it no capabilities), and dumpable again, as a process exec'd as
 * that uid is (the kernel makes one that dropped root's ids not dumpable,
 * and moeepd takes no fd from such a process). Returns 0 or -1. */
static int drop_to_uid(uid_t uid) {
        if (setgroups(0, NULL) < 0 || setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) < 0 ||
            setresuid(uid, uid, uid) < 0 || prctl(PR_SET_DUMPABLE, 1) < 0)
                return -1;
        return 0;
}

/* Waits for the child `pid`, checking the well-behaved client meanwhile.
 * Past `timeout_ms` it is killed and "FAIL: <who>'<what>' ran past" said.
 * Returns its wait status, or -1 when it ran past. */
static int watch_child(const char *who, const char *what, pid_t pid, int timeout_ms) {
        long deadline = now_ms() + timeout_ms;
        int st = 0;

        while (now_ms() < deadline && waitpid(pid, &st, WNOHANG) == 0)
                check_served(what, 1);
        if (now_ms() >= deadline && waitpid(pid, &st, WNOHANG) == 0) {
                kill(pid, SIGKILL);
                waitpid(pid, &st, 0);
                say("FAIL: %s'%s' ran past %d ms", who, what, timeout_ms);
                return -1;
        }
        return st;
}

/* Starts `fn` in a child as `uid`, FUSE's device closed there. Returns its
 * pid, or -1. */
static pid_t spawn_as(uid_t uid, int (*fn)(void *), void *arg) {
        pid_t pid;

        fflush(stdout);
        pid = fork();
        if (pid == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                if (drop_to_uid(uid) < 0)
                        _exit(100);
                if (fuse_stub_device() >= 0) /* the FUSE server's alone */
                        close(fuse_stub_device());
                failures = 0;
                fn(arg);
                fflush(stdout);
                _exit(failures > 0 ? 1 : 0);
        }
        return pid;
}

/* Runs `fn` in a child as ATTACK_UID; while it runs the well-behaved
 * client is checked. Returns the child's failures. */
static int run_attacker(const char *what, int (*fn)(void *), void *arg, int timeout_ms) {
        pid_t pid = spawn_as(ATTACK_UID, fn, arg);
        int st;

        fuse_stub_answer_flush_from(pid); /* its own closes of FUSE files return */
        st = watch_child("attacker ", what, pid, timeout_ms);
        return st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}

/* The start both programs share (usage: PROG MOEEPD MOEEPCTL [CASE]):
 * root, the run's time bound, the private directory (removed at exit) and
 * the daemon's paths in it. Returns 0 to go on, else the exit status: 2 for
 * bad usage, 77 (skipped) when not root, 1 when the directory fails.
 * `what` says what root is needed for. */
static int sec_begin(const char *name, const char *what, int argc, char **argv) {
        if (argc < 3) {
                fprintf(stderr, "usage: %s MOEEPD MOEEPCTL [CASE]\n", argv[0]);
                return 2;
        }
        if (geteuid() != 0) {
                say("%s: needs root to %s; skipped", name, what);
                return 77;
        }
        moeepctl = argv[2];
        setvbuf(stdout, NULL, _IOLBF, 0);
        signal(SIGALRM, on_alarm);
        signal(SIGPIPE, SIG_IGN);
        alarm(TOTAL_TIMEOUT_S);
        test_tmp_path(tmpdir, sizeof(tmpdir), "moeep-sec-fd.XXXXXX");
        if (!mkdtemp(tmpdir) || chmod(tmpdir, 0755) < 0) {
                say("%s: temp dir: %s", name, strerror(errno));
                return 1;
        }
        have_tmpdir = true;
        atexit(cleanup);
        snprintf(sock_path, sizeof(sock_path), "%s/moeepd.sock", tmpdir);
        snprintf(conf_path, sizeof(conf_path), "%s/moeepd.conf", tmpdir);
        snprintf(log_path, sizeof(log_path), "%s/moeepd.log", tmpdir);
        return 0;
}

/* Waits up to 20 s for the daemon just started (daemon_pid) to answer
 * Hello on sock_path. Returns 0, or -1 when it did not (or died). */
static int sec_wait_daemon(void) {
        for (int i = 0; daemon_pid > 0 && i < 400; i++) {
                struct conn *c = conn_open();

                if (c) {
                        int ok = hello_with(c, NULL, 0, NULL, 0) == 0;

                        conn_close(c);
                        if (ok)
                                return 0;
                }
                if (waitpid(daemon_pid, NULL, WNOHANG) == daemon_pid) {
                        daemon_pid = -1;
                        return -1;
                }
                sleep_ms(50);
        }
        return -1;
}

/* One case of a security test program. */
struct sec_case {
        const char *name;
        void (*fn)(void);
};

/* Runs the cases in order (only the one named `only` when not NULL),
 * saying "ok" or "FAIL" after each; stops when the daemon died. */
static void sec_run_cases(const struct sec_case *cases, size_t n, const char *only) {
        for (size_t i = 0; i < n; i++) {
                int before = failures;

                if (only && strcmp(only, cases[i].name) != 0)
                        continue;
                cases[i].fn();
                say("%s %s", failures == before ? "ok  " : "FAIL", cases[i].name);
                if (daemon_pid > 0 && waitpid(daemon_pid, NULL, WNOHANG) == daemon_pid) {
                        say("FAIL: moeepd died");
                        daemon_pid = -1;
                        failures++;
                        break;
                }
        }
}

/* Warms the daemon up (first allocations, closer threads), then takes the
 * fd and RSS baseline the cases are checked against. */
static void sec_baseline(void) {
        for (int i = 0; i < 3; i++)
                served_ms();
        sleep_ms(200);
        fds_base = proc_count_fds(daemon_pid);
        rss_base = proc_rss_kib(daemon_pid);
        say("baseline: %d fds, %ld KiB", fds_base, rss_base);
}

/* ------------------------------------------------------------ linger */

/* A listener on loopback that never accepts or reads: a socket connected
 * to it, with data it could not send and SO_LINGER set, blocks its last
 * close() for the linger time. Closing the tarpit resets the connections,
 * and those closes return. */
static int tarpit_fd = -1;
static struct sockaddr_in tarpit_addr;

static int tarpit_open(void) {
        socklen_t len = sizeof(tarpit_addr);
        int small = 4096;

        tarpit_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        tarpit_addr.sin_family = AF_INET;
        tarpit_addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        setsockopt(tarpit_fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
        if (tarpit_fd < 0 || bind(tarpit_fd, (struct sockaddr *)&tarpit_addr, sizeof(tarpit_addr)) < 0 ||
            listen(tarpit_fd, 64) < 0 || getsockname(tarpit_fd, (struct sockaddr *)&tarpit_addr, &len) < 0)
                return -1;
        return 0;
}

/* A TCP socket to the tarpit whose close() blocks for `linger_s`, or -1.
 * It is filled until the tarpit's window is shut: sends until EAGAIN, then
 * waits up to 100 ms for room, since on a loaded machine the first EAGAIN
 * can come before the tarpit has taken what it will, and a socket whose
 * bytes all reach the tarpit closes at once. Returned only with bytes
 * still unsent (SIOCOUTQNSD). */
static int lingering_socket(int linger_s) {
        struct linger lg = { .l_onoff = 1, .l_linger = linger_s };
        char chunk[16384] = { 0 };
        int small = 4096, unsent = 0;
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

        if (fd < 0)
                return -1;
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
        if (connect(fd, (struct sockaddr *)&tarpit_addr, sizeof(tarpit_addr)) < 0)
                goto fail;
        fcntl(fd, F_SETFL, O_NONBLOCK);
        for (int i = 0; i < 10000; i++) {
                struct pollfd p = { .fd = fd, .events = POLLOUT };

                if (send(fd, chunk, sizeof(chunk), MSG_NOSIGNAL) >= 0)
                        continue;
                if (errno != EAGAIN || poll(&p, 1, 100) == 0)
                        break;
        }
        if (ioctl(fd, SIOCOUTQNSD, &unsent) < 0 || unsent <= 0)
                goto fail;
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
        return fd;
fail:
        close(fd);
        return -1;
}

#endif
