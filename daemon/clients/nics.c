/* RDMA devices and the GPU -> NIC mapping; see nics.h. */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <limits.h>
#include <rdma/fabric.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clients/nics.h"
#include "log.h"

/* Distances, nearest first; nics_distance() returns these names. */
static const char *const distances[] = { "PIX", "PXB", "PHB", "NODE", "SYS" };

/* libfabric providers that drive no RDMA hardware (sockets, shared memory,
 * and the utility layers that sit on top of a core provider). */
static const char *const software_providers[] = { "tcp", "udp",   "shm",  "sm2", "sockets", "net",    "rxm",
                                                  "rxd", "mrail", "hook", "lnx", "ofi_rxm", "ofi_rxd" };

/* Reads the first line of ROOT/REL into buf, without its newline. */
static int read_line(const char *root, const char *rel, char *buf, size_t size) {
        char path[PATH_MAX];
        FILE *f;

        snprintf(path, sizeof(path), "%s/%s", root, rel);
        f = fopen(path, "re");
        if (!f)
                return -errno;
        if (!fgets(buf, (int)size, f)) {
                fclose(f);
                return -EIO;
        }
        fclose(f);
        buf[strcspn(buf, "\n")] = '\0';
        return 0;
}

static int read_numa(const char *device_path) {
        char buf[32];

        if (read_line(device_path, "numa_node", buf, sizeof(buf)) < 0)
                return -1;
        return atoi(buf) >= 0 ? atoi(buf) : -1;
}

/* The PCI address of a device directory (its last path component when
 * that looks like "0000:3b:00.0"), or "". */
static const char *pci_address_of(const char *device_path) {
        const char *base = strrchr(device_path, '/');

        base = base ? base + 1 : device_path;
        return strlen(base) == 12 && base[4] == ':' && base[7] == ':' && base[10] == '.' ? base : "";
}

/* Appends a NicInfo; strings are copied. */
static int nic_add(Moeep__V1__Nics *n, const char *name, const char *source, const char *pci, int numa,
                   const char *link) {
        Moeep__V1__NicInfo **list = realloc(n->nics, (n->n_nics + 1) * sizeof(*list));
        Moeep__V1__NicInfo *ni;

        if (!list)
                return -ENOMEM;
        n->nics = list;
        ni = malloc(sizeof(*ni));
        if (!ni)
                return -ENOMEM;
        moeep__v1__nic_info__init(ni);
        ni->name = strdup(name);
        ni->source = strdup(source);
        ni->pci_address = strdup(pci);
        ni->link = strdup(link);
        ni->numa_node = numa;
        n->nics[n->n_nics++] = ni; /* freed by nics_free() even when a strdup failed */
        return ni->name && ni->source && ni->pci_address && ni->link ? 0 : -ENOMEM;
}

/* ibverbs: every device, its PCI place and port 1's state from sysfs. */
static int scan_ibverbs(const char *root, Moeep__V1__Nics *n) {
        struct ibv_device **list;
        int count = 0, r = 0;

        list = ibv_get_device_list(&count);
        if (!list) /* no RDMA subsystem in this kernel: no devices */
                return 0;
        for (int i = 0; i < count && r == 0; i++) {
                const char *name = ibv_get_device_name(list[i]);
                char rel[PATH_MAX + 64], dev[PATH_MAX], state[64] = "", layer[64] = "", link[160];
                const char *pci = "", *st;
                int numa = -1;

                snprintf(rel, sizeof(rel), "%s/class/infiniband/%s/device", root, name);
                if (realpath(rel, dev)) {
                        pci = pci_address_of(dev);
                        numa = read_numa(dev);
                }
                snprintf(rel, sizeof(rel), "class/infiniband/%s/ports/1/state", name);
                read_line(root, rel, state, sizeof(state)); /* "4: ACTIVE" */
                snprintf(rel, sizeof(rel), "class/infiniband/%s/ports/1/link_layer", name);
                read_line(root, rel, layer, sizeof(layer));
                st = strchr(state, ' ') ? strchr(state, ' ') + 1 : state;
                snprintf(link, sizeof(link), "%s%s%s%s", st, layer[0] ? " (" : "", layer,
                         layer[0] ? ")" : "");
                for (char *p = link; *p && *p != ' '; p++)
                        *p = (char)tolower((unsigned char)*p);
                r = nic_add(n, name, "ibverbs", pci, numa, link);
        }
        ibv_free_device_list(list);
        return r;
}

static bool provider_is_software(const char *prov, size_t len) {
        for (size_t i = 0; i < sizeof(software_providers) / sizeof(software_providers[0]); i++)
                if (strlen(software_providers[i]) == len && strncmp(prov, software_providers[i], len) == 0)
                        return true;
        return false;
}

static bool nic_listed(const Moeep__V1__Nics *n, const char *name, const char *source) {
        for (size_t i = 0; i < n->n_nics; i++)
                if (strcmp(n->nics[i]->name, name) == 0 && strcmp(n->nics[i]->source, source) == 0)
                        return true;
        return false;
}

