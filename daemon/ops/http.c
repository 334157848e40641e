/* The metrics HTTP listener; see http.h. */
#include <arpa/inet.h>
#include <errno.h>
#include <event2/event.h>
#include <inttypes.h>
#include <netdb.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "metrics-text.h"
#include "ops/http.h"
#include "ops/metrics.h"

/* Connections accepted per callback before others get a turn. */
#define HTTP_ACCEPT_BATCH 64
/* Back-off after accept() ran out of descriptors. */
#define HTTP_ACCEPT_PAUSE_MS 1000

/* What a refused connection is told, in one send() that a fresh socket's
 * buffer always takes. */
static const char http_busy[] = "HTTP/1.1 503 Service Unavailable\r\n"
                                "Content-Type: text/plain; charset=utf-8\r\n"
                                "Content-Length: 28\r\n"
                                "Connection: close\r\n"
                                "\r\n"
                                "moeepd: too many connections";

enum http_conn_state {
        HTTP_READING, /* reading the request head */
        HTTP_WRITING, /* writing the answer */
        HTTP_CLOSING, /* answer sent and write side shut: waiting for the client's EOF */
};

struct http_conn {
        struct http *http;  /* not owning */
        int fd;             /* owns */
        uint8_t source[16]; /* its source: an IPv4 address (mapped) or an IPv6 /64 */
        enum http_conn_state state;
        bool peer_closed;          /* EOF while writing: free once the answer is out */
        struct event *ev_read;     /* owns */
        struct event *ev_write;    /* owns; pending only while writing */
        struct event *ev_deadline; /* owns; HTTP_DEADLINE_MS from accept, whatever happens */
        size_t in_len;
        char *out; /* owns; the whole answer */
        size_t out_len, out_off;
        TAILQ_ENTRY(http_conn) entry;
        char in[HTTP_MAX_REQUEST + 1]; /* the request head so far, NUL-terminated */
};

TAILQ_HEAD(http_conn_list, http_conn);

struct http {
        struct event_base *base;     /* not owning */
        struct metrics *metrics;     /* not owning; what it serves and where it counts */
        int fd;                      /* owns; the listening socket */
        struct event *ev_accept;     /* owns */
        struct event *ev_resume;     /* owns; re-enables accepting after EMFILE */
        struct http_conn_list conns; /* owns */
};

static void http_conn_free(struct http_conn *c) {
        struct http *h = c->http;

        TAILQ_REMOVE(&h->conns, c, entry);
        h->metrics->http_connections--;
        if (c->ev_read)
                event_free(c->ev_read);
        if (c->ev_write)
                event_free(c->ev_write);
        if (c->ev_deadline)
                event_free(c->ev_deadline);
        close(c->fd);
        free(c->out);
        free(c);
}

/* Queues the answer (status line, headers and, unless `head_only`, the
 * body) and switches from reading to writing. */
static void http_answer(struct http_conn *c, int code, const char *reason, const char *type, const char *body,
                        size_t body_len, bool head_only, const char *extra_headers) {
        char head[512];
        int n;

        n = snprintf(
                head, sizeof(head),
                "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%sConnection: close\r\n\r\n",
                code, reason, type, body_len, extra_headers);
        c->out_len = (size_t)n + (head_only ? 0 : body_len);
        c->out = malloc(c->out_len);
        if (n < 0 || (size_t)n >= sizeof(head) || !c->out) {
                http_conn_free(c);
                return;
        }
        memcpy(c->out, head, (size_t)n);
        if (!head_only)
                memcpy(c->out + n, body, body_len);
        c->state = HTTP_WRITING;
        event_add(c->ev_write, NULL);
}

static void http_answer_text(struct http_conn *c, int code, const char *reason, const char *text,
                             const char *extra_headers) {
        http_answer(c, code, reason, "text/plain; charset=utf-8", text, strlen(text), false, extra_headers);
}

