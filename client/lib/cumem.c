/* The few CUDA driver calls the data plane needs, resolved from libcuda at
 * first use, so that libmoeep links and its control plane works on machines
 * with no GPU driver at all. */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cumem.h"

static struct cumem_api api;
static int api_status = -ENOSYS;
static char api_error[256];
static pthread_once_t api_once = PTHREAD_ONCE_INIT;

static void api_load(void) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

        if (!lib) {
                snprintf(api_error, sizeof(api_error), "cannot load libcuda.so.1: %s", dlerror());
                api_status = -ENOENT;
                return;
        }
#define SYM(field, name)                                                                       \
        do {                                                                                   \
                *(void **)&api.field = dlsym(lib, name);                                       \
                if (!api.field) {                                                              \
                        snprintf(api_error, sizeof(api_error), "libcuda.so.1 lacks %s", name); \
                        api_status = -ENOSYS;                                                  \
                        return;                                                                \
                }                                                                              \
        } while (0)
        SYM(get_error_string, "cuGetErrorString");
        SYM(device_get, "cuDeviceGet");
        SYM(granularity, "cuMemGetAllocationGranularity");
        SYM(create, "cuMemCreate");
        SYM(release, "cuMemRelease");
        SYM(export_handle, "cuMemExportToShareableHandle");
        SYM(import_handle, "cuMemImportFromShareableHandle");
        SYM(address_reserve, "cuMemAddressReserve");
        SYM(address_free, "cuMemAddressFree");
        SYM(map, "cuMemMap");
        SYM(unmap, "cuMemUnmap");
        SYM(set_access, "cuMemSetAccess");
#undef SYM
        *(void **)&api.device_attribute = dlsym(lib, "cuDeviceGetAttribute");
        *(void **)&api.range_handle = dlsym(lib, "cuMemGetHandleForAddressRange");
        api_status = 0;
}

int cumem_api_get(const struct cumem_api **ret_api, const char **ret_why) {
        pthread_once(&api_once, api_load);
        if (api_status < 0) {
                if (ret_why)
                        *ret_why = api_error;
                return api_status;
        }
        *ret_api = &api;
        return 0;
}

const char *cumem_strerror(const struct cumem_api *a, CUresult r) {
        const char *s = NULL;

        if (a->get_error_string(r, &s) != CUDA_SUCCESS || !s)
                return "unknown CUDA driver error";
        return s;
}

void cumem_mapping_release(const struct cumem_api *a, struct cumem_mapping *m) {
        if (!m || !m->ptr)
                return;
        a->unmap(m->ptr, m->size);
        a->address_free(m->ptr, m->size);
        a->release(m->handle);
        memset(m, 0, sizeof(*m));
}

/* Maps `handle` (reference taken over) at a fresh address with read/write
 * access for `device`. */
static CUresult map_handle(const struct cumem_api *a, CUmemGenericAllocationHandle handle, size_t size,
                           int device, struct cumem_mapping *ret) {
        CUmemAccessDesc access = {
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device },
                .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        CUdeviceptr ptr = 0;
        CUresult r;

        r = a->address_reserve(&ptr, size, 0, 0, 0);
        if (r != CUDA_SUCCESS)
                goto fail_release;
        r = a->map(ptr, size, 0, handle, 0);
        if (r != CUDA_SUCCESS)
                goto fail_free;
        r = a->set_access(ptr, size, &access, 1);
        if (r != CUDA_SUCCESS)
                goto fail_unmap;
        *ret = (struct cumem_mapping){ .ptr = ptr, .size = size, .handle = handle };
        return CUDA_SUCCESS;

fail_unmap:
        a->unmap(ptr, size);
fail_free:
        a->address_free(ptr, size);
fail_release:
        a->release(handle);
        return r;
}

CUresult cumem_alloc_exportable(const struct cumem_api *a, int device, size_t min_size,
                                struct cumem_mapping *ret_mapping, int *ret_fd) {
        CUmemAllocationProp prop = {
                .type = CU_MEM_ALLOCATION_TYPE_PINNED,
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device },
                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        };
        CUmemGenericAllocationHandle handle;
        struct cumem_mapping m;
        size_t gran = 0, size;
        int fd = -1, rdma = 0;
        CUdevice dev;
        CUresult r;

        /* Where the device can, the memory is made usable by a NIC too
         * (GPUDirect RDMA on cuMem allocations), so that it can be exported
         * as a dma-buf for a verbs transport (cumem_export_dmabuf). */
        if (a->device_attribute && a->device_get(&dev, device) == CUDA_SUCCESS &&
            a->device_attribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev) ==
                    CUDA_SUCCESS &&
            rdma)
                prop.allocFlags.gpuDirectRDMACapable = 1;
        r = a->granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
        if (r != CUDA_SUCCESS)
                return r;
        size = (min_size + gran - 1) / gran * gran;
        r = a->create(&handle, size, &prop, 0);
        if (r != CUDA_SUCCESS)
                return r;
        r = a->export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (r != CUDA_SUCCESS) {
                a->release(handle);
                return r;
        }
        r = map_handle(a, handle, size, device, &m);
        if (r != CUDA_SUCCESS) {
                close(fd);
                return r;
        }
        *ret_mapping = m;
        *ret_fd = fd;
        return CUDA_SUCCESS;
}

CUresult cumem_export_dmabuf(const struct cumem_api *a, const struct cumem_mapping *m, int *ret_fd) {
        int fd = -1;
        CUresult r;

        if (!a->range_handle)
                return CUDA_ERROR_NOT_SUPPORTED;
        r = a->range_handle(&fd, m->ptr, m->size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
        if (r != CUDA_SUCCESS)
                return r;
        *ret_fd = fd;
        return CUDA_SUCCESS;
}

CUresult cumem_import(const struct cumem_api *a, int fd, size_t size, int device, struct cumem_mapping *ret) {
        CUmemGenericAllocationHandle handle;
        CUresult r;

        r = a->import_handle(&handle, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (r != CUDA_SUCCESS)
                return r;
        return map_handle(a, handle, size, device, ret);
}
