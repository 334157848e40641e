/* tp-fabric: the libfabric backend (transport.h). One RDM endpoint per
 * transport, FI_RMA writes, one CQ, one AV; the provider comes from the
 * configuration: "efa" or "verbs" in production, "tcp" (tcp;ofi_rxm) for
 * tests on loopback. Objects are created in order in fabric_open and
 * unwound in reverse through one label ladder, as fabtests do.
 *
 * Memory-registration modes are taken as the provider returns them:
 * FI_MR_VIRT_ADDR decides whether the wire address of a region is its
 * virtual address or 0, FI_MR_PROV_KEY whether we pick keys, FI_MR_LOCAL
 * whether writes pass descriptors. Ordering: when the provider orders
 * write-after-write (FI_ORDER_WAW in tx_attr->msg_order, as tcp;ofi_rxm
 * and efa do) an ordered write is an ordinary one; otherwise it carries
 * FI_FENCE. Completion: on tcp a write asks for FI_DELIVERY_COMPLETE, so
 * that a write the target refuses (a deregistered region) completes with
 * an error instead of "done" (see fabric_open). */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "datapath/transport.h"
#include "log.h"

#define FABRIC_VERSION FI_VERSION(1, 14)

struct tp_mr {
        struct fid_mr *mr; /* owns */
        void *desc;        /* fi_mr_desc(mr), for FI_MR_LOCAL providers */
        void *addr;        /* host address of offset 0, NULL for device memory */
        uint64_t length;
        uint64_t base; /* wire address of offset 0 */
        uint64_t key;
        void *map; /* owns when not NULL: our mmap of a memfd */
};

struct tp {
        char prov[64];             /* provider name, for messages */
        char who[96];              /* "transport fabric 'PROV'", for messages */
        struct fi_info *info;      /* owns */
        struct fid_fabric *fabric; /* owns */
        struct fid_domain *domain; /* owns */
        struct fid_cq *cq;         /* owns */
        struct fid_av *av;         /* owns */
        struct fid_ep *ep;         /* owns */
        char name[TP_ADDR_MAX];    /* our endpoint name */
        size_t name_len;
        bool virt_addr, prov_key, local_mr, waw;
        uint64_t complete; /* FI_DELIVERY_COMPLETE where completions are local (tcp), else 0 */
        uint64_t
                next_key; /* next requested_key when !prov_key; taken atomically (mr_new runs on any thread) */
        bool *used;       /* owns; TP_MAX_PEERS: in use (peer_new .. peer_free) */
        fi_addr_t *peers; /* owns; TP_MAX_PEERS: its AV entry, FI_ADDR_NOTAVAIL until connected */
};

