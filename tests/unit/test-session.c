/* Sessions driven in-process: a real daemon object on a private socket,
 * its loop pumped by the test between requests. Checks the state machine,
 * the error paths that close a session, and that the daemon's descriptor
 * count comes back to where it was. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <grp.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "../tmpdir.h"
#include "clients/session.h"
#include "daemon.h"
#include "datapath/datapath.h"
#include "moeep_job.h" /* MOEEP_UNIQUE_ID_BYTES */
#include "record.h"
#include "state/broker.h"
#include "state/clientfd.h"
#include "state/job.h"
#include "unit.h"

/* Every statx() of this program, the daemon's included, goes through
 * here: it counts those of the inode `region_ino` made on the thread that
 * runs the loop (main()'s). */
static pthread_t loop_thread;
static ino_t region_ino;
static int statx_region_on_loop;

int statx(int dirfd, const char *path, int flags, unsigned mask, struct statx *buf) {
        int r = (int)syscall(SYS_statx, dirfd, path, flags, mask, buf);

        if (r == 0 && region_ino && buf->stx_ino == region_ino && pthread_equal(pthread_self(), loop_thread))
                statx_region_on_loop++;
        return r;
}

/* And every mmap() (mmap64() with _FILE_OFFSET_BITS=64): a shared
 * mapping of HELD_BYTES (the size of the tests' held regions only) is a
 * transport's registration of a proxy region (tp-fabric maps the memfd):
 * counted by thread, and, made off the loop, held while `map_gate` is
 * closed (at most 5 s), as a registration that pins gigabytes takes its
 * time. One of FAIL_BYTES fails with ENOMEM. */
#define HELD_BYTES (3u << 20)
#define FAIL_BYTES (5u << 20)
static pthread_mutex_t map_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t map_cond = PTHREAD_COND_INITIALIZER;
static bool map_gate_closed;
static int maps_on_loop, maps_off_loop, maps_held;

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
        if (fd >= 0 && (flags & MAP_SHARED) && len == FAIL_BYTES) {
                errno = ENOMEM;
                return MAP_FAILED;
        }
        if (fd >= 0 && (flags & MAP_SHARED) && len == HELD_BYTES) {
                struct timespec until;

                clock_gettime(CLOCK_REALTIME, &until);
                until.tv_sec += 5;
                pthread_mutex_lock(&map_lock);
                if (pthread_equal(pthread_self(), loop_thread)) {
                        maps_on_loop++;
                } else {
                        maps_off_loop++;
                        maps_held++;
                        pthread_cond_broadcast(&map_cond);
                        while (map_gate_closed && pthread_cond_timedwait(&map_cond, &map_lock, &until) == 0)
                                ;
                        maps_held--;
                }
                pthread_mutex_unlock(&map_lock);
        }
        return (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
}

static void map_gate(bool closed) {
        pthread_mutex_lock(&map_lock);
        map_gate_closed = closed;
        pthread_cond_broadcast(&map_cond);
        pthread_mutex_unlock(&map_lock);
}

struct fixture {
        struct daemon d;
        char dir[80];
        char path[96];
        int fds_before;
        struct moeep_record rec;
};

static void pump(struct fixture *f) {
        for (int i = 0; i < 20; i++)
                event_base_loop(f->d.base, EVLOOP_NONBLOCK);
}

static int setup(void **state) {
        struct fixture *f = calloc(1, sizeof(*f));
        struct daemon_options o = { .log_level = "err", .no_config = true };

        if (!f)
                return -1;
        /* A directory of its own: the admin socket goes beside it, in
         * DIR-admin (proto/admin-socket.h). */
        test_tmp_path(f->dir, sizeof(f->dir), "moeep-unit-session.XXXXXX");
        if (!mkdtemp(f->dir))
                return -1;
        snprintf(f->path, sizeof(f->path), "%s/moeepd.sock", f->dir);
        o.socket = f->path;
        if (daemon_init(&f->d, &o) < 0)
                return -1;
        f->fds_before = unit_count_fds();
        *state = f;
        return 0;
}

/* Starts the daemon of `f` with its data path on (a mesh listener on
 * loopback, no peers) over libfabric's tcp on loopback, its client socket
 * open to every uid. Returns 0 or -1. */
