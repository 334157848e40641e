/* moeepctl drain [--off] (admin): the daemon refuses new jobs
 * (ERROR_DRAINING) and lets running ones finish; --off accepts new jobs
 * again. Then shows the status, which says whether it drains. */
#include <stdio.h>

#include "ctl.h"

int ctl_drain(struct ctl *ctl) {
        Moeep__V1__Drain drain = MOEEP__V1__DRAIN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;

        if (!ctl_require_operator(ctl, "drain"))
                return 1;
        drain.on = !ctl->off;
        req.body_case = MOEEP__V1__REQUEST__BODY_DRAIN;
        req.drain = &drain;
        if (ctl_query(ctl, &req, MOEEP__V1__RESPONSE__BODY_OK, &resp) < 0)
                return 1;
        moeep__v1__response__free_unpacked(resp, NULL);
        return ctl_status(ctl);
}
