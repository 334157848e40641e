/* libFuzzer target: the request dispatcher (daemon/clients/session.c with job.c,
 * broker.c and query.c behind it).
 *
 * A real daemon object runs in-process on a private socket (as in
 * tests/unit/test-session.c); its loop is pumped by the harness. An input
 * is a program of operations by up to NCLIENTS clients: connect, close,
 * well-formed requests built from fuzzed fields (Hello, JobCreate, JobJoin
 * with the last unique id the daemon handed out, intact or damaged,
 * RegionRegister with memfds, pipes or /dev/null, Barrier, ...), requests
 * with a correct header and a fuzzed payload, requests of up to a whole
 * record of fields the daemon does not know (each must be handled within
 * UNKNOWN_HANDLE_MAX_US), and raw datagrams. Every op
 * byte is  (client << 5) | opcode.
 *
 * After every operation the daemon's state must be consistent (sessions,
 * members, jobs, regions and per-uid charges agree; every cap holds) and
 * every record it sent must be a well-formed Response or Event. After the
 * input every client closes: no session, job, region or descriptor may be
 * left behind. Lower caps than the defaults make the limits reachable. */
#include <dirent.h>
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <syslog.h>
#include <time.h>
#include <unistd.h>

#include "../tmpdir.h"
#include "clients/session.h"
#include "daemon.h"
#include "fuzz.h"
#include "log.h"
#include "record.h"
#include "state/broker.h"
#include "state/clientfd.h"
#include "state/job.h"

#define NCLIENTS 4
#define MAX_IDS 8

static struct daemon d;
static char sock_path[96];
static int devnull = -1;
static int fds_baseline;
static struct moeep_record rec;
static uint8_t buf[MOEEP_RECORD_MAX];

/* Per input. */
static int clients[NCLIENTS];
static uint8_t unique_id[JOB_UNIQUE_ID_BYTES];
static bool have_unique_id;
static uint64_t region_ids[MAX_IDS];
static size_t nregion_ids;
static uint64_t next_rid;

/* Up to `max` bytes of the input, as they are (length from two bytes). */
static size_t take_bytes(struct input *in, size_t max, const uint8_t **ret) {
        size_t n = take8(in);

        n = n | (size_t)take8(in) << 8;
        return take_span(in, n, max, ret);
}

static int count_fds(void) {
        DIR *dir = opendir("/proc/self/fd");
        struct dirent *e;
        int n = 0;

        if (!dir)
                abort();
        while ((e = readdir(dir)))
                n += e->d_name[0] != '.';
        closedir(dir);
        return n - 1;
}

static void pump(void) {
        for (int i = 0; i < 4; i++)
                event_base_loop(d.base, EVLOOP_NONBLOCK);
}

static char dir[64];

static void cleanup(void) {
        char admin[sizeof(dir) + 32];

        unlink(sock_path);
        rmdir(dir);
        snprintf(admin, sizeof(admin), "%s-admin/moeepd.sock", dir);
        unlink(admin);
        snprintf(admin, sizeof(admin), "%s-admin", dir);
        rmdir(admin);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        struct daemon_options o = { .log_level = "err", .no_config = true };

        /* A directory of its own: the admin socket goes beside it, in
         * DIR-admin (proto/admin-socket.h). Both go with the process. */
        test_tmp_path(dir, sizeof(dir), "moeep-fuzz-session.XXXXXX");
        if (!mkdtemp(dir))
                abort();
        atexit(cleanup);
        snprintf(sock_path, sizeof(sock_path), "%s/moeepd.sock", dir);
        o.socket = sock_path;
        if (daemon_init(&d, &o) < 0)
                abort();
        /* Caps low enough for short inputs to reach them. */
        d.config.max_sessions_per_uid = 3;
        d.config.max_jobs_per_uid = 2;
        d.config.max_regions_per_session = 3;
        d.config.max_fds_per_uid = 4 + 2 * JOB_CONTROL_FDS; /* and the jobs' control pages */
        d.config.max_region_bytes_per_uid = 1 << 20;
        devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (devnull < 0)
                abort();
        for (int i = 0; i < NCLIENTS; i++)
                clients[i] = -1;
        fds_baseline = count_fds();
        return 0;
}