/* libfabric: one row per (hardware provider, domain). */
static int scan_libfabric(const char *root, Moeep__V1__Nics *n) {
        struct fi_info *info = NULL;
        int r = 0;

        if (fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, NULL, &info) != 0 || !info)
                return 0; /* FI_ENODATA: no provider found anything */
        for (const struct fi_info *i = info; i && r == 0; i = i->next) {
                const char *prov =
                        i->fabric_attr && i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "";
                const char *name = i->domain_attr && i->domain_attr->name ? i->domain_attr->name : "";
                size_t core = strcspn(prov, ";"); /* "verbs;ofi_rxm": the core provider is first */
                char source[96], pci[16] = "", dev[PATH_MAX], rel[PATH_MAX];
                int numa = -1;

                if (!name[0] || provider_is_software(prov, core))
                        continue;
                snprintf(source, sizeof(source), "libfabric/%.*s", (int)core, prov);
                if (nic_listed(n, name, source))
                        continue;
                if (i->nic && i->nic->bus_attr && i->nic->bus_attr->bus_type == FI_BUS_PCI) {
                        const struct fi_pci_attr *a = &i->nic->bus_attr->attr.pci;

                        snprintf(pci, sizeof(pci), "%04x:%02x:%02x.%x", a->domain_id, a->bus_id, a->device_id,
                                 a->function_id);
                        snprintf(rel, sizeof(rel), "%s/bus/pci/devices/%s", root, pci);
                        if (realpath(rel, dev))
                                numa = read_numa(dev);
                }
                r = nic_add(n, name, source, pci, numa, "");
        }
        fi_freeinfo(info);
        return r;
}

/* The part of a sysfs device path after ".../devices/", split at '/':
 * returns the number of components (at most `max`). */
static size_t split_path(const char *path, char parts[][32], size_t max) {
        const char *p = strstr(path, "/devices/");
        size_t n = 0;

        if (!p)
                return 0;
        p += strlen("/devices/");
        while (*p && n < max) {
                size_t len = strcspn(p, "/");

                snprintf(parts[n++], 32, "%.*s", (int)len, p);
                p += len;
                p += *p == '/';
        }
        return n;
}

#define PATH_PARTS 16

const char *nics_distance(const char *path_a, int numa_a, const char *path_b, int numa_b) {
        char a[PATH_PARTS][32], b[PATH_PARTS][32];
        size_t na = split_path(path_a, a, PATH_PARTS), nb = split_path(path_b, b, PATH_PARTS), common = 0;

        while (common < na && common < nb && strcmp(a[common], b[common]) == 0)
                common++;
        if (common == 0) /* different host bridges (or unknown paths) */
                return numa_a >= 0 && numa_a == numa_b ? "NODE" : "SYS";
        if (common == 1) /* only the host bridge in common */
                return "PHB";
        /* Below the common bridge each side passes a downstream port at most:
         * one switch. */
        return (na > nb ? na : nb) - common <= 2 ? "PIX" : "PXB";
}

static size_t distance_rank(const char *d) {
        for (size_t i = 0; i < sizeof(distances) / sizeof(distances[0]); i++)
                if (strcmp(d, distances[i]) == 0)
                        return i;
        return sizeof(distances) / sizeof(distances[0]);
}

static bool is_nvidia_gpu(const char *root, const char *addr) {
        char rel[PATH_MAX], vendor[32], class[32];

        snprintf(rel, sizeof(rel), "bus/pci/devices/%s/vendor", addr);
        if (read_line(root, rel, vendor, sizeof(vendor)) < 0 || strcmp(vendor, "0x10de") != 0)
                return false;
        snprintf(rel, sizeof(rel), "bus/pci/devices/%s/class", addr);
        if (read_line(root, rel, class, sizeof(class)) < 0)
                return false;
        /* 0x0300xx VGA, 0x0302xx 3D controller; NVSwitches are 0x0680xx. */
        return strncmp(class, "0x0300", 6) == 0 || strncmp(class, "0x0302", 6) == 0;
}

static int gpu_add(Moeep__V1__Nics *n, const char *pci, int numa, const char *nic, const char *distance) {
        Moeep__V1__GpuNic **list = realloc(n->gpus, (n->n_gpus + 1) * sizeof(*list));
        Moeep__V1__GpuNic *g;

        if (!list)
                return -ENOMEM;
        n->gpus = list;
        g = malloc(sizeof(*g));
        if (!g)
                return -ENOMEM;
        moeep__v1__gpu_nic__init(g);
        g->gpu_pci_address = strdup(pci);
        g->nic = strdup(nic);
        g->distance = strdup(distance);
        g->gpu_numa_node = numa;
        n->gpus[n->n_gpus++] = g;
        return g->gpu_pci_address && g->nic && g->distance ? 0 : -ENOMEM;
}

