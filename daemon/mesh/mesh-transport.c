/* Each mesh connection's transport peer: when a connection to a daemon
 * comes up, the local half of a transport connection to it is made and its
 * address goes out in PeerTransport; the peer's answer connects it. The
 * data path is reached only through the hooks given at mesh_start()
 * (struct mesh_transport_hooks, filled by daemon.c), never included. */
#include <errno.h>
#include <inttypes.h>
#include <string.h>

#include "datapath/transport.h"
#include "log.h"
#include "mesh/mesh-internal.h"
#include "mesh/mesh.h"

/* The connection is up: makes our half of a transport connection to that
 * daemon and sends its address. Peers older than 1.3 would refuse the
 * message, and a daemon without a data path has nothing to offer. */
void mesh_transport_offer(struct mesh_peer *p) {
        const struct mesh_transport_hooks *tp = &p->mesh->transport;
        Moeep__V1__PeerTransport pt = MOEEP__V1__PEER_TRANSPORT__INIT;
        PEER_MSG(msg, transport, &pt, TRANSPORT);
        char errmsg[ERRMSG_MAX] = "";
        uint8_t blob[TP_ADDR_MAX];
        size_t len = 0;

        if (p->minor < 3 || !tp->up(tp->dp, NULL))
                return;
        if (tp->peer_new(tp->dp, &p->tp_peer, blob, &len, errmsg) < 0) {
                log_warn("mesh: peer %s: no transport connection: %s", p->address, errmsg);
                return;
        }
        pt.backend = (char *)tp->backend(tp->dp);
        pt.address.data = blob;
        pt.address.len = len;
        mesh_peer_send(p, &msg);
}

void mesh_transport_handle(struct mesh_peer *p, const Moeep__V1__PeerTransport *pt) {
        const struct mesh_transport_hooks *tp = &p->mesh->transport;
        char errmsg[ERRMSG_MAX] = "";

        if (p->tp_peer == MESH_NO_TP_PEER || p->tp_connected) {
                log_debug("mesh: peer %s: PeerTransport ignored (%s)", p->address,
                          p->tp_connected ? "already connected" : "this daemon has no data path");
                return;
        }
        if (!pt->backend || strcmp(pt->backend, tp->backend(tp->dp)) != 0) {
                log_warn("mesh: peer %s: its transport is '%.32s', ours '%s': no internode data path with it",
                         p->address, pt->backend ? pt->backend : "", tp->backend(tp->dp));
                return;
        }
        if (pt->address.len == 0 || pt->address.len > TP_ADDR_MAX ||
            tp->peer_connect(tp->dp, p->tp_peer, pt->address.data, pt->address.len, errmsg) < 0) {
                log_warn("mesh: peer %s: transport address of %zu bytes refused: %s", p->address,
                         pt->address.len, errmsg[0] ? errmsg : "bad length");
                return;
        }
        p->tp_connected = true;
        log_info("mesh: peer %s: transport connected (transport peer %" PRIu32 ")", p->address, p->tp_peer);
}

bool mesh_transport_drop(struct mesh_peer *p, bool fail) {
        bool was = p->tp_connected;

        if (p->tp_peer != MESH_NO_TP_PEER && fail)
                p->mesh->transport.peer_fail(p->mesh->transport.dp, p->tp_peer, -ECONNRESET);
        p->tp_peer = MESH_NO_TP_PEER;
        p->tp_connected = false;
        return was;
}

int mesh_transport_peer(const struct mesh *mesh, const char *address, uint32_t *ret_tp_peer) {
        struct mesh_peer *p = mesh ? mesh_peer_find(mesh, address) : NULL;

        if (!p)
                return -ENOTCONN;
        if (!p->tp_connected)
                return -ENODEV;
        *ret_tp_peer = p->tp_peer;
        return 0;
}

void mesh_transport_failed(struct mesh *mesh, uint32_t tp_peer, const char *why) {
        struct mesh_peer *p;

        if (!mesh)
                return;
        TAILQ_FOREACH (p, &mesh->peers, entry)
                if (p->state == MESH_PEER_UP && p->tp_peer == tp_peer) {
                        mesh_peer_fail(p, false, "its transport connection failed: %s", why);
                        return;
                }
}