static void client_close(int c) {
        if (clients[c] >= 0) {
                close(clients[c]);
                clients[c] = -1;
        }
}

static void client_connect(int c) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        int fd;

        client_close(c);
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
                abort();
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock_path);
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
                abort();
        clients[c] = fd;
}

/* Reads what the daemon sent to every client. Everything must decode;
 * JobCreated and RegionRegistered are remembered for later operations. */
static void drain(void) {
        for (int c = 0; c < NCLIENTS; c++) {
                while (clients[c] >= 0) {
                        const char *why = NULL;
                        int r = moeep_record_recv(clients[c], &rec, &why);

                        if (r == -EAGAIN)
                                break;
                        if (r == -ECONNRESET) {
                                client_close(c);
                                break;
                        }
                        if (r < 0) {
                                fprintf(stderr, "fuzz-session: the daemon sent a bad record: %s (%d)\n",
                                        why ? why : "?", r);
                                abort();
                        }
                        if (rec.hdr.type >= MOEEP_TYPE_EVENT_MIN) {
                                Moeep__V1__Event *ev = moeep_record_decode_event(&rec);

                                if (!ev)
                                        abort();
                                moeep__v1__event__free_unpacked(ev, NULL);
                        } else {
                                Moeep__V1__Response *resp = moeep_record_decode_response(&rec);

                                if (!resp)
                                        abort();
                                if (resp->body_case == MOEEP__V1__RESPONSE__BODY_JOB_CREATED &&
                                    resp->job_created->unique_id.len == JOB_UNIQUE_ID_BYTES) {
                                        memcpy(unique_id, resp->job_created->unique_id.data,
                                               JOB_UNIQUE_ID_BYTES);
                                        have_unique_id = true;
                                }
                                if (resp->body_case == MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED)
                                        region_ids[nregion_ids++ % MAX_IDS] =
                                                resp->region_registered->region_id;
                                if (resp->body_case == MOEEP__V1__RESPONSE__BODY_REGIONS &&
                                    resp->regions->n_regions != rec.nfds)
                                        abort();
                                moeep__v1__response__free_unpacked(resp, NULL);
                        }
                        moeep_record_release(&rec);
                }
        }
}

/* The daemon's invariants, checked between operations. */
static void check_consistent(void) {
        const struct session *s;
        const struct job *job;
        const struct uid_usage *u;
        uint32_t nsessions = 0, njobs = 0, nregions = 0, usage_fds = 0;
        uint64_t usage_bytes = 0, region_bytes = 0;

        TAILQ_FOREACH (s, &d.sessions->list, entry) {
                nsessions++;
                if ((s->state == SESSION_READY) != (s->member != NULL))
                        abort();
                if (s->member &&
                    (s->member->owner != s || s->member->job->ranks[s->member->rank] != s->member))
                        abort();
        }
        if (nsessions != d.sessions->count)
                abort();
        TAILQ_FOREACH (job, &d.jobs->list, entry) {
                uint32_t joined = 0;

                njobs++;
                if (job->world_size < 1 || job->world_size > MOEEP_MAX_RANKS)
                        abort();
                if (jobs_count_uid(d.jobs, job->owner_uid) > d.config.max_jobs_per_uid)
                        abort();
                if (job->control->abort != (job->state == JOB_ABORTED))
                        abort();
                for (uint32_t r = 0; r < MOEEP_MAX_RANKS; r++) {
                        const struct job_member *m = job->ranks[r];
                        const struct region *reg;
                        uint32_t n = 0;

                        if (!m)
                                continue;
                        if (r >= job->world_size || m->rank != r || m->job != job)
                                abort();
                        joined++;
                        TAILQ_FOREACH (reg, &m->regions, entry) {
                                if (reg->owner != m)
                                        abort();
                                n++;
                                region_bytes += reg->size;
                        }
                        if (n != m->nregions || n > d.config.max_regions_per_session)
                                abort();
                        nregions += n;
                }
                if (joined != job->njoined || (job->state == JOB_READY && joined != job->world_size))
                        abort();
        }
        if (njobs != d.jobs->count || nregions != d.broker->nregions)
                abort();
        LIST_FOREACH (u, &d.broker->usage, entry) {
                if (u->fds > d.config.max_fds_per_uid || u->bytes > d.config.max_region_bytes_per_uid)
                        abort();
                usage_fds += u->fds;
                usage_bytes += u->bytes;
        }
        if (usage_fds != nregions || usage_bytes != region_bytes)
                abort();
}

