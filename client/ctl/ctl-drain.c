/* moeepctl drain [--off] (admin): the daemon refuses new jobs
 * (ERROR_DRAINING) and lets running ones finish; --off accepts new jobs
 * again. Then shows the status, which says whether it drains. */
#include "ctl.h"

int ctl_drain(struct ctl *ctl) {
        Moeep__V1__Drain drain = MOEEP__V1__DRAIN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        drain.on = !ctl->off;
        req.body_case = MOEEP__V1__REQUEST__BODY_DRAIN;
        req.drain = &drain;
        return ctl_admin(ctl, "drain", &req);
}
