/* moeepd's counters and gauges; see metrics.h. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "datapath/datapath.h"
#include "log.h"
#include "mesh/mesh.h"
#include "messages.h"
#include "moeep-config.h"
#include "ops/metrics.h"
#include "state/broker.h"
#include "state/job.h"

/* Bounds of one snapshot; metrics_snapshot() asserts it stays inside them. */
#define SNAPSHOT_FAMILIES 32
#define SNAPSHOT_SAMPLES 128
#define SNAPSHOT_LABELS 160

/* A snapshot in one allocation: the message first, so that the message's
 * address is the allocation's. Every string it points to is static or lives
 * in here. */
struct snapshot {
        Moeep__V1__Metrics metrics;
        Moeep__V1__MetricFamily *family_ptrs[SNAPSHOT_FAMILIES];
        Moeep__V1__MetricFamily families[SNAPSHOT_FAMILIES];
        Moeep__V1__MetricSample *sample_ptrs[SNAPSHOT_SAMPLES];
        Moeep__V1__MetricSample samples[SNAPSHOT_SAMPLES];
        Moeep__V1__MetricLabel *label_ptrs[SNAPSHOT_LABELS];
        Moeep__V1__MetricLabel labels[SNAPSHOT_LABELS];
        size_t nsamples, nlabels;
        bool overflow; /* a bound was hit: a bug here, not a client's doing */
        char protocol[16];
};

static Moeep__V1__MetricFamily *family_add(struct snapshot *s, const char *name, Moeep__V1__MetricType type,
                                           const char *help) {
        Moeep__V1__MetricFamily *f;

        if (s->overflow || s->metrics.n_families >= SNAPSHOT_FAMILIES) {
                s->overflow = true;
                return NULL;
        }
        f = &s->families[s->metrics.n_families];
        moeep__v1__metric_family__init(f);
        f->name = (char *)name;
        f->help = (char *)help;
        f->type = type;
        /* A family's samples are consecutive in the snapshot's array. */
        f->samples = &s->sample_ptrs[s->nsamples];
        s->family_ptrs[s->metrics.n_families++] = f;
        return f;
}

/* Adds a sample to the family added last, with up to two labels (pass
 * NULL names for fewer). */
static void sample_add(struct snapshot *s, double value, const char *l1, const char *v1, const char *l2,
                       const char *v2) {
        Moeep__V1__MetricFamily *f = s->metrics.n_families ? s->family_ptrs[s->metrics.n_families - 1] : NULL;
        const char *names[2] = { l1, l2 }, *values[2] = { v1, v2 };
        Moeep__V1__MetricSample *smp;

        if (s->overflow || !f || s->nsamples >= SNAPSHOT_SAMPLES || s->nlabels + 2 > SNAPSHOT_LABELS) {
                s->overflow = true;
                return;
        }
        smp = &s->samples[s->nsamples];
        moeep__v1__metric_sample__init(smp);
        smp->value = value;
        smp->labels = &s->label_ptrs[s->nlabels];
        for (int i = 0; i < 2 && names[i]; i++) {
                Moeep__V1__MetricLabel *l = &s->labels[s->nlabels];

                moeep__v1__metric_label__init(l);
                l->name = (char *)names[i];
                l->value = (char *)values[i];
                s->label_ptrs[s->nlabels++] = l;
                smp->n_labels++;
        }
        s->sample_ptrs[s->nsamples++] = smp;
        f->n_samples++;
}

/* A family of one unlabelled sample. */
static void single(struct snapshot *s, const char *name, Moeep__V1__MetricType type, const char *help,
                   double value) {
        if (family_add(s, name, type, help))
                sample_add(s, value, NULL, NULL, NULL, NULL);
}

#define COUNTER MOEEP__V1__METRIC_TYPE__METRIC_TYPE_COUNTER
#define GAUGE MOEEP__V1__METRIC_TYPE__METRIC_TYPE_GAUGE

static void snapshot_sessions(struct snapshot *s, const struct metrics *m) {
        /* session.h's session_state_to_string() of the states counted. */
        static const char *const states[METRICS_SESSION_STATES] = { "new", "hello", "ready" };

        family_add(
                s, "moeepd_sessions", GAUGE,
                "Connected client sessions by state (new: before Hello, hello: welcomed, ready: in a job).");
        for (size_t i = 0; i < METRICS_SESSION_STATES; i++)
                sample_add(s, m->sessions[i], "state", states[i], NULL, NULL);
        single(s, "moeepd_sessions_accepted_total", COUNTER, "Connections accepted as sessions.",
               (double)m->sessions_accepted);
        single(s, "moeepd_sessions_refused_total", COUNTER,
               "Connections refused by max_sessions or max_sessions_per_uid.", (double)m->sessions_refused);
}

