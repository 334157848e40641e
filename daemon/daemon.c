/* The daemon object; see daemon.h. In order: the configuration, the
 * listening sockets, the signals and reload, then daemon_init(), which
 * makes the objects from the bottom up, the loop and the end. */
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
#include "clients/requests.h"
#include "clients/session.h"
#include "clients/sockdir.h"
#include "daemon.h"
#include "datapath/datapath.h"
#include "errors.h"
#include "log.h"
#include "mesh/mesh-jobs.h"
#include "mesh/mesh.h"
#include "moeep-config.h"
#include "ops/http.h"
#include "ops/metrics.h"
#include "ops/notify.h"
#include "record.h"
#include "state/broker.h"
#include "state/clientfd.h"
#include "state/job.h"

/* Connections accepted per callback before others get a turn. */
#define DAEMON_ACCEPT_BATCH 64
/* Back-off after accept() ran out of descriptors. */
#define DAEMON_ACCEPT_PAUSE_MS 1000

static const int daemon_signals[] = { SIGTERM, SIGINT, SIGHUP };

/* Updates systemd's STATUS= line after a turn of the loop (daemon_run()). */
static void daemon_status_changed(struct daemon *d) {
        /* While stopping, STOPPING=1 carried the last STATUS=. */
        if (!d->jobs || !d->sessions || d->stopping)
                return;
        notify_status(&d->notify, d->sessions->count, d->jobs->count);
}

/* ------------------------------------------------------------ configuration */

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

/* Binds a listener's socket ourselves at `path` (sockdir.h): created with
 * `mode` and `group` ("" to leave it). The admin socket's directory is
 * made when missing (0700), must be the daemon's uid's and writable by
 * nobody else, and may be neither the client socket's directory nor below
 * it (`client`, NULL when unknown): containers are given that one. */
static int daemon_bind(struct daemon_listener *l, const char *path, mode_t mode, const char *group,
                       const struct stat *client) {
        const char *what = l->admin ? "admin socket" : "socket";
        char errmsg[ERRMSG_MAX];
        gid_t gid = (gid_t)-1;
        int fd, r;

        if (group[0]) {
                struct group gr, *grr = NULL;
                char buf[4096];

                if (getgrnam_r(group, &gr, buf, sizeof(buf), &grr) != 0 || !grr) {
                        log_err("socket_group '%s': no such group", group);
                        return -ENOENT;
                }
                gid = gr.gr_gid;
        }
        r = sockdir_open(&l->dir, path, l->admin, errmsg);
        if (r == 0 && l->admin)
                r = sockdir_check_private(&l->dir, errmsg);
        if (r == 0 && l->admin && client && sockdir_within(&l->dir, client) == 1)
                r = errmsg_set(errmsg, -EPERM,
                               "directory %s is the client socket's directory or below it, which containers "
                               "are given: set admin_socket to a path outside it",
                               l->dir.path);
        if (r < 0) {
                log_err("%s %s: %s", what, path, errmsg);
                sockdir_close(&l->dir, false);
                return r;
        }
        if (l->dir.created)
                log_info("%s: created %s (mode 0700)", what, l->dir.path);
        fd = sockdir_bind(&l->dir, mode, gid, errmsg);
        if (fd < 0) {
                log_err("%s: %s", what, errmsg);
                sockdir_close(&l->dir, false);
                return fd;
        }
        l->fd = fd;
        l->bound = true;
        log_info("listening on %s %s (mode 0%o%s%s)", what, path, (unsigned)mode, group[0] ? ", group " : "",
                 group);
        return 0;
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

/* Where the client socket is (`ret_path`: the configured path, or the one
 * systemd bound) and its directory's identity: true, or false when it
 * cannot be told. */
static bool daemon_client_dir(const struct daemon *d, char ret_path[static 108], struct stat *ret) {
        struct sockaddr_un sa = { 0 };
        socklen_t len = sizeof(sa) - 1; /* keeps a NUL after the path */
        char errmsg[ERRMSG_MAX];
        struct sockdir dir;

        snprintf(ret_path, 108, "%s", d->config.socket);
        if (d->listen.bound) {
                *ret = d->listen.dir.st;
                return true;
        }
        if (getsockname(d->listen.fd, (struct sockaddr *)&sa, &len) == 0 && sa.sun_path[0] == '/')
                snprintf(ret_path, 108, "%s", sa.sun_path);
        if (sockdir_open(&dir, ret_path, false, errmsg) < 0)
                return false;
        *ret = dir.st;
        sockdir_close(&dir, false);
        return true;
}

/* The admin socket systemd passed: the operator placed it; a warning when
 * it lies where containers reach. */
static void daemon_admin_placement_check(const struct daemon *d, const struct stat *client) {
        struct sockaddr_un sa = { 0 };
        socklen_t len = sizeof(sa) - 1;
        char errmsg[ERRMSG_MAX];
        struct sockdir dir;

        if (!client || getsockname(d->admin.fd, (struct sockaddr *)&sa, &len) < 0 || sa.sun_path[0] != '/' ||
            sockdir_open(&dir, sa.sun_path, false, errmsg) < 0)
                return;
        if (sockdir_within(&dir, client) == 1)
                log_warn("admin socket %s is in the client socket's directory or below it: whoever is given "
                         "that directory (a container) reaches the operator's socket; move it "
                         "(moeepd-admin.socket)",
                         sa.sun_path);
        sockdir_close(&dir, false);
}

/* Takes the sockets systemd passed (moeepd.socket: named "client", or
 * unnamed; moeepd-admin.socket: named "admin"), and binds what it did not
 * pass: a unit from before the admin socket passes only the client socket,
 * and the daemon then binds the admin socket itself. */
static int daemon_listen(struct daemon *d) {
        char admin_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
        char client_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
        struct stat client_dir;
        bool have_client_dir;
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
                r = daemon_bind(&d->listen, d->config.socket, d->config.socket_mode, d->config.socket_group,
                                NULL);
                if (r < 0)
                        return r;
        }
        have_client_dir = daemon_client_dir(d, client_path, &client_dir);
        if (d->admin.fd >= 0) {
                daemon_admin_placement_check(d, have_client_dir ? &client_dir : NULL);
                return 0;
        }
        r = d->config.admin_socket[0] ? config_admin_socket(&d->config, admin_path, sizeof(admin_path))
                                      : moeep_admin_socket_path(client_path, admin_path, sizeof(admin_path));
        if (r < 0) {
                log_err("admin socket next to %s: %s; set admin_socket", client_path,
                        r == -ENAMETOOLONG
                                ? "the path is too long"
                                : "the client socket has no directory of its own to put it next to");
                return r;
        }
        /* The operator's: only the daemon's own uid may connect. */
        return daemon_bind(&d->admin, admin_path, 0600, "", have_client_dir ? &client_dir : NULL);
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
                r = session_new(l->daemon->sessions, fd, l->admin, &s);
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
        notify_stopping();
        event_del(d->listen.ev);
        event_del(d->admin.ev);
        jobs_abort_all(d->jobs, "the daemon is shutting down");
        mesh_jobs_stop(d->mesh_jobs);
        d->stopping = true;
        sessions_shutdown(d->sessions, "the daemon is shutting down");
        event_base_loopexit(d->base, NULL);
}

