/* Operator commands that change the daemon; see admin.h. */
#include <errno.h>
#include <inttypes.h>

#include "admin.h"
#include "daemon.h"
#include "log.h"
#include "query.h"
#include "session.h"

/* -EPERM naming the caller and who would be allowed. */
static int admin_check(const struct session *s, const char *what, char *errmsg) {
        const char *group = s->daemon->config.admin_group;

        if (query_is_admin(s))
                return 0;
        return errmsg_set(errmsg, -EPERM, "%s: uid %u is not an admin (root, the daemon's uid%s%s%s)", what,
                          (unsigned)s->cred.uid, group[0] ? " or members of group '" : "", group,
                          group[0] ? "'" : "");
}

int admin_log_level_set(struct session *s, uint64_t request_id, const char *level, char *errmsg) {
        int r, value;

        r = admin_check(s, "LogLevelSet", errmsg);
        if (r < 0)
                return r;
        if (log_level_from_string(level, &value) < 0)
                return errmsg_set(errmsg, -EINVAL,
                                  "LogLevelSet '%s': need err, warning, notice, info or debug", level);
        /* Logged at notice before and after, so that the change shows in
         * the journal whichever way it goes. */
        log_notice("session %" PRIu64 " (uid %u): log level %s -> %s", s->id, (unsigned)s->cred.uid,
                   log_level_to_string(log_get_level()), log_level_to_string(value));
        log_set_level(value);
        return session_send_ok(s, request_id);
}

int admin_drain(struct session *s, uint64_t request_id, bool on, char *errmsg) {
        struct daemon *d = s->daemon;
        int r;

        r = admin_check(s, "Drain", errmsg);
        if (r < 0)
                return r;
        if (d->draining != on)
                log_notice("session %" PRIu64 " (uid %u): %s", s->id, (unsigned)s->cred.uid,
                           on ? "draining: new jobs are refused, running jobs go on"
                              : "drain ended: new jobs are accepted");
        d->draining = on;
        return session_send_ok(s, request_id);
}
