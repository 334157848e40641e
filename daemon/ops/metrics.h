/* moeepd's counters and gauges, and their snapshot. struct metrics is
 * where the floors above count what they own: the request layer its
 * requests, jobs created and regions registered (requests.c,
 * membership.c), the session registry its connections, its sessions by
 * state and its Error responses (session.c), the HTTP listener its scrapes
 * (http.c), daemon.c its reloads. A snapshot reads those, and the live
 * state of the floors below (jobs, broker, mesh, data path), whose objects
 * it is handed at start (metrics_init()). A snapshot is a Metrics message
 * (moeep.proto), which MetricsGet returns as it is (query.c) and the HTTP
 * listener writes in the Prometheus text format.
 *
 * The daemon sees only the control plane: dispatch and combine run in the
 * clients' kernels, so there are no data-plane metrics here. */
#ifndef MOEEPD_METRICS_H
#define MOEEPD_METRICS_H

#include <stdint.h>
#include <time.h>

#include "moeep.pb-c.h"
#include "record.h"

struct broker;
struct datapath;
struct jobs;
struct mesh;

/* Error codes counted: every ErrorCode value is below METRICS_ERROR_CODES,
 * ERROR_UNSPECIFIED (never sent) and one per row of proto/errors.def, which
 * lists the codes in the enum's order (tests/unit/test-messages.c), so that
 * a new code is counted without a change here. */
enum {
        METRICS_ERROR_UNSPECIFIED,
#define MOEEP_ERROR_REFUSAL(CODE, ERRNO, TEXT) METRICS_ERROR_##CODE,
#define MOEEP_ERROR_OTHER MOEEP_ERROR_REFUSAL
#include "errors.def"
#undef MOEEP_ERROR_OTHER
#undef MOEEP_ERROR_REFUSAL
        METRICS_ERROR_CODES
};

/* Live sessions are counted by state: those of session.h's enum
 * session_state before CLOSED (new, hello, ready), in its order. */
#define METRICS_SESSION_STATES 3

/* Totals since start-up and gauges, and what a snapshot reads. One, owned
 * by daemon.c; only the loop thread writes or reads it. */
struct metrics {
        /* The request layer's. */
        uint64_t requests[MOEEP_TYPE_REQUEST_MAX + 1]; /* requests received, by type (known types only) */
        uint64_t jobs_created;
        uint64_t regions_registered;
        /* daemon.c's. */
        uint64_t reloads_ok;     /* SIGHUP reloads applied */
        uint64_t reloads_failed; /* SIGHUP reloads refused (bad file) */
        /* The session registry's. */
        uint32_t sessions[METRICS_SESSION_STATES]; /* live sessions by state (session_state_set()) */
        uint64_t sessions_accepted;                /* connections that became sessions */
        uint64_t sessions_refused;                 /* connections turned away by max_sessions* */
        uint64_t errors[METRICS_ERROR_CODES];      /* Error responses sent, by code */
        /* The HTTP listener's. */
        uint64_t http_requests;    /* scrapes served */
        uint64_t http_refused;     /* connections closed for the caps: displaced (or out of memory) */
        uint64_t http_deadlines;   /* connections closed at HTTP_DEADLINE_MS */
        uint32_t http_connections; /* open now */
        /* What a snapshot reads of the floors below; not owning. */
        const struct jobs *jobs;
        const struct broker *broker;
        const struct mesh *mesh;         /* NULL unless the mesh is on */
        const struct datapath *datapath; /* NULL unless the mesh is on */
        struct timespec started;         /* CLOCK_MONOTONIC at start-up */
};

/* Makes `m`: every counter 0, the objects a snapshot reads, the time the
 * daemon started. */
void metrics_init(struct metrics *m, const struct timespec *started, const struct jobs *jobs,
                  const struct broker *broker, const struct mesh *mesh, const struct datapath *datapath);

/* Milliseconds since start-up. */
uint64_t metrics_uptime_ms(const struct metrics *m);

/* Takes a snapshot of everything `m` shows. Returns 0 with *ret_metrics to
 * free with metrics_snapshot_free(), or -ENOMEM. */
int metrics_snapshot(const struct metrics *m, Moeep__V1__Metrics **ret_metrics);

/* Frees a snapshot. Accepts NULL. */
void metrics_snapshot_free(Moeep__V1__Metrics *m);

#endif
