/* moeep-sec-fdattack: attacks on how moeepd receives, checks, keeps and
 * closes the descriptors clients send (issue 15, items 3 and 4, and the
 * Hello deadline of item 5), against the real daemon on a socket in a
 * temporary directory.
 *
 * Every attacker is a forked child that drops to uid 65534. While it runs,
 * and after, a well-behaved client (root: its own closer queue) must be
 * served within 100 ms per request, and once the attack is over the
 * daemon's descriptor count (/proc/PID/fd) and RSS must be back to their
 * baseline. Cases:
 *
 *   linger     a TCP socket with SO_LINGER and unsent data (its close
 *              blocks for the linger time) attached to Hello and as a
 *              region of each kind: refused; the daemon stays responsive
 *              while the close is stuck, and logs how long it took once
 *              the tarpit lets go
 *   fuse       a file of a FUSE server that never answers FLUSH from the
 *              daemon (skipped where FUSE cannot be mounted): on Hello, as
 *              every region kind, and 60 at once on one record; the
 *              attacker's closes stay stuck and charged to its uid, which
 *              is then refused more, while everyone else is served
 *   kinds      pipes, sockets, a connection to moeepd itself, a directory,
 *              an eventfd, /dev/zero, a regular file, an O_PATH fd, a
 *              tmpfs file and memfds as each region kind: each refused
 *              with ERROR_BAD_FDS naming the kind and what the fd is; a
 *              real memfd is accepted as a memfd
 *   fetch      RegionsFetch repeated without reading replies: the daemon's
 *              fds stay bounded by the uid's cap and moeepctl status answers
 *   hello      70 connections that never say Hello are closed by the
 *              deadline
 *
 * usage: moeep-sec-fdattack MOEEPD MOEEPCTL [CASE]
 * Exit 0 when every case passed, 77 when not root, 1 otherwise. */
#include "fdattack-client.h"

/* ------------------------------------------------------------ linger */

static const Moeep__V1__RegionKind all_kinds[] = {
        MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD,
        MOEEP__V1__REGION_KIND__REGION_KIND_CUMEM_FD,
        MOEEP__V1__REGION_KIND__REGION_KIND_DMABUF,
};
static const char *const kind_names[] = { "memfd region", "cumem-fd region", "dma-buf region" };

static int attack_linger(void *arg) {
        char msg[512];
        struct conn *c;
        int fd, code;

        give_fds = true;
        /* On Hello: the record may not carry fds. */
        fd = lingering_socket(300);
        c = conn_open();
        CHECK(fd >= 0 && c, "linger: setup");
        if (fd < 0 || !c)
                return 1;
        code = hello_with(c, &fd, 1, msg, sizeof(msg));
        CHECK(hello_fds_refused(code), "linger on Hello: code %d (%s)", code, msg);
        conn_close(c);
        /* As a region of every kind. */
        c = conn_open();
        CHECK(c && enter_job(c) == 0, "linger: job");
        for (size_t k = 0; c && k < 3; k++) {
                fd = lingering_socket(300);
                code = region_register(c, all_kinds[k], 4096, fd, NULL, msg, sizeof(msg));
                CHECK(code == MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS && strstr(msg, kind_names[k]) &&
                              strstr(msg, "a socket"),
                      "linger socket as %s: code %d (%s)", kind_names[k], code, msg);
        }
        conn_close(c);
        /* Left unread behind two records of zero bytes, which read like
         * the end of the connection: the daemon's close of the session
         * socket closes it, in this uid's queue. */
        c = conn_open();
        fd = lingering_socket(300);
        if (c && hello_with(c, NULL, 0, NULL, 0) < 0) /* before Welcome the socket takes no fds */
                CHECK(0, "linger: Hello");
        if (c && fd >= 0) {
                union {
                        char buf[CMSG_SPACE(sizeof(int))];
                        struct cmsghdr align;
                } control = { 0 };
                struct mmsghdr mm[3] = { 0 };
                struct cmsghdr *cm;
                int sent;

                mm[2].msg_hdr.msg_control = control.buf;
                mm[2].msg_hdr.msg_controllen = sizeof(control.buf);
                cm = CMSG_FIRSTHDR(&mm[2].msg_hdr);
                cm->cmsg_level = SOL_SOCKET;
                cm->cmsg_type = SCM_RIGHTS;
                cm->cmsg_len = CMSG_LEN(sizeof(int));
                memcpy(CMSG_DATA(cm), &fd, sizeof(int));
                /* In one call, so that the daemon, which ends the session
                 * at the first, most likely finds all three queued. */
                sent = sendmmsg(c->fd, mm, 3, MSG_NOSIGNAL);
                if (sent < 3) {
                        struct linger now = { .l_onoff = 1, .l_linger = 0 };

                        /* The daemon was quicker: our close of the socket
                         * would be the last; make it reset at once. */
                        setsockopt(fd, SOL_SOCKET, SO_LINGER, &now, sizeof(now));
                        say("linger: the daemon closed after %d of 3 zero-length records: that part not run",
                            sent);
                }
        }
        /* fd is not closed here: where the daemon dropped its copy first
         * (it ends the session at the first record), our close would be the
         * last and wait out the 300 s linger (CI under load once ran past
         * the attacker's 20 s that way). The attacker's exit releases it
         * without lingering: Linux never lingers for an exiting task. */
        conn_close(c);
        return 0;
}

