/* moeep_fast: moeep.Buffer's low-latency dispatch and combine in C for the
 * common case, so that a decode step does not pay for the Python layer's
 * per-call work (argument checks, a ctypes call, tuples of outputs): on a
 * slow host that was most of the step's host time.
 *
 * The common case: a call on the stream of the last call (moeep/buffer.py,
 * Buffer._begin, tells us that stream), without hook, async_finish, UE8M0
 * scales or shrink arguments, with plain torch.Tensor arguments, and with
 * outputs and handles the Python path already made for both buffer sets
 * (it hands them over after each of its calls, remember()). Anything else
 * returns None before any GPU work and the caller runs the Python path
 * (moeep/_low_latency.py), which makes the same checks and raises the
 * errors with their messages. The checks here must never be weaker than
 * the Python path's.
 *
 * Built with Python's limited API (3.10), so that one file serves every
 * Python that torch runs on; it needs no torch headers (tensors are read
 * through their Python attributes) and no link to libmoeep (the Python
 * layer passes the addresses of libmoeep's functions from the library
 * it loaded, so both paths call the same copy). */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "moeep_ep.h"

typedef int (*ll_dispatch_fn)(struct moeep_ep *, const struct moeep_ll_dispatch_args *,
                              struct moeep_ll_dispatch_result *, struct moeep_ll_hook *, cudaStream_t);
typedef int (*ll_combine_fn)(struct moeep_ep *, const struct moeep_ll_combine_args *, struct moeep_ll_hook *,
                             cudaStream_t);

enum {
        MAX_DIMS = 3,
        SETS = 2
};

/* What the Python path made for one low-latency buffer set, for dispatches
 * of num_max tokens per rank at most. All references owned. */
struct set_cache {
        int num_max;        /* 0: nothing yet */
        PyObject *rx[2];    /* [use_fp8]: recv_x, or the tuple (recv_x, scales) */
        PyObject *count[2]; /* [use_fp8]: recv_count */
        PyObject **handles; /* [tokens 0..ll_max]: the LowLatencyHandle, or NULL */
        PyObject *last;     /* the handle of the last dispatch into this set (borrowed from handles) */
        int last_tokens;
};

struct fast {
        PyObject ob_base;    /* PyObject_HEAD */
        struct moeep_ep *ep; /* NULL once closed: every call goes to Python */
        ll_dispatch_fn dispatch;
        ll_combine_fn combine;
        int device, ranks, hidden, num_experts, local_experts, ll_max;
        int max_topk;          /* the Python path's bound on top-k (moeep/_lib.py, MAX_TOPK) */
        uintptr_t last_stream; /* Buffer._last_stream, set by Python (note_stream) */
        unsigned long long dispatches, combines; /* calls made here (counts()) */
        struct set_cache sets[SETS];
        /* Owned references, from the constructor. */
        PyObject *check;       /* Endpoint.check(r, what): raises MoeepError */
        PyObject *tensor_type; /* torch.Tensor: arguments of exactly this type only */
        PyObject *bf16, *fp8, *f32, *i32, *i64;
        PyObject *raw_stream;   /* torch._C._cuda_getCurrentRawStream(device) */
        PyObject *device_index; /* the int device, its argument */
        PyObject *mode_enabled; /* torch._C._is_torch_function_mode_enabled() */
        PyObject *no_function;  /* torch._C.DisableTorchFunction */
        PyObject *empty;        /* torch.empty */
        PyObject *empty_kw;     /* {dtype: bfloat16, device: the Buffer's} */
        PyObject *no_event;     /* the EventOverlap(None) calls without async_finish return */
};

static PyObject *s_dtype, *s_shape, *s_get_device, *s_is_contiguous, *s_data_ptr, *s_enter, *s_exit;

/* The attributes of a tensor argument that the checks need. */
struct tensor {
        PyObject *dtype; /* borrowed from one of struct fast's dtypes */
        int dims;
        long shape[MAX_DIMS];
        void *ptr;
};

