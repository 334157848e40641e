/* moeepctl clients: the sessions the caller may see. */
#include <stdio.h>

#include "ctl.h"

static const struct ctl_column columns[] = {
        { "SESSION", "session_id", CTL_UINT },
        { "PID", "pid", CTL_UINT },
        { "UID", "uid", CTL_UINT },
        { "JOB", "job_id", CTL_ID },
        { "RANK", "rank", CTL_RANK },
        { "GPU", "gpu_uuid", CTL_STRING },
        { "STATE", "state", CTL_STRING },
        { "REGIONS", "regions", CTL_UINT },
        { "NAME", "name", CTL_STRING },
};

int ctl_clients(struct ctl *ctl) {
        Moeep__V1__ClientsList list = MOEEP__V1__CLIENTS_LIST__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        struct ctl_table t;
        int r = 0;

        req.body_case = MOEEP__V1__REQUEST__BODY_CLIENTS_LIST;
        req.clients_list = &list;
        if (ctl_query(ctl, &req, MOEEP__V1__RESPONSE__BODY_CLIENTS, &resp) < 0)
                return 1;

        ctl_table_init(&t, columns, sizeof(columns) / sizeof(columns[0]));
        for (size_t i = 0; i < resp->clients->n_clients && r >= 0; i++) {
                const Moeep__V1__ClientInfo *ci = resp->clients->clients[i];

                r = ctl_table_add(&t, (const struct ctl_value[]){
                                              { .u = ci->session_id },
                                              { .u = ci->pid },
                                              { .u = ci->uid },
                                              { .u = ci->job_id },
                                              { .i = ci->rank },
                                              { .s = ci->gpu_uuid },
                                              { .s = ci->state },
                                              { .u = ci->regions },
                                              { .s = ci->name },
                                      });
        }
        return ctl_table_finish(&t, r, ctl->json, false, resp);
}
