/* Transports: the helpers every backend shares; see transport.h. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "datapath/transport.h"
#include "errors.h"
#include "log.h"

const char *tp_mem_kind_to_string(enum tp_mem_kind k) {
        switch (k) {
        case TP_MEM_HOST:
                return "host";
        case TP_MEM_MEMFD:
                return "memfd";
        case TP_MEM_DMABUF:
                return "dma-buf";
        case TP_MEM_CUMEM:
                return "cumem-fd";
        }
        return "unknown";
}

int tp_mem_map(const struct tp_mem *mem, const char *who, void **ret_addr, void **ret_map, char *errmsg) {
        const char *name = mem->name ? mem->name : "region";
        void *map;

        if (mem->length == 0)
                return errmsg_set(errmsg, -EINVAL, "%s: %s: empty", who, name);
        *ret_map = NULL;
        switch (mem->kind) {
        case TP_MEM_HOST:
                if (!mem->addr)
                        return errmsg_set(errmsg, -EINVAL, "%s: %s: no address", who, name);
                *ret_addr = mem->addr;
                return 0;
        case TP_MEM_MEMFD:
                map = mmap(NULL, mem->length, PROT_READ | PROT_WRITE, MAP_SHARED, mem->fd,
                           (off_t)mem->offset);
                /* The client's fd does not let us write: opened read-only
                 * (EACCES) or sealed against writes (EPERM). Its fault,
                 * and said as such, not as whatever those errnos alias. */
                if (map == MAP_FAILED && (errno == EACCES || errno == EPERM))
                        return errmsg_set(
                                errmsg, -ERROR_KIND_BAD_FDS,
                                "%s: %s: fd %d cannot be mapped for writing (%s): it is read-only or "
                                "sealed against writes, and the daemon writes into this region",
                                who, name, mem->fd, strerror(errno));
                if (map == MAP_FAILED)
                        return errmsg_set(errmsg, -errno, "%s: %s: mmap of fd %d (%llu bytes at %llu): %s",
                                          who, name, mem->fd, (unsigned long long)mem->length,
                                          (unsigned long long)mem->offset, strerror(errno));
                *ret_addr = *ret_map = map;
                return 0;
        case TP_MEM_DMABUF:
        case TP_MEM_CUMEM:
                *ret_addr = NULL;
                return 0;
        }
        return errmsg_set(errmsg, -EINVAL, "%s: %s: unknown memory kind %d", who, name, (int)mem->kind);
}

void tp_mem_unmap(void *map, uint64_t length) {
        if (map)
                munmap(map, length);
}
