/* The daemon object; see daemon.h. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "broker.h"
#include "clientfd.h"
#include "daemon.h"
#include "datapath.h"
#include "http.h"
#include "mesh.h"
#include "job.h"
#include "log.h"
#include "moeep-config.h"
#include "record.h"
#include "session.h"

/* Connections accepted per callback before others get a turn. */
#define DAEMON_ACCEPT_BATCH 64
/* Back-off after accept() ran out of descriptors. */
#define DAEMON_ACCEPT_PAUSE_MS 1000

static const int daemon_signals[] = { SIGTERM, SIGINT, SIGHUP };

uint64_t daemon_uptime_ms(const struct daemon *d) {
        struct timespec now;

        clock_gettime(CLOCK_MONOTONIC, &now);
        return (uint64_t)(now.tv_sec - d->started.tv_sec) * 1000 +
               (uint64_t)((now.tv_nsec - d->started.tv_nsec) / 1000000);
}

void daemon_status_changed(struct daemon *d) {
        /* While stopping, STOPPING=1 carried the last STATUS=. */
        if (!d->jobs || d->stopping)
                return;
        if (d->status_sent && d->status_sessions == d->nsessions && d->status_jobs == d->jobs->count)
                return;
        d->status_sent = true;
        d->status_sessions = d->nsessions;
        d->status_jobs = d->jobs->count;
        sd_notifyf(0, "STATUS=%" PRIu32 " sessions, %" PRIu32 " jobs", d->nsessions, d->jobs->count);
}

const char *daemon_config_path(const struct daemon_options *o) {
        if (o->no_config)
                return NULL;
        if (o->config_path)
                return o->config_path;
        return access(MOEEP_DEFAULT_CONFIG, F_OK) == 0 ? MOEEP_DEFAULT_CONFIG : NULL;
}

int daemon_config_build(const struct daemon_options *o, struct config *ret_config, char *errmsg) {
        const char *path = daemon_config_path(o);
        struct config c;
        int r;

        r = config_init(&c);
        if (r < 0)
                return errmsg_set(errmsg, r, "embedded defaults: out of memory");
        if (path) {
                r = config_load(&c, path, errmsg);
                if (r < 0)
                        goto fail;
        }
        if (o->socket) {
                r = config_set(&c, "socket", o->socket, errmsg);
                if (r < 0)
                        goto fail;
        }
        if (o->log_level) {
                r = config_set(&c, "log_level", o->log_level, errmsg);
                if (r < 0)
                        goto fail;
        }
        if (o->metrics_listen) {
                r = config_set(&c, "metrics_listen", o->metrics_listen, errmsg);
                if (r < 0)
                        goto fail;
        }
        *ret_config = c;
        return 0;

fail:
        config_done(&c);
        return r;
}

/* A socket already at `path`: refuse when a daemon answers there, remove
 * it when it is a stale leftover of a daemon that died. */
static int daemon_clear_stale(const struct sockaddr_un *sa) {
        struct stat st;
        int fd, r;

        if (lstat(sa->sun_path, &st) < 0)
                return errno == ENOENT ? 0 : -errno;
        if (!S_ISSOCK(st.st_mode))
                return -EEXIST;
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return -errno;
        r = connect(fd, (const struct sockaddr *)sa, sizeof(*sa));
        close(fd);
        if (r == 0)
                return -EADDRINUSE;
        if (unlink(sa->sun_path) < 0 && errno != ENOENT)
                return -errno;
        return 0;
}

/* Binds the socket ourselves: created under a umask so that it is never
 * more open than 0600 before the chmod, then given its mode and group. */
