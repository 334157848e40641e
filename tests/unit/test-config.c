/* Configuration parsing (daemon/config.c): defaults, good and bad files,
 * messages that name key and value, and what SIGHUP may change. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>
#include <unistd.h>

#include <cmocka.h>

#include "../tmpdir.h"
#include "config.h"
#include "log.h"
#include "moeep-config.h"

/* Writes `text` to a fresh temporary file; returns its path (static). */
static const char *write_file(const char *text) {
        static char path[128];
        FILE *f;
        int fd;

        test_tmp_path(path, sizeof(path), "moeep-unit-config-XXXXXX");
        fd = mkstemp(path);
        assert_true(fd >= 0);
        f = fdopen(fd, "w");
        assert_non_null(f);
        fputs(text, f);
        fclose(f);
        return path;
}

/* Loads `text` into a default configuration; returns the result and
 * leaves the message in errmsg. */
static int load(struct config *c, const char *text, char *errmsg) {
        const char *path = write_file(text);
        int r;

        assert_int_equal(config_init(c), 0);
        errmsg[0] = '\0';
        r = config_load(c, path, errmsg);
        unlink(path);
        return r;
}

static void test_defaults(void **state) {
        struct config c;

        assert_int_equal(config_init(&c), 0);
        assert_string_equal(c.socket, MOEEP_DEFAULT_SOCKET);
        assert_int_equal(c.socket_mode, 0660);
        assert_string_equal(c.socket_group, "");
        assert_string_equal(c.admin_group, "");
        assert_string_equal(c.admin_socket, "");
        assert_int_equal(c.log_level, LOG_INFO);
        assert_int_equal(c.max_regions_per_session, 8);
        assert_int_equal(c.max_region_bytes_per_uid, 1ull << 40);
        assert_int_equal(c.max_mirrors_per_peer, 256);
        assert_int_equal(c.max_proxy_bytes_per_uid, 16ull << 30);
        assert_int_equal(c.max_proxy_bytes, 64ull << 30);
        assert_true(c.max_sessions > 0 && c.max_sessions_per_uid > 0 && c.max_jobs_per_uid > 0 &&
                    c.max_fds_per_uid > 0);
        config_done(&c);
        config_done(&c); /* idempotent */
}

static void test_good_file(void **state) {
        struct config c;
        char errmsg[ERRMSG_MAX];

        assert_int_equal(load(&c,
                              "# a comment\n"
                              "[moeepd]\n"
                              "socket = /run/moeep-test/moeepd.sock\n"
                              "socket_mode = 0600\n"
                              "socket_group = users\n"
                              "admin_group = wheel\n"
                              "log_level = debug\n"
                              "max_sessions = 10\n"
                              "max_sessions_per_uid = 5\n"
                              "max_jobs_per_uid = 3\n"
                              "max_mirrors_per_peer = 7\n"
                              "max_regions_per_session = 4\n"
                              "max_region_bytes_per_uid = 2G\n"
                              "max_fds_per_uid = 16\n"
                              "max_proxy_bytes_per_uid = 512M\n"
                              "max_proxy_bytes = 1G\n",
                              errmsg),
                         0);
        assert_string_equal(c.socket, "/run/moeep-test/moeepd.sock");
        assert_int_equal(c.socket_mode, 0600);
        assert_string_equal(c.socket_group, "users");
        assert_string_equal(c.admin_group, "wheel");
        assert_int_equal(c.log_level, LOG_DEBUG);
        assert_int_equal(c.max_sessions, 10);
        assert_int_equal(c.max_sessions_per_uid, 5);
        assert_int_equal(c.max_jobs_per_uid, 3);
        assert_int_equal(c.max_mirrors_per_peer, 7);
        assert_int_equal(c.max_regions_per_session, 4);
        assert_int_equal(c.max_region_bytes_per_uid, 2ull << 30);
        assert_int_equal(c.max_fds_per_uid, 16);
        assert_int_equal(c.max_proxy_bytes_per_uid, 512ull << 20);
        assert_int_equal(c.max_proxy_bytes, 1ull << 30);
        config_done(&c);
}

