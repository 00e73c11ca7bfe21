// The layer object: configuration, parameters, kernels, scratch buffers and profiling marks
// (layer.c), read by the attention cores (src/cores/) and the forward pass (src/forward/). The
// cores keep their own state in it, opaque here (core_state); the public clmha_layer_create()
// and clmha_layer_release(), which make and free that state too, are above the cores
// (src/forward/layer_create.c).
#ifndef CLMHA_LAYER_LAYER_H
#define CLMHA_LAYER_LAYER_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "context/context.h"
#include "layer/shape.h"

// Slots of per-core state in a layer: at least the rows of the dispatch table (src/cores/core.c
// checks it).
#define CLMHA__CORE_SLOTS 8

enum { CLMHA__TILE_Q, CLMHA__TILE_K, CLMHA__TILE_V, CLMHA__TILE_OUT, CLMHA__TILE_COUNT };

// The float32 copies a 16-bit layer's device forward and backward calls make of their tensors
// (src/forward/convert.c), and the padded copies of a packed call through a KV cache.
enum {
    CLMHA__STAGED_QUERY,
    CLMHA__STAGED_KEY,
    CLMHA__STAGED_VALUE,
    CLMHA__STAGED_KPM,
    CLMHA__STAGED_ATTN,
    CLMHA__STAGED_OUTPUT,
    CLMHA__STAGED_WEIGHTS,
    // A packed call through a KV cache (src/forward/forward.c): its query, key, value and
    // output padded to the longest sequence, in the layer's dtype.
    CLMHA__STAGED_PAD_QUERY,
    CLMHA__STAGED_PAD_KEY,
    CLMHA__STAGED_PAD_VALUE,
    CLMHA__STAGED_PAD_OUTPUT,
    // A 16-bit call of attention as a function: its sinks and ALiBi slopes widened.
    CLMHA__STAGED_SINKS,
    CLMHA__STAGED_SLOPES,
    // A 16-bit layer's backward call (src/backward/backward.c): its grad_output and
    // grad_weights widened, and a float32 copy per gradient (in clmha_backward_args order)
    // narrowed into the caller's buffer after the pass.
    CLMHA__STAGED_GRAD_OUTPUT,
    CLMHA__STAGED_GRAD_WEIGHTS,
    CLMHA__STAGED_GRAD,
    CLMHA__STAGED_COUNT = CLMHA__STAGED_GRAD + 16
};

// The device copies of a host-array call's tensors (clmha_layer_forward_host(),
// clmha_layer_backward_host(): src/forward/staging.c), kept between calls and grown to the
// largest one, so that repeated calls allocate nothing; the gradients of a backward call take
// the slots from CLMHA__HOST_GRAD on.
enum {
    CLMHA__HOST_QUERY,
    CLMHA__HOST_KEY,
    CLMHA__HOST_VALUE,
    CLMHA__HOST_KPM,
    CLMHA__HOST_ATTN,
    CLMHA__HOST_OUTPUT,
    CLMHA__HOST_WEIGHTS,
    CLMHA__HOST_GRAD_OUTPUT,
    CLMHA__HOST_GRAD_WEIGHTS,
    CLMHA__HOST_LSE,  // attention as a function's log-sum-exp rows
    CLMHA__HOST_ALIBI,  // attention as a function's ALiBi slopes
    CLMHA__HOST_SINKS,  // attention as a function's sinks
    CLMHA__HOST_MOD_PARAMS,  // attention as a function's user functions' p
    CLMHA__HOST_GRAD,
    CLMHA__HOST_COUNT = CLMHA__HOST_GRAD + 16
};

struct clmha_layer {
    clmha_context *ctx;
    clmha_layer_desc desc;  // kdim and vdim filled in
    size_t e, h, d;         // embed_dim, num_heads, head_dim
    size_t kvh, kve;        // num_kv_heads (grouped-query attention; h without), kvh * d
    size_t rs;              // bytes of a device element (parameters, scratch, the kernels'
                            // REAL: cl/real.cl): 8 for a float64 layer, else 4

