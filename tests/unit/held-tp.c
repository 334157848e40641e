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
#include "log.h"

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
        uint32_t k;

        (void)src_off;
        (void)dst_off;
        (void)len;
        (void)imm;
        (void)flags;
        pthread_mutex_lock(&tp->lock);
        assert_true(tp->nheld < HELD_MAX);
        if (peer >= TP_MAX_PEERS || !tp->used[peer])
                tp->stray++;
        tp->held[tp->nheld].cookie = cookie;
        tp->held[tp->nheld].ring = src->ring;
        tp->held[tp->nheld].peer = peer;
        tp->held[tp->nheld].status = 0;
        tp->held[tp->nheld].go = false;
        tp->nheld++;
        if (src->ring >= 0 && src->ring < HELD_RINGS)
                tp->writes[src->ring]++;
        for (k = 0; k < tp->nkeys && (tp->keys[k].peer != peer || tp->keys[k].key != dst->key); k++)
                ;
        if (k == tp->nkeys && k < HELD_KEYS) {
                tp->keys[k].peer = peer;
                tp->keys[k].key = dst->key;
                tp->keys[k].n = 0;
                tp->nkeys++;
        }
        if (k < HELD_KEYS)
                tp->keys[k].n++;
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
        int r = 0;

        pthread_mutex_lock(&tp->lock);
        if (peer >= TP_MAX_PEERS || tp->used[peer])
                tp->stray++;
        else if (tp->peer_new_error)
                r = errmsg_set(errmsg, tp->peer_new_error, "held: peer %u: refused as the test asked", peer);
        else
                tp->used[peer] = true;
        pthread_mutex_unlock(&tp->lock);
        memcpy(ret_blob, "held", 4);
        *ret_len = 4;
        return r;
}

static void held_peer_free(struct tp *tp, uint32_t peer) {
        pthread_mutex_lock(&tp->lock);
        if (peer >= TP_MAX_PEERS || !tp->used[peer])
                tp->stray++;
        else
                tp->used[peer] = false;
        if (peer < TP_MAX_PEERS)
                tp->freed[peer]++;
        pthread_mutex_unlock(&tp->lock);
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
        .peer_free = held_peer_free,
        .write = held_write,
        .poll = held_poll,
};

void release_with(struct tp *tp, int ring, uint32_t n, int status) {
        pthread_mutex_lock(&tp->lock);
        for (uint32_t i = 0; i < tp->nheld && n; i++)
                if (tp->held[i].ring == ring && !tp->held[i].go) {
                        tp->held[i].go = true;
                        tp->held[i].status = status;
                        n--;
                }
        pthread_mutex_unlock(&tp->lock);
}

void release(struct tp *tp, int ring, uint32_t n) {
        release_with(tp, ring, n, 0);
}

uint64_t held_key_writes(struct tp *tp, uint32_t peer, uint64_t key) {
        uint64_t n = 0;

        pthread_mutex_lock(&tp->lock);
        for (uint32_t k = 0; k < tp->nkeys; k++)
                if (tp->keys[k].peer == peer && tp->keys[k].key == key)
                        n = tp->keys[k].n;
        pthread_mutex_unlock(&tp->lock);
        return n;
}

uint32_t held_count(struct tp *tp) {
        uint32_t n;

        pthread_mutex_lock(&tp->lock);
        n = tp->nheld;
        pthread_mutex_unlock(&tp->lock);
        return n;
}
