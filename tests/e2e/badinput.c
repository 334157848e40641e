/* moeep-e2e-badinput: feeds a real moeepd every kind of bad input a client
 * can send and checks, after each, that
 *
 *   - the daemon answered an Error record (where it can tell the request id)
 *     and then closed the session, or closed it straight away;
 *   - it still serves a fresh client (Hello -> Welcome, JobCreate, JobJoin,
 *     RegionRegister, JobLeave);
 *   - its descriptor count (/proc/PID/fd) is back to where it was.
 *
 * Records are crafted with proto/record.h, the same framing the daemon uses,
 * then broken on purpose. The daemon runs on a socket in a temporary
 * directory; it is killed and the directory removed on every exit path, and
 * an alarm bounds the whole run.
 *
 * usage: moeep-e2e-badinput MOEEPD [CASE-NAME-SUBSTRING]
 * Exit status 0 when every case passed, 1 otherwise. */

/* The raw side of moeep-e2e-badinput (badinput.c): the daemon it starts on
 * a socket in a temporary directory (and kills, with the directory removed,
 * on every exit path), its descriptor count, and the records it sends and
 * reads, crafted with proto/record.h. */
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

/* ------------------------------------------------------------------ cases */

static size_t job_create_record(uint8_t *buf, size_t nfds) {
        Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        jc.name = "badinput";
        jc.world_size = 2;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
        req.job_create = &jc;
        return (size_t)moeep_record_encode(buf, MOEEP__V1__REQUEST__BODY_JOB_CREATE, next_request_id++,
                                           &req.base, nfds);
}

static void header_patch(uint8_t *buf, void (*patch)(struct moeep_record_header *)) {
        struct moeep_record_header h;

        memcpy(&h, buf, sizeof(h));
        patch(&h);
        memcpy(buf, &h, sizeof(h));
}

#define BAD(...)                                                  \
        expect_error_then_close(fd, (const int[]){ __VA_ARGS__ }, \
                                sizeof((const int[]){ __VA_ARGS__ }) / sizeof(int))

static uint64_t rng_state = 0x6d6f656570ull;
static uint8_t rng_byte(void) {
        rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
        return (uint8_t)(rng_state >> 56);
}

static int random_bytes(int fd, size_t len) {
        uint8_t buf[4096];

        for (size_t i = 0; i < len; i++)
                buf[i] = rng_byte();
        if (send_raw(fd, buf, len, NULL, 0) < 0)
                return -1;
        return expect_error_then_close(fd, NULL, 0);
}

static int case_random_short(int fd) {
        return random_bytes(fd, 7);
}
static int case_random_header(int fd) {
        return random_bytes(fd, sizeof(struct moeep_record_header));
}
static int case_random_long(int fd) {
        return random_bytes(fd, 1500);
}

