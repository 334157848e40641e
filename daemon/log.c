/* moeepd logging; see log.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

static int log_level = LOG_INFO;

static const char *const level_names[] = {
        [LOG_EMERG] = "emerg",     [LOG_ALERT] = "alert",   [LOG_CRIT] = "crit", [LOG_ERR] = "err",
        [LOG_WARNING] = "warning", [LOG_NOTICE] = "notice", [LOG_INFO] = "info", [LOG_DEBUG] = "debug",
};

void log_set_level(int level) {
        if (level >= LOG_ERR && level <= LOG_DEBUG)
                log_level = level;
}

int log_get_level(void) {
        return log_level;
}

int log_level_from_string(const char *s, int *ret_level) {
        if (!s)
                return -EINVAL;
        if (strcmp(s, "warn") == 0) {
                *ret_level = LOG_WARNING;
                return 0;
        }
        for (int l = LOG_ERR; l <= LOG_DEBUG; l++)
                if (strcmp(s, level_names[l]) == 0) {
                        *ret_level = l;
                        return 0;
                }
        if (s[0] >= '0' + LOG_ERR && s[0] <= '0' + LOG_DEBUG && s[1] == '\0') {
                *ret_level = s[0] - '0';
                return 0;
        }
        return -EINVAL;
}

const char *log_level_to_string(int level) {
        if (level < LOG_EMERG || level > LOG_DEBUG)
                return "unknown";
        return level_names[level];
}

/* Messages quote names that clients chose (job names, client names), so
 * control characters are replaced: a client must not be able to forge log
 * lines or priority prefixes. */
static void vlog(int pri, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

static void vlog(int pri, const char *fmt, va_list ap) {
        char line[1024];
        int saved = errno;

        if (pri > log_level)
                return;
        vsnprintf(line, sizeof(line), fmt, ap);
        for (char *p = line; *p; p++)
                if ((unsigned char)*p < 0x20 || *p == 0x7f)
                        *p = '?';
        fprintf(stderr, "<%d>%s\n", pri, line);
        errno = saved;
}

#define LOG_FUNC(name, pri)               \
        void name(const char *fmt, ...) { \
                va_list ap;               \
                va_start(ap, fmt);        \
                vlog(pri, fmt, ap);       \
                va_end(ap);               \
        }

LOG_FUNC(log_err, LOG_ERR)
LOG_FUNC(log_warn, LOG_WARNING)
LOG_FUNC(log_notice, LOG_NOTICE)
LOG_FUNC(log_info, LOG_INFO)
LOG_FUNC(log_debug, LOG_DEBUG)

void fatal(const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        vlog(LOG_CRIT, fmt, ap);
        va_end(ap);
        exit(EXIT_FAILURE);
}

int errmsg_set(char *errmsg, int r, const char *fmt, ...) {
        va_list ap;

        if (!errmsg)
                return r;
        va_start(ap, fmt);
        vsnprintf(errmsg, ERRMSG_MAX, fmt, ap);
        va_end(ap);
        return r;
}