static void http_answer_metrics(struct http_conn *c, bool head_only) {
        Moeep__V1__Metrics *m = NULL;
        char *text = NULL;
        size_t len = 0;
        FILE *f;

        c->http->metrics->http_requests++;
        if (metrics_snapshot(c->http->metrics, &m) < 0) {
                http_answer_text(c, 500, "Internal Server Error", "out of memory\n", "");
                return;
        }
        f = open_memstream(&text, &len);
        if (!f || moeep_metrics_write_text(m, f) < 0 || fclose(f) != 0) {
                if (f)
                        free(text);
                metrics_snapshot_free(m);
                http_answer_text(c, 500, "Internal Server Error", "out of memory\n", "");
                return;
        }
        metrics_snapshot_free(m);
        http_answer(c, 200, "OK", MOEEP_METRICS_CONTENT_TYPE, text, len, head_only, "");
        free(text);
}

/* Answers the complete request head in c->in. Only the request line
 * matters: no header changes the answer. */
static void http_handle(struct http_conn *c) {
        char method[16], target[HTTP_MAX_REQUEST], version[16];
        size_t path_len;
        bool head;

        if (sscanf(c->in, "%15[A-Z] %8191[^ \r\n] HTTP/%15[0-9.]", method, target, version) != 3 ||
            target[0] != '/') {
                http_answer_text(c, 400, "Bad Request", "moeepd: not an HTTP request\n", "");
                return;
        }
        head = strcmp(method, "HEAD") == 0;
        if (!head && strcmp(method, "GET") != 0) {
                http_answer_text(c, 405, "Method Not Allowed", "moeepd serves only GET and HEAD\n",
                                 "Allow: GET, HEAD\r\n");
                return;
        }
        path_len = strcspn(target, "?");
        if (path_len == strlen("/metrics") && memcmp(target, "/metrics", path_len) == 0)
                http_answer_metrics(c, head);
        else
                http_answer_text(c, 404, "Not Found", "moeepd serves only /metrics\n", "");
}

static void http_read_cb(evutil_socket_t fd, short what, void *arg) {
        struct http_conn *c = arg;
        char discard[1024];
        ssize_t n;

        if (c->state != HTTP_READING) {
                /* Whatever the client still sends is dropped; its EOF (or
                 * the deadline) ends the connection. Closing with unread
                 * input would reset it and could cut the answer short. */
                n = recv(fd, discard, sizeof(discard), 0);
                if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR)))
                        return;
                if (n == 0 && c->state == HTTP_WRITING) {
                        /* Half-closed after its request: the answer still
                         * goes out, then the connection ends. */
                        event_del(c->ev_read);
                        c->peer_closed = true;
                        return;
                }
                http_conn_free(c);
                return;
        }
        n = recv(fd, c->in + c->in_len, HTTP_MAX_REQUEST - c->in_len, 0);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
                return;
        if (n <= 0) {
                http_conn_free(c);
                return;
        }
        c->in_len += (size_t)n;
        c->in[c->in_len] = '\0';
        if (memchr(c->in, '\0', c->in_len)) {
                http_answer_text(c, 400, "Bad Request", "moeepd: a NUL byte in the request\n", "");
                return;
        }
        if (strstr(c->in, "\r\n\r\n") || strstr(c->in, "\n\n"))
                http_handle(c);
        else if (c->in_len == HTTP_MAX_REQUEST)
                http_answer_text(c, 431, "Request Header Fields Too Large",
                                 "moeepd: the request head is larger than 8192 bytes\n", "");
}