static void case_linger(void) {
        if (tarpit_open() < 0) {
                CHECK(0, "linger: tarpit: %s", strerror(errno));
                return;
        }
        failures += run_attacker("linger", attack_linger, NULL, 20000);
        /* The closes are stuck now (300 s linger): everyone else goes on. */
        check_served("linger, closes stuck", 10);
        check_ctl("linger, closes stuck");
        sleep_ms(1200);
        close(tarpit_fd); /* resets the connections: the closes return */
        tarpit_fd = -1;
        for (int i = 0; i < 100 && !log_has("closing a descriptor it sent took"); i++)
                sleep_ms(50);
        CHECK(log_has("closing a descriptor it sent took"),
              "linger: the daemon never logged a slow close: was "
              "it really stuck?");
        check_served("linger, after", 5);
        check_baseline("linger");
}

/* ------------------------------------------------------------ fuse */

static int attack_fuse(void *arg) {
        char path[sizeof(fuse_dir) + 8], msg[512];
        int fds[60], fd, code, n = 0;
        struct conn *c;

        snprintf(path, sizeof(path), "%s/f", fuse_dir);
        fd = open(path, O_RDWR | O_CLOEXEC);
        CHECK(fd >= 0, "fuse: open %s: %s", path, strerror(errno));
        if (fd < 0)
                return 1;
        c = conn_open();
        code = c ? hello_with(c, &fd, 1, msg, sizeof(msg)) : -1;
        CHECK(hello_fds_refused(code), "FUSE fd on Hello: code %d (%s)", code, msg);
        conn_close(c);
        c = conn_open();
        CHECK(c && enter_job(c) == 0, "fuse: job");
        for (size_t k = 0; c && k < 3; k++) {
                code = region_register(c, all_kinds[k], 4096, fd, NULL, msg, sizeof(msg));
                CHECK(code == MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS && strstr(msg, kind_names[k]) &&
                              strstr(msg, "a regular file"),
                      "FUSE file as %s: code %d (%s)", kind_names[k], code, msg);
        }
        /* 60 at once on one record, which says so: more than fit under
         * max_fds_per_uid, so the daemon drops the record unread (the fds
         * released in a closer, never taken) and the session ends. */
        for (n = 0; n < 60; n++)
                fds[n] = fd;
        if (c) {
                Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
                Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
                uint8_t buf[MOEEP_RECORD_MAX];
                int len;

                rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
                rr.size = 4096;
                req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
                req.region_register = &rr;
                code = code_of(conn_call(c, &req, fds, (size_t)n), msg, sizeof(msg));
                CHECK(code == MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS && strstr(msg, "dropped unread"),
                      "60 FUSE fds on one record: code %d (%s)", code, msg);
                conn_close(c);
                /* The same, its header saying 1: it fits, so it is read,
                 * refused, and its 60 fds are ours to close: stuck, and
                 * charged to us past max_fds_per_uid. */
                c = conn_open();
                CHECK(c && hello_with(c, NULL, 0, NULL, 0) == 0, "fuse: Hello");
                len = moeep_record_encode(buf, (uint16_t)req.body_case, ++c->rid, &req.base, 1);
                CHECK(c && len > 0 && moeep_record_send_raw(c->fd, buf, (size_t)len, fds, (size_t)n) == 0,
                      "fuse: sending 60 fds under a header saying 1");
                code = c ? code_of(conn_response(c), msg, sizeof(msg)) : -1;
                CHECK(code == MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS,
                      "60 FUSE fds, the header saying 1: code %d (%s)", code, msg);
        }
        conn_close(c);
        /* Our closes are stuck past max_fds_per_uid (and for longer than
         * clientfd.c's CF_STUCK_MS): we are refused more. */
        sleep_ms(500);
        c = conn_open();
        code = c ? code_of(conn_response(c), msg, sizeof(msg)) : -1;
        CHECK(code == MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED && strstr(msg, "still being closed"),
              "connecting with %d closes stuck: code %d (%s)", n + 4, code, msg);
        conn_close(c);
        close(fd); /* FLUSH from us: answered */
        return 0;
}