/* Returns 1 and fills *t when `obj` is a contiguous torch.Tensor (exactly)
 * on our device with at most MAX_DIMS dimensions; 0 when not (the Python
 * path will say why); -1 with an exception set when reading failed. */
static int tensor_read(struct fast *f, PyObject *obj, struct tensor *t) {
        PyObject *v;
        int ok = 0;

        if ((PyObject *)Py_TYPE(obj) != f->tensor_type)
                return 0;
        if (!(v = PyObject_GetAttr(obj, s_dtype)))
                return -1;
        t->dtype = v == f->bf16  ? f->bf16
                   : v == f->fp8 ? f->fp8
                   : v == f->f32 ? f->f32
                   : v == f->i32 ? f->i32
                   : v == f->i64 ? f->i64
                                 : NULL;
        Py_DECREF(v);
        if (!t->dtype)
                return 0;
        if (!(v = PyObject_GetAttr(obj, s_shape)))
                return -1;
        t->dims = (int)PyTuple_Size(v); /* torch.Size is a tuple */
        if (t->dims < 1 || t->dims > MAX_DIMS) {
                Py_DECREF(v);
                return t->dims < 0 ? -1 : 0;
        }
        for (int i = 0; i < t->dims; i++)
                t->shape[i] = PyLong_AsLong(PyTuple_GetItem(v, i));
        Py_DECREF(v);
        if (PyErr_Occurred())
                return -1;

        if (!(v = PyObject_CallMethodObjArgs(obj, s_get_device, NULL)))
                return -1;
        ok = PyLong_Check(v) && PyLong_AsLong(v) == f->device;
        Py_DECREF(v);
        if (!ok)
                return PyErr_Occurred() ? -1 : 0;
        if (!(v = PyObject_CallMethodObjArgs(obj, s_is_contiguous, NULL)))
                return -1;
        ok = v == Py_True;
        Py_DECREF(v);
        if (!ok)
                return 0;
        if (!(v = PyObject_CallMethodObjArgs(obj, s_data_ptr, NULL)))
                return -1;
        t->ptr = PyLong_AsVoidPtr(v);
        Py_DECREF(v);
        return PyErr_Occurred() ? -1 : 1;
}

/* As tensor_read, and the tensor must be of `dtype` with `dims`
 * dimensions (shape[i] >= 0 must match too). */
static int tensor_expect(struct fast *f, PyObject *obj, struct tensor *t, PyObject *dtype, int dims,
                         const long *shape) {
        int r = tensor_read(f, obj, t);

        if (r <= 0)
                return r;
        if (t->dtype != dtype || t->dims != dims)
                return 0;
        for (int i = 0; shape && i < dims; i++)
                if (shape[i] >= 0 && t->shape[i] != shape[i])
                        return 0;
        return 1;
}

/* Top-k ids: int64 or int32, [rows][1..MAX_TOPK]. */
static int index_read(struct fast *f, PyObject *obj, struct tensor *t, long rows) {
        int r = tensor_read(f, obj, t);

        if (r <= 0)
                return r;
        return (t->dtype == f->i64 || t->dtype == f->i32) && t->dims == 2 && t->shape[0] == rows &&
               t->shape[1] >= 1 && t->shape[1] <= f->max_topk;
}

/* A Python int that is not a bool and fits a long, into *ret; false when
 * not one (the Python path says what is wrong with it). */
static bool int_arg(PyObject *obj, long *ret) {
        if (!PyLong_Check(obj) || PyBool_Check(obj))
                return false;
        *ret = PyLong_AsLong(obj);
        if (PyErr_Occurred()) {
                PyErr_Clear(); /* too large: not the common case */
                return false;
        }
        return true;
}

/* The torch function handling of the tensor reads: off while a mode is
 * active (torch.set_default_device installs one), as the Python path's
 * _as_binding does; a mode would turn every read into a Python call.
 * Returns the context to leave (NULL: none was entered), or sets *err. */
