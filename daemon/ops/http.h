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
 * It answers with a snapshot of struct metrics (metrics.h), which it is
 * handed at start and where it counts its scrapes and connections; daemon.c
 * starts it. */
#ifndef MOEEPD_HTTP_H
#define MOEEPD_HTTP_H

#include <stdint.h>

#define HTTP_MAX_CONNECTIONS 32
#define HTTP_MAX_PER_SOURCE 8
#define HTTP_DEADLINE_MS 5000
#define HTTP_MAX_REQUEST 8192

struct event_base;
struct http;
struct metrics;

/* Starts listening on `listen` (as metrics_listen takes it), answering with
 * snapshots of `m` and counting in it (http_*). Logs the address and port
 * it bound. Returns 0 with *ret_http, or -errno with errmsg naming the
 * address. */
int http_start(struct event_base *base, const char *listen, struct metrics *m, struct http **ret_http,
               char *errmsg);

/* Stops listening and closes open connections. Accepts NULL. */
void http_free(struct http *h);

#endif
