/* moeep-mesh-rank: one rank of a job that spans two daemons, through
 * libmoeep's public API only (moeep.h). mesh.sh starts four of these, two
 * at each daemon.
 *
 *   moeep-mesh-rank --socket PATH --id-file FILE --world N --rank R
 *                   (--create|--join) --local MASK --remote MASK
 *                   [--ready-file FILE (--expect-lost|--hold)] [--timeout S]
 *
 * Rank R connects to the daemon at PATH; with --create it creates the job
 * and writes its unique id to FILE (through a temporary name and rename),
 * with --join it waits for FILE. It joins, passes a barrier with every rank
 * of the job (at both daemons), checks moeep_job_ranks() against the
 * expected bit masks of local and remote ranks, registers a memfd region,
 * and after a second barrier checks that moeep_regions_fetch() gives fds
 * for the other local ranks' regions and metadata only (fd -1) for the
 * remote ranks' ones; it passes a third barrier before it leaves.
 *
 * --expect-lost: instead of the third barrier and leaving, it creates FILE
 * (--ready-file) and enters a barrier that can only end because the test kills the other daemon: it
 * must fail with -ENOTCONN, the control page's abort word must be set, its
 * lost_ranks must name every remote rank, and a PeerLost event must name a
 * remote rank. --hold: instead, it creates
 * FILE and waits to be killed (with its daemon).
 *
 * Exit status: 0 when everything checked out, 1 on any mismatch (one line
 * on stderr naming the rank, the check and the value seen), 2 on bad
 * usage; SIGALRM after --timeout seconds (default 30) ends it otherwise. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "../job-id.h"
#include "moeep.h"

#define RANK_PROGRAM "mesh-rank"
#include "rank-fail.h"

static int run(struct moeep_client *c, const char *id_file, bool create, int world, uint32_t want_local,
               uint32_t want_remote, const char *ready_file, bool expect_lost, bool hold) {
        const volatile struct moeep_control_page *page;
        struct moeep_region *regions = NULL;
        struct moeep_unique_id id;
        struct moeep_event ev;
        const char *what;
        uint32_t local = 0, remote = 0, fetched = 0, fetched_remote = 0;
        uint64_t region_id;
        size_t n = 0;
        int r, fd;

        if ((r = id_share(c, create, "mesh", world, id_file, &id, &what)) < 0)
                return fail("%s (%s): %s (%s)", what, id_file, strerror(-r), moeep_client_error(c));
        r = moeep_job_join(c, &id, my_rank, world, NULL);
        if (r < 0)
                return fail("moeep_job_join: %s (%s)", strerror(-r), moeep_client_error(c));
        r = moeep_job_barrier(c);
        if (r < 0)
                return fail("first barrier: %s (%s)", strerror(-r), moeep_client_error(c));
        r = moeep_job_ranks(c, &local, &remote);
        if (r < 0)
                return fail("moeep_job_ranks: %s (%s)", strerror(-r), moeep_client_error(c));
        if (local != want_local || remote != want_remote)
                return fail("moeep_job_ranks: local 0x%x remote 0x%x, want local 0x%x remote 0x%x", local,
                            remote, want_local, want_remote);

        fd = memfd_create("mesh-rank", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, 4096) < 0)
                return fail("memfd: %s", strerror(errno));
        r = moeep_region_register(c, fd, MOEEP_REGION_MEMFD, 4096, 1, &region_id);
        close(fd);
        if (r < 0)
                return fail("moeep_region_register: %s (%s)", strerror(-r), moeep_client_error(c));
        r = moeep_job_barrier(c);
        if (r < 0)
                return fail("second barrier: %s (%s)", strerror(-r), moeep_client_error(c));
        /* Descriptors travel between ranks of one daemon only; the remote
         * ranks' regions come as metadata with fd -1. */
        r = moeep_regions_fetch(c, -1, -1, &regions, &n);
        if (r < 0)
                return fail("moeep_regions_fetch: %s (%s)", strerror(-r), moeep_client_error(c));
        for (size_t i = 0; i < n; i++) {
                if (regions[i].fd >= 0)
                        fetched |= 1u << regions[i].rank;
                else if (regions[i].size == 4096 && regions[i].tag == 1)
                        fetched_remote |= 1u << regions[i].rank;
        }
        moeep_regions_free(regions, n);
        if (fetched != (want_local & ~(1u << my_rank)) || fetched_remote != want_remote)
                return fail("moeep_regions_fetch: fds of ranks 0x%x and metadata of 0x%x, want fds of the "
                            "other local "
                            "ranks 0x%x and metadata of the remote ones 0x%x",
                            fetched, fetched_remote, want_local & ~(1u << my_rank), want_remote);
        printf("mesh-rank %d: local 0x%x remote 0x%x, region fds of 0x%x, remote regions of 0x%x\n", my_rank,
               local, remote, fetched, fetched_remote);
        fflush(stdout);
        if (!expect_lost && !hold) {
                /* Nobody leaves (taking its region along) before every
                 * rank fetched. */
                r = moeep_job_barrier(c);
                if (r < 0)
                        return fail("third barrier: %s (%s)", strerror(-r), moeep_client_error(c));
                return moeep_job_leave(c) < 0 ? fail("moeep_job_leave: %s", moeep_client_error(c)) : 0;
        }

        fd = open(ready_file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0)
                return fail("creating %s: %s", ready_file, strerror(errno));
        close(fd);
        while (hold)
                pause();
        r = moeep_job_barrier(c);
        if (r != -ENOTCONN)
                return fail("barrier after the other daemon died: %d (%s), want -ENOTCONN", r,
                            moeep_client_error(c));
        page = moeep_job_control_page(c);
        if (!page || page->abort != 1)
                return fail("the control page's abort word is not set");
        /* Every rank at the dead daemon is marked lost (control page
         * version 2; a local rank that checked already and left is too). */
        for (int i = 0; i < 1000 && (page->lost_ranks & want_remote) != want_remote; i++)
                nanosleep(&(struct timespec){ .tv_nsec = 1000000 }, NULL);
        if (page->version < 2 || (page->lost_ranks & want_remote) != want_remote || page->stopping)
                return fail(
                        "control page version %u: lost_ranks 0x%x, want the remote ranks 0x%x; stopping %u",
                        page->version, page->lost_ranks, want_remote, page->stopping);
        r = moeep_event_next(c, &ev);
        if (r != 1 || ev.type != MOEEP_EVENT_PEER_LOST || ev.rank < 0 || !(want_remote & (1u << ev.rank)))
                return fail("want a PeerLost event naming a remote rank: r=%d type %d rank %d", r,
                            r == 1 ? (int)ev.type : 0, r == 1 ? ev.rank : -1);
        printf("mesh-rank %d: barrier -ENOTCONN, abort word set, PeerLost rank %d (%s)\n", my_rank, ev.rank,
               ev.reason);
        return 0;
}

