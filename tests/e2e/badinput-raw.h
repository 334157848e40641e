/* The raw side of moeep-e2e-badinput (badinput.c): the daemon it starts on
 * a socket in a temporary directory (and kills, with the directory removed,
 * on every exit path), its descriptor count, and the records it sends and
 * reads, crafted with proto/record.h. Included by badinput.c only; test
 * code. */
#ifndef MOEEP_E2E_BADINPUT_RAW_H
#define MOEEP_E2E_BADINPUT_RAW_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../cleanup.h"
#include "../tmpdir.h"
#include "isolation-proc.h"
#include "record.h"
#include "say.h"

#define REPLY_TIMEOUT_MS 3000  /* for a reply or for the daemon to close */
#define SETTLE_TIMEOUT_MS 3000 /* for the fd count to come back */
#define TOTAL_TIMEOUT_S 240

extern char **environ;

static char tmpdir[64];
static char sock_path[sizeof(tmpdir) + 32];
static char log_path[sizeof(tmpdir) + 32];
static pid_t daemon_pid = -1;
static uint64_t next_request_id = 1;
/* One receive buffer; the test is single-threaded. */
static struct moeep_record rec;

/* The daemon and the temporary directory go on every way out
 * (tests/cleanup.h), within TOTAL_TIMEOUT_S. */
static void cleanup_setup(void) {
        cleanup_add_pid(&daemon_pid);
        cleanup_add_file(log_path);
        cleanup_add_file(sock_path);
        cleanup_arm(TOTAL_TIMEOUT_S, "badinput: timed out, killing moeepd\n");
}

static void show_log(void) {
        char cmd[sizeof(log_path) + 32];

        if (!log_path[0])
                return;
        printf("--- last lines of the moeepd log\n");
        fflush(stdout);
        snprintf(cmd, sizeof(cmd), "tail -n 40 '%s'", log_path);
        (void)!system(cmd);
}

static long now_ms(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int daemon_alive(void) {
        int status;

        if (daemon_pid <= 0)
                return 0;
        if (waitpid(daemon_pid, &status, WNOHANG) == daemon_pid) {
                if (WIFSIGNALED(status))
                        say("moeepd died of signal %d", WTERMSIG(status));
                else
                        say("moeepd exited with status %d", WEXITSTATUS(status));
                daemon_pid = -1;
                return 0;
        }
        return 1;
}

static int conn_open(void) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

        if (fd < 0)
                return -errno;
        strcpy(sa.sun_path, sock_path);
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                int r = -errno;

                close(fd);
                return r;
        }
        return fd;
}

static int daemon_start(const char *moeepd) {
        char *argv[] = { (char *)moeepd, "--socket", sock_path, "--foreground", NULL };
        posix_spawn_file_actions_t fa;
        long deadline;
        int r;

        snprintf(sock_path, sizeof(sock_path), "%s/moeepd.sock", tmpdir);
        snprintf(log_path, sizeof(log_path), "%s/moeepd.log", tmpdir);
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
        posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
        r = posix_spawn(&daemon_pid, moeepd, &fa, NULL, argv, environ);
        posix_spawn_file_actions_destroy(&fa);
        if (r != 0) {
                say("cannot start %s: %s", moeepd, strerror(r));
                daemon_pid = -1;
                return -r;
        }
        deadline = now_ms() + 20000;
        while (now_ms() < deadline) {
                int fd = conn_open();

                if (fd >= 0) {
                        close(fd);
                        return 0;
                }
                if (!daemon_alive())
                        return -ESRCH;
                sleep_ms(20);
        }
        say("moeepd did not accept connections on %s within 20 s", sock_path);
        return -ETIMEDOUT;
}

