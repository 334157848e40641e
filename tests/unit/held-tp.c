/* The held transport of the proxy's unit tests; see held-tp.h. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "held-tp.h"

static int held_mr_new(struct tp *tp, const struct tp_mem *mem, struct tp_mr **ret, char *errmsg) {
        (void)tp;
        (void)mem;
        (void)errmsg;
        *ret = calloc(1, sizeof(**ret));
        (*ret)->ring = -1;
        return 0;
}

static void held_mr_free(struct tp *tp, struct tp_mr *mr) {
        (void)tp;
        free(mr);
}

static int held_write(struct tp *tp, uint32_t peer, struct tp_mr *src, uint64_t src_off,
                      const struct tp_rkey *dst, uint64_t dst_off, uint64_t len, uint64_t cookie,
                      uint64_t imm, unsigned flags) {
        (void)peer;
        (void)src_off;
        (void)dst;
        (void)dst_off;
        (void)len;
        (void)imm;
        (void)flags;
        pthread_mutex_lock(&tp->lock);
        assert_true(tp->nheld < HELD_MAX);
        tp->held[tp->nheld].cookie = cookie;
        tp->held[tp->nheld].ring = src->ring;
        tp->held[tp->nheld].status = 0;
        tp->held[tp->nheld].go = false;
        tp->nheld++;
        if (src->ring >= 0)
                tp->writes[src->ring]++;
        pthread_mutex_unlock(&tp->lock);
        return 0;
}

static int held_poll(struct tp *tp, struct tp_completion *out, int max) {
        uint32_t kept = 0;
        int n = 0;

        pthread_mutex_lock(&tp->lock);
        for (uint32_t i = 0; i < tp->nheld; i++) {
                if (tp->held[i].go && n < max)
                        out[n++] = (struct tp_completion){ .cookie = tp->held[i].cookie,
                                                           .status = tp->held[i].status };
                else
                        tp->held[kept++] = tp->held[i];
        }
        tp->nheld = kept;
        pthread_mutex_unlock(&tp->lock);
        return n;
}

static int held_peer_new(struct tp *tp, uint32_t peer, void *ret_blob, size_t *ret_len, char *errmsg) {
        (void)tp;
        (void)peer;
        (void)errmsg;
        memcpy(ret_blob, "held", 4);
        *ret_len = 4;
        return 0;
}

static int held_peer_connect(struct tp *tp, uint32_t peer, const void *blob, size_t len, char *errmsg) {
        (void)tp;
        (void)peer;
        (void)blob;
        (void)len;
        (void)errmsg;
        return 0;
}

const struct tp_ops held_ops = {
        .name = "held",
        .mr_new = held_mr_new,
        .mr_free = held_mr_free,
        .peer_new = held_peer_new,
        .peer_connect = held_peer_connect,
        .write = held_write,
        .poll = held_poll,
};

void release(struct tp *tp, int ring, uint32_t n) {
        pthread_mutex_lock(&tp->lock);
        for (uint32_t i = 0; i < tp->nheld && n; i++)
                if (tp->held[i].ring == ring && !tp->held[i].go) {
                        tp->held[i].go = true;
                        n--;
                }
        pthread_mutex_unlock(&tp->lock);
}
