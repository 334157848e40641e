/* moeep-bench (bench.c): the NCCL all-to-all reference, what a user
 * writes without moeep (counts, pack, all-to-all, unpack), timed like the
 * moeep figures. libnccl.so.2 is loaded at run time: without it the
 * reference is left out. */
#include <dlfcn.h>
#include <errno.h>

#include "bench.h"
#include "bench/bench_kernels.h"

/* ---------------------------------------------------------------- NCCL, loaded at run time */

struct nccl_api {
        ncclResult_t (*get_unique_id)(ncclUniqueId *);
        ncclResult_t (*comm_init_rank)(ncclComm_t *, int, ncclUniqueId, int);
        ncclResult_t (*comm_destroy)(ncclComm_t);
        ncclResult_t (*group_start)(void);
        ncclResult_t (*group_end)(void);
        ncclResult_t (*send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
        ncclResult_t (*recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
};

static int nccl_load(struct nccl_api *n) {
        void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
        if (!lib)
                return -ENOENT;
        *(void **)&n->get_unique_id = dlsym(lib, "ncclGetUniqueId");
        *(void **)&n->comm_init_rank = dlsym(lib, "ncclCommInitRank");
        *(void **)&n->comm_destroy = dlsym(lib, "ncclCommDestroy");
        *(void **)&n->group_start = dlsym(lib, "ncclGroupStart");
        *(void **)&n->group_end = dlsym(lib, "ncclGroupEnd");
        *(void **)&n->send = dlsym(lib, "ncclSend");
        *(void **)&n->recv = dlsym(lib, "ncclRecv");
        return n->get_unique_id && n->comm_init_rank && n->comm_destroy && n->group_start && n->group_end &&
                               n->send && n->recv
                       ? 0
                       : -ENOSYS;
}

struct nccl_case {
        struct nccl_api *api;
        ncclComm_t comm;
        const uint8_t *in_rank;
        const void *x;
        int T, hidden, ranks;
        int32_t *pos, *counts_dev, *recv_counts_dev, *offsets_dev;
        int counts[MOEEP_MAX_RANKS], recv_counts[MOEEP_MAX_RANKS];
        void *sendbuf, *recvbuf, *backbuf, *out;
        int sms;
};

static void nccl_a2a(struct nccl_case *n, const void *send, const int *scount, void *recv, const int *rcount,
                     size_t row, cudaStream_t st) {
        size_t so = 0, ro = 0;
        n->api->group_start();
        for (int d = 0; d < n->ranks; d++) {
                n->api->send((const char *)send + so * row, (size_t)scount[d] * row, ncclUint8, d, n->comm,
                             st);
                n->api->recv((char *)recv + ro * row, (size_t)rcount[d] * row, ncclUint8, d, n->comm, st);
                so += (size_t)scount[d];
                ro += (size_t)rcount[d];
        }
        n->api->group_end();
}

/* What a user writes: count exchange (device all-to-all, then a host copy),
 * pack by destination, data all-to-all. */
static int op_nccl_dispatch(struct rank_env *env, void *arg) {
        struct nccl_case *n = arg;
        int offs[MOEEP_MAX_RANKS], sum = 0;
        size_t row = (size_t)n->hidden * 2;

        moeep_launch_ref_scan(n->in_rank, n->T, n->ranks, n->pos, n->counts_dev, env->st);
        n->api->group_start();
        for (int d = 0; d < n->ranks; d++) {
                n->api->send(n->counts_dev + d, 1, ncclInt32, d, n->comm, env->st);
                n->api->recv(n->recv_counts_dev + d, 1, ncclInt32, d, n->comm, env->st);
        }
        n->api->group_end();
        cudaMemcpyAsync(n->counts, n->counts_dev, sizeof(int) * n->ranks, cudaMemcpyDeviceToHost, env->st);
        cudaMemcpyAsync(n->recv_counts, n->recv_counts_dev, sizeof(int) * n->ranks, cudaMemcpyDeviceToHost,
                        env->st);
        cudaStreamSynchronize(env->st);
        for (int d = 0; d < n->ranks; d++) {
                offs[d] = sum;
                sum += n->counts[d];
        }
        cudaMemcpyAsync(n->offsets_dev, offs, sizeof(offs), cudaMemcpyHostToDevice, env->st);
        moeep_launch_ref_pack(n->x, row, n->T, n->ranks, n->pos, n->offsets_dev, n->sendbuf, n->sms, env->st);
        nccl_a2a(n, n->sendbuf, n->counts, n->recvbuf, n->recv_counts, row, env->st);
        return 0;
}

static int op_nccl_data(struct rank_env *env, void *arg) {
        struct nccl_case *n = arg;
        nccl_a2a(n, n->sendbuf, n->counts, n->recvbuf, n->recv_counts, (size_t)n->hidden * 2, env->st);
        return 0;
}

static int op_nccl_combine(struct rank_env *env, void *arg) {
        struct nccl_case *n = arg;
        nccl_a2a(n, n->recvbuf, n->recv_counts, n->backbuf, n->counts, (size_t)n->hidden * 2, env->st);
        moeep_launch_ref_unpack(n->backbuf, n->hidden, n->T, n->ranks, n->pos, n->offsets_dev, n->out, n->sms,
                                env->st);
        return 0;
}

int bench_nccl(struct rank_env *env, int *slot, int T) {
        const struct opts *o = env->o;
        struct nccl_api api;
        struct nccl_case n = { .api = &api, .T = T, .hidden = o->hidden, .ranks = env->ranks, .sms = o->sms };
        struct inputs in = { 0 };
        int err = 0, nrecv = 0;
        double us;
        size_t rowsz = (size_t)o->hidden * 2, cap = (size_t)T * env->ranks;

        if (nccl_load(&api) < 0) {
                if (env->rank == 0)
                        fprintf(stderr, "moeep-bench: libnccl.so.2 not found; no NCCL reference\n");
                return 0;
        }
        if (env->rank == 0) {
                api.get_unique_id(&env->sh->nccl_id);
                __atomic_store_n(&env->sh->nccl_ready, 1, __ATOMIC_RELEASE);
        }
        moeep_job_barrier(env->c);
        if (api.comm_init_rank(&n.comm, env->ranks, env->sh->nccl_id, env->rank) != ncclSuccess) {
                fprintf(stderr, "rank %d: ncclCommInitRank failed\n", env->rank);
                return -1;
        }
        if (inputs_make(env, &in, T) < 0)
                return -1;
        n.in_rank = in.in_rank;
        n.x = in.x;
        CUDA_OK(cudaMalloc((void **)&n.pos, sizeof(int32_t) * (size_t)T * env->ranks + 16));
        CUDA_OK(cudaMalloc((void **)&n.counts_dev, 64));
        CUDA_OK(cudaMalloc((void **)&n.recv_counts_dev, 64));
        CUDA_OK(cudaMalloc((void **)&n.offsets_dev, 64));
        CUDA_OK(cudaMalloc(&n.sendbuf, cap * rowsz + 16));
        CUDA_OK(cudaMalloc(&n.recvbuf, cap * rowsz + 16));
        CUDA_OK(cudaMalloc(&n.backbuf, cap * rowsz + 16));
        n.out = in.out;

        us = time_op(env, op_nccl_dispatch, &n, &err);
        for (int d = 0; d < env->ranks; d++)
                nrecv += n.recv_counts[d];
        record(env, (*slot)++, OP_NCCL_DISPATCH, T, 0, us, (double)nrecv * rowsz);
        us = time_op(env, op_nccl_data, &n, &err);
        record(env, (*slot)++, OP_NCCL_DATA, T, 0, us, (double)nrecv * rowsz);
        us = time_op(env, op_nccl_combine, &n, &err);
        record(env, (*slot)++, OP_NCCL_COMBINE, T, 0, us, (double)nrecv * rowsz);

        cudaStreamSynchronize(env->st);
        api.comm_destroy(n.comm);
        cudaFree(n.pos);
        cudaFree(n.counts_dev);
        cudaFree(n.recv_counts_dev);
        cudaFree(n.offsets_dev);
        cudaFree(n.sendbuf);
        cudaFree(n.recvbuf);
        cudaFree(n.backbuf);
        inputs_free(&in);
        return err;
}
