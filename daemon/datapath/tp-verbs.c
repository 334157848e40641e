/* tp-verbs: the libibverbs RC backend (transport.h), for ConnectX on
 * InfiniBand or RoCE. One PD and one CQ per transport, one RC QP per peer,
 * brought to RTS with the peer's (lid, qpn, psn, gid) blob as rc_pingpong
 * does; objects are created in order and unwound through one label ladder.
 *
 * Ordering: an RC QP executes its writes in order and ConnectX places them
 * in order (no relaxed ordering on the registered regions), so an ordered
 * write needs no fence; IBV_SEND_FENCE only orders after reads and atomics. */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#include "datapath/transport.h"
#include "log.h"

/* The address blob: what rc_pingpong exchanges. */
struct verbs_blob {
        uint32_t magic; /* VERBS_BLOB_MAGIC */
        uint32_t qpn;
        uint32_t psn;
        uint16_t lid;
        uint8_t mtu; /* enum ibv_mtu of the sender's port */
        uint8_t pad;
        uint8_t gid[16];
};
#define VERBS_BLOB_MAGIC 0x6d6f7671u /* "movq" */

struct tp_mr {
        struct ibv_mr *mr; /* owns */
        void *addr;        /* host address of offset 0, NULL for device memory */
        uint64_t length;
        uint64_t base; /* wire address of offset 0 (the virtual address; 0 for dma-buf at iova 0) */
        void *map;     /* owns when not NULL */
};

struct tp {
        char dev[64];
        char who[96];            /* "transport verbs DEV", for messages */
        struct ibv_context *ctx; /* owns */
        struct ibv_pd *pd;       /* owns */
        struct ibv_cq *cq;       /* owns */
        struct ibv_port_attr port_attr;
        uint8_t port;
        uint32_t gid_index;
        union ibv_gid gid;
        uint32_t depth;
        struct ibv_qp **qps; /* owns each; TP_MAX_PEERS, NULL while the index is free */
        bool *connected;     /* owns; TP_MAX_PEERS */
        uint32_t *psn;       /* owns; our send PSN per peer, sent in our blob */
};

static int verbs_open(const struct tp_config *cfg, struct tp **ret, char *errmsg) {
        struct ibv_device **list = NULL;
        struct ibv_device *dev = NULL;
        struct tp *tp;
        int n, r;

        tp = calloc(1, sizeof(*tp));
        if (!tp || !(tp->qps = calloc(TP_MAX_PEERS, sizeof(*tp->qps))) ||
            !(tp->connected = calloc(TP_MAX_PEERS, sizeof(*tp->connected))) ||
            !(tp->psn = calloc(TP_MAX_PEERS, sizeof(*tp->psn)))) {
                r = errmsg_set(errmsg, -ENOMEM, "transport verbs: out of memory");
                goto err_tp;
        }
        list = ibv_get_device_list(&n);
        if (!list || n == 0) {
                r = errmsg_set(errmsg, -ENODEV,
                               "transport verbs: no RDMA device (ibv_get_device_list found none)");
                goto err_list;
        }
        for (int i = 0; i < n && !dev; i++)
                if (!cfg->device || !cfg->device[0] || strcmp(ibv_get_device_name(list[i]), cfg->device) == 0)
                        dev = list[i];
        if (!dev) {
                r = errmsg_set(errmsg, -ENODEV, "transport verbs: no RDMA device named '%s'", cfg->device);
                goto err_list;
        }
        snprintf(tp->dev, sizeof(tp->dev), "%s", ibv_get_device_name(dev));
        snprintf(tp->who, sizeof(tp->who), "transport verbs %s", tp->dev);
        tp->port = cfg->port ? (uint8_t)cfg->port : 1;
        tp->gid_index = cfg->gid_index;
        tp->depth = cfg->queue_depth ? cfg->queue_depth : 1024;
        tp->ctx = ibv_open_device(dev);
        if (!tp->ctx) {
                r = errmsg_set(errmsg, -errno, "transport verbs: %s: ibv_open_device: %s", tp->dev,
                               strerror(errno));
                goto err_list;
        }
        if (ibv_query_port(tp->ctx, tp->port, &tp->port_attr) ||
            ibv_query_gid(tp->ctx, tp->port, (int)tp->gid_index, &tp->gid)) {
                r = errmsg_set(errmsg, -EINVAL, "transport verbs: %s port %u gid index %u: cannot query",
                               tp->dev, tp->port, tp->gid_index);
                goto err_ctx;
        }
        tp->pd = ibv_alloc_pd(tp->ctx);
        if (!tp->pd) {
                r = errmsg_set(errmsg, -ENOMEM, "transport verbs: %s: ibv_alloc_pd failed", tp->dev);
                goto err_ctx;
        }
        tp->cq = ibv_create_cq(tp->ctx, (int)(2 * tp->depth), NULL, NULL, 0);
        if (!tp->cq) {
                r = errmsg_set(errmsg, -ENOMEM, "transport verbs: %s: ibv_create_cq(%u) failed", tp->dev,
                               2 * tp->depth);
                goto err_pd;
        }
        ibv_free_device_list(list);
        *ret = tp;
        return 0;

err_pd:
        ibv_dealloc_pd(tp->pd);
err_ctx:
        ibv_close_device(tp->ctx);
err_list:
        if (list)
                ibv_free_device_list(list);
err_tp:
        if (tp) {
                free(tp->qps);
                free(tp->connected);
                free(tp->psn);
        }
        free(tp);
        return r;
}

