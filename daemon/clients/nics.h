/* The RDMA devices moeepd sees and the NIC nearest each GPU.
 *
 * Devices come from libibverbs (ibv_get_device_list) and libfabric
 * (fi_getinfo, hardware providers only: tcp, udp, shm and the like are no
 * RDMA devices); their PCIe places and the GPUs (NVIDIA display and 3D
 * controllers) come from sysfs, and GDRCopy's /dev/gdrdrv is reported where
 * it exists. A machine without RDMA devices gets empty
 * lists, not an error. Nothing here is cached: an operator asks rarely and
 * wants what is true now. */
#ifndef MOEEPD_NICS_H
#define MOEEPD_NICS_H

#include "moeep.pb-c.h"

#define NICS_SYSFS_ROOT "/sys"

/* Scans the devices. `sysfs_root` is where sysfs is mounted ("/sys"; unit
 * tests pass a fake tree). Returns 0 with *ret_nics (free with
 * nics_free()), or -ENOMEM with errmsg. */
int nics_scan(const char *sysfs_root, Moeep__V1__Nics **ret_nics, char *errmsg);

/* Where GDRCopy's driver puts its device node. */
#define NICS_GDRDRV_PATH "/dev/gdrdrv"

/* Fills ret_nics->gdrdrv when `dev_path` (NICS_GDRDRV_PATH; unit tests pass
 * another character device) is a character device: its module version
 * from `sysfs_root`/module/gdrdrv/version, and whether the daemon can open
 * it read-write. Leaves it NULL otherwise. nics_scan() calls it. Returns 0
 * or -ENOMEM. */
int nics_gdrdrv(const char *dev_path, const char *sysfs_root, Moeep__V1__Nics *nics);

/* Fills ret_nics->gpus for the NVIDIA GPUs under `sysfs_root`, each with
 * the nearest of ret_nics->nics that has a PCI address. nics_scan() calls
 * it; unit tests call it on a fake tree. Returns 0 or -ENOMEM. */
int nics_map_gpus(const char *sysfs_root, Moeep__V1__Nics *nics);

/* How far apart two PCI devices are, from their sysfs device paths
 * ("/sys/devices/pci0000:00/0000:00:01.0/...") and NUMA nodes (-1 when
 * unknown), in nvidia-smi topo's terms: "PIX" (at most one PCIe switch
 * between them), "PXB" (several switches, no host bridge), "PHB" (through
 * the host bridge), "NODE" (same NUMA node, different host bridges), "SYS"
 * (across NUMA nodes, or unknown). */
const char *nics_distance(const char *path_a, int numa_a, const char *path_b, int numa_b);

/* Frees what nics_scan() returned. Accepts NULL. */
void nics_free(Moeep__V1__Nics *nics);

#endif