static int daemon_bind(struct daemon *d) {
        const struct config *c = &d->config;
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        mode_t old_umask;
        int fd, r;

        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", c->socket);
        r = daemon_clear_stale(&sa);
        if (r < 0) {
                log_err("socket %s: %s", c->socket,
                        r == -EADDRINUSE ? "another daemon is listening there"
                        : r == -EEXIST   ? "exists and is not a socket"
                                         : strerror(-r));
                return r;
        }
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
                r = -errno;
                log_err("socket %s: socket(): %s", c->socket, strerror(errno));
                return r;
        }
        old_umask = umask(0177);
        r = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
        umask(old_umask);
        if (r < 0) {
                r = -errno;
                log_err("socket %s: bind: %s", c->socket, strerror(errno));
                goto fail;
        }
        d->bound_path = strdup(c->socket);
        if (!d->bound_path) {
                r = -ENOMEM;
                unlink(c->socket);
                goto fail;
        }
        if (chmod(c->socket, c->socket_mode) < 0) {
                r = -errno;
                log_err("socket %s: chmod 0%o: %s", c->socket, (unsigned)c->socket_mode, strerror(errno));
                goto fail;
        }
        if (c->socket_group[0]) {
                struct group gr, *grr = NULL;
                char buf[4096];

                if (getgrnam_r(c->socket_group, &gr, buf, sizeof(buf), &grr) != 0 || !grr) {
                        r = -ENOENT;
                        log_err("socket_group '%s': no such group", c->socket_group);
                        goto fail;
                }
                if (chown(c->socket, (uid_t)-1, gr.gr_gid) < 0) {
                        r = -errno;
                        log_err("socket %s: chgrp %s: %s", c->socket, c->socket_group, strerror(errno));
                        goto fail;
                }
        }
        if (listen(fd, SOMAXCONN) < 0) {
                r = -errno;
                log_err("socket %s: listen: %s", c->socket, strerror(errno));
                goto fail;
        }
        d->listen_fd = fd;
        log_info("listening on %s (mode 0%o%s%s)", c->socket, (unsigned)c->socket_mode,
                 c->socket_group[0] ? ", group " : "", c->socket_group);
        return 0;

fail:
        close(fd);
        return r;
}

/* Takes the socket systemd passed (moeepd.socket), or binds one. */
static int daemon_listen(struct daemon *d) {
        int n = sd_listen_fds(1);
        int fd = SD_LISTEN_FDS_START;
        int flags;

        if (n < 0) {
                log_err("sd_listen_fds: %s", strerror(-n));
                return n;
        }
        if (n == 0)
                return daemon_bind(d);
        if (n > 1) {
                log_err("socket activation passed %d sockets: need exactly 1", n);
                return -EINVAL;
        }
        if (sd_is_socket(fd, AF_UNIX, SOCK_SEQPACKET, 1) <= 0) {
                log_err("socket activation: fd %d is not a listening AF_UNIX SOCK_SEQPACKET socket "
                        "(use ListenSequentialPacket=)",
                        fd);
                return -EINVAL;
        }
        flags = fcntl(fd, F_GETFL);
        if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
                int r = -errno;

                log_err("socket activation: fd %d: fcntl: %s", fd, strerror(errno));
                return r;
        }
        d->listen_fd = fd;
        log_info("listening on the socket systemd passed (fd %d)", fd);
        return 0;
}

static void daemon_accept_cb(evutil_socket_t lfd, short what, void *arg) {
        struct daemon *d = arg;
        struct timeval pause = { .tv_sec = DAEMON_ACCEPT_PAUSE_MS / 1000,
                                 .tv_usec = (DAEMON_ACCEPT_PAUSE_MS % 1000) * 1000 };

        for (int i = 0; i < DAEMON_ACCEPT_BATCH; i++) {
                struct session *s;
                int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                int r;

                if (fd < 0) {
                        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ||
                            errno == ECONNABORTED)
                                return;
                        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                                /* The pending connection stays queued;
                                 * without a pause we would spin on it. */
                                log_warn("accept: %s: pausing for %d ms", strerror(errno),
                                         DAEMON_ACCEPT_PAUSE_MS);
                                event_del(d->ev_listen);
                                evtimer_add(d->ev_accept_resume, &pause);
                                return;
                        }
                        log_err("accept: %s", strerror(errno));
                        return;
                }
                r = session_new(d, fd, &s);
                if (r < 0 && r != -EDQUOT) /* refusals were logged with their reason */
                        log_warn("new session: %s", strerror(-r));
        }
}

static void daemon_accept_resume_cb(evutil_socket_t fd, short what, void *arg) {
        struct daemon *d = arg;

        event_add(d->ev_listen, NULL);
}

