/* libmoeep control plane: the job a handle creates, joins and leaves, its
 * barrier, its ranks and its control page (moeep.h). */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "client-handle.h"
#include "names.h"

void client_job_forget(struct moeep_client *c) {
        if (c->job_data_free)
                c->job_data_free(c->job_data);
        c->job_data = NULL;
        c->job_data_free = NULL;
        if (c->control_page)
                munmap(c->control_page, MOEEP_CONTROL_PAGE_SIZE);
        c->control_page = NULL;
        c->job_id = 0;
        c->rank = -1;
        c->world_size = 0;
}

static int check_world_size(struct moeep_client *c, int world_size) {
        if (world_size < 1 || world_size > MOEEP_MAX_RANKS)
                return client_error_set(c, -EINVAL, "world size %d is out of range (1..%d)", world_size,
                                        MOEEP_MAX_RANKS);
        return 0;
}

int moeep_job_create(struct moeep_client *c, const char *name, int world_size,
                     struct moeep_unique_id *ret_id) {
        Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        ProtobufCBinaryData *uid;
        int r;

        if (!c)
                return -EINVAL;
        if (!name || !ret_id)
                return client_error_set(c, -EINVAL, "job create: %s is NULL", !name ? "name" : "ret_id");
        if (!moeep_job_name_valid(name))
                return client_error_set(c, -EINVAL,
                                        "job name '%.80s' is invalid (1..%d printable ASCII bytes)", name,
                                        MOEEP_JOB_NAME_MAX);
        r = check_world_size(c, world_size);
        if (r < 0)
                return r;

        jc.name = (char *)name;
        jc.world_size = (uint32_t)world_size;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
        req.job_create = &jc;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_JOB_CREATED, NULL, 0, &resp);
        if (r < 0)
                return r;
        uid = &resp->job_created->unique_id;
        if (uid->len == 0 || uid->len > MOEEP_UNIQUE_ID_BYTES) {
                r = client_error_set(c, -EPROTO, "moeepd returned a unique id of %zu bytes (expected 1..%d)",
                                     uid->len, MOEEP_UNIQUE_ID_BYTES);
                goto out;
        }
        /* Zero-padded to the full size; moeep_job_join() sends all of it. */
        memset(ret_id, 0, sizeof(*ret_id));
        memcpy(ret_id->bytes, uid->data, uid->len);
out:
        moeep__v1__response__free_unpacked(resp, NULL);
        return r;
}

/* Maps the control page the daemon sent with JobJoined (read-only) and
 * checks it. Takes ownership of nothing: the caller closes `fd`. */
static int control_page_map(struct moeep_client *c, int fd, struct moeep_control_page **ret_page) {
        struct moeep_control_page *page = NULL;
        struct stat st;

        if (fstat(fd, &st) < 0)
                return client_error_set(c, -errno, "cannot stat the job's control page (fd %d): %m", fd);
        if (st.st_size < MOEEP_CONTROL_PAGE_SIZE)
                return client_error_set(c, -EPROTO, "moeepd sent a control page of %lld bytes (expected %d)",
                                        (long long)st.st_size, MOEEP_CONTROL_PAGE_SIZE);
        page = mmap(NULL, MOEEP_CONTROL_PAGE_SIZE, PROT_READ, MAP_SHARED, fd, 0);
        if (page == MAP_FAILED)
                return client_error_set(c, -errno, "cannot map the job's control page (fd %d): %m", fd);
        if (page->magic != MOEEP_CONTROL_PAGE_MAGIC) {
                uint32_t magic = page->magic;

                munmap(page, MOEEP_CONTROL_PAGE_SIZE);
                return client_error_set(c, -EPROTO, "job control page has magic 0x%08x (expected 0x%08x)",
                                        magic, MOEEP_CONTROL_PAGE_MAGIC);
        }
        *ret_page = page;
        return 0;
}

static int client_simple_call(struct moeep_client *c, Moeep__V1__Request *req) {
        Moeep__V1__Response *resp;
        int r;

        r = client_call(c, req, MOEEP__V1__RESPONSE__BODY_OK, NULL, 0, &resp);
        if (r < 0)
                return r;
        moeep__v1__response__free_unpacked(resp, NULL);
        return 0;
}

static int client_leave_call(struct moeep_client *c) {
        Moeep__V1__JobLeave jl = MOEEP__V1__JOB_LEAVE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_LEAVE;
        req.job_leave = &jl;
        return client_simple_call(c, &req);
}