static void http_write_cb(evutil_socket_t fd, short what, void *arg) {
        struct http_conn *c = arg;
        ssize_t n;

        n = send(fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
                return;
        if (n < 0) {
                http_conn_free(c);
                return;
        }
        c->out_off += (size_t)n;
        if (c->out_off < c->out_len)
                return;
        if (c->peer_closed) {
                http_conn_free(c);
                return;
        }
        event_del(c->ev_write);
        shutdown(fd, SHUT_WR);
        c->state = HTTP_CLOSING;
}

static void http_deadline_cb(evutil_socket_t fd, short what, void *arg) {
        struct http_conn *c = arg;

        log_debug("metrics: connection fd %d: %d ms passed, closing it (%s)", c->fd, HTTP_DEADLINE_MS,
                  c->state == HTTP_READING ? "the request never completed" : "the client did not close");
        c->http->metrics->http_deadlines++;
        http_conn_free(c);
}

/* The quota's key of a peer address: the IPv4 address (as v4-mapped
 * IPv6), or the /64 of an IPv6 one. */
static void http_source_key(const struct sockaddr_storage *ss, uint8_t ret[static 16]) {
        memset(ret, 0, 16);
        if (ss->ss_family == AF_INET) {
                ret[10] = ret[11] = 0xff;
                memcpy(ret + 12, &((const struct sockaddr_in *)ss)->sin_addr, 4);
        } else if (ss->ss_family == AF_INET6) {
                const struct in6_addr *a = &((const struct sockaddr_in6 *)ss)->sin6_addr;

                memcpy(ret, a->s6_addr, IN6_IS_ADDR_V4MAPPED(a) ? 16 : 8);
        }
}

/* The oldest connection from `source` (the list is in accept order), and
 * how many there are. */
static struct http_conn *http_source_oldest(const struct http *h, const uint8_t source[static 16],
                                            uint32_t *ret_count) {
        struct http_conn *c, *oldest = NULL;
        uint32_t n = 0;

        TAILQ_FOREACH (c, &h->conns, entry)
                if (memcmp(c->source, source, 16) == 0) {
                        oldest = oldest ? oldest : c;
                        n++;
                }
        *ret_count = n;
        return oldest;
}

/* Makes room for one more connection from `source`: its own oldest goes
 * when it is at its quota; when every slot is taken, the oldest of the
 * source that holds the most. A scraper's request comes in its first
 * milliseconds, so only connections that dawdle are ever displaced. */
static void http_make_room(struct http *h, const uint8_t source[static 16]) {
        struct http_conn *c, *victim;
        uint32_t n, most = 0;
        bool own;

        victim = http_source_oldest(h, source, &n);
        own = n >= HTTP_MAX_PER_SOURCE;
        if (!own)
                victim = NULL;
        if (!victim && h->metrics->http_connections >= HTTP_MAX_CONNECTIONS)
                TAILQ_FOREACH (c, &h->conns, entry) {
                        struct http_conn *o = http_source_oldest(h, c->source, &n);

                        if (n > most) {
                                most = n;
                                victim = o;
                        }
                }
        if (!victim)
                return;
        h->metrics->http_refused++;
        log_debug("metrics: connection fd %d displaced: its source holds %s", victim->fd,
                  own ? "its quota" : "the most of the connections");
        (void)send(victim->fd, http_busy, sizeof(http_busy) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        http_conn_free(victim);
}

static void http_conn_new(struct http *h, int fd, const struct sockaddr_storage *peer) {
        struct timeval deadline = { .tv_sec = HTTP_DEADLINE_MS / 1000,
                                    .tv_usec = (HTTP_DEADLINE_MS % 1000) * 1000 };
        uint8_t source[16];
        struct http_conn *c;

        http_source_key(peer, source);
        http_make_room(h, source);
        c = calloc(1, sizeof(*c));
        if (!c) {
                h->metrics->http_refused++;
                close(fd);
                return;
        }
        c->http = h;
        c->fd = fd;
        memcpy(c->source, source, sizeof(source));
        c->state = HTTP_READING;
        TAILQ_INSERT_TAIL(&h->conns, c, entry);
        h->metrics->http_connections++;
        c->ev_read = event_new(h->base, fd, EV_READ | EV_PERSIST, http_read_cb, c);
        c->ev_write = event_new(h->base, fd, EV_WRITE | EV_PERSIST, http_write_cb, c);
        c->ev_deadline = evtimer_new(h->base, http_deadline_cb, c);
        if (!c->ev_read || !c->ev_write || !c->ev_deadline || event_add(c->ev_read, NULL) < 0 ||
            evtimer_add(c->ev_deadline, &deadline) < 0)
                http_conn_free(c);
}

static void http_accept_cb(evutil_socket_t lfd, short what, void *arg) {
        struct http *h = arg;
        struct timeval pause = { .tv_sec = HTTP_ACCEPT_PAUSE_MS / 1000,
                                 .tv_usec = (HTTP_ACCEPT_PAUSE_MS % 1000) * 1000 };

        for (int i = 0; i < HTTP_ACCEPT_BATCH; i++) {
                struct sockaddr_storage peer = { 0 };
                socklen_t len = sizeof(peer);
                int fd = accept4(lfd, (struct sockaddr *)&peer, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);

                if (fd < 0) {
                        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                                log_warn("metrics: accept: %s: pausing for %d ms", strerror(errno),
                                         HTTP_ACCEPT_PAUSE_MS);
                                event_del(h->ev_accept);
                                evtimer_add(h->ev_resume, &pause);
                        }
                        return;
                }
                http_conn_new(h, fd, &peer);
        }
}

static void http_resume_cb(evutil_socket_t fd, short what, void *arg) {
        struct http *h = arg;

        event_add(h->ev_accept, NULL);
}

/* The address and port the listener really got (port 0 asks for any). */
static void http_log_bound(int fd) {
        struct sockaddr_storage ss = { 0 };
        socklen_t len = sizeof(ss);
        char addr[INET6_ADDRSTRLEN] = "?";
        unsigned port = 0;

        if (getsockname(fd, (struct sockaddr *)&ss, &len) == 0) {
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
        log_info("metrics: listening on http://%s%s%s:%u/metrics (at most %d connections, %d ms each)",
                 ss.ss_family == AF_INET6 ? "[" : "", addr, ss.ss_family == AF_INET6 ? "]" : "", port,
                 HTTP_MAX_CONNECTIONS, HTTP_DEADLINE_MS);
}

/* Binds and listens on host:port; returns the socket or -errno. */
static int http_listen(const char *host, uint16_t port) {
        struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV };
        struct addrinfo *ai = NULL;
        char service[8];
        int fd, one = 1, r;

        snprintf(service, sizeof(service), "%u", (unsigned)port);
        r = getaddrinfo(host, service, &hints, &ai);
        if (r != 0)
                return r == EAI_SYSTEM ? -errno : -EADDRNOTAVAIL;
        fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
                r = -errno;
                goto out;
        }
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
            bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 128) < 0) {
                r = -errno;
                close(fd);
                goto out;
        }
        r = fd;