    // Parameters, in PyTorch's layouts.
    cl_mem w_in;     // q_proj (E, E), then k_proj (KVE, kdim), then v_proj (KVE, vdim), KVE
                     // = kve (E without grouped-query attention); with kdim == vdim == E and
                     // KVE == E this is in_proj_weight (3E, E)
    // An absent bias stays NULL: the kernels that take one get the context's dummy instead
    // (forward.c), or are not run.
    cl_mem b_in;     // in_proj_bias (E + 2 KVE), NULL without bias
    cl_mem w_out;    // out_proj.weight (E, E)
    // w_in and w_out packed for the host path's products (src/device/packed_weight.h), kept
    // equal to them by every write of their parameters (layer.c): NULL where not made (not
    // the host path, a float64 layer (rs 8), kdim or vdim other than E for w_in, no AVX-512, or
    // out of host memory).
    struct clmha__packed_weight *packed_in, *packed_out;
    cl_mem b_out;    // out_proj.bias (E), NULL without bias
    cl_mem bias_kv;  // bias_k (KVE) then bias_v (KVE), NULL without add_bias_kv
    cl_mem alibi;    // alibi_slopes (H), NULL without desc.alibi; starts geometric
    // The slopes of the attention function's call on a bare layer (clmha_attention_args::
    // alibi_slopes), set per call under the bare layer's lock; NULL: alibi's.
    cl_mem alibi_call;
    size_t alibi_call_off;
    cl_mem sinks;  // sinks (H), NULL without desc.sinks; zero at creation
    // The sinks of the attention function's call on a bare layer (clmha_attention_args::sinks),
    // set per call under the bare layer's lock.
    cl_mem sinks_call;
    size_t sinks_call_off;
    // H values of -inf: the sinks of clmha_layer_attend()'s ranges but the one that holds them
    // (src/forward/partial.c), made on first use.
    cl_mem no_sinks;
    // User functions (clmha_layer_desc::mod_source; src/layer/mods.c): the layer's copy of the
    // source (NULL without; desc.mod_source points to it), the functions its text defines
    // (CLMHA__MOD_* bits), their parameters p (desc.mod_params_count floats, NULL when none)
    // and the attention function's per call (clmha_attention_args::mod_params, under the bare
    // layer's lock; NULL: mod_params). mod_version counts the changes of p: the cores' block
    // masks of clmha_mask_mod (src/cores/block_mask.c) are evaluated again after one.
    char *mod_source;
    unsigned mods;
    cl_mem mod_params;
    cl_mem mod_params_call;
    size_t mod_params_call_off;
    unsigned long mod_version;
    // The build options of the layer's score variants and user functions
    // (clmha__layer_variant_options()).
    char variant_options[96];

    // Kernels of cl/heads.cl (per layer: setting arguments is not thread-safe). The cores'
    // kernels are in their state (core_state).
    cl_kernel split_heads, merge_heads, fill_rows, average_heads, accumulate_heads;
    size_t heads_wg;    // work-group of the cl/heads.cl kernels, within each one's limit
    size_t heads_limit;  // the smallest CL_KERNEL_WORK_GROUP_SIZE of the cl/heads.cl kernels

    // Scratch, grown on demand (sizes in elements of rs bytes).
    cl_mem proj;     // projected rows: query (L*N, E), key (S*N, E), value (S*N, E)
    // Head tiles, each its own buffer used at offset 0: q (N*H, L, D), k and v (N*H, S', D),
    // attention out (N*H, L, D). (CLBlast 1.5.3's GemmStridedBatched ignores buffer offsets on
    // one of its internal paths, so the batched GEMMs only ever see offset 0.)
    cl_mem tiles[CLMHA__TILE_COUNT];
    cl_mem scores;   // (N*H, L, S'), or one chunk of its rows (clmha__scores_chunks())
    cl_mem head_sums;  // chunks: running head sums of averaged weights (clmha__chunks::sums)
    cl_mem partial_lse;  // clmha_layer_attend(): the log-sum-exp rows (N*H*L) before the copy
    size_t proj_cap, tile_caps[CLMHA__TILE_COUNT], scores_cap, head_sums_cap, partial_lse_cap;
    size_t cores_scratch_cap;  // floats of the scratch the cores keep in their state
                               // (clmha__layer_grow_core_scratch())

    // A 16-bit layer (desc.dtype F16 or BF16): the kernels of cl/convert.cl that widen its
    // inputs to float32 and narrow its results (NULL for a float32 layer), and the float32
    // copies of a call's tensors, grown on demand (sizes in floats; counted in the scratch).
    cl_kernel to_f32, from_f32;
    cl_mem staged[CLMHA__STAGED_COUNT];
    size_t staged_caps[CLMHA__STAGED_COUNT];
    cl_mem host[CLMHA__HOST_COUNT];  // a host-array call's tensors (sizes in floats)
    size_t host_caps[CLMHA__HOST_COUNT];

