/* libmoeep control plane: regions (register, fetch, release) and the
 * internode proxy path's regions and channel (client-internal.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "client-handle.h"

/* Returns the protocol's kind, or REGION_KIND_UNSPECIFIED for a value that
 * is not one of ours (the caller's int may hold anything). */
static Moeep__V1__RegionKind region_kind_to_proto(enum moeep_region_kind kind) {
        switch (kind) {
        case MOEEP_REGION_CUMEM_FD:
                return MOEEP__V1__REGION_KIND__REGION_KIND_CUMEM_FD;
        case MOEEP_REGION_DMABUF:
                return MOEEP__V1__REGION_KIND__REGION_KIND_DMABUF;
        case MOEEP_REGION_MEMFD:
                return MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        }
        return MOEEP__V1__REGION_KIND__REGION_KIND_UNSPECIFIED;
}

/* RegionRegister of `fd` with proxy role `proxy` (PROXY_ROLE_NONE for an
 * ordinary region): attached to the record, or with `take` (1.4) named by
 * its number for the daemon to take from this process. */
static int region_register_call(struct moeep_client *c, int fd, Moeep__V1__RegionKind kind, uint64_t size,
                                uint32_t tag, Moeep__V1__ProxyRole proxy, bool take,
                                uint64_t *ret_region_id) {
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__TakeFd take_fd = MOEEP__V1__TAKE_FD__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        int r;

        if (fd < 0 || fcntl(fd, F_GETFD) < 0)
                return client_error_set(c, -EBADF, "region fd %d is not an open descriptor", fd);
        if (size == 0)
                return client_error_set(c, -EINVAL, "region size 0 (fd %d) is invalid", fd);
        if (take && !(c->features & MOEEP__V1__FEATURE__FEATURE_PIDFD))
                return client_error_set(c, -EOPNOTSUPP,
                                        "region register by fd number: moeepd %s at %s does not offer it "
                                        "(it needs protocol 1.4)",
                                        c->daemon_version, c->socket_path);
        r = client_require_job(c, "region register");
        if (r < 0)
                return r;

        rr.kind = kind;
        rr.size = size;
        rr.tag = tag;
        rr.proxy = proxy;
        if (take) {
                take_fd.fd_number = fd;
                rr.take = &take_fd;
        }
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED, take ? NULL : &fd, take ? 0 : 1,
                        &resp);
        if (r < 0)
                return r;
        if (ret_region_id)
                *ret_region_id = resp->region_registered->region_id;
        moeep__v1__response__free_unpacked(resp, NULL);
        return 0;
}

static int region_register(struct moeep_client *c, int fd, enum moeep_region_kind kind, uint64_t size,
                           uint32_t tag, bool take, uint64_t *ret_region_id) {
        Moeep__V1__RegionKind k = region_kind_to_proto(kind);

        if (!c)
                return -EINVAL;
        if (k == MOEEP__V1__REGION_KIND__REGION_KIND_UNSPECIFIED)
                return client_error_set(c, -EINVAL, "region kind %d is unknown", (int)kind);
        return region_register_call(c, fd, k, size, tag, MOEEP__V1__PROXY_ROLE__PROXY_ROLE_NONE, take,
                                    ret_region_id);
}

int moeep_region_register(struct moeep_client *c, int fd, enum moeep_region_kind kind, uint64_t size,
                          uint32_t tag, uint64_t *ret_region_id) {
        return region_register(c, fd, kind, size, tag, false, ret_region_id);
}

int moeep_region_register_pidfd(struct moeep_client *c, int fd_number, enum moeep_region_kind kind,
                                uint64_t size, uint32_t tag, uint64_t *ret_region_id) {
        return region_register(c, fd_number, kind, size, tag, true, ret_region_id);
}

/* The daemon takes proxy regions and channels only after agreeing on
 * FEATURE_PROXY (protocol 1.3). */
static int client_require_proxy(struct moeep_client *c, const char *what) {
        if (!(c->features & MOEEP__V1__FEATURE__FEATURE_PROXY))
                return client_error_set(c, -EOPNOTSUPP,
                                        "%s: moeepd %s at %s does not offer the internode proxy path "
                                        "(it needs protocol 1.3)",
                                        what, c->daemon_version, c->socket_path);
        return 0;
}