static PyObject *function_off(struct fast *f, bool *err) {
        PyObject *on = PyObject_CallNoArgs(f->mode_enabled), *ctx, *r;

        *err = false;
        if (!on) {
                *err = true;
                return NULL;
        }
        if (on != Py_True) {
                Py_DECREF(on);
                return NULL;
        }
        Py_DECREF(on);
        if (!(ctx = PyObject_CallNoArgs(f->no_function)) ||
            !(r = PyObject_CallMethodObjArgs(ctx, s_enter, NULL))) {
                Py_XDECREF(ctx);
                *err = true;
                return NULL;
        }
        Py_DECREF(r);
        return ctx;
}

/* Leaves the context of function_off (keeping an exception that is set). */
static void function_on(PyObject *ctx) {
        PyObject *type, *value, *tb, *r;

        if (!ctx)
                return;
        PyErr_Fetch(&type, &value, &tb);
        r = PyObject_CallMethodObjArgs(ctx, s_exit, Py_None, Py_None, Py_None, NULL);
        Py_XDECREF(r);
        if (type)
                PyErr_Restore(type, value, tb);
        Py_DECREF(ctx);
}

/* The caller's current stream if it is the stream of the last call (1),
 * else 0; -1 with an exception. */
static int stream_read(struct fast *f, cudaStream_t *ret) {
        PyObject *v = PyObject_CallFunctionObjArgs(f->raw_stream, f->device_index, NULL);
        uintptr_t s;

        if (!v)
                return -1;
        s = (uintptr_t)PyLong_AsVoidPtr(v);
        Py_DECREF(v);
        if (PyErr_Occurred())
                return -1;
        *ret = (cudaStream_t)s;
        return s == f->last_stream;
}

/* Raises the endpoint's error for a libmoeep call that returned r < 0. */
static PyObject *raise_error(struct fast *f, int r, const char *what) {
        PyObject *v = PyObject_CallFunction(f->check, "is", r, what);

        Py_XDECREF(v);
        if (!PyErr_Occurred())
                PyErr_Format(PyExc_RuntimeError, "%s failed (%d)", what, r);
        return NULL;
}

/* The start of dispatch and combine: 1 when the call may run here, 0 when
 * it goes to Python (the endpoint is closed), -1 with an exception. */
static int call_start(const struct fast *f, Py_ssize_t n, Py_ssize_t want, const char *what) {
        if (n != want) {
                PyErr_Format(PyExc_TypeError, "moeep_fast %s takes %zd arguments", what, want);
                return -1;
        }
        return f->ep != NULL;
}

/* The end of dispatch and combine: leaves function_off's context; returns
 * `ret`, or None where the call was not the common case (no result and no
 * exception). */
static PyObject *call_end(PyObject *ctx, PyObject *ret) {
        function_on(ctx);
        if (ret || PyErr_Occurred())
                return ret;
        Py_RETURN_NONE;
}

/* dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
 *          cumulative_local_expert_recv_stats, use_fp8, round_scale)
 * -> (recv_x, recv_count, handle, event, None) as low_latency_dispatch, or
 * None: not the common case, run the Python path. */