static void daemon_reload(struct daemon *d) {
        char errmsg[ERRMSG_MAX] = "";
        struct config fresh;
        int r;

        r = daemon_config_build(&d->options, &fresh, errmsg);
        if (r < 0) {
                d->metrics.reloads_failed++;
                log_err("reload: %s: keeping the previous configuration", errmsg);
                return;
        }
        if (strcmp(fresh.socket, d->config.socket) != 0 || fresh.socket_mode != d->config.socket_mode ||
            strcmp(fresh.socket_group, d->config.socket_group) != 0 ||
            strcmp(fresh.metrics_listen, d->config.metrics_listen) != 0 ||
            strcmp(fresh.mesh_listen, d->config.mesh_listen) != 0 ||
            strcmp(fresh.mesh_peers, d->config.mesh_peers) != 0 ||
            strcmp(fresh.cluster_key_file, d->config.cluster_key_file) != 0)
                log_notice("reload: socket, socket_mode, socket_group, metrics_listen and the mesh keys "
                           "(mesh_listen, mesh_peers, cluster_key_file) change only on restart");
        r = config_apply_reloadable(&d->config, &fresh);
        config_done(&fresh);
        if (r < 0) {
                d->metrics.reloads_failed++;
                log_err("reload: out of memory: keeping the previous configuration");
                return;
        }
        d->metrics.reloads_ok++;
        log_set_level(d->config.log_level);
        log_notice("configuration reloaded from %s, log level %s",
                   daemon_config_path(&d->options) ? daemon_config_path(&d->options) : "(embedded defaults)",
                   log_level_to_string(d->config.log_level));
}

static void daemon_signal_cb(evutil_socket_t sig, short what, void *arg) {
        struct daemon *d = arg;

        if (sig == SIGHUP) {
                daemon_reload(d);
                return;
        }
        if (d->stopping)
                return;
        log_notice("%s: shutting down", strsignal((int)sig));
        sd_notify(0, "STOPPING=1\nSTATUS=shutting down");
        event_del(d->ev_listen);
        jobs_abort_all(d->jobs, "the daemon is shutting down");
        sessions_shutdown(d, "the daemon is shutting down");
        event_base_loopexit(d->base, NULL);
}

static void daemon_watchdog_cb(evutil_socket_t fd, short what, void *arg) {
        sd_notify(0, "WATCHDOG=1");
}

static void daemon_reap_cb(evutil_socket_t fd, short what, void *arg) {
        sessions_reap(arg);
}

static int daemon_events(struct daemon *d) {
        uint64_t usec = 0;

        d->ev_listen = event_new(d->base, d->listen_fd, EV_READ | EV_PERSIST, daemon_accept_cb, d);
        d->ev_accept_resume = evtimer_new(d->base, daemon_accept_resume_cb, d);
        d->ev_reap = event_new(d->base, -1, 0, daemon_reap_cb, d);
        if (!d->ev_listen || !d->ev_accept_resume || !d->ev_reap || event_add(d->ev_listen, NULL) < 0)
                return -ENOMEM;
        for (size_t i = 0; i < sizeof(daemon_signals) / sizeof(daemon_signals[0]); i++) {
                d->ev_signal[i] = evsignal_new(d->base, daemon_signals[i], daemon_signal_cb, d);
                if (!d->ev_signal[i] || event_add(d->ev_signal[i], NULL) < 0)
                        return -ENOMEM;
        }
        /* Ping at half the interval systemd expects, as sd_watchdog_enabled(3)
         * recommends. */
        if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) {
                struct timeval tv = { .tv_sec = (time_t)(usec / 2 / 1000000),
                                      .tv_usec = (suseconds_t)(usec / 2 % 1000000) };

                d->ev_watchdog = event_new(d->base, -1, EV_PERSIST, daemon_watchdog_cb, d);
                if (!d->ev_watchdog || event_add(d->ev_watchdog, &tv) < 0)
                        return -ENOMEM;
                log_info("watchdog: pinging every %" PRIu64 " ms", usec / 2000);
        }
        return 0;
}

