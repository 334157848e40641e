/* Operator commands that change the daemon; see admin.h. */
#include <errno.h>
#include <inttypes.h>

#include "clients/admin.h"
#include "clients/session.h"
#include "errors.h"
#include "log.h"

int admin_log_level_set(const struct session *s, const char *level, char *errmsg) {
        int value;

        if (log_level_from_string(level, &value) < 0)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "LogLevelSet '%s': need err, warning, notice, info or debug", level);
        /* Logged at notice before and after, so that the change shows in
         * the journal whichever way it goes. */
        log_notice("session %" PRIu64 " (uid %u): log level %s -> %s", s->id, (unsigned)s->cred.uid,
                   log_level_to_string(log_get_level()), log_level_to_string(value));
        log_set_level(value);
        return 0;
}

int admin_drain(const struct session *s, bool *draining, bool on, char *errmsg) {
        if (*draining != on)
                log_notice("session %" PRIu64 " (uid %u): %s", s->id, (unsigned)s->cred.uid,
                           on ? "draining: new jobs are refused, running jobs go on"
                              : "drain ended: new jobs are accepted");
        *draining = on;
        return 0;
}
