/* moeep-e2e-rank: one rank of an end-to-end job, using only libmoeep's public
 * API (moeep.h). The e2e tests and scripts/demo.sh start several of these.
 *
 * A rank connects, rank 0 creates the job and publishes its unique id in a
 * file (written to a temporary name and renamed, so readers never see half
 * of it), every rank joins, registers a memfd region filled with a pattern
 * that only its rank and a random seed (kept in the region's header)
 * determine, waits at a barrier, fetches every peer's region, maps it and
 * checks the pattern, waits at a second barrier and leaves. With --hold it
 * stays in the job (so moeepctl can see it) until SIGUSR1 or SIGTERM.
 *
 * --outsider plays a client that is not in the job: every way it tries to get
 * the job's regions must be refused.
 *
 * Exit status: 0 when everything checked out, 1 on a mismatch or a refused
 * request, 2 on bad usage, 3 on timeout. Every failure prints one line naming
 * the rank, what was wrong and the value seen. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "moeep.h"
#include "../job-id.h"

#define REGION_MAGIC 0x4b4e4152u /* "RANK" */
#define REGION_TAG 7
#define DEFAULT_REGION_SIZE (64 * 1024)

/* Layout of the first bytes of every rank's region; the pattern follows it
 * up to the end of the region. */
struct region_header {
        uint32_t magic;      /* REGION_MAGIC */
        uint32_t rank;       /* owner's rank */
        uint32_t world_size; /* owner's view of the job's size */
        uint32_t reserved;
        uint64_t job_id; /* owner's job, from moeep_job_info() */
        uint64_t seed;   /* random; with the rank it determines the pattern */
};

struct options {
        const char *socket;
        const char *id_file;
        const char *ready_file;
        const char *name;
        int create;
        int join;
        int outsider;
        int rank;
        int world;
        int hold;
        unsigned timeout;
        size_t size;
};

static int me = -1; /* this rank, for messages */

static void fail_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail_msg(const char *fmt, ...) {
        va_list ap;

        if (me >= 0)
                fprintf(stderr, "rank %d: ", me);
        else
                fprintf(stderr, "moeep-e2e-rank: ");
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
}

static void on_alarm(int sig) {
        static const char msg[] = "moeep-e2e-rank: timed out (--timeout), giving up\n";

        (void)sig;
        (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
        _exit(3);
}

/* splitmix64: the pattern generator; every byte of a region is a function of
 * (seed, rank, offset) so a reader can check it without the writer. */
static uint64_t mix(uint64_t x) {
        x += 0x9e3779b97f4a7c15ull;
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        return x ^ (x >> 31);
}

static void pattern_fill(uint8_t *p, size_t len, uint64_t seed, uint32_t rank) {
        for (size_t i = 0; i < len; i += 8) {
                uint64_t v = mix(seed ^ ((uint64_t)rank << 48) ^ i);
                size_t n = len - i < 8 ? len - i : 8;

                memcpy(p + i, &v, n);
        }
}

/* Returns the offset of the first byte that differs from the pattern, or
 * `len` when all match. */
static size_t pattern_check(const uint8_t *p, size_t len, uint64_t seed, uint32_t rank) {
        uint8_t want[8];

        for (size_t i = 0; i < len; i += 8) {
                uint64_t v = mix(seed ^ ((uint64_t)rank << 48) ^ i);
                size_t n = len - i < 8 ? len - i : 8;

                memcpy(want, &v, sizeof(want));
                for (size_t j = 0; j < n; j++)
                        if (p[i + j] != want[j])
                                return i + j;
        }
        return len;
}

static int touch(const char *path) {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);

        if (fd < 0)
                return -errno;
        close(fd);
        return 0;
}

/* Creates this rank's region: a sealed memfd of `size` bytes. */
static int region_create(size_t size, int rank, int world, uint64_t job_id, int *ret_fd) {
        struct region_header hdr = {
                .magic = REGION_MAGIC,
                .rank = (uint32_t)rank,
                .world_size = (uint32_t)world,
                .job_id = job_id,
        };
        uint8_t *p;
        int fd, r;

        if (getrandom(&hdr.seed, sizeof(hdr.seed), 0) != sizeof(hdr.seed))
                return -errno;
        fd = memfd_create("moeep-e2e-rank", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0)
                return -errno;
        if (ftruncate(fd, (off_t)size) < 0)
                goto fail_errno;
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
                goto fail_errno;
        memcpy(p, &hdr, sizeof(hdr));
        pattern_fill(p + sizeof(hdr), size - sizeof(hdr), hdr.seed, hdr.rank);
        munmap(p, size);
        /* Peers map it: its size must not change under them. */
        if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
                goto fail_errno;
        *ret_fd = fd;
        return 0;

fail_errno:
        r = -errno;
        close(fd);
        return r;
}