static PyObject *fast_dispatch(PyObject *self, PyObject *const *args, Py_ssize_t n) {
        struct fast *f = (struct fast *)self;
        struct tensor x, idx, stats = { 0 };
        long num_max, num_experts;
        int use_fp8, round_scale, r;
        cudaStream_t stream;
        PyObject *ctx, *ret = NULL;
        bool err;

        if ((r = call_start(f, n, 7, "dispatch")) <= 0)
                return r < 0 ? NULL : Py_NewRef(Py_None);
        if (!int_arg(args[2], &num_max) || !int_arg(args[3], &num_experts))
                Py_RETURN_NONE;
        if ((use_fp8 = PyObject_IsTrue(args[5])) < 0 || (round_scale = PyObject_IsTrue(args[6])) < 0)
                return NULL;
        if (num_max < 1 || num_max > f->ll_max || num_experts != f->num_experts || (round_scale && !use_fp8))
                Py_RETURN_NONE;

        ctx = function_off(f, &err);
        if (err)
                return NULL;
        const long x_shape[2] = { -1, f->hidden };
        const long stats_shape[1] = { f->local_experts };
        if (tensor_expect(f, args[0], &x, f->bf16, 2, x_shape) <= 0 || x.shape[0] < 1 ||
            x.shape[0] > num_max || index_read(f, args[1], &idx, x.shape[0]) <= 0 ||
            (args[4] != Py_None && tensor_expect(f, args[4], &stats, f->i32, 1, stats_shape) <= 0) ||
            stream_read(f, &stream) <= 0)
                goto out;

        /* Both sets must have their outputs and the handle for these tokens:
         * the call picks the set. */
        const int T = (int)x.shape[0];
        for (int s = 0; s < SETS; s++) {
                const struct set_cache *c = &f->sets[s];
                if (c->num_max != num_max || !c->rx[use_fp8] || !c->handles[T])
                        goto out;
        }

        const struct moeep_ll_dispatch_args a = {
                .x = x.ptr,
                .num_tokens = T,
                .topk_idx = idx.ptr,
                .topk_idx_type = idx.dtype == f->i64 ? MOEEP_INDEX_INT64 : MOEEP_INDEX_INT32,
                .num_topk = (int)idx.shape[1],
                .use_fp8 = use_fp8,
                .round_scale = round_scale,
                .cumulative_local_expert_recv_stats = stats.ptr,
                .num_max_tokens = (int)num_max,
        };
        struct moeep_ll_dispatch_result res;
        struct moeep_ll_hook hook;
        if ((r = f->dispatch(f->ep, &a, &res, &hook, stream)) < 0) {
                raise_error(f, r, "low_latency_dispatch");
                goto out;
        }
        f->dispatches++;
        struct set_cache *c = &f->sets[res.handle.set & 1];
        c->last = c->handles[T];
        c->last_tokens = T;
        ret = PyTuple_Pack(5, c->rx[use_fp8], c->count[use_fp8], c->last, f->no_event, Py_None);
out:
        return call_end(ctx, ret);
}

/* combine(x, topk_idx, topk_weights, handle, zero_copy, out)
 * -> (combined_x, event, None) as low_latency_combine, or None: not the
 * common case (the handle must be of the last dispatch into its set). */
static PyObject *fast_combine(PyObject *self, PyObject *const *args, Py_ssize_t n) {
        struct fast *f = (struct fast *)self;
        struct tensor x, idx, w, out;
        cudaStream_t stream;
        PyObject *ctx, *ret = NULL, *outobj = NULL;
        int set, T, S, r;
        bool err;

        if ((r = call_start(f, n, 6, "combine")) <= 0)
                return r < 0 ? NULL : Py_NewRef(Py_None);
        if ((r = PyObject_IsTrue(args[4])) != 0)
                return r < 0 ? NULL : Py_NewRef(Py_None);
        for (set = 0; set < SETS && (!f->sets[set].last || args[3] != f->sets[set].last); set++)
                ;
        if (set == SETS)
                Py_RETURN_NONE;
        T = f->sets[set].last_tokens;
        S = f->ranks * f->sets[set].num_max;

        ctx = function_off(f, &err);
        if (err)
                return NULL;
        const long x_shape[3] = { f->local_experts, S, f->hidden };
        if (tensor_expect(f, args[0], &x, f->bf16, 3, x_shape) <= 0 || index_read(f, args[1], &idx, T) <= 0)
                goto out;
        const long w_shape[2] = { T, idx.shape[1] }, out_shape[2] = { T, f->hidden };
        if (tensor_expect(f, args[2], &w, f->f32, 2, w_shape) <= 0 ||
            (args[5] != Py_None && tensor_expect(f, args[5], &out, f->bf16, 2, out_shape) <= 0) ||
            stream_read(f, &stream) <= 0)
                goto out;
        if (args[5] != Py_None) {
                outobj = Py_NewRef(args[5]);
        } else {
                /* A new tensor, as DeepEP's: torch.empty(T, hidden, dtype=,
                 * device=) (sizes as separate ints: torch parses those
                 * fastest). */
                PyObject *size = Py_BuildValue("(ii)", T, f->hidden), *p;
                if (!size)
                        goto out;
                outobj = PyObject_Call(f->empty, size, f->empty_kw);
                Py_DECREF(size);
                if (!outobj || !(p = PyObject_CallMethodObjArgs(outobj, s_data_ptr, NULL)))
                        goto out;
                out.ptr = PyLong_AsVoidPtr(p);
                Py_DECREF(p);
                if (PyErr_Occurred())
                        goto out;
        }

        const struct moeep_ll_handle h = { .set = set, .num_tokens = T, .slots_per_expert = S };
        const struct moeep_ll_combine_args a = {
                .x = x.ptr,
                .topk_idx = idx.ptr,
                .topk_idx_type = idx.dtype == f->i64 ? MOEEP_INDEX_INT64 : MOEEP_INDEX_INT32,
                .topk_weights = w.ptr,
                .num_topk = (int)idx.shape[1],
                .handle = &h,
                .out = out.ptr,
        };
        struct moeep_ll_hook hook;
        if ((r = f->combine(f->ep, &a, &hook, stream)) < 0) {
                raise_error(f, r, "low_latency_combine");
                goto out;
        }
        f->combines++;
        ret = PyTuple_Pack(3, outobj, f->no_event, Py_None);
out:
        Py_XDECREF(outobj);
        return call_end(ctx, ret);
}