static int proxy_daemon_start(struct fixture *f) {
        struct daemon_options o = { .log_level = "err", .socket = f->path };
        char conf[128];
        FILE *c;
        int r;

        snprintf(conf, sizeof(conf), "%s/moeepd.conf", f->dir);
        c = fopen(conf, "we");
        if (!c)
                return -1;
        fprintf(c, "[moeepd]\nsocket_mode = 0666\nmesh_listen = 127.0.0.1:0\ntransport = fabric\n"
                   "fabric_provider = tcp\ntransport_address = 127.0.0.1\n");
        fclose(c);
        o.config_path = conf;
        r = daemon_init(&f->d, &o) < 0 || !datapath_up(f->d.datapath, NULL) ? -1 : 0;
        unlink(conf);
        return r;
}

static int setup_proxy(void **state) {
        struct fixture *f = calloc(1, sizeof(*f));

        if (!f)
                return -1;
        test_tmp_path(f->dir, sizeof(f->dir), "moeep-unit-session.XXXXXX");
        if (!mkdtemp(f->dir) || chmod(f->dir, 0755) < 0)
                return -1;
        snprintf(f->path, sizeof(f->path), "%s/moeepd.sock", f->dir);
        if (proxy_daemon_start(f) < 0) {
                daemon_done(&f->d);
                rmdir(f->dir);
                return -1;
        }
        f->fds_before = unit_count_fds();
        map_gate(false);
        maps_on_loop = maps_off_loop = 0;
        *state = f;
        return 0;
}

static int teardown(void **state) {
        struct fixture *f = *state;

        map_gate(false); /* a test that failed left a registration held */
        pump(f);
        /* Client fds are closed by closer threads (clientfd.h). */
        assert_int_equal(clientfds_settle(f->d.clientfds, 2000), 0);
        assert_int_equal(unit_count_fds(), f->fds_before);
        daemon_done(&f->d);
        assert_int_equal(access(f->path, F_OK), -1); /* the self-bound socket is gone */
        rmdir(f->dir);
        free(f);
        return 0;
}

static int client(struct fixture *f) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        /* Non-blocking, so that "no reply yet" can be checked. */
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);

        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f->path);
        assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
        pump(f);
        return fd;
}

static void request(struct fixture *f, int fd, Moeep__V1__Request *req, uint64_t rid, const int *fds,
                    size_t n) {
        assert_int_equal(moeep_record_send(fd, (uint16_t)req->body_case, rid, &req->base, fds, n), 0);
        pump(f);
}

/* Receives the next record (a response or an event), without blocking. */
static uint16_t next(struct fixture *f, int fd, uint64_t *ret_rid, int *ret_code) {
        Moeep__V1__Response *resp;

        moeep_record_release(&f->rec);
        if (moeep_record_recv(fd, &f->rec, NULL) != 0)
                return 0;
        if (ret_rid)
                *ret_rid = f->rec.hdr.request_id;
        if (ret_code && f->rec.hdr.type == MOEEP__V1__RESPONSE__BODY_ERROR) {
                resp = moeep_record_decode_response(&f->rec);
                assert_non_null(resp);
                *ret_code = resp->error->code;
                moeep__v1__response__free_unpacked(resp, NULL);
        }
        return f->rec.hdr.type;
}

/* Like next(), for a reply made off the loop (a region's kind check runs
 * on a closer): waits for it up to 2 s. */
static uint16_t next_late(struct fixture *f, int fd, uint64_t *ret_rid, int *ret_code) {
        uint16_t type = 0;

        for (int i = 0; i < 200 && !type; i++) {
                clientfds_settle(f->d.clientfds, 10);
                pump(f);
                type = next(f, fd, ret_rid, ret_code);
        }
        return type;
}