static void daemon_listeners_init(struct daemon *d) {
        d->listen = (struct daemon_listener){ .daemon = d, .admin = false, .fd = -1, .dir.fd = -1 };
        d->admin = (struct daemon_listener){ .daemon = d, .admin = true, .fd = -1, .dir.fd = -1 };
}

static void daemon_listener_done(struct daemon_listener *l) {
        if (l->ev)
                event_free(l->ev);
        if (l->ev_resume)
                event_free(l->ev_resume);
        if (l->fd >= 0)
                close(l->fd);
        sockdir_close(&l->dir, l->bound);
}

/* The client socket takes no fds before a session is welcomed (sessions
 * inherit the listener's SO_PASSRIGHTS, session_welcome() turns it on):
 * a connection turned away at accept then holds nothing whose release
 * could wait, and closes at once. Kernels before 6.16 lack the option. */
static void daemon_client_fds_off(struct daemon *d) {
        const int off = 0;

        if (setsockopt(d->listen.fd, SOL_SOCKET, SESSION_SO_PASSRIGHTS, &off, sizeof(off)) == 0) {
                d->sessions->fds_after_welcome = true;
                return;
        }
        log_info("client socket: no SO_PASSRIGHTS (%s; Linux 6.16+): connections may send fds before "
                 "Hello, and those turned away close in their uid's closer queue",
                 strerror(errno));
}

static int daemon_events(struct daemon *d) {
        struct daemon_listener *listeners[] = { &d->listen, &d->admin };

        for (size_t i = 0; i < sizeof(listeners) / sizeof(listeners[0]); i++) {
                struct daemon_listener *l = listeners[i];

                l->ev = event_new(d->base, l->fd, EV_READ | EV_PERSIST, daemon_accept_cb, l);
                l->ev_resume = evtimer_new(d->base, daemon_accept_resume_cb, l);
                if (!l->ev || !l->ev_resume || event_add(l->ev, NULL) < 0)
                        return -ENOMEM;
                /* Priority 0 (of 2) for the operator's socket and sessions
                 * (session.c): a loop busy with clients serves it first. */
                if (l->admin)
                        event_priority_set(l->ev, 0);
        }
        for (size_t i = 0; i < sizeof(daemon_signals) / sizeof(daemon_signals[0]); i++) {
                d->ev_signal[i] = evsignal_new(d->base, daemon_signals[i], daemon_signal_cb, d);
                if (!d->ev_signal[i] || event_add(d->ev_signal[i], NULL) < 0)
                        return -ENOMEM;
        }
        return notify_watchdog_start(&d->notify, d->base);
}

