/* moeepctl mesh: the peer daemons of the internode mesh. moeepd has no
 * internode transport yet, so there is no mesh to ask about: the honest
 * answer is an empty table that says so. When the mesh lands it comes with
 * its own request and feature bit, and this file asks for it. */
#include <stdio.h>

#include "ctl.h"

#define NOT_CONFIGURED "internode mesh not configured: this moeepd has no internode transport yet"

static const struct ctl_column columns[] = {
        { "PEER", "peer", CTL_STRING },
        { "ADDRESS", "address", CTL_STRING },
        { "STATE", "state", CTL_STRING },
        { "LATENCY", "latency_us", CTL_UINT },
};

int ctl_mesh(struct ctl *ctl) {
        struct ctl_table t;

        ctl_table_init(&t, columns, sizeof(columns) / sizeof(columns[0]));
        if (ctl->json) {
                fputs("{\"configured\": false, \"peers\": ", stdout);
                ctl_table_print_json(&t, stdout);
                fputs(", \"note\": ", stdout);
                ctl_json_string(stdout, NOT_CONFIGURED);
                fputs("}\n", stdout);
        } else {
                ctl_table_print_list(&t, false, stdout);
                ctl_note("%s", NOT_CONFIGURED);
        }
        ctl_table_done(&t);
        return 0;
}