int daemon_init(struct daemon *d, const struct daemon_options *options) {
        char errmsg[ERRMSG_MAX] = "";
        int r;

        memset(d, 0, sizeof(*d));
        d->listen_fd = -1;
        d->options = *options;
        d->next_session_id = 1;
        TAILQ_INIT(&d->sessions);
        TAILQ_INIT(&d->dead);
        clock_gettime(CLOCK_MONOTONIC, &d->started);

        r = daemon_config_build(options, &d->config, errmsg);
        if (r < 0) {
                log_err("configuration: %s", errmsg);
                return r;
        }
        log_set_level(d->config.log_level);
        log_info("configuration: %s",
                 daemon_config_path(options) ? daemon_config_path(options) : "embedded defaults (no file)");
        /* MSG_NOSIGNAL covers our sends; this covers everything else. */
        signal(SIGPIPE, SIG_IGN);

        d->base = event_base_new();
        if (!d->base) {
                log_err("event_base_new failed");
                return -ENOMEM;
        }
        r = jobs_new(&d->config, &session_job_callbacks, &d->jobs);
        if (r < 0)
                goto oom;
        r = clientfds_new(d->base, &d->config, &d->clientfds);
        if (r < 0)
                goto oom;
        r = broker_new(&d->config, d->clientfds, &d->broker);
        if (r < 0)
                goto oom;
        r = daemon_listen(d);
        if (r < 0)
                return r;
        r = daemon_events(d);
        if (r < 0)
                goto oom;
        if (d->config.metrics_listen[0]) {
                r = http_start(d, d->config.metrics_listen, &d->http, errmsg);
                if (r < 0) {
                        log_err("%s", errmsg);
                        return r;
                }
        }
        /* Before the mesh, whose connections offer its transport. */
        r = datapath_start(d, &d->datapath);
        if (r < 0)
                goto oom;
        r = mesh_start(d, &d->mesh, errmsg);
        if (r < 0) {
                log_err("%s", errmsg);
                return r;
        }
        return 0;

oom:
        log_err("start-up: out of memory");
        return r;
}

int daemon_run(struct daemon *d) {
        log_notice("moeepd %s ready (protocol %d.%d, pid %d)", MOEEP_VERSION, MOEEP_PROTOCOL_MAJOR,
                   MOEEP_PROTOCOL_MINOR, (int)getpid());
        sd_notify(0, "READY=1");
        daemon_status_changed(d);
        if (event_base_dispatch(d->base) < 0) {
                log_err("event loop failed");
                return -EIO;
        }
        return 0;
}

void daemon_done(struct daemon *d) {
        struct session *s, *next;

        if (!d)
                return;
        d->stopping = true;
        /* Sessions still flushing their last records are given up now. */
        for (s = TAILQ_FIRST(&d->sessions); s; s = next) {
                next = TAILQ_NEXT(s, entry);
                session_fail(s, 0, 0, "the daemon is exiting");
                session_close_now(s);
        }
        /* The mesh after the sessions left their jobs (they tell it), and
         * before the reaping: forwarded joins hold session references. */
        mesh_free(d->mesh);
        d->mesh = NULL;
        datapath_free(d->datapath);
        d->datapath = NULL;
        sessions_reap(d);
        http_free(d->http);
        jobs_free(d->jobs);
        broker_free(d->broker);
        clientfds_free(d->clientfds, 1000);
        for (size_t i = 0; i < sizeof(d->ev_signal) / sizeof(d->ev_signal[0]); i++)
                if (d->ev_signal[i])
                        event_free(d->ev_signal[i]);
        if (d->ev_listen)
                event_free(d->ev_listen);
        if (d->ev_accept_resume)
                event_free(d->ev_accept_resume);
        if (d->ev_watchdog)
                event_free(d->ev_watchdog);
        if (d->ev_reap)
                event_free(d->ev_reap);
        if (d->listen_fd >= 0)
                close(d->listen_fd);
        if (d->bound_path) {
                unlink(d->bound_path);
                free(d->bound_path);
        }
        if (d->base)
                event_base_free(d->base);
        config_done(&d->config);
        memset(d, 0, sizeof(*d));
        d->listen_fd = -1;
}
