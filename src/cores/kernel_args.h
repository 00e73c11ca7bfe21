// Kernel arguments and launches shared by the attention cores and the forward pass: kernel
// creation, argument lists, 1-D launches, and the mask and dropout arguments that
// cl/cores/unfused.cl's masked_softmax and cl/cores/fused.cl's fused_attention take in the same
// order.
#ifndef CLMHA_CORES_KERNEL_ARGS_H
#define CLMHA_CORES_KERNEL_ARGS_H

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"

// Creates kernel @p name of @p prog in *out (NULL on failure; counted by clmha__held_new()).
CLMHA__HIDDEN clmha_status clmha__kernel_make(clmha_context *ctx, cl_program prog,
                                              const char *name, cl_kernel *out);

// One kernel argument: its size and a pointer to its value.
typedef struct clmha__arg {
    size_t size;
    const void *value;
} clmha__arg;

#define CLMHA__ARG(x) ((clmha__arg){sizeof(x), &(x)})

// A kernel argument of type REAL (cl/real.cl): float, or double in a float64 layer's
// programs. It holds both; CLMHA__REAL_ARG(r, rs) passes the one of rs bytes (the layer's rs).
typedef struct clmha__real {
    float f;
    double d;
} clmha__real;

static inline clmha__real clmha__real_of(double v) { return (clmha__real){(float)v, v}; }

#define CLMHA__REAL_ARG(r, rs)                                                                \
    ((clmha__arg){(rs), (rs) == 8 ? (const void *)&(r).d : (const void *)&(r).f})

// Sets the arguments of @p k (@p name names the kernel in the message).
CLMHA__HIDDEN clmha_status clmha__set_args(clmha_context *ctx, cl_kernel k, const char *name,
                                           const clmha__arg *args, cl_uint nargs);

// Sets the arguments of @p k and enqueues it over @p total work-items in groups of @p wg.
CLMHA__HIDDEN clmha_status clmha__launch(clmha_context *ctx, cl_kernel k, const char *name,
                                         size_t total, size_t wg, const clmha__arg *args,
                                         cl_uint nargs);

// Sets the arguments of @p k and enqueues it over a 2-D range: @p cols work-items across (in
// groups of @p wg), @p rows down (fill_rows: no division per element, so that a CPU driver
// vectorises the columns).
CLMHA__HIDDEN clmha_status clmha__launch_rows(clmha_context *ctx, cl_kernel k, const char *name,
                                              size_t rows, size_t cols, size_t wg,
                                              const clmha__arg *args, cl_uint nargs);

// The mask and dropout arguments of masked_softmax and fused_attention, in their order.
typedef struct clmha__mask_args {
    cl_mem attn;
    cl_ulong attn_off;
    cl_uint attn_kind;
    cl_ulong attn_sn, attn_sh, attn_si;  // the broadcast strides (clmha__dims)
    cl_mem kpm;
    cl_ulong kpm_off;
    cl_uint kpm_kind, causal;
    cl_long win_left, win_right;  // the sliding window (clmha__dims)
    clmha__real softcap;          // soft-capping (clmha__dims; 0: off)
    cl_mem alibi;                 // ALiBi's slopes (H), at alibi_off; the dummy without
    cl_ulong alibi_off;
    cl_mem sinks;                 // the sinks (H), at sinks_off; the dummy without
    cl_ulong sinks_off;
    // The user functions' p (clmha_layer::mod_params, or the attention function's call's), at
    // mod_off, and the block mask of clmha_mask_mod (the dummy but in the cores that skip
    // tiles: src/cores/block_mask.c).
    cl_mem mod_p;
    cl_ulong mod_off;
    cl_mem mod_blocks;
    cl_ulong q_pos, k_pos;  // partial attention's positions (clmha__dims; 0 elsewhere)
    cl_uint dropout_on, threshold;
    clmha__real keep_scale;
    cl_uint seed_lo, seed_hi, off_lo;
    size_t rs;  // the layer's element size: which of keep_scale the kernels take
} clmha__mask_args;

// The strides of rows (cl/cores/fused.cl, AT: offset, per batch, per head, per row) of @p t
// tokens a batch, the first at element @p at, @p ld elements apart, head h in columns h·hd..,
// in the call's order (batch first: row n·t + i; else row i·N + n).
static inline cl_ulong4 clmha__rows_at(const clmha__dims *d, size_t at, size_t ld, cl_ulong hd,
                                       cl_ulong t) {
    return d->batch_first ? (cl_ulong4){{at, t * ld, hd, ld}}
                          : (cl_ulong4){{at, ld, hd, d->n * ld}};
}

// The buffer and offset of the user functions' p of layer @p l (the dummy without).
static inline cl_mem clmha__mod_params_of(const clmha_layer *l, cl_ulong *off) {
    *off = l->mod_params_call ? l->mod_params_call_off : 0;
    if (l->mod_params_call) return l->mod_params_call;
    return l->mod_params ? l->mod_params : l->ctx->dummy;
}

// The mask and dropout arguments of the call @p a, resolved as @p d, on @p l.
CLMHA__HIDDEN clmha__mask_args clmha__masks_of(const clmha_layer *l, const clmha_forward_args *a,
                                               const clmha__dims *d);

// The fields of a clmha__mask_args as kernel arguments, in order: the kernels' MASK_PARAMS
// (cl/common.cl).
#define CLMHA__MASK_ARGS(m)                                                                   \
    CLMHA__ARG((m).attn), CLMHA__ARG((m).attn_off), CLMHA__ARG((m).attn_kind),                \
        CLMHA__ARG((m).attn_sn), CLMHA__ARG((m).attn_sh), CLMHA__ARG((m).attn_si),            \
        CLMHA__ARG((m).kpm), CLMHA__ARG((m).kpm_off),                                         \
        CLMHA__ARG((m).kpm_kind), CLMHA__ARG((m).causal), CLMHA__ARG((m).win_left),           \
        CLMHA__ARG((m).win_right), CLMHA__REAL_ARG((m).softcap, (m).rs),                      \
        CLMHA__ARG((m).alibi), CLMHA__ARG((m).alibi_off), CLMHA__ARG((m).sinks),             \
        CLMHA__ARG((m).sinks_off), CLMHA__ARG((m).mod_p), CLMHA__ARG((m).mod_off),              \
        CLMHA__ARG((m).mod_blocks), CLMHA__ARG((m).q_pos), CLMHA__ARG((m).k_pos),             \
        CLMHA__ARG((m).dropout_on),                                                           \
        CLMHA__ARG((m).threshold), CLMHA__REAL_ARG((m).keep_scale, (m).rs),                   \
        CLMHA__ARG((m).seed_lo), CLMHA__ARG((m).seed_hi), CLMHA__ARG((m).off_lo)

#endif