/* Hello offering `features`; returns those the Welcome agreed to. */
static uint64_t hello_features(struct fixture *f, int fd, uint64_t features) {
        Moeep__V1__Hello h = MOEEP__V1__HELLO__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        uint64_t agreed;

        h.major = MOEEP_PROTOCOL_MAJOR;
        h.features = features;
        req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
        req.hello = &h;
        request(f, fd, &req, 1, NULL, 0);
        assert_int_equal(next(f, fd, NULL, NULL), MOEEP__V1__RESPONSE__BODY_WELCOME);
        resp = moeep_record_decode_response(&f->rec);
        assert_non_null(resp);
        agreed = resp->welcome->features;
        moeep__v1__response__free_unpacked(resp, NULL);
        return agreed;
}

static void hello(struct fixture *f, int fd) {
        hello_features(f, fd, 0);
}

/* JobCreate of `world_size` ranks on `creator`, then JobJoin of ranks
 * 0.. on `fds` (one each). */
static void job_formed(struct fixture *f, int creator, const int *fds, uint32_t world_size) {
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
        Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
        Moeep__V1__Response *resp;
        uint8_t uid[MOEEP_UNIQUE_ID_BYTES]; /* with the mesh on, the daemon's address too */
        size_t uid_len;

        jc.name = "session test";
        jc.world_size = world_size;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
        req.job_create = &jc;
        request(f, creator, &req, 10, NULL, 0);
        assert_int_equal(next(f, creator, NULL, NULL), MOEEP__V1__RESPONSE__BODY_JOB_CREATED);
        resp = moeep_record_decode_response(&f->rec);
        uid_len = resp->job_created->unique_id.len;
        assert_true(uid_len >= JOB_UNIQUE_ID_BYTES && uid_len <= sizeof(uid));
        memcpy(uid, resp->job_created->unique_id.data, uid_len);
        moeep__v1__response__free_unpacked(resp, NULL);

        jj.unique_id.data = uid;
        jj.unique_id.len = uid_len;
        jj.world_size = world_size;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
        req.job_join = &jj;
        for (uint32_t r = 0; r < world_size; r++) {
                jj.rank = r;
                request(f, fds[r], &req, 20, NULL, 0);
                assert_int_equal(next(f, fds[r], NULL, NULL), MOEEP__V1__RESPONSE__BODY_JOB_JOINED);
                assert_int_equal(f->rec.nfds, 1); /* the control page */
        }
        moeep_record_release(&f->rec);
}

/* Whether the daemon closed the connection (after what it still sent). */
static bool closed_by_daemon(struct fixture *f, int fd) {
        char c;

        pump(f);
        clientfds_settle(f->d.clientfds, 2000); /* the socket is closed off the loop */
        return recv(fd, &c, 1, MSG_DONTWAIT) == 0;
}

static void test_hello_then_close(void **state) {
        struct fixture *f = *state;
        int fd = client(f);

        assert_int_equal(f->d.sessions->count, 1);
        hello(f, fd);
        close(fd);
        pump(f);
        assert_int_equal(f->d.sessions->count, 0);
}

static void test_not_welcomed(void **state) {
        struct fixture *f = *state;
        Moeep__V1__JobLeave jl = MOEEP__V1__JOB_LEAVE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        uint64_t rid = 0;
        int fd = client(f), code = 0;

        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_LEAVE;
        req.job_leave = &jl;
        request(f, fd, &req, 77, NULL, 0);
        assert_int_equal(next(f, fd, &rid, &code), MOEEP__V1__RESPONSE__BODY_ERROR);
        assert_int_equal(rid, 77);
        assert_int_equal(code, MOEEP__V1__ERROR_CODE__ERROR_NOT_WELCOMED);
        assert_true(closed_by_daemon(f, fd));
        close(fd);
}