/* Sends a request built from `req` with `fds`; header nfds may be made to
 * lie by `nfds_delta`. */
static void send_request(int c, Moeep__V1__Request *req, const int *fds, size_t nfds, int nfds_delta) {
        struct moeep_record_header hdr;
        int len;

        if (clients[c] < 0)
                return;
        len = moeep_record_encode(buf, (uint16_t)req->body_case, ++next_rid, &req->base, nfds);
        if (len < 0)
                return;
        if (nfds_delta) {
                memcpy(&hdr, buf, sizeof(hdr));
                hdr.nfds = (uint16_t)(hdr.nfds + nfds_delta);
                memcpy(buf, &hdr, sizeof(hdr));
        }
        (void)moeep_record_send_raw(clients[c], buf, (size_t)len, fds, nfds);
}

/* A string of up to `max` input bytes (NUL-terminated in `out`). */
static char *take_string(struct input *in, char *out, size_t max) {
        const uint8_t *p;
        size_t n = take_bytes(in, max, &p);

        memcpy(out, p, n);
        out[n] = '\0';
        return out;
}

static void op_register(struct input *in, int c) {
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        uint8_t how = take8(in);
        uint32_t fsize = take32(in) % (2u << 20);
        int fds[2] = { -1, -1 }, pipefd[2] = { -1, -1 };
        size_t nfds = 1;

        rr.kind = (Moeep__V1__RegionKind)(take8(in) % 5);
        rr.size = how & 0x80 ? take64(in) : take32(in) % (2u << 20);
        rr.tag = take8(in) % 4;
        switch (how % 6) {
        case 0:
        case 1:
                fds[0] = memfd_create("fuzz-region", MFD_CLOEXEC);
                if (fds[0] < 0 || ftruncate(fds[0], fsize) < 0)
                        abort();
                break;
        case 2:
                fds[0] = dup(devnull);
                break;
        case 3:
                if (pipe2(pipefd, O_CLOEXEC) < 0)
                        abort();
                fds[0] = pipefd[0];
                break;
        case 4:
                nfds = 0;
                break;
        case 5:
                fds[0] = dup(devnull);
                fds[1] = dup(devnull);
                nfds = 2;
                break;
        }
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        send_request(c, &req, fds, nfds, (how & 0x40) ? 1 : 0);
        for (int i = 0; i < 2; i++)
                if (fds[i] >= 0)
                        close(fds[i]);
        if (pipefd[1] >= 0)
                close(pipefd[1]);
}