static void set_clear(struct set_cache *c, int ll_max) {
        for (int i = 0; i < 2; i++) {
                Py_CLEAR(c->rx[i]);
                Py_CLEAR(c->count[i]);
        }
        for (int t = 0; c->handles && t <= ll_max; t++)
                Py_CLEAR(c->handles[t]);
        c->num_max = 0;
        c->last = NULL;
}

/* Stores a new reference to `obj` in *slot, dropping the old one. */
static void replace(PyObject **slot, PyObject *obj) {
        PyObject *old = *slot;

        *slot = Py_NewRef(obj);
        Py_XDECREF(old);
}

/* remember(set, num_max, tokens, use_fp8, recv_x, recv_count, handle): what
 * the Python path returned for a common-case dispatch, for the calls here. */
static PyObject *fast_remember(PyObject *self, PyObject *const *args, Py_ssize_t n) {
        struct fast *f = (struct fast *)self;
        long set, num_max, tokens;
        int use_fp8;

        if (n != 7) {
                PyErr_SetString(PyExc_TypeError, "moeep_fast remember takes 7 arguments");
                return NULL;
        }
        if (!int_arg(args[0], &set) || !int_arg(args[1], &num_max) || !int_arg(args[2], &tokens) ||
            (use_fp8 = PyObject_IsTrue(args[3])) < 0) {
                if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_TypeError,
                                        "moeep_fast remember: set, num_max, tokens are ints");
                return NULL;
        }
        if (set < 0 || set >= SETS || num_max < 1 || num_max > f->ll_max || tokens < 1 || tokens > num_max) {
                PyErr_Format(PyExc_ValueError, "moeep_fast remember: set %ld, num_max %ld, tokens %ld", set,
                             num_max, tokens);
                return NULL;
        }
        struct set_cache *c = &f->sets[set];
        if (c->num_max != num_max) {
                set_clear(c, f->ll_max);
                c->num_max = (int)num_max;
        }
        replace(&c->rx[use_fp8], args[4]);
        replace(&c->count[use_fp8], args[5]);
        replace(&c->handles[tokens], args[6]);
        c->last = c->handles[tokens];
        c->last_tokens = (int)tokens;
        Py_RETURN_NONE;
}

/* note_stream(raw): the stream of the call Python just made (_begin). */
static PyObject *fast_note_stream(PyObject *self, PyObject *arg) {
        struct fast *f = (struct fast *)self;
        void *p = PyLong_AsVoidPtr(arg);

        if (PyErr_Occurred())
                return NULL;
        f->last_stream = (uintptr_t)p;
        Py_RETURN_NONE;
}

/* counts() -> (dispatches, combines) made here so far. */
static PyObject *fast_counts(PyObject *self, PyObject *unused) {
        struct fast *f = (struct fast *)self;

        (void)unused;
        return Py_BuildValue("(KK)", f->dispatches, f->combines);
}

