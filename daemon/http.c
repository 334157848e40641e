/* The metrics HTTP listener; see http.h. */
#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/http.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "config.h"
#include "daemon.h"
#include "http.h"
#include "log.h"
#include "metrics-text.h"
#include "metrics.h"

/* A scraper gets this long to send its request and read the answer. */
#define HTTP_TIMEOUT_S 10
/* Request headers beyond this are refused (413): only a scraper talks here. */
#define HTTP_MAX_HEADERS 8192

struct http {
        struct daemon *daemon; /* not owning */
        struct evhttp *evhttp; /* owns, with its bound socket and connections */
};

static void http_reply_error(struct evhttp_request *req, int code, const char *reason, const char *text) {
        struct evbuffer *body = evbuffer_new();

        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                          "text/plain; charset=utf-8");
        if (body)
                evbuffer_add_printf(body, "%s\n", text);
        evhttp_send_reply(req, code, reason, body);
        if (body)
                evbuffer_free(body);
}

static void http_metrics_cb(struct evhttp_request *req, void *arg) {
        struct http *h = arg;
        Moeep__V1__Metrics *m = NULL;
        struct evbuffer *body;
        char *text = NULL;
        size_t len = 0;
        FILE *f;

        h->daemon->metrics.http_requests++;
        if (metrics_snapshot(h->daemon, &m) < 0) {
                http_reply_error(req, HTTP_INTERNAL, "Internal Server Error", "out of memory");
                return;
        }
        f = open_memstream(&text, &len);
        if (!f || moeep_metrics_write_text(m, f) < 0 || fclose(f) != 0) {
                if (f)
                        free(text);
                metrics_snapshot_free(m);
                http_reply_error(req, HTTP_INTERNAL, "Internal Server Error", "out of memory");
                return;
        }
        metrics_snapshot_free(m);
        body = evbuffer_new();
        if (!body || evbuffer_add(body, text, len) < 0) {
                free(text);
                if (body)
                        evbuffer_free(body);
                http_reply_error(req, HTTP_INTERNAL, "Internal Server Error", "out of memory");
                return;
        }
        free(text);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", MOEEP_METRICS_CONTENT_TYPE);
        evhttp_send_reply(req, HTTP_OK, "OK", body);
        evbuffer_free(body);
}

/* Everything but /metrics. */
static void http_other_cb(struct evhttp_request *req, void *arg) {
        http_reply_error(req, HTTP_NOTFOUND, "Not Found", "moeepd serves only /metrics");
}

/* The address and port the listener really got (port 0 asks for any). */
static void http_log_bound(struct evhttp_bound_socket *bound) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof(ss);
        char addr[INET6_ADDRSTRLEN] = "?";
        unsigned port = 0;

        if (getsockname(evhttp_bound_socket_get_fd(bound), (struct sockaddr *)&ss, &len) == 0) {
                if (ss.ss_family == AF_INET6) {
                        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)&ss;

                        inet_ntop(AF_INET6, &s6->sin6_addr, addr, sizeof(addr));
                        port = ntohs(s6->sin6_port);
                } else if (ss.ss_family == AF_INET) {
                        const struct sockaddr_in *s4 = (const struct sockaddr_in *)&ss;

                        inet_ntop(AF_INET, &s4->sin_addr, addr, sizeof(addr));
                        port = ntohs(s4->sin_port);
                }
        }
        log_info("metrics: listening on http://%s%s%s:%u/metrics", ss.ss_family == AF_INET6 ? "[" : "", addr,
                 ss.ss_family == AF_INET6 ? "]" : "", port);
}

int http_start(struct daemon *d, const char *listen, struct http **ret_http, char *errmsg) {
        struct evhttp_bound_socket *bound;
        char host[CONFIG_HOST_MAX];
        struct http *h;
        uint16_t port;

        if (config_listen_split(listen, host, &port) < 0)
                return errmsg_set(errmsg, -EINVAL, "metrics_listen '%s': not an address", listen);
        h = calloc(1, sizeof(*h));
        if (!h)
                return errmsg_set(errmsg, -ENOMEM, "metrics_listen '%s': out of memory", listen);
        h->daemon = d;
        h->evhttp = evhttp_new(d->base);
        if (!h->evhttp) {
                free(h);
                return errmsg_set(errmsg, -ENOMEM, "metrics_listen '%s': out of memory", listen);
        }
        evhttp_set_allowed_methods(h->evhttp, EVHTTP_REQ_GET | EVHTTP_REQ_HEAD);
        evhttp_set_timeout(h->evhttp, HTTP_TIMEOUT_S);
        evhttp_set_max_headers_size(h->evhttp, HTTP_MAX_HEADERS);
        evhttp_set_max_body_size(h->evhttp, 0);
        if (evhttp_set_cb(h->evhttp, "/metrics", http_metrics_cb, h) < 0) {
                http_free(h);
                return errmsg_set(errmsg, -ENOMEM, "metrics_listen '%s': out of memory", listen);
        }
        evhttp_set_gencb(h->evhttp, http_other_cb, h);
        errno = 0;
        bound = evhttp_bind_socket_with_handle(h->evhttp, host, port);
        if (!bound) {
                int e = errno ? errno : EADDRNOTAVAIL;

                http_free(h);
                return errmsg_set(errmsg, -e, "metrics_listen '%s': cannot listen on %s port %u: %s", listen,
                                  host, (unsigned)port, strerror(e));
        }
        http_log_bound(bound);
        *ret_http = h;
        return 0;
}

void http_free(struct http *h) {
        if (!h)
                return;
        if (h->evhttp)
                evhttp_free(h->evhttp);
        free(h);
}
