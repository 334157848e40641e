/* moeepctl log-level LEVEL (admin): sets the daemon's log level until the
 * next SIGHUP or restart, then shows the level the daemon reports. */
#include "ctl.h"

int ctl_log_level(struct ctl *ctl) {
        Moeep__V1__LogLevelSet set = MOEEP__V1__LOG_LEVEL_SET__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        set.level = ctl->args[0];
        req.body_case = MOEEP__V1__REQUEST__BODY_LOG_LEVEL_SET;
        req.log_level_set = &set;
        return ctl_admin(ctl, "log-level", &req);
}
