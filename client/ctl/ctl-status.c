/* moeepctl status: the daemon at a glance. */
#include <stdio.h>

#include "ctl.h"

static const struct ctl_column columns[] = {
        { "socket", "socket", CTL_STRING },
        { "version", "version", CTL_STRING },
        { "protocol", "protocol", CTL_STRING },
        { "uptime", "uptime_ms", CTL_DURATION_MS },
        { "pid", "pid", CTL_UINT },
        { "sessions", "sessions", CTL_UINT },
        { "jobs", "jobs", CTL_UINT },
        { "draining", "draining", CTL_BOOL },
        { "log level", "log_level", CTL_STRING },
};

int ctl_status(struct ctl *ctl) {
        Moeep__V1__StatusGet get = MOEEP__V1__STATUS_GET__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        struct ctl_table t;
        Moeep__V1__Status *s;
        char protocol[32];
        int r;

        req.body_case = MOEEP__V1__REQUEST__BODY_STATUS_GET;
        req.status_get = &get;
        if (ctl_query(ctl, &req, MOEEP__V1__RESPONSE__BODY_STATUS, &resp) < 0)
                return 1;
        s = resp->status;
        snprintf(protocol, sizeof(protocol), "%u.%u", s->major, s->minor);

        ctl_table_init(&t, columns, sizeof(columns) / sizeof(columns[0]));
        r = ctl_table_add(&t, (const struct ctl_value[]){
                                      { .s = client_socket_path(ctl->client) },
                                      { .s = s->daemon_version },
                                      { .s = protocol },
                                      { .u = s->uptime_ms },
                                      { .u = s->pid },
                                      { .u = s->sessions },
                                      { .u = s->jobs },
                                      { .u = s->draining },
                                      { .s = s->log_level },
                              });
        return ctl_table_finish(&t, r, ctl->json, true, resp);
}