    clmha_attention_fn core;    // the user's core (src/cores/user.c), or NULL
    void *core_data;

    clmha_impl impl;            // the core for calls whose impl is CLMHA_IMPL_AUTO

    // A bare layer (clmha__layer_new_bare()): no parameters, and no reference to its context,
    // which owns it (the bare layers of clmha_attention_forward()).
    bool bare;

    // The attention cores' state (src/cores/): slot i belongs to row i of the dispatch table and
    // holds a clmha__core_slot (src/cores/core.h): the core it belongs to and what its create
    // hook made when the layer was created, freed by its release hook when the layer is
    // released (clmha__core_state() finds it); opaque here. NULL for a core without state.
    void *core_state[CLMHA__CORE_SLOTS];
    const void *last_core;      // the core (const clmha__core *) the last forward call chose

    // The backward pass's kernels and scratch (src/backward/), made on its first call; opaque
    // here, freed by backward_release when the layer is freed.
    void *backward;
    void (*backward_release)(void *backward);

    // Profiling: marks[0] before the first stage, marks[1 + s] after stage s (NULL when the
    // stage did not run in the last call).
    bool profiling;
    cl_event marks[CLMHA_STAGE_COUNT + 1];
};

// The packed copy of @p w when it is one of @p l's weights that has one, else NULL (for
// clmha__gemm_op::b_packed).
static inline const struct clmha__packed_weight *clmha__layer_packed(const clmha_layer *l,
                                                                     cl_mem w) {
    return !w ? NULL : w == l->w_in ? l->packed_in : w == l->w_out ? l->packed_out : NULL;
}

// Makes a layer of @p desc on @p ctx: its parameters (zero) and the kernels of cl/heads.cl, no
// core state (clmha_layer_create() adds it). Checks @p out, @p ctx and @p desc as
// clmha_layer_create() documents; on failure *out is NULL.
CLMHA__HIDDEN clmha_status clmha__layer_new(clmha_layer **out, clmha_context *ctx,
                                            const clmha_layer_desc *desc);

// A bare layer on @p ctx for attention without projections (clmha_attention_forward()): H
// @p heads, @p kv_heads key/value heads, head_dim @p head_dim, of @p dtype (float32, or
// float64 on a device with double precision: the caller checks), its programs built
// with the score variants of @p call (soft-capping: desc.softcap 1, which each call sets to
// its value; ALiBi: alibi_slopes geometric; sinks: the calls give theirs); the kernels of
// cl/heads.cl, no other parameters (w_in ... stay NULL), no core state (the caller adds it,
// clmha__cores_create()). It holds no reference to @p ctx: whoever keeps it must free it
// (clmha__layer_free(), after the cores' state) before the context goes.
CLMHA__HIDDEN clmha_status clmha__layer_new_bare(clmha_layer **out, clmha_context *ctx,
                                                 size_t heads, size_t kv_heads,
                                                 size_t head_dim, clmha_dtype dtype,
                                                 const clmha__dims *call);

// Frees what clmha__layer_new() made (the cores' state must be gone) and releases the context.
// NULL is ignored.
CLMHA__HIDDEN void clmha__layer_free(clmha_layer *layer);

// With profiling on, enqueues a marker recording the end of @p slot (0: start, 1 + stage).
CLMHA__HIDDEN clmha_status clmha__layer_mark(clmha_layer *layer, int slot);

// Releases the recorded markers.
CLMHA__HIDDEN void clmha__layer_marks_release(clmha_layer *layer);

// A new zero-filled buffer of @p count elements of @p elem bytes on the device of @p ctx
// (@p what names it in the message when it does not fit in one allocation or cannot be made).
CLMHA__HIDDEN clmha_status clmha__zero_buffer(clmha_context *ctx, size_t count, size_t elem,
                                              const char *what, cl_mem *out);

// The build options that give a layer's programs its element type (cl/real.cl): " -DCLMHA_F64"
// for a float64 layer, else "".
static inline const char *clmha__layer_real_options(const clmha_layer *layer) {
    return layer->rs == 8 ? " -DCLMHA_F64" : "";
}