static void op_join(struct input *in, int c) {
        Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        uint8_t id[MOEEP_UNIQUE_ID_BYTES] = { 0 };
        uint8_t how = take8(in);
        char uuid[80];

        memcpy(id, unique_id, sizeof(unique_id));
        jj.unique_id.data = id;
        jj.unique_id.len = JOB_UNIQUE_ID_BYTES;
        switch (how % 6) {
        case 0: /* as handed out */
        case 1:
                break;
        case 2: /* one secret bit flipped */
                id[9 + take8(in) % JOB_SECRET_BYTES] ^= (uint8_t)(1u << (take8(in) % 8));
                break;
        case 3: /* another job id */
                id[1] ^= take8(in);
                break;
        case 4: /* padded like the client's 128-byte copy, or cut short */
                jj.unique_id.len = take8(in) % (MOEEP_UNIQUE_ID_BYTES + 2);
                break;
        case 5: /* fuzzed bytes */
                jj.unique_id.len = take8(in) % (MOEEP_UNIQUE_ID_BYTES + 2);
                for (size_t i = 0; i < jj.unique_id.len && i < sizeof(id); i++)
                        id[i] = take8(in);
                break;
        }
        if (jj.unique_id.len > sizeof(id))
                jj.unique_id.len = sizeof(id);
        jj.rank = take8(in) % 10;
        jj.world_size = take8(in) % 10;
        jj.gpu_uuid = how & 0x80 ? take_string(in, uuid, 70) : (char *)"";
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
        req.job_join = &jj;
        send_request(c, &req, NULL, 0, 0);
}

/* A record with a correct header and a fuzzed payload, with 0..2 memfds. */
static void op_fuzzed_payload(struct input *in, int c) {
        struct moeep_record_header hdr = { .magic = MOEEP_RECORD_MAGIC, .major = MOEEP_PROTOCOL_MAJOR };
        uint8_t how = take8(in);
        const uint8_t *p;
        size_t n = take_bytes(in, sizeof(buf) - sizeof(hdr), &p);
        int fds[2];
        size_t nfds = how % 3;

        if (clients[c] < 0)
                return;
        hdr.type = (uint16_t)(how & 0x80 ? take8(in) : 1 + take8(in) % 20);
        hdr.nfds = (uint16_t)nfds;
        hdr.length = (uint32_t)n;
        hdr.request_id = ++next_rid;
        memcpy(buf, &hdr, sizeof(hdr));
        memcpy(buf + sizeof(hdr), p, n);
        for (size_t i = 0; i < nfds; i++) {
                fds[i] = memfd_create("fuzz-payload", MFD_CLOEXEC);
                if (fds[i] < 0 || ftruncate(fds[i], 4096) < 0)
                        abort();
        }
        (void)moeep_record_send_raw(clients[c], buf, sizeof(hdr) + n, fds, nfds);
        for (size_t i = 0; i < nfds; i++)
                close(fds[i]);
}

/* Longest the daemon took to handle a request of more unknown fields than
 * a message may carry (record.h's MOEEP_RECORD_UNKNOWN_MAX): they are
 * refused before protobuf-c decodes them, which took about 1.4 ms (and
 * more under the sanitizers) for 21,800 of them. */
#define UNKNOWN_HANDLE_MAX_US 20000

static uint64_t mono_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* A request whose body carries many fields the daemon does not know (up to
 * a whole record of them), under a field number and wire type from the
 * input: refused (ERROR_BAD_RECORD) past MOEEP_RECORD_UNKNOWN_MAX, and
 * quickly, however many there are. */
