/* The protocol table (proto/messages.def) against moeep.proto: every body
 * case of the Request, Response and Event envelopes has its row, and every
 * row is a body case, in its envelope's range, with the field's and the
 * message's names as protoc-c generated them; proto/mesh.def has a row
 * per body case of PeerMessage but `sealed`, saying the same; and
 * proto/errors.def has a row per ErrorCode. The descriptors are the
 * independent reference: a
 * message or code added to moeep.proto without a row (or the other way
 * round) fails here. */
#include <errno.h>
#include <setjmp.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "messages.h"
#include "record.h"

struct envelope {
        const ProtobufCMessageDescriptor *desc;
        enum moeep_direction direction;
        unsigned min, max; /* record.h's range of its types */
};

static const struct envelope envelopes[] = {
        { &moeep__v1__request__descriptor, MOEEP_DIRECTION_REQUEST, MOEEP_TYPE_REQUEST_MIN,
          MOEEP_TYPE_REQUEST_MAX },
        { &moeep__v1__response__descriptor, MOEEP_DIRECTION_RESPONSE, MOEEP_TYPE_RESPONSE_MIN,
          MOEEP_TYPE_RESPONSE_MAX },
        { &moeep__v1__event__descriptor, MOEEP_DIRECTION_EVENT, MOEEP_TYPE_EVENT_MIN, MOEEP_TYPE_EVENT_MAX },
};

/* Every body case of every envelope has a row saying the same. */
static void test_every_case_has_a_row(void **state) {
        for (size_t e = 0; e < sizeof(envelopes) / sizeof(envelopes[0]); e++) {
                const ProtobufCMessageDescriptor *d = envelopes[e].desc;

                for (unsigned i = 0; i < d->n_fields; i++) {
                        const ProtobufCFieldDescriptor *f = &d->fields[i];
                        const struct moeep_message *m = moeep_message_lookup((uint16_t)f->id);

                        assert_true(f->id >= envelopes[e].min && f->id <= envelopes[e].max);
                        assert_non_null(m);
                        assert_int_equal(m->type, f->id);
                        assert_int_equal(m->direction, envelopes[e].direction);
                        assert_string_equal(m->field, f->name);
                        assert_int_equal(f->type, PROTOBUF_C_TYPE_MESSAGE);
                        assert_string_equal(m->name,
                                            ((const ProtobufCMessageDescriptor *)f->descriptor)->short_name);
                        assert_true(moeep_record_type_known(m->type));
                }
        }
}

/* Every row is a body case of its envelope, and says what it may: only
 * requests need a job or the admin socket, descriptor counts are 0, 1 or many, a feature is
 * one bit. */
static void test_every_row_is_a_case(void **state) {
        size_t rows = 0, cases = 0;

        for (unsigned t = 0; t <= UINT16_MAX; t++) {
                const struct moeep_message *m = moeep_message_lookup((uint16_t)t);
                const struct envelope *env;

                if (!m) {
                        assert_false(moeep_record_type_known((uint16_t)t));
                        continue;
                }
                rows++;
                assert_int_equal(m->type, t);
                assert_true(m->direction <= MOEEP_DIRECTION_EVENT);
                env = &envelopes[m->direction];
                assert_true(t >= env->min && t <= env->max);
                assert_non_null(protobuf_c_message_descriptor_get_field(env->desc, t));
                assert_true(m->fds == 0 || m->fds == 1 || m->fds == MOEEP_FDS_MANY ||
                            m->fds == MOEEP_FDS_ONE_OR_NONE);
                assert_int_equal(moeep_record_fds_expected(m->type), m->fds);
                assert_true(m->direction == MOEEP_DIRECTION_REQUEST || !m->needs_job);
                assert_true(m->direction == MOEEP_DIRECTION_REQUEST || !m->admin_only);
                assert_true((m->feature & (m->feature - 1)) == 0);
                assert_string_not_equal(moeep_direction_to_string(m->direction), "unknown");
        }
        for (size_t e = 0; e < sizeof(envelopes) / sizeof(envelopes[0]); e++)
                cases += envelopes[e].desc->n_fields;
        assert_int_equal(rows, cases);
}

