/* moeepctl: look at a running moeepd. One small file per subcommand; this
 * one parses the global options, connects and dispatches. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "admin-socket.h"
#include "ctl.h"
#include "moeep-config.h"

/* How long moeepctl waits for any answer: a stuck daemon must not hang an
 * operator's shell. */
#define CTL_TIMEOUT_MS 10000

static const struct ctl_subcommand subcommands[] = {
        { "status", "", 0, false, "daemon version, protocol, uptime, pid, sessions, jobs, draining",
          ctl_status },
        { "jobs", "", 0, false, "jobs: id, name, world size, joined ranks, state, owner", ctl_jobs },
        { "clients", "", 0, false, "sessions: pid, uid, job, rank, GPU, state, name, regions", ctl_clients },
        { "nics", "", 0, false, "RDMA devices the daemon sees and the NIC nearest each GPU", ctl_nics },
        { "mesh", "", 0, false, "admin: peer daemons of the internode mesh", ctl_mesh },
        { "metrics", "", 0, false, "counters and gauges (Prometheus text format)", ctl_metrics },
        { "log-level", "LEVEL", 1, false, "admin: set the daemon's log level until SIGHUP or restart",
          ctl_log_level },
        { "drain", "[--off]", 0, true, "admin: refuse new jobs, let running ones finish (--off: undo)",
          ctl_drain },
};

static void usage(FILE *f) {
        fprintf(f,
                "Usage: moeepctl [--socket PATH] [--admin-socket PATH] [--client] [--json] [COMMAND [ARGS]]\n"
                "\n"
                "Shows and steers moeepd, the moeep node daemon. Commands go to the admin socket\n"
                "(root's, mode 0600), where everything is shown and the admin commands are\n"
                "accepted; when it cannot be opened, to the client socket, which shows only\n"
                "your own sessions and jobs.\n"
                "\n"
                "Commands (default: status):\n");
        for (size_t i = 0; i < sizeof(subcommands) / sizeof(subcommands[0]); i++) {
                char synopsis[32];

                snprintf(synopsis, sizeof(synopsis), "%s%s%s", subcommands[i].name,
                         subcommands[i].args[0] ? " " : "", subcommands[i].args);
                fprintf(f, "  %-16s %s\n", synopsis, subcommands[i].summary);
        }
        fprintf(f,
                "\n"
                "Options:\n"
                "  -s, --socket PATH  client socket (default: $MOEEP_SOCKET, else %s)\n"
                "  -a, --admin-socket PATH\n"
                "                     admin socket (default: $MOEEP_ADMIN_SOCKET, else beside the client\n"
                "                     socket's directory: DIR-admin/NAME for DIR/NAME)\n"
                "  -c, --client       use the client socket only (what a client sees)\n"
                "  -j, --json         machine-readable output\n"
                "  -h, --help         show this help\n"
                "  -V, --version      show the version\n"
                "\n"
                "Exit status: 0 on success, 1 when the daemon cannot be reached or refuses, 2 on a usage "
                "error.\n",
                MOEEP_DEFAULT_SOCKET);
}

bool ctl_require_operator(struct ctl *ctl, const char *command) {
        if (client_features(ctl->client) & MOEEP__V1__FEATURE__FEATURE_OPERATOR)
                return true;
        fprintf(stderr, "moeepctl: moeepd %s at %s does not offer '%s' (it needs protocol 1.1 or later)\n",
                client_daemon_version(ctl->client), client_socket_path(ctl->client), command);
        return false;
}

int ctl_admin(struct ctl *ctl, const char *command, const Moeep__V1__Request *req) {
        Moeep__V1__Response *resp;

        if (!ctl_require_operator(ctl, command))
                return 1;
        if (ctl_query(ctl, req, MOEEP__V1__RESPONSE__BODY_OK, &resp) < 0) {
                ctl_admin_hint(ctl);
                return 1;
        }
        moeep__v1__response__free_unpacked(resp, NULL);
        return ctl_status(ctl);
}

int ctl_query(struct ctl *ctl, const Moeep__V1__Request *req, Moeep__V1__Response__BodyCase expect,
              Moeep__V1__Response **ret_resp) {
        int r = client_call(ctl->client, req, expect, NULL, 0, ret_resp);

        if (r < 0)
                fprintf(stderr, "moeepctl: %s\n", moeep_client_error(ctl->client));
        return r;
}

/* Why a connection failed, in an operator's words. */
static const char *connect_hint(int r) {
        switch (-r) {
        case ENOENT:
        case ECONNREFUSED:
                return " (is moeepd running?)";
        case EACCES:
                return " (is your user in the moeep group?)";
        default:
                return "";
        }
}

void ctl_admin_hint(const struct ctl *ctl) {
        if (!ctl->admin && ctl->admin_error[0])
                fprintf(stderr, "moeepctl: (the admin socket, which admin commands need: %s)\n",
                        ctl->admin_error);
}

/* Parses the options, wherever they stand (`moeepctl jobs --json` works);
 * --off belongs to drain. Returns -1 to go on, else the exit status. */
