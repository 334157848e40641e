/* Elastic (shrink-mode) parts of the low-latency kernels (ll/): what a
 * call does when a rank is masked, and how it masks one that does not come.
 * Included by every file of ll/ after ll.cuh (the clean barrier and the
 * mask, the elastic endpoints' own launches, are in shrink.cu).
 * docs/reliability.md ("Elastic ranks") says what is guaranteed.
 *
 * Who decides what, once per call, so that the blocks of a launch never
 * disagree:
 *   - the dispatch send's block 0 decides which ranks the call leaves out
 *     (`skip`: masked, marked lost by the daemon, or inactive for the call)
 *     and after which lower ranks' counts our pairs go (`view`: those whose
 *     counts came; a rank whose counts do not come within the shrink
 *     timeout is masked), and publishes both (state->ll_send_view) before
 *     any other block sends;
 *   - the dispatch receive (one block), or the relay's block 0 with ranks
 *     at other daemons, decides whose counts the slots are laid out after
 *     (`cv`: the send's view for the lower ranks, then the higher ones whose
 *     counts came) and whose rows it takes (`in`: those that arrived within
 *     twice the timeout; a pair's sender waited up to one timeout for the
 *     counts before it sent), checks that every sender placed its pairs
 *     where that layout says (a digest of its places, begin_digest), closes
 *     the runs of the sources whose rows it does not take, and publishes
 *     counts and ranges;
 *   - each combine receive block decides whose expert outputs it sums:
 *     those whose arrival it saw. */
#pragma once

/* Bits of a decision word (publish_decision, wait.cuh). */
#define LL_DEC_VIEW(w) ((w)&0xffu)            /* send: lower ranks whose counts our pairs go after */
#define LL_DEC_SKIP(w) (((w) >> 8) & 0xffu)   /* send: ranks the call leaves out */
#define LL_DEC_FP8 (1u << 16)                 /* send: the rows are FP8 (for closing runs) */
#define LL_DEC_CV(w) ((w)&0xffu)              /* receive: local sources whose counts the layout is after */
#define LL_DEC_REMOTE(w) (((w) >> 8) & 0xffu) /* receive, combine relay: remote sources placed */
static_assert(MOEEP_KERNEL_MAX_RANKS <= 8, "a decision word holds 8 ranks per field");

/* The decision of sequence number seq in a word another launch of this
 * call published (the send's, for its receive or relay): it is there,
 * since launches on one stream run in order; a stale word (a launch that
 * failed part way) reads as 0 with an error recorded. */
__device__ __forceinline__ uint32_t ll_decision_of(const struct moeep_ctx &ctx, const uint64_t *word, uint64_t seq) {
        const uint64_t w = *(const volatile uint64_t *)word;

        if ((w >> 32) != (seq & 0xffffffffull)) {
                record_error(ctx, MOEEP_KERR_TIMEOUT, ctx.rank);
                return 0;
        }
        return (uint32_t)w;
}

/* The ranks a send leaves out, from the lost word read earlier (a PCIe
 * load the caller issued first, so that it overlaps other work): masked
 * ones, the ones the daemon marked lost (masked now: every send takes the
 * daemon's word into the mask) and the ones this call's active_ranks names
 * inactive. Never ourselves. One thread. */
__device__ __forceinline__ uint32_t ll_skip_of(const struct moeep_ctx &ctx, uint64_t lost_word) {
        const uint32_t lost = (uint32_t)lost_word;
        uint32_t skip = 0;

        for (int r = 0; r < ctx.ranks; r++) {
                if (r == ctx.rank)
                        continue;
                if ((lost >> r & 1) && !ll_masked(ctx, r))
                        ll_mask(ctx, r);
                if (ll_masked(ctx, r) || (ctx.active && ctx.active[r] == 0))
                        skip |= 1u << r;
        }
        return skip;
}

/* The ranks a combine leaves out: masked, or inactive for this call. One
 * thread. */
__device__ __forceinline__ uint32_t ll_skip_now(const struct moeep_ctx &ctx) {
        uint32_t skip = 0;

        for (int r = 0; r < ctx.ranks; r++)
                if (r != ctx.rank && (ll_masked(ctx, r) || (ctx.active && ctx.active[r] == 0)))
                        skip |= 1u << r;
        return skip;
}