static void case_fuse(void) {
        int r, n;

        snprintf(fuse_dir, sizeof(fuse_dir), "%s/fuse", tmpdir);
        r = fuse_stub_start(fuse_dir);
        if (r < 0) {
                say("fuse: cannot mount a FUSE filesystem here (%s): case skipped; the linger case covers a "
                    "close that blocks",
                    strerror(-r));
                return;
        }
        /* The daemon's FLUSH is never answered, everyone else's at once
         * (the attacker's own closes, whenever they come). */
        fuse_stub_hold_flushes(daemon_pid, 3600 * 1000);
        failures += run_attacker("fuse", attack_fuse, NULL, 30000);
        check_served("fuse, closes stuck", 10);
        check_ctl("fuse, closes stuck");
        n = proc_count_fds(daemon_pid);
        CHECK(n <= fds_base + 64 + 8, "fuse: the daemon holds %d fds while stuck, baseline %d", n, fds_base);
        CHECK(fuse_stub_stuck_flushes() >= 1, "fuse: the daemon never sent FLUSH: nothing was stuck");
        /* Aborting the connection ends the stuck closes. */
        fuse_stub_stop();
        check_served("fuse, after", 5);
        check_baseline("fuse");
}

/* ------------------------------------------------------------ kinds */

struct fd_case {
        const char *what;
        int fd;
        const char *is[3]; /* expected in the message, per kind; NULL = accepted */
};

