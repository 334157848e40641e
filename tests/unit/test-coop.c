/* Unit tests of kernels/common/coop-rule.h: when a low-latency launch of
 * both phases may go plain. Per device: only on the one stream of every
 * launch of a kernel that waits for other ranks, after a cooperative one
 * succeeded there; a second stream, a capture, MPS or the debug switch
 * keep it cooperative, and a second stream or a capture for good. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "common/coop-rule.h"

enum {
        S1 = 11,
        S2 = 12
}; /* stream ids */

/* One launch of both phases on `id`: whether it was cooperative; a
 * cooperative one ends `ok`. */
static bool both(struct coop_device *d, bool capturing, unsigned long long id, bool ok) {
        coop_rule_seen(d, capturing, id);
        const bool coop = coop_rule_cooperative(d, false);
        if (coop)
                coop_rule_done(d, capturing ? 0 : id, ok);
        return coop;
}

static void test_one_stream(void **state) {
        struct coop_device d = { 0 };

        (void)state;
        assert_true(both(&d, false, S1, true));  /* the first proves the grid fits */
        assert_false(both(&d, false, S1, true)); /* then plain */
        coop_rule_seen(&d, false, S1);           /* a hook phase or the normal mode, same stream */
        assert_false(both(&d, false, S1, true));
        assert_true(coop_rule_cooperative(&d, true)); /* MOEEP_DEBUG_LL_COOP */
        assert_false(both(&d, false, S1, true));      /* without it, plain again */
}

static void test_refused_cooperative_launch(void **state) {
        struct coop_device d = { 0 };

        (void)state;
        assert_true(both(&d, false, S1, false)); /* too large for the context: two launches ran */
        assert_true(both(&d, false, S1, false)); /* still cooperative, refused again */
        assert_true(both(&d, false, S1, true));
        assert_false(both(&d, false, S1, true));
}

static void test_second_stream(void **state) {
        struct coop_device d = { 0 };

        (void)state;
        assert_true(both(&d, false, S1, true));
        assert_false(both(&d, false, S1, true));
        assert_true(both(&d, false, S2, true)); /* another endpoint's stream */
        assert_true(both(&d, false, S1, true)); /* for good */
        assert_true(both(&d, false, S2, true));

        struct coop_device e = { 0 };
        coop_rule_seen(&e, false, S2); /* a normal-mode kernel on a comm stream first */
        assert_true(both(&e, false, S1, true));
        assert_true(both(&e, false, S1, true));
}

static void test_capture(void **state) {
        struct coop_device d = { 0 };

        (void)state;
        assert_true(both(&d, false, S1, true));
        assert_true(both(&d, true, 0, true));   /* captured: a graph may run on any stream */
        assert_true(both(&d, false, S1, true)); /* eager ones after it too */

        struct coop_device e = { 0 };
        coop_rule_seen(&e, true, 0); /* a captured normal dispatch */
        assert_true(both(&e, false, S1, true));
        assert_true(both(&e, false, S1, true));
}

static void test_mps(void **state) {
        struct coop_device d = { .known = true, .mps = true };

        (void)state;
        for (int i = 0; i < 3; i++)
                assert_true(both(&d, false, S1, true));
}

static void test_done_elsewhere(void **state) {
        struct coop_device d = { 0 };

        (void)state;
        coop_rule_seen(&d, false, S1);
        coop_rule_done(&d, S2, true); /* a cooperative launch of another stream's, told late */
        assert_true(coop_rule_cooperative(&d, false));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_one_stream),    cmocka_unit_test(test_refused_cooperative_launch),
                cmocka_unit_test(test_second_stream), cmocka_unit_test(test_capture),
                cmocka_unit_test(test_mps),           cmocka_unit_test(test_done_elsewhere),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
