/* moeepd's counters and gauges. The counters live in struct metrics (in the
 * daemon object) and in the registries that already count (jobs, broker);
 * the gauges are read from the live state when a snapshot is taken. A
 * snapshot is a Metrics message (moeep.proto), which MetricsGet returns as
 * it is and the HTTP listener (http.c) writes in the Prometheus text format.
 *
 * The daemon sees only the control plane: dispatch and combine run in the
 * clients' kernels, so there are no data-plane metrics here. */
#ifndef MOEEPD_METRICS_H
#define MOEEPD_METRICS_H

#include <stdint.h>

#include "moeep.pb-c.h"
#include "record.h"

struct daemon;

/* Error codes counted: every ErrorCode value up to this one. */
#define METRICS_ERROR_CODES (MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE + 1)

/* Totals since start-up. Only the loop thread writes or reads them. */
struct metrics {
        uint64_t requests[MOEEP_TYPE_REQUEST_MAX + 1]; /* requests received, by type (known types only) */
        uint64_t errors[METRICS_ERROR_CODES];          /* Error responses sent, by code */
        uint64_t sessions_accepted;                    /* connections that became sessions */
        uint64_t sessions_refused;                     /* connections turned away by max_sessions* */
        uint64_t jobs_created;
        uint64_t regions_registered;
        uint64_t reloads_ok;     /* SIGHUP reloads applied */
        uint64_t reloads_failed; /* SIGHUP reloads refused (bad file) */
        uint64_t http_requests;  /* scrapes served by the HTTP listener */
        uint64_t http_refused;   /* HTTP connections closed at once: HTTP_MAX_CONNECTIONS were open */
        uint64_t http_deadlines; /* HTTP connections closed at HTTP_DEADLINE_MS */
};

/* Counts one Error response of `code` (unknown codes are not counted). */
void metrics_count_error(struct metrics *m, int code);

/* Takes a snapshot of everything. Returns 0 with *ret_metrics to free with
 * metrics_snapshot_free(), or -ENOMEM. */
int metrics_snapshot(const struct daemon *d, Moeep__V1__Metrics **ret_metrics);

/* Frees a snapshot. Accepts NULL. */
void metrics_snapshot_free(Moeep__V1__Metrics *m);

#endif