static void verbs_close(struct tp *tp) {
        if (!tp)
                return;
        for (uint32_t i = 0; i < TP_MAX_PEERS; i++)
                if (tp->qps[i])
                        ibv_destroy_qp(tp->qps[i]);
        ibv_destroy_cq(tp->cq);
        ibv_dealloc_pd(tp->pd);
        ibv_close_device(tp->ctx);
        free(tp->qps);
        free(tp->connected);
        free(tp->psn);
        free(tp);
}

static int verbs_mr_new(struct tp *tp, const struct tp_mem *mem, struct tp_mr **ret, char *errmsg) {
        const char *name = mem->name ? mem->name : "region";
        int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
        struct tp_mr *mr;
        int r;

        if (mem->kind == TP_MEM_CUMEM)
                return errmsg_set(
                        errmsg, -EOPNOTSUPP,
                        "transport verbs %s: %s: a cuMem fd needs a CUDA context to import; register "
                        "GPU memory as a dma-buf (cuMemGetHandleForAddressRange)",
                        tp->dev, name);
        mr = calloc(1, sizeof(*mr));
        if (!mr)
                return errmsg_set(errmsg, -ENOMEM, "transport verbs %s: %s: out of memory", tp->dev, name);
        mr->length = mem->length;
        r = tp_mem_map(mem, tp->who, &mr->addr, &mr->map, errmsg);
        if (r < 0)
                goto err_mr;
        if (mem->kind == TP_MEM_DMABUF) {
                /* iova 0: the wire address of offset 0 is 0. */
                mr->mr = ibv_reg_dmabuf_mr(tp->pd, mem->offset, mem->length, 0, mem->fd, access);
                /* EOPNOTSUPP / EPROTONOSUPPORT: the device's driver (or the
                 * kernel, before 5.12) has no dma-buf import; nvidia_peermem
                 * would not help here, the daemon does not use it. */
                if (!mr->mr && (errno == EOPNOTSUPP || errno == EPROTONOSUPPORT))
                        r = errmsg_set(
                                errmsg, -EOPNOTSUPP,
                                "transport verbs %s: %s: this device or kernel cannot register dma-buf "
                                "memory (ibv_reg_dmabuf_mr on fd %d: %s): use a transport that reads "
                                "host memory (fabric tcp)",
                                tp->dev, name, mem->fd, strerror(errno));
                else if (!mr->mr)
                        r = errmsg_set(errmsg, -errno,
                                       "transport verbs %s: %s: ibv_reg_dmabuf_mr(fd %d, %" PRIu64
                                       " bytes at %" PRIu64 "): %s",
                                       tp->dev, name, mem->fd, mem->length, mem->offset, strerror(errno));
                if (!mr->mr)
                        goto err_mr;
        }
        if (!mr->mr) {
                mr->mr = ibv_reg_mr(tp->pd, mr->addr, mem->length, access);
                if (!mr->mr) {
                        r = errmsg_set(errmsg, -errno,
                                       "transport verbs %s: %s (%s, %" PRIu64 " bytes): ibv_reg_mr: %s",
                                       tp->dev, name, tp_mem_kind_to_string(mem->kind), mem->length,
                                       strerror(errno));
                        goto err_map;
                }
        }
        mr->base = (uint64_t)(uintptr_t)mr->addr;
        *ret = mr;
        return 0;

err_map:
        tp_mem_unmap(mr->map, mr->length);
err_mr:
        free(mr);
        return r;
}

