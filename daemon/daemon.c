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

#include "admin-socket.h"
#include "broker.h"
#include "clientfd.h"
#include "daemon.h"
#include "datapath.h"
#include "http.h"
#include "mesh-jobs.h"
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
        if (o->admin_socket) {
                r = config_set(&c, "admin_socket", o->admin_socket, errmsg);
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

/* Binds a listener's socket ourselves at `path`: created under a umask so
 * that it is never more open than 0600 before the chmod, then given `mode`
 * and `group` ("" to leave it). */
static int daemon_bind(struct daemon_listener *l, const char *path, mode_t mode, const char *group) {
        const char *what = l->admin ? "admin socket" : "socket";
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        mode_t old_umask;
        int fd, r;

        if (strlen(path) >= sizeof(sa.sun_path)) {
                log_err("%s %s: longer than %zu bytes", what, path, sizeof(sa.sun_path) - 1);
                return -ENAMETOOLONG;
        }
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        r = daemon_clear_stale(&sa);
        if (r < 0) {
                log_err("%s %s: %s", what, path,
                        r == -EADDRINUSE ? "another daemon is listening there"
                        : r == -EEXIST   ? "exists and is not a socket"
                                         : strerror(-r));
                return r;
        }
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
                r = -errno;
                log_err("%s %s: socket(): %s", what, path, strerror(errno));
                return r;
        }
        old_umask = umask(0177);
        r = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
        umask(old_umask);
        if (r < 0) {
                r = -errno;
                log_err("%s %s: bind: %s", what, path, strerror(errno));
                goto fail;
        }
        l->bound_path = strdup(path);
        if (!l->bound_path) {
                r = -ENOMEM;
                unlink(path);
                goto fail;
        }
        if (chmod(path, mode) < 0) {
                r = -errno;
                log_err("%s %s: chmod 0%o: %s", what, path, (unsigned)mode, strerror(errno));
                goto fail;
        }
        if (group[0]) {
                struct group gr, *grr = NULL;
                char buf[4096];

                if (getgrnam_r(group, &gr, buf, sizeof(buf), &grr) != 0 || !grr) {
                        r = -ENOENT;
                        log_err("socket_group '%s': no such group", group);
                        goto fail;
                }
                if (chown(path, (uid_t)-1, gr.gr_gid) < 0) {
                        r = -errno;
                        log_err("%s %s: chgrp %s: %s", what, path, group, strerror(errno));
                        goto fail;
                }
        }
        if (listen(fd, SOMAXCONN) < 0) {
                r = -errno;
                log_err("%s %s: listen: %s", what, path, strerror(errno));
                goto fail;
        }
        l->fd = fd;
        log_info("listening on %s %s (mode 0%o%s%s)", what, path, (unsigned)mode, group[0] ? ", group " : "",
                 group);
        return 0;

fail:
        close(fd);
        return r;
}

/* Creates the admin socket's directory (/run/moeep-admin) when it is
 * missing, for the daemon's uid alone; tmpfiles.d and moeepd-admin.socket
 * make it under systemd. A failure shows when binding. */
static void daemon_admin_dir(const char *path) {
        char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
        struct stat st;
        char *slash;

        snprintf(dir, sizeof(dir), "%s", path);
        slash = strrchr(dir, '/');
        if (!slash || slash == dir)
                return;
        *slash = '\0';
        if (mkdir(dir, 0700) == 0)
                log_info("admin socket: created %s (mode 0700)", dir);
        else if (stat(dir, &st) == 0 && (st.st_mode & 0022))
                /* Whoever may write there may put a socket of their own
                 * where moeepctl looks for the daemon's. */
                log_warn("admin socket %s: its directory is writable by others (mode 0%o): set admin_socket "
                         "to a path in a directory only the daemon's uid may write",
                         path, (unsigned)(st.st_mode & 07777));
}

/* Warns when the admin socket systemd passed is open to more than its
 * owner: whoever can connect to it is an operator. */
static void daemon_admin_mode_check(int fd) {
        struct sockaddr_un sa = { 0 };
        socklen_t len = sizeof(sa) - 1; /* keeps a NUL after the path */
        struct stat st;

        if (getsockname(fd, (struct sockaddr *)&sa, &len) < 0 || sa.sun_path[0] != '/' ||
            stat(sa.sun_path, &st) < 0 || !(st.st_mode & 0077))
                return;
        log_warn("admin socket %s is mode 0%o: anyone who can open it is an operator (drain, log level, "
                 "every job); make it 0600 (SocketMode=0600 in moeepd-admin.socket)",
                 sa.sun_path, (unsigned)(st.st_mode & 0777));
}

