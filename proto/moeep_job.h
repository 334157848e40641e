/* What a job's ranks and moeepd share outside the protocol's messages: the
 * limits of a job, which the daemon (daemon/state/job.h), the client library
 * and the kernels (kernels/common/params.h) size their arrays by, and the
 * layout of the job's control page. Plain C; installed next to moeep.h,
 * which includes it: the public names of libmoeep. */
#ifndef MOEEP_JOB_H
#define MOEEP_JOB_H

#include <stdint.h>

#define MOEEP_UNIQUE_ID_BYTES 128 /* struct moeep_unique_id (moeep.h) */
#define MOEEP_MAX_RANKS 8         /* ranks of a job */
#define MOEEP_CONTROL_PAGE_SIZE 4096
#define MOEEP_CONTROL_PAGE_MAGIC 0x4c525443u /* "CTRL" */

/* Layout of the job's control page, a sealed memfd the daemon shares with
 * every rank at join (read-only for clients). Kernels poll `abort` inside
 * every spin-wait (the page is cudaHostRegister'ed by the data plane).
 * Fields are only ever added at the end, with a new version; a client reads
 * a field only when `version` says it is there (the rest of the page is
 * zero). */
struct moeep_control_page {
        uint32_t magic;    /* MOEEP_CONTROL_PAGE_MAGIC */
        uint32_t version;  /* MOEEP_CONTROL_PAGE_VERSION (1: up to job_id) */
        uint32_t abort;    /* 0 while the job is healthy; set to 1 by the daemon */
        int32_t lost_rank; /* the first rank lost, -1 while none */
        uint64_t job_id;
        /* Version 2. Bit r: rank r of the job was lost (its session closed
         * without JobLeave, its daemon or the mesh link to its daemon went
         * down). Bits are only ever set, each with a release store before
         * `abort`, so a reader that sees a bit may rely on it. Elastic
         * (shrink-mode) endpoints mask these ranks and go on. */
        uint32_t lost_ranks;
        /* Version 2: 1 when the job ended for every rank (the daemon is
         * stopping), set before `abort`; elastic endpoints fail then too. */
        uint32_t stopping;
};

#define MOEEP_CONTROL_PAGE_VERSION 2

#endif
