// Contexts: the OpenCL context, device and in-order queue clmha works on, its program cache and
// its last error message.
#include "internal.h"
#include "tuning.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <clblast_c.h>

static _Thread_local char create_error[CLMHA__ERROR_SIZE];

const char *clmha_last_create_error(void) { return create_error; }

clmha_status clmha__fail(const clmha_context *ctx, clmha_status status, const char *fmt, ...) {
    char buf[CLMHA__ERROR_SIZE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (!ctx) {
        memcpy(create_error, buf, sizeof buf);
        return status;
    }
    clmha_context *c = (clmha_context *)ctx;  // the message is mutable state of the context
    pthread_mutex_lock(&c->lock);
    memcpy(c->last_error, buf, sizeof buf);
    pthread_mutex_unlock(&c->lock);
    return status;
}

const char *clmha_context_last_error(const clmha_context *ctx) {
    if (!ctx) return "ctx is NULL";
    // Another thread may record an error at any time: hand out this thread's copy, taken under
    // the lock, rather than the context's buffer.
    static _Thread_local char copy[CLMHA__ERROR_SIZE];
    clmha_context *c = (clmha_context *)ctx;
    pthread_mutex_lock(&c->lock);
    memcpy(copy, c->last_error, sizeof copy);
    pthread_mutex_unlock(&c->lock);
    return copy;
}

// Fills the fields common to both constructors once cl_ctx, device and queue are set.
static clmha_status context_finish(clmha_context *c) {
    cl_platform_id platform = NULL;
    clGetDeviceInfo(c->device, CL_DEVICE_PLATFORM, sizeof platform, &platform, NULL);
    clmha__device_describe(platform, c->device, 0, 0, &c->info);
    snprintf(c->info.spec, sizeof c->info.spec, "-");
    snprintf(c->device_name, sizeof c->device_name, "%s / %s", c->info.platform_name,
             c->info.device_name);
    c->quirks = clmha__device_quirks(&c->info);
    c->max_work_group = 1;
    clGetDeviceInfo(c->device, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof c->max_work_group,
                    &c->max_work_group, NULL);
    c->cls = clmha__device_class_of(c->device, c->info.type, c->info.platform_name);
    cl_int err;
    c->dummy = clCreateBuffer(c->cl_ctx, CL_MEM_READ_WRITE, 16, NULL, &err);
    clmha__held_new(CLMHA__HELD_MEM, c->dummy);
    if (err != CL_SUCCESS) return clmha__cl_fail(NULL, err, "clCreateBuffer(dummy)");
    clmha__tuning_apply_stored(c);  // never fails: an unusable file is noted and ignored
    return CLMHA_SUCCESS;
}

size_t clmha__fused_default_vw(const clmha_context *ctx) {
    if (ctx->cls->vw) return ctx->cls->vw;
    // The native width, not the preferred one: Intel's oneAPI CPU runtime prefers 1 but is
    // native 16 (5.5x faster with 16); PoCL on AVX-512 reports 16 for both.
    cl_uint native = 1;
    clGetDeviceInfo(ctx->device, CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT, sizeof native, &native,
                    NULL);
    return native ? native : 1;
}

clmha__fused_tiles clmha__fused_tiles_for(const clmha_context *ctx, size_t hd) {
    // The device class's defaults (src/device_class.c), unless a stored tuning has its own.
    const clmha__device_class *cls = ctx->cls;
    size_t pref_tiles[CLMHA__FUSED_PARAMS] = {0};  // BQ, BK, RPW, VW of a stored tuning
    clmha__tuning_fused(ctx->device, pref_tiles);
    clmha__fused_tiles t = {.bq = pref_tiles[0] ? pref_tiles[0] : cls->bq,
                            .bk = pref_tiles[1] ? pref_tiles[1] : cls->bk,
                            .rpw = pref_tiles[2] ? pref_tiles[2] : cls->rpw,
                            .vw = pref_tiles[3] ? pref_tiles[3] : clmha__fused_default_vw(ctx)};
    clmha__fused_tiles_fit(ctx, hd, &t);
    return t;
}

// Lower limits set by tests, 0 for none (clmha__test_set_kernel_limits()).
static size_t test_kernel_wg, test_local_mem;

void clmha__test_set_kernel_limits(size_t work_group, size_t local_mem) {
    test_kernel_wg = work_group;
    test_local_mem = local_mem;
}

cl_ulong clmha__local_mem(const clmha_context *ctx) {
    cl_ulong device = ctx->info.local_mem_bytes;
    return test_local_mem && test_local_mem < device ? (cl_ulong)test_local_mem : device;
}

clmha_status clmha__kernel_limits(const clmha_context *ctx, cl_kernel k, size_t *work_group,
                                  cl_ulong *local_mem) {
    size_t wg = 0;
    cl_ulong lm = 0;
    cl_int err = clGetKernelWorkGroupInfo(k, ctx->device, CL_KERNEL_WORK_GROUP_SIZE, sizeof wg,
                                          &wg, NULL);
    if (err == CL_SUCCESS)
        err = clGetKernelWorkGroupInfo(k, ctx->device, CL_KERNEL_LOCAL_MEM_SIZE, sizeof lm, &lm,
                                       NULL);
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clGetKernelWorkGroupInfo");
    if (wg > ctx->max_work_group) wg = ctx->max_work_group;
    if (test_kernel_wg && test_kernel_wg < wg) wg = test_kernel_wg;
    *work_group = wg ? wg : 1;
    if (local_mem) *local_mem = lm;
    return CLMHA_SUCCESS;
}

void clmha__fused_tiles_fit(const clmha_context *ctx, size_t hd, clmha__fused_tiles *t) {
    clmha__fused_tiles_fit_limits(ctx->cls, clmha__local_mem(ctx), ctx->max_work_group, hd, t);
    if (ctx->quirks.no_vload) t->vw = 1;  // Clover aborts on vloadN (tools/driver-bugs)
}

void clmha__fused_tiles_fit_limits(const clmha__device_class *cls, cl_ulong local_mem,
                                   size_t max_wg, size_t hd, clmha__fused_tiles *t) {
    // Leave room for what the compiler adds to local memory.
    cl_ulong local = local_mem > 1024 ? (local_mem - 1024) / sizeof(float) : 0;  // floats
    size_t bq = 1;
    while (bq * 2 <= t->bq && bq * 2 <= max_wg) bq *= 2;
    t->bq = bq;
    if (!t->rpw) t->rpw = 1;
    t->q_local = cls->coalesced;
    t->acc_local = false;
    // Private arrays within the class's budget, so that they stay in registers: one row per
    // work-item, then fewer keys per tile (down to 8), then the query rows in local memory,
    // then the accumulators too.
    while (clmha__fused_private_floats(t, hd) > cls->private_floats) {
        if (t->rpw > 1) --t->rpw;
        else if (t->bk > 8) t->bk /= 2;
        else if (!t->q_local) t->q_local = true;
        else if (!t->acc_local) t->acc_local = true;
        else if (t->bk > 1) t->bk /= 2;
        else break;
    }
    // Local memory: fewer keys per tile (down to 8), then smaller work-groups where query rows
    // live in local memory (down to 32), then anything that helps; bk 0 when nothing fits.
    while (t->bk > 0 && clmha__fused_local_floats(t, hd) > local) {
        bool rows_local = t->q_local || t->acc_local;
        if (t->bk > 8) t->bk /= 2;
        else if (rows_local && t->bq > 32) t->bq /= 2;
        else if (t->bk > 1) t->bk /= 2;
        else if (rows_local && t->bq > 1) t->bq /= 2;
        else t->bk = 0;
    }
    size_t want = t->vw;
    t->vw = 16;
    while (t->vw > 1 && (t->vw > want || hd % t->vw || (t->bk && t->bk % t->vw))) t->vw /= 2;
}

static clmha_context *context_alloc(void) {
    clmha_context *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->refcount = 1;
    pthread_mutex_init(&c->lock, NULL);
    return c;
}

clmha_status clmha_context_create(clmha_context **out, const char *spec) {
    if (!out) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    clmha_device_info info = {.struct_size = sizeof info};
    char msg[CLMHA__ERROR_SIZE];
    clmha_status st = clmha_device_select(spec, &info, msg, sizeof msg);
    if (st) return clmha__fail(NULL, st, "%s", msg);

    clmha_context *c = context_alloc();
    if (!c) return clmha__fail(NULL, CLMHA_OUT_OF_MEMORY, "out of host memory");
    cl_int err;
    cl_context_properties props[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)info.platform,
                                     0};
    c->device = info.device;
    c->cl_ctx = clCreateContext(props, 1, &info.device, NULL, NULL, &err);
    clmha__held_new(CLMHA__HELD_CONTEXT, c->cl_ctx);
    if (err != CL_SUCCESS) {
        st = clmha__cl_fail(NULL, err, "clCreateContext");
        goto fail;
    }
    c->queue = clCreateCommandQueue(c->cl_ctx, info.device, CL_QUEUE_PROFILING_ENABLE, &err);
    clmha__held_new(CLMHA__HELD_QUEUE, c->queue);
    if (err != CL_SUCCESS) {
        st = clmha__cl_fail(NULL, err, "clCreateCommandQueue");
        goto fail;
    }
    if ((st = context_finish(c))) goto fail;
    c->info.platform_index = info.platform_index;
    c->info.device_index = info.device_index;
    snprintf(c->info.spec, sizeof c->info.spec, "%s", info.spec);
    *out = c;
    return CLMHA_SUCCESS;
fail:
    clmha_context_release(c);
    return st;
}