static void test_fds_on_hello_closes_them(void **state) {
        struct fixture *f = *state;
        Moeep__V1__Hello h = MOEEP__V1__HELLO__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        int fd = client(f), code = 0;
        int fds[3] = { unit_memfd(64, NULL), unit_memfd(64, NULL), unit_memfd(64, NULL) };
        int daemon_fds;

        h.major = MOEEP_PROTOCOL_MAJOR;
        req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
        req.hello = &h;
        /* The encoder writes nfds into the header; the record layer refuses
         * descriptors on Hello. Where the kernel has SO_PASSRIGHTS, the
         * client socket takes none before Welcome: the send fails, and the
         * session goes on. */
        daemon_fds = unit_count_fds();
        if (f->d.sessions->fds_after_welcome) {
                assert_int_equal(moeep_record_send(fd, (uint16_t)req.body_case, 3, &req.base, fds, 3),
                                 -EPERM);
                hello(f, fd);
                pump(f);
                assert_int_equal(unit_count_fds(), daemon_fds);
                for (int i = 0; i < 3; i++)
                        close(fds[i]);
                close(fd);
                return;
        }
        request(f, fd, &req, 3, fds, 3);
        assert_int_equal(next(f, fd, NULL, &code), MOEEP__V1__RESPONSE__BODY_ERROR);
        assert_int_equal(code, MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS);
        assert_true(closed_by_daemon(f, fd));
        /* Everything received was closed (our own three are still open). */
        assert_int_equal(unit_count_fds(), daemon_fds - 1);
        for (int i = 0; i < 3; i++)
                close(fds[i]);
        close(fd);
}

static void test_job_flow_and_peer_lost(void **state) {
        struct fixture *f = *state;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Barrier bar = MOEEP__V1__BARRIER__INIT;
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__RegionsFetch rf = MOEEP__V1__REGIONS_FETCH__INIT;
        int a = client(f), b = client(f), code = 0, region;
        const int ranks[] = { a, b };
        struct stat st;
        uint64_t rid = 0;
        char text[16] = "";

        hello(f, a);
        hello(f, b);
        job_formed(f, a, ranks, 2);

        /* Regions: b registers, a fetches every other rank's. */
        region = unit_memfd(4096, "from b");
        rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        rr.size = 4096;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        assert_int_equal(fstat(region, &st), 0);
        region_ino = st.st_ino;
        statx_region_on_loop = 0;
        request(f, b, &req, 30, &region, 1);
        close(region);
        assert_int_equal(next_late(f, b, NULL, NULL), MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED);
        /* Its kind was checked on a closer: the loop never looked. */
        assert_int_equal(statx_region_on_loop, 0);
        region_ino = 0;
        rf.rank = -1;
        rf.tag = -1;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGIONS_FETCH;
        req.regions_fetch = &rf;
        request(f, a, &req, 31, NULL, 0);
        assert_int_equal(next(f, a, NULL, NULL), MOEEP__V1__RESPONSE__BODY_REGIONS);
        assert_int_equal(f->rec.nfds, 1);
        assert_int_equal(pread(f->rec.fds[0], text, sizeof(text), 0), sizeof(text));
        assert_string_equal(text, "from b");

        /* The barrier reply is held until both arrived. */
        req.body_case = MOEEP__V1__REQUEST__BODY_BARRIER;
        req.barrier = &bar;
        request(f, a, &req, 40, NULL, 0);
        assert_int_equal(next(f, a, NULL, NULL), 0);
        request(f, b, &req, 41, NULL, 0);
        assert_int_equal(next(f, a, &rid, NULL), MOEEP__V1__RESPONSE__BODY_OK);
        assert_int_equal(rid, 40);
        assert_int_equal(next(f, b, &rid, NULL), MOEEP__V1__RESPONSE__BODY_OK);
        assert_int_equal(rid, 41);

        /* b dies while a waits: PeerLost, then the barrier fails. */
        request(f, a, &req, 42, NULL, 0);
        close(b);
        pump(f);
        assert_int_equal(next(f, a, NULL, NULL), MOEEP__V1__EVENT__BODY_PEER_LOST);
        assert_int_equal(next(f, a, &rid, &code), MOEEP__V1__RESPONSE__BODY_ERROR);
        assert_int_equal(rid, 42);
        assert_int_equal(code, MOEEP__V1__ERROR_CODE__ERROR_PEER_LOST);
        moeep_record_release(&f->rec);
        close(a);
        pump(f);
        assert_int_equal(f->d.jobs->count, 0);
        assert_int_equal(f->d.broker->nregions, 0);
}

static void test_shutdown_event(void **state) {
        struct fixture *f = *state;
        int fd = client(f);

        hello(f, fd);
        f->d.stopping = true;
        sessions_shutdown(f->d.sessions, "unit test");
        assert_int_equal(next(f, fd, NULL, NULL), MOEEP__V1__EVENT__BODY_SHUTDOWN);
        assert_true(closed_by_daemon(f, fd));
        close(fd);
}

