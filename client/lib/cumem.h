/* CUDA driver calls for cuMem buffers shared through POSIX fds, loaded
 * lazily from libcuda.so.1 (see cumem.c). */
#ifndef MOEEP_CUMEM_H
#define MOEEP_CUMEM_H

#include <stddef.h>

#include <cuda.h>

struct cumem_api {
        CUresult (*get_error_string)(CUresult, const char **);
        CUresult (*device_get)(CUdevice *, int);
        CUresult (*granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
        CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                           unsigned long long);
        CUresult (*release)(CUmemGenericAllocationHandle);
        CUresult (*export_handle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                  unsigned long long);
        CUresult (*import_handle)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
        CUresult (*address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
        CUresult (*address_free)(CUdeviceptr, size_t);
        CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
        CUresult (*unmap)(CUdeviceptr, size_t);
        CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
        /* Optional (NULL where this libcuda lacks them): dma-buf export. */
        CUresult (*device_attribute)(int *, CUdevice_attribute, CUdevice);
        CUresult (*range_handle)(void *, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
};

/* One mapped allocation: owns `handle` and the address range. */
struct cumem_mapping {
        CUdeviceptr ptr;
        size_t size;
        CUmemGenericAllocationHandle handle;
};

/* Returns the driver table, loading libcuda on first use; on failure
 * ret_why names the reason. */
int cumem_api_get(const struct cumem_api **ret_api, const char **ret_why);

const char *cumem_strerror(const struct cumem_api *api, CUresult r);

/* Allocates at least min_size bytes on `device`, exportable as a POSIX fd,
 * and maps them read/write for the device. The caller owns the fd. */
CUresult cumem_alloc_exportable(const struct cumem_api *api, int device, size_t min_size,
                                struct cumem_mapping *ret_mapping, int *ret_fd);

/* Exports the mapping as a dma-buf fd (cuMemGetHandleForAddressRange), for
 * a NIC to register (ibv_reg_dmabuf_mr); the caller owns the fd.
 * CUDA_ERROR_NOT_SUPPORTED where the driver or the device cannot. */
CUresult cumem_export_dmabuf(const struct cumem_api *api, const struct cumem_mapping *m, int *ret_fd);

/* Imports a peer's fd (not consumed) of `size` bytes and maps it for `device`. */
CUresult cumem_import(const struct cumem_api *api, int fd, size_t size, int device,
                      struct cumem_mapping *ret_mapping);

/* Unmaps and releases. Accepts NULL and unmapped entries. */
void cumem_mapping_release(const struct cumem_api *api, struct cumem_mapping *m);

#endif