int moeep_job_join(struct moeep_client *c, const struct moeep_unique_id *id, int rank, int world_size,
                   const char *gpu_uuid) {
        Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        struct moeep_control_page *page = NULL;
        Moeep__V1__Response *resp;
        Moeep__V1__JobJoined *joined;
        size_t nfds;
        int *fds, r;

        if (!c)
                return -EINVAL;
        if (!id)
                return client_error_set(c, -EINVAL, "job join: unique id is NULL");
        r = check_world_size(c, world_size);
        if (r < 0)
                return r;
        if (rank < 0 || rank >= world_size)
                return client_error_set(c, -ERANGE, "rank %d is out of range (0..%d)", rank, world_size - 1);
        if (gpu_uuid && strlen(gpu_uuid) > MOEEP_GPU_UUID_MAX)
                return client_error_set(c, -EINVAL, "GPU UUID '%.80s' is longer than %d bytes", gpu_uuid,
                                        MOEEP_GPU_UUID_MAX);
        if (c->control_page)
                return client_error_set(c, -EISCONN, "this session already joined job %llu as rank %d",
                                        (unsigned long long)c->job_id, c->rank);

        /* The whole zero-padded id; the daemon ignores trailing zeros. */
        jj.unique_id.data = (uint8_t *)id->bytes;
        jj.unique_id.len = sizeof(id->bytes);
        jj.rank = (uint32_t)rank;
        jj.world_size = (uint32_t)world_size;
        jj.gpu_uuid = (char *)(gpu_uuid ? gpu_uuid : "");
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
        req.job_join = &jj;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_JOB_JOINED, NULL, 0, &resp);
        if (r < 0)
                return r;
        joined = resp->job_joined;
        fds = client_reply_fds(c, &nfds);
        if (joined->rank != (uint32_t)rank || joined->world_size != (uint32_t)world_size) {
                r = client_error_set(c, -EPROTO,
                                     "moeepd joined us as rank %u of %u, we asked for rank %d of %d",
                                     joined->rank, joined->world_size, rank, world_size);
                goto undo;
        }
        /* The record layer guarantees JobJoined carries exactly one fd. */
        r = control_page_map(c, fds[0], &page);
        if (r < 0)
                goto undo;
        c->control_page = page;
        c->job_id = joined->job_id;
        c->rank = rank;
        c->world_size = world_size;
        moeep__v1__response__free_unpacked(resp, NULL);
        moeep_record_release(c->rec);
        return 0;

undo:
        /* The daemon counts us as joined; leave, keeping the first error. */
        moeep__v1__response__free_unpacked(resp, NULL);
        {
                char saved[sizeof(c->error)];

                memcpy(saved, c->error, sizeof(saved));
                (void)client_leave_call(c);
                memcpy(c->error, saved, sizeof(saved));
        }
        return r;
}

int client_require_job(struct moeep_client *c, const char *what) {
        if (c->control_page)
                return 0;
        return client_error_set(c, -ENOTCONN, "%s: this session has not joined a job", what);
}

int moeep_job_leave(struct moeep_client *c) {
        int r;

        if (!c)
                return -EINVAL;
        r = client_require_job(c, "job leave");
        if (r < 0)
                return r;
        r = client_leave_call(c);
        /* Forget the job unless the daemon still counts us in it: when it says
         * we are not in a job, or is gone, there is nothing left to leave. */
        if (r == 0 || r == -ENOTCONN || c->broken)
                client_job_forget(c);
        return r;
}

int moeep_job_barrier(struct moeep_client *c) {
        Moeep__V1__Barrier b = MOEEP__V1__BARRIER__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        int r;

        if (!c)
                return -EINVAL;
        r = client_require_job(c, "barrier");
        if (r < 0)
                return r;
        req.body_case = MOEEP__V1__REQUEST__BODY_BARRIER;
        req.barrier = &b;
        return client_simple_call(c, &req);
}

int moeep_job_info(const struct moeep_client *c, uint64_t *ret_job_id, int *ret_rank, int *ret_world_size) {
        if (!c)
                return -EINVAL;
        if (!c->control_page)
                return -ENOTCONN;
        if (ret_job_id)
                *ret_job_id = c->job_id;
        if (ret_rank)
                *ret_rank = c->rank;
        if (ret_world_size)
                *ret_world_size = c->world_size;
        return 0;
}

int moeep_job_ranks(struct moeep_client *c, uint32_t *ret_local, uint32_t *ret_remote) {
        Moeep__V1__JobsList list = MOEEP__V1__JOBS_LIST__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        uint32_t local = 0, remote = 0;
        bool found = false;
        int r;

        if (!c)
                return -EINVAL;
        r = client_require_job(c, "job ranks");
        if (r < 0)
                return r;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOBS_LIST;
        req.jobs_list = &list;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_JOBS, NULL, 0, &resp);
        if (r < 0)
                return r;
        for (size_t i = 0; i < resp->jobs->n_jobs && !found; i++) {
                const Moeep__V1__JobInfo *ji = resp->jobs->jobs[i];

                if (ji->job_id != c->job_id)
                        continue;
                found = true;
                for (size_t k = 0; k < ji->n_joined_ranks; k++)
                        if (ji->joined_ranks[k] < 32)
                                local |= 1u << ji->joined_ranks[k];
                for (size_t k = 0; k < ji->n_remote_ranks; k++)
                        if (ji->remote_ranks[k] < 32)
                                remote |= 1u << ji->remote_ranks[k];
        }
        moeep__v1__response__free_unpacked(resp, NULL);
        if (!found)
                return client_error_set(c, -ENOTCONN, "job ranks: the daemon lists no job %" PRIu64,
                                        c->job_id);
        if (ret_local)
                *ret_local = local & ~remote;
        if (ret_remote)
                *ret_remote = remote;
        return 0;
}

const volatile struct moeep_control_page *moeep_job_control_page(const struct moeep_client *c) {
        return c ? c->control_page : NULL;
}

void *client_job_data(const struct moeep_client *c) {
        return c->job_data;
}

void client_job_data_set(struct moeep_client *c, void *data, void (*free_fn)(void *data)) {
        c->job_data = data;
        c->job_data_free = free_fn;
}
