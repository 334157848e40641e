/* moeep-bench (bench.c): the report, a table or JSON (--json) of every
 * result with min/median/max over ranks, its floors and host times. */
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
        case OP_LL_BOTH_HOOKS:
                return "ll dispatch + combine, hooks";
        }
        return "?";
}

const char *timing_to_string(enum timing t) {
        switch (t) {
        case TIMING_KERNEL:
                return "kernel";
        case TIMING_B2B:
                return "b2b";
        case TIMING_GRAPH:
                return "graph";
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

/* The medians over ranks of a floor (fl, per rank) and of each rank's time
 * over it; false, and zeros, when a rank has no floor (fl[k] <= 0). */
static bool floor_stats(const struct result *r, const double *fl, int ranks, double *ret_floor,
                        double *ret_x) {
        double x[MOEEP_MAX_RANKS], f[MOEEP_MAX_RANKS], dummy;

        *ret_floor = *ret_x = 0;
        for (int k = 0; k < ranks; k++) {
                if (fl[k] <= 0)
                        return false;
                f[k] = fl[k];
                x[k] = r->us[k] / fl[k];
        }
        stats(f, ranks, &dummy, ret_floor, &dummy);
        stats(x, ranks, &dummy, ret_x, &dummy);
        return true;
}

/* A cell of the table: the value with `decimals` decimals and `mark`
 * after it, or "-" when there is none. */
static const char *cell(char *buf, size_t len, double v, int decimals, const char *mark, bool present) {
        if (!present)
                return "-";
        snprintf(buf, len, "%.*f%s", decimals, v, mark);
        return buf;
}

static void header(const struct opts *o, const struct shared *sh, int ranks) {
        const struct device_speed *d = &sh->speed[0];

        printf("moeep-bench: %d ranks, hidden %d, top-%d of %d experts, %d iters (median per rank; "
               "min/median/max over ranks)\n"
               "NVLink buffer: %.1f MiB per rank\n"
               "timing: kernel = each call after a daemon barrier, a 500 us busy kernel and %s\n"
               "        (the GPU time of its kernels)\n"
               "        b2b = the calls back to back as engines issue them, CUDA events around each\n"
               "        (host cost counts where the GPU waits for it)\n",
               ranks, o->hidden, o->topk, o->experts, o->iters, sh->buffer_bytes / 1048576.0,
               o->host_start ? "no GPU barrier (--host-start)" : "a GPU barrier");
        if (o->ll)
                printf("        graph = CUDA-graph replays of two steps back to back, per step\n");
        printf("floor = bytes the call must read and write in one GPU's memory / device copy speed\n"
               "        + its kernel launches; rank 0: copy %.0f GB/s (read + write), one launch %.1f us\n",
               d->copy_gbps, d->launch_us);
        if (o->ll && d->nvl_gbps > 0 && sh->flag_rtt_us > 0)
                printf("nvl = bytes a rank must send to or receive from other GPUs (the larger) / all-peer "
                       "store speed\n"
                       "        + its launches + one flag round trip per call; rank 0: %.0f GB/s sent with "
                       "%d SMs,\n"
                       "        flag round trip %.2f us (rank 0 to 1 and back)\n",
                       d->nvl_gbps, sh->nvl_sms, sh->flag_rtt_us);
        else if (o->ll)
                printf("nvl = NVLink floor: - (one rank, or ranks not all on NVLink)\n");
        printf("host us = wall-clock time of the calling thread inside the call(s), cpu us = its CPU time\n"
               "        (b2b, graph); *: the call waits on the host for the GPU (the count exchange)\n");
        printf("%-31s %-6s %6s %4s %28s %28s %8s %7s", "operation", "timing", "tokens", "SMs",
               "time us (min/med/max)", "GB/s (min/med/max)", "floor us", "x floor");
        if (o->ll)
                printf(" %8s %6s", "nvl us", "x nvl");
        printf(" %8s %8s\n", "host us", "cpu us");
        if (o->nodes == 2)
                printf("ranks 0..%d at daemon A, %d..%d at daemon B (two simulated nodes): NVLink inside a "
                       "node, the proxy path (libfabric tcp over 127.0.0.1) between them\n",
                       ranks - ranks / 2 - 1, ranks - ranks / 2, ranks - 1);
}

void report(const struct opts *o, const struct shared *sh, int ranks) {
        if (o->json)
                printf("{\"ranks\": %d, \"hidden\": %d, \"topk\": %d, \"experts\": %d, \"iters\": %d, "
                       "\"seed\": %" PRIu64 ", \"buffer_bytes\": %zu, \"start\": \"%s\", \"copy_gbps\": "
                       "%.1f, \"launch_us\": %.2f, \"nvl_gbps\": %.1f, \"nvl_sms\": %d, \"flag_rtt_us\": "
                       "%.3f, "
                       "\"results\": [\n",
                       ranks, o->hidden, o->topk, o->experts, o->iters, o->seed, sh->buffer_bytes,
                       o->host_start ? "host" : "gpu", sh->speed[0].copy_gbps, sh->speed[0].launch_us,
                       sh->speed[0].nvl_gbps, sh->nvl_sms, sh->flag_rtt_us);
        else
                header(o, sh, ranks);
        for (int i = 0; i < sh->nres; i++) {
                const struct result *r = &sh->res[i];
                double gb[MOEEP_MAX_RANKS], fl[MOEEP_MAX_RANKS], nfl[MOEEP_MAX_RANKS], t[3], g[3], h[3], c[3],
                        fmd, xmd, nmd, nxmd;
                char b[6][32];

                for (int k = 0; k < ranks; k++) {
                        const struct device_speed *d = &sh->speed[k];
                        gb[k] = r->us[k] > 0 ? r->bytes[k] / (r->us[k] * 1e3) : 0;
                        fl[k] = r->moved[k] > 0 && d->copy_gbps > 0
                                        ? r->moved[k] / (d->copy_gbps * 1e3) + r->launches * d->launch_us
                                        : 0;
                        nfl[k] = r->round_trips > 0 && d->nvl_gbps > 0 && sh->flag_rtt_us > 0
                                         ? r->nvl_bytes[k] / (d->nvl_gbps * 1e3) +
                                                   r->launches * d->launch_us +
                                                   r->round_trips * sh->flag_rtt_us
                                         : 0;
                }
                stats(r->us, ranks, &t[0], &t[1], &t[2]);
                stats(gb, ranks, &g[0], &g[1], &g[2]);
                stats(r->host_us, ranks, &h[0], &h[1], &h[2]);
                stats(r->cpu_us, ranks, &c[0], &c[1], &c[2]);
                const bool has_floor = floor_stats(r, fl, ranks, &fmd, &xmd),
                           has_nvl = floor_stats(r, nfl, ranks, &nmd, &nxmd),
                           has_host = r->timing != TIMING_KERNEL;
                if (o->json) {
                        printf("  {\"op\": \"%s\", \"timing\": \"%s\", \"tokens\": %d, \"sms\": %d, "
                               "\"us\": [%.1f, %.1f, %.1f], \"gbps\": [%.1f, %.1f, %.1f], "
                               "\"floor_us\": %.2f, \"x_floor\": %.2f, \"nvl_floor_us\": %.2f, "
                               "\"x_nvl\": %.2f, \"host_us\": [%.1f, %.1f, %.1f], "
                               "\"cpu_us\": [%.1f, %.1f, %.1f], \"host_waits\": %s}%s\n",
                               op_to_string(r->op), timing_to_string(r->timing), r->tokens, r->sms, t[0],
                               t[1], t[2], g[0], g[1], g[2], fmd, xmd, nmd, nxmd, h[0], h[1], h[2], c[0],
                               c[1], c[2], r->host_waits ? "true" : "false", i + 1 < sh->nres ? "," : "");
                        continue;
                }
                printf("%-31s %-6s %6d %4d %8.1f /%8.1f /%8.1f %8.1f /%8.1f /%8.1f %8s %7s",
                       op_to_string(r->op), timing_to_string(r->timing), r->tokens, r->sms, t[0], t[1], t[2],
                       g[0], g[1], g[2], cell(b[0], sizeof(b[0]), fmd, 1, "", has_floor),
                       cell(b[1], sizeof(b[1]), xmd, 2, "", has_floor));
                if (o->ll)
                        printf(" %8s %6s", cell(b[2], sizeof(b[2]), nmd, 1, "", has_nvl),
                               cell(b[3], sizeof(b[3]), nxmd, 2, "", has_nvl));
                printf(" %8s %8s\n", cell(b[4], sizeof(b[4]), h[1], 1, r->host_waits ? "*" : "", has_host),
                       cell(b[5], sizeof(b[5]), c[1], 1, "", has_host));
        }
        if (o->json)
                printf("]}\n");
}