int main(int argc, char **argv) {
        static const struct option longopts[] = {
                { "socket", required_argument, NULL, 's' },
                { "id-file", required_argument, NULL, 'i' },
                { "world", required_argument, NULL, 'w' },
                { "rank", required_argument, NULL, 'r' },
                { "create", no_argument, NULL, 'c' },
                { "join", no_argument, NULL, 'j' },
                { "local", required_argument, NULL, 'l' },
                { "remote", required_argument, NULL, 'R' },
                { "ready-file", required_argument, NULL, 'f' },
                { "expect-lost", no_argument, NULL, 'x' },
                { "hold", no_argument, NULL, 'H' },
                { "timeout", required_argument, NULL, 't' },
                { 0 },
        };
        const char *socket = NULL, *id_file = NULL, *ready_file = NULL;
        uint32_t want_local = 0, want_remote = 0;
        bool create = false, join = false, expect_lost = false, hold = false;
        int world = -1, timeout = 30, opt, r;
        struct moeep_client *c;

        while ((opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
                switch (opt) {
                case 's':
                        socket = optarg;
                        break;
                case 'i':
                        id_file = optarg;
                        break;
                case 'w':
                        world = atoi(optarg);
                        break;
                case 'r':
                        my_rank = atoi(optarg);
                        break;
                case 'c':
                        create = true;
                        break;
                case 'j':
                        join = true;
                        break;
                case 'l':
                        want_local = (uint32_t)strtoul(optarg, NULL, 0);
                        break;
                case 'R':
                        want_remote = (uint32_t)strtoul(optarg, NULL, 0);
                        break;
                case 'f':
                        ready_file = optarg;
                        break;
                case 'x':
                        expect_lost = true;
                        break;
                case 'H':
                        hold = true;
                        break;
                case 't':
                        timeout = atoi(optarg);
                        break;
                default:
                        return 2;
                }
        }
        if (!socket || !id_file || world < 1 || my_rank < 0 || create == join ||
            ((expect_lost || hold) && !ready_file) || (expect_lost && hold)) {
                fprintf(stderr, "usage: see the comment at the top of tests/mesh/mesh-rank.c\n");
                return 2;
        }
        alarm((unsigned)timeout);
        r = moeep_connect(socket, &c);
        if (r < 0)
                return fail("moeep_connect(%s): %s", socket, strerror(-r));
        r = run(c, id_file, create, world, want_local, want_remote, ready_file, expect_lost, hold);
        moeep_client_free(c);
        return r;
}
