/* libFuzzer target: the configuration parser (daemon/config.c).
 *
 * Byte 0 picks the entry point, the rest is its text:
 *
 *   even   a whole INI file for config_load() (read through a memfd), then
 *          config_apply_reloadable() of the result onto fresh defaults
 *   odd    one "key\0value" pair for config_set()
 *
 * Checked: a successful parse leaves every field within the range that
 * config.c documents; a refusal always says why (a NUL-terminated message
 * that names something); nothing leaks (LeakSanitizer). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <syslog.h>
#include <unistd.h>

#include "fuzz.h"
#include "config.h"
#include "log.h"

static int memfd = -1;
static char path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        memfd = memfd_create("fuzz-config", MFD_CLOEXEC);
        if (memfd < 0)
                abort();
        snprintf(path, sizeof(path), "/proc/self/fd/%d", memfd);
        log_set_level(LOG_ERR);
        return 0;
}

static void check_valid(const struct config *c) {
        if (!c->socket || c->socket[0] != '/' || !c->socket_group || !c->admin_group)
                abort();
        if (c->socket_mode > 0777 || c->log_level < LOG_ERR || c->log_level > LOG_DEBUG)
                abort();
        if (c->max_sessions < 1 || c->max_sessions_per_uid < 1 || c->max_jobs_per_uid < 1 ||
            c->max_mirrors_per_peer < 1 || c->max_mirrors_per_peer > 4096 || c->max_regions_per_session < 1 ||
            c->max_regions_per_session > 64 || c->max_region_bytes_per_uid < 1 || c->max_fds_per_uid < 1 ||
            c->max_proxy_bytes_per_uid < 1 || c->max_proxy_bytes < 1)
                abort();
}

static void check_refusal(const char *errmsg) {
        if (memchr(errmsg, '\0', ERRMSG_MAX) == NULL || errmsg[0] == '\0')
                abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        char errmsg[ERRMSG_MAX];
        struct config c, fresh;
        int r;

        if (size < 1)
                return 0;
        if (config_init(&c) < 0)
                abort();
        check_valid(&c);
        memset(errmsg, 0, sizeof(errmsg));
        if (data[0] % 2 == 0) {
                if (ftruncate(memfd, 0) < 0 || pwrite(memfd, data + 1, size - 1, 0) != (ssize_t)(size - 1))
                        abort();
                r = config_load(&c, path, errmsg);
                if (r < 0) {
                        if (r != -EINVAL && r != -ENOMEM)
                                abort();
                        check_refusal(errmsg);
                } else {
                        check_valid(&c);
                        if (config_init(&fresh) < 0 || config_apply_reloadable(&fresh, &c) < 0)
                                abort();
                        check_valid(&fresh);
                        if (strcmp(fresh.admin_group, c.admin_group) != 0 ||
                            fresh.max_sessions != c.max_sessions)
                                abort();
                        config_done(&fresh);
                }
        } else {
                /* "key\0value": the key ends at the first NUL (or is all of
                 * it, with an empty value). */
                char *copy = malloc(size + 1);
                const char *value;

                if (!copy)
                        return 0;
                memcpy(copy, data + 1, size - 1);
                copy[size - 1] = '\0';
                value = copy + strlen(copy);
                if (value < copy + size - 1)
                        value++;
                r = config_set(&c, copy, value, errmsg);
                if (r < 0) {
                        if (r != -EINVAL && r != -ENOENT && r != -ENOMEM)
                                abort();
                        check_refusal(errmsg);
                } else {
                        check_valid(&c);
                        (void)config_key_reloadable(copy);
                }
                free(copy);
        }
        config_done(&c);
        config_done(&c); /* done twice must be harmless */
        return 0;
}
