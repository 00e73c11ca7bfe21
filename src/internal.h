// Declarations shared between clmha's source files. Not installed.
#ifndef CLMHA_INTERNAL_H
#define CLMHA_INTERNAL_H

#include "clmha.h"

#include <stdarg.h>

#include "base/checked.h"
#include "base/defs.h"
#include "base/message.h"

// ---- sizes -----------------------------------------------------------------------------------

// How attn_mask is laid out once its shape is checked.
typedef enum clmha__attn_layout {
    CLMHA__ATTN_NONE = 0,
    CLMHA__ATTN_SHARED,    // (L, S): every batch item and head
    CLMHA__ATTN_PER_HEAD,  // (N*H, L, S)
    CLMHA__ATTN_PER_BATCH, // (N, L, S): shared by the heads of a batch item
} clmha__attn_layout;

// The sizes of one forward call, resolved from the layer and the arguments.
typedef struct clmha__dims {
    bool batched;        // false: unbatched 2-D inputs (N = 1)
    bool batch_first;    // batched and the layer is batch_first
    size_t n, l, s;      // batch, target length, source length
    size_t e, kdim, vdim, h, d;
    size_t s_padded;     // s + add_bias_kv + add_zero_attn
    bool key_is_query;   // args->key.ndim == 0
    bool value_is_key;   // args->value.ndim == 0
    clmha__attn_layout attn_layout;
    clmha_mask_kind attn_kind, kpm_kind;
    size_t query_count, key_count, value_count;  // elements of each input
    size_t attn_count, kpm_count;                // elements of each mask (0 if none)
    size_t output_count, weights_count;          // elements of each output
    size_t scores_count;                         // n * h * l * s_padded
} clmha__dims;

// Checks @p args against @p desc (already validated) and fills @p dims. On failure writes a
// message naming the argument and the shapes to @p msg and returns the status.
CLMHA__HIDDEN clmha_status clmha__dims_resolve(const clmha_layer_desc *desc,
                                               const clmha_forward_args *args, clmha__dims *dims,
                                               char *msg, size_t msg_size);

// Checks that every tensor the resolved call reads has a host data pointer.
CLMHA__HIDDEN clmha_status clmha__check_host_data(const clmha__dims *dims,
                                                  const clmha_forward_args *args, char *msg,
                                                  size_t msg_size);

// Checks a layer descriptor and fills kdim/vdim defaults into @p out.
CLMHA__HIDDEN clmha_status clmha__desc_check(const clmha_layer_desc *desc, clmha_layer_desc *out,
                                             char *msg, size_t msg_size);

// ---- dropout randomness (same function as cl/softmax.cl) ------------------------------------

// Philox4x32-10, first output word.
static inline uint32_t clmha__philox_word0(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                           uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; ++round) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = (uint32_t)p0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

// The dropout threshold: weight dropped when word0 < threshold. p in [0, 1).
static inline uint32_t clmha__dropout_threshold(float p) {
    double t = (double)p * 4294967296.0;
    return t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
}

// true when attention weight (bh, i, j) is kept.
static inline bool clmha__dropout_keep(clmha_dropout_rng rng, uint32_t threshold, size_t bh,
                                       size_t i, size_t j) {
    uint32_t w = clmha__philox_word0((uint32_t)j, (uint32_t)i, (uint32_t)bh, (uint32_t)rng.offset,
                                     (uint32_t)rng.seed,
                                     (uint32_t)(rng.seed >> 32) ^ (uint32_t)(rng.offset >> 32));
    return w >= threshold;
}

// ---- device classes (src/device_class.c) -------------------------------------------------------

// The defaults of clmha's own kernels for one class of devices: one row of the table in
// src/device_class.c.
typedef struct clmha__device_class {
    const char *name;        // "cpu-pocl", "gpu-nvidia", ...
    cl_device_type type;     // the row matches devices of this type (0: any)
    cl_uint vendor_id;       // ... with this CL_DEVICE_VENDOR_ID (0: any)
    const char *platform;    // ... on a platform whose name contains this (NULL: any)
    size_t bq, bk, rpw;      // fused tiles: work-group size, keys per tile, rows per work-item
    size_t vw;               // fused vector width; 0: CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT
    size_t private_floats;   // cap on the fused kernel's per-work-item arrays, in floats
    bool coalesced;          // GPU mapping: split/merge one work-item per float, the fused
                             // kernel's query rows in (padded) local memory, loaded and stored
                             // by adjacent work-items on adjacent floats
    size_t softmax_wg;       // cap on masked_softmax's work-group size
} clmha__device_class;

// The table row of a device: the first that matches its type, vendor id and platform name (or
// the row forced by clmha__test_force_device_class()).
CLMHA__HIDDEN const clmha__device_class *clmha__device_class_match(cl_device_type type,
                                                                   cl_uint vendor_id,
                                                                   const char *platform_name);