static void daemon_fd_list(void) {
        char path[64], target[256];
        struct dirent *de;
        DIR *d;

        snprintf(path, sizeof(path), "/proc/%d/fd", (int)daemon_pid);
        d = opendir(path);
        if (!d)
                return;
        while ((de = readdir(d))) {
                ssize_t n;
                char link[400];

                if (de->d_name[0] == '.')
                        continue;
                snprintf(link, sizeof(link), "%s/%s", path, de->d_name);
                n = readlink(link, target, sizeof(target) - 1);
                target[n < 0 ? 0 : n] = 0;
                say("    fd %s -> %s", de->d_name, target);
        }
        closedir(d);
}

/* Waits until the daemon's fd count is `want` again. */
static int fds_settle(int want) {
        long deadline = now_ms() + SETTLE_TIMEOUT_MS;
        int n;

        do {
                n = proc_count_fds(daemon_pid);
                if (n == want)
                        return 0;
                sleep_ms(20);
        } while (now_ms() < deadline);
        say("moeepd holds %d descriptors, %d before the case:", n, want);
        daemon_fd_list();
        return -1;
}

/* ------------------------------------------------------------------ records */

static int send_request(int fd, Moeep__V1__Request *req, const int *fds, size_t nfds) {
        return moeep_record_send(fd, (uint16_t)req->body_case, next_request_id++, &req->base, fds, nfds);
}

/* Sends `len` bytes as one datagram with `nfds` descriptors (any number, so
 * it can exceed what record.c would send). */
static int send_raw(int fd, const void *buf, size_t len, const int *fds, size_t nfds) {
        size_t cl = nfds ? CMSG_SPACE(sizeof(int) * nfds) : 0;
        char *control = cl ? calloc(1, cl) : NULL;
        struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = cl };
        ssize_t n;

        if (nfds) {
                struct cmsghdr *c = CMSG_FIRSTHDR(&mh);

                c->cmsg_level = SOL_SOCKET;
                c->cmsg_type = SCM_RIGHTS;
                c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
                memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
        }
        n = sendmsg(fd, &mh, MSG_NOSIGNAL);
        free(control);
        if (n < 0)
                return -errno;
        return n == (ssize_t)len ? 0 : -EIO;
}

/* Receives the next record within `timeout_ms`: 0 with `rec` filled,
 * -ETIMEDOUT, -ECONNRESET when the daemon closed the session, or another
 * -errno. The caller releases rec's fds. */
static int recv_record(int fd, int timeout_ms) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        const char *why = NULL;
        int r;

        r = poll(&p, 1, timeout_ms);
        if (r < 0)
                return -errno;
        if (r == 0)
                return -ETIMEDOUT;
        r = moeep_record_recv(fd, &rec, &why);
        if (r == -EBADMSG || r == -EPROTONOSUPPORT)
                say("    (the daemon sent a malformed record: %s)", why ? why : "?");
        return r;
}

/* Receives the next response, skipping events (PeerLost may arrive at any
 * time). Returns the decoded response or NULL (with *ret_err set). */
static Moeep__V1__Response *recv_response(int fd, int *ret_err) {
        for (;;) {
                Moeep__V1__Response *resp;
                int r = recv_record(fd, REPLY_TIMEOUT_MS);

                if (r < 0) {
                        *ret_err = r;
                        return NULL;
                }
                if (rec.hdr.type >= MOEEP_TYPE_EVENT_MIN) {
                        moeep_record_release(&rec);
                        continue;
                }
                resp = moeep_record_decode_response(&rec);
                if (!resp) {
                        moeep_record_release(&rec);
                        *ret_err = -EBADMSG;
                        return NULL;
                }
                return resp;
        }
}

static const char *error_code_name(int code) {
        const ProtobufCEnumValue *v =
                protobuf_c_enum_descriptor_get_value(&moeep__v1__error_code__descriptor, code);

        return v ? v->name : "?";
}

/* Waits for the response to the request just sent; it must be of body case
 * `want` (the fds that came with it stay in `rec`). */