clmha_status clmha_context_create_from_env(clmha_context **out) {
    return clmha_context_create(out, getenv("CLMHA_DEVICE"));
}

clmha_status clmha_context_create_from_cl(clmha_context **out, cl_context context,
                                          cl_device_id device, cl_command_queue queue) {
    if (!out) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (!context || !device || !queue)
        return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT,
                           "context, device and queue must all be given (got %p, %p, %p)",
                           (void *)context, (void *)device, (void *)queue);
    cl_context qctx = NULL;
    cl_device_id qdev = NULL;
    cl_command_queue_properties qprops = 0;
    cl_int err = clGetCommandQueueInfo(queue, CL_QUEUE_CONTEXT, sizeof qctx, &qctx, NULL);
    if (err == CL_SUCCESS)
        err = clGetCommandQueueInfo(queue, CL_QUEUE_DEVICE, sizeof qdev, &qdev, NULL);
    if (err == CL_SUCCESS)
        err = clGetCommandQueueInfo(queue, CL_QUEUE_PROPERTIES, sizeof qprops, &qprops, NULL);
    if (err != CL_SUCCESS)
        return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "queue is not a valid command queue (%s)",
                           clmha__cl_error_name(err));
    if (qctx != context)
        return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT,
                           "queue belongs to another cl_context than the one given");
    if (qdev != device)
        return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT,
                           "queue belongs to another device than the one given");
    if (qprops & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE)
        return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT,
                           "queue is out-of-order: clmha (and CLBlast) need an in-order queue");

    clmha_context *c = context_alloc();
    if (!c) return clmha__fail(NULL, CLMHA_OUT_OF_MEMORY, "out of host memory");
    clRetainContext(context);
    clRetainDevice(device);  // a no-op for root devices; keeps a sub-device alive
    clRetainCommandQueue(queue);
    clmha__held_add(CLMHA__HELD_CONTEXT, 1);
    clmha__held_add(CLMHA__HELD_DEVICE, 1);
    clmha__held_add(CLMHA__HELD_QUEUE, 1);
    c->owns_device_ref = true;
    c->cl_ctx = context;
    c->device = device;
    c->queue = queue;
    clmha_status st = context_finish(c);
    if (st) {
        clmha_context_release(c);
        return st;
    }
    *out = c;
    return CLMHA_SUCCESS;
}

