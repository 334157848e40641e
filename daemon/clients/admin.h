/* Operator commands that change the daemon (LogLevelSet, Drain). Only
 * sessions accepted on the admin socket may send them: their rows in
 * proto/messages.def say ADMIN, and requests.c refuses them with
 * ERROR_PERMISSION_DENIED on the client socket, whatever the uid (struct
 * session's `admin`, decided at accept), before calling these. Each logs
 * what changed and who changed it and returns 0; requests.c then sends Ok. */
#ifndef MOEEPD_ADMIN_H
#define MOEEPD_ADMIN_H

#include <stdbool.h>
#include <stdint.h>

struct session;

/* Sets the log level until the next SIGHUP (which re-reads log_level) or
 * restart. -ERROR_KIND_INVALID_ARGUMENT for a level log_level_from_string()
 * refuses. */
int admin_log_level_set(const struct session *s, const char *level, char *errmsg);

/* Starts (`on`) or ends draining (*draining, struct jobs' flag): while
 * draining, JobCreate is refused with ERROR_DRAINING and jobs that exist go
 * on. Not kept across restarts. */
int admin_drain(const struct session *s, bool *draining, bool on, char *errmsg);

#endif