/* The rows the daemon's checks rely on, spelled out (protocol.md). */
static void test_known_rows(void **state) {
        const struct moeep_message *m;

        assert_int_equal(moeep_record_fds_expected(MOEEP__V1__REQUEST__BODY_REGION_REGISTER),
                         MOEEP_FDS_ONE_OR_NONE);
        assert_int_equal(moeep_record_fds_expected(MOEEP__V1__RESPONSE__BODY_JOB_JOINED), 1);
        assert_int_equal(moeep_record_fds_expected(MOEEP__V1__RESPONSE__BODY_CHANNEL_OPENED), 1);
        assert_int_equal(moeep_record_fds_expected(MOEEP__V1__RESPONSE__BODY_REGIONS), MOEEP_FDS_MANY);
        assert_int_equal(moeep_record_fds_expected(MOEEP__V1__REQUEST__BODY_HELLO), 0);
        m = moeep_message_lookup(MOEEP__V1__REQUEST__BODY_CHANNEL_OPEN);
        assert_non_null(m);
        assert_true(m->needs_job);
        assert_int_equal(m->feature, MOEEP__V1__FEATURE__FEATURE_PROXY);
        m = moeep_message_lookup(MOEEP__V1__REQUEST__BODY_JOB_JOIN);
        assert_non_null(m);
        assert_false(m->needs_job);
        assert_int_equal(m->feature, 0);
        assert_false(m->admin_only);
        m = moeep_message_lookup(MOEEP__V1__REQUEST__BODY_MESH_LIST);
        assert_non_null(m);
        assert_int_equal(m->feature, MOEEP__V1__FEATURE__FEATURE_MESH);
        assert_true(m->admin_only);
        m = moeep_message_lookup(MOEEP__V1__REQUEST__BODY_METRICS_GET);
        assert_non_null(m);
        assert_false(m->admin_only);
        assert_int_equal(m->feature, MOEEP__V1__FEATURE__FEATURE_OPERATOR);
        m = moeep_message_lookup(MOEEP__V1__REQUEST__BODY_NICS_LIST);
        assert_non_null(m);
        assert_false(m->admin_only);
        assert_null(moeep_message_lookup(0));
        assert_null(moeep_message_lookup(50));
        assert_null(moeep_message_lookup(192)); /* PeerHello: the mesh's, not the session's */
}

/* The operator commands only the admin socket accepts (operations.md,
 * "Sockets"): exactly LogLevelSet, Drain and MeshList among the requests. */
static void test_admin_only_rows(void **state) {
        static const uint16_t admin[] = {
                MOEEP__V1__REQUEST__BODY_LOG_LEVEL_SET,
                MOEEP__V1__REQUEST__BODY_DRAIN,
                MOEEP__V1__REQUEST__BODY_MESH_LIST,
        };
        size_t found = 0;

        for (unsigned t = MOEEP_TYPE_REQUEST_MIN; t <= MOEEP_TYPE_REQUEST_MAX; t++) {
                const struct moeep_message *m = moeep_message_lookup((uint16_t)t);
                bool want = false;

                for (size_t i = 0; i < sizeof(admin) / sizeof(admin[0]); i++)
                        want |= admin[i] == t;
                if (!m) {
                        assert_false(want);
                        continue;
                }
                assert_int_equal(m->admin_only, want);
                found += m->admin_only;
        }
        assert_int_equal(found, sizeof(admin) / sizeof(admin[0]));
}

/* proto/mesh.def's rows, as written. */
struct peer_row {
        int value; /* the body case */
        const char *field, *name, *phase, *from, *owner;
};