/* Each bad file fails with -EINVAL and a message holding every `needles`. */
static void expect_bad(const char *text, const char *needle1, const char *needle2) {
        struct config c;
        char errmsg[ERRMSG_MAX];

        assert_int_equal(load(&c, text, errmsg), -EINVAL);
        if (!strstr(errmsg, needle1) || (needle2 && !strstr(errmsg, needle2)))
                fail_msg("message '%s' lacks '%s' / '%s'", errmsg, needle1, needle2 ? needle2 : "");
        config_done(&c);
}

static void test_bad_files(void **state) {
        expect_bad("max_sessions = 0\n", "max_sessions", "'0'");
        expect_bad("max_sessions = 12abc\n", "max_sessions", "12abc");
        expect_bad("max_sessions = -1\n", "max_sessions", "-1");
        expect_bad("max_regions_per_session = 65\n", "max_regions_per_session", "65");
        expect_bad("socket_mode = 999\n", "socket_mode", "999");
        expect_bad("socket_mode = 01777\n", "socket_mode", "01777");
        expect_bad("socket = relative.sock\n", "socket", "relative.sock");
        expect_bad("log_level = loud\n", "log_level", "loud");
        expect_bad("max_region_bytes_per_uid = 5X\n", "max_region_bytes_per_uid", "5X");
        expect_bad("max_region_bytes_per_uid = 99999999999T\n", "max_region_bytes_per_uid", "99999999999T");
        expect_bad("max_proxy_bytes_per_uid = 0\n", "max_proxy_bytes_per_uid", "'0'");
        expect_bad("max_proxy_bytes_per_uid = 4Q\n", "max_proxy_bytes_per_uid", "4Q");
        expect_bad("max_proxy_bytes = 0\n", "max_proxy_bytes", "'0'");
        expect_bad("max_proxy_bytes = 99999999999T\n", "max_proxy_bytes", "99999999999T");
        expect_bad("admin_group = a:b\n", "admin_group", "a:b");
        expect_bad("no_such_key = 1\n", "no_such_key", NULL);
        expect_bad("[other]\nmax_sessions = 1\n", ":2: unknown section [other]", NULL);
        expect_bad("max_sessions = 1\nthis line is wrong\n", ":2: syntax", NULL);
        expect_bad("max_sessions = 1\n\nmax_jobs_per_uid = 0\n", ":3: max_jobs_per_uid", "'0'");
        expect_bad("metrics_listen = 65536\n", "metrics_listen", "'65536'");
        expect_bad("metrics_listen = example.com:9464\n", "metrics_listen", "example.com:9464");
        expect_bad("metrics_listen = :9464\n", "metrics_listen", "':9464'");
        expect_bad("metrics_listen = [::1:9464\n", "metrics_listen", "[::1:9464");
        expect_bad("metrics_listen = 127.0.0.1:\n", "metrics_listen", "127.0.0.1:");
        expect_bad("metrics_listen = 127.0.0.1:http\n", "metrics_listen", "127.0.0.1:http");
}

/* metrics_listen: the forms it takes and how they split. */
static void test_metrics_listen(void **state) {
        static const struct {
                const char *value, *host;
                uint16_t port;
        } good[] = {
                { "9464", "127.0.0.1", 9464 },       { "0", "127.0.0.1", 0 },
                { "0.0.0.0:9464", "0.0.0.0", 9464 }, { "localhost:1", "localhost", 1 },
                { "[::1]:9464", "::1", 9464 },       { "[::]:65535", "::", 65535 },
        };
        char host[CONFIG_HOST_MAX], errmsg[ERRMSG_MAX];
        struct config c;
        uint16_t port;

        for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
                assert_int_equal(config_listen_split(good[i].value, host, &port), 0);
                assert_string_equal(host, good[i].host);
                assert_int_equal(port, good[i].port);
        }
        assert_int_equal(config_init(&c), 0);
        assert_string_equal(c.metrics_listen, ""); /* off by default */
        assert_int_equal(config_set(&c, "metrics_listen", "9464", errmsg), 0);
        assert_string_equal(c.metrics_listen, "9464");
        assert_int_equal(config_set(&c, "metrics_listen", "", errmsg), 0);
        assert_false(config_key_reloadable("metrics_listen"));
        config_done(&c);
}