static Moeep__V1__Response *await_response(int fd, Moeep__V1__Response__BodyCase want, const char *what) {
        Moeep__V1__Response *resp;
        int r;

        resp = recv_response(fd, &r);
        if (!resp) {
                say("    %s: no response: %s", what, strerror(-r));
                return NULL;
        }
        if (resp->body_case != want) {
                if (resp->body_case == MOEEP__V1__RESPONSE__BODY_ERROR)
                        say("    %s: Error %s: %s", what, error_code_name(resp->error->code),
                            resp->error->message);
                else
                        say("    %s: response type %d, want %d", what, resp->body_case, want);
                moeep__v1__response__free_unpacked(resp, NULL);
                moeep_record_release(&rec);
                return NULL;
        }
        return resp;
}

/* Sends a request and expects a response of body case `want`. */
static Moeep__V1__Response *call(int fd, Moeep__V1__Request *req, const int *fds, size_t nfds,
                                 Moeep__V1__Response__BodyCase want, const char *what) {
        int r = send_request(fd, req, fds, nfds);

        if (r < 0) {
                say("    %s: send: %s", what, strerror(-r));
                return NULL;
        }
        return await_response(fd, want, what);
}

/* call() for requests whose reply only has to be of the right kind; drops
 * the reply and any fds it carried. */
static int call_done(int fd, Moeep__V1__Request *req, const int *fds, size_t nfds,
                     Moeep__V1__Response__BodyCase want, const char *what) {
        Moeep__V1__Response *resp = call(fd, req, fds, nfds, want, what);

        if (!resp)
                return -1;
        moeep__v1__response__free_unpacked(resp, NULL);
        moeep_record_release(&rec);
        return 0;
}

/* A valid Hello record in `buf`; returns its length. */
static size_t hello_record(uint8_t *buf) {
        Moeep__V1__Hello h = MOEEP__V1__HELLO__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        h.major = MOEEP_PROTOCOL_MAJOR;
        h.minor = MOEEP_PROTOCOL_MINOR;
        h.features = MOEEP__V1__FEATURE__FEATURE_REGIONS;
        h.pid = (uint32_t)getpid();
        h.client_name = "moeep-e2e-badinput";
        req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
        req.hello = &h;
        return (size_t)moeep_record_encode(buf, MOEEP__V1__REQUEST__BODY_HELLO, next_request_id++, &req.base,
                                           0);
}

static int hello(int fd) {
        uint8_t buf[MOEEP_RECORD_MAX];
        Moeep__V1__Response *resp;
        int r = send_raw(fd, buf, hello_record(buf), NULL, 0);

        if (r < 0) {
                say("    Hello: send: %s", strerror(-r));
                return -1;
        }
        resp = await_response(fd, MOEEP__V1__RESPONSE__BODY_WELCOME, "Hello");
        if (!resp)
                return -1;
        moeep__v1__response__free_unpacked(resp, NULL);
        moeep_record_release(&rec);
        return 0;
}

/* JobCreate; copies the unique id into `ret_id` (MOEEP_UNIQUE_ID_BYTES max). */
static int job_create(int fd, const char *name, uint32_t world, uint8_t *ret_id, size_t *ret_len) {
        Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;

        jc.name = (char *)name;
        jc.world_size = world;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
        req.job_create = &jc;
        resp = call(fd, &req, NULL, 0, MOEEP__V1__RESPONSE__BODY_JOB_CREATED, "JobCreate");
        if (!resp)
                return -1;
        if (resp->job_created->unique_id.len == 0 || resp->job_created->unique_id.len > 128) {
                say("    JobCreate: unique id of %zu bytes", resp->job_created->unique_id.len);
                moeep__v1__response__free_unpacked(resp, NULL);
                return -1;
        }
        memcpy(ret_id, resp->job_created->unique_id.data, resp->job_created->unique_id.len);
        *ret_len = resp->job_created->unique_id.len;
        moeep__v1__response__free_unpacked(resp, NULL);
        moeep_record_release(&rec);
        return 0;
}

