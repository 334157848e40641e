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
 * - at most HTTP_MAX_CONNECTIONS connections are open; one more is
 *   answered 503 and closed at once, without being read;
 * - a connection lives at most HTTP_DEADLINE_MS from accept to close,
 *   however it trickles (reading the request, writing the answer, waiting
 *   for the client to close);
 * - a request head (request line and headers) is at most HTTP_MAX_REQUEST
 *   bytes (431 beyond). */
#ifndef MOEEPD_HTTP_H
#define MOEEPD_HTTP_H

#include <stdint.h>

#define HTTP_MAX_CONNECTIONS 32
#define HTTP_DEADLINE_MS 5000
#define HTTP_MAX_REQUEST 8192

struct daemon;
struct http;

/* Starts listening on `listen` (as metrics_listen takes it). Logs the
 * address and port it bound. Returns 0 with *ret_http, or -errno with
 * errmsg naming the address. */
int http_start(struct daemon *d, const char *listen, struct http **ret_http, char *errmsg);

/* Connections open now (for the metrics). Accepts NULL. */
uint32_t http_connections(const struct http *h);

/* Stops listening and closes open connections. Accepts NULL. */
void http_free(struct http *h);

#endif