static int proxy_region_register(struct moeep_client *c, int fd, Moeep__V1__RegionKind kind, uint64_t size,
                                 enum moeep_proxy_role role, uint32_t tag, uint64_t *ret_region_id) {
        Moeep__V1__ProxyRole proxy;
        int r;

        if (!c)
                return -EINVAL;
        switch (role) {
        case MOEEP_PROXY_SEND:
                proxy = MOEEP__V1__PROXY_ROLE__PROXY_ROLE_SEND;
                break;
        case MOEEP_PROXY_RECV:
                proxy = MOEEP__V1__PROXY_ROLE__PROXY_ROLE_RECV;
                break;
        case MOEEP_PROXY_COUNTERS:
                proxy = MOEEP__V1__PROXY_ROLE__PROXY_ROLE_COUNTERS;
                break;
        default: /* the caller's int may hold anything */
                return client_error_set(c, -EINVAL, "proxy role %d is unknown", (int)role);
        }
        r = client_require_proxy(c, "proxy region register");
        if (r < 0)
                return r;
        return region_register_call(c, fd, kind, size, tag, proxy, false, ret_region_id);
}

int client_proxy_region_register(struct moeep_client *c, int memfd, uint64_t size, enum moeep_proxy_role role,
                                 uint32_t tag, uint64_t *ret_region_id) {
        return proxy_region_register(c, memfd, MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD, size, role, tag,
                                     ret_region_id);
}

int client_proxy_region_register_gpu(struct moeep_client *c, int fd, uint64_t size,
                                     enum moeep_proxy_role role, uint32_t tag, uint64_t *ret_region_id) {
        return proxy_region_register(c, fd, MOEEP__V1__REGION_KIND__REGION_KIND_CUMEM_FD, size, role, tag,
                                     ret_region_id);
}

int client_proxy_region_register_dmabuf(struct moeep_client *c, int fd, uint64_t size,
                                        enum moeep_proxy_role role, uint32_t tag, uint64_t *ret_region_id) {
        return proxy_region_register(c, fd, MOEEP__V1__REGION_KIND__REGION_KIND_DMABUF, size, role, tag,
                                     ret_region_id);
}

int client_proxy_channel_open(struct moeep_client *c, uint32_t capacity, int *ret_ring_fd,
                              uint64_t *ret_ring_id, uint32_t *ret_capacity) {
        Moeep__V1__ChannelOpen co = MOEEP__V1__CHANNEL_OPEN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        size_t nfds = 0;
        int *fds, r;

        if (!c || !ret_ring_fd)
                return -EINVAL;
        r = client_require_proxy(c, "channel open");
        if (r == 0)
                r = client_require_job(c, "channel open");
        if (r < 0)
                return r;
        co.capacity = capacity;
        req.body_case = MOEEP__V1__REQUEST__BODY_CHANNEL_OPEN;
        req.channel_open = &co;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_CHANNEL_OPENED, NULL, 0, &resp);
        if (r < 0)
                return r;
        fds = client_reply_fds(c, &nfds);
        if (nfds != 1 || fds[0] < 0) {
                moeep__v1__response__free_unpacked(resp, NULL);
                return client_error_set(c, -EPROTO, "channel open: the reply carried %zu ring fds, not 1",
                                        nfds);
        }
        *ret_ring_fd = fds[0];
        fds[0] = -1; /* ours now */
        if (ret_ring_id)
                *ret_ring_id = resp->channel_opened->ring_id;
        if (ret_capacity)
                *ret_capacity = resp->channel_opened->capacity;
        moeep__v1__response__free_unpacked(resp, NULL);
        return 0;
}

int moeep_region_release(struct moeep_client *c, uint64_t region_id) {
        Moeep__V1__RegionRelease rr = MOEEP__V1__REGION_RELEASE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        int r;

        if (!c)
                return -EINVAL;
        r = client_require_job(c, "region release");
        if (r < 0)
                return r;
        rr.region_id = region_id;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_RELEASE;
        req.region_release = &rr;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_OK, NULL, 0, &resp);
        if (r < 0)
                return r;
        moeep__v1__response__free_unpacked(resp, NULL);
        return 0;
}