/* Takes socket-activated fd `fd` for listener `l`. */
static int daemon_take_fd(struct daemon_listener *l, int fd, const char *name) {
        int flags;

        if (sd_is_socket(fd, AF_UNIX, SOCK_SEQPACKET, 1) <= 0) {
                log_err("socket activation: fd %d ('%s') is not a listening AF_UNIX SOCK_SEQPACKET socket "
                        "(use ListenSequentialPacket=)",
                        fd, name);
                return -EINVAL;
        }
        flags = fcntl(fd, F_GETFL);
        if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
                int r = -errno;

                log_err("socket activation: fd %d: fcntl: %s", fd, strerror(errno));
                return r;
        }
        l->fd = fd;
        log_info("listening on the %s socket systemd passed (fd %d, '%s')", l->admin ? "admin" : "client", fd,
                 name);
        if (l->admin)
                daemon_admin_mode_check(fd);
        return 0;
}

/* Takes the sockets systemd passed (moeepd.socket: named "client", or
 * unnamed; moeepd-admin.socket: named "admin"), and binds what it did not
 * pass: a unit from before the admin socket passes only the client socket,
 * and the daemon then binds the admin socket itself. */
static int daemon_listen(struct daemon *d) {
        char admin_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
        char **names = NULL;
        int n, r = 0;

        n = sd_listen_fds_with_names(1, &names);
        if (n < 0) {
                log_err("sd_listen_fds: %s", strerror(-n));
                return n;
        }
        for (int i = 0; i < n && r == 0; i++) {
                const char *name = names && names[i] ? names[i] : "unknown";
                bool admin = strcmp(name, "admin") == 0;
                struct daemon_listener *l = admin ? &d->admin : &d->listen;

                if (l->fd >= 0) {
                        log_err("socket activation passed two %s sockets (fd %d and %d): need one "
                                "(FileDescriptorName=admin marks the admin socket)",
                                admin ? "admin" : "client", l->fd, SD_LISTEN_FDS_START + i);
                        r = -EINVAL;
                } else
                        r = daemon_take_fd(l, SD_LISTEN_FDS_START + i, name);
        }
        for (int i = 0; names && i < n; i++)
                free(names[i]);
        free(names);
        if (r < 0)
                return r;
        if (d->listen.fd < 0) {
                r = daemon_bind(&d->listen, d->config.socket, d->config.socket_mode, d->config.socket_group);
                if (r < 0)
                        return r;
        }
        if (d->admin.fd < 0) {
                struct sockaddr_un sa = { 0 };
                socklen_t len = sizeof(sa) - 1; /* keeps a NUL after the path */
                const char *next_to = d->config.socket;

                /* Next to the client socket systemd passed, where that is
                 * not where the configuration says. */
                if (!d->listen.bound_path && !d->config.admin_socket[0] &&
                    getsockname(d->listen.fd, (struct sockaddr *)&sa, &len) == 0 && sa.sun_path[0] == '/')
                        next_to = sa.sun_path;
                r = d->config.admin_socket[0]
                            ? config_admin_socket(&d->config, admin_path, sizeof(admin_path))
                            : moeep_admin_socket_path(next_to, admin_path, sizeof(admin_path));
                if (r < 0) {
                        log_err("admin socket next to %s: the path is too long; set admin_socket", next_to);
                        return -ENAMETOOLONG;
                }
                daemon_admin_dir(admin_path);
                /* The operator's: only the daemon's own uid may connect. */
                r = daemon_bind(&d->admin, admin_path, 0600, "");
        }
        return r;
}

static void daemon_accept_cb(evutil_socket_t lfd, short what, void *arg) {
        struct daemon_listener *l = arg;
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
                                log_warn("accept on the %s socket: %s: pausing for %d ms",
                                         l->admin ? "admin" : "client", strerror(errno),
                                         DAEMON_ACCEPT_PAUSE_MS);
                                event_del(l->ev);
                                evtimer_add(l->ev_resume, &pause);
                                return;
                        }
                        log_err("accept: %s", strerror(errno));
                        return;
                }
                r = session_new(l->daemon, fd, l->admin, &s);
                if (r < 0 && r != -EDQUOT) /* refusals were logged with their reason */
                        log_warn("new session: %s", strerror(-r));
        }
}

static void daemon_accept_resume_cb(evutil_socket_t fd, short what, void *arg) {
        struct daemon_listener *l = arg;

        event_add(l->ev, NULL);
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
            strcmp(fresh.admin_socket, d->config.admin_socket) != 0 ||
            strcmp(fresh.socket_group, d->config.socket_group) != 0 ||
            strcmp(fresh.metrics_listen, d->config.metrics_listen) != 0 ||
            strcmp(fresh.mesh_listen, d->config.mesh_listen) != 0 ||
            strcmp(fresh.mesh_peers, d->config.mesh_peers) != 0 ||
            strcmp(fresh.cluster_key_file, d->config.cluster_key_file) != 0)
                log_notice("reload: socket, socket_mode, socket_group, admin_socket, metrics_listen and the "
                           "mesh keys "
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
        event_del(d->listen.ev);
        event_del(d->admin.ev);
        jobs_abort_all(d->jobs, "the daemon is shutting down");
        sessions_shutdown(d, "the daemon is shutting down");
        event_base_loopexit(d->base, NULL);
}

