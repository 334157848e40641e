/* moeepctl log-level LEVEL (admin): sets the daemon's log level until the
 * next SIGHUP or restart, then shows the level the daemon reports. */
#include <stdio.h>

#include "ctl.h"

int ctl_log_level(struct ctl *ctl) {
        Moeep__V1__LogLevelSet set = MOEEP__V1__LOG_LEVEL_SET__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;

        if (!ctl_require_operator(ctl, "log-level"))
                return 1;
        set.level = ctl->args[0];
        req.body_case = MOEEP__V1__REQUEST__BODY_LOG_LEVEL_SET;
        req.log_level_set = &set;
        if (ctl_query(ctl, &req, MOEEP__V1__RESPONSE__BODY_OK, &resp) < 0)
                return 1;
        moeep__v1__response__free_unpacked(resp, NULL);
        return ctl_status(ctl);
}
