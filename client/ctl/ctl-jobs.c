/* moeepctl jobs: the jobs the caller may see. The secret never shows. A
 * mirror of a job of another daemon has no owner here ("-"). */
#include <stdio.h>

#include "ctl.h"

static const struct ctl_column columns[] = {
        { "ID", "job_id", CTL_UINT },        { "NAME", "name", CTL_STRING },
        { "WORLD", "world_size", CTL_UINT }, { "JOINED", "joined_ranks", CTL_RANKS },
        { "STATE", "state", CTL_STRING },    { "OWNER", "owner_uid", CTL_UID },
        { "LOST", "lost_ranks", CTL_RANKS },
};

int ctl_jobs(struct ctl *ctl) {
        Moeep__V1__JobsList list = MOEEP__V1__JOBS_LIST__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        struct ctl_table t;
        int r = 0;

        req.body_case = MOEEP__V1__REQUEST__BODY_JOBS_LIST;
        req.jobs_list = &list;
        if (ctl_query(ctl, &req, MOEEP__V1__RESPONSE__BODY_JOBS, &resp) < 0)
                return 1;

        ctl_table_init(&t, columns, sizeof(columns) / sizeof(columns[0]));
        for (size_t i = 0; i < resp->jobs->n_jobs && r >= 0; i++) {
                const Moeep__V1__JobInfo *j = resp->jobs->jobs[i];

                r = ctl_table_add(&t, (const struct ctl_value[]){
                                              { .u = j->job_id },
                                              { .s = j->name },
                                              { .u = j->world_size },
                                              { .list = j->joined_ranks, .n = j->n_joined_ranks },
                                              { .s = j->state },
                                              { .u = j->owner_uid },
                                              { .list = j->lost_ranks, .n = j->n_lost_ranks },
                                      });
        }
        return ctl_table_finish(&t, r, ctl->json, false, resp);
}
