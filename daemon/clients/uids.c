/* What the daemon keeps per client uid; see uids.h. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "clients/uids.h"
#include "log.h"

uint64_t uids_now_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Grows `a` back by `num`/`den` units per microsecond since its last
 * refill, up to `burst`. */
static void allowance_refill(struct uid_allowance *a, uint64_t now_us, uint64_t num, uint64_t den,
                             int64_t burst) {
        uint64_t grown;

        if (now_us <= a->at_us)
                return;
        if (a->credit >= burst) {
                a->at_us = now_us;
                a->remainder = 0;
                return;
        }
        /* Long idle times saturate: no product can overflow. */
        grown = now_us - a->at_us > (uint64_t)1 << 40 ? (uint64_t)1 << 40 : now_us - a->at_us;
        grown = grown * num + a->remainder;
        a->remainder = grown % den;
        a->at_us = now_us;
        if (a->credit + (int64_t)(grown / den) >= burst) {
                a->credit = burst;
                a->remainder = 0;
        } else {
                a->credit += (int64_t)(grown / den);
        }
}

static void loop_refill(struct client_uid *cu, uint64_t now_us) {
        allowance_refill(&cu->loop, now_us, UID_LOOP_SHARE_PERCENT, 100, UID_LOOP_BURST_US);
}

static void joins_refill(struct client_uid *cu, uint64_t now_us) {
        allowance_refill(&cu->joins, now_us, UID_JOINS_PER_S, 1000000, UID_JOINS_BURST);
}

void uids_init(struct uids *u) {
        LIST_INIT(&u->list);
        u->count = 0;
}

void uids_done(struct uids *u) {
        struct client_uid *cu;

        while ((cu = LIST_FIRST(&u->list))) {
                LIST_REMOVE(cu, entry);
                free(cu);
        }
        u->count = 0;
}

static void joins_log(struct client_uid *cu, uint64_t now_us);

/* Whether `cu` could go: no session, allowances grown back in full and no
 * failed joins waiting to be logged. */
static bool uid_idle(struct client_uid *cu, uint64_t now_us) {
        if (cu->joins_failed || cu->joins_refused)
                joins_log(cu, now_us);
        if (cu->sessions || cu->throttled || cu->joins_failed || cu->joins_refused)
                return false;
        loop_refill(cu, now_us);
        joins_refill(cu, now_us);
        return cu->loop.credit >= UID_LOOP_BURST_US && cu->joins.credit >= UID_JOINS_BURST;
}

struct client_uid *uids_session_add(struct uids *u, uid_t uid) {
        uint64_t now = uids_now_us();
        struct client_uid *cu, *next, *found = NULL;

        for (cu = LIST_FIRST(&u->list); cu; cu = next) {
                next = LIST_NEXT(cu, entry);
                if (cu->uid == uid)
                        found = cu;
                else if (uid_idle(cu, now)) {
                        LIST_REMOVE(cu, entry);
                        u->count--;
                        free(cu);
                }
        }
        cu = found;
        if (!cu) {
                cu = calloc(1, sizeof(*cu));
                if (!cu)
                        return NULL;
                cu->uid = uid;
                cu->loop = (struct uid_allowance){ .credit = UID_LOOP_BURST_US, .at_us = now };
                cu->joins = (struct uid_allowance){ .credit = UID_JOINS_BURST, .at_us = now };
                LIST_INSERT_HEAD(&u->list, cu, entry);
                u->count++;
        }
        cu->sessions++;
        return cu;
}

void uids_session_remove(struct uids *u, struct client_uid *cu) {
        if (cu && cu->sessions)
                cu->sessions--;
}

bool uid_loop_ok(struct client_uid *cu, uint64_t now_us) {
        loop_refill(cu, now_us);
        return cu->loop.credit > 0;
}

void uid_loop_charge(struct client_uid *cu, uint64_t used_us) {
        cu->loop.credit -= used_us > (uint64_t)INT32_MAX ? INT32_MAX : (int64_t)used_us;
}

uint64_t uid_loop_wait_us(const struct client_uid *cu, uint64_t now_us) {
        int64_t missing = 1 - cu->loop.credit;

        if (missing <= 0)
                return 0;
        /* The allowance grows by SHARE/100 a microsecond. */
        return ((uint64_t)missing * 100 + UID_LOOP_SHARE_PERCENT - 1) / UID_LOOP_SHARE_PERCENT;
}

/* Logs what `cu` got wrong since the last line, at most once per
 * UID_JOINS_LOG_S. */
static void joins_log(struct client_uid *cu, uint64_t now_us) {
        char refused[64] = "";

        if (cu->joins_logged_us && now_us - cu->joins_logged_us < (uint64_t)UID_JOINS_LOG_S * 1000000u)
                return;
        if (cu->joins_refused)
                snprintf(refused, sizeof(refused), ", %" PRIu64 " more refused unchecked", cu->joins_refused);
        log_notice("uid %u: %" PRIu64 " job joins named no job it may join (an unknown id or a wrong "
                   "secret)%s; it may get %d wrong a second",
                   (unsigned)cu->uid, cu->joins_failed, refused, UID_JOINS_PER_S);
        cu->joins_logged_us = now_us;
        cu->joins_failed = 0;
        cu->joins_refused = 0;
}

int uid_join_allowed(struct client_uid *cu, uint64_t now_us) {
        joins_refill(cu, now_us);
        if (cu->joins.credit >= 1)
                return 0;
        cu->joins_refused++;
        joins_log(cu, now_us);
        return -1;
}

void uid_join_failed(struct client_uid *cu, uint64_t now_us) {
        joins_refill(cu, now_us);
        cu->joins.credit--;
        cu->joins_failed++;
        joins_log(cu, now_us);
}