/* close(): forgets the endpoint and every cached object (Buffer.destroy). */
static PyObject *fast_close(PyObject *self, PyObject *unused) {
        struct fast *f = (struct fast *)self;

        (void)unused;
        f->ep = NULL;
        for (int s = 0; s < SETS; s++)
                set_clear(&f->sets[s], f->ll_max);
        Py_RETURN_NONE;
}

static void fast_dealloc(PyObject *self) {
        struct fast *f = (struct fast *)self;
        PyTypeObject *type = Py_TYPE(self);

        for (int s = 0; s < SETS; s++) {
                set_clear(&f->sets[s], f->ll_max);
                free(f->sets[s].handles);
        }
        Py_XDECREF(f->check);
        Py_XDECREF(f->tensor_type);
        Py_XDECREF(f->bf16);
        Py_XDECREF(f->fp8);
        Py_XDECREF(f->f32);
        Py_XDECREF(f->i32);
        Py_XDECREF(f->i64);
        Py_XDECREF(f->raw_stream);
        Py_XDECREF(f->device_index);
        Py_XDECREF(f->mode_enabled);
        Py_XDECREF(f->no_function);
        Py_XDECREF(f->empty);
        Py_XDECREF(f->empty_kw);
        Py_XDECREF(f->no_event);
        ((freefunc)PyType_GetSlot(type, Py_tp_free))(self);
        Py_DECREF(type);
}

/* LowLatency(ep, dispatch, combine, check, torch, device, ranks, hidden,
 *            num_experts, ll_max, max_topk, no_event): ep and the two functions as
 * addresses (ints) from the ctypes binding; check the Endpoint's check
 * method; torch the module. */
static PyObject *fast_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
        PyObject *ep, *dsp, *cmb, *check, *torch, *no_event, *C = NULL;
        int device, ranks, hidden, num_experts, ll_max, max_topk;
        struct fast *f;

        if (kw && PyDict_Size(kw)) {
                PyErr_SetString(PyExc_TypeError, "moeep_fast.LowLatency takes no keyword arguments");
                return NULL;
        }
        if (!PyArg_ParseTuple(args, "OOOOOiiiiiiO", &ep, &dsp, &cmb, &check, &torch, &device, &ranks, &hidden,
                              &num_experts, &ll_max, &max_topk, &no_event))
                return NULL;
        if (ranks < 1 || hidden < 1 || num_experts < ranks || num_experts % ranks || ll_max < 1 ||
            ll_max > MOEEP_LL_MAX_TOKENS || max_topk < 1) {
                PyErr_Format(PyExc_ValueError,
                             "moeep_fast.LowLatency: ranks %d, hidden %d, experts %d, ll_max %d, max_topk %d",
                             ranks, hidden, num_experts, ll_max, max_topk);
                return NULL;
        }
        if (!(f = (struct fast *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0)))
                return NULL;
        f->ep = PyLong_AsVoidPtr(ep);
        f->dispatch = (ll_dispatch_fn)PyLong_AsVoidPtr(dsp);
        f->combine = (ll_combine_fn)PyLong_AsVoidPtr(cmb);
        if (PyErr_Occurred() || !f->ep || !f->dispatch || !f->combine) {
                if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_ValueError,
                                        "moeep_fast.LowLatency: a NULL endpoint or function");
                goto fail;
        }
        f->device = device;
        f->ranks = ranks;
        f->hidden = hidden;
        f->num_experts = num_experts;
        f->local_experts = num_experts / ranks;
        f->ll_max = ll_max;
        f->max_topk = max_topk;
        f->last_stream = UINTPTR_MAX; /* no call yet: matches no stream */
        for (int s = 0; s < SETS; s++)
                if (!(f->sets[s].handles = calloc((size_t)ll_max + 1, sizeof(PyObject *)))) {
                        PyErr_NoMemory();
                        goto fail;
                }
        f->check = Py_NewRef(check);
        f->no_event = Py_NewRef(no_event);
        if (!(C = PyObject_GetAttrString(torch, "_C")) ||
            !(f->tensor_type = PyObject_GetAttrString(torch, "Tensor")) ||
            !(f->bf16 = PyObject_GetAttrString(torch, "bfloat16")) ||
            !(f->fp8 = PyObject_GetAttrString(torch, "float8_e4m3fn")) ||
            !(f->f32 = PyObject_GetAttrString(torch, "float32")) ||
            !(f->i32 = PyObject_GetAttrString(torch, "int32")) ||
            !(f->i64 = PyObject_GetAttrString(torch, "int64")) ||
            !(f->raw_stream = PyObject_GetAttrString(C, "_cuda_getCurrentRawStream")) ||
            !(f->mode_enabled = PyObject_GetAttrString(C, "_is_torch_function_mode_enabled")) ||
            !(f->no_function = PyObject_GetAttrString(C, "DisableTorchFunction")) ||
            !(f->empty = PyObject_GetAttrString(torch, "empty")) ||
            !(f->device_index = PyLong_FromLong(device)))
                goto fail;
        PyObject *dev = PyObject_CallMethod(torch, "device", "si", "cuda", device);
        if (!dev)
                goto fail;
        f->empty_kw = Py_BuildValue("{sOsO}", "dtype", f->bf16, "device", dev);
        Py_DECREF(dev);
        if (!f->empty_kw)
                goto fail;
        Py_DECREF(C);
        return (PyObject *)f;