/* Maps a peer's region and checks it is the one that rank wrote for this job.
 * Returns 0 or 1 (and says why). */
static int region_verify(const struct moeep_region *reg, int world, uint64_t job_id, size_t size) {
        struct region_header hdr;
        struct stat st;
        const uint8_t *p;
        size_t bad;

        if (reg->kind != MOEEP_REGION_MEMFD || reg->tag != REGION_TAG || reg->size != size) {
                fail_msg("region %" PRIu64 " of rank %d: kind %d tag %u size %" PRIu64
                         ", want kind %d tag %u size %zu",
                         reg->id, reg->rank, (int)reg->kind, reg->tag, reg->size, MOEEP_REGION_MEMFD,
                         REGION_TAG, size);
                return 1;
        }
        if (reg->fd < 0 || fstat(reg->fd, &st) < 0) {
                fail_msg("region %" PRIu64 " of rank %d: fd %d is not usable", reg->id, reg->rank, reg->fd);
                return 1;
        }
        if ((uint64_t)st.st_size != reg->size) {
                fail_msg("region %" PRIu64 " of rank %d: fd is %lld bytes, metadata says %" PRIu64, reg->id,
                         reg->rank, (long long)st.st_size, reg->size);
                return 1;
        }
        /* Read-only on purpose: a peer's region is its own to write. */
        p = mmap(NULL, size, PROT_READ, MAP_SHARED, reg->fd, 0);
        if (p == MAP_FAILED) {
                fail_msg("region %" PRIu64 " of rank %d: mmap: %s", reg->id, reg->rank, strerror(errno));
                return 1;
        }
        memcpy(&hdr, p, sizeof(hdr));
        if (hdr.magic != REGION_MAGIC || (int)hdr.rank != reg->rank || (int)hdr.world_size != world ||
            hdr.job_id != job_id) {
                fail_msg("region %" PRIu64
                         " said to be rank %d's: header magic %#x rank %u world %u job %" PRIu64
                         ", want magic %#x rank %d world %d job %" PRIu64,
                         reg->id, reg->rank, hdr.magic, hdr.rank, hdr.world_size, hdr.job_id, REGION_MAGIC,
                         reg->rank, world, job_id);
                munmap((void *)p, size);
                return 1;
        }
        bad = pattern_check(p + sizeof(hdr), size - sizeof(hdr), hdr.seed, hdr.rank);
        munmap((void *)p, size);
        if (bad != size - sizeof(hdr)) {
                fail_msg("region %" PRIu64 " of rank %d: contents differ from its pattern at byte %zu",
                         reg->id, reg->rank, bad + sizeof(hdr));
                return 1;
        }
        return 0;
}

/* Fetches every other rank's regions and checks there is exactly one per
 * peer, each with the right contents. */
static int verify_peers(struct moeep_client *c, int rank, int world, uint64_t job_id, size_t size) {
        struct moeep_region *regs = NULL;
        unsigned char seen[MOEEP_MAX_RANKS] = { 0 };
        size_t n = 0;
        int r, bad = 0;

        r = moeep_regions_fetch(c, -1, -1, &regs, &n);
        if (r < 0) {
                fail_msg("moeep_regions_fetch: %s (%s)", strerror(-r), moeep_client_error(c));
                return 1;
        }
        for (size_t i = 0; i < n; i++) {
                int owner = regs[i].rank;

                if (owner < 0 || owner >= world || owner == rank) {
                        fail_msg("got a region of rank %d, want only ranks 0..%d other than %d", owner,
                                 world - 1, rank);
                        bad = 1;
                        continue;
                }
                if (seen[owner]++) {
                        fail_msg("got rank %d's region twice", owner);
                        bad = 1;
                        continue;
                }
                bad |= region_verify(&regs[i], world, job_id, size);
        }
        if (n != (size_t)world - 1) {
                fail_msg("got %zu regions, want %d (one per peer)", n, world - 1);
                bad = 1;
        }
        moeep_regions_free(regs, n);
        return bad;
}

/* Waits for SIGUSR1 or SIGTERM (blocked since start-up), bounded by the alarm. */
static void hold(void) {
        sigset_t set;
        int sig = 0;

        sigemptyset(&set);
        sigaddset(&set, SIGUSR1);
        sigaddset(&set, SIGTERM);
        sigwait(&set, &sig);
}

