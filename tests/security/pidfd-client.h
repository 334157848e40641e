/* The clients of moeep-sec-pidfd (pidfd.c): Hello with or without
 * FEATURE_PIDFD, a job of one rank, RegionRegister naming a descriptor to
 * take, the refusal checks, and the run of a client as ATTACK_UID in a PID
 * namespace of its own. Included by pidfd.c only; test code. */
#ifndef MOEEP_SEC_PIDFD_CLIENT_H
#define MOEEP_SEC_PIDFD_CLIENT_H

#include <limits.h>
#include <sched.h>

#include "fdattack-client.h"
#include "moeep.h"

/* ------------------------------------------------------------ clients */

/* Hello offering FEATURE_PIDFD (or not), then a job of one rank. */
static int hello_features(struct conn *c, uint64_t features) {
        Moeep__V1__Hello h = MOEEP__V1__HELLO__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        int ok;

        h.major = MOEEP_PROTOCOL_MAJOR;
        h.minor = MOEEP_PROTOCOL_MINOR;
        h.features = features;
        h.client_name = "pidfd";
        req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
        req.hello = &h;
        resp = conn_call(c, &req, NULL, 0);
        ok = resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_WELCOME &&
             (resp->welcome->features & features) == features;
        code_of(resp, NULL, 0);
        return ok ? 0 : -1;
}

static int enter_job_with(struct conn *c, uint64_t features) {
        return hello_features(c, features) == 0 ? create_and_join(c, "pidfd") : -1;
}

/* A RegionRegister of a 4096-byte memfd region that names fd `number` of
 * the sender's process; the request points into the struct. */
struct take_request {
        Moeep__V1__RegionRegister rr;
        Moeep__V1__TakeFd take;
        Moeep__V1__Request req;
};

static void take_request_init(struct take_request *t, int64_t number) {
        t->take = (Moeep__V1__TakeFd)MOEEP__V1__TAKE_FD__INIT;
        t->take.fd_number = number;
        t->rr = (Moeep__V1__RegionRegister)MOEEP__V1__REGION_REGISTER__INIT;
        t->rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        t->rr.size = 4096;
        t->rr.take = &t->take;
        t->req = (Moeep__V1__Request)MOEEP__V1__REQUEST__INIT;
        t->req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        t->req.region_register = &t->rr;
}

/* RegionRegister naming `number` (and attaching `nfds` of `fds`): 0 with
 * *ret_id, the error code with `msg`, or -1 when the session ended. */
static int take_register(struct conn *c, int64_t number, const int *fds, size_t nfds, uint64_t *ret_id,
                         char *msg, size_t msize) {
        struct take_request t;
        Moeep__V1__Response *resp;

        take_request_init(&t, number);
        resp = conn_call(c, &t.req, fds, nfds);
        if (resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED) {
                if (ret_id)
                        *ret_id = resp->region_registered->region_id;
                moeep__v1__response__free_unpacked(resp, NULL);
                return 0;
        }
        return code_of(resp, msg, msize);
}

/* Checks that a take of `number` is refused with `code` and a message
 * containing `part` (and the number, when `named`). */
static void expect_refused(struct conn *c, int64_t number, int code, const char *part, bool named) {
        char msg[512], fd_n[48], fd_number_n[48];
        int got = take_register(c, number, NULL, 0, NULL, msg, sizeof(msg));

        snprintf(fd_n, sizeof(fd_n), "fd %" PRId64 " ", number);
        snprintf(fd_number_n, sizeof(fd_number_n), "fd number %" PRId64 " ", number);
        CHECK(got == code, "fd number %" PRId64 ": code %d, expected %d (%s)", number, got, code, msg);
        CHECK(strstr(msg, part) != NULL, "fd number %" PRId64 ": message '%s' lacks '%s'", number, msg, part);
        CHECK(!named || strstr(msg, fd_n) || strstr(msg, fd_number_n),
              "fd number %" PRId64 ": message '%s' does not name it", number, msg);
}

/* ------------------------------------------------------------ namespaced clients */

/* Runs `fn` as ATTACK_UID in a PID namespace of its own: a child unshares
 * it and forks `fn`'s process, which is pid 1 there and drops to
 * ATTACK_UID with no capabilities. Meanwhile the well-behaved client is
 * checked. Returns the failures of `fn` (1 when it did not finish). */
static int run_namespaced(const char *what, int (*fn)(void *), void *arg, int timeout_ms) {
        int st;
        pid_t pid;

        fflush(stdout);
        pid = fork();
        if (pid == 0) {
                pid_t inner;
                int ist = 0;

                prctl(PR_SET_PDEATHSIG, SIGKILL);
                if (unshare(CLONE_NEWPID) < 0) {
                        say("FAIL %s: unshare(CLONE_NEWPID): %s", what, strerror(errno));
                        _exit(101);
                }
                inner = fork();
                if (inner == 0) {
                        prctl(PR_SET_PDEATHSIG, SIGKILL);
                        if (getpid() != 1)
                                _exit(102);
                        if (fuse_stub_device() >= 0) /* the FUSE server's alone */
                                close(fuse_stub_device());
                        if (drop_to_uid(ATTACK_UID) < 0)
                                _exit(100);
                        failures = 0;
                        fn(arg);
                        fflush(stdout);
                        _exit(failures > 0 ? 1 : 0);
                }
                if (inner < 0 || waitpid(inner, &ist, 0) < 0)
                        _exit(103);
                _exit(WIFEXITED(ist) ? WEXITSTATUS(ist) : 104);
        }
        st = watch_child("", what, pid, timeout_ms);
        if (st < 0)
                return 1;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
                say("FAIL: '%s' ended with status 0x%x", what, st);
        return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}

#endif