/* A region taken by fd number (FEATURE_PIDFD) whose RegionRegistered
 * cannot be queued (the output queue overflowed: the client does not read)
 * is registered, not refused: no Error is made for it (the session fails
 * from the loop, and its member's regions go with it). */
static void test_take_reply_lost_is_no_refusal(void **state) {
        struct fixture *f = *state;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__TakeFd take = MOEEP__V1__TAKE_FD__INIT;
        int fd = client(f), region;
        uint64_t errors = 0;
        struct session *s;

        if (!(hello_features(f, fd, MOEEP__V1__FEATURE__FEATURE_PIDFD) & MOEEP__V1__FEATURE__FEATURE_PIDFD)) {
                close(fd);
                skip();
        }
        job_formed(f, fd, &fd, 1);

        /* The output queue overflowed (session_send()): every reply from
         * now on is refused with -ENOBUFS until the loop fails it. */
        s = TAILQ_FIRST(&f->d.sessions->list);
        assert_non_null(s);
        s->broken = "unit test: output queue full";
        region = unit_memfd(4096, "taken");
        take.fd_number = region;
        rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        rr.size = 4096;
        rr.take = &take;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        request(f, fd, &req, 4, NULL, 0);
        /* The take runs on a closer thread; its end on the loop. */
        for (int i = 0; i < 200 && f->d.metrics.regions_registered == 0; i++) {
                clientfds_settle(f->d.clientfds, 10);
                pump(f);
        }
        close(region);
        assert_int_equal(f->d.metrics.regions_registered, 1);
        assert_int_equal(f->d.broker->nregions, 1);
        for (int code = 0; code < METRICS_ERROR_CODES; code++)
                errors += f->d.metrics.errors[code];
        assert_int_equal(errors, 0);
        close(fd);
        pump(f);
        assert_int_equal(f->d.sessions->count, 0);
        assert_int_equal(f->d.broker->nregions, 0);
}

/* Every ErrorCode moeep.proto declares is counted by code (the
 * moeepd_errors_total samples): the enum's descriptor is the reference. */
static void test_errors_counted_by_code(void **state) {
        const ProtobufCEnumDescriptor *d = &moeep__v1__error_code__descriptor;
        struct fixture *f = *state;
        int fd = client(f), code;
        struct session *s;

        hello(f, fd);
        s = TAILQ_FIRST(&f->d.sessions->list);
        assert_non_null(s);
        for (unsigned i = 0; i < d->n_values; i++) {
                if (d->values[i].value == MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED)
                        continue;
                assert_true(d->values[i].value > 0 && d->values[i].value < METRICS_ERROR_CODES);
                assert_int_equal(f->d.metrics.errors[d->values[i].value], 0);
                assert_int_equal(session_send_error(s, 7, d->values[i].value, "unit test"), 0);
                pump(f);
                code = 0;
                assert_int_equal(next(f, fd, NULL, &code), MOEEP__V1__RESPONSE__BODY_ERROR);
                assert_int_equal(code, d->values[i].value);
                assert_int_equal(f->d.metrics.errors[d->values[i].value], 1);
        }
        close(fd);
}

/* ------------------------------------------------------------ proxy regions */

#define OTHER_UID 65534

/* A session of uid OTHER_UID: a child process of that uid connects, hands
 * the socket over and exits (SO_PEERCRED stays the connecting process's). */