static void verbs_mr_free(struct tp *tp, struct tp_mr *mr) {
        (void)tp;
        if (!mr)
                return;
        ibv_dereg_mr(mr->mr);
        tp_mem_unmap(mr->map, mr->length);
        free(mr);
}

static void verbs_mr_rkey(const struct tp_mr *mr, struct tp_rkey *ret) {
        ret->base = mr->base;
        ret->key = mr->mr->rkey;
        ret->length = mr->length;
}

static void *verbs_mr_addr(const struct tp_mr *mr) {
        return mr->addr;
}

static int verbs_peer_new(struct tp *tp, uint32_t peer, void *ret_blob, size_t *ret_len, char *errmsg) {
        struct ibv_qp_init_attr init = { 0 };
        struct ibv_qp_attr attr = { 0 };
        struct verbs_blob blob = { 0 };
        struct ibv_qp *qp;

        if (peer >= TP_MAX_PEERS || tp->qps[peer])
                return errmsg_set(errmsg, -EINVAL, "transport verbs %s: peer %u: not a free index", tp->dev,
                                  peer);
        init.send_cq = tp->cq;
        init.recv_cq = tp->cq;
        init.cap.max_send_wr = tp->depth;
        init.cap.max_recv_wr = tp->depth;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.qp_type = IBV_QPT_RC;
        init.sq_sig_all = 1;
        qp = ibv_create_qp(tp->pd, &init);
        if (!qp)
                return errmsg_set(errmsg, -errno, "transport verbs %s: peer %u: ibv_create_qp: %s", tp->dev,
                                  peer, strerror(errno));
        attr.qp_state = IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = tp->port;
        attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
        if (ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
                int r = -errno;

                ibv_destroy_qp(qp);
                return errmsg_set(errmsg, r, "transport verbs %s: peer %u: QP to INIT: %s", tp->dev, peer,
                                  strerror(-r));
        }
        blob.magic = VERBS_BLOB_MAGIC;
        blob.qpn = qp->qp_num;
        blob.psn = (uint32_t)random() & 0xffffff;
        blob.lid = tp->port_attr.lid;
        blob.mtu = (uint8_t)tp->port_attr.active_mtu;
        memcpy(blob.gid, tp->gid.raw, 16);
        tp->qps[peer] = qp;
        tp->psn[peer] = blob.psn;
        tp->connected[peer] = false;
        memcpy(ret_blob, &blob, sizeof(blob));
        *ret_len = sizeof(blob);
        return 0;
}

