/* moeep-sec-share: no uid exhausts what moeepd shares (issue 27, items 1,
 * 2, 3, 6 and 8), against the real daemon run at RLIMIT_NOFILE 1024 on a
 * socket in a temporary directory, max_fds_per_uid 128.
 *
 * Every attacker is a forked child with a uid of its own (65534, 10001..,
 * 4294967294). While each case runs, and after, a well-behaved client
 * (root) must be served within 100 ms per request and the operator's
 * StatusGet on the admin socket within 100 ms; afterwards the daemon's
 * descriptor count and RSS must be back at their baseline. Cases:
 *
 *   fds       (item 1) a uid whose close never returns (a file of the
 *             test's FUSE filesystem: its FLUSH is not answered) sends 33
 *             records of 253 fds each, under honest and lying headers,
 *             then opens and drops 2,000 connections: the daemon holds at
 *             most its cap and one record past it, never the 8,350 of the
 *             report, and every connection it turned away is closed
 *   closers   (item 2) uids 10001..10008 and 4294967294 each with a close
 *             that never returns: another uid's registration by fd number
 *             (a take) is served, its memfd releases and 30 sessions it
 *             closes give their fds back at once
 *   unknown   (item 3) 32 sessions of uid 65534 sending 64 KiB requests of
 *             21,800 unknown fields each: refused before decoding
 *             (ERROR_BAD_RECORD), and 8 uids of 8 sessions each flooding
 *             valid requests: root's StatusGet p50 and max within 100 ms
 *   pages     (item 6) 31 uids making 16 jobs each (two fds each for the
 *             control page, charged to the uid): refused once the budget
 *             is spent (with the default caps, RLIMIT_NOFILE 1024 does not
 *             hold 31 tenants' jobs), and the reserve keeps the operator
 *             and new connections served; a new client's JobCreate is
 *             refused at once, naming the budget
 *   joins     (item 8) uid 65534 names an existing job with wrong secrets
 *             and unknown job ids: the same answer for both, past 32 at
 *             once refused unchecked, and the daemon logs it
 *
 * FUSE needs /dev/fuse and mount rights: without them fds and closers are
 * skipped, saying so.
 *
 * usage: moeep-sec-share MOEEPD MOEEPCTL [CASE]
 * Exit 0 when every case passed, 77 when not root, 1 otherwise. */
#include "fdattack-client.h"
#include "pidfd-client.h"

#define SHARE_FDS_PER_UID 128   /* max_fds_per_uid in the daemon's configuration */
#define SHARE_NOFILE 1024       /* the daemon's RLIMIT_NOFILE */
#define RECV_FDS 253            /* MOEEP_RECORD_RECV_FDS */
#define HOLD_FOREVER_MS 3600000 /* the daemon's FLUSH waits until the stub stops */

/* The floods of the unknown case free what they allocate, but ASan's
 * quarantine (256 MiB by default) keeps it for a while: RSS is checked
 * against that there (LeakSanitizer catches leaks at the daemon's exit),
 * and after it the baseline is taken again. */
#if defined(__SANITIZE_ADDRESS__)
#define UNKNOWN_RSS_SLACK_KIB (512 * 1024)
#else
#define UNKNOWN_RSS_SLACK_KIB RSS_SLACK_KIB
#endif

static char admin_path[sizeof(tmpdir) + 40];
static bool have_fuse;

/* ------------------------------------------------------------ helpers */

/* StatusGet on the admin socket: round trip in ms, or -1; the jobs it
 * counts in *ret_jobs when not NULL. */
static long operator_status(uint32_t *ret_jobs) {
        Moeep__V1__StatusGet sg = MOEEP__V1__STATUS_GET__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        char saved[sizeof(sock_path)];
        Moeep__V1__Response *resp;
        struct conn *c;
        long t0 = now_ms(), t;
        int code;

        memcpy(saved, sock_path, sizeof(saved));
        snprintf(sock_path, sizeof(sock_path), "%.*s", (int)sizeof(sock_path) - 1, admin_path);
        c = conn_open();
        memcpy(sock_path, saved, sizeof(sock_path));
        if (!c || hello_with(c, NULL, 0, NULL, 0) != 0) {
                conn_close(c);
                return -1;
        }
        req.body_case = MOEEP__V1__REQUEST__BODY_STATUS_GET;
        req.status_get = &sg;
        t0 = now_ms();
        resp = conn_call(c, &req, NULL, 0);
        t = now_ms() - t0;
        if (resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_STATUS && ret_jobs)
                *ret_jobs = resp->status->jobs;
        code = resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_STATUS ? 0 : -1;
        code_of(resp, NULL, 0);
        conn_close(c);
        return code == 0 ? t : -1;
}

