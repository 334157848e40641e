/* moeepd logging: one line per message to stderr, prefixed with the syslog
 * priority in angle brackets ("<4>...") so journald keeps the level when
 * systemd runs us. Single-threaded use (the event loop thread). */
#ifndef MOEEPD_LOG_H
#define MOEEPD_LOG_H

#include <stdarg.h>
#include <syslog.h>

/* Size of the error-message buffers that functions fill next to their -errno
 * return ("errmsg" parameters): the caller decides whether to log it or send
 * it to a client, so the callee does not log. */
#define ERRMSG_MAX 256

/* Levels are the syslog priorities LOG_ERR..LOG_DEBUG. */
void log_set_level(int level);
int log_get_level(void);

/* Parses "err", "warning" (or "warn"), "notice", "info", "debug" or the
 * number 3..7. Returns 0 or -EINVAL. */
int log_level_from_string(const char *s, int *ret_level);
const char *log_level_to_string(int level);

void log_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_notice(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_debug(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Start-up only: logs at LOG_CRIT and exits 1. Never for anything a client
 * sent. */
void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* Formats into `errmsg` (ERRMSG_MAX bytes) when it is not NULL; returns
 * `r` so callers can write `return errmsg_set(errmsg, -EINVAL, ...)`. */
int errmsg_set(char *errmsg, int r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