static void daemon_watchdog_cb(evutil_socket_t fd, short what, void *arg) {
        sd_notify(0, "WATCHDOG=1");
}

/* The mesh's hooks into the daemon and its sessions (mesh-jobs.h). */
static void daemon_mesh_status_changed(void *arg) {
        daemon_status_changed(arg);
}

static bool daemon_mesh_stopping(void *arg) {
        return ((struct daemon *)arg)->stopping;
}

static uint64_t daemon_mesh_session_id(const struct session *s) {
        return s->id;
}

static bool daemon_mesh_session_can_join(const struct session *s) {
        return s->state != SESSION_CLOSED && !s->member;
}

static void daemon_mesh_join_failed(struct session *s, uint64_t request_id, int code, const char *message) {
        if (s->state != SESSION_CLOSED)
                session_send_error(s, request_id, code, message);
}

/* The peers, with the data path's functions, then the jobs across daemons
 * on them, with the hooks above. */
static int daemon_mesh_start(struct daemon *d, char *errmsg) {
        const struct mesh_transport_hooks transport = {
                .dp = d->datapath,
                .up = datapath_up,
                .backend = datapath_backend,
                .peer_new = datapath_peer_new,
                .peer_connect = datapath_peer_connect,
                .peer_fail = datapath_peer_fail,
        };
        const struct mesh_jobs_hooks hooks = {
                .arg = d,
                .status_changed = daemon_mesh_status_changed,
                .stopping = daemon_mesh_stopping,
                .error_code = session_error_code,
                .session_ref = session_ref,
                .session_unref = session_unref,
                .session_id = daemon_mesh_session_id,
                .session_can_join = daemon_mesh_session_can_join,
                .join_failed = daemon_mesh_join_failed,
                .joined = session_joined,
        };
        int r;

        r = mesh_start(d->base, &d->config, &transport, &d->mesh, errmsg);
        if (r < 0)
                return r;
        r = mesh_jobs_new(d->mesh, d->jobs, &hooks, &d->mesh_jobs);
        if (r < 0)
                return errmsg_set(errmsg, r, "mesh: out of memory");
        return 0;
}

static void daemon_listeners_init(struct daemon *d) {
        d->listen = (struct daemon_listener){ .daemon = d, .admin = false, .fd = -1 };
        d->admin = (struct daemon_listener){ .daemon = d, .admin = true, .fd = -1 };
}

static void daemon_listener_done(struct daemon_listener *l) {
        if (l->ev)
                event_free(l->ev);
        if (l->ev_resume)
                event_free(l->ev_resume);
        if (l->fd >= 0)
                close(l->fd);
        if (l->bound_path) {
                unlink(l->bound_path);
                free(l->bound_path);
        }
}

static void daemon_reap_cb(evutil_socket_t fd, short what, void *arg) {
        sessions_reap(arg);
}

static int daemon_events(struct daemon *d) {
        uint64_t usec = 0;

        struct daemon_listener *listeners[] = { &d->listen, &d->admin };

        for (size_t i = 0; i < sizeof(listeners) / sizeof(listeners[0]); i++) {
                struct daemon_listener *l = listeners[i];

                l->ev = event_new(d->base, l->fd, EV_READ | EV_PERSIST, daemon_accept_cb, l);
                l->ev_resume = evtimer_new(d->base, daemon_accept_resume_cb, l);
                if (!l->ev || !l->ev_resume || event_add(l->ev, NULL) < 0)
                        return -ENOMEM;
        }
        d->ev_reap = event_new(d->base, -1, 0, daemon_reap_cb, d);
        if (!d->ev_reap)
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
        daemon_listeners_init(d);
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
        if (d->config.admin_group[0])
                log_notice("admin_group '%s' is no longer used: operator rights come from the admin socket "
                           "(admin_socket), whoever connects to the client socket",
                           d->config.admin_group);
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
        r = daemon_mesh_start(d, errmsg);
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
        mesh_jobs_free(d->mesh_jobs);
        d->mesh_jobs = NULL;
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
        if (d->ev_watchdog)
                event_free(d->ev_watchdog);
        if (d->ev_reap)
                event_free(d->ev_reap);
        daemon_listener_done(&d->listen);
        daemon_listener_done(&d->admin);
        if (d->base)
                event_base_free(d->base);
        config_done(&d->config);
        memset(d, 0, sizeof(*d));
        daemon_listeners_init(d);
}