static void check_operator(const char *when) {
        long t = operator_status(NULL);

        CHECK(t >= 0 && t <= SERVE_MS, "%s: the operator's StatusGet took %ld ms (-1: failed)", when, t);
}

/* Waits for every child in `pids`, the well-behaved client and the
 * operator checked meanwhile. Returns the failures. */
static int watch_all(const char *what, pid_t *pids, int n, int timeout_ms) {
        long deadline = now_ms() + timeout_ms;
        int bad = 0, left = n;

        while (left > 0 && now_ms() < deadline) {
                check_served(what, 1);
                check_operator(what);
                for (int i = 0; i < n; i++) {
                        int st;

                        if (pids[i] <= 0 || waitpid(pids[i], &st, WNOHANG) != pids[i])
                                continue;
                        bad += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
                        pids[i] = -1;
                        left--;
                }
        }
        for (int i = 0; i < n; i++)
                if (pids[i] > 0) {
                        kill(pids[i], SIGKILL);
                        waitpid(pids[i], NULL, 0);
                        say("FAIL: %s: attacker %d ran past %d ms", what, i, timeout_ms);
                        bad++;
                }
        return bad;
}

/* A file of the test's FUSE filesystem, opened, or -1. */
static int fuse_file(void) {
        char path[sizeof(fuse_dir) + 8];

        snprintf(path, sizeof(path), "%s/f", fuse_dir);
        return open(path, O_RDWR | O_CLOEXEC);
}

/* Hello, a job, and a FUSE file as a region: refused, and the daemon's
 * close of it never returns. Returns the connection, or NULL. */
static struct conn *stick(void) {
        struct conn *c = conn_open();
        int fd = fuse_file(), code;
        char msg[512];

        CHECK(c && fd >= 0 && enter_job(c) == 0, "stick: a job and a FUSE file");
        if (!c || fd < 0)
                return c;
        code = region_register(c, MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD, 4096, fd, NULL, msg,
                               sizeof(msg));
        CHECK(code == MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, "stick: the FUSE file: code %d (%s)", code, msg);
        close(fd);
        return c;
}

/* sendmsg() of `len` bytes with `n` fds (more than moeep_record_send_raw()
 * takes). Returns 0 or -errno. */
static int send_many(int sock, const void *buf, size_t len, const int *fds, size_t n) {
        union {
                char buf[CMSG_SPACE(sizeof(int) * RECV_FDS)];
                struct cmsghdr align;
        } control = { 0 };
        struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
        struct msghdr mh = { .msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = control.buf,
                             .msg_controllen = CMSG_SPACE(sizeof(int) * n) };
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);

        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * n);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * n);
        return sendmsg(sock, &mh, MSG_NOSIGNAL) == (ssize_t)len ? 0 : -errno;
}

/* Sends RegionRegister with `n` fds, the header saying `say_n`. Returns
 * the answer's code (-1: none, the session ended). */
static int send_fds(struct conn *c, const int *fds, size_t n, size_t say_n) {
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        uint8_t buf[MOEEP_RECORD_MAX];
        int len;

        rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        rr.size = 4096;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        len = moeep_record_encode(buf, (uint16_t)req.body_case, ++c->rid, &req.base, say_n > 64 ? 64 : say_n);
        if (len < 0)
                return -1;
        ((struct moeep_record_header *)buf)->nfds = (uint16_t)say_n;
        if (send_many(c->fd, buf, (size_t)len, fds, n) < 0)
                return -1;
        return code_of(conn_response(c), NULL, 0);
}

/* ------------------------------------------------------------ fds */

