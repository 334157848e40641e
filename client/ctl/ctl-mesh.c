/* moeepctl mesh (admin socket): the peer daemons of the internode mesh
 * (MeshList, protocol 1.2): their state, round-trip time and the jobs
 * spanning them. */
#include <stdio.h>

#include "ctl.h"

#define MESH_OFF "internode mesh off: mesh_listen is not set in this moeepd's configuration"
#define NO_KEY "no cluster key loaded (cluster_key_file): every peer daemon is refused"
#define NO_PEERS "no peer daemons yet: none configured in mesh_peers and none connected"

static const struct ctl_column columns[] = {
        { "PEER", "address", CTL_STRING },   { "STATE", "state", CTL_STRING },
        { "DIALLED", "outbound", CTL_BOOL }, { "RTT_US", "rtt_us", CTL_UINT },
        { "JOBS", "jobs", CTL_UINT },
};

int ctl_mesh(struct ctl *ctl) {
        Moeep__V1__MeshList list = MOEEP__V1__MESH_LIST__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        const Moeep__V1__Mesh *m;
        const char *note = "";
        struct ctl_table t;
        int r = 0;

        if (!(client_features(ctl->client) & MOEEP__V1__FEATURE__FEATURE_MESH)) {
                fprintf(stderr,
                        "moeepctl: moeepd %s at %s does not offer 'mesh' (it needs protocol 1.2 or later)\n",
                        client_daemon_version(ctl->client), client_socket_path(ctl->client));
                return 1;
        }
        req.body_case = MOEEP__V1__REQUEST__BODY_MESH_LIST;
        req.mesh_list = &list;
        if (ctl_query(ctl, &req, MOEEP__V1__RESPONSE__BODY_MESH, &resp) < 0) {
                ctl_admin_hint(ctl);
                return 1;
        }
        m = resp->mesh;
        ctl_table_init(&t, columns, sizeof(columns) / sizeof(columns[0]));
        for (size_t i = 0; i < m->n_peers && r >= 0; i++)
                r = ctl_table_add(&t, (const struct ctl_value[]){
                                              { .s = m->peers[i]->address },
                                              { .s = m->peers[i]->state },
                                              { .u = m->peers[i]->outbound },
                                              { .u = m->peers[i]->rtt_us },
                                              { .u = m->peers[i]->jobs },
                                      });
        if (!m->enabled)
                note = MESH_OFF;
        else if (!m->keyed)
                note = NO_KEY;
        else if (m->n_peers == 0)
                note = NO_PEERS;
        if (r < 0) {
                fprintf(stderr, "moeepctl: out of memory formatting the mesh table\n");
        } else if (ctl->json) {
                fputs("{\"configured\": ", stdout);
                fputs(m->enabled ? "true" : "false", stdout);
                fputs(", \"address\": ", stdout);
                ctl_json_string(stdout, m->address);
                fputs(", \"keyed\": ", stdout);
                fputs(m->keyed ? "true" : "false", stdout);
                fputs(", \"peers\": ", stdout);
                ctl_table_print_json(&t, stdout);
                fputs(", \"note\": ", stdout);
                ctl_json_string(stdout, note);
                fputs("}\n", stdout);
        } else {
                if (m->enabled)
                        printf("mesh address: %s\n\n", m->address);
                ctl_table_print_list(&t, false, stdout);
                if (note[0])
                        ctl_note("%s", note);
        }
        ctl_table_done(&t);
        moeep__v1__response__free_unpacked(resp, NULL);
        return r < 0 ? 1 : 0;
}