/* The nearest NIC with a PCI address to the GPU at `gpu_path`. */
static int gpu_map_one(const char *root, Moeep__V1__Nics *n, const char *addr, const char *gpu_path) {
        const char *best = "", *best_distance = "";
        size_t best_rank = sizeof(distances) / sizeof(distances[0]) + 1;
        int gpu_numa = read_numa(gpu_path);

        for (size_t i = 0; i < n->n_nics; i++) {
                const Moeep__V1__NicInfo *nic = n->nics[i];
                char rel[PATH_MAX], nic_path[PATH_MAX];
                const char *d;

                if (!nic->pci_address[0])
                        continue;
                snprintf(rel, sizeof(rel), "%s/bus/pci/devices/%s", root, nic->pci_address);
                if (!realpath(rel, nic_path))
                        continue;
                d = nics_distance(gpu_path, gpu_numa, nic_path, nic->numa_node);
                if (distance_rank(d) < best_rank) { /* ties: the first listed (ibverbs before libfabric) */
                        best_rank = distance_rank(d);
                        best = nic->name;
                        best_distance = d;
                }
        }
        return gpu_add(n, addr, gpu_numa, best, best_distance);
}

static int addr_compare(const void *a, const void *b) {
        return strcmp(*(char *const *)a, *(char *const *)b);
}

int nics_map_gpus(const char *root, Moeep__V1__Nics *n) {
        char dir[PATH_MAX], **addrs = NULL;
        size_t count = 0;
        struct dirent *e;
        int r = 0;
        DIR *d;

        snprintf(dir, sizeof(dir), "%s/bus/pci/devices", root);
        d = opendir(dir);
        if (!d)
                return 0; /* no PCI bus to look at: no GPUs */
        while ((e = readdir(d)) && r == 0) {
                char **grown;

                if (e->d_name[0] == '.' || !is_nvidia_gpu(root, e->d_name))
                        continue;
                grown = realloc(addrs, (count + 1) * sizeof(*addrs));
                if (!grown || !(grown[count] = strdup(e->d_name))) {
                        addrs = grown ? grown : addrs;
                        r = -ENOMEM;
                        break;
                }
                addrs = grown;
                count++;
        }
        closedir(d);
        if (count)
                qsort(addrs, count, sizeof(*addrs), addr_compare);
        for (size_t i = 0; i < count && r == 0; i++) {
                char rel[PATH_MAX + 256], path[PATH_MAX];

                snprintf(rel, sizeof(rel), "%s/%s", dir, addrs[i]);
                r = gpu_map_one(root, n, addrs[i], realpath(rel, path) ? path : rel);
        }
        for (size_t i = 0; i < count; i++)
                free(addrs[i]);
        free(addrs);
        return r;
}

int nics_gdrdrv(const char *dev_path, const char *root, Moeep__V1__Nics *n) {
        Moeep__V1__Gdrdrv *g;
        char version[64] = "";
        struct stat st;
        int fd;

        if (stat(dev_path, &st) < 0 || !S_ISCHR(st.st_mode))
                return 0;
        g = malloc(sizeof(*g));
        if (!g)
                return -ENOMEM;
        moeep__v1__gdrdrv__init(g);
        read_line(root, "module/gdrdrv/version", version, sizeof(version));
        /* Opening makes a gdrdrv context and nothing more; the driver's
         * open does not wait for anyone. O_NONBLOCK all the same. */
        fd = open(dev_path, O_RDWR | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
        g->accessible = fd >= 0;
        g->path = strdup(dev_path);
        g->module_version = strdup(version);
        g->error = strdup(fd >= 0 ? "" : strerror(errno));
        if (fd >= 0)
                close(fd);
        n->gdrdrv = g;
        if (!g->path || !g->module_version || !g->error)
                return -ENOMEM;
        return 0;
}

int nics_scan(const char *root, Moeep__V1__Nics **ret_nics, char *errmsg) {
        Moeep__V1__Nics *n = malloc(sizeof(*n));
        int r;

        if (!n)
                return errmsg_set(errmsg, -ENOMEM, "NicsList: out of memory");
        moeep__v1__nics__init(n);
        r = scan_ibverbs(root, n);
        if (r == 0)
                r = scan_libfabric(root, n);
        if (r == 0)
                r = nics_map_gpus(root, n);
        if (r == 0)
                r = nics_gdrdrv(NICS_GDRDRV_PATH, root, n);
        if (r < 0) {
                nics_free(n);
                return errmsg_set(errmsg, r, "NicsList: out of memory");
        }
        *ret_nics = n;
        return 0;
}

void nics_free(Moeep__V1__Nics *n) {
        if (!n)
                return;
        for (size_t i = 0; i < n->n_nics; i++) {
                free(n->nics[i]->name);
                free(n->nics[i]->source);
                free(n->nics[i]->pci_address);
                free(n->nics[i]->link);
                free(n->nics[i]);
        }
        for (size_t i = 0; i < n->n_gpus; i++) {
                free(n->gpus[i]->gpu_pci_address);
                free(n->gpus[i]->nic);
                free(n->gpus[i]->distance);
                free(n->gpus[i]);
        }
        if (n->gdrdrv) {
                free(n->gdrdrv->path);
                free(n->gdrdrv->module_version);
                free(n->gdrdrv->error);
                free(n->gdrdrv);
        }
        free(n->nics);
        free(n->gpus);
        free(n);
}