static void snapshot_jobs(struct snapshot *s, const struct metrics *m) {
        static const enum job_state states[] = { JOB_FORMING, JOB_READY, JOB_ABORTED };
        uint32_t count[JOB_ABORTED + 1] = { 0 }, ranks = 0, lost = 0;
        const struct job *job;

        TAILQ_FOREACH (job, &m->jobs->list, entry) {
                count[job->state]++;
                ranks += job->njoined;
                lost += (uint32_t)__builtin_popcount(job->control->lost_ranks);
        }
        family_add(s, "moeepd_jobs", GAUGE, "Live jobs by state.");
        for (size_t i = 0; i < sizeof(states) / sizeof(states[0]); i++)
                sample_add(s, count[states[i]], "state", job_state_to_string(states[i]), NULL, NULL);
        single(s, "moeepd_jobs_created_total", COUNTER, "Jobs created.", (double)m->jobs_created);
        single(s, "moeepd_ranks", GAUGE, "Ranks joined to live jobs.", ranks);
        single(s, "moeepd_barriers_total", COUNTER, "Barriers that every rank of a job passed.",
               (double)m->jobs->barriers_completed);
        single(s, "moeepd_ranks_lost_total", COUNTER,
               "Ranks lost without JobLeave (socket closed, process died, bad record); each aborts its job.",
               (double)m->jobs->ranks_lost);
        single(s, "moeepd_job_lost_ranks", GAUGE,
               "Ranks of live jobs marked lost in their control page (elastic jobs go on without them).",
               lost);
}

static void snapshot_regions(struct snapshot *s, const struct metrics *m) {
        const struct uid_usage *u;
        uint64_t bytes = 0;

        LIST_FOREACH (u, &m->broker->usage, entry)
                bytes += u->bytes;
        single(s, "moeepd_regions", GAUGE, "Memory regions registered with the broker.", m->broker->nregions);
        single(s, "moeepd_registered_bytes", GAUGE, "Bytes of the registered memory regions.", (double)bytes);
        single(s, "moeepd_regions_registered_total", COUNTER, "Memory regions registered.",
               (double)m->regions_registered);
}

static void snapshot_requests(struct snapshot *s, const struct metrics *m) {
        family_add(s, "moeepd_requests_total", COUNTER, "Requests received, by type.");
        /* A sample per request row of proto/messages.def, labelled with
         * its body field. */
        for (unsigned t = MOEEP_TYPE_REQUEST_MIN; t <= MOEEP_TYPE_REQUEST_MAX; t++) {
                const struct moeep_message *row = moeep_message_lookup((uint16_t)t);

                if (row)
                        sample_add(s, (double)m->requests[t], "type", row->field, NULL, NULL);
        }
        family_add(s, "moeepd_errors_total", COUNTER, "Error responses sent, by code.");
        for (int code = 1; code < METRICS_ERROR_CODES; code++) {
                const ProtobufCEnumValue *e =
                        protobuf_c_enum_descriptor_get_value(&moeep__v1__error_code__descriptor, code);

                if (e)
                        sample_add(s, (double)m->errors[code], "code", e->name, NULL, NULL);
        }
}

static void snapshot_daemon(struct snapshot *s, const struct metrics *m) {
        snprintf(s->protocol, sizeof(s->protocol), "%d.%d", MOEEP_PROTOCOL_MAJOR, MOEEP_PROTOCOL_MINOR);
        if (family_add(s, "moeepd_build_info", GAUGE, "Always 1; the labels name the daemon's version."))
                sample_add(s, 1, "version", MOEEP_VERSION, "protocol", s->protocol);
        single(s, "moeepd_uptime_seconds", GAUGE, "Seconds since the daemon started.",
               (double)metrics_uptime_ms(m) / 1000.0);
        single(s, "moeepd_draining", GAUGE, "1 while new jobs are refused (moeepctl drain), else 0.",
               m->jobs->draining);
        family_add(s, "moeepd_config_reloads_total", COUNTER, "SIGHUP reloads, by result.");
        sample_add(s, (double)m->reloads_ok, "result", "ok", NULL, NULL);
        sample_add(s, (double)m->reloads_failed, "result", "failed", NULL, NULL);
        single(s, "moeepd_http_requests_total", COUNTER, "Requests served by the metrics HTTP listener.",
               (double)m->http_requests);
        single(s, "moeepd_http_connections", GAUGE, "Open connections of the metrics HTTP listener.",
               m->http_connections);
        family_add(s, "moeepd_http_closed_total", COUNTER,
                   "Metrics HTTP connections closed by the daemon, by reason: over the connection cap, or "
                   "past the whole-request deadline.");
        sample_add(s, (double)m->http_refused, "reason", "cap", NULL, NULL);
        sample_add(s, (double)m->http_deadlines, "reason", "deadline", NULL, NULL);
}

