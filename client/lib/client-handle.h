/* The client handle's fields, for libmoeep's own control-plane files
 * (client.c: the connection; client-job.c: the joined job; client-region.c:
 * regions and the proxy path). Everything outside client/lib/ sees struct
 * moeep_client as opaque and uses client-internal.h. */
#ifndef MOEEP_CLIENT_HANDLE_H
#define MOEEP_CLIENT_HANDLE_H

#include <stddef.h>
#include <stdint.h>

#include "client-internal.h"

struct moeep_client {
        int sock;          /* owns; the connection to moeepd */
        char *socket_path; /* owns */
        uint64_t last_request_id;
        int broken;                /* 0, or the -errno every later call fails with */
        uint64_t alive_checked_ns; /* CLOCK_MONOTONIC of client_check_alive()'s last poll */

        /* From Welcome. */
        uint64_t session_id;
        uint64_t features;
        char daemon_version[64];

        /* The joined job; control_page is NULL while not in a job. */
        struct moeep_control_page *control_page; /* owns the mapping */
        uint64_t job_id;
        int rank;
        int world_size;

        /* Ring of pending events, oldest at events_head. */
        struct moeep_event events[MOEEP_CLIENT_EVENT_QUEUE];
        size_t events_head;
        size_t events_count;
        uint64_t events_dropped;

        struct moeep_record *rec; /* owns; receive buffer, holds the last reply's fds */
        char error[256];

        /* The data plane's state for the joined job (client_job_data). */
        void *job_data;
        void (*job_data_free)(void *data);
};

/* 0 when the handle has joined a job, else -ENOTCONN with an error text
 * naming `what`. */
int client_require_job(struct moeep_client *c, const char *what);

/* Forgets the joined job locally (the data plane's state included) and
 * unmaps its control page; moeep_client_free() and moeep_job_leave() call
 * it. */
void client_job_forget(struct moeep_client *c);

#endif
