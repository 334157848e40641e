/* What the read-only answers (query.c's listings, metrics.c's snapshot) see
 * of the daemon: one struct of pointers that daemon.c fills once every
 * object exists, so that neither reaches its siblings through struct
 * daemon. Nothing here is owned; only the loop thread reads it. */
#ifndef MOEEPD_VIEW_H
#define MOEEPD_VIEW_H

#include <stdbool.h>
#include <stdint.h>
#include <time.h>

struct broker;
struct datapath;
struct http;
struct jobs;
struct mesh;
struct mesh_jobs;
struct metrics;
struct sessions;

struct view {
        const struct sessions *sessions;
        const struct jobs *jobs;
        const struct broker *broker;
        const struct mesh *mesh;           /* NULL unless the mesh is on */
        const struct mesh_jobs *mesh_jobs; /* jobs across daemons; NULL unless the mesh is on */
        const struct datapath *datapath;   /* the internode data path; NULL unless the mesh is on */
        const struct http *http;           /* NULL unless metrics_listen is set */
        const struct metrics *counters;    /* the request and reload counters (metrics.h) */
        const bool *draining;              /* Drain is on (struct requests) */
        struct timespec started;           /* CLOCK_MONOTONIC at start-up */
};

/* Milliseconds since start-up. */
static inline uint64_t view_uptime_ms(const struct view *v) {
        struct timespec now;

        clock_gettime(CLOCK_MONOTONIC, &now);
        return (uint64_t)(now.tv_sec - v->started.tv_sec) * 1000 +
               (uint64_t)((now.tv_nsec - v->started.tv_nsec) / 1000000);
}

#endif