static int run_rank(const struct options *o) {
        struct moeep_client *c = NULL;
        struct moeep_unique_id id;
        const char *what;
        uint64_t region_id = 0, job_id = 0;
        int fd = -1, r, ret = 1, info_rank = -1, info_world = -1;

        r = moeep_connect(o->socket, &c);
        if (r < 0) {
                fail_msg("moeep_connect(%s): %s", o->socket ? o->socket : "default socket", strerror(-r));
                return 1;
        }
        r = id_share(c, o->create, o->name, o->world, o->id_file, &id, &what);
        if (r < 0) {
                fail_msg("%s (job %s of %d ranks, id file %s): %s (%s)", what, o->name, o->world, o->id_file,
                         strerror(-r), moeep_client_error(c));
                goto out;
        }
        r = moeep_job_join(c, &id, o->rank, o->world, NULL);
        if (r < 0) {
                fail_msg("moeep_job_join(rank %d, world %d): %s (%s)", o->rank, o->world, strerror(-r),
                         moeep_client_error(c));
                goto out;
        }
        r = moeep_job_info(c, &job_id, &info_rank, &info_world);
        if (r < 0 || info_rank != o->rank || info_world != o->world) {
                fail_msg("moeep_job_info: r=%d rank %d world %d, want rank %d world %d", r, info_rank,
                         info_world, o->rank, o->world);
                goto out;
        }
        r = region_create(o->size, o->rank, o->world, job_id, &fd);
        if (r < 0) {
                fail_msg("creating a %zu-byte memfd region: %s", o->size, strerror(-r));
                goto out;
        }
        r = moeep_region_register(c, fd, MOEEP_REGION_MEMFD, o->size, REGION_TAG, &region_id);
        if (r < 0) {
                fail_msg("moeep_region_register: %s (%s)", strerror(-r), moeep_client_error(c));
                goto out;
        }
        r = moeep_job_barrier(c);
        if (r < 0) {
                fail_msg("first barrier: %s (%s)", strerror(-r), moeep_client_error(c));
                goto out;
        }
        if (verify_peers(c, o->rank, o->world, job_id, o->size))
                goto out;
        /* Nobody leaves (taking its region along) before everyone checked. */
        r = moeep_job_barrier(c);
        if (r < 0) {
                fail_msg("second barrier: %s (%s)", strerror(-r), moeep_client_error(c));
                goto out;
        }
        printf("rank %d/%d: job %" PRIu64 ", region %" PRIu64 ", verified %d peers' regions\n", o->rank,
               o->world, job_id, region_id, o->world - 1);
        fflush(stdout);
        if (o->hold) {
                if (o->ready_file && (r = touch(o->ready_file)) < 0) {
                        fail_msg("creating %s: %s", o->ready_file, strerror(-r));
                        goto out;
                }
                hold();
        }
        r = moeep_job_leave(c);
        if (r < 0) {
                fail_msg("moeep_job_leave: %s (%s)", strerror(-r), moeep_client_error(c));
                goto out;
        }
        ret = 0;
out:
        if (fd >= 0)
                close(fd);
        moeep_client_free(c);
        return ret;
}

enum attempt {
        ATTEMPT_FETCH_ALL,  /* RegionsFetch(-1) without joining */
        ATTEMPT_FETCH_RANK, /* RegionsFetch(0) without joining */
        ATTEMPT_FORGED_ID,  /* JobJoin with a forged secret */
        ATTEMPT_TAKEN_RANK, /* JobJoin as a rank that is held */
        ATTEMPT_BAD_RANK,   /* JobJoin as rank == world size */
};

static const char *attempt_to_string(enum attempt a) {
        switch (a) {
        case ATTEMPT_FETCH_ALL:
                return "RegionsFetch of every rank before joining";
        case ATTEMPT_FETCH_RANK:
                return "RegionsFetch of rank 0 before joining";
        case ATTEMPT_FORGED_ID:
                return "JobJoin with a forged unique id";
        case ATTEMPT_TAKEN_RANK:
                return "JobJoin as an already joined rank";
        case ATTEMPT_BAD_RANK:
                return "JobJoin with a rank out of range";
        }
        return "?";
}

static size_t flip_byte;         /* byte of the unique id ATTEMPT_FORGED_ID changes */
static unsigned secret_refusals; /* forged ids refused as no job (-ENOENT) or unchecked (-EUSERS) */

/* One attempt on a fresh connection, so that one refusal (which may close the
 * session) cannot make the next attempt fail for the wrong reason. Returns 1
 * when the attempt got through. */
