/* tp-loop: a transport inside one process. A write is a memcpy into the
 * target region's host address (the rkey's base) and completes at once. It
 * measures the proxy's own cost (no network) and tests the proxy without
 * one. Peers are only numbers; any region of the process is reachable.
 *
 * As a NIC would, it checks each write's key against the regions that are
 * registered now: a write into a region that was deregistered completes
 * with -EACCES (a remote access error) instead of copying into memory that
 * is gone. The registry's mutex also keeps mr_free (event loop) from
 * unmapping a region while write (proxy thread) copies into it. */
#include <pthread.h>
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "datapath/transport.h"
#include "log.h"

struct tp_mr {
        uint64_t key; /* unique per transport: what the rkey names */
        void *addr;   /* host address of offset 0 */
        uint64_t length;
        void *map; /* owns when not NULL: our mmap of a memfd */
};

struct tp {
        bool peers[TP_MAX_PEERS]; /* in use (peer_new .. peer_free) */
        uint32_t depth;           /* capacity of cq (power of two) */
        uint64_t cq_head, cq_tail;
        struct tp_completion *cq; /* owns; completions not yet polled */
        pthread_mutex_t lock;     /* guards mrs, nmrs against write */
        struct tp_mr **mrs;       /* owns the array, not the regions: the registered regions */
        size_t nmrs, mrs_cap;
        uint64_t next_key;
};

static int loop_open(const struct tp_config *cfg, struct tp **ret, char *errmsg) {
        struct tp *tp = calloc(1, sizeof(*tp));
        uint32_t depth = 1;

        while (depth < (cfg->queue_depth ? cfg->queue_depth : 8192))
                depth <<= 1;
        if (!tp || !(tp->cq = calloc(depth, sizeof(*tp->cq)))) {
                free(tp);
                return errmsg_set(errmsg, -ENOMEM, "transport loop: out of memory");
        }
        tp->depth = depth;
        tp->next_key = 1;
        pthread_mutex_init(&tp->lock, NULL);
        *ret = tp;
        return 0;
}

static void loop_close(struct tp *tp) {
        if (!tp)
                return;
        free(tp->cq);
        free(tp->mrs);
        pthread_mutex_destroy(&tp->lock);
        free(tp);
}

static int loop_mr_new(struct tp *tp, const struct tp_mem *mem, struct tp_mr **ret, char *errmsg) {
        const char *name = mem->name ? mem->name : "region";
        struct tp_mr *mr;
        int r;

        (void)tp;
        if (mem->kind == TP_MEM_DMABUF || mem->kind == TP_MEM_CUMEM)
                return errmsg_set(errmsg, -EOPNOTSUPP, "transport loop: %s: cannot register %s memory", name,
                                  tp_mem_kind_to_string(mem->kind));
        mr = calloc(1, sizeof(*mr));
        if (!mr)
                return errmsg_set(errmsg, -ENOMEM, "transport loop: %s: out of memory", name);
        mr->length = mem->length;
        r = tp_mem_map(mem, "transport loop", &mr->addr, &mr->map, errmsg);
        if (r < 0) {
                free(mr);
                return r;
        }
        pthread_mutex_lock(&tp->lock);
        if (tp->nmrs == tp->mrs_cap) {
                size_t cap = tp->mrs_cap ? 2 * tp->mrs_cap : 16;
                struct tp_mr **mrs = realloc(tp->mrs, cap * sizeof(*mrs));

                if (!mrs) {
                        pthread_mutex_unlock(&tp->lock);
                        tp_mem_unmap(mr->map, mr->length);
                        free(mr);
                        return errmsg_set(errmsg, -ENOMEM, "transport loop: %s: out of memory", name);
                }
                tp->mrs = mrs;
                tp->mrs_cap = cap;
        }
        mr->key = tp->next_key++;
        tp->mrs[tp->nmrs++] = mr;
        pthread_mutex_unlock(&tp->lock);
        *ret = mr;
        return 0;
}