out:
        freeaddrinfo(ai);
        return r;
}

int http_start(struct event_base *base, const char *listen, struct metrics *m, struct http **ret_http,
               char *errmsg) {
        char host[CONFIG_HOST_MAX];
        struct http *h;
        uint16_t port;
        int fd;

        if (config_listen_split(listen, host, &port) < 0)
                return errmsg_set(errmsg, -EINVAL, "metrics_listen '%s': not an address", listen);
        fd = http_listen(host, port);
        if (fd < 0)
                return errmsg_set(errmsg, fd, "metrics_listen '%s': cannot listen on %s port %u: %s", listen,
                                  host, (unsigned)port, strerror(-fd));
        h = calloc(1, sizeof(*h));
        if (!h) {
                close(fd);
                return errmsg_set(errmsg, -ENOMEM, "metrics_listen '%s': out of memory", listen);
        }
        h->base = base;
        h->metrics = m;
        h->fd = fd;
        TAILQ_INIT(&h->conns);
        h->ev_accept = event_new(base, fd, EV_READ | EV_PERSIST, http_accept_cb, h);
        h->ev_resume = evtimer_new(base, http_resume_cb, h);
        if (!h->ev_accept || !h->ev_resume || event_add(h->ev_accept, NULL) < 0) {
                http_free(h);
                return errmsg_set(errmsg, -ENOMEM, "metrics_listen '%s': out of memory", listen);
        }
        http_log_bound(fd);
        *ret_http = h;
        return 0;
}

void http_free(struct http *h) {
        struct http_conn *c;

        if (!h)
                return;
        while ((c = TAILQ_FIRST(&h->conns)))
                http_conn_free(c);
        if (h->ev_accept)
                event_free(h->ev_accept);
        if (h->ev_resume)
                event_free(h->ev_resume);
        close(h->fd);
        free(h);
}