fail:
        Py_XDECREF(C);
        Py_DECREF(f);
        return NULL;
}

static PyMethodDef fast_methods[] = {
        { "dispatch", (PyCFunction)(void (*)(void))fast_dispatch, METH_FASTCALL, NULL },
        { "combine", (PyCFunction)(void (*)(void))fast_combine, METH_FASTCALL, NULL },
        { "remember", (PyCFunction)(void (*)(void))fast_remember, METH_FASTCALL, NULL },
        { "note_stream", fast_note_stream, METH_O, NULL },
        { "counts", fast_counts, METH_NOARGS, NULL },
        { "close", fast_close, METH_NOARGS, NULL },
        { NULL, NULL, 0, NULL },
};

static PyType_Slot fast_slots[] = {
        { Py_tp_new, fast_new },
        { Py_tp_dealloc, fast_dealloc },
        { Py_tp_methods, fast_methods },
        { Py_tp_doc, "moeep.Buffer's low-latency calls in C, for the common case (moeep/_low_latency.py)" },
        { 0, NULL },
};

static PyType_Spec fast_spec = {
        .name = "moeep_fast.LowLatency",
        .basicsize = sizeof(struct fast),
        .flags = Py_TPFLAGS_DEFAULT,
        .slots = fast_slots,
};

static int fast_module_exec(PyObject *m) {
        PyObject *type;

        if (!(s_dtype = PyUnicode_InternFromString("dtype")) ||
            !(s_shape = PyUnicode_InternFromString("shape")) ||
            !(s_get_device = PyUnicode_InternFromString("get_device")) ||
            !(s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) ||
            !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
            !(s_enter = PyUnicode_InternFromString("__enter__")) ||
            !(s_exit = PyUnicode_InternFromString("__exit__")))
                return -1;
        if (!(type = PyType_FromSpec(&fast_spec)))
                return -1;
        if (PyModule_AddObject(m, "LowLatency", type) < 0) {
                Py_DECREF(type);
                return -1;
        }
        return PyModule_AddIntConstant(m, "ABI", 1);
}

static PyModuleDef_Slot module_slots[] = {
        { Py_mod_exec, fast_module_exec },
        { 0, NULL },
};

static struct PyModuleDef module = {
        PyModuleDef_HEAD_INIT,
        .m_name = "moeep_fast",
        .m_doc = "moeep.Buffer's low-latency calls in C (see moeep/_low_latency.py)",
        .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit_moeep_fast(void); /* the one symbol Python looks up */

PyMODINIT_FUNC PyInit_moeep_fast(void) {
        return PyModuleDef_Init(&module);
}
