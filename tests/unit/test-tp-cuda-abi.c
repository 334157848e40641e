/* Checks daemon/datapath/tp-cuda-api.h, which declares the driver API that moeepd
 * loads at run time, against <cuda.h> wherever CUDA is installed: the
 * constants, the struct layout and the symbol names <cuda.h> maps the
 * plain names to. Compiling checks the first two, running the third. */
#include <stddef.h>
#include <stdio.h>

#include <cuda.h>

#include "datapath/tp-cuda-api.h"

_Static_assert(sizeof(tpc_result) == sizeof(CUresult), "CUresult");
_Static_assert(sizeof(tpc_device) == sizeof(CUdevice), "CUdevice");
_Static_assert(sizeof(tpc_devptr) == sizeof(CUdeviceptr), "CUdeviceptr");
_Static_assert(sizeof(tpc_mem_handle) == sizeof(CUmemGenericAllocationHandle), "handle");
_Static_assert(TPC_SUCCESS == CUDA_SUCCESS, "CUDA_SUCCESS");
_Static_assert(TPC_ERROR_NOT_READY == CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY");
_Static_assert(TPC_HANDLE_POSIX_FD == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "handle type");
_Static_assert(TPC_LOCATION_DEVICE == CU_MEM_LOCATION_TYPE_DEVICE, "location type");
_Static_assert(TPC_ACCESS_READWRITE == CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "access flags");
_Static_assert(TPC_STREAM_NON_BLOCKING == CU_STREAM_NON_BLOCKING, "stream flags");
_Static_assert(TPC_EVENT_DISABLE_TIMING == CU_EVENT_DISABLE_TIMING, "event flags");
_Static_assert(TPC_HOST_REGISTER_PORTABLE == CU_MEMHOSTREGISTER_PORTABLE, "host register");
_Static_assert(TPC_HOST_REGISTER_DEVICEMAP == CU_MEMHOSTREGISTER_DEVICEMAP, "host register");
_Static_assert(sizeof(struct tpc_access_desc) == sizeof(CUmemAccessDesc), "CUmemAccessDesc");
_Static_assert(offsetof(struct tpc_access_desc, location_type) == offsetof(CUmemAccessDesc, location.type),
               "CUmemAccessDesc.location.type");
_Static_assert(offsetof(struct tpc_access_desc, location_id) == offsetof(CUmemAccessDesc, location.id),
               "CUmemAccessDesc.location.id");
_Static_assert(offsetof(struct tpc_access_desc, flags) == offsetof(CUmemAccessDesc, flags),
               "CUmemAccessDesc.flags");

#define STR_(x) #x
#define STR(x) STR_(x)

int main(void) {
        /* The macro names <cuda.h> expands to must be what tp-cuda loads. */
        static const char *const ours[] = { TPC_API_SYMBOLS };
        const char *want[] = { STR(cuMemcpyDtoDAsync), STR(cuStreamDestroy),
                               STR(cuEventDestroy),    STR(cuDevicePrimaryCtxRelease),
                               STR(cuMemHostRegister), STR(cuMemHostGetDevicePointer) };
        int bad = 0;

        for (size_t w = 0; w < sizeof(want) / sizeof(want[0]); w++) {
                int found = 0;

                for (size_t i = 0; i < sizeof(ours) / sizeof(ours[0]); i++)
                        found |= __builtin_strcmp(ours[i], want[w]) == 0;
                if (!found) {
                        fprintf(stderr, "tp-cuda-api.h does not load %s\n", want[w]);
                        bad = 1;
                }
        }
        return bad;
}
