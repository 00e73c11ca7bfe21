// Contexts: the OpenCL context, device and in-order queue clmha works on, with what it knows of
// the device (class, quirks, limits), its program cache and its counters.
#ifndef CLMHA_CONTEXT_CONTEXT_H
#define CLMHA_CONTEXT_CONTEXT_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "context/programs.h"
#include "device/device.h"
#include "device/device_class.h"
#include "device/host_blas.h"
#include "errors/errors.h"
#include "tuning_store/store.h"

struct clmha_context {
    clmha__error_slot errors;   // first: what clmha__fail() reads of a context (errors.h)
    int refcount;               // guarded by lock
    pthread_mutex_t lock;
    cl_context cl_ctx;
    cl_device_id device;
    cl_command_queue queue;
    bool owns_device_ref;       // the device was retained (caller's objects)
    cl_mem dummy;               // 16 bytes bound to unused buffer arguments
    clmha_device_info info;
    char device_name[300];
    size_t max_work_group;
    clmha__quirks quirks;       // known driver bugs of the device (clmha__device_quirks())
    const clmha__device_class *cls;  // the device's row of the class table
    clmha__programs *programs;  // the program cache (its own lock)
    // GEMMs (context/gemm.c): the host BLAS they run in, or NULL for CLBlast; the path asked
    // for; the line clmha_context_gemm_note() returns. Set at creation and by
    // clmha_context_set_gemm().
    const clmha__host_blas *host_blas;
    clmha_gemm gemm_asked;
    char gemm_note[640];
    // Counters for tests (libclmha.a): program builds and device buffer allocations made by
    // clmha itself on this context (CLBlast's own are not counted). Guarded by lock.
    size_t program_builds, buffer_allocations;
    // The bare layers of clmha_attention_forward() (src/forward/attention_cache.c), made on
    // its first call (under lock), opaque here; attention_release frees them first when the
    // context goes. They hold no reference to the context.
    void *attention;
    void (*attention_release)(void *attention);
};

// The context as the tuning store sees it (src/tuning_store/store.h).
static inline clmha__tuning_target clmha__context_tuning_target(const clmha_context *ctx) {
    clmha__tuning_target t = {ctx, &ctx->errors, ctx->device, &ctx->info, ctx->max_work_group};
    return t;
}

// Reads the counters above (test hook, reachable through libclmha.a).
CLMHA__HIDDEN void clmha__context_counters(clmha_context *ctx, size_t *program_builds,
                                           size_t *buffer_allocations);

// Adds to the counters above. Inline, so that the files the context calls (the program cache,
// src/context/programs.c) count without calling back into context.c.
static inline void clmha__count(clmha_context *ctx, size_t program_builds,
                                size_t buffer_allocations) {
    pthread_mutex_lock(&ctx->lock);
    ctx->program_builds += program_builds;
    ctx->buffer_allocations += buffer_allocations;
    pthread_mutex_unlock(&ctx->lock);
}

// The largest buffer clmha allocates as scratch on the device of @p ctx, in bytes: the device's
// CL_DEVICE_MAX_MEM_ALLOC_SIZE, or the test hook's lower limit when one is set.
CLMHA__HIDDEN cl_ulong clmha__max_alloc(const clmha_context *ctx);

// Test hook (reachable only by linking libclmha.a): makes clmha__max_alloc() report at most
// @p bytes, so that scratch limits and the chunking of the unfused core show on small shapes.
// 0 restores the device's limit. Not thread-safe: set it while no forward call runs.
CLMHA__HIDDEN void clmha__test_set_max_alloc(size_t bytes);

// The device memory a layer's scratch may come to, in bytes: the device's
// CL_DEVICE_GLOBAL_MEM_SIZE, or the test hook's lower limit when one is set. A layer refuses
// scratch past it before anything is allocated (the driver would fail only when it runs).
CLMHA__HIDDEN cl_ulong clmha__global_mem(const clmha_context *ctx);

// Test hook, as clmha__test_set_max_alloc(): makes clmha__global_mem() report at most @p bytes.
CLMHA__HIDDEN void clmha__test_set_global_mem(size_t bytes);

// Test hook: lowers the work-group limit every kernel reports (CL_KERNEL_WORK_GROUP_SIZE) to
// @p work_group and the device's local memory to @p local_mem bytes (0: no change), so that the
// refitting of launches and the fallback to the unfused core show on any device.
CLMHA__HIDDEN void clmha__test_set_kernel_limits(size_t work_group, size_t local_mem);

// The device's local memory in bytes (lowered by clmha__test_set_kernel_limits()).
CLMHA__HIDDEN cl_ulong clmha__local_mem(const clmha_context *ctx);

// What the built kernel @p k allows on the device of @p ctx: the largest work-group
// (CL_KERNEL_WORK_GROUP_SIZE, at most the device's, lowered by the test hook above) and the
// local memory it uses (CL_KERNEL_LOCAL_MEM_SIZE; @p local_mem may be NULL).
CLMHA__HIDDEN clmha_status clmha__kernel_limits(const clmha_context *ctx, cl_kernel k,
                                                size_t *work_group, cl_ulong *local_mem);

#endif
