/* The metrics HTTP listener (libevent's evhttp): GET /metrics answers the
 * Prometheus text format of a metrics snapshot. Opt-in (metrics_listen),
 * bound to 127.0.0.1 unless the operator names another address; it serves
 * nothing but /metrics and reads no request body. It runs on the loop
 * thread, like everything else. */
#ifndef MOEEPD_HTTP_H
#define MOEEPD_HTTP_H

struct daemon;
struct http;

/* Starts listening on `listen` (as metrics_listen takes it). Logs the
 * address and port it bound. Returns 0 with *ret_http, or -errno with
 * errmsg naming the address. */
int http_start(struct daemon *d, const char *listen, struct http **ret_http, char *errmsg);

/* Stops listening and closes open connections. Accepts NULL. */
void http_free(struct http *h);

#endif