static void snapshot_mesh(struct snapshot *s, const struct metrics *m) {
        static const enum mesh_peer_state states[] = { MESH_PEER_CONNECTING, MESH_PEER_AUTHENTICATING,
                                                       MESH_PEER_UP, MESH_PEER_DOWN };
        uint32_t count[MESH_PEER_DOWN + 1];

        mesh_count(m->mesh, count);
        family_add(s, "moeepd_mesh_peers", GAUGE,
                   "Peer daemons of the internode mesh by state (all 0 while the mesh is off).");
        for (size_t i = 0; i < sizeof(states) / sizeof(states[0]); i++)
                sample_add(s, count[states[i]], "state", mesh_peer_state_to_string(states[i]), NULL, NULL);
        single(s, "moeepd_mesh_refused_total", COUNTER,
               "Peer connections refused during the handshake (wrong or no cluster key, timeout, cap).",
               m->mesh ? (double)m->mesh->refused : 0);
}

/* The transport peers held (connected, draining), and the bytes the
 * transport wrote by where they travelled (transport.h, struct tp_stats;
 * only backends that count, cuda, have that family). */
static void snapshot_transport(struct snapshot *s, const struct metrics *m) {
        uint32_t connected, draining;
        struct tp_stats st;

        datapath_transport_peers(m->datapath, &connected, &draining);
        family_add(s, "moeepd_transport_peers", GAUGE,
                   "Transport peers held: connected (one per mesh connection with a data path), draining "
                   "(failed; their writes still drain or their connection has not let go). Their indexes are "
                   "reused once freed.");
        sample_add(s, connected, "state", "connected", NULL, NULL);
        sample_add(s, draining, "state", "draining", NULL, NULL);
        if (!datapath_transport_stats(m->datapath, &st))
                return;
        family_add(s, "moeepd_transport_bytes_total", COUNTER,
                   "Bytes the internode transport wrote: device (GPU to GPU), host (through a client's host "
                   "memory), daemon (the proxy's signal words).");
        sample_add(s, (double)st.device, "path", "device", NULL, NULL);
        sample_add(s, (double)st.host, "path", "host", NULL, NULL);
        sample_add(s, (double)st.daemon, "path", "daemon", NULL, NULL);
}

void metrics_init(struct metrics *m, const struct timespec *started, const struct jobs *jobs,
                  const struct broker *broker, const struct mesh *mesh, const struct datapath *datapath) {
        *m = (struct metrics){
                .jobs = jobs,
                .broker = broker,
                .mesh = mesh,
                .datapath = datapath,
                .started = *started,
        };
}

uint64_t metrics_uptime_ms(const struct metrics *m) {
        struct timespec now;

        clock_gettime(CLOCK_MONOTONIC, &now);
        return (uint64_t)(now.tv_sec - m->started.tv_sec) * 1000 +
               (uint64_t)((now.tv_nsec - m->started.tv_nsec) / 1000000);
}

int metrics_snapshot(const struct metrics *m, Moeep__V1__Metrics **ret_metrics) {
        struct snapshot *s = calloc(1, sizeof(*s));

        if (!s)
                return -ENOMEM;
        moeep__v1__metrics__init(&s->metrics);
        s->metrics.families = s->family_ptrs;
        snapshot_daemon(s, m);
        snapshot_sessions(s, m);
        snapshot_jobs(s, m);
        snapshot_regions(s, m);
        snapshot_mesh(s, m);
        snapshot_transport(s, m);
        snapshot_requests(s, m);
        if (s->overflow) /* our own bounds: SNAPSHOT_* must grow with the families */
                log_err("metrics: snapshot bounds too small, some samples are missing");
        *ret_metrics = &s->metrics;
        return 0;
}

void metrics_snapshot_free(Moeep__V1__Metrics *m) {
        free(m); /* the snapshot's first member */
}
