/* daemon/clients/nics.c: PCIe distances, and the GPU -> NIC mapping on a fake
 * sysfs tree (two host bridges, a PCIe switch with a GPU and a NIC behind
 * it, a GPU and a NIC on another NUMA node, an NVSwitch that is no GPU). */
#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "../tmpdir.h"
#include "clients/nics.h"

static void test_distance(void **state) {
        const char *sw_gpu = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0";
        const char *sw_nic = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0";
        const char *deep_nic = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0/0000:05:00.0/"
                               "0000:06:00.0/0000:07:00.0";
        const char *rp2 = "/sys/devices/pci0000:00/0000:00:02.0/0000:08:00.0";
        const char *other = "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0";

        assert_string_equal(nics_distance(sw_gpu, 0, sw_nic, 0), "PIX");
        assert_string_equal(nics_distance(sw_gpu, 0, deep_nic, 0), "PXB");
        assert_string_equal(nics_distance(sw_gpu, 0, rp2, 0), "PHB");
        assert_string_equal(nics_distance(sw_gpu, 0, other, 0), "NODE");
        assert_string_equal(nics_distance(sw_gpu, 0, other, 1), "SYS");
        assert_string_equal(nics_distance(sw_gpu, -1, other, -1), "SYS");
        assert_string_equal(nics_distance("nonsense", 0, "nonsense", 0), "NODE");
}

static char root[128];

/* snprintf() into an array, failing the test rather than cutting the path. */
#define PATHF(buf, ...) assert_true((size_t)snprintf(buf, sizeof(buf), __VA_ARGS__) < sizeof(buf))

static void put(const char *rel, const char *text) {
        char path[PATH_MAX];
        FILE *f;

        PATHF(path, "%s/%s", root, rel);
        f = fopen(path, "w");
        assert_non_null(f);
        fputs(text, f);
        fclose(f);
}

static void mkdirs(const char *rel) {
        char path[PATH_MAX];

        PATHF(path, "mkdir -p '%s/%s'", root, rel);
        assert_int_equal(system(path), 0);
}

/* A PCI device at devices/PATH with a bus/pci/devices/ADDR link. */
static void device(const char *path, const char *vendor, const char *class, const char *numa) {
        const char *addr = strrchr(path, '/') + 1;
        char rel[PATH_MAX], target[PATH_MAX], link[PATH_MAX];

        PATHF(rel, "devices/%s", path);
        mkdirs(rel);
        PATHF(link, "%s/vendor", rel);
        put(link, vendor);
        PATHF(link, "%s/class", rel);
        put(link, class);
        PATHF(link, "%s/numa_node", rel);
        put(link, numa);
        PATHF(target, "%s/%s", root, rel);
        PATHF(link, "%s/bus/pci/devices/%s", root, addr);
        assert_int_equal(symlink(target, link), 0);
}

static Moeep__V1__NicInfo *nic(const char *name, const char *pci, int numa) {
        Moeep__V1__NicInfo *n = malloc(sizeof(*n));

        assert_non_null(n);
        moeep__v1__nic_info__init(n);
        n->name = strdup(name);
        n->source = strdup("ibverbs");
        n->pci_address = strdup(pci);
        n->link = strdup("");
        n->numa_node = numa;
        return n;
}