static int attack_kinds(void *arg) {
        char msg[512], shm_path[64];
        int p[2] = { -1, -1 }, sp[2] = { -1, -1 }, shm = -1;
        struct conn *c = conn_open(), *self = conn_open();
        struct fd_case cases[12];
        size_t n = 0;
        int small;

        CHECK(c && self && enter_job(c) == 0, "kinds: job");
        if (!c || !self)
                return 1;
        CHECK(pipe2(p, O_CLOEXEC) == 0 && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) == 0,
              "kinds: pipe, socketpair");
        snprintf(shm_path, sizeof(shm_path), "/dev/shm/moeep-fdattack-%d", (int)getpid());
        shm = open(shm_path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (shm >= 0) {
                unlink(shm_path);
                (void)!ftruncate(shm, 4096);
        }
        small = memfd_of(1024);
        cases[n++] =
                (struct fd_case){ "pipe", p[0], { "a pipe or FIFO", "a pipe or FIFO", "a pipe or FIFO" } };
        cases[n++] = (struct fd_case){ "socketpair", sp[0], { "a socket", "a socket", "a socket" } };
        cases[n++] =
                (struct fd_case){ "moeepd connection", self->fd, { "a socket", "a socket", "a socket" } };
        cases[n++] = (struct fd_case){ "directory",
                                       open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC),
                                       { "a directory", "a directory", "a directory" } };
        cases[n++] = (struct fd_case){ "eventfd",
                                       eventfd(0, EFD_CLOEXEC),
                                       { "anon_inode:[eventfd]", "anon_inode:[eventfd]",
                                         "anon_inode:[eventfd]" } };
        cases[n++] = (struct fd_case){ "/dev/zero",
                                       open("/dev/zero", O_RDWR | O_CLOEXEC),
                                       { "character device 1:5", "character device 1:5",
                                         "character device 1:5" } };
        cases[n++] = (struct fd_case){ "regular file",
                                       open(reg_path, O_RDONLY | O_CLOEXEC),
                                       { "a regular file", "a regular file", "a regular file" } };
        cases[n++] = (struct fd_case){ "O_PATH",
                                       open("/dev/zero", O_PATH | O_CLOEXEC),
                                       { "O_PATH", "O_PATH", "O_PATH" } };
        if (shm >= 0)
                cases[n++] = (struct fd_case){ "tmpfs file",
                                               shm,
                                               { "tmpfs", "a regular file", "a regular file" } };
        cases[n++] = (struct fd_case){ "memfd", memfd_of(4096), { NULL, "/memfd:", "/memfd:" } };
        cases[n++] =
                (struct fd_case){ "memfd too small", small, { "only 1024 bytes", "/memfd:", "/memfd:" } };

        for (size_t i = 0; i < n; i++) {
                CHECK(cases[i].fd >= 0, "kinds: making a %s: %s", cases[i].what, strerror(errno));
                if (cases[i].fd < 0)
                        continue;
                for (size_t k = 0; k < 3; k++) {
                        uint64_t id = 0;
                        int code = region_register(c, all_kinds[k], 4096, cases[i].fd, &id, msg, sizeof(msg));

                        if (!cases[i].is[k]) {
                                CHECK(code == 0, "a %s as %s: refused, code %d (%s)", cases[i].what,
                                      kind_names[k], code, msg);
                                if (code == 0)
                                        CHECK(region_release(c, id) == 0, "releasing the %s", cases[i].what);
                                continue;
                        }
                        CHECK(code > 0 && strstr(msg, kind_names[k]) && strstr(msg, cases[i].is[k]),
                              "a %s as %s: code %d, message '%s' (want '%s')", cases[i].what, kind_names[k],
                              code, msg, cases[i].is[k]);
                        CHECK(code == (strstr(cases[i].is[k], "only")
                                               ? MOEEP__V1__ERROR_CODE__ERROR_INVALID_ARGUMENT
                                               : MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS),
                              "a %s as %s: code %d", cases[i].what, kind_names[k], code);
                }
        }
        /* A record of zero bytes reads like the end, but its fds must be
         * closed all the same (the daemon's fd count is checked after). */
        {
                struct conn *z = conn_open();
                int mfd = memfd_of(4096);
                union {
                        char buf[CMSG_SPACE(sizeof(int))];
                        struct cmsghdr align;
                } control = { 0 };
                struct msghdr mh = { .msg_control = control.buf, .msg_controllen = sizeof(control.buf) };
                struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);

                cm->cmsg_level = SOL_SOCKET;
                cm->cmsg_type = SCM_RIGHTS;
                cm->cmsg_len = CMSG_LEN(sizeof(int));
                memcpy(CMSG_DATA(cm), &mfd, sizeof(int));
                /* Welcomed first: before, the socket takes no fds. */
                CHECK(z && mfd >= 0 && hello_with(z, NULL, 0, NULL, 0) == 0 && sendmsg(z->fd, &mh, 0) == 0,
                      "kinds: a zero-byte record with an fd");
                CHECK(z && conn_response(z) == NULL, "kinds: the daemon answered a zero-byte record");
                close(mfd);
                conn_close(z);
        }
        /* The session survived every refusal. */
        CHECK(region_release(c, 999999) == MOEEP__V1__ERROR_CODE__ERROR_INVALID_ARGUMENT,
              "kinds: the session is still served");
        for (size_t i = 0; i < n; i++)
                if (cases[i].fd >= 0 && cases[i].fd != self->fd)
                        close(cases[i].fd);
        if (p[1] >= 0)
                close(p[1]);
        if (sp[1] >= 0)
                close(sp[1]);
        conn_close(self);
        conn_close(c);
        return 0;
}

static void case_kinds(void) {
        failures += run_attacker("kinds", attack_kinds, NULL, 20000);
        check_served("kinds, after", 5);
        check_baseline("kinds");
}

/* ------------------------------------------------------------ fetch */