// The build options that give the attention cores' programs a layer's score variants and user
// functions (cl/common.cl): " -DSOFTCAP=1" with soft-capping, " -DALIBI=1" with ALiBi,
// " -DSINKS=1" with sinks, then the user functions' " -DUSER_SCORE=1", " -DUSER_GRAD=1",
// " -DUSER_MASK=1", in that order, or "" (set at creation: clmha__layer_mods_init()).
static inline const char *clmha__layer_variant_options(const clmha_layer *layer) {
    return layer->variant_options;
}

// Makes *buf hold at least @p need floats (*cap, in floats, says what it holds): a new
// read-write buffer when it is too small (the old one is released; queued work that uses it
// keeps it), refused with CLMHA_OUT_OF_MEMORY beyond the device's largest allocation. @p what
// names it in messages.
CLMHA__HIDDEN clmha_status clmha__grow_buffer(clmha_context *ctx, cl_mem *buf, size_t *cap,
                                              size_t need, const char *what);

// clmha__grow_buffer() for a buffer of the layer's elements (rs bytes: doubles for a float64
// layer; *cap counts elements).
CLMHA__HIDDEN clmha_status clmha__layer_grow(clmha_layer *layer, cl_mem *buf, size_t *cap,
                                             size_t need, const char *what);

// clmha__layer_grow_core_scratch() for a buffer of ones of the layer's elements (the column of
// the bias gradients' GEMMs): made filled, from a host array (CL_MEM_COPY_HOST_PTR), so that no
// command is enqueued and every tool sees it written (Oclgrind's check of uninitialised values
// does not count clEnqueueFillBuffer).
CLMHA__HIDDEN clmha_status clmha__layer_grow_ones(clmha_layer *layer, cl_mem *buf, size_t *cap,
                                                  size_t need, const char *what);

// clmha__grow_buffer() for a buffer a core keeps in its state, counted in the layer's scratch
// (clmha_layer_scratch_bytes()).
CLMHA__HIDDEN clmha_status clmha__layer_grow_core_scratch(clmha_layer *layer, cl_mem *buf,
                                                          size_t *cap, size_t need,
                                                          const char *what);

// How the unfused core walks the scores, N*H*L rows of S' floats (row r is query r % L of plane
// r / L, plane = batch·head): in chunks of at most `rows` consecutive rows, so that the scores
// buffer holds one chunk. One chunk of every row when the scores fit in half the largest
// allocation (clmha__max_alloc(); the other half leaves room for the padded copies CLBlast's
// indirect GEMM makes); else chunks of whole planes (`whole`: `rows` is a multiple of L and the
// planes per chunk divide H or are a multiple of it, so that no chunk straddles batch items
// partly), the last one possibly shorter; else, when one plane does not fit, chunks of rows of
// one plane (the last of each plane possibly shorter), taken block of rows by block of rows with
// the heads of a batch item in turn: (item, rows, head), so that averaged weights can be summed
// over the heads of one block before the next.
typedef struct clmha__chunks {
    size_t rows;   // score rows per chunk
    bool whole;    // chunks are whole planes
    size_t count;  // number of chunks
    size_t sums;   // floats of running head sums that averaged weights need (0: each chunk
                   // holds whole batch items)
} clmha__chunks;

// Plans the chunks of the unfused core for @p dims; false when not even one row of S' scores
// fits (the key tiles would not fit either).
CLMHA__HIDDEN bool clmha__scores_chunks(const clmha_layer *layer, const clmha__dims *dims,
                                        clmha__chunks *chunks);

// The row pitch (elements) of projected rows @p width elements wide in layer->proj when the
// fused core reads them there (the rows path, clmha__core_call::rows): one 64-byte line more
// when the rows would be a multiple of 4 KiB apart, where every row of a key tile would fall
// into the same sets of a 4 KiB-way L1 cache (a key/value projection 2 x 512 floats wide);
// else @p width.
CLMHA__HIDDEN size_t clmha__rows_pitch(const clmha_layer *layer, size_t width);

// Grows the scratch buffers to fit @p dims, with room for the scores when @p scores (the
// unfused core: one chunk of them, clmha__scores_chunks(), or all of them for a user core,
// which returns weights through them) and for the running head sums of chunked averaged weights
// when @p head_sums. Allocates only when they are too small.
CLMHA__HIDDEN clmha_status clmha__layer_reserve(clmha_layer *layer, const clmha__dims *dims,
                                                bool scores, bool head_sums);

#endif