static int region_kind_from_proto(Moeep__V1__RegionKind kind, enum moeep_region_kind *ret_kind) {
        switch (kind) {
        case MOEEP__V1__REGION_KIND__REGION_KIND_CUMEM_FD:
                *ret_kind = MOEEP_REGION_CUMEM_FD;
                return 0;
        case MOEEP__V1__REGION_KIND__REGION_KIND_DMABUF:
                *ret_kind = MOEEP_REGION_DMABUF;
                return 0;
        case MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD:
                *ret_kind = MOEEP_REGION_MEMFD;
                return 0;
        case MOEEP__V1__REGION_KIND__REGION_KIND_UNSPECIFIED:
        case _MOEEP__V1__REGION_KIND_IS_INT_SIZE:
                break;
        }
        return -EPROTO;
}

int moeep_regions_fetch(struct moeep_client *c, int rank, int64_t tag, struct moeep_region **ret_regions,
                        size_t *ret_count) {
        Moeep__V1__RegionsFetch rf = MOEEP__V1__REGIONS_FETCH__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        struct moeep_region *regions = NULL;
        Moeep__V1__Response *resp;
        Moeep__V1__Regions *m;
        size_t nfds, nlocal = 0;
        int *fds, r;

        if (!c)
                return -EINVAL;
        if (!ret_regions || !ret_count)
                return client_error_set(c, -EINVAL, "regions fetch: %s is NULL",
                                        !ret_regions ? "ret_regions" : "ret_count");
        if (tag < -1 || tag > UINT32_MAX)
                return client_error_set(c, -EINVAL, "region tag %lld is out of range (-1..%u)",
                                        (long long)tag, UINT32_MAX);
        r = client_require_job(c, "regions fetch");
        if (r < 0)
                return r;
        if (rank < -1 || rank >= c->world_size)
                return client_error_set(c, -ERANGE, "rank %d is out of range (-1..%d)", rank,
                                        c->world_size - 1);

        rf.rank = rank;
        rf.tag = tag;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGIONS_FETCH;
        req.regions_fetch = &rf;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_REGIONS, NULL, 0, &resp);
        if (r < 0)
                return r;
        m = resp->regions;
        fds = client_reply_fds(c, &nfds);
        for (size_t i = 0; i < m->n_regions; i++)
                nlocal += !m->regions[i]->remote;
        if (nlocal != nfds) {
                r = client_error_set(c, -EPROTO,
                                     "moeepd sent %zu regions of local ranks with %zu descriptors", nlocal,
                                     nfds);
                goto out;
        }
        /* At least one element, so that success never returns NULL. */
        regions = calloc(m->n_regions ? m->n_regions : 1, sizeof(*regions));
        if (!regions) {
                r = client_error_set(c, -ENOMEM, "out of memory for %zu regions", m->n_regions);
                goto out;
        }
        for (size_t i = 0; i < m->n_regions; i++) {
                const Moeep__V1__RegionInfo *ri = m->regions[i];

                r = region_kind_from_proto(ri->kind, &regions[i].kind);
                if (r < 0) {
                        client_error_set(c, r, "moeepd sent region %llu of unknown kind %d",
                                         (unsigned long long)ri->region_id, (int)ri->kind);
                        goto out;
                }
                regions[i].rank = (int)ri->rank;
                regions[i].tag = ri->tag;
                regions[i].size = ri->size;
                regions[i].id = ri->region_id;
        }
        /* Only now that nothing can fail: the fds move to the caller, in
         * order, to the regions of local ranks; remote ranks' get -1. */
        for (size_t i = 0, k = 0; i < m->n_regions; i++) {
                regions[i].fd = -1;
                if (m->regions[i]->remote)
                        continue;
                regions[i].fd = fds[k];
                fds[k++] = -1;
        }
        *ret_regions = regions;
        *ret_count = m->n_regions;
        regions = NULL;
        r = 0;
out:
        free(regions);
        moeep__v1__response__free_unpacked(resp, NULL);
        moeep_record_release(c->rec);
        return r;
}

void moeep_regions_free(struct moeep_region *regions, size_t count) {
        if (!regions)
                return;
        for (size_t i = 0; i < count; i++)
                if (regions[i].fd >= 0)
                        close(regions[i].fd);
        free(regions);
}