static int attack_fetch(void *arg) {
        Moeep__V1__RegionsFetch rf = MOEEP__V1__REGIONS_FETCH__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        struct conn *c = conn_open();
        int regs = 0, sent = 0;

        CHECK(c && enter_job(c) == 0, "fetch: job");
        if (!c)
                return 1;
        for (int i = 0; i < 8; i++) {
                int fd = memfd_of(4096);

                regs += region_register(c, MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD, 4096, fd, NULL, NULL,
                                        0) == 0;
                close(fd);
        }
        CHECK(regs == 8, "fetch: registered %d of 8 regions", regs);
        rf.rank = 0;
        rf.tag = -1;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGIONS_FETCH;
        req.regions_fetch = &rf;
        fcntl(c->fd, F_SETFL, O_NONBLOCK);
        /* Never read: the daemon must bound what it keeps for us. */
        for (int i = 0; i < 4000; i++) {
                int r = moeep_record_send(c->fd, (uint16_t)req.body_case, ++c->rid, &req.base, NULL, 0);

                if (r == -EAGAIN) {
                        sleep_ms(2);
                        continue;
                }
                if (r < 0)
                        break; /* the daemon closed us: fine */
                sent++;
        }
        say("fetch: sent %d RegionsFetch without reading", sent);
        sleep_ms(300);
        conn_close(c);
        return 0;
}

static void case_fetch(void) {
        long deadline;
        int max = 0, st = 0;
        pid_t pid;

        fflush(stdout);
        pid = fork();
        if (pid == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                if (setgroups(0, NULL) < 0 || setresgid(ATTACK_UID, ATTACK_UID, ATTACK_UID) < 0 ||
                    setresuid(ATTACK_UID, ATTACK_UID, ATTACK_UID) < 0)
                        _exit(100);
                failures = 0;
                attack_fetch(NULL);
                fflush(stdout);
                _exit(failures > 0 ? 1 : 0);
        }
        deadline = now_ms() + 30000;
        /* Sample the daemon's fds every millisecond or so; serve and ask
         * for status now and then. */
        for (int i = 0; now_ms() < deadline && waitpid(pid, &st, WNOHANG) == 0; i++) {
                int n = proc_count_fds(daemon_pid);

                max = n > max ? n : max;
                if (i % 200 == 100) {
                        check_served("fetch", 1);
                        check_ctl("fetch");
                }
                sleep_ms(1);
        }
        if (now_ms() >= deadline) {
                kill(pid, SIGKILL);
                waitpid(pid, &st, 0);
        }
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fetch: the attacker failed (status 0x%x)", st);
        /* Its regions and queued duplicates stay within its uid's cap; one
         * socket for it and a few for the probes. */
        CHECK(max <= fds_base + CAP_FDS_PER_UID + 8,
              "fetch: the daemon held up to %d fds (baseline %d, cap %d)", max, fds_base, CAP_FDS_PER_UID);
        say("fetch: the daemon held at most %d fds (baseline %d)", max, fds_base);
        CHECK(log_has("the peer does not read"),
              "fetch: the daemon never closed the session that does not read");
        check_served("fetch, after", 5);
        check_ctl("fetch, after");
        check_baseline("fetch");
}

/* ------------------------------------------------------------ hello */

