/* moeep-bench (bench.c): the report, a table or JSON (--json) of every
 * result with min/median/max over ranks and the memory floor. */
#include <inttypes.h>
#include <string.h>

#include "bench.h"

const char *op_to_string(enum op o) {
        switch (o) {
        case OP_DISPATCH_BF16:
                return "dispatch bf16";
        case OP_DISPATCH_FP8:
                return "dispatch fp8";
        case OP_DISPATCH_CACHED:
                return "dispatch bf16 cached";
        case OP_COMBINE:
                return "combine bf16";
        case OP_NVL_FLOOR:
                return "nvlink floor (same SMs)";
        case OP_NVL_FLOOR_ALL:
                return "nvlink floor (all SMs)";
        case OP_NCCL_DISPATCH:
                return "nccl dispatch (counts+pack+a2a)";
        case OP_NCCL_DATA:
                return "nccl a2a data only";
        case OP_NCCL_COMBINE:
                return "nccl combine (a2a+sum)";
        case OP_LL_DISPATCH:
                return "ll dispatch fp8";
        case OP_LL_COMBINE:
                return "ll combine bf16";
        case OP_LL_BOTH:
                return "ll dispatch + combine";
        case OP_LL_DISPATCH_SEND:
                return "ll dispatch send (hook)";
        case OP_LL_DISPATCH_RECV:
                return "ll dispatch recv (hook)";
        case OP_LL_COMBINE_SEND:
                return "ll combine send (hook)";
        case OP_LL_COMBINE_RECV:
                return "ll combine recv (hook)";
        }
        return "?";
}

static void stats(const double *v, int n, double *mn, double *md, double *mx) {
        double t[MOEEP_MAX_RANKS];
        memcpy(t, v, sizeof(double) * (size_t)n);
        *md = median(t, n);
        *mn = t[0];
        *mx = t[n - 1];
}

void report(const struct opts *o, const struct shared *sh, int ranks) {
        if (o->json)
                printf("{\"ranks\": %d, \"hidden\": %d, \"topk\": %d, \"experts\": %d, \"iters\": %d, "
                       "\"seed\": %" PRIu64 ", \"buffer_bytes\": %zu, \"start\": \"%s\", \"copy_gbps\": "
                       "%.1f, \"launch_us\": %.2f, "
                       "\"results\": [\n",
                       ranks, o->hidden, o->topk, o->experts, o->iters, o->seed, sh->buffer_bytes,
                       o->host_start ? "host" : "gpu", sh->speed[0].copy_gbps, sh->speed[0].launch_us);
        else
                printf("moeep-bench: %d ranks, hidden %d, top-%d of %d experts, %d iters (median per rank; "
                       "min/median/max over ranks)\n"
                       "NVLink buffer: %.1f MiB per rank; each call starts after %s\n"
                       "memory floor = bytes the call must read and write in one GPU's memory / device copy "
                       "speed\n"
                       "+ its kernel launches; rank 0: copy %.0f GB/s (read + write), one launch %.1f us\n"
                       "%-34s %6s %4s %26s %26s %9s %7s\n",
                       ranks, o->hidden, o->topk, o->experts, o->iters, sh->buffer_bytes / 1048576.0,
                       o->host_start ? "a daemon barrier (--host-start)" : "a GPU barrier",
                       sh->speed[0].copy_gbps, sh->speed[0].launch_us, "operation", "tokens", "SMs",
                       "time us (min/med/max)", "GB/s (min/med/max)", "floor us", "x floor");
        if (!o->json && o->nodes == 2)
                printf("ranks 0..%d at daemon A, %d..%d at daemon B (two simulated nodes): NVLink inside a "
                       "node, the "
                       "proxy path (libfabric tcp over 127.0.0.1) between them\n",
                       ranks - ranks / 2 - 1, ranks - ranks / 2, ranks - 1);
        for (int i = 0; i < sh->nres; i++) {
                const struct result *r = &sh->res[i];
                double gb[MOEEP_MAX_RANKS], fl[MOEEP_MAX_RANKS], xf[MOEEP_MAX_RANKS], tmn, tmd, tmx, gmn, gmd,
                        gmx, fmd = 0, xmd = 0, dummy;
                bool has_floor = true;
                for (int k = 0; k < ranks; k++) {
                        const struct device_speed *d = &sh->speed[k];
                        gb[k] = r->us[k] > 0 ? r->bytes[k] / (r->us[k] * 1e3) : 0;
                        has_floor &= r->moved[k] > 0 && d->copy_gbps > 0;
                        fl[k] = has_floor ? r->moved[k] / (d->copy_gbps * 1e3) + r->launches * d->launch_us
                                          : 0;
                        xf[k] = has_floor ? r->us[k] / fl[k] : 0;
                }
                stats(r->us, ranks, &tmn, &tmd, &tmx);
                stats(gb, ranks, &gmn, &gmd, &gmx);
                if (has_floor) {
                        stats(fl, ranks, &dummy, &fmd, &dummy);
                        stats(xf, ranks, &dummy, &xmd, &dummy);
                }
                if (o->json)
                        printf("  {\"op\": \"%s\", \"tokens\": %d, \"sms\": %d, \"us\": [%.1f, %.1f, %.1f], "
                               "\"gbps\": [%.1f, %.1f, %.1f], "
                               "\"floor_us\": %.2f, \"x_floor\": %.2f}%s\n",
                               op_to_string(r->op), r->tokens, r->sms, tmn, tmd, tmx, gmn, gmd, gmx, fmd, xmd,
                               i + 1 < sh->nres ? "," : "");
                else if (has_floor)
                        printf("%-34s %6d %4d %8.1f /%8.1f /%8.1f %8.1f /%8.1f /%8.1f %9.1f %7.2f\n",
                               op_to_string(r->op), r->tokens, r->sms, tmn, tmd, tmx, gmn, gmd, gmx, fmd,
                               xmd);
                else
                        printf("%-34s %6d %4d %8.1f /%8.1f /%8.1f %8.1f /%8.1f /%8.1f %9s %7s\n",
                               op_to_string(r->op), r->tokens, r->sms, tmn, tmd, tmx, gmn, gmd, gmx, "-",
                               "-");
        }
        if (o->json)
                printf("]}\n");
}