// clmha__device_class_match() for @p device (reads its CL_DEVICE_VENDOR_ID).
CLMHA__HIDDEN const clmha__device_class *clmha__device_class_of(cl_device_id device,
                                                                cl_device_type type,
                                                                const char *platform_name);

// The table row called @p name, or NULL.
CLMHA__HIDDEN const clmha__device_class *clmha__device_class_named(const char *name);

// Test hook (reachable only by linking libclmha.a): contexts created afterwards take table row
// @p name whatever their device ("gpu" runs the GPU mapping on PoCL); NULL restores detection.
// False (and no change) for an unknown name. Not thread-safe against context creation.
CLMHA__HIDDEN bool clmha__test_force_device_class(const char *name);

// ---- contexts, programs, layers ---------------------------------------------------------------

#include <pthread.h>

#define CLMHA__ERROR_SIZE 4096

// A compiled program, cached per context by kernel family and build options.
typedef struct clmha__program {
    char *key;  // "family|options"
    cl_program program;
    struct clmha__program *next;
} clmha__program;

// Known driver bugs clmha works around (docs/design.md, "Driver quirks").
typedef struct clmha__quirks {
    // Mesa llvmpipe (gallivm): every loop of a kernel ends once a work-item has run this many
    // loop iterations in total, over all its loops (0: no such limit). See
    // tools/driver-bugs/llvmpipe-loop-limit.
    size_t loop_limit;
    // Clover: its compiler aborts the process on vloadN, so the fused kernel is built with VW 1.
    bool no_vload;
} clmha__quirks;

// The quirks of the device @p info describes.
CLMHA__HIDDEN clmha__quirks clmha__device_quirks(const clmha_device_info *info);

struct clmha_context {
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
    clmha__program *programs;   // guarded by lock
    char last_error[CLMHA__ERROR_SIZE];
    // Counters for tests (libclmha.a): program builds and device buffer allocations made by
    // clmha itself on this context (CLBlast's own are not counted). Guarded by lock.
    size_t program_builds, buffer_allocations;
};

// Reads the counters above (test hook, reachable through libclmha.a).
CLMHA__HIDDEN void clmha__context_counters(clmha_context *ctx, size_t *program_builds,
                                           size_t *buffer_allocations);

// Adds to the counters above.
CLMHA__HIDDEN void clmha__count(clmha_context *ctx, size_t program_builds,
                                size_t buffer_allocations);

// Records the last error of @p ctx and returns @p status.
CLMHA__HIDDEN clmha_status clmha__fail(const clmha_context *ctx, clmha_status status,
                                       const char *fmt, ...) CLMHA__PRINTF(3, 4);

// Maps an OpenCL error code of @p call to a status and records the message.
CLMHA__HIDDEN clmha_status clmha__cl_fail(const clmha_context *ctx, cl_int err,
                                          const char *call);

// Maps a CLBlast status of @p call to a status and records the message.
CLMHA__HIDDEN clmha_status clmha__blas_fail(const clmha_context *ctx, int err, const char *call);

// Name of an OpenCL error code ("CL_OUT_OF_RESOURCES").
CLMHA__HIDDEN const char *clmha__cl_error_name(cl_int err);

// Builds (or finds in the context's cache) the program of kernel family @p family
// ("heads", "softmax", "fused") with build @p options. The context keeps the program.
CLMHA__HIDDEN clmha_status clmha__program_get(clmha_context *ctx, const char *family,
                                              const char *options, cl_program *out);

// Test hook (reachable only by linking libclmha.a): appends @p options to every later program
// build, e.g. "-DCLMHA_FORCE_BUILD_ERROR" to make cl/heads.cl fail to compile. NULL clears it.
// The string must outlive its use.
CLMHA__HIDDEN void clmha__test_set_extra_build_options(const char *options);

// The largest buffer clmha allocates as scratch on the device of @p ctx, in bytes: the device's
// CL_DEVICE_MAX_MEM_ALLOC_SIZE, or the test hook's lower limit when one is set.
CLMHA__HIDDEN cl_ulong clmha__max_alloc(const clmha_context *ctx);

// Test hook (reachable only by linking libclmha.a): makes clmha__max_alloc() report at most
// @p bytes, so that scratch limits and the chunking of the unfused core show on small shapes.
// 0 restores the device's limit. Not thread-safe: set it while no forward call runs.
CLMHA__HIDDEN void clmha__test_set_max_alloc(size_t bytes);

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

// The fused attention kernel's tiles.
typedef struct clmha__fused_tiles {
    size_t bq;   // work-group size (a power of two within the device's limit)
    size_t bk;   // keys per tile (0: not even one key fits in local memory)
    size_t rpw;  // query rows per work-item (1 or 2); a work-group covers bq * rpw rows
    size_t vw;   // vector width of the inner products: 1, 2, 4, 8 or 16, dividing bk and hd
    bool q_local;    // query rows in local memory (coalesced loads and stores), not private
    bool acc_local;  // accumulators in local memory too (the private budget is too small)
} clmha__fused_tiles;