static int attack_hello(void *arg) {
        struct pollfd pfd[IDLE_CONNECTIONS];
        int open_now = 0, closed = 0, early = 0;
        long t0 = now_ms(), deadline = t0 + HELLO_DEADLINE_MS + 3000;

        for (int i = 0; i < IDLE_CONNECTIONS; i++) {
                struct sockaddr_un sa = { .sun_family = AF_UNIX };

                pfd[i].fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
                pfd[i].events = POLLIN;
                snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock_path);
                if (pfd[i].fd >= 0 && connect(pfd[i].fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
                        open_now++;
        }
        CHECK(open_now == IDLE_CONNECTIONS, "hello: %d of %d connections opened", open_now, IDLE_CONNECTIONS);
        while (closed < open_now && now_ms() < deadline) {
                if (poll(pfd, IDLE_CONNECTIONS, 100) <= 0)
                        continue;
                for (int i = 0; i < IDLE_CONNECTIONS; i++) {
                        char buf[512];
                        ssize_t r;

                        if (pfd[i].fd < 0 || !(pfd[i].revents & (POLLIN | POLLHUP)))
                                continue;
                        while ((r = recv(pfd[i].fd, buf, sizeof(buf), 0)) > 0)
                                ; /* the Error */
                        if (r == 0) {
                                early += now_ms() - t0 < HELLO_DEADLINE_MS - 500;
                                close(pfd[i].fd);
                                pfd[i].fd = -1;
                                closed++;
                        }
                }
        }
        CHECK(closed == open_now, "hello: %d of %d idle connections closed within %d ms", closed, open_now,
              HELLO_DEADLINE_MS + 3000);
        CHECK(early == 0, "hello: %d connections closed before the deadline", early);
        for (int i = 0; i < IDLE_CONNECTIONS; i++)
                if (pfd[i].fd >= 0)
                        close(pfd[i].fd);
        return 0;
}

static void case_hello(void) {
        failures += run_attacker("hello", attack_hello, NULL, HELLO_DEADLINE_MS + 10000);
        CHECK(log_has("no Hello within"), "hello: the daemon did not log the deadline");
        check_served("hello, after", 5);
        check_baseline("hello");
}

/* ------------------------------------------------------------ main */

static int start_daemon(const char *moeepd) {
        FILE *f = fopen(conf_path, "w");

        if (!f)
                return -1;
        fprintf(f,
                "[moeepd]\nsocket = %s\nsocket_mode = 0666\nadmin_group =\nlog_level = info\n"
                "max_sessions_per_uid = 100\nmax_fds_per_uid = %d\n",
                sock_path, CAP_FDS_PER_UID);
        if (fclose(f) != 0)
                return -1;
        daemon_pid = proc_spawn_logged((char *const[]){ (char *)moeepd, "-c", conf_path, NULL }, log_path);
        return sec_wait_daemon();
}

int main(int argc, char **argv) {
        const char *only = argc > 3 ? argv[3] : NULL;
        static const struct sec_case cases[] = { { "kinds", case_kinds },
                                                 { "linger", case_linger },
                                                 { "fuse", case_fuse },
                                                 { "fetch", case_fetch },
                                                 { "hello", case_hello } };
        int fd, r = sec_begin("fdattack", "run attackers as uid 65534", argc, argv);

        if (r != 0)
                return r;
        snprintf(reg_path, sizeof(reg_path), "%s/regular", tmpdir);
        fd = open(reg_path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0 || ftruncate(fd, 8192) < 0) {
                perror("fdattack: regular file");
                return 1;
        }
        close(fd);
        if (start_daemon(argv[1]) < 0) {
                say("FAIL: moeepd did not start; its log:");
                char cmd[sizeof(log_path) + 32];

                snprintf(cmd, sizeof(cmd), "tail -n 20 '%s'", log_path);
                (void)!system(cmd);
                return 1;
        }
        sec_baseline();
        sec_run_cases(cases, sizeof(cases) / sizeof(cases[0]), only);
        /* SIGTERM while closes of lingering sockets are stuck: the loop
         * acts on it, and the daemon ends cleanly (LeakSanitizer finding
         * nothing in ASan builds) within 5 s. */
        if (daemon_pid > 0 && (!only || strcmp(only, "term") == 0)) {
                long t0;
                int st = -1;

                if (tarpit_open() == 0 && run_attacker("term", attack_linger, NULL, 20000) == 0) {
                        t0 = now_ms();
                        kill(daemon_pid, SIGTERM);
                        for (int i = 0; i < 100 && waitpid(daemon_pid, &st, WNOHANG) == 0; i++)
                                sleep_ms(50);
                        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                              "moeepd did not exit cleanly within 5 s of SIGTERM with closes stuck (status "
                              "0x%x)",
                              st);
                        if (WIFEXITED(st) || WIFSIGNALED(st)) {
                                daemon_pid = -1;
                                say("term: moeepd exited %ld ms after SIGTERM, closes of lingering sockets "
                                    "stuck",
                                    now_ms() - t0);
                        }
                } else {
                        CHECK(0, "term: the lingering attack failed");
                }
                if (tarpit_fd >= 0)
                        close(tarpit_fd);
                say("%s term", failures ? "FAIL" : "ok  ");
        }
        if (failures) {
                char cmd[sizeof(log_path) + 32];

                snprintf(cmd, sizeof(cmd), "tail -n 30 '%s'", log_path);
                (void)!system(cmd);
        }
        say("fdattack: %d failures", failures);
        return failures ? 1 : 0;
}
