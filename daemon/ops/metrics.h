/* moeepd's counters and gauges. Each object counts what it owns: struct
 * metrics below holds the request layer's counters (written by requests.c)
 * and the reloads (daemon.c); the session registry counts connections and
 * Error responses (session.h), the HTTP listener its scrapes (http.h), the
 * jobs and the broker theirs. The gauges are read from the live state when
 * a snapshot is taken, through struct view (view.h), which daemon.c fills. A
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

struct view;

/* Totals since start-up. Owned by daemon.c; only the loop thread writes or
 * reads them. */
struct metrics {
        uint64_t requests[MOEEP_TYPE_REQUEST_MAX + 1]; /* requests received, by type (known types only) */
        uint64_t jobs_created;
        uint64_t regions_registered;
        uint64_t reloads_ok;     /* SIGHUP reloads applied */
        uint64_t reloads_failed; /* SIGHUP reloads refused (bad file) */
};

/* Takes a snapshot of everything `v` shows. Returns 0 with *ret_metrics to
 * free with metrics_snapshot_free(), or -ENOMEM. */
int metrics_snapshot(const struct view *v, Moeep__V1__Metrics **ret_metrics);

/* Frees a snapshot. Accepts NULL. */
void metrics_snapshot_free(Moeep__V1__Metrics *m);

#endif
