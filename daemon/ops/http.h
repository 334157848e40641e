/* The metrics HTTP listener: GET (or HEAD) /metrics answers the Prometheus
 * text format of a metrics snapshot. Opt-in (metrics_listen), bound to
 * 127.0.0.1 unless the operator names another address; it serves nothing
 * but /metrics, reads no request body and answers one request per
 * connection (Connection: close). It runs on the loop thread, like
 * everything else.
 *
 * It is a small server of its own rather than libevent's evhttp, because
 * evhttp (2.1) can neither cap its connections nor bound a connection's
 * whole life: its timeout restarts with every byte, so a client that drips
 * one byte a second keeps its fd for ever. Here:
 * - at most HTTP_MAX_CONNECTIONS connections are open, at most
 *   HTTP_MAX_PER_SOURCE of them from one source (an IPv4 address or an
 *   IPv6 /64): a new connection from a source at its quota displaces that
 *   source's oldest, and when every slot is taken it displaces the oldest
 *   of the source that holds the most (as the mesh's pre-authentication
 *   slots do), so that no source, however fast it reconnects, keeps a
 *   scraper of another out; a displaced connection is answered 503 and
 *   closed;
 * - a connection lives at most HTTP_DEADLINE_MS from accept to close,
 *   however it trickles (reading the request, writing the answer, waiting
 *   for the client to close);
 * - a request head (request line and headers) is at most HTTP_MAX_REQUEST
 *   bytes (431 beyond).
 *
 * It knows nothing of the daemon: daemon.c starts it with the hooks that
 * take and free a snapshot (metrics.c), and metrics.c reads its counters
 * through http_counters(). */
#ifndef MOEEPD_HTTP_H
#define MOEEPD_HTTP_H

#include <stdint.h>

#define HTTP_MAX_CONNECTIONS 32
#define HTTP_MAX_PER_SOURCE 8
#define HTTP_DEADLINE_MS 5000
#define HTTP_MAX_REQUEST 8192

#include "moeep.pb-c.h"

struct event_base;
struct http;

/* Where the answers come from. Called on the loop with `ctx`. */
struct http_hooks {
        void *ctx; /* not owning */
        /* A snapshot of the metrics: 0 with *ret, or -ENOMEM. */
        int (*snapshot)(void *ctx, Moeep__V1__Metrics **ret);
        void (*snapshot_free)(Moeep__V1__Metrics *m);
};

/* What the listener counts, for the metrics. Written by http.c only. */
struct http_counters {
        uint64_t requests;    /* scrapes served */
        uint64_t refused;     /* connections closed for the caps: displaced (or out of memory) */
        uint64_t deadlines;   /* connections closed at HTTP_DEADLINE_MS */
        uint32_t connections; /* open now */
};

/* Starts listening on `listen` (as metrics_listen takes it). Logs the
 * address and port it bound. Returns 0 with *ret_http, or -errno with
 * errmsg naming the address. */
int http_start(struct event_base *base, const char *listen, const struct http_hooks *hooks,
               struct http **ret_http, char *errmsg);

/* Its counters; all 0 for NULL (no listener). */
const struct http_counters *http_counters(const struct http *h);

/* Stops listening and closes open connections. Accepts NULL. */
void http_free(struct http *h);

#endif
