/* moeepctl nics: the RDMA devices moeepd sees (libibverbs, libfabric) and
 * the NIC nearest each GPU by PCIe topology, then GDRCopy's /dev/gdrdrv
 * where the node has it. A node without RDMA devices gets empty tables and
 * a note saying so. */
#include <stdio.h>

#include "ctl.h"

#define NO_NICS "no RDMA devices: neither libibverbs nor libfabric reports one"
#define NO_GPUS "no NVIDIA GPUs in sysfs"
#define NO_GDRDRV "no /dev/gdrdrv (GDRCopy): not needed; containers never need it"

static const struct ctl_column nic_columns[] = {
        { "NIC", "name", CTL_STRING },        { "SOURCE", "source", CTL_STRING },
        { "PCI", "pci_address", CTL_STRING }, { "NUMA", "numa_node", CTL_RANK },
        { "LINK", "link", CTL_STRING },
};

static const struct ctl_column gpu_columns[] = {
        { "GPU", "gpu_pci_address", CTL_STRING },
        { "NUMA", "gpu_numa_node", CTL_RANK },
        { "NIC", "nic", CTL_STRING },
        { "DISTANCE", "distance", CTL_STRING },
};

static int fill(const Moeep__V1__Nics *n, struct ctl_table *nics, struct ctl_table *gpus) {
        int r = 0;

        for (size_t i = 0; i < n->n_nics && r >= 0; i++)
                r = ctl_table_add(nics, (const struct ctl_value[]){
                                                { .s = n->nics[i]->name },
                                                { .s = n->nics[i]->source },
                                                { .s = n->nics[i]->pci_address },
                                                { .i = n->nics[i]->numa_node },
                                                { .s = n->nics[i]->link },
                                        });
        for (size_t i = 0; i < n->n_gpus && r >= 0; i++)
                r = ctl_table_add(gpus, (const struct ctl_value[]){
                                                { .s = n->gpus[i]->gpu_pci_address },
                                                { .i = n->gpus[i]->gpu_numa_node },
                                                { .s = n->gpus[i]->nic },
                                                { .s = n->gpus[i]->distance },
                                        });
        return r;
}

/* GDRCopy's driver: where it is, its version, whether the daemon can open
 * it; or that there is none (containers never need it). */
static void print_gdrdrv(const Moeep__V1__Gdrdrv *g) {
        if (!g) {
                printf("gdrdrv: none\n");
                ctl_note("%s", NO_GDRDRV);
                return;
        }
        printf("gdrdrv: %s (module %s)%s%s\n", g->path,
               g->module_version[0] ? g->module_version : "version unknown",
               g->accessible ? "" : ", the daemon cannot open it: ", g->accessible ? "" : g->error);
}

static void print_gdrdrv_json(const Moeep__V1__Gdrdrv *g) {
        if (!g) {
                fputs("null", stdout);
                return;
        }
        fputs("{\"path\": ", stdout);
        ctl_json_string(stdout, g->path);
        fputs(", \"module_version\": ", stdout);
        ctl_json_string(stdout, g->module_version);
        printf(", \"accessible\": %s, \"error\": ", g->accessible ? "true" : "false");
        ctl_json_string(stdout, g->error);
        fputc('}', stdout);
}

int ctl_nics(struct ctl *ctl) {
        Moeep__V1__NicsList list = MOEEP__V1__NICS_LIST__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        struct ctl_table nics, gpus;
        int r;

        if (!ctl_require_operator(ctl, "nics"))
                return 1;
        req.body_case = MOEEP__V1__REQUEST__BODY_NICS_LIST;
        req.nics_list = &list;
        if (ctl_query(ctl, &req, MOEEP__V1__RESPONSE__BODY_NICS, &resp) < 0)
                return 1;
        ctl_table_init(&nics, nic_columns, sizeof(nic_columns) / sizeof(nic_columns[0]));
        ctl_table_init(&gpus, gpu_columns, sizeof(gpu_columns) / sizeof(gpu_columns[0]));
        r = fill(resp->nics, &nics, &gpus);
        if (r < 0)
                fprintf(stderr, "moeepctl: out of memory formatting the NIC tables\n");
        else if (ctl->json) {
                fputs("{\"nics\": ", stdout);
                ctl_table_print_json(&nics, stdout);
                fputs(", \"gpus\": ", stdout);
                ctl_table_print_json(&gpus, stdout);
                fputs(", \"note\": ", stdout);
                ctl_json_string(stdout, nics.nrows == 0 ? NO_NICS : "");
                fputs(", \"gdrdrv\": ", stdout);
                print_gdrdrv_json(resp->nics->gdrdrv);
                fputs("}\n", stdout);
        } else {
                ctl_table_print_list(&nics, false, stdout);
                if (nics.nrows == 0)
                        ctl_note("%s", NO_NICS);
                fputc('\n', stdout);
                ctl_table_print_list(&gpus, false, stdout);
                if (gpus.nrows == 0)
                        ctl_note("%s", NO_GPUS);
                fputc('\n', stdout);
                print_gdrdrv(resp->nics->gdrdrv);
        }
        ctl_table_done(&gpus);
        ctl_table_done(&nics);
        moeep__v1__response__free_unpacked(resp, NULL);
        return r < 0 ? 1 : 0;
}