static int case_empty_record(int fd) {
        if (send_raw(fd, "", 0, NULL, 0) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static int case_short_header(int fd) {
        uint8_t buf[MOEEP_RECORD_MAX];
        hello_record(buf);
        if (send_raw(fd, buf, 10, NULL, 0) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static int case_truncated(int fd) {
        uint8_t buf[MOEEP_RECORD_MAX];
        size_t len = hello_record(buf);

        /* The header promises the whole payload; half of it arrives. */
        if (send_raw(fd, buf,
                     sizeof(struct moeep_record_header) + (len - sizeof(struct moeep_record_header)) / 2,
                     NULL, 0) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static void set_long_length(struct moeep_record_header *h) {
        h->length = MOEEP_RECORD_MAX + 4096 - sizeof(*h);
}

static int case_oversized(int fd) {
        size_t len = MOEEP_RECORD_MAX + 4096;
        uint8_t *buf = calloc(1, len);
        int r;

        if (!buf)
                return -1;
        hello_record(buf);
        header_patch(buf, set_long_length);
        r = send_raw(fd, buf, len, NULL, 0);
        free(buf);
        if (r < 0) {
                say("    sending a %zu-byte record: %s", len, strerror(-r));
                return -1;
        }
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static void set_bad_magic(struct moeep_record_header *h) {
        h->magic = 0xdeadbeef;
}
static void set_bad_major(struct moeep_record_header *h) {
        h->major = MOEEP_PROTOCOL_MAJOR + 1;
}
static void set_unknown_request(struct moeep_record_header *h) {
        h->type = MOEEP_TYPE_REQUEST_MAX; /* in the request range, but no such request */
}
static void set_event_type(struct moeep_record_header *h) {
        h->type = MOEEP__V1__EVENT__BODY_SHUTDOWN; /* a known type a client may not send */
}
static void set_out_of_range_type(struct moeep_record_header *h) {
        h->type = 4000;
}
static void set_reserved(struct moeep_record_header *h) {
        h->reserved = 1;
}

static int send_patched_hello(int fd, void (*patch)(struct moeep_record_header *)) {
        uint8_t buf[MOEEP_RECORD_MAX];
        size_t len = hello_record(buf);

        header_patch(buf, patch);
        return send_raw(fd, buf, len, NULL, 0);
}

static int case_bad_magic(int fd) {
        if (send_patched_hello(fd, set_bad_magic) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static int case_bad_major(int fd) {
        if (send_patched_hello(fd, set_bad_major) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_VERSION_MISMATCH);
}

static int case_reserved_set(int fd) {
        if (send_patched_hello(fd, set_reserved) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static int case_unknown_type(int fd) {
        if (hello(fd) < 0 || send_patched_hello(fd, set_unknown_request) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static int case_event_from_client(int fd) {
        if (hello(fd) < 0 || send_patched_hello(fd, set_event_type) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static int case_type_out_of_range(int fd) {
        if (hello(fd) < 0 || send_patched_hello(fd, set_out_of_range_type) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static void set_one_fd(struct moeep_record_header *h) {
        h->nfds = 1;
}

/* Sends the record in `buf` with one memfd attached; it must be refused. */
static int send_with_fd_refused(int fd, const uint8_t *buf, size_t len) {
        int mfd = memfd_of(4096), r;

        if (mfd < 0)
                return -1;
        r = send_raw(fd, buf, len, &mfd, 1);
        close(mfd);
        if (r < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

/* A Hello with a descriptor the header owns up to: Hello may not carry any.
 * Where the kernel has SO_PASSRIGHTS (Linux 6.16+), the client socket takes
 * no descriptor at all before Welcome: the send itself fails (EPERM) and
 * the session goes on; elsewhere the daemon refuses the record. */
static int case_fd_on_hello(int fd) {
        uint8_t buf[MOEEP_RECORD_MAX];
        size_t len = hello_record(buf);
        int mfd = memfd_of(4096), r;

        if (mfd < 0)
                return -1;
        header_patch(buf, set_one_fd);
        r = send_raw(fd, buf, len, &mfd, 1);
        close(mfd);
        if (r == -EPERM) {
                say("    the socket takes no descriptor before Welcome (SO_PASSRIGHTS): EPERM");
                return hello(fd);
        }
        if (r < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

/* A descriptor the header does not mention. */
static int case_undeclared_fd(int fd) {
        uint8_t buf[MOEEP_RECORD_MAX];

        if (hello(fd) < 0)
                return -1;
        return send_with_fd_refused(fd, buf, job_create_record(buf, 0));
}

/* JobCreate with a declared descriptor: the type may not carry one. */
static int case_fd_on_job_create(int fd) {
        uint8_t buf[MOEEP_RECORD_MAX];

        if (hello(fd) < 0)
                return -1;
        return send_with_fd_refused(fd, buf, job_create_record(buf, 1));
}

/* RegionRegister (exactly one fd allowed) with `n` fds, declared. */
static int region_register_with(int fd, size_t n) {
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        uint8_t buf[MOEEP_RECORD_MAX];
        int *fds = calloc(n ? n : 1, sizeof(int)), r, len;
        uint8_t id[128];
        size_t id_len;

        if (!fds)
                return -1;
        if (hello(fd) < 0 || job_create(fd, "badinput-fds", 1, id, &id_len) < 0 ||
            job_join(fd, id, id_len, 0, 1) < 0) {
                free(fds);
                return -1;
        }
        rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        rr.size = 4096;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        len = moeep_record_encode(buf, MOEEP__V1__REQUEST__BODY_REGION_REGISTER, next_request_id++, &req.base,
                                  0);
        memcpy(buf + offsetof(struct moeep_record_header, nfds), &(uint16_t){ (uint16_t)n },
               sizeof(uint16_t));
        /* The same memfd n times: the daemon receives n descriptors. */
        fds[0] = memfd_of(4096);
        for (size_t i = 1; i < n; i++)
                fds[i] = fds[0];
        r = send_raw(fd, buf, (size_t)len, fds, n);
        close(fds[0]);
        free(fds);
        if (r < 0) {
                say("    sending %zu fds: %s", n, strerror(-r));
                return -1;
        }
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static int case_two_fds(int fd) {
        return region_register_with(fd, 2);
}
static int case_too_many_fds(int fd) {
        return region_register_with(fd, 200);
}
static int case_no_fd(int fd) {
        return region_register_with(fd, 0);
}

static int case_garbage_protobuf(int fd) {
        /* Tag 0x0f is field 1 with wire type 7, which does not exist. */
        static const uint8_t garbage[] = { 0x0f, 0xff, 0xff, 0xff, 0x0f, 0x0f, 0x0f, 0x07 };
        struct moeep_record_header h = {
                .magic = MOEEP_RECORD_MAGIC,
                .major = MOEEP_PROTOCOL_MAJOR,
                .type = MOEEP__V1__REQUEST__BODY_HELLO,
                .length = sizeof(garbage),
                .request_id = next_request_id++,
        };
        uint8_t buf[sizeof(h) + sizeof(garbage)];

        memcpy(buf, &h, sizeof(h));
        memcpy(buf + sizeof(h), garbage, sizeof(garbage));
        if (send_raw(fd, buf, sizeof(buf), NULL, 0) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

/* A well-formed JobCreate body under a Barrier header: the header type must
 * equal the body case. */
static int case_type_body_mismatch(int fd) {
        uint8_t buf[MOEEP_RECORD_MAX];
        size_t len;
        struct moeep_record_header h;

        if (hello(fd) < 0)
                return -1;
        len = job_create_record(buf, 0);
        memcpy(&h, buf, sizeof(h));
        h.type = MOEEP__V1__REQUEST__BODY_BARRIER;
        memcpy(buf, &h, sizeof(h));
        if (send_raw(fd, buf, len, NULL, 0) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static int case_request_before_hello(int fd) {
        uint8_t buf[MOEEP_RECORD_MAX];
        size_t len = job_create_record(buf, 0);

        if (send_raw(fd, buf, len, NULL, 0) < 0)
                return -1;
        return BAD(MOEEP__V1__ERROR_CODE__ERROR_NOT_WELCOMED);
}

static int case_second_hello(int fd) {
        uint8_t buf[MOEEP_RECORD_MAX];
        size_t len;
        Moeep__V1__Response *resp;
        int r;

        if (hello(fd) < 0)
                return -1;
        len = hello_record(buf);
        if (send_raw(fd, buf, len, NULL, 0) < 0)
                return -1;
        /* A repeated Hello is a protocol error; an Error is all it may get
         * (the session may go on or be closed). */
        resp = recv_response(fd, &r);
        if (!resp)
                return r == -ECONNRESET ? 0 : (say("    second Hello: %s", strerror(-r)), -1);
        r = resp->body_case == MOEEP__V1__RESPONSE__BODY_ERROR ? 0 : -1;
        say("    second Hello answered with %s",
            r == 0 ? error_code_name(resp->error->code) : "something other than an Error");
        moeep__v1__response__free_unpacked(resp, NULL);
        moeep_record_release(&rec);
        return r;
}

/* Connects, says nothing, and stays connected while a well-behaved client
 * is served. */
static int case_silent_client(int fd) {
        long t0 = now_ms();
        int r = fresh_client();

        if (r == 0)
                say("    served another client in %ld ms while this one sat silent", now_ms() - t0);
        return r;
}

/* Has a forked child connect, Hello, and send JobJoin (rank 1 of a job this
 * process created); `when` says when it dies: 0 = right after sending JobJoin,
 * 1 = after it joined and registered a region (then the parent kills it).
 * The parent, rank 0, must get a PeerLost event naming rank 1 when the child
 * had joined. */
static int killed_mid_join(int fd, int when) {
        uint8_t id[128];
        size_t id_len;
        int pipefd[2], status, r = -1;
        pid_t child;
        char c;

        if (hello(fd) < 0 || job_create(fd, "badinput-kill", 2, id, &id_len) < 0 ||
            job_join(fd, id, id_len, 0, 2) < 0)
                return -1;
        if (pipe2(pipefd, O_CLOEXEC) < 0)
                return -1;
        fflush(stdout);
        child = fork();
        if (child < 0)
                return -1;
        if (child == 0) {
                int cfd = conn_open();
                Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
                Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

                daemon_pid = -1; /* the parent owns it */
                if (cfd < 0 || hello(cfd) < 0)
                        _exit(1);
                if (when == 0) {
                        jj.unique_id.data = id;
                        jj.unique_id.len = id_len;
                        jj.rank = 1;
                        jj.world_size = 2;
                        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
                        req.job_join = &jj;
                        send_request(cfd, &req, NULL, 0);
                        raise(SIGKILL);
                }
                if (job_join(cfd, id, id_len, 1, 2) < 0 || region_register(cfd, 8192) < 0)
                        _exit(1);
                (void)!write(pipefd[1], "j", 1);
                pause();
                _exit(0);
        }
        close(pipefd[1]);
        if (when == 1) {
                struct pollfd p = { .fd = pipefd[0], .events = POLLIN };

                if (poll(&p, 1, REPLY_TIMEOUT_MS) != 1 || read(pipefd[0], &c, 1) != 1) {
                        say("    the child did not join");
                        kill(child, SIGKILL);
                        waitpid(child, NULL, 0);
                        close(pipefd[0]);
                        return -1;
                }
                kill(child, SIGKILL);
        }
        close(pipefd[0]);
        waitpid(child, &status, 0);
        if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) {
                say("    the child failed before it was killed (status %#x)", status);
                return -1;
        }
        if (when == 0) {
                /* Whether its join got in before it died is a race; the
                 * daemon must cope either way. Leave and go. */
                say("    child killed right after sending JobJoin");
                return 0;
        }
        /* Rank 1 joined and died: rank 0 must hear of it. */
        for (;;) {
                Moeep__V1__Event *ev;
                int rr = recv_record(fd, REPLY_TIMEOUT_MS);

                if (rr < 0) {
                        say("    no PeerLost event after rank 1 was killed: %s", strerror(-rr));
                        return -1;
                }
                ev = moeep_record_decode_event(&rec);
                moeep_record_release(&rec);
                if (!ev) {
                        /* A response here would be to nothing we asked. */
                        say("    got record type %u, want a PeerLost event", rec.hdr.type);
                        return -1;
                }
                if (ev->body_case == MOEEP__V1__EVENT__BODY_PEER_LOST) {
                        r = ev->peer_lost->rank == 1 ? 0 : -1;
                        say("    PeerLost: rank %u (%s)%s", ev->peer_lost->rank, ev->peer_lost->reason,
                            r == 0 ? "" : ", want rank 1");
                        moeep__v1__event__free_unpacked(ev, NULL);
                        return r;
                }
                moeep__v1__event__free_unpacked(ev, NULL);
        }
}

static int case_killed_after_join_sent(int fd) {
        return killed_mid_join(fd, 0);
}
static int case_killed_after_join(int fd) {
        return killed_mid_join(fd, 1);
}

struct bad_case {
        const char *name;
        int (*run)(int fd);
};

static const struct bad_case cases[] = {
        { "random bytes, shorter than a header", case_random_short },
        { "random bytes, header-sized", case_random_header },
        { "random bytes, 1500", case_random_long },
        { "empty record", case_empty_record },
        { "record shorter than its header", case_short_header },
        { "truncated record", case_truncated },
        { "oversized record (> 64 KiB)", case_oversized },
        { "wrong magic", case_bad_magic },
        { "wrong protocol major", case_bad_major },
        { "reserved header field set", case_reserved_set },
        { "unknown request type", case_unknown_type },
        { "event type sent by a client", case_event_from_client },
        { "type out of every range", case_type_out_of_range },
        { "fd on a Hello", case_fd_on_hello },
        { "fd the header does not declare", case_undeclared_fd },
        { "fd on a JobCreate", case_fd_on_job_create },
        { "RegionRegister without its fd", case_no_fd },
        { "RegionRegister with 2 fds", case_two_fds },
        { "too many fds (200)", case_too_many_fds },
        { "valid header, garbage protobuf", case_garbage_protobuf },
        { "header type differs from body case", case_type_body_mismatch },
        { "request before Hello", case_request_before_hello },
        { "second Hello", case_second_hello },
        { "client that connects and sends nothing", case_silent_client },
        { "client killed right after sending JobJoin", case_killed_after_join_sent },
        { "client killed after joining", case_killed_after_join },
};

static int run_case(const struct bad_case *c, int baseline) {
        int fd, r;

        say("case: %s", c->name);
        fd = conn_open();
        if (fd < 0) {
                say("    connect: %s", strerror(-fd));
                return -1;
        }
        r = c->run(fd);
        close(fd);
        if (!daemon_alive()) {
                say("not ok - %s: moeepd is gone", c->name);
                return -1;
        }
        if (r == 0)
                r = fresh_client();
        if (r == 0)
                r = fds_settle(baseline);
        if (r == 0 && !daemon_alive())
                r = -1;
        say("%s - %s", r == 0 ? "ok" : "not ok", c->name);
        return r;
}

int main(int argc, char **argv) {
        int baseline, failed = 0, ran = 0, status;
        long deadline;

        if (argc < 2 || argc > 3) {
                fprintf(stderr, "usage: %s MOEEPD [CASE-NAME-SUBSTRING]\n", argv[0]);
                return 2;
        }
        signal(SIGPIPE, SIG_IGN);
        cleanup_setup();
        test_tmp_path(tmpdir, sizeof(tmpdir), "moeep-badinput.XXXXXX");
        if (!mkdtemp(tmpdir)) {
                perror("mkdtemp");
                return 1;
        }
        cleanup_add_dir(tmpdir);
        if (daemon_start(argv[1]) < 0) {
                show_log();
                return 1;
        }
        /* The baseline is taken after one full round, so lazily opened
         * descriptors do not count as leaks. */
        if (fresh_client() < 0 || fresh_client() < 0) {
                say("moeepd does not serve a well-behaved client; nothing else can be checked");
                show_log();
                return 1;
        }
        sleep_ms(200);
        baseline = proc_count_fds(daemon_pid);
        say("moeepd pid %d holds %d descriptors", (int)daemon_pid, baseline);

        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                if (argc == 3 && !strstr(cases[i].name, argv[2]))
                        continue;
                ran++;
                if (run_case(&cases[i], baseline) < 0) {
                        failed++;
                        if (!daemon_alive())
                                break;
                }
        }

        /* SIGTERM must stop it cleanly (under ASan this also catches leaks). */
        if (daemon_alive()) {
                kill(daemon_pid, SIGTERM);
                deadline = now_ms() + 15000;
                while (waitpid(daemon_pid, &status, WNOHANG) == 0 && now_ms() < deadline)
                        sleep_ms(20);
                if (now_ms() >= deadline) {
                        say("not ok - moeepd did not exit within 15 s of SIGTERM");
                        failed++;
                } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
                        say("not ok - moeepd exited with %s %d after SIGTERM",
                            WIFEXITED(status) ? "status" : "signal",
                            WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
                        failed++;
                } else {
                        say("ok - moeepd exited 0 on SIGTERM");
                }
                daemon_pid = -1;
        } else {
                failed++;
        }
        if (failed)
                show_log();
        say("badinput: %d of %d cases failed", failed, ran);
        return failed ? 1 : 0;
}
