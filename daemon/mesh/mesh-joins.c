/* Forwarded joins: a JobJoin whose unique id names another daemon goes to
 * that daemon (the job's home) as PeerJoin, and its PeerJoined makes the
 * session a member of a mirror of the job here; see mesh-jobs.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "log.h"
#include "mesh/mesh-jobs-internal.h"
#include "mesh/mesh-jobs.h"
#include "mesh/mesh.h"
#include "state/job.h"

/* A client's JobJoin forwarded to its job's home. */
struct mesh_join {
        uint64_t token;
        struct session *session; /* holds a reference (hooks.session_ref) */
        uint64_t request_id;
        bool sent; /* PeerJoin is out; waiting for PeerJoined */
        char home[JOB_NODE_MAX + 1];
        uint8_t unique_id[MOEEP_UNIQUE_ID_BYTES]; /* never logged */
        size_t unique_id_len;
        uint32_t rank, world_size;
        char gpu_uuid[MOEEP_GPU_UUID_MAX + 1];
        TAILQ_ENTRY(mesh_join) entry;
};

void mesh_joins_flush(struct mesh_jobs *mj, struct mesh_peer *p) {
        struct mesh_join *j;

        TAILQ_FOREACH (j, &mj->joins, entry) {
                Moeep__V1__PeerJoin pj = MOEEP__V1__PEER_JOIN__INIT;
                PEER_MSG(msg, join, &pj, JOIN);

                if (j->sent || strcmp(j->home, p->address) != 0)
                        continue;
                pj.token = j->token;
                pj.unique_id.data = j->unique_id;
                pj.unique_id.len = j->unique_id_len;
                pj.rank = j->rank;
                pj.world_size = j->world_size;
                pj.gpu_uuid = j->gpu_uuid;
                if (mesh_peer_send(p, &msg) == 0)
                        j->sent = true;
        }
}

static struct mesh_join *join_find(const struct mesh_jobs *mj, uint64_t token) {
        struct mesh_join *j;

        TAILQ_FOREACH (j, &mj->joins, entry)
                if (j->token == token)
                        return j;
        return NULL;
}

static void join_free(struct mesh_jobs *mj, struct mesh_join *j) {
        TAILQ_REMOVE(&mj->joins, j, entry);
        mj->hooks.session_unref(j->session);
        explicit_bzero(j->unique_id, sizeof(j->unique_id));
        free(j);
}

void mesh_joins_fail(struct mesh_jobs *mj, const char *home, const char *why) {
        struct mesh_join *j, *next;
        char msg[ERRMSG_MAX + JOB_NODE_MAX + 48];

        for (j = TAILQ_FIRST(&mj->joins); j; j = next) {
                next = TAILQ_NEXT(j, entry);
                if (strcmp(j->home, home) != 0)
                        continue;
                snprintf(msg, sizeof(msg), "the job's daemon %s cannot be reached: %s", home, why);
                mj->hooks.join_failed(j->session, j->request_id, MOEEP__V1__ERROR_CODE__ERROR_NO_SUCH_JOB,
                                      msg);
                join_free(mj, j);
        }
}

