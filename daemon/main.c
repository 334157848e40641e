/* moeepd: the moeep node daemon. Parses the command line and runs the
 * daemon object; everything else lives in moeepd_lib so tests link it. */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "daemon.h"
#include "log.h"
#include "moeep-config.h"
#include "record.h"

static void usage(FILE *f) {
        fprintf(f,
                "Usage: moeepd [OPTIONS]\n"
                "The moeep node daemon: brokers GPU memory handles between the ranks of\n"
                "expert-parallel jobs over a Unix socket.\n"
                "\n"
                "  -s, --socket PATH       listen on PATH (default %s); ignored under socket activation\n"
                "  -a, --admin-socket PATH the operator socket, mode 0600 (default: beside the socket's\n"
                "                          directory, DIR-admin/NAME for DIR/NAME: %s);\n"
                "                          ignored when systemd passes one named admin\n"
                "  -f, --foreground        accepted for compatibility: moeepd never forks\n"
                "  -c, --config FILE       read FILE (INI) over the embedded defaults; SIGHUP re-reads it\n"
                "                          (default %s, when it exists)\n"
                "  -n, --no-config         embedded defaults only: read no file\n"
                "  -l, --log-level LEVEL   err, warning, notice, info or debug (overrides the file)\n"
                "  -m, --metrics-listen ADDR  serve /metrics over HTTP on ADDR (PORT, HOST:PORT,\n"
                "                          [IPV6]:PORT), or \"\" for off (overrides the file)\n"
                "  -t, --check-config      check the configuration, print the result and exit\n"
                "  -d, --dump-config       print the configuration in effect (file syntax) and exit\n"
                "  -h, --help              show this help\n"
                "  -V, --version           show the version\n",
                MOEEP_DEFAULT_SOCKET, MOEEP_DEFAULT_ADMIN_SOCKET, MOEEP_DEFAULT_CONFIG);
}

/* --check-config: builds the configuration as start-up would and says
 * whether it is good; an operator runs it before SIGHUP or a restart. */
static int check_config(const struct daemon_options *options, bool dump) {
        const char *path = daemon_config_path(options);
        char errmsg[ERRMSG_MAX] = "";
        struct config c;
        int r;

        if (daemon_config_build(options, &c, errmsg) < 0) {
                fprintf(stderr, "moeepd: configuration: %s\n", errmsg);
                return EXIT_FAILURE;
        }
        if (dump) {
                printf("# moeepd %s: %s with the command line over it\n", MOEEP_VERSION,
                       path ? path : "embedded defaults");
                r = config_write(&c, stdout);
        } else
                r = printf("%s: configuration is valid\n", path ? path : "(embedded defaults)") < 0 ? -EIO
                                                                                                    : 0;
        config_done(&c);
        return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}

int main(int argc, char **argv) {
        static const struct option longopts[] = {
                { "socket", required_argument, NULL, 's' },
                { "admin-socket", required_argument, NULL, 'a' },
                { "foreground", no_argument, NULL, 'f' },
                { "config", required_argument, NULL, 'c' },
                { "log-level", required_argument, NULL, 'l' },
                { "no-config", no_argument, NULL, 'n' },
                { "metrics-listen", required_argument, NULL, 'm' },
                { "check-config", no_argument, NULL, 't' },
                { "dump-config", no_argument, NULL, 'd' },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, 'V' },
                {},
        };
        struct daemon_options options = { 0 };
        bool check = false, dump = false;
        struct daemon d;
        int c, level, r;

        while ((c = getopt_long(argc, argv, "s:a:fc:l:nm:tdhV", longopts, NULL)) != -1)
                switch (c) {
                case 's':
                        options.socket = optarg;
                        break;
                case 'a':
                        options.admin_socket = optarg;
                        break;
                case 'f':
                        break;
                case 'c':
                        options.config_path = optarg;
                        break;
                case 'l':
                        if (log_level_from_string(optarg, &level) < 0)
                                fatal("--log-level '%s': need err, warning, notice, info or debug", optarg);
                        options.log_level = optarg;
                        break;
                case 'n':
                        options.no_config = true;
                        break;
                case 'm':
                        options.metrics_listen = optarg;
                        break;
                case 't':
                        check = true;
                        break;
                case 'd':
                        dump = true;
                        break;
                case 'h':
                        usage(stdout);
                        return EXIT_SUCCESS;
                case 'V':
                        printf("moeepd %s (protocol %d.%d)\n", MOEEP_VERSION, MOEEP_PROTOCOL_MAJOR,
                               MOEEP_PROTOCOL_MINOR);
                        return EXIT_SUCCESS;
                default:
                        usage(stderr);
                        return EXIT_FAILURE;
                }
        if (optind < argc) {
                fprintf(stderr, "moeepd: unexpected argument '%s'\n", argv[optind]);
                usage(stderr);
                return EXIT_FAILURE;
        }

        if (options.no_config && options.config_path) {
                fprintf(stderr, "moeepd: --config and --no-config exclude each other\n");
                return EXIT_FAILURE;
        }
        if (check || dump)
                return check_config(&options, dump);

        r = daemon_init(&d, &options);
        if (r < 0) {
                daemon_done(&d);
                return EXIT_FAILURE;
        }
        r = daemon_run(&d);
        daemon_done(&d);
        return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