static int outsider_attempt(const struct options *o, const struct moeep_unique_id *id, enum attempt a) {
        struct moeep_client *c = NULL;
        struct moeep_region *regs = NULL;
        struct moeep_unique_id forged;
        size_t n = 0;
        int r;

        r = moeep_connect(o->socket, &c);
        if (r < 0) {
                fail_msg("outsider: moeep_connect(%s): %s", o->socket ? o->socket : "default", strerror(-r));
                return 1;
        }
        switch (a) {
        case ATTEMPT_FETCH_ALL:
        case ATTEMPT_FETCH_RANK:
                r = moeep_regions_fetch(c, a == ATTEMPT_FETCH_ALL ? -1 : 0, -1, &regs, &n);
                if (r >= 0)
                        moeep_regions_free(regs, n);
                break;
        case ATTEMPT_FORGED_ID:
                /* See the forged ids in run_outsider(). */
                forged = *id;
                forged.bytes[flip_byte] ^= 0x01;
                r = moeep_job_join(c, &forged, o->world - 1, o->world, NULL);
                /* A wrong secret is answered as an unknown id is; past
                 * its uid's allowance of wrong joins, unchecked. */
                if (r == -ENOENT || r == -EUSERS)
                        secret_refusals++;
                moeep_client_free(c);
                return r >= 0;
        case ATTEMPT_TAKEN_RANK:
                r = moeep_job_join(c, id, 0, o->world, NULL);
                break;
        case ATTEMPT_BAD_RANK:
                r = moeep_job_join(c, id, o->world, o->world, NULL);
                break;
        }
        if (r >= 0)
                fail_msg("outsider: %s was allowed (returned %d), must be refused", attempt_to_string(a), r);
        else
                printf("outsider: %s refused: %s (%s)\n", attempt_to_string(a), strerror(-r),
                       moeep_client_error(c));
        moeep_client_free(c);
        return r >= 0;
}

/* A client that is not in the job tries to get at its regions. */
static int run_outsider(const struct options *o) {
        static const enum attempt attempts[] = {
                ATTEMPT_FETCH_ALL,
                ATTEMPT_FETCH_RANK,
                ATTEMPT_TAKEN_RANK,
                ATTEMPT_BAD_RANK,
        };
        struct moeep_client *c = NULL;
        struct moeep_region *regs = NULL;
        struct moeep_unique_id id, own;
        size_t n = 0;
        int r, bad = 0;

        r = id_read(o->id_file, &id);
        if (r < 0) {
                fail_msg("outsider: reading the unique id from %s: %s", o->id_file, strerror(-r));
                return 1;
        }
        for (size_t i = 0; i < sizeof(attempts) / sizeof(attempts[0]); i++)
                bad |= outsider_attempt(o, &id, attempts[i]);

        /* Forged ids: the real one with one bit flipped, at every byte. None
         * may get in. The id's layout is the daemon's business, but some of
         * its bytes are a secret, and a wrong secret must be refused before
         * anything about ranks is told, with the answer an unknown job id
         * gets (-ENOENT), or unchecked once the uid got too many wrong
         * (-EUSERS): at least 16 bytes (128 bits) must be refused that
         * way. */
        for (flip_byte = 0; flip_byte < sizeof(id.bytes); flip_byte++)
                bad |= outsider_attempt(o, &id, ATTEMPT_FORGED_ID);
        if (secret_refusals < 16) {
                fail_msg("outsider: only %u of %zu one-bit forgeries of the unique id were refused as no "
                         "such job (-ENOENT, -EUSERS), want at least 16",
                         secret_refusals, sizeof(id.bytes));
                bad = 1;
        } else {
                printf("outsider: JobJoin with a forged unique id refused (%u of %zu one-bit forgeries as "
                       "no such job)\n",
                       secret_refusals, sizeof(id.bytes));
        }

        /* In a job of its own, it must see only its own job's regions (none). */
        r = moeep_connect(o->socket, &c);
        if (r < 0) {
                fail_msg("outsider: moeep_connect: %s", strerror(-r));
                return 1;
        }
        r = moeep_job_create(c, "e2e-outsider", 1, &own);
        /* The forgeries spent this uid's allowance of wrong joins: its
         * joins are refused unchecked (-EUSERS) until it grows back, at 8 a
         * second. */
        for (int i = 0; r >= 0 && i < 40; i++) {
                r = moeep_job_join(c, &own, 0, 1, NULL);
                if (r != -EUSERS)
                        break;
                usleep(50 * 1000);
                r = 0;
        }
        if (r < 0) {
                fail_msg("outsider: creating and joining a job of its own: %s (%s)", strerror(-r),
                         moeep_client_error(c));
                moeep_client_free(c);
                return 1;
        }
        for (int rank = -1; rank < o->world; rank++) {
                r = moeep_regions_fetch(c, rank, -1, &regs, &n);
                if (r < 0 && rank == -1) {
                        fail_msg("outsider: RegionsFetch(-1) in its own job: %s (%s)", strerror(-r),
                                 moeep_client_error(c));
                        bad = 1;
                }
                if (r >= 0 && n > 0) {
                        fail_msg("outsider: RegionsFetch(%d) in its own job gave %zu regions of another job "
                                 "(first: rank %d, region %" PRIu64 ")",
                                 rank, n, regs[0].rank, regs[0].id);
                        bad = 1;
                }
                if (r >= 0)
                        moeep_regions_free(regs, n);
        }
        moeep_job_leave(c);
        moeep_client_free(c);
        if (!bad)
                printf("outsider: no region of the job was given out\n");
        return bad;
}