/* Whether source s's counts of dispatch seq on set b are here (its table
 * row, released by count_flag): waited for (wait_peer, which masks s when
 * they do not come within the shrink timeout) unless s is left out, then
 * looked at once more, so that counts that did come are always placed
 * after, whoever masked s. Every rank applies this same rule to the same
 * flags, which is what keeps their layouts the same. */
__device__ __forceinline__ bool ll_counts_present(const struct moeep_ctx &ctx, int b, uint64_t seq, int s,
                                                  bool left_out) {
        const uint64_t *f = &ll_sync_of(ctx, ctx.rank)->count_flag[b][s];

        if (!left_out && wait_peer(ctx, f, seq, s, ctx.shrink_timeout_ns))
                return true;
        return ld_acquire_sys(f) >= seq;
}

/* The digest of a source's places at one expert: its first slot there (+1)
 * times a constant of the expert, summed over the experts it sends pairs
 * to (mod 2^64), mixed with the call's sequence number. The same function
 * on both sides: the sender over its s_begin, the receiver over the layout
 * it computed. */
__device__ __forceinline__ uint64_t ll_digest_term(int le, int64_t begin) {
        uint64_t z = (uint64_t)le + 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return ((uint64_t)begin + 1) * ((z ^ (z >> 31)) | 1);
}

__device__ __forceinline__ uint64_t ll_digest_seal(uint64_t sum, uint64_t seq) {
        return sum ^ (seq * 0xd1b54a32d192ed03ull);
}

/* The send's block 0, after its pairs' places are known: the digest of
 * where our pairs go at each mapped destination's experts, into its
 * begin_digest for us (ordered before our arrival by ll_arrive). One warp
 * per destination. Our counts are our own table row. */
__device__ __forceinline__ void ll_send_digests(const struct moeep_ctx &ctx, int b, uint64_t seq, const int *s_begin,
                                                uint32_t skip) {
        const int lane = threadIdx.x % 32, d = threadIdx.x / 32, me = ctx.rank, epr = ctx.num_experts / ctx.ranks;
        const struct moeep_ll_sync *own = ll_sync_of(ctx, me);

        if (d >= ctx.ranks || d == me || px_remote(ctx, d) || (skip >> d & 1))
                return;
        uint64_t sum = 0;
        for (int le = lane; le < epr; le += 32) {
                const int e = d * epr + le;
                if (*(const volatile int32_t *)&own->table[b][me][e] > 0)
                        sum += ll_digest_term(le, s_begin[e]);
        }
#pragma unroll
        for (int o = 16; o >= 1; o /= 2)
                sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0)
                ll_sync_of(ctx, d)->begin_digest[b][me] = ll_digest_seal(sum, seq);
}

/* Which local sources' counts the receive lays its slots out after: the
 * lower ones as the send saw them (the view our own pairs went after),
 * ourselves, and the higher ones whose counts came (ll_counts_present). One
 * block; every thread gets the answer. */
__device__ __forceinline__ uint32_t ll_decide_cv(const struct moeep_ctx &ctx, int b, uint64_t seq, uint32_t send_dec) {
        __shared__ uint32_t s_cv;
        const int tid = threadIdx.x, me = ctx.rank;
        const uint32_t skip = LL_DEC_SKIP(send_dec);

        if (tid == 0)
                s_cv = LL_DEC_VIEW(send_dec) | 1u << me;
        __syncthreads();
        if (tid < ctx.ranks && tid > me && !px_remote(ctx, tid) &&
            ll_counts_present(ctx, b, seq, tid, (skip >> tid & 1) || ll_masked(ctx, tid)))
                atomicOr(&s_cv, 1u << tid);
        __syncthreads();
        const uint32_t cv = s_cv;
        __syncthreads();
        return cv;
}

/* Bounded wait for our own flag (the other blocks of this launch): never
 * masks anyone. */
__device__ __forceinline__ void ll_wait_own(const struct moeep_ctx &ctx, const uint64_t *flag, uint64_t want) {
        struct spin s = spin_begin();

        spin_until([&] { return ld_acquire_sys(flag) >= want; }, [&] { return spin_give_up_block(ctx, s); });
}

/* Moves n slots of local expert le from slot `from` on to slot `to` on
 * (the ranges do not overlap): row, FP8 scales, source token and kinfo;
 * for our own pairs also where the combine finds them in place (ref). The
 * whole block. */