// The fused kernel's private floats per work-item for tiles @p t and head dim @p hd: per row,
// the tile's scores (bk) plus the scaled query and the accumulator where they are private.
static inline size_t clmha__fused_private_floats(const clmha__fused_tiles *t, size_t hd) {
    return t->rpw * (t->bk + (t->q_local ? 0 : hd) + (t->acc_local ? 0 : hd));
}

// The fused kernel's local memory in floats (cl/fused.cl): the key tile hd x bk (row stride
// bk|1 with q_local), the value tile bk x hd, and the query rows and accumulators
// bq*rpw x (hd|1) each where they are local.
static inline size_t clmha__fused_local_floats(const clmha__fused_tiles *t, size_t hd) {
    size_t rows = t->bq * t->rpw * (hd | 1);
    return hd * (t->q_local ? t->bk | 1 : t->bk) + t->bk * hd + (t->q_local ? rows : 0) +
           (t->acc_local ? rows : 0);
}

// Tiles of the fused attention kernel for head dim @p hd on the device of @p ctx: the context's
// preferred ones (a stored tuning) or its device class's defaults, fitted by
// clmha__fused_tiles_fit().
CLMHA__HIDDEN clmha__fused_tiles clmha__fused_tiles_for(const clmha_context *ctx, size_t hd);

// The fused kernel's default vector width on the device of @p ctx: the class table's, or
// (CPUs) the device's native float width.
CLMHA__HIDDEN size_t clmha__fused_default_vw(const clmha_context *ctx);

// Makes tiles @p t usable for head dim @p hd on the device of @p ctx:
// clmha__fused_tiles_fit_limits() with its class, local memory and work-group limit; vw 1
// where vloadN is unsafe (clmha__quirks).
CLMHA__HIDDEN void clmha__fused_tiles_fit(const clmha_context *ctx, size_t hd,
                                          clmha__fused_tiles *t);

// Makes tiles @p t usable for head dim @p hd under class @p cls with @p local_mem bytes of
// local memory and work-groups of at most @p max_wg: bq the largest power of two within both;
// q_local from the class; then, while the private arrays exceed the class's budget
// (clmha__fused_private_floats()), one row per work-item, bk halved down to 8, the query rows
// and then the accumulators moved to local memory; then, while the local memory
// (clmha__fused_local_floats()) exceeds the device's less 1 KiB, bk halved down to 8, bq down to
// 32, then either further (bk 0: nothing fits); last, vw narrowed (a power of two up to 16, at
// most the given vw) until it divides hd and bk.
CLMHA__HIDDEN void clmha__fused_tiles_fit_limits(const clmha__device_class *cls,
                                                 cl_ulong local_mem, size_t max_wg, size_t hd,
                                                 clmha__fused_tiles *t);

// ---- OpenCL objects clmha holds ------------------------------------------------------------

// What clmha holds a reference to, counted process-wide: every cl_context, command queue and
// device clmha created or retained, and every cl_mem, cl_program and cl_kernel it created and has
// not released (CLBlast's own objects are not counted). Tests compare these with zero after
// releasing everything, which also works on drivers whose CL_*_REFERENCE_COUNT does not move.
typedef enum clmha__held_kind {
    CLMHA__HELD_CONTEXT,
    CLMHA__HELD_QUEUE,
    CLMHA__HELD_DEVICE,
    CLMHA__HELD_MEM,
    CLMHA__HELD_PROGRAM,
    CLMHA__HELD_KERNEL,
    CLMHA__HELD_KINDS
} clmha__held_kind;

// Adds @p delta to the count of @p kind (thread-safe).
CLMHA__HIDDEN void clmha__held_add(clmha__held_kind kind, long delta);

// Test hook (reachable only by linking libclmha.a): the counts above, indexed by kind.
CLMHA__HIDDEN void clmha__test_held(long counts[CLMHA__HELD_KINDS]);

// Counts an object clmha just created (NULL, a failed creation, is not counted).
static inline void clmha__held_new(clmha__held_kind kind, const void *object) {
    if (object) clmha__held_add(kind, 1);
}

// Releases what clmha created, and counts it (NULL is ignored).
static inline void clmha__release_mem(cl_mem m) {
    if (!m) return;
    clReleaseMemObject(m);
    clmha__held_add(CLMHA__HELD_MEM, -1);
}
static inline void clmha__release_kernel(cl_kernel k) {
    if (!k) return;
    clReleaseKernel(k);
    clmha__held_add(CLMHA__HELD_KERNEL, -1);
}
static inline void clmha__release_program(cl_program p) {
    if (!p) return;
    clReleaseProgram(p);
    clmha__held_add(CLMHA__HELD_PROGRAM, -1);
}

// Frees every cached program of a context.
CLMHA__HIDDEN void clmha__programs_release(clmha_context *ctx);

// Fills a device info record for one device.
CLMHA__HIDDEN void clmha__device_describe(cl_platform_id platform, cl_device_id device,
                                          unsigned platform_index, unsigned device_index,
                                          clmha_device_info *info);

#endif