/* The mesh keys: off by default, their forms, and what they refuse. */
static void test_mesh_keys(void **state) {
        char errmsg[ERRMSG_MAX];
        struct config c;

        assert_int_equal(config_init(&c), 0);
        assert_string_equal(c.mesh_listen, "");
        assert_string_equal(c.mesh_peers, "");
        assert_string_equal(c.cluster_key_file, "");
        assert_int_equal(config_set(&c, "mesh_listen", "127.0.0.1:7100", errmsg), 0);
        assert_int_equal(config_set(&c, "mesh_peers", "10.0.0.2:7100,[::1]:7100,localhost:1", errmsg), 0);
        assert_string_equal(c.mesh_peers, "10.0.0.2:7100,[::1]:7100,localhost:1");
        assert_int_equal(config_set(&c, "cluster_key_file", "/etc/moeep/cluster.key", errmsg), 0);
        assert_int_equal(config_set(&c, "cluster_key_file", "", errmsg), 0);
        for (const char *const *k =
                     (const char *const[]){ "mesh_listen", "mesh_peers", "cluster_key_file", NULL };
             *k; k++)
                assert_false(config_key_reloadable(*k));
        config_done(&c);
        expect_bad("mesh_listen = host.example:7100\n", "mesh_listen", "host.example:7100");
        expect_bad("mesh_peers = 10.0.0.2:7100,\n", "mesh_peers", "trailing comma");
        expect_bad("mesh_peers = 10.0.0.2:7100,,10.0.0.3:1\n", "mesh_peers", "10.0.0.2:7100,,10.0.0.3:1");
        expect_bad("mesh_peers = 10.0.0.2:0\n", "mesh_peers", "'10.0.0.2:0'");
        expect_bad("mesh_peers = 10.0.0.2\n", "mesh_peers", "'10.0.0.2'");
        expect_bad("cluster_key_file = cluster.key\n", "cluster_key_file", "cluster.key");
}

/* --dump-config's output reads back into the same configuration. */
static void test_write_reads_back(void **state) {
        struct config c, back;
        char errmsg[ERRMSG_MAX], *text = NULL;
        size_t len = 0;
        FILE *f;

        assert_int_equal(load(&c,
                              "max_region_bytes_per_uid = 3G\nsocket_mode = 0604\nmetrics_listen = [::1]:9\n"
                              "log_level = notice\nmax_fds_per_uid = 7\nmesh_listen = 127.0.0.1:7100\n"
                              "mesh_peers = 127.0.0.1:7101,[::1]:7102\ncluster_key_file = /k\n",
                              errmsg),
                         0);
        f = open_memstream(&text, &len);
        assert_non_null(f);
        assert_int_equal(config_write(&c, f), 0);
        fclose(f);
        assert_non_null(strstr(text, "max_region_bytes_per_uid = 3G\n"));
        assert_non_null(strstr(text, "socket_mode = 0604\n"));
        assert_non_null(strstr(text, "socket_group =\n"));
        assert_int_equal(load(&back, text, errmsg), 0);
        assert_int_equal(back.max_region_bytes_per_uid, 3ull << 30);
        assert_int_equal(back.socket_mode, 0604);
        assert_string_equal(back.metrics_listen, "[::1]:9");
        assert_int_equal(back.log_level, LOG_NOTICE);
        assert_int_equal(back.max_fds_per_uid, 7);
        assert_string_equal(back.mesh_peers, "127.0.0.1:7101,[::1]:7102");
        assert_string_equal(back.cluster_key_file, "/k");
        free(text);
        config_done(&c);
        config_done(&back);
}