static void usage(FILE *f) {
        fprintf(f,
                "usage: moeep-e2e-rank [--socket PATH] --id-file FILE --world N --rank R (--create|--join)\n"
                "                      [--hold [--ready-file FILE]] [--size BYTES] [--name NAME] [--timeout "
                "S]\n"
                "       moeep-e2e-rank [--socket PATH] --id-file FILE --world N --outsider\n"
                "\n"
                "  --create       create the job (as rank R, normally 0) and write its unique id to FILE\n"
                "  --join         wait for FILE, then join the job as rank R\n"
                "  --hold         after checking every peer, stay in the job until SIGUSR1/SIGTERM\n"
                "  --ready-file   created once the rank holds\n"
                "  --outsider     not a member: every attempt to get the job's regions must fail\n"
                "  --timeout S    give up after S seconds (default 60)\n");
}

int main(int argc, char **argv) {
        static const struct option longopts[] = {
                { "socket", required_argument, NULL, 's' },
                { "id-file", required_argument, NULL, 'i' },
                { "ready-file", required_argument, NULL, 'R' },
                { "name", required_argument, NULL, 'n' },
                { "create", no_argument, NULL, 'c' },
                { "join", no_argument, NULL, 'j' },
                { "outsider", no_argument, NULL, 'o' },
                { "rank", required_argument, NULL, 'r' },
                { "world", required_argument, NULL, 'w' },
                { "hold", no_argument, NULL, 'H' },
                { "timeout", required_argument, NULL, 't' },
                { "size", required_argument, NULL, 'z' },
                { "help", no_argument, NULL, 'h' },
                { 0 },
        };
        struct options o = {
                .name = "e2e", .rank = -1, .world = -1, .timeout = 60, .size = DEFAULT_REGION_SIZE
        };
        sigset_t set;
        int opt;

        while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
                switch (opt) {
                case 's':
                        o.socket = optarg;
                        break;
                case 'i':
                        o.id_file = optarg;
                        break;
                case 'R':
                        o.ready_file = optarg;
                        break;
                case 'n':
                        o.name = optarg;
                        break;
                case 'c':
                        o.create = 1;
                        break;
                case 'j':
                        o.join = 1;
                        break;
                case 'o':
                        o.outsider = 1;
                        break;
                case 'r':
                        o.rank = atoi(optarg);
                        break;
                case 'w':
                        o.world = atoi(optarg);
                        break;
                case 'H':
                        o.hold = 1;
                        break;
                case 't':
                        o.timeout = (unsigned)atoi(optarg);
                        break;
                case 'z':
                        o.size = (size_t)strtoull(optarg, NULL, 0);
                        break;
                case 'h':
                        usage(stdout);
                        return 0;
                default:
                        usage(stderr);
                        return 2;
                }
        }
        if (optind != argc || !o.id_file || o.world < 1 || o.world > MOEEP_MAX_RANKS ||
            o.create + o.join + o.outsider != 1 || (!o.outsider && (o.rank < 0 || o.rank >= o.world)) ||
            o.size < sizeof(struct region_header) || o.size > (1u << 30)) {
                usage(stderr);
                return 2;
        }
        me = o.outsider ? -1 : o.rank;

        /* Blocked before anything else so a SIGUSR1 sent early is not lost. */
        sigemptyset(&set);
        sigaddset(&set, SIGUSR1);
        if (o.hold)
                sigaddset(&set, SIGTERM);
        sigprocmask(SIG_BLOCK, &set, NULL);
        signal(SIGALRM, on_alarm);
        alarm(o.timeout);

        return o.outsider ? run_outsider(&o) : run_rank(&o);
}
