/* The few CUDA driver calls tp-cuda.c makes, declared here rather than
 * taken from <cuda.h>, so that moeepd builds and links without CUDA and
 * loads libcuda.so.1 (dlopen) only when the cuda transport is configured.
 * The types and constants follow the driver API's ABI (CUDA 11.x-12.x on
 * 64-bit Linux); tests/unit/test-tp-cuda-abi.c compares them with <cuda.h>
 * wherever CUDA is installed. The `_v2` symbol names are the ones <cuda.h>
 * maps the plain names to. */
#ifndef MOEEPD_TP_CUDA_API_H
#define MOEEPD_TP_CUDA_API_H

#include <stddef.h>

typedef int tpc_result;                    /* CUresult */
typedef int tpc_device;                    /* CUdevice */
typedef unsigned long long tpc_devptr;     /* CUdeviceptr */
typedef unsigned long long tpc_mem_handle; /* CUmemGenericAllocationHandle */
typedef struct tpc_ctx_st *tpc_context;    /* CUcontext */
typedef struct tpc_stream_st *tpc_stream;  /* CUstream */
typedef struct tpc_event_st *tpc_event;    /* CUevent */

#define TPC_SUCCESS 0                 /* CUDA_SUCCESS */
#define TPC_ERROR_NOT_READY 600       /* CUDA_ERROR_NOT_READY */
#define TPC_HANDLE_POSIX_FD 1         /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
#define TPC_LOCATION_DEVICE 1         /* CU_MEM_LOCATION_TYPE_DEVICE */
#define TPC_ACCESS_READWRITE 3        /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
#define TPC_STREAM_NON_BLOCKING 1     /* CU_STREAM_NON_BLOCKING */
#define TPC_EVENT_DISABLE_TIMING 2    /* CU_EVENT_DISABLE_TIMING */
#define TPC_HOST_REGISTER_PORTABLE 1  /* CU_MEMHOSTREGISTER_PORTABLE */
#define TPC_HOST_REGISTER_DEVICEMAP 2 /* CU_MEMHOSTREGISTER_DEVICEMAP */

/* CUmemAccessDesc: a CUmemLocation (type, id) and the access flags. */
struct tpc_access_desc {
        int location_type;
        int location_id;
        int flags;
};

/* Resolved entry points; see tp-cuda.c's cuda_api_load. */
struct tpc_api {
        tpc_result (*get_error_string)(tpc_result, const char **);
        tpc_result (*init)(unsigned);
        tpc_result (*device_get_count)(int *);
        tpc_result (*device_get)(tpc_device *, int);
        tpc_result (*primary_ctx_retain)(tpc_context *, tpc_device);
        tpc_result (*primary_ctx_release)(tpc_device);
        tpc_result (*ctx_set_current)(tpc_context);
        tpc_result (*stream_create)(tpc_stream *, unsigned);
        tpc_result (*stream_destroy)(tpc_stream);
        tpc_result (*stream_synchronize)(tpc_stream);
        tpc_result (*event_create)(tpc_event *, unsigned);
        tpc_result (*event_destroy)(tpc_event);
        tpc_result (*event_record)(tpc_event, tpc_stream);
        tpc_result (*event_query)(tpc_event);
        tpc_result (*memcpy_dtod_async)(tpc_devptr, tpc_devptr, size_t, tpc_stream);
        tpc_result (*memcpy_async)(tpc_devptr, tpc_devptr, size_t, tpc_stream);
        tpc_result (*host_register)(void *, size_t, unsigned);
        tpc_result (*host_unregister)(void *);
        tpc_result (*host_get_device_pointer)(tpc_devptr *, void *, unsigned);
        tpc_result (*import_handle)(tpc_mem_handle *, void *, int);
        tpc_result (*address_reserve)(tpc_devptr *, size_t, size_t, tpc_devptr, unsigned long long);
        tpc_result (*address_free)(tpc_devptr, size_t);
        tpc_result (*map)(tpc_devptr, size_t, size_t, tpc_mem_handle, unsigned long long);
        tpc_result (*unmap)(tpc_devptr, size_t);
        tpc_result (*release)(tpc_mem_handle);
        tpc_result (*set_access)(tpc_devptr, size_t, const struct tpc_access_desc *, size_t);
};

/* Symbol names, in the order of struct tpc_api's members. */
#define TPC_API_SYMBOLS                                                                                    \
        "cuGetErrorString", "cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain",       \
                "cuDevicePrimaryCtxRelease_v2", "cuCtxSetCurrent", "cuStreamCreate", "cuStreamDestroy_v2", \
                "cuStreamSynchronize", "cuEventCreate", "cuEventDestroy_v2", "cuEventRecord",              \
                "cuEventQuery", "cuMemcpyDtoDAsync_v2", "cuMemcpyAsync", "cuMemHostRegister_v2",           \
                "cuMemHostUnregister", "cuMemHostGetDevicePointer_v2", "cuMemImportFromShareableHandle",   \
                "cuMemAddressReserve", "cuMemAddressFree", "cuMemMap", "cuMemUnmap", "cuMemRelease",       \
                "cuMemSetAccess"

#endif