static const struct peer_row peer_rows[] = {
#define MOEEP_PEER(CASE, field, Name, PHASE, FROM, OWNER) \
        { MOEEP__V1__PEER_MESSAGE__BODY_##CASE, #field, Name, #PHASE, #FROM, #OWNER },
#include "mesh.def"
#undef MOEEP_PEER
};

static bool one_of(const char *word, const char *const *words) {
        for (; *words; words++)
                if (strcmp(word, *words) == 0)
                        return true;
        return false;
}

/* proto/mesh.def against PeerMessage's descriptor: every body case but
 * `sealed` has exactly one row, with the field's and the message's names,
 * and every column says one of the words the daemon expands. */
static void test_peer_rows(void **state) {
        static const char *const phases[] = { "CLEAR", "WELCOME", "SEALED", NULL };
        static const char *const froms[] = { "DIALLER", "ACCEPTOR", "EITHER", NULL };
        static const char *const owners[] = { "PEERS", "JOBS", "JOINS", "TRANSPORT", NULL };
        const ProtobufCMessageDescriptor *d = &moeep__v1__peer_message__descriptor;
        size_t n = sizeof(peer_rows) / sizeof(peer_rows[0]), welcome = 0;

        assert_int_equal(n + 1, d->n_fields);
        for (unsigned i = 0; i < d->n_fields; i++) {
                const ProtobufCFieldDescriptor *f = &d->fields[i];
                size_t found = 0;

                if (f->id == MOEEP__V1__PEER_MESSAGE__BODY_SEALED) {
                        assert_string_equal(f->name, "sealed");
                        assert_int_equal(f->type, PROTOBUF_C_TYPE_BYTES);
                        continue;
                }
                assert_int_equal(f->type, PROTOBUF_C_TYPE_MESSAGE);
                for (size_t r = 0; r < n; r++) {
                        if (peer_rows[r].value != (int)f->id)
                                continue;
                        found++;
                        assert_string_equal(peer_rows[r].field, f->name);
                        assert_string_equal(peer_rows[r].name,
                                            ((const ProtobufCMessageDescriptor *)f->descriptor)->short_name);
                }
                assert_int_equal(found, 1);
        }
        for (size_t r = 0; r < n; r++) {
                assert_true(one_of(peer_rows[r].phase, phases));
                assert_true(one_of(peer_rows[r].from, froms));
                assert_true(one_of(peer_rows[r].owner, owners));
                /* The handshake is the peers' own. */
                if (strcmp(peer_rows[r].phase, "SEALED") != 0)
                        assert_string_equal(peer_rows[r].owner, "PEERS");
                if (strcmp(peer_rows[r].phase, "WELCOME") == 0) {
                        welcome++;
                        assert_int_equal(peer_rows[r].value, MOEEP__V1__PEER_MESSAGE__BODY_WELCOME);
                        assert_string_equal(peer_rows[r].from, "ACCEPTOR");
                }
        }
        assert_int_equal(welcome, 1);
}

/* proto/errors.def has one row per ErrorCode but ERROR_UNSPECIFIED, in
 * the enum's order, named as the enum names it. */
static void test_error_rows(void **state) {
        static const struct {
                const char *name;
                int value;
                int errnum;
        } rows[] = {
#define MOEEP_ERROR_REFUSAL(CODE, ERRNO, TEXT) { "ERROR_" #CODE, MOEEP__V1__ERROR_CODE__ERROR_##CODE, ERRNO },
#define MOEEP_ERROR_OTHER MOEEP_ERROR_REFUSAL
#include "errors.def"
#undef MOEEP_ERROR_OTHER
#undef MOEEP_ERROR_REFUSAL
        };
        const ProtobufCEnumDescriptor *d = &moeep__v1__error_code__descriptor;
        size_t n = sizeof(rows) / sizeof(rows[0]);

        assert_int_equal(n + 1, d->n_values);
        for (size_t i = 0; i < n; i++) {
                const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(d, rows[i].value);

                assert_non_null(v);
                assert_string_equal(v->name, rows[i].name);
                assert_int_equal(rows[i].value, (int)i + 1);
                assert_true(rows[i].errnum > 0);
        }
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_every_case_has_a_row), cmocka_unit_test(test_every_row_is_a_case),
                cmocka_unit_test(test_known_rows),           cmocka_unit_test(test_admin_only_rows),
                cmocka_unit_test(test_error_rows),           cmocka_unit_test(test_peer_rows),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