static void loop_mr_free(struct tp *tp, struct tp_mr *mr) {
        if (!mr)
                return;
        pthread_mutex_lock(&tp->lock);
        for (size_t i = 0; i < tp->nmrs; i++)
                if (tp->mrs[i] == mr) {
                        tp->mrs[i] = tp->mrs[--tp->nmrs];
                        break;
                }
        pthread_mutex_unlock(&tp->lock);
        tp_mem_unmap(mr->map, mr->length);
        free(mr);
}

static void loop_mr_rkey(const struct tp_mr *mr, struct tp_rkey *ret) {
        ret->base = (uint64_t)(uintptr_t)mr->addr;
        ret->key = mr->key;
        ret->length = mr->length;
}

static void *loop_mr_addr(const struct tp_mr *mr) {
        return mr->addr;
}

static int loop_peer_new(struct tp *tp, uint32_t peer, void *ret_blob, size_t *ret_len, char *errmsg) {
        if (peer >= TP_MAX_PEERS || tp->peers[peer])
                return errmsg_set(errmsg, -EINVAL, "transport loop: peer %u: not a free index", peer);
        tp->peers[peer] = true;
        memcpy(ret_blob, "loop", 4);
        *ret_len = 4;
        return 0;
}

static int loop_peer_connect(struct tp *tp, uint32_t peer, const void *blob, size_t len, char *errmsg) {
        if (peer >= TP_MAX_PEERS || !tp->peers[peer] || len != 4 || memcmp(blob, "loop", 4) != 0)
                return errmsg_set(errmsg, -EINVAL, "transport loop: peer %u: bad address blob", peer);
        return 0;
}

static void loop_peer_free(struct tp *tp, uint32_t peer) {
        if (peer < TP_MAX_PEERS)
                tp->peers[peer] = false;
}

static int loop_write(struct tp *tp, uint32_t peer, struct tp_mr *src, uint64_t src_off,
                      const struct tp_rkey *dst, uint64_t dst_off, uint64_t len, uint64_t cookie,
                      uint64_t imm, unsigned flags) {
        struct tp_completion *c;

        (void)imm;
        (void)flags;
        if (peer >= TP_MAX_PEERS || !tp->peers[peer])
                return -ENOTCONN;
        if (!tp_range_ok(src->length, src_off, dst->length, dst_off, len))
                return -EINVAL;
        if (tp->cq_tail - tp->cq_head >= tp->depth)
                return -EAGAIN;
        c = &tp->cq[tp->cq_tail++ & (tp->depth - 1)];
        c->status = -EACCES;
        pthread_mutex_lock(&tp->lock);
        for (size_t i = 0; i < tp->nmrs; i++) {
                const struct tp_mr *mr = tp->mrs[i];

                if (mr->key == dst->key && (uint64_t)(uintptr_t)mr->addr == dst->base &&
                    mr->length == dst->length) {
                        memcpy((char *)mr->addr + dst_off, (char *)src->addr + src_off, len);
                        c->status = 0;
                        break;
                }
        }
        pthread_mutex_unlock(&tp->lock);
        c->cookie = cookie;
        c->remote = 0;
        c->peer = peer;
        return 0;
}

static int loop_poll(struct tp *tp, struct tp_completion *out, int max) {
        int n = 0;

        while (n < max && tp->cq_head != tp->cq_tail)
                out[n++] = tp->cq[tp->cq_head++ & (tp->depth - 1)];
        return n;
}

const struct tp_ops tp_loop_ops = {
        .name = "loop",
        .open = loop_open,
        .close = loop_close,
        .mr_new = loop_mr_new,
        .mr_free = loop_mr_free,
        .mr_rkey = loop_mr_rkey,
        .mr_addr = loop_mr_addr,
        .peer_new = loop_peer_new,
        .peer_connect = loop_peer_connect,
        .peer_free = loop_peer_free,
        .write = loop_write,
        .poll = loop_poll,
};