static int job_join(int fd, const uint8_t *id, size_t id_len, uint32_t rank, uint32_t world) {
        Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        jj.unique_id.data = (uint8_t *)id;
        jj.unique_id.len = id_len;
        jj.rank = rank;
        jj.world_size = world;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
        req.job_join = &jj;
        return call_done(fd, &req, NULL, 0, MOEEP__V1__RESPONSE__BODY_JOB_JOINED, "JobJoin");
}

static int memfd_of(size_t size) {
        int fd = memfd_create("badinput", MFD_CLOEXEC);

        if (fd >= 0 && ftruncate(fd, (off_t)size) < 0) {
                close(fd);
                return -1;
        }
        return fd;
}

static int region_register(int fd, size_t size) {
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        int mfd = memfd_of(size), r;

        if (mfd < 0)
                return -1;
        rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        rr.size = size;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        r = call_done(fd, &req, &mfd, 1, MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED, "RegionRegister");
        close(mfd);
        return r;
}

static int job_leave(int fd) {
        Moeep__V1__JobLeave jl = MOEEP__V1__JOB_LEAVE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_LEAVE;
        req.job_leave = &jl;
        return call_done(fd, &req, NULL, 0, MOEEP__V1__RESPONSE__BODY_OK, "JobLeave");
}

/* A well-behaved client does a whole round; the daemon must serve it. */
static int fresh_client(void) {
        uint8_t id[128];
        size_t id_len = 0;
        int fd = conn_open(), r = -1;

        if (fd < 0) {
                say("    fresh client: connect: %s", strerror(-fd));
                return -1;
        }
        if (hello(fd) == 0 && job_create(fd, "badinput-probe", 1, id, &id_len) == 0 &&
            job_join(fd, id, id_len, 0, 1) == 0 && region_register(fd, 4096) == 0 && job_leave(fd) == 0)
                r = 0;
        close(fd);
        if (r < 0)
                say("    a well-behaved client was not served");
        return r;
}

/* After bad input on `fd`: the daemon may answer an Error (any of `codes`,
 * when given), and must then close the session. */
static int expect_error_then_close(int fd, const int *codes, size_t ncodes) {
        int r, got_error = 0;

        for (;;) {
                r = recv_record(fd, REPLY_TIMEOUT_MS);
                if (r == -ECONNRESET) {
                        say("    session closed%s", got_error ? " after the Error" : " without a reply");
                        return 0;
                }
                if (r == -ETIMEDOUT) {
                        say("    the daemon neither closed the session nor answered within %d ms",
                            REPLY_TIMEOUT_MS);
                        return -1;
                }
                if (r < 0) {
                        say("    reading the reply: %s", strerror(-r));
                        return -1;
                }
                if (rec.hdr.type == MOEEP__V1__RESPONSE__BODY_ERROR && !got_error) {
                        Moeep__V1__Response *resp = moeep_record_decode_response(&rec);
                        int ok = ncodes == 0;

                        if (!resp) {
                                say("    the daemon's Error record does not decode");
                                moeep_record_release(&rec);
                                return -1;
                        }
                        for (size_t i = 0; i < ncodes; i++)
                                ok |= (int)resp->error->code == codes[i];
                        say("    Error %s: %s", error_code_name(resp->error->code), resp->error->message);
                        if (!ok) {
                                say("    unexpected error code %d (%s)", resp->error->code,
                                    error_code_name(resp->error->code));
                                moeep__v1__response__free_unpacked(resp, NULL);
                                return -1;
                        }
                        moeep__v1__response__free_unpacked(resp, NULL);
                        got_error = 1;
                        continue;
                }
                say("    got record type %u after bad input, want an Error or the session closed",
                    rec.hdr.type);
                moeep_record_release(&rec);
                return -1;
        }
}

#endif