static int fabric_open(const struct tp_config *cfg, struct tp **ret, char *errmsg) {
        const char *prov = cfg->provider && cfg->provider[0] ? cfg->provider : "tcp";
        struct fi_info *hints = NULL;
        struct fi_cq_attr cq_attr = { 0 };
        struct fi_av_attr av_attr = { 0 };
        struct tp *tp;
        int r;

        tp = calloc(1, sizeof(*tp));
        if (!tp || !(tp->peers = calloc(TP_MAX_PEERS, sizeof(*tp->peers))) ||
            !(tp->used = calloc(TP_MAX_PEERS, sizeof(*tp->used)))) {
                r = errmsg_set(errmsg, -ENOMEM, "transport fabric: out of memory");
                goto err_tp;
        }
        for (uint32_t i = 0; i < TP_MAX_PEERS; i++)
                tp->peers[i] = FI_ADDR_NOTAVAIL;
        snprintf(tp->prov, sizeof(tp->prov), "%s", prov);
        snprintf(tp->who, sizeof(tp->who), "transport fabric '%s'", tp->prov);
        hints = fi_allocinfo();
        if (!hints) {
                r = errmsg_set(errmsg, -ENOMEM, "transport fabric: out of memory");
                goto err_tp;
        }
        hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
        hints->ep_attr->type = FI_EP_RDM;
        hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
        hints->domain_attr->threading = FI_THREAD_SAFE;
        hints->fabric_attr->prov_name = strdup(prov);
        if (cfg->device && cfg->device[0])
                hints->domain_attr->name = strdup(cfg->device);
        hints->tx_attr->size = cfg->queue_depth ? cfg->queue_depth : 1024;
        r = fi_getinfo(FABRIC_VERSION, cfg->node, NULL, cfg->node ? FI_SOURCE : 0, hints, &tp->info);
        if (r) {
                r = errmsg_set(errmsg, r == -FI_ENODATA ? -ENODEV : r,
                               "transport fabric: provider '%s' domain '%s' node '%s': %s", prov,
                               cfg->device ? cfg->device : "", cfg->node ? cfg->node : "", fi_strerror(-r));
                goto err_hints;
        }
        tp->virt_addr = tp->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR;
        tp->prov_key = tp->info->domain_attr->mr_mode & FI_MR_PROV_KEY;
        tp->local_mr = tp->info->domain_attr->mr_mode & FI_MR_LOCAL;
        tp->waw = tp->info->tx_attr->msg_order & FI_ORDER_WAW;
        /* tcp (and sockets) complete a write once it is on the socket:
         * the target checks the key later, and a write into a region it
         * already deregistered was reported done while it landed nowhere.
         * Asking for delivery completion makes the target's refusal our
         * error completion, which fails the peer as docs/protocol.md says.
         * Hardware providers (efa, verbs) complete after the remote NIC
         * accepted the write, key checked, so they keep the cheaper
         * default. */
        if (strncmp(tp->info->fabric_attr->prov_name, "tcp", 3) == 0 ||
            strncmp(tp->info->fabric_attr->prov_name, "sockets", 7) == 0)
                tp->complete = FI_DELIVERY_COMPLETE;
        tp->next_key = 1;

        r = fi_fabric(tp->info->fabric_attr, &tp->fabric, NULL);
        if (r) {
                r = errmsg_set(errmsg, r, "transport fabric: provider '%s': fi_fabric: %s", prov,
                               fi_strerror(-r));
                goto err_info;
        }
        r = fi_domain(tp->fabric, tp->info, &tp->domain, NULL);
        if (r) {
                r = errmsg_set(errmsg, r, "transport fabric: provider '%s' domain '%s': fi_domain: %s", prov,
                               tp->info->domain_attr->name, fi_strerror(-r));
                goto err_fabric;
        }
        cq_attr.format = FI_CQ_FORMAT_DATA;
        cq_attr.size = 4 * hints->tx_attr->size;
        r = fi_cq_open(tp->domain, &cq_attr, &tp->cq, NULL);
        if (r) {
                r = errmsg_set(errmsg, r, "transport fabric: provider '%s': fi_cq_open: %s", prov,
                               fi_strerror(-r));
                goto err_domain;
        }
        av_attr.type = FI_AV_TABLE;
        r = fi_av_open(tp->domain, &av_attr, &tp->av, NULL);
        if (r) {
                r = errmsg_set(errmsg, r, "transport fabric: provider '%s': fi_av_open: %s", prov,
                               fi_strerror(-r));
                goto err_cq;
        }
        r = fi_endpoint(tp->domain, tp->info, &tp->ep, NULL);
        if (r) {
                r = errmsg_set(errmsg, r, "transport fabric: provider '%s': fi_endpoint: %s", prov,
                               fi_strerror(-r));
                goto err_av;
        }
        r = fi_ep_bind(tp->ep, &tp->cq->fid, FI_TRANSMIT | FI_RECV);
        if (!r)
                r = fi_ep_bind(tp->ep, &tp->av->fid, 0);
        if (!r)
                r = fi_enable(tp->ep);
        if (r) {
                r = errmsg_set(errmsg, r, "transport fabric: provider '%s': endpoint bind/enable: %s", prov,
                               fi_strerror(-r));
                goto err_ep;
        }
        tp->name_len = sizeof(tp->name);
        r = fi_getname(&tp->ep->fid, tp->name, &tp->name_len);
        if (r) {
                r = errmsg_set(errmsg, r, "transport fabric: provider '%s': fi_getname: %s", prov,
                               fi_strerror(-r));
                goto err_ep;
        }
        fi_freeinfo(hints);
        *ret = tp;
        return 0;

err_ep:
        fi_close(&tp->ep->fid);
err_av:
        fi_close(&tp->av->fid);
err_cq:
        fi_close(&tp->cq->fid);
err_domain:
        fi_close(&tp->domain->fid);
err_fabric:
        fi_close(&tp->fabric->fid);
err_info:
        fi_freeinfo(tp->info);
err_hints:
        fi_freeinfo(hints);
err_tp:
        if (tp) {
                free(tp->peers);
                free(tp->used);
        }
        free(tp);
        return r;
}

static void fabric_close(struct tp *tp) {
        if (!tp)
                return;
        fi_close(&tp->ep->fid);
        fi_close(&tp->av->fid);
        fi_close(&tp->cq->fid);
        fi_close(&tp->domain->fid);
        fi_close(&tp->fabric->fid);
        fi_freeinfo(tp->info);
        free(tp->peers);
        free(tp->used);
        free(tp);
}

/* Runs on the checker threads of several uids at once (transport.h): the
 * domain is FI_THREAD_SAFE, and control calls such as fi_mr_reg are thread
 * safe in every threading model; our own state is the key counter. */