static void op_unknown_fields(struct input *in, int c) {
        struct moeep_record_header hdr = { .magic = MOEEP_RECORD_MAGIC, .major = MOEEP_PROTOCOL_MAJOR };
        uint8_t how = take8(in), type = (uint8_t)(1 + take8(in) % 17);
        uint32_t field = 100 + take8(in), count = 1 + (uint32_t)take8(in) * 100, n = 0, inner;
        static uint8_t body[MOEEP_RECORD_MAX];
        uint64_t t0;

        if (clients[c] < 0)
                return;
        /* The fields: varints (3 bytes) or empty strings (3 bytes). */
        for (uint32_t i = 0; i < count && n + 3 <= sizeof(body) - 64; i++) {
                body[n++] = (uint8_t)(((field << 3) | (how & 1 ? 2 : 0)) | 0x80);
                body[n++] = (uint8_t)(field >> 4);
                body[n++] = how & 1 ? 0 : 1;
        }
        inner = n;
        hdr.type = type;
        hdr.request_id = ++next_rid;
        /* Request{<type>: {fields}}: the body case's tag and length first. */
        {
                size_t h = sizeof(hdr);

                buf[h++] = (uint8_t)((type << 3) | 2);
                do {
                        buf[h++] = (uint8_t)((inner & 0x7f) | (inner > 0x7f ? 0x80 : 0));
                        inner >>= 7;
                } while (inner);
                memcpy(buf + h, body, n);
                hdr.length = (uint32_t)(h - sizeof(hdr) + n);
        }
        memcpy(buf, &hdr, sizeof(hdr));
        if (moeep_record_send_raw(clients[c], buf, sizeof(hdr) + hdr.length, NULL, 0) < 0)
                return;
        t0 = mono_us();
        pump();
        if (n / 3 > MOEEP_RECORD_UNKNOWN_MAX && mono_us() - t0 > UNKNOWN_HANDLE_MAX_US) {
                fprintf(stderr,
                        "fuzz-session: a request of %u unknown fields took %" PRIu64 " us to handle\n", n / 3,
                        mono_us() - t0);
                abort();
        }
}

static void op_raw(struct input *in, int c) {
        const uint8_t *p;
        size_t n = take_bytes(in, sizeof(buf), &p);

        if (clients[c] >= 0 && n > 0)
                (void)moeep_record_send_raw(clients[c], p, n, NULL, 0);
}

