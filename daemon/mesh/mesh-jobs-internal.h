/* What mesh-jobs.c (home and mirror jobs) and mesh-joins.c (forwarded
 * joins) share. Not for any other file: the rest of the daemon uses
 * mesh-jobs.h. */
#ifndef MOEEPD_MESH_JOBS_INTERNAL_H
#define MOEEPD_MESH_JOBS_INTERNAL_H

#include <stdint.h>
#include <sys/queue.h>

#include "mesh/mesh-jobs.h"
#include "moeep.pb-c.h"

struct mesh_peer;
struct mesh_rank; /* mesh-jobs.c */
struct mesh_join; /* mesh-joins.c */
TAILQ_HEAD(mesh_rank_list, mesh_rank);
TAILQ_HEAD(mesh_join_list, mesh_join);

struct mesh_jobs {
        struct mesh *mesh;            /* not owning; the peers */
        struct jobs *jobs;            /* not owning; the registry */
        struct mesh_jobs_hooks hooks; /* upward: the daemon and its sessions */
        struct mesh_rank_list ranks;  /* owns; remote ranks of our home jobs, in order of joining */
        struct mesh_join_list joins;  /* owns; forwarded joins waiting for an answer */
        uint64_t next_token;
};

/* Sends the forwarded joins that wait for `p` (UP). */
void mesh_joins_flush(struct mesh_jobs *mj, struct mesh_peer *p);

/* Fails the forwarded joins waiting for daemon `home` (it cannot be
 * reached: `why`). */
void mesh_joins_fail(struct mesh_jobs *mj, const char *home, const char *why);

/* The home's answer to a forwarded join. */
void mesh_joins_handle_joined(struct mesh_jobs *mj, struct mesh_peer *p, const Moeep__V1__PeerJoined *pj);

/* Drops every forwarded join (the daemon stops; no answer is sent). */
void mesh_joins_free_all(struct mesh_jobs *mj);

#endif
