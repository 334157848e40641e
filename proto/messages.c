/* The session protocol's message table; see messages.h and messages.def. */
#include <stddef.h>

#include "messages.h"
#include "record.h"

#define ROW(ENVELOPE, DIRECTION, CASE, field_, Name, FDS, FEATURE, JOB, ADMIN) \
        [MOEEP__V1__##ENVELOPE##__BODY_##CASE] = {                             \
                .type = MOEEP__V1__##ENVELOPE##__BODY_##CASE,                  \
                .direction = MOEEP_DIRECTION_##DIRECTION,                      \
                .name = Name,                                                  \
                .field = #field_,                                              \
                .fds = FDS_##FDS,                                              \
                .feature = (uint64_t)MOEEP__V1__FEATURE__FEATURE_##FEATURE,    \
                .needs_job = JOB,                                              \
                .admin_only = ADMIN,                                           \
        },
/* The FDS column: 0, 1, MANY or ONE_OR_NONE. */
#define FDS_0 0
#define FDS_1 1
#define FDS_MANY MOEEP_FDS_MANY
#define FDS_ONE_OR_NONE MOEEP_FDS_ONE_OR_NONE

/* Indexed by record type; the rows no message fills have no name. Two rows
 * of one type would be an initializer overridden (-Woverride-init). */
static const struct moeep_message messages[MOEEP_TYPE_EVENT_MAX + 1] = {
#define MOEEP_REQUEST(CASE, field, Name, FDS, FEATURE, JOB, ADMIN) \
        ROW(REQUEST, REQUEST, CASE, field, Name, FDS, FEATURE, JOB, ADMIN)
#define MOEEP_RESPONSE(CASE, field, Name, FDS, FEATURE, JOB, ADMIN) \
        ROW(RESPONSE, RESPONSE, CASE, field, Name, FDS, FEATURE, JOB, ADMIN)
#define MOEEP_EVENT(CASE, field, Name, FDS, FEATURE, JOB, ADMIN) \
        ROW(EVENT, EVENT, CASE, field, Name, FDS, FEATURE, JOB, ADMIN)
#include "messages.def"
#undef MOEEP_REQUEST
#undef MOEEP_RESPONSE
#undef MOEEP_EVENT
};

const struct moeep_message *moeep_message_lookup(uint16_t type) {
        if (type >= sizeof(messages) / sizeof(messages[0]) || !messages[type].name)
                return NULL;
        return &messages[type];
}

const char *moeep_direction_to_string(enum moeep_direction d) {
        switch (d) {
        case MOEEP_DIRECTION_REQUEST:
                return "request";
        case MOEEP_DIRECTION_RESPONSE:
                return "response";
        case MOEEP_DIRECTION_EVENT:
                return "event";
        }
        return "unknown";
}