__device__ __forceinline__ void ll_move_slots(const struct moeep_ctx &ctx, int b, int le, size_t slots, int from,
                                              int to, int n, bool fp8, bool own) {
        char *buf = ctx.peers[ctx.rank];
        const size_t xrow = (size_t)ctx.hidden * (fp8 ? 1 : 2), n16 = xrow / 16;
        const int nscales = ctx.hidden / MOEEP_SCALE_BLOCK;
        int4 *x = (int4 *)(buf + ctx.ll.x[b]);
        float *sc = (float *)(buf + ctx.ll.scales[b]);
        int32_t *src = (int32_t *)(buf + ctx.ll.src[b]), *kinfo = (int32_t *)(buf + ctx.ll.kinfo[b]);
        int32_t *ref = (int32_t *)(buf + ctx.ll.ref[b]);
        const size_t base = (size_t)le * slots;

        /* L2 loads (__ldcg): other GPUs and other blocks wrote these. */
        for (size_t i = threadIdx.x; i < (size_t)n * n16; i += blockDim.x)
                x[(base + to + i / n16) * n16 + i % n16] = __ldcg(&x[(base + from + i / n16) * n16 + i % n16]);
        if (fp8)
                for (int i = threadIdx.x; i < n * nscales; i += blockDim.x) {
                        const size_t g = (size_t)le * nscales + i / n;
                        sc[g * slots + to + i % n] = __ldcg(&sc[g * slots + from + i % n]);
                }
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int32_t t = __ldcg(&src[base + from + i]), ki = __ldcg(&kinfo[base + from + i]);
                src[base + to + i] = t;
                kinfo[base + to + i] = ki;
                if (own && t >= 0 && t < ctx.ll.max_tokens)
                        ref[(size_t)t * ctx.max_topk + moeep_ll_kinfo_k(ki)] = (int32_t)(base + to + i);
        }
}

/* Closes the runs of the sources whose rows the receive does not take:
 * every taken run after one moves down to its new first slot, in chunks no
 * longer than the distance it moves, so that no chunk overwrites slots
 * still to be read. Rare (a rank died after its counts went out, or is
 * masked here only), so one block does it, expert by expert. */
__device__ __forceinline__ void ll_close_runs(const struct moeep_ctx &ctx, int b, size_t slots, uint32_t cv,
                                              uint32_t in, bool fp8) {
        __shared__ int s_runs[MOEEP_KERNEL_MAX_RANKS][4]; /* from, to, count, ours */
        __shared__ int s_nruns;
        const struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int R = ctx.ranks, me = ctx.rank, epr = ctx.num_experts / R;
        const int64_t *range = (const int64_t *)(ctx.peers[me] + ctx.ll.range[b]);

        for (int le = 0; le < epr; le++) {
                if (threadIdx.x == 0) {
                        int64_t from = 0, to = 0;
                        int n = 0;
                        for (int pass = 0; pass < 2; pass++) /* the layout of ll_recv_shrink */
                                for (int s = 0; s < R; s++) {
                                        if (px_remote(ctx, s) != (pass == 1))
                                                continue;
                                        const bool counted = pass == 0 ? (cv >> s & 1) : (in >> s & 1);
                                        const bool taken = counted && (in >> s & 1);
                                        /* A local source's count is its table row; a
                                         * remote one's row is zeroed by now, and the
                                         * count is in its range (it is taken). */
                                        int c = 0;
                                        if (counted && pass == 0)
                                                c = *(const volatile int32_t *)&my->table[b][s][me * epr + le];
                                        else if (counted)
                                                c = (int)(uint32_t)range[(size_t)le * R + s];
                                        if (taken && c > 0 && from != to) {
                                                s_runs[n][0] = (int)from;
                                                s_runs[n][1] = (int)to;
                                                s_runs[n][2] = c;
                                                s_runs[n][3] = s == me;
                                                n++;
                                        }
                                        if (counted)
                                                from += c;
                                        if (taken)
                                                to += c;
                                }
                        s_nruns = n;
                }
                __syncthreads();
                for (int r = 0; r < s_nruns; r++) {
                        const int from = s_runs[r][0], to = s_runs[r][1], c = s_runs[r][2], shift = from - to;
                        for (int done = 0; done < c; done += shift) {
                                ll_move_slots(ctx, b, le, slots, from + done, to + done, min(shift, c - done), fp8,
                                              s_runs[r][3]);
                                __syncthreads();
                        }
                }
                __syncthreads(); /* s_runs is the next expert's */
        }
}