static void test_map_fake_tree(void **state) {
        Moeep__V1__Nics *n = calloc(1, sizeof(*n));
        char cmd[192];

        test_tmp_path(root, sizeof(root), "moeep-unit-sysfs-XXXXXX");
        assert_non_null(mkdtemp(root));
        mkdirs("bus/pci/devices");
        device("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", "0x10de\n", "0x030200\n",
               "0\n");
        device("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", "0x15b3\n", "0x020700\n",
               "0\n");
        device("pci0000:80/0000:80:01.0/0000:81:00.0", "0x10de\n", "0x030000\n", "1\n");
        device("pci0000:80/0000:80:02.0/0000:82:00.0", "0x15b3\n", "0x020700\n", "1\n");
        device("pci0000:80/0000:80:03.0/0000:83:00.0", "0x10de\n", "0x068000\n", "1\n"); /* NVSwitch */

        assert_non_null(n);
        moeep__v1__nics__init(n);
        n->nics = calloc(3, sizeof(*n->nics));
        n->nics[n->n_nics++] = nic("mlx5_far", "0000:82:00.0", 1);
        n->nics[n->n_nics++] = nic("mlx5_near", "0000:04:00.0", 0);
        n->nics[n->n_nics++] = nic("nopci", "", -1);
        assert_int_equal(nics_map_gpus(root, n), 0);

        assert_int_equal(n->n_gpus, 2); /* the NVSwitch is no GPU */
        assert_string_equal(n->gpus[0]->gpu_pci_address, "0000:03:00.0");
        assert_int_equal(n->gpus[0]->gpu_numa_node, 0);
        assert_string_equal(n->gpus[0]->nic, "mlx5_near");
        assert_string_equal(n->gpus[0]->distance, "PIX");
        assert_string_equal(n->gpus[1]->gpu_pci_address, "0000:81:00.0");
        assert_string_equal(n->gpus[1]->nic, "mlx5_far");
        assert_string_equal(n->gpus[1]->distance, "PHB");
        nics_free(n);

        /* No PCI bus at all: no GPUs, no error. */
        n = calloc(1, sizeof(*n));
        moeep__v1__nics__init(n);
        assert_int_equal(nics_map_gpus("/nonexistent", n), 0);
        assert_int_equal(n->n_gpus, 0);
        nics_free(n);

        PATHF(cmd, "rm -rf '%s'", root);
        assert_int_equal(system(cmd), 0);
}

/* GDRCopy's driver: reported with its module version where the device
 * node is a character device (here /dev/null stands in for /dev/gdrdrv),
 * not at all where there is none or where the path is no device. */
static void test_gdrdrv(void **state) {
        Moeep__V1__Nics *n = calloc(1, sizeof(*n));
        char cmd[192], file[192];
        FILE *f;

        test_tmp_path(root, sizeof(root), "moeep-unit-sysfs-XXXXXX");
        assert_non_null(mkdtemp(root));
        mkdirs("module/gdrdrv");
        put("module/gdrdrv/version", "2.4.1\n");
        assert_non_null(n);
        moeep__v1__nics__init(n);
        assert_int_equal(nics_gdrdrv("/dev/null", root, n), 0);
        assert_non_null(n->gdrdrv);
        assert_string_equal(n->gdrdrv->path, "/dev/null");
        assert_string_equal(n->gdrdrv->module_version, "2.4.1");
        assert_true(n->gdrdrv->accessible);
        assert_string_equal(n->gdrdrv->error, "");
        nics_free(n);

        /* No module directory: present, version unknown. */
        n = calloc(1, sizeof(*n));
        moeep__v1__nics__init(n);
        assert_int_equal(nics_gdrdrv("/dev/null", "/nonexistent", n), 0);
        assert_non_null(n->gdrdrv);
        assert_string_equal(n->gdrdrv->module_version, "");
        nics_free(n);

        /* Absent, and a regular file where the node should be: nothing. */
        PATHF(file, "%s/gdrdrv", root);
        f = fopen(file, "w");
        assert_non_null(f);
        fclose(f);
        n = calloc(1, sizeof(*n));
        moeep__v1__nics__init(n);
        assert_int_equal(nics_gdrdrv("/nonexistent/gdrdrv", root, n), 0);
        assert_null(n->gdrdrv);
        assert_int_equal(nics_gdrdrv(file, root, n), 0);
        assert_null(n->gdrdrv);
        nics_free(n);

        PATHF(cmd, "rm -rf '%s'", root);
        assert_int_equal(system(cmd), 0);
}

/* The real machine: whatever it has, the scan succeeds and every entry is
 * filled in. */
static void test_scan_here(void **state) {
        char errmsg[256];
        Moeep__V1__Nics *n;

        assert_int_equal(nics_scan(NICS_SYSFS_ROOT, &n, errmsg), 0);
        for (size_t i = 0; i < n->n_nics; i++)
                assert_true(n->nics[i]->name[0] && n->nics[i]->source[0]);
        for (size_t i = 0; i < n->n_gpus; i++)
                assert_true(n->gpus[i]->gpu_pci_address[0]);
        /* gdrdrv exactly where the node has one. */
        assert_int_equal(n->gdrdrv != NULL, access(NICS_GDRDRV_PATH, F_OK) == 0);
        nics_free(n);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_distance),
                cmocka_unit_test(test_map_fake_tree),
                cmocka_unit_test(test_gdrdrv),
                cmocka_unit_test(test_scan_here),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