int mesh_jobs_join_forward(struct mesh_jobs *mj, struct session *s, uint64_t rid,
                           const Moeep__V1__JobJoin *jj, const char *home, char *errmsg) {
        char canon[JOB_NODE_MAX + 1], said[JOB_NODE_MAX + 1];
        struct mesh_join *j;
        struct mesh_peer *p;

        mesh_claim_printable(home, said);
        if (!mj)
                return errmsg_set(
                        errmsg, -ERROR_KIND_NO_SUCH_JOB,
                        "the job was created at daemon %s, and this daemon's mesh is off (mesh_listen)",
                        said);
        if (jj->unique_id.len > MOEEP_UNIQUE_ID_BYTES || strlen(jj->gpu_uuid) > MOEEP_GPU_UUID_MAX)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "unique id of %zu bytes or gpu uuid of %zu: too long", jj->unique_id.len,
                                  strlen(jj->gpu_uuid));
        /* The address comes from the client: it is only ever looked up
         * among the configured peers, never dialled as it is. */
        if (mesh_address_canon(home, canon) < 0)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "the unique id names daemon '%s', which is not a mesh address", said);
        if (strcmp(canon, mesh_address(mj->mesh)) == 0)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "the unique id names daemon '%s', which is this one (%s)", said,
                                  mesh_address(mj->mesh));
        p = mesh_configured_find(mj->mesh, canon);
        if (!p)
                return errmsg_set(errmsg, -ERROR_KIND_NO_SUCH_JOB,
                                  "the job's daemon %s (named in the unique id) is not one of this daemon's "
                                  "mesh_peers: the join is not forwarded",
                                  said);
        TAILQ_FOREACH (j, &mj->joins, entry)
                if (j->session == s)
                        return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                          "session %" PRIu64 " already waits for a join at daemon %s",
                                          mj->hooks.session_id(s), j->home);
        j = calloc(1, sizeof(*j));
        if (!j)
                return errmsg_set(errmsg, -ENOMEM, "out of memory");
        j->token = ++mj->next_token;
        j->session = s;
        mj->hooks.session_ref(s);
        j->request_id = rid;
        snprintf(j->home, sizeof(j->home), "%s", canon);
        memcpy(j->unique_id, jj->unique_id.data, jj->unique_id.len);
        j->unique_id_len = jj->unique_id.len;
        j->rank = jj->rank;
        j->world_size = jj->world_size;
        snprintf(j->gpu_uuid, sizeof(j->gpu_uuid), "%s", jj->gpu_uuid);
        TAILQ_INSERT_TAIL(&mj->joins, j, entry);
        log_info("session %" PRIu64 ": join as rank %" PRIu32 " forwarded to daemon %s",
                 mj->hooks.session_id(s), j->rank, canon);
        /* A configured peer that is down is being redialled; the join
         * goes when it is up, or fails with the next failed dial. */
        p = mesh_peer_find(mj->mesh, canon);
        if (p)
                mesh_joins_flush(mj, p);
        return 0;
}

void mesh_joins_handle_joined(struct mesh_jobs *mj, struct mesh_peer *p, const Moeep__V1__PeerJoined *pj) {
        struct mesh_join *j = join_find(mj, pj->token);
        char errmsg[ERRMSG_MAX] = "";
        struct job_member *m;
        struct session *s;
        int r;

        if (!j || strcmp(j->home, p->address) != 0) {
                log_debug("mesh: peer %s: PeerJoined for unknown token %" PRIu64, p->address, pj->token);
                return;
        }
        s = j->session;
        if (pj->error != MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED) {
                snprintf(errmsg, sizeof(errmsg), "at daemon %s: %s", p->address,
                         pj->message ? pj->message : "");
                mj->hooks.join_failed(s, j->request_id, pj->error, errmsg);
                join_free(mj, j);
                return;
        }
        r = -ECANCELED;
        if (mj->hooks.session_can_join(s))
                r = jobs_join_mirror(mj->jobs, p->address, pj->job_id, pj->name, pj->world_size, j->rank,
                                     j->gpu_uuid, s, mj->hooks.session_uid(s), &m, errmsg);
        if (r < 0) {
                Moeep__V1__PeerLeave leave = MOEEP__V1__PEER_LEAVE__INIT;
                PEER_MSG(msg, leave, &leave, LEAVE);

                leave.job_id = pj->job_id;
                leave.rank = j->rank;
                mesh_peer_send(p, &msg);
                if (r != -ECANCELED)
                        mj->hooks.join_failed(s, j->request_id, mj->hooks.error_code(r), errmsg);
                join_free(mj, j);
                return;
        }
        mj->hooks.joined(s, j->request_id, m);
        mj->hooks.status_changed(mj->hooks.arg);
        join_free(mj, j);
}

void mesh_joins_free_all(struct mesh_jobs *mj) {
        struct mesh_join *j;

        while ((j = TAILQ_FIRST(&mj->joins)))
                join_free(mj, j);
}