static void op(struct input *in) {
        uint8_t b = take8(in);
        int c = (b >> 5) % NCLIENTS;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Hello hello = MOEEP__V1__HELLO__INIT;
        Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
        Moeep__V1__JobLeave jl = MOEEP__V1__JOB_LEAVE__INIT;
        Moeep__V1__Barrier bar = MOEEP__V1__BARRIER__INIT;
        Moeep__V1__RegionsFetch rf = MOEEP__V1__REGIONS_FETCH__INIT;
        Moeep__V1__RegionRelease rel = MOEEP__V1__REGION_RELEASE__INIT;
        Moeep__V1__StatusGet st = MOEEP__V1__STATUS_GET__INIT;
        Moeep__V1__JobsList jobs = MOEEP__V1__JOBS_LIST__INIT;
        Moeep__V1__ClientsList cl = MOEEP__V1__CLIENTS_LIST__INIT;
        char text[80];
        uint8_t x;

        switch (b & 0x1f) {
        case 0:
        case 1:
                client_connect(c);
                break;
        case 2:
                client_close(c);
                break;
        case 3:
        case 4:
                x = take8(in);
                hello.major = x == 0xff ? 2 : MOEEP_PROTOCOL_MAJOR;
                hello.minor = x & 3;
                hello.features = take64(in);
                hello.client_name = x & 0x40 ? take_string(in, text, 70) : (char *)"fuzz";
                req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
                req.hello = &hello;
                send_request(c, &req, NULL, 0, 0);
                break;
        case 5:
        case 6:
                x = take8(in);
                jc.name = x & 0x80 ? take_string(in, text, 70) : (char *)"fuzz job";
                jc.world_size = x % 10;
                req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
                req.job_create = &jc;
                send_request(c, &req, NULL, 0, 0);
                break;
        case 7:
        case 8:
        case 9:
                op_join(in, c);
                break;
        case 10:
                req.body_case = MOEEP__V1__REQUEST__BODY_JOB_LEAVE;
                req.job_leave = &jl;
                send_request(c, &req, NULL, 0, 0);
                break;
        case 11:
        case 12:
                req.body_case = MOEEP__V1__REQUEST__BODY_BARRIER;
                req.barrier = &bar;
                send_request(c, &req, NULL, 0, 0);
                break;
        case 13:
        case 14:
                op_register(in, c);
                break;
        case 15:
                x = take8(in);
                rf.rank = x & 0x80 ? (int32_t)take32(in) : (int32_t)(x % 10) - 1;
                rf.tag = x & 0x40 ? (int64_t)take64(in) : (int64_t)(take8(in) % 5) - 1;
                req.body_case = MOEEP__V1__REQUEST__BODY_REGIONS_FETCH;
                req.regions_fetch = &rf;
                send_request(c, &req, NULL, 0, 0);
                break;
        case 16:
                x = take8(in);
                rel.region_id = x & 0x80 || nregion_ids == 0 ? take64(in) : region_ids[x % MAX_IDS];
                req.body_case = MOEEP__V1__REQUEST__BODY_REGION_RELEASE;
                req.region_release = &rel;
                send_request(c, &req, NULL, 0, 0);
                break;
        case 17:
                req.body_case = MOEEP__V1__REQUEST__BODY_STATUS_GET;
                req.status_get = &st;
                send_request(c, &req, NULL, 0, 0);
                break;
        case 18:
                req.body_case = MOEEP__V1__REQUEST__BODY_JOBS_LIST;
                req.jobs_list = &jobs;
                send_request(c, &req, NULL, 0, 0);
                break;
        case 19:
                req.body_case = MOEEP__V1__REQUEST__BODY_CLIENTS_LIST;
                req.clients_list = &cl;
                send_request(c, &req, NULL, 0, 0);
                break;
        case 20:
        case 21:
        case 22:
                op_fuzzed_payload(in, c);
                break;
        case 23:
                op_raw(in, c);
                break;
        case 24:
                op_unknown_fields(in, c);
                break;
        default: /* nothing queued for this client: just let the loop run */
                break;
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        struct input in = { .p = data, .left = size };
        int fds;

        /* Daemon-wide settings an input may change (Drain, LogLevelSet as
         * root, who is an admin) start each input the same. */
        d.jobs->draining = false;
        log_set_level(LOG_ERR);
        have_unique_id = false;
        memset(unique_id, 0, sizeof(unique_id));
        nregion_ids = 0;
        for (int steps = 0; in.left > 0 && steps < 256; steps++) {
                op(&in);
                pump();
                drain();
                check_consistent();
        }
        for (int c = 0; c < NCLIENTS; c++)
                client_close(c);
        /* Sessions that still flush an error linger at most 1 s; a closed
         * peer ends that at once, so a few rounds are enough. A session
         * held back (its uid's share of the loop spent, or its next
         * record's fds waiting for closes) notices its peer's end when it
         * is read again, within its hold (at most 1 s): then wait. */
        for (int i = 0; i < 1500 && (d.sessions->count > 0 || !TAILQ_EMPTY(&d.sessions->dead)); i++) {
                pump();
                if (i >= 50)
                        usleep(1000);
        }
        check_consistent();
        if (d.sessions->count != 0 || !TAILQ_EMPTY(&d.sessions->dead) || d.jobs->count != 0 ||
            d.broker->nregions != 0 || !LIST_EMPTY(&d.broker->usage)) {
                fprintf(stderr, "fuzz-session: left behind %u sessions, %u jobs, %u regions\n",
                        d.sessions->count, d.jobs->count, d.broker->nregions);
                abort();
        }
        /* libFuzzer's RSS watcher thread opens /proc files for a moment:
         * a real leak stays, so look again before calling it one. (Its
         * symbolizer, started the first time it prints a NEW_FUNC line,
         * keeps two pipes open for good: run-fuzz.sh passes
         * -print_funcs=0.) */
        clientfds_settle(d.clientfds, 1000); /* client fds close off the loop */
        fds = count_fds();
        for (int i = 0; i < 3 && fds != fds_baseline; i++) {
                usleep(1000);
                fds = count_fds();
        }
        if (fds != fds_baseline) {
                fprintf(stderr, "fuzz-session: %d descriptors open, %d before\n", fds, fds_baseline);
                abort();
        }
        return 0;
}