void clmha_context_retain(clmha_context *ctx) {
    if (!ctx) return;
    pthread_mutex_lock(&ctx->lock);
    ++ctx->refcount;
    pthread_mutex_unlock(&ctx->lock);
}

void clmha_context_release(clmha_context *ctx) {
    if (!ctx) return;
    pthread_mutex_lock(&ctx->lock);
    int left = --ctx->refcount;
    pthread_mutex_unlock(&ctx->lock);
    if (left > 0) return;
    if (ctx->queue) clFinish(ctx->queue);  // nothing of ours may still run on freed objects
    clmha__programs_release(ctx);
    // CLBlast keeps compiled programs in a process-wide cache, and each holds a reference to
    // the cl_context. Clearing it gives the caller's context back its reference count; other
    // contexts only pay a rebuild (from the driver's binary cache where it has one).
    CLBlastClearCache();
    clmha__release_mem(ctx->dummy);
    if (ctx->queue) {
        clReleaseCommandQueue(ctx->queue);
        clmha__held_add(CLMHA__HELD_QUEUE, -1);
    }
    if (ctx->owns_device_ref) {
        clReleaseDevice(ctx->device);
        clmha__held_add(CLMHA__HELD_DEVICE, -1);
    }
    if (ctx->cl_ctx) {
        clReleaseContext(ctx->cl_ctx);
        clmha__held_add(CLMHA__HELD_CONTEXT, -1);
    }
    pthread_mutex_destroy(&ctx->lock);
    free(ctx);
}

cl_context clmha_context_cl_context(const clmha_context *ctx) { return ctx ? ctx->cl_ctx : NULL; }
cl_device_id clmha_context_cl_device(const clmha_context *ctx) { return ctx ? ctx->device : NULL; }
cl_command_queue clmha_context_cl_queue(const clmha_context *ctx) {
    return ctx ? ctx->queue : NULL;
}
const char *clmha_context_device_name(const clmha_context *ctx) {
    return ctx ? ctx->device_name : "";
}

static _Atomic long held[CLMHA__HELD_KINDS];

void clmha__held_add(clmha__held_kind kind, long delta) { atomic_fetch_add(&held[kind], delta); }

void clmha__test_held(long counts[CLMHA__HELD_KINDS]) {
    for (int k = 0; k < CLMHA__HELD_KINDS; ++k) counts[k] = atomic_load(&held[k]);
}

void clmha__count(clmha_context *ctx, size_t program_builds, size_t buffer_allocations) {
    pthread_mutex_lock(&ctx->lock);
    ctx->program_builds += program_builds;
    ctx->buffer_allocations += buffer_allocations;
    pthread_mutex_unlock(&ctx->lock);
}

void clmha__context_counters(clmha_context *ctx, size_t *program_builds,
                             size_t *buffer_allocations) {
    pthread_mutex_lock(&ctx->lock);
    if (program_builds) *program_builds = ctx->program_builds;
    if (buffer_allocations) *buffer_allocations = ctx->buffer_allocations;
    pthread_mutex_unlock(&ctx->lock);
}