static int client_as(struct fixture *f, uid_t uid) {
        union {
                char buf[CMSG_SPACE(sizeof(int))];
                struct cmsghdr align;
        } control = { 0 };
        struct iovec iov = { .iov_base = &(char){ 0 }, .iov_len = 1 };
        struct msghdr mh = { .msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = control.buf,
                             .msg_controllen = sizeof(control.buf) };
        int sp[2], fd = -1, st = 0;
        pid_t pid;

        assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp), 0);
        pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
                struct sockaddr_un sa = { .sun_family = AF_UNIX };
                struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);

                snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f->path);
                fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
                if (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0 ||
                    fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
                        _exit(1);
                cm->cmsg_level = SOL_SOCKET;
                cm->cmsg_type = SCM_RIGHTS;
                cm->cmsg_len = CMSG_LEN(sizeof(int));
                memcpy(CMSG_DATA(cm), &fd, sizeof(int));
                _exit(sendmsg(sp[1], &mh, 0) == 1 ? 0 : 1);
        }
        close(sp[1]);
        assert_int_equal(recvmsg(sp[0], &mh, MSG_CMSG_CLOEXEC), 1);
        assert_non_null(CMSG_FIRSTHDR(&mh));
        memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&mh)), sizeof(int));
        close(sp[0]);
        assert_int_equal(waitpid(pid, &st, 0), pid);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        pump(f);
        return fd;
}

/* A memfd of `size` bytes sealed against shrinking, as proxy regions must
 * be. */