static void test_missing_file(void **state) {
        struct config c;
        char errmsg[ERRMSG_MAX];

        assert_int_equal(config_init(&c), 0);
        assert_int_equal(config_load(&c, "/nonexistent/moeepd.conf", errmsg), -ENOENT);
        assert_non_null(strstr(errmsg, "/nonexistent/moeepd.conf"));
        config_done(&c);
}

static void test_set_and_reload(void **state) {
        struct config live, fresh;
        char errmsg[ERRMSG_MAX];

        assert_int_equal(config_init(&live), 0);
        assert_int_equal(config_init(&fresh), 0);
        assert_int_equal(config_set(&fresh, "socket", "/run/moeep-test/other.sock", errmsg), 0);
        assert_int_equal(config_set(&fresh, "log_level", "warn", errmsg), 0);
        assert_int_equal(config_set(&fresh, "log_level", "3", errmsg), 0);
        assert_int_equal(config_set(&fresh, "max_jobs_per_uid", "2", errmsg), 0);
        assert_int_equal(config_set(&fresh, "max_mirrors_per_peer", "5", errmsg), 0);
        assert_int_equal(config_set(&fresh, "max_mirrors_per_peer", "4097", errmsg), -EINVAL);
        assert_int_equal(config_set(&fresh, "admin_group", "", errmsg), 0);
        assert_int_equal(config_set(&fresh, "max_proxy_bytes_per_uid", "3G", errmsg), 0);
        assert_int_equal(config_set(&fresh, "max_proxy_bytes", "5G", errmsg), 0);
        assert_int_equal(config_set(&fresh, "bogus", "1", errmsg), -ENOENT);
        assert_int_equal(config_apply_reloadable(&live, &fresh), 0);
        assert_string_equal(live.socket, MOEEP_DEFAULT_SOCKET); /* needs a restart */
        assert_int_equal(live.log_level, LOG_ERR);
        assert_int_equal(live.max_jobs_per_uid, 2);
        assert_int_equal(live.max_mirrors_per_peer, 5);
        assert_int_equal(live.max_proxy_bytes_per_uid, 3ull << 30);
        assert_int_equal(live.max_proxy_bytes, 5ull << 30);
        assert_string_equal(live.admin_group, "");
        assert_false(config_key_reloadable("socket"));
        assert_false(config_key_reloadable("socket_mode"));
        assert_true(config_key_reloadable("log_level"));
        assert_true(config_key_reloadable("max_fds_per_uid"));
        assert_true(config_key_reloadable("max_proxy_bytes_per_uid"));
        assert_true(config_key_reloadable("max_proxy_bytes"));
        config_done(&live);
        config_done(&fresh);
}

static void test_log_levels(void **state) {
        int level;

        assert_int_equal(log_level_from_string("notice", &level), 0);
        assert_int_equal(level, LOG_NOTICE);
        assert_int_equal(log_level_from_string("7", &level), 0);
        assert_int_equal(level, LOG_DEBUG);
        assert_int_equal(log_level_from_string("8", &level), -EINVAL);
        assert_int_equal(log_level_from_string("", &level), -EINVAL);
        assert_string_equal(log_level_to_string(LOG_WARNING), "warning");
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_defaults),       cmocka_unit_test(test_good_file),
                cmocka_unit_test(test_bad_files),      cmocka_unit_test(test_missing_file),
                cmocka_unit_test(test_set_and_reload), cmocka_unit_test(test_log_levels),
                cmocka_unit_test(test_metrics_listen), cmocka_unit_test(test_write_reads_back),
                cmocka_unit_test(test_mesh_keys),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