static int fabric_mr_new(struct tp *tp, const struct tp_mem *mem, struct tp_mr **ret, char *errmsg) {
        const char *name = mem->name ? mem->name : "region";
        uint64_t access = FI_WRITE | FI_REMOTE_WRITE;
        uint64_t key = __atomic_fetch_add(&tp->next_key, 1, __ATOMIC_RELAXED);
        struct tp_mr *mr;
        int r;

        mr = calloc(1, sizeof(*mr));
        if (!mr)
                return errmsg_set(errmsg, -ENOMEM, "transport fabric '%s': %s: out of memory", tp->prov,
                                  name);
        if (mem->kind == TP_MEM_CUMEM) {
                free(mr);
                return errmsg_set(errmsg, -EOPNOTSUPP,
                                  "transport fabric '%s': %s: a cuMem fd needs a CUDA context to import; "
                                  "register GPU memory as a dma-buf",
                                  tp->prov, name);
        }
        mr->length = mem->length;
        r = tp_mem_map(mem, tp->who, &mr->addr, &mr->map, errmsg);
        if (r < 0)
                goto err_mr;
        if (mem->kind == TP_MEM_DMABUF) {
#ifdef FI_MR_DMABUF
                {
                        struct fi_mr_dmabuf dmabuf = { .fd = mem->fd,
                                                       .offset = mem->offset,
                                                       .len = mem->length };
                        struct fi_mr_attr attr = { .dmabuf = &dmabuf,
                                                   .iov_count = 1,
                                                   .access = access,
                                                   .requested_key = key,
                                                   .iface = FI_HMEM_CUDA };

                        r = fi_mr_regattr(tp->domain, &attr, FI_MR_DMABUF, &mr->mr);
                        if (r) {
                                r = errmsg_set(errmsg, r, "transport fabric '%s': %s: dma-buf fd %d: %s",
                                               tp->prov, name, mem->fd, fi_strerror(-r));
                                goto err_mr;
                        }
                }
#else
                r = errmsg_set(errmsg, -EOPNOTSUPP,
                               "transport fabric '%s': %s: this libfabric (%u.%u) has no FI_MR_DMABUF",
                               tp->prov, name, FI_MAJOR(fi_version()), FI_MINOR(fi_version()));
                goto err_mr;
#endif
        }
        if (!mr->mr) {
                r = fi_mr_reg(tp->domain, mr->addr, mem->length, access, 0, key, 0, &mr->mr, NULL);
                if (r) {
                        r = errmsg_set(errmsg, r,
                                       "transport fabric '%s': %s (%s, %" PRIu64 " bytes): fi_mr_reg: %s",
                                       tp->prov, name, tp_mem_kind_to_string(mem->kind), mem->length,
                                       fi_strerror(-r));
                        goto err_map;
                }
        }
        mr->desc = fi_mr_desc(mr->mr);
        mr->key = fi_mr_key(mr->mr);
        mr->base = tp->virt_addr ? (uint64_t)(uintptr_t)mr->addr : 0;
        *ret = mr;
        return 0;

err_map:
        tp_mem_unmap(mr->map, mr->length);
err_mr:
        free(mr);
        return r;
}

static void fabric_mr_free(struct tp *tp, struct tp_mr *mr) {
        (void)tp;
        if (!mr)
                return;
        fi_close(&mr->mr->fid);
        tp_mem_unmap(mr->map, mr->length);
        free(mr);
}

static void fabric_mr_rkey(const struct tp_mr *mr, struct tp_rkey *ret) {
        ret->base = mr->base;
        ret->key = mr->key;
        ret->length = mr->length;
}

static void *fabric_mr_addr(const struct tp_mr *mr) {
        return mr->addr;
}

static int fabric_peer_new(struct tp *tp, uint32_t peer, void *ret_blob, size_t *ret_len, char *errmsg) {
        if (peer >= TP_MAX_PEERS || tp->used[peer])
                return errmsg_set(errmsg, -EINVAL, "transport fabric '%s': peer %u: not a free index",
                                  tp->prov, peer);
        tp->used[peer] = true;
        tp->peers[peer] = FI_ADDR_NOTAVAIL;
        memcpy(ret_blob, tp->name, tp->name_len);
        *ret_len = tp->name_len;
        return 0;
}