int daemon_init(struct daemon *d, const struct daemon_options *options) {
        char errmsg[ERRMSG_MAX] = "";
        struct timespec started;
        int r;

        clock_gettime(CLOCK_MONOTONIC, &started);
        memset(d, 0, sizeof(*d));
        daemon_listeners_init(d);
        d->options = *options;

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
        if (!d->base || event_base_priority_init(d->base, 2) < 0) {
                log_err("event_base_new failed");
                return -ENOMEM;
        }
        /* The floors from the bottom up (docs/architecture.md): each object
         * is handed the objects it calls, made before it; nothing is reached
         * before the loop runs. A constructor that can only run out of
         * memory leaves errmsg empty. */
        r = clientfds_new(d->base, &d->config, &d->clientfds);
        if (r == 0)
                r = jobs_new(&d->config, &membership_job_callbacks, d->clientfds, &d->jobs);
        if (r == 0)
                r = broker_new(&d->config, d->clientfds, &d->broker);
        if (r == 0)
                r = mesh_start(d->base, &d->config, &d->mesh, errmsg);
        if (r == 0)
                r = mesh_jobs_new(d->mesh, d->jobs, &d->mesh_jobs);
        if (r == 0)
                r = datapath_start(d->base, &d->config, d->clientfds, d->mesh, d->mesh_jobs, &d->datapath);
        if (r == 0) {
                metrics_init(&d->metrics, &started, d->jobs, d->broker, d->mesh, d->datapath);
                if (d->config.metrics_listen[0])
                        r = http_start(d->base, d->config.metrics_listen, &d->metrics, &d->http, errmsg);
        }
        if (r == 0)
                r = membership_init(&d->requests.membership, &d->metrics, d->jobs, d->broker, d->mesh,
                                    d->mesh_jobs, d->datapath);
        if (r == 0) {
                d->requests.metrics = &d->metrics;
                r = sessions_new(d->base, &d->config, d->clientfds, &d->metrics, requests_dispatch,
                                 &d->requests, &d->sessions);
        }
        if (r < 0) {
                log_err("%s", errmsg[0] ? errmsg : "start-up: out of memory");
                return r;
        }
        /* Then the sockets clients reach it on, and the signals. */
        r = daemon_listen(d);
        if (r < 0)
                return r;
        daemon_client_fds_off(d);
        r = daemon_events(d);
        if (r < 0) {
                log_err("start-up: out of memory");
                return r;
        }
        return 0;
}

int daemon_run(struct daemon *d) {
        int r;

        log_notice("moeepd %s ready (protocol %d.%d, pid %d)", MOEEP_VERSION, MOEEP_PROTOCOL_MAJOR,
                   MOEEP_PROTOCOL_MINOR, (int)getpid());
        notify_ready();
        /* After every turn of the loop the STATUS= line says how many
         * sessions and jobs there are (notify_status() sends it only when
         * that changed): no object tells the daemon of a change. */
        for (;;) {
                daemon_status_changed(d);
                r = event_base_loop(d->base, EVLOOP_ONCE);
                if (r < 0) {
                        log_err("event loop failed");
                        return -EIO;
                }
                if (r == 1 || event_base_got_exit(d->base) || event_base_got_break(d->base))
                        return 0;
        }
}

void daemon_done(struct daemon *d) {
        if (!d)
                return;
        d->stopping = true;
        /* Sessions still flushing their last records are given up now. */
        if (d->sessions)
                sessions_close_all(d->sessions, "the daemon is exiting");
        /* The mesh after the sessions left their jobs (they tell it), and
         * before the reaping: forwarded joins hold session references. */
        membership_done(&d->requests.membership);
        mesh_jobs_stop(d->mesh_jobs);
        mesh_jobs_free(d->mesh_jobs);
        d->mesh_jobs = NULL;
        /* The data path before the mesh it subscribed to: it unsubscribes.
         * The metrics' snapshot stops reading either. */
        datapath_free(d->datapath);
        d->datapath = NULL;
        d->metrics.datapath = NULL;
        mesh_free(d->mesh);
        d->mesh = NULL;
        d->metrics.mesh = NULL;
        if (d->sessions)
                sessions_reap(d->sessions);
        sessions_free(d->sessions);
        http_free(d->http);
        jobs_free(d->jobs);
        broker_free(d->broker);
        clientfds_free(d->clientfds, 1000);
        for (size_t i = 0; i < sizeof(d->ev_signal) / sizeof(d->ev_signal[0]); i++)
                if (d->ev_signal[i])
                        event_free(d->ev_signal[i]);
        notify_done(&d->notify);
        daemon_listener_done(&d->listen);
        daemon_listener_done(&d->admin);
        if (d->base)
                event_base_free(d->base);
        config_done(&d->config);
        memset(d, 0, sizeof(*d));
        daemon_listeners_init(d);
}