static int parse_options(int argc, char **argv, struct ctl *ctl, const char **socket_path,
                         const char **admin_path) {
        static const struct option options[] = {
                { "socket", required_argument, NULL, 's' }, { "admin-socket", required_argument, NULL, 'a' },
                { "client", no_argument, NULL, 'c' },       { "json", no_argument, NULL, 'j' },
                { "off", no_argument, NULL, 'o' },          { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, 'V' },      {},
        };
        int c;

        while ((c = getopt_long(argc, argv, "s:a:cjhV", options, NULL)) >= 0)
                switch (c) {
                case 's':
                        *socket_path = optarg;
                        break;
                case 'a':
                        *admin_path = optarg;
                        break;
                case 'c':
                        ctl->client_only = true;
                        break;
                case 'j':
                        ctl->json = true;
                        break;
                case 'o':
                        ctl->off = true;
                        break;
                case 'h':
                        usage(stdout);
                        return 0;
                case 'V':
                        printf("moeepctl %s (protocol %d.%d)\n", MOEEP_VERSION, MOEEP_PROTOCOL_MAJOR,
                               MOEEP_PROTOCOL_MINOR);
                        return 0;
                default:
                        usage(stderr);
                        return 2;
                }
        return -1;
}

/* The uid serving socket `path` (SO_PEERCRED of a connection made and
 * closed at once): 0, or -errno. */
static int admin_peer_uid(const char *path, uid_t *ret_uid) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        struct ucred cred;
        socklen_t len = sizeof(cred);
        int fd, r = 0;

        if (strlen(path) >= sizeof(sa.sun_path))
                return -ENAMETOOLONG;
        memcpy(sa.sun_path, path, strlen(path) + 1);
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return -errno;
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
            getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
                r = -errno;
        else
                *ret_uid = cred.uid;
        close(fd);
        return r;
}

/* Connects to the admin socket (the operator's view and the admin
 * commands), else to the client socket. */
static int ctl_connect(struct ctl *ctl, const char *socket_path, const char *admin_path, char *err,
                       size_t errlen) {
        char derived[sizeof(((struct sockaddr_un *)0)->sun_path)];
        const char *env;
        int r;

        if (!ctl->client_only) {
                if (!admin_path) {
                        env = secure_getenv("MOEEP_ADMIN_SOCKET");
                        admin_path = env && env[0] ? env : NULL;
                }
                if (!admin_path) {
                        env = secure_getenv("MOEEP_SOCKET");
                        if (moeep_admin_socket_path(socket_path     ? socket_path
                                                    : env && env[0] ? env
                                                                    : MOEEP_DEFAULT_SOCKET,
                                                    derived, sizeof(derived)) == 0)
                                admin_path = derived;
                }
                if (admin_path) {
                        uid_t uid = 0;

                        /* The daemon runs as root or as us: a socket there
                         * that another uid serves is not the daemon's; it
                         * is not even told Hello. */
                        r = admin_peer_uid(admin_path, &uid);
                        if (r == 0 && uid != 0 && uid != geteuid())
                                r = -EPERM;
                        else
                                r = client_connect(admin_path, "moeepctl/" MOEEP_VERSION, &ctl->client,
                                                   ctl->admin_error, sizeof(ctl->admin_error));
                        if (r == -EPERM || (r == 0 && (client_peer_uid(ctl->client, &uid) < 0 ||
                                                       (uid != 0 && uid != geteuid())))) {
                                snprintf(ctl->admin_error, sizeof(ctl->admin_error),
                                         "%s is served by uid %u, neither root nor you: not the daemon's, "
                                         "not used",
                                         admin_path, (unsigned)uid);
                                moeep_client_free(ctl->client);
                                ctl->client = NULL;
                                r = -EPERM;
                        }
                        if (r == 0) {
                                ctl->admin = true;
                                return 0;
                        }
                }
        }
        return client_connect(socket_path, "moeepctl/" MOEEP_VERSION, &ctl->client, err, errlen);
}

int main(int argc, char **argv) {
        const struct ctl_subcommand *sub = NULL;
        struct ctl ctl = { 0 };
        const char *socket_path = NULL, *admin_path = NULL, *name = "status";
        char err[512];
        int r;

        r = parse_options(argc, argv, &ctl, &socket_path, &admin_path);
        if (r >= 0)
                return r;
        /* getopt_long() moved the options first: what is left is the
         * subcommand and its arguments. */
        if (optind < argc) {
                name = argv[optind];
                ctl.args = argv + optind + 1;
                ctl.nargs = (size_t)(argc - optind - 1);
        }
        if (strcmp(name, "help") == 0) {
                usage(stdout);
                return 0;
        }
        for (size_t i = 0; i < sizeof(subcommands) / sizeof(subcommands[0]); i++)
                if (strcmp(name, subcommands[i].name) == 0)
                        sub = &subcommands[i];
        if (!sub) {
                fprintf(stderr, "moeepctl: unknown command '%s' (try moeepctl --help)\n", name);
                return 2;
        }
        if (ctl.nargs != sub->nargs) {
                if (ctl.nargs > sub->nargs)
                        fprintf(stderr, "moeepctl: unexpected argument '%s' after '%s'\n",
                                ctl.args[sub->nargs], name);
                else
                        fprintf(stderr, "moeepctl: '%s' needs %s\n", name, sub->args);
                return 2;
        }
        if (ctl.off && !sub->takes_off) {
                fprintf(stderr, "moeepctl: --off goes only with drain\n");
                return 2;
        }

        r = ctl_connect(&ctl, socket_path, admin_path, err, sizeof(err));
        if (r < 0) {
                fprintf(stderr, "moeepctl: %s%s\n", err, connect_hint(r));
                ctl_admin_hint(&ctl);
                return 1;
        }
        r = client_set_timeout(ctl.client, CTL_TIMEOUT_MS);
        if (r < 0)
                fprintf(stderr, "moeepctl: %s (going on without a timeout)\n",
                        moeep_client_error(ctl.client));
        r = sub->run(&ctl);
        moeep_client_free(ctl.client);
        return r;
}