static int fabric_peer_connect(struct tp *tp, uint32_t peer, const void *blob, size_t len, char *errmsg) {
        fi_addr_t addr;
        int r;

        if (peer >= TP_MAX_PEERS || !tp->used[peer] || len == 0 || len > TP_ADDR_MAX)
                return errmsg_set(errmsg, -EINVAL,
                                  "transport fabric '%s': peer %u: bad address blob (%zu bytes)", tp->prov,
                                  peer, len);
        if (tp->peers[peer] != FI_ADDR_NOTAVAIL)
                return errmsg_set(errmsg, -EALREADY, "transport fabric '%s': peer %u: already connected",
                                  tp->prov, peer);
        r = fi_av_insert(tp->av, blob, 1, &addr, 0, NULL);
        if (r != 1)
                return errmsg_set(errmsg, r < 0 ? r : -EINVAL,
                                  "transport fabric '%s': peer %u: fi_av_insert: %s", tp->prov, peer,
                                  r < 0 ? fi_strerror(-r) : "address rejected");
        tp->peers[peer] = addr;
        return 0;
}

/* The AV entry goes (each insert is removed once: the provider counts
 * inserts of one address), and with it what the provider keeps for that
 * address when nothing else names it (ofi_rxm: the connection). */
static void fabric_peer_free(struct tp *tp, uint32_t peer) {
        if (peer >= TP_MAX_PEERS || !tp->used[peer])
                return;
        if (tp->peers[peer] != FI_ADDR_NOTAVAIL) {
                int r = fi_av_remove(tp->av, &tp->peers[peer], 1, 0);

                if (r)
                        log_warn("transport fabric '%s': peer %u: fi_av_remove: %s", tp->prov, peer,
                                 fi_strerror(-r));
        }
        tp->peers[peer] = FI_ADDR_NOTAVAIL;
        tp->used[peer] = false;
}

static int fabric_write(struct tp *tp, uint32_t peer, struct tp_mr *src, uint64_t src_off,
                        const struct tp_rkey *dst, uint64_t dst_off, uint64_t len, uint64_t cookie,
                        uint64_t imm, unsigned flags) {
        struct iovec iov;
        struct fi_rma_iov rma;
        struct fi_msg_rma msg = { 0 };
        uint64_t fl = FI_COMPLETION | tp->complete;
        ssize_t r;

        if (peer >= TP_MAX_PEERS || !tp->used[peer] || tp->peers[peer] == FI_ADDR_NOTAVAIL)
                return -ENOTCONN;
        if (!tp_range_ok(src->length, src_off, dst->length, dst_off, len))
                return -EINVAL;
        iov.iov_base = (char *)src->addr + src_off;
        iov.iov_len = len;
        rma.addr = dst->base + dst_off;
        rma.len = len;
        rma.key = dst->key;
        msg.msg_iov = &iov;
        msg.desc = &src->desc;
        msg.iov_count = 1;
        msg.addr = tp->peers[peer];
        msg.rma_iov = &rma;
        msg.rma_iov_count = 1;
        msg.context = (void *)(uintptr_t)cookie;
        if ((flags & TP_WRITE_ORDERED) && !tp->waw)
                fl |= FI_FENCE;
        if (flags & TP_WRITE_IMM) {
                msg.data = imm;
                fl |= FI_REMOTE_CQ_DATA;
        }
        r = fi_writemsg(tp->ep, &msg, fl);
        if (r == -FI_EAGAIN)
                return -EAGAIN;
        return (int)r;
}

static int fabric_poll(struct tp *tp, struct tp_completion *out, int max) {
        struct fi_cq_data_entry e[64];
        ssize_t n;
        int i;

        if (max > 64)
                max = 64;
        n = fi_cq_read(tp->cq, e, (size_t)max);
        if (n == -FI_EAGAIN)
                return 0;
        if (n == -FI_EAVAIL) {
                struct fi_cq_err_entry err = { 0 };

                if (fi_cq_readerr(tp->cq, &err, 0) != 1)
                        return 0;
                out[0].cookie = (uint64_t)(uintptr_t)err.op_context;
                out[0].status = err.err ? -err.err : -EIO;
                out[0].remote = 0;
                out[0].peer = UINT32_MAX;
                return 1;
        }
        if (n < 0)
                return (int)n;
        for (i = 0; i < n; i++) {
                bool remote = e[i].flags & FI_REMOTE_CQ_DATA;

                out[i].cookie = remote ? e[i].data : (uint64_t)(uintptr_t)e[i].op_context;
                out[i].status = 0;
                out[i].remote = remote;
                out[i].peer = UINT32_MAX;
        }
        return (int)n;
}

const struct tp_ops tp_fabric_ops = {
        .name = "fabric",
        .open = fabric_open,
        .close = fabric_close,
        .mr_new = fabric_mr_new,
        .mr_free = fabric_mr_free,
        .mr_rkey = fabric_mr_rkey,
        .mr_addr = fabric_mr_addr,
        .peer_new = fabric_peer_new,
        .peer_connect = fabric_peer_connect,
        .peer_free = fabric_peer_free,
        .write = fabric_write,
        .poll = fabric_poll,
};