static int sealed_memfd(size_t size) {
        int fd = memfd_create("proxy region", MFD_CLOEXEC | MFD_ALLOW_SEALING);

        assert_true(fd >= 0 && ftruncate(fd, (off_t)size) == 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
        return fd;
}

/* RegionRegister of `region` (closed here) as the proxy region of `role`. */
static void register_proxy(struct fixture *f, int fd, uint64_t rid, Moeep__V1__ProxyRole role, size_t size,
                           int region) {
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;

        rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        rr.size = size;
        rr.proxy = role;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        request(f, fd, &req, rid, &region, 1);
        close(region);
}

/* A request without arguments of `body` (StatusGet, RegionsFetch of every
 * other rank, ChannelOpen of the default capacity): the type answered at
 * once, or 0. */
static uint16_t ask(struct fixture *f, int fd, Moeep__V1__Request__BodyCase body) {
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__StatusGet sg = MOEEP__V1__STATUS_GET__INIT;
        Moeep__V1__RegionsFetch rf = MOEEP__V1__REGIONS_FETCH__INIT;
        Moeep__V1__ChannelOpen co = MOEEP__V1__CHANNEL_OPEN__INIT;

        rf.rank = -1;
        rf.tag = -1;
        req.body_case = body;
        req.status_get = &sg; /* the oneof's members share their place */
        if (body == MOEEP__V1__REQUEST__BODY_REGIONS_FETCH)
                req.regions_fetch = &rf;
        else if (body == MOEEP__V1__REQUEST__BODY_CHANNEL_OPEN)
                req.channel_open = &co;
        request(f, fd, &req, 90, NULL, 0);
        return next(f, fd, NULL, NULL);
}

/* Hello with FEATURE_PROXY on `fd`, and a job of one rank: `fd`'s. */
static void proxy_rank(struct fixture *f, int fd) {
        hello_features(f, fd, MOEEP__V1__FEATURE__FEATURE_PROXY);
        job_formed(f, fd, &fd, 1);
}

static int wait_held(struct fixture *f);

/* RegionRegister on `fd` of a proxy region of `role` and HELD_BYTES, whose
 * transport registration is then held (map_gate()). */
static void register_held(struct fixture *f, int fd, uint64_t rid, Moeep__V1__ProxyRole role) {
        map_gate(true);
        register_proxy(f, fd, rid, role, HELD_BYTES, sealed_memfd(HELD_BYTES));
        assert_int_equal(wait_held(f), 1);
}

/* Pumps the loop until a registration is held in its transport's mmap
 * (at most 2 s); returns how many are. */
static int wait_held(struct fixture *f) {
        int held = 0;

        for (int i = 0; i < 400 && !held; i++) {
                pump(f);
                pthread_mutex_lock(&map_lock);
                held = maps_held;
                pthread_mutex_unlock(&map_lock);
                if (!held)
                        usleep(5000);
        }
        return held;
}

/* The session whose request is in progress (paused), or NULL. */
static struct session *paused_session(struct fixture *f) {
        struct session *s;

        TAILQ_FOREACH (s, &f->d.sessions->list, entry)
                if (s->paused)
                        return s;
        return NULL;
}

/* Whether a shared mapping of HELD_BYTES is still in this process (the
 * loop transport's of a region). */
static bool held_mapped(void) {
        char line[512];
        bool found = false;
        FILE *m = fopen("/proc/self/maps", "re");

        assert_non_null(m);
        while (!found && fgets(line, sizeof(line), m)) {
                unsigned long lo, hi;

                found = sscanf(line, "%lx-%lx", &lo, &hi) == 2 && hi - lo == HELD_BYTES &&
                        strstr(line, "proxy region");
        }
        fclose(m);
        return found;
}

/* A proxy region's transport registration (mr_new: pinning, mapping) runs
 * off the loop, in its uid's own queue: while one is held there, the loop
 * answers another uid at once and registers that uid's region, and the
 * held region is handed to no peer until it is registered; then it is
 * answered, and its channel opens. */
static void test_proxy_register_off_loop(void **state) {
        struct fixture *f = *state;
        const uint64_t proxy = MOEEP__V1__FEATURE__FEATURE_PROXY;
        int a = client(f), c = client(f), b = client_as(f, OTHER_UID);
        const int ranks[] = { a, c };
        uint64_t rid = 0;

        hello_features(f, a, proxy);
        hello_features(f, c, proxy);
        job_formed(f, a, ranks, 2);
        proxy_rank(f, b);

        register_held(f, a, 50, MOEEP__V1__PROXY_ROLE__PROXY_ROLE_SEND);
        assert_int_equal(maps_on_loop, 0);
        assert_int_equal(next(f, a, NULL, NULL), 0);

        /* The other uid: answered at once, its own region registered. */
        assert_int_equal(ask(f, b, MOEEP__V1__REQUEST__BODY_STATUS_GET), MOEEP__V1__RESPONSE__BODY_STATUS);
        register_proxy(f, b, 51, MOEEP__V1__PROXY_ROLE__PROXY_ROLE_COUNTERS, 4096, sealed_memfd(4096));
        assert_int_equal(next_late(f, b, &rid, NULL), MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED);
        assert_int_equal(rid, 51);
        /* a's peer sees no region of a's yet. */
        assert_int_equal(ask(f, c, MOEEP__V1__REQUEST__BODY_REGIONS_FETCH),
                         MOEEP__V1__RESPONSE__BODY_REGIONS);
        assert_int_equal(f->rec.nfds, 0);
        assert_int_equal(next(f, a, NULL, NULL), 0);

        map_gate(false);
        assert_int_equal(next_late(f, a, &rid, NULL), MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED);
        assert_int_equal(rid, 50);
        assert_int_equal(maps_on_loop, 0);
        assert_int_equal(maps_off_loop, 1);
        assert_int_equal(ask(f, c, MOEEP__V1__REQUEST__BODY_REGIONS_FETCH),
                         MOEEP__V1__RESPONSE__BODY_REGIONS);
        assert_int_equal(f->rec.nfds, 1);
        assert_int_equal(ask(f, a, MOEEP__V1__REQUEST__BODY_CHANNEL_OPEN),
                         MOEEP__V1__RESPONSE__BODY_CHANNEL_OPENED);
        moeep_record_release(&f->rec);
        close(a);
        close(b);
        close(c);
        pump(f);
        assert_int_equal(f->d.broker->nregions, 0);
}

/* A session that fails while its registration is held: the registration
 * is undone when it returns (its mapping gone, its fd closed, its charge
 * returned: the same uid registers as much again, at a cap of exactly one
 * region's bytes), and nothing is answered. */
static void test_proxy_register_session_gone(void **state) {
        struct fixture *f = *state;
        int a = client(f), a2 = client(f);
        struct session *s;
        uint64_t rid = 0;

        f->d.config.max_proxy_bytes_per_uid = HELD_BYTES;
        proxy_rank(f, a);
        register_held(f, a, 60, MOEEP__V1__PROXY_ROLE__PROXY_ROLE_RECV);
        s = paused_session(f);
        assert_non_null(s);
        session_fail(s, 0, 0, "unit test: the session fails while its region is registered");
        pump(f);
        assert_int_equal(f->d.broker->nregions, 0);
        map_gate(false);
        /* The run returns (its mapping made), and is undone on the loop. */
        for (int i = 0; i < 200 && clientfds_settle(f->d.clientfds, 10) < 0; i++)
                pump(f);
        pump(f);
        assert_false(held_mapped());
        assert_true(closed_by_daemon(f, a));
        assert_int_equal(next(f, a, NULL, NULL), 0);
        close(a);

        proxy_rank(f, a2);
        register_proxy(f, a2, 61, MOEEP__V1__PROXY_ROLE__PROXY_ROLE_RECV, HELD_BYTES,
                       sealed_memfd(HELD_BYTES));
        assert_int_equal(next_late(f, a2, &rid, NULL), MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED);
        assert_int_equal(rid, 61);
        close(a2);
        pump(f);
}

static void *open_gate_later(void *arg) {
        usleep(300 * 1000);
        map_gate(false);
        return NULL;
}

/* The daemon stops while a registration is held: its stop waits for it
 * (the transport stays open until then) and undoes it, and nothing is left
 * (the mapping gone, every fd closed: the restarted daemon holds as many
 * as before). */
static void test_proxy_register_daemon_exit(void **state) {
        struct fixture *f = *state;
        int a = client(f);
        pthread_t opener;

        proxy_rank(f, a);
        register_held(f, a, 80, MOEEP__V1__PROXY_ROLE__PROXY_ROLE_COUNTERS);
        assert_int_equal(pthread_create(&opener, NULL, open_gate_later, NULL), 0);
        daemon_done(&f->d);
        pthread_join(opener, NULL);
        assert_false(held_mapped());
        close(a);
        assert_int_equal(proxy_daemon_start(f), 0);
}

/* A registration the transport refuses off the loop: an Error naming the
 * region and why, and nothing kept (the role free again, the charge
 * returned: registering as much again works at a cap of exactly that). */
static void test_proxy_register_refused(void **state) {
        struct fixture *f = *state;
        int a = client(f), code = 0;
        Moeep__V1__Response *resp;
        uint64_t rid = 0;

        f->d.config.max_proxy_bytes_per_uid = FAIL_BYTES;
        proxy_rank(f, a);
        register_proxy(f, a, 70, MOEEP__V1__PROXY_ROLE__PROXY_ROLE_SEND, FAIL_BYTES,
                       sealed_memfd(FAIL_BYTES));
        assert_int_equal(next_late(f, a, &rid, &code), MOEEP__V1__RESPONSE__BODY_ERROR);
        assert_int_equal(rid, 70);
        resp = moeep_record_decode_response(&f->rec);
        assert_non_null(resp);
        if (!strstr(resp->error->message, "rank 0 send region") || !strstr(resp->error->message, "mmap"))
                fail_msg("the Error does not name the region and mmap: '%s'", resp->error->message);
        moeep__v1__response__free_unpacked(resp, NULL);
        assert_int_equal(f->d.broker->nregions, 0);

        register_proxy(f, a, 71, MOEEP__V1__PROXY_ROLE__PROXY_ROLE_SEND, HELD_BYTES,
                       sealed_memfd(HELD_BYTES));
        assert_int_equal(next_late(f, a, &rid, NULL), MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED);
        assert_int_equal(rid, 71);
        assert_int_equal(f->d.broker->nregions, 1);
        close(a);
        pump(f);
}

int main(void) {
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
        const struct CMUnitTest tests[] = {
                T(test_hello_then_close),
                T(test_not_welcomed),
                T(test_fds_on_hello_closes_them),
                T(test_job_flow_and_peer_lost),
                T(test_shutdown_event),
                T(test_errors_counted_by_code),
                T(test_take_reply_lost_is_no_refusal),
                cmocka_unit_test_setup_teardown(test_proxy_register_off_loop, setup_proxy, teardown),
                cmocka_unit_test_setup_teardown(test_proxy_register_session_gone, setup_proxy, teardown),
                cmocka_unit_test_setup_teardown(test_proxy_register_refused, setup_proxy, teardown),
                cmocka_unit_test_setup_teardown(test_proxy_register_daemon_exit, setup_proxy, teardown),
        };

        loop_thread = pthread_self();
        return cmocka_run_group_tests(tests, NULL, NULL);
}
