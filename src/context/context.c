// Contexts: the OpenCL context, device and in-order queue clmha works on, what it knows of the
// device, its program cache and its counters.
#include "context/context.h"

#include "context/gemm.h"
#include "device/held.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <clblast_c.h>

_Static_assert(offsetof(struct clmha_context, errors) == 0,
               "clmha__fail() reads a context's error slot at its start");

const char *clmha_context_last_error(const clmha_context *ctx) {
    if (!ctx) return "ctx is NULL";
    return clmha__error_last(&ctx->errors);
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
    clmha__tuning_target tg = clmha__context_tuning_target(c);
    clmha__tuning_apply_stored(&tg);  // never fails: an unusable file is noted and ignored
    clmha__gemm_init(c);              // never fails: CLBlast when the host path is impossible
    return CLMHA_SUCCESS;
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

// A lower limit set by tests, 0 for none (clmha__test_set_max_alloc()).
static size_t test_max_alloc;

void clmha__test_set_max_alloc(size_t bytes) { test_max_alloc = bytes; }

cl_ulong clmha__max_alloc(const clmha_context *ctx) {
    cl_ulong device = ctx->info.max_alloc_bytes;
    return test_max_alloc && test_max_alloc < device ? (cl_ulong)test_max_alloc : device;
}

// A lower global memory set by tests, 0 for none (clmha__test_set_global_mem()).
static size_t test_global_mem;

void clmha__test_set_global_mem(size_t bytes) { test_global_mem = bytes; }

cl_ulong clmha__global_mem(const clmha_context *ctx) {
    cl_ulong device = ctx->info.global_mem_bytes;
    return test_global_mem && test_global_mem < device ? (cl_ulong)test_global_mem : device;
}

// clmha contexts alive in the process (allocated, not yet freed), for CLBlastClearCache().
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static size_t live_contexts;

static clmha_context *context_alloc(void) {
    clmha_context *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->programs = clmha__programs_create();
    if (!c->programs) {
        free(c);
        return NULL;
    }
    pthread_mutex_lock(&live_lock);
    ++live_contexts;
    pthread_mutex_unlock(&live_lock);
    clmha__error_slot_init(&c->errors);
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
    if (ctx->attention_release) ctx->attention_release(ctx->attention);
    clmha__programs_release(ctx->programs);
    // CLBlast keeps compiled programs in a process-wide cache, and each holds a reference to
    // the cl_context. Clearing it gives the caller's context back its reference count, but it
    // also drops the programs of every other context: so it is cleared only when this was the
    // last clmha context alive (also after a failed creation, which frees its context here).
    pthread_mutex_lock(&live_lock);
    bool last = --live_contexts == 0;
    pthread_mutex_unlock(&live_lock);
    if (last) CLBlastClearCache();
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
    clmha__error_slot_forget(&ctx->errors);
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

void clmha__context_counters(clmha_context *ctx, size_t *program_builds,
                             size_t *buffer_allocations) {
    pthread_mutex_lock(&ctx->lock);
    if (program_builds) *program_builds = ctx->program_builds;
    if (buffer_allocations) *buffer_allocations = ctx->buffer_allocations;
    pthread_mutex_unlock(&ctx->lock);
}
