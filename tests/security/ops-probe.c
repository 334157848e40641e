/* moeep-ops-probe: the well-behaved client of the ops security tests. It
 * connects to a moeepd socket as libmoeep does (Hello), asks one question
 * and disconnects, COUNT times, and fails when any round trip fails or
 * takes longer than LIMIT_MS:
 *
 *   moeep-ops-probe SOCKET COUNT LIMIT_MS [status|clients|jobs|drain]
 *
 * Prints the slowest round trip in milliseconds. The time counts connect,
 * Hello and the answer: what an operator waits for, without the process
 * start of moeepctl (which the shell tests time separately). `drain` sends
 * Drain(off) and expects Ok, or prints the daemon's refusal and exits 3. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client-internal.h"

static double now_ms(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* One round trip; returns 0, -1 on a failure, -3 when the daemon refused. */
static int ask(const char *socket, const char *what, char *err, size_t errlen) {
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__StatusGet st = MOEEP__V1__STATUS_GET__INIT;
        Moeep__V1__ClientsList cl = MOEEP__V1__CLIENTS_LIST__INIT;
        Moeep__V1__JobsList jl = MOEEP__V1__JOBS_LIST__INIT;
        Moeep__V1__Drain dr = MOEEP__V1__DRAIN__INIT;
        Moeep__V1__Response__BodyCase expect;
        Moeep__V1__Response *resp = NULL;
        struct moeep_client *c;
        int r;

        if (strcmp(what, "status") == 0) {
                req.body_case = MOEEP__V1__REQUEST__BODY_STATUS_GET;
                req.status_get = &st;
                expect = MOEEP__V1__RESPONSE__BODY_STATUS;
        } else if (strcmp(what, "clients") == 0) {
                req.body_case = MOEEP__V1__REQUEST__BODY_CLIENTS_LIST;
                req.clients_list = &cl;
                expect = MOEEP__V1__RESPONSE__BODY_CLIENTS;
        } else if (strcmp(what, "jobs") == 0) {
                req.body_case = MOEEP__V1__REQUEST__BODY_JOBS_LIST;
                req.jobs_list = &jl;
                expect = MOEEP__V1__RESPONSE__BODY_JOBS;
        } else {
                req.body_case = MOEEP__V1__REQUEST__BODY_DRAIN;
                req.drain = &dr;
                expect = MOEEP__V1__RESPONSE__BODY_OK;
        }
        r = client_connect(socket, "ops-probe", &c, err, errlen);
        if (r < 0)
                return -1;
        client_set_timeout(c, 5000);
        r = client_call(c, &req, expect, NULL, 0, &resp);
        if (r < 0)
                snprintf(err, errlen, "%s", moeep_client_error(c));
        else
                moeep__v1__response__free_unpacked(resp, NULL);
        moeep_client_free(c);
        return r < 0 ? (strcmp(what, "drain") == 0 ? -3 : -1) : 0;
}

int main(int argc, char **argv) {
        const char *what = argc > 4 ? argv[4] : "status";
        double worst = 0;
        char err[512] = "";
        int count, limit;

        if (argc < 4 || (count = atoi(argv[2])) <= 0 || (limit = atoi(argv[3])) <= 0 ||
            (strcmp(what, "status") && strcmp(what, "clients") && strcmp(what, "jobs") &&
             strcmp(what, "drain"))) {
                fprintf(stderr, "usage: %s SOCKET COUNT LIMIT_MS [status|clients|jobs|drain]\n", argv[0]);
                return 2;
        }
        for (int i = 0; i < count; i++) {
                double t0 = now_ms(), dt;
                int r = ask(argv[1], what, err, sizeof(err));

                dt = now_ms() - t0;
                if (r < 0) {
                        printf("%s %s: %s\n", what, argv[1], err);
                        return -r;
                }
                if (dt > worst)
                        worst = dt;
        }
        printf("%.1f\n", worst);
        if (worst > limit) {
                fprintf(stderr, "%s on %s: the slowest of %d round trips took %.1f ms, more than %d ms\n",
                        what, argv[1], count, worst, limit);
                return 1;
        }
        return 0;
}