/* The elastic receive phase of dispatch seq on set b, in one block: see
 * the top of this file. `send_dec` is the send's decision; with
 * `relayed` the relay decided cv and the remote sources it placed
 * (state->ll_recv_view), else this block decides cv and there are no
 * remote sources. With `in_send` (block 0 of the send's own launch) our
 * own pairs may still be landing: they are waited for only when runs must
 * close. */
__device__ __forceinline__ void ll_recv_shrink(const struct moeep_ctx &ctx, int b, uint64_t seq, int *stats,
                                               size_t slots, uint32_t send_dec, bool relayed, bool in_send) {
        __shared__ uint32_t s_in, s_bad;
        __shared__ int s_move;
        __shared__ unsigned long long s_dig[MOEEP_KERNEL_MAX_RANKS];
        struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int tid = threadIdx.x, R = ctx.ranks, me = ctx.rank, epr = ctx.num_experts / R;
        int64_t *range = (int64_t *)(ctx.peers[me] + ctx.ll.range[b]);
        const uint32_t skip = LL_DEC_SKIP(send_dec);
        uint32_t cv, remote_in = 0;

        if (relayed) {
                const uint32_t w = ll_decision_of(ctx, &ctx.state->ll_recv_view[b], seq);
                cv = LL_DEC_CV(w);
                remote_in = LL_DEC_REMOTE(w);
        } else {
                cv = ll_decide_cv(ctx, b, seq, send_dec);
        }
        if (tid == 0) {
                s_in = remote_in | 1u << me;
                s_bad = 0;
                s_move = 0;
        }
        if (tid < MOEEP_KERNEL_MAX_RANKS)
                s_dig[tid] = 0;
        __syncthreads();
        /* The rows of every counted source we do not leave out: twice the
         * timeout, since its sender may have waited one for counts. */
        if (tid < R && tid != me && !px_remote(ctx, tid) && (cv >> tid & 1) && !(skip >> tid & 1) &&
            !ll_masked(ctx, tid) &&
            wait_peer(ctx, &my->dispatch_flag[b][tid], seq << 32, tid, 2 * ctx.shrink_timeout_ns))
                atomicOr(&s_in, 1u << tid);
        __syncthreads();
        const uint32_t in = s_in;
        /* Per local expert: where each source's run is (`from`: after the
         * counted sources, as the senders placed them; remote runs after
         * the local ones, as the relay placed them) and where it goes (`to`:
         * after the taken ones only). Counts and ranges say `to`. */
        for (int le = tid; le < epr; le += blockDim.x) {
                const int e = me * epr + le;
                int64_t from = 0, to = 0;
                for (int pass = 0; pass < 2; pass++)
                        for (int s = 0; s < R; s++) {
                                if (px_remote(ctx, s) != (pass == 1))
                                        continue;
                                const bool counted = pass == 0 ? (cv >> s & 1) : (in >> s & 1);
                                const bool taken = counted && (in >> s & 1);
                                const int32_t c = counted ? *(volatile int32_t *)&my->table[b][s][e] : 0;
                                if (pass == 1)
                                        my->table[b][s][e] = 0; /* the relay adds into it */
                                if (pass == 0 && taken && s != me && c > 0)
                                        atomicAdd(&s_dig[s], (unsigned long long)ll_digest_term(le, from));
                                range[(size_t)le * R + s] = moeep_ll_range_pack(to, taken ? c : 0);
                                if (taken && c > 0 && from != to)
                                        s_move = 1;
                                if (counted)
                                        from += c;
                                if (taken)
                                        to += c;
                        }
                my->count[b][le] = (int32_t)to;
                if (stats)
                        stats[le] += (int)to;
        }
        __syncthreads();
        if (tid < R && tid != me && !px_remote(ctx, tid) && (in >> tid & 1) &&
            *(volatile uint64_t *)&my->begin_digest[b][tid] != ll_digest_seal(s_dig[tid], seq))
                atomicOr(&s_bad, 1u << tid);
        __syncthreads();
        if (s_bad) {
                if (tid == 0)
                        record_error(ctx, MOEEP_KERR_SHRINK_VIEW, __ffs(s_bad) - 1);
                return;
        }
        if (!s_move)
                return;
        if (tid == 0 && in_send)
                ll_wait_own(ctx, &my->dispatch_flag[b][me], seq << 32);
        __syncthreads();
        ll_close_runs(ctx, b, slots, cv, in, send_dec & LL_DEC_FP8);
}