static int verbs_peer_connect(struct tp *tp, uint32_t peer, const void *blobp, size_t len, char *errmsg) {
        struct ibv_qp_attr attr = { 0 };
        struct verbs_blob blob;
        int r;

        if (peer >= TP_MAX_PEERS || !tp->qps[peer] || len != sizeof(blob))
                return errmsg_set(errmsg, -EINVAL,
                                  "transport verbs %s: peer %u: bad address blob (%zu bytes)", tp->dev, peer,
                                  len);
        if (tp->connected[peer])
                return errmsg_set(errmsg, -EALREADY, "transport verbs %s: peer %u: already connected",
                                  tp->dev, peer);
        memcpy(&blob, blobp, sizeof(blob));
        if (blob.magic != VERBS_BLOB_MAGIC)
                return errmsg_set(errmsg, -EINVAL, "transport verbs %s: peer %u: address blob has bad magic",
                                  tp->dev, peer);
        attr.qp_state = IBV_QPS_RTR;
        attr.path_mtu =
                blob.mtu < tp->port_attr.active_mtu ? (enum ibv_mtu)blob.mtu : tp->port_attr.active_mtu;
        attr.dest_qp_num = blob.qpn;
        attr.rq_psn = blob.psn;
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = blob.lid;
        attr.ah_attr.port_num = tp->port;
        if (tp->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET || blob.lid == 0) {
                attr.ah_attr.is_global = 1;
                memcpy(attr.ah_attr.grh.dgid.raw, blob.gid, 16);
                attr.ah_attr.grh.sgid_index = (uint8_t)tp->gid_index;
                attr.ah_attr.grh.hop_limit = 1;
        }
        r = ibv_modify_qp(tp->qps[peer], &attr,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
        if (r)
                return errmsg_set(errmsg, -r, "transport verbs %s: peer %u (qpn %u): QP to RTR: %s", tp->dev,
                                  peer, blob.qpn, strerror(r));
        attr.qp_state = IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.sq_psn = tp->psn[peer]; /* the PSN our blob told the peer to expect */
        attr.max_rd_atomic = 1;
        r = ibv_modify_qp(tp->qps[peer], &attr,
                          IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
        if (r)
                return errmsg_set(errmsg, -r, "transport verbs %s: peer %u (qpn %u): QP to RTS: %s", tp->dev,
                                  peer, blob.qpn, strerror(r));
        tp->connected[peer] = true;
        return 0;
}

/* The QP goes to the error state: the writes posted on it complete at
 * once, flushed (IBV_WC_WR_FLUSH_ERR), so the proxy's drain ends without
 * waiting out its timeout, and the NIC reads nothing more for it. */
static void verbs_peer_fail(struct tp *tp, uint32_t peer) {
        struct ibv_qp_attr attr = { .qp_state = IBV_QPS_ERR };

        if (peer < TP_MAX_PEERS && tp->qps[peer])
                ibv_modify_qp(tp->qps[peer], &attr, IBV_QP_STATE);
}

/* The QP goes, and with it what the NIC holds for it. Completions of its
 * writes already in the shared CQ stay there; the proxy ignores them. */
static void verbs_peer_free(struct tp *tp, uint32_t peer) {
        if (peer >= TP_MAX_PEERS || !tp->qps[peer])
                return;
        if (ibv_destroy_qp(tp->qps[peer]))
                log_warn("transport verbs %s: peer %u: ibv_destroy_qp failed: %s", tp->dev, peer,
                         strerror(errno));
        tp->qps[peer] = NULL;
        tp->connected[peer] = false;
}

static int verbs_write(struct tp *tp, uint32_t peer, struct tp_mr *src, uint64_t src_off,
                       const struct tp_rkey *dst, uint64_t dst_off, uint64_t len, uint64_t cookie,
                       uint64_t imm, unsigned flags) {
        struct ibv_sge sge;
        struct ibv_send_wr wr = { 0 }, *bad;
        int r;

        if (peer >= TP_MAX_PEERS || !tp->connected[peer])
                return -ENOTCONN;
        if (!tp_range_ok(src->length, src_off, dst->length, dst_off, len) || len > UINT32_MAX)
                return -EINVAL;
        sge.addr = (uint64_t)(uintptr_t)src->addr + src_off;
        sge.length = (uint32_t)len;
        sge.lkey = src->mr->lkey;
        wr.wr_id = cookie;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.opcode = (flags & TP_WRITE_IMM) ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.imm_data = (uint32_t)imm;
        wr.wr.rdma.remote_addr = dst->base + dst_off;
        wr.wr.rdma.rkey = (uint32_t)dst->key;
        r = ibv_post_send(tp->qps[peer], &wr, &bad);
        return r == ENOMEM ? -EAGAIN : -r;
}

static int verbs_poll(struct tp *tp, struct tp_completion *out, int max) {
        struct ibv_wc wc[64];
        int n;

        if (max > 64)
                max = 64;
        n = ibv_poll_cq(tp->cq, max, wc);
        if (n < 0)
                return -EIO;
        for (int i = 0; i < n; i++) {
                bool remote = wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM;

                out[i].cookie = remote ? wc[i].imm_data : wc[i].wr_id;
                out[i].status = wc[i].status == IBV_WC_SUCCESS         ? 0
                                : wc[i].status == IBV_WC_RETRY_EXC_ERR ? -ETIMEDOUT
                                                                       : -ECONNRESET;
                out[i].remote = remote;
                out[i].peer = UINT32_MAX;
        }
        return n;
}

const struct tp_ops tp_verbs_ops = {
        .name = "verbs",
        .open = verbs_open,
        .close = verbs_close,
        .mr_new = verbs_mr_new,
        .mr_free = verbs_mr_free,
        .mr_rkey = verbs_mr_rkey,
        .mr_addr = verbs_mr_addr,
        .peer_new = verbs_peer_new,
        .peer_connect = verbs_peer_connect,
        .write = verbs_write,
        .poll = verbs_poll,
        .peer_fail = verbs_peer_fail,
        .peer_free = verbs_peer_free,
};
