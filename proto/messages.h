/* What the session protocol's messages are, for code that checks or
 * dispatches them: one row per message, made from the one table in
 * messages.def. record.c reads it for the descriptor counts and the known
 * types, moeepd for the handlers, the feature, job and admin checks and
 * the per-type metric labels. */
#ifndef MOEEP_MESSAGES_H
#define MOEEP_MESSAGES_H

#include <stdbool.h>
#include <stdint.h>

/* Who sends a message. */
enum moeep_direction {
        MOEEP_DIRECTION_REQUEST,  /* client to daemon; answered by a Response of the same request id */
        MOEEP_DIRECTION_RESPONSE, /* daemon to client */
        MOEEP_DIRECTION_EVENT,    /* daemon to client, unsolicited (request id 0) */
};

const char *moeep_direction_to_string(enum moeep_direction d);

/* A message that carries one descriptor per entry (Regions): any number
 * up to MOEEP_RECORD_MAX_FDS, checked against the entries after decoding. */
#define MOEEP_FDS_MANY (-1)
/* A message that carries one descriptor, or none when its body says so
 * (RegionRegister with `take`, 1.4): at most one before decoding, the
 * daemon checks which after. */
#define MOEEP_FDS_ONE_OR_NONE (-2)

struct moeep_message {
        uint16_t type; /* the envelope's body case, the record header's type */
        enum moeep_direction direction;
        const char *name;  /* static; as moeep.proto names the message: "JobCreate" */
        const char *field; /* static; the body field: "job_create" (the metric label) */
        int fds;           /* 0, 1 (exactly one), MOEEP_FDS_MANY or MOEEP_FDS_ONE_OR_NONE */
        uint64_t feature;  /* the Feature bit both Hellos must have had, 0 for none */
        bool needs_job;    /* a request refused with ERROR_NOT_IN_JOB outside a job */
        bool admin_only; /* an operator command: refused with ERROR_PERMISSION_DENIED outside the admin socket */
};

/* The row of record type `type`, or NULL for a type no row declares. */
const struct moeep_message *moeep_message_lookup(uint16_t type);

#endif