static int attack_fds(void *arg) {
        int fds[RECV_FDS], most = 0, refused = 0, sent = 0;
        struct conn *c = stick();

        for (int i = 0; i < RECV_FDS; i++)
                fds[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
        /* 33 records of 253 fds, the headers saying 253 or (lying) 1: at
         * most one fits past the cap; the others are dropped unread. */
        for (int i = 0; i < 33; i++) {
                int code;

                if (!c || c->fd < 0) {
                        conn_close(c);
                        c = conn_open();
                        if (!c || hello_with(c, NULL, 0, NULL, 0) != 0)
                                continue;
                }
                code = send_fds(c, fds, RECV_FDS, i % 2 ? 1 : RECV_FDS);
                sent++;
                refused += code == MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS ||
                           code == MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED || code == -1;
                if (code != MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED) { /* the session ended */
                        conn_close(c);
                        c = NULL;
                }
        }
        CHECK(refused == sent, "fds: %d of %d records of 253 fds refused", refused, sent);
        conn_close(c);
        /* 2,000 connections opened and dropped: each refused or taken, and
         * closed again, whatever this uid's closes do. */
        for (int i = 0; i < 2000; i++) {
                struct conn *k = conn_open();

                most += k != NULL;
                conn_close(k);
        }
        CHECK(most > 0, "fds: no connection got through");
        for (int i = 0; i < RECV_FDS; i++)
                close(fds[i]);
        return 0;
}

static void case_fds(void) {
        pid_t pid;
        int max = 0, n;

        if (!have_fuse) {
                say("fds: no FUSE here: skipped (the closes that never return need it)");
                return;
        }
        fuse_stub_hold_flushes(daemon_pid, HOLD_FOREVER_MS);
        pid = spawn_as(ATTACK_UID, attack_fds, NULL);
        for (long deadline = now_ms() + 60000; now_ms() < deadline;) {
                int st;

                n = proc_count_fds(daemon_pid);
                max = n > max ? n : max;
                if (waitpid(pid, &st, WNOHANG) == pid) {
                        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fds: the attacker failed (0x%x)", st);
                        pid = -1;
                        break;
                }
                check_served("fds", 1);
                check_operator("fds");
        }
        if (pid > 0) {
                kill(pid, SIGKILL);
                waitpid(pid, NULL, 0);
                CHECK(0, "fds: the attacker ran past 60 s");
        }
        /* Its cap, one record past it, its sessions, the probes. */
        CHECK(max <= fds_base + SHARE_FDS_PER_UID + RECV_FDS + 80,
              "fds: the daemon held up to %d fds (baseline %d, cap %d + %d)", max, fds_base,
              SHARE_FDS_PER_UID, RECV_FDS);
        say("fds: the daemon held at most %d fds (baseline %d) while uid %d's closes were stuck", max,
            fds_base, ATTACK_UID);
        check_ctl("fds, closes stuck");
        fuse_stub_stop(); /* the stuck closes return */
        have_fuse = fuse_stub_start(fuse_dir) == 0;
        check_served("fds, after", 5);
        check_operator("fds, after");
        check_baseline("fds");
}

/* ------------------------------------------------------------ closers */

static int attack_stick(void *arg) {
        struct conn *c = stick();

        /* Held open: the session stays while the test checks the others. */
        for (int i = 0; i < 200 && access((const char *)arg, F_OK) != 0; i++)
                sleep_ms(50);
        conn_close(c);
        return 0;
}

/* Another uid while the others are stuck: a take, memfd releases, and 30
 * sessions opened and closed, each served in time. */
static int good_uid(void *arg) {
        const uint64_t pidfd_bit = MOEEP__V1__FEATURE__FEATURE_PIDFD;
        struct conn *c = conn_open(), *more[30];
        uint64_t id = 0;
        long t0;
        int fd = memfd_of(4096);

        CHECK(c && enter_job_with(c, pidfd_bit) == 0, "closers: the other uid's job");
        if (!c)
                return 0;
        t0 = now_ms();
        CHECK(take_register(c, fd, NULL, 0, &id, NULL, 0) == 0, "closers: a take by the other uid");
        CHECK(now_ms() - t0 <= SERVE_MS, "closers: the take took %ld ms", now_ms() - t0);
        for (int i = 0; i < 20; i++) {
                uint64_t rid = 0;

                t0 = now_ms();
                CHECK(region_register(c, MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD, 4096, fd, &rid, NULL,
                                      0) == 0 &&
                              region_release(c, rid) == 0,
                      "closers: memfd register and release %d", i);
                CHECK(now_ms() - t0 <= 2 * SERVE_MS, "closers: a register and release took %ld ms",
                      now_ms() - t0);
        }
        for (int i = 0; i < 30; i++) {
                more[i] = conn_open();
                CHECK(more[i] && hello_with(more[i], NULL, 0, NULL, 0) == 0, "closers: session %d", i);
        }
        for (int i = 0; i < 30; i++)
                conn_close(more[i]);
        CHECK(region_release(c, id) == 0, "closers: releasing the taken region");
        conn_close(c);
        close(fd);
        return 0;
}

static void case_closers(void) {
        static const uid_t uids[] = { 10001, 10002, 10003, 10004, 10005, 10006, 10007, 10008, 4294967294u };
        enum {
                N = sizeof(uids) / sizeof(uids[0])
        };
        char release[sizeof(tmpdir) + 16];
        pid_t pids[N], good;
        int before, after, st;

        if (!have_fuse) {
                say("closers: no FUSE here: skipped (the closes that never return need it)");
                return;
        }
        snprintf(release, sizeof(release), "%s/release", tmpdir);
        unlink(release);
        fuse_stub_hold_flushes(daemon_pid, HOLD_FOREVER_MS);
        for (int i = 0; i < N; i++)
                pids[i] = spawn_as(uids[i], attack_stick, release);
        for (int i = 0; i < 400 && fuse_stub_stuck_flushes() < N; i++)
                sleep_ms(50);
        CHECK(fuse_stub_stuck_flushes() >= N, "closers: %d of %d closes stuck", fuse_stub_stuck_flushes(), N);
        sleep_ms(300); /* past CF_STUCK_MS */
        before = proc_count_fds(daemon_pid);
        good = spawn_as(20000, good_uid, NULL);
        failures += watch_all("closers", &good, 1, 30000);
        /* The other uid's sessions and regions are gone, at once. */
        for (int i = 0; i < 40 && (after = proc_count_fds(daemon_pid)) > before; i++)
                sleep_ms(25);
        CHECK(after <= before, "closers: the other uid's fds did not come back (%d, %d before it)", after,
              before);
        say("closers: %d uids (uid 4294967294 among them) with a close that never returns; another uid's "
            "take, "
            "memfd releases and 30 sessions served, its fds back (%d, %d before)",
            N, after, before);
        check_ctl("closers, closes stuck");
        close(open(release, O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
        for (int i = 0; i < N; i++) {
                st = 0;
                waitpid(pids[i], &st, 0);
                CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "closers: attacker uid %u failed (0x%x)",
                      (unsigned)uids[i], st);
        }
        fuse_stub_stop();
        have_fuse = fuse_stub_start(fuse_dir) == 0;
        check_served("closers, after", 5);
        check_baseline("closers");
}

/* ------------------------------------------------------------ unknown */

static int attack_unknown(void *arg) {
        static uint8_t buf[MOEEP_RECORD_MAX];
        struct moeep_record_header hdr = { .magic = MOEEP_RECORD_MAGIC,
                                           .major = MOEEP_PROTOCOL_MAJOR,
                                           .type = MOEEP__V1__REQUEST__BODY_STATUS_GET };
        size_t n = sizeof(hdr), bad = 0, sent = 0;
        long end = now_ms() + 3000;

        /* StatusGet{} then ~21,800 unknown varint fields of 3 bytes. */
        buf[n++] = (MOEEP__V1__REQUEST__BODY_STATUS_GET << 3) | 2;
        buf[n++] = 0;
        while (n + 3 <= sizeof(buf)) {
                buf[n++] = (uint8_t)((1000 << 3 & 0x7f) | 0x80);
                buf[n++] = 1000 >> 4;
                buf[n++] = 1;
        }
        hdr.length = (uint32_t)(n - sizeof(hdr));
        memcpy(buf, &hdr, sizeof(hdr));
        while (now_ms() < end) {
                struct conn *c = conn_open();
                char msg[256];
                int code;

                if (!c || hello_with(c, NULL, 0, NULL, 0) != 0) {
                        conn_close(c);
                        continue;
                }
                code = moeep_record_send_raw(c->fd, buf, n, NULL, 0) == 0
                               ? code_of(conn_response(c), msg, sizeof(msg))
                               : -1;
                sent++;
                bad += code == MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD && strstr(msg, "does not know");
                conn_close(c);
        }
        CHECK(sent > 0 && bad == sent, "unknown: %zu of %zu records refused before decoding", bad, sent);
        return 0;
}

static int attack_valid(void *arg) {
        Moeep__V1__ClientsList cl = MOEEP__V1__CLIENTS_LIST__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        struct conn *c[8];
        long end = now_ms() + 3000;

        req.body_case = MOEEP__V1__REQUEST__BODY_CLIENTS_LIST;
        req.clients_list = &cl;
        for (int i = 0; i < 8; i++) {
                c[i] = conn_open();
                CHECK(c[i] && hello_with(c[i], NULL, 0, NULL, 0) == 0, "valid: session %d", i);
        }
        while (now_ms() < end)
                for (int i = 0; i < 8; i++)
                        if (c[i])
                                code_of(conn_call(c[i], &req, NULL, 0), NULL, 0);
        for (int i = 0; i < 8; i++)
                conn_close(c[i]);
        return 0;
}

static int cmp_long(const void *a, const void *b) {
        return (int)(*(const long *)a - *(const long *)b);
}

static void case_unknown(void) {
        pid_t pids[32 + 8];
        long t[400];
        int n = 0, alive;

        for (int i = 0; i < 32; i++)
                pids[i] = spawn_as(ATTACK_UID, attack_unknown, NULL);
        for (int i = 0; i < 8; i++)
                pids[32 + i] = spawn_as(10001 + (uid_t)i, attack_valid, NULL);
        /* Root's StatusGet on the client socket, and the operator's. */
        do {
                long ms = served_ms();

                if (ms >= 0 && n < 400)
                        t[n++] = ms;
                check_operator("unknown");
                alive = 0;
                for (int i = 0; i < 40; i++)
                        alive += pids[i] > 0 && waitpid(pids[i], NULL, WNOHANG) == 0;
        } while (alive > 0);
        for (int i = 0; i < 40; i++) {
                int st = 0;

                if (pids[i] > 0 && waitpid(pids[i], &st, 0) == pids[i])
                        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "unknown: attacker %d failed (0x%x)", i,
                              st);
        }
        qsort(t, (size_t)n, sizeof(t[0]), cmp_long);
        CHECK(n > 10 && t[n / 2] <= SERVE_MS && t[n - 1] <= SERVE_MS,
              "unknown: root's requests p50 %ld ms, max %ld ms over %d rounds", n ? t[n / 2] : -1,
              n ? t[n - 1] : -1, n);
        say("unknown: root's requests p50 %ld ms, max %ld ms (%d rounds) during 32 sessions of unknown "
            "fields and "
            "8 uids of valid requests",
            n ? t[n / 2] : -1, n ? t[n - 1] : -1, n);
        check_baseline_slack("unknown", UNKNOWN_RSS_SLACK_KIB);
#if defined(__SANITIZE_ADDRESS__)
        rss_base = proc_rss_kib(daemon_pid); /* the quarantine stays filled */
#endif
}

/* ------------------------------------------------------------ pages */

static int attack_pages(void *arg) {
        struct conn *c = conn_open();
        int made = 0, refused = 0, code;
        char msg[512] = "";

        /* The others' jobs may have spent the budget already: then this
         * session is turned away at once, naming it. */
        code = c ? hello_with(c, NULL, 0, msg, sizeof(msg)) : -1;
        CHECK(code == 0 ||
                      (code == MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED && strstr(msg, "RLIMIT_NOFILE")),
              "pages: Hello: code %d (%s)", code, msg);
        if (code != 0) {
                conn_close(c);
                return 0;
        }
        for (int i = 0; c && i < 16; i++) {
                Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
                Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

                jc.name = "pages";
                jc.world_size = 1;
                req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
                req.job_create = &jc;
                code = code_of(conn_call(c, &req, NULL, 0), NULL, 0);
                made += code == 0;
                refused += code == MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED;
        }
        CHECK(made + refused == 16, "pages: %d made, %d refused of 16", made, refused);
        /* Hold them until told. */
        for (int i = 0; i < 200 && access((const char *)arg, F_OK) != 0; i++)
                sleep_ms(50);
        conn_close(c);
        return 0;
}

static void case_pages(void) {
        char release[sizeof(tmpdir) + 16];
        uint32_t jobs = 0;
        pid_t pids[31];
        int n, st;

        snprintf(release, sizeof(release), "%s/release", tmpdir);
        unlink(release);
        for (int i = 0; i < 31; i++)
                pids[i] = spawn_as(10101 + (uid_t)i, attack_pages, release);
        sleep_ms(2000);
        n = proc_count_fds(daemon_pid);
        /* The jobs made hold two fds each, within the budget: the reserve
         * (192 + 253) stays for accept() and the operator. */
        CHECK(n <= SHARE_NOFILE - 192, "pages: the daemon holds %d fds of its %d", n, SHARE_NOFILE);
        CHECK(operator_status(&jobs) >= 0 && jobs > 0 && jobs < 31 * 16,
              "pages: %" PRIu32 " jobs made of %d asked: the budget refused none", jobs, 31 * 16);
        /* The budget is spent: a new client still connects and is
         * answered at once, a job refused naming the budget. */
        {
                struct conn *c = conn_open();
                Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
                Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
                char msg[512] = "";
                long t0 = now_ms();
                int code = -1;

                jc.name = "late";
                jc.world_size = 1;
                req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
                req.job_create = &jc;
                /* Turned away at accept (a session counts in the budget
                 * too), or its JobCreate refused: either way at once. */
                code = c ? hello_with(c, NULL, 0, msg, sizeof(msg)) : -1;
                if (code == 0)
                        code = code_of(conn_call(c, &req, NULL, 0), msg, sizeof(msg));
                CHECK(code == MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED && strstr(msg, "RLIMIT_NOFILE") &&
                              now_ms() - t0 <= 2 * SERVE_MS,
                      "pages: a new client's JobCreate: code %d (%s) in %ld ms", code, msg, now_ms() - t0);
                conn_close(c);
        }
        check_operator("pages, jobs held");
        check_ctl("pages, jobs held");
        say("pages: 31 uids asked for 16 jobs each: %" PRIu32 " made, the daemon holds %d fds of its "
            "RLIMIT_NOFILE %d",
            jobs, n, SHARE_NOFILE);
        close(open(release, O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
        for (int i = 0; i < 31; i++) {
                st = 0;
                waitpid(pids[i], &st, 0);
                CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "pages: uid %d failed (0x%x)", 10101 + i, st);
        }
        check_served("pages, after", 5);
        check_baseline("pages");
}

/* ------------------------------------------------------------ joins */

static int attack_joins(void *arg) {
        const uint8_t *real = arg;
        int unknown = 0, wrong = 0, unchecked = 0;
        char first_unknown[256] = "", first_wrong[256] = "";
        struct conn *c = conn_open();

        CHECK(c && hello_with(c, NULL, 0, NULL, 0) == 0, "joins: Hello");
        for (int i = 0; c && i < 200; i++) {
                Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
                Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
                uint8_t id[41];
                char msg[256];
                int code;

                memcpy(id, real, sizeof(id));
                if (i % 2)
                        id[1] ^= 0x40; /* another job id */
                id[9 + i % 32] ^= 0x5a;
                jj.unique_id.data = id;
                jj.unique_id.len = sizeof(id);
                jj.world_size = 2;
                req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
                req.job_join = &jj;
                code = code_of(conn_call(c, &req, NULL, 0), msg, sizeof(msg));
                if (code == MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED && strstr(msg, "not checked")) {
                        unchecked++;
                        continue;
                }
                CHECK(code == MOEEP__V1__ERROR_CODE__ERROR_NO_SUCH_JOB, "joins: guess %d: code %d (%s)", i,
                      code, msg);
                if (i % 2 && !unknown++)
                        snprintf(first_unknown, sizeof(first_unknown), "%s", strchr(msg, ':') ?: msg);
                if (!(i % 2) && !wrong++)
                        snprintf(first_wrong, sizeof(first_wrong), "%s", strchr(msg, ':') ?: msg);
        }
        /* The same words for an unknown id and a wrong secret (but the id). */
        CHECK(strcmp(first_unknown, first_wrong) == 0,
              "joins: '%s' for an unknown id, '%s' for a wrong secret", first_unknown, first_wrong);
        CHECK(unchecked >= 150, "joins: only %d of 200 guesses refused unchecked", unchecked);
        say("joins: 200 guesses at once: %d answered 'no such job' alike for unknown ids and wrong secrets, "
            "%d refused unchecked",
            unknown + wrong, unchecked);
        conn_close(c);
        return 0;
}

static void case_joins(void) {
        Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        struct conn *c = conn_open();
        uint8_t id[41] = { 0 };

        CHECK(c && hello_with(c, NULL, 0, NULL, 0) == 0, "joins: root's Hello");
        jc.name = "victim";
        jc.world_size = 2;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
        req.job_create = &jc;
        resp = c ? conn_call(c, &req, NULL, 0) : NULL;
        if (resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_JOB_CREATED &&
            resp->job_created->unique_id.len >= sizeof(id))
                memcpy(id, resp->job_created->unique_id.data, sizeof(id));
        else
                CHECK(0, "joins: root's job");
        code_of(resp, NULL, 0);
        failures += run_attacker("joins", attack_joins, id, 30000);
        CHECK(log_has("uid 65534:") && log_has("job joins named no job it may join"),
              "joins: the daemon did not log the wrong joins");
        conn_close(c);
        check_baseline("joins");
}

/* ------------------------------------------------------------ main */

static int start_daemon(const char *moeepd) {
        char prlimit_arg[64];
        FILE *f = fopen(conf_path, "w");

        if (!f)
                return -1;
        fprintf(f,
                "[moeepd]\nsocket = %s\nsocket_mode = 0666\nlog_level = info\nmax_fds_per_uid = %d\n"
                "max_sessions_per_uid = 64\n",
                sock_path, SHARE_FDS_PER_UID);
        if (fclose(f) != 0)
                return -1;
        snprintf(prlimit_arg, sizeof(prlimit_arg), "--nofile=%d:%d", SHARE_NOFILE, SHARE_NOFILE);
        daemon_pid = proc_spawn_logged(
                (char *const[]){ "prlimit", prlimit_arg, "--", (char *)moeepd, "-c", conf_path, NULL },
                log_path);
        return sec_wait_daemon();
}

int main(int argc, char **argv) {
        const char *only = argc > 3 ? argv[3] : NULL;
        static const struct sec_case cases[] = { { "fds", case_fds },
                                                 { "closers", case_closers },
                                                 { "unknown", case_unknown },
                                                 { "pages", case_pages },
                                                 { "joins", case_joins } };
        int r = sec_begin("share", "run attackers under uids of their own", argc, argv);

        if (r != 0)
                return r;
        snprintf(admin_path, sizeof(admin_path), "%s-admin/moeepd.sock", tmpdir);
        snprintf(fuse_dir, sizeof(fuse_dir), "%s/fuse", tmpdir);
        have_fuse = fuse_stub_start(fuse_dir) == 0;
        if (start_daemon(argv[1]) < 0) {
                say("FAIL: moeepd did not start; its log:");
                char cmd[sizeof(log_path) + 32];

                snprintf(cmd, sizeof(cmd), "tail -n 20 '%s'", log_path);
                (void)!system(cmd);
                return 1;
        }
        sec_baseline();
        sec_run_cases(cases, sizeof(cases) / sizeof(cases[0]), only);
        (void)tarpit_open;
        (void)lingering_socket;
        (void)reg_path;
        (void)run_namespaced;
        (void)expect_refused;
        if (failures) {
                char cmd[sizeof(log_path) + 32];

                snprintf(cmd, sizeof(cmd), "tail -n 30 '%s'", log_path);
                (void)!system(cmd);
        }
        say("share: %d failures", failures);
        return failures ? 1 : 0;
}
