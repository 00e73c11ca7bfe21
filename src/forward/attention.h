// Attention as a function: what the device form (attention.c) offers the host-array form
// (attention_host.c).
#ifndef CLMHA_FORWARD_ATTENTION_H
#define CLMHA_FORWARD_ATTENTION_H

#include <stdbool.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/attention_shape.h"
#include "layer/layer.h"

// Where a call's results go (NULL lse or weights: not asked); offsets in the call's elements.
typedef struct clmha__attention_out {
    cl_mem output, lse, weights;
    size_t output_offset, lse_offset, weights_offset;
} clmha__attention_out;

// Reads the caller's @p args into @p in (this library's layout) and resolves it into @p d; a
// failure's message goes to @p ctx.
CLMHA__HIDDEN clmha_status clmha__attention_check_args(clmha_context *ctx,
                                                       const clmha_attention_args *args,
                                                       clmha_attention_args *in,
                                                       clmha__attention_dims *d);

// Bytes of an element of call @p a's tensors (float masks, alibi_slopes and sinks too): 4, 8
// for dtype float64, 2 for 16-bit dtypes (checked: clmha__attention_check_args()). A bare
// layer of a float32 or float64 call has the same rs; a 16-bit call's computes in float32.
CLMHA__HIDDEN size_t clmha__attention_elem(const clmha_attention_args *a);

// Whether call @p a's dtype is float16 or bfloat16.
CLMHA__HIDDEN bool clmha__attention_16(const clmha_attention_args *a);

// Bytes of an element of a mask of @p kind in call @p a: a byte for boolean masks, else
// clmha__attention_elem().
CLMHA__HIDDEN size_t clmha__attention_mask_elem(const clmha_attention_args *a,
                                                clmha_mask_kind kind);

// Enqueues checked call @p a (sizes @p d, buffers checked) on bare layer @p layer (the
// attention cache locked): asks the dispatch for the core and reserves the scratch (nothing is
// enqueued before those succeed), then waits for @p wait_list, stages the inputs, runs the core,
// writes the results to @p out; the completion event in @p event.
CLMHA__HIDDEN clmha_status clmha__attention_enqueue(clmha_layer *layer,
                                                    const clmha_attention_args *a,
                                                    const clmha__attention_dims *d,
                                                    const clmha__attention_out *out,
                                                    cl_uint num_wait, const cl_event *wait_list,
                                                    cl_event *event);

// The host-array forms (attention_host.c): uploads the `data` of @p a's query, key, value and
// mask into bare layer @p l's staging slots (clmha__host_upload()) and points @p a's and @p d's
// tensors at them (offset 0); makes room for the results in @p o (lse, weights: asked for).
CLMHA__HIDDEN clmha_status clmha__attention_upload(clmha_layer *l, clmha_attention_args *a,
                                                   clmha__attention_dims *d, bool lse,
                                                   bool weights, clmha__attention_out *o);

// CLMHA_INVALID_ARGUMENT, naming @p function and the form to use, when call @p a's dtype is
// not @p takes, the dtype of a host form's arrays.
CLMHA__HIDDEN clmha_status clmha__attention_host_dtype(clmha_context *ctx,
                                                       const clmha_attention_args *a,
                                                       clmha_dtype takes, const char *function);

// A 16-bit call of a float host form (attention_host.c): @p count floats of @p from rounded
// to dtype @p t into a new array *copy (malloc'd; the caller frees it).
CLMHA__HIDDEN clmha_status clmha__attention_round_copy(clmha_context *ctx, clmha_dtype t,
                                                       const float *from, size_t count,
                                                       float **copy);

// ... the float32 call @p a on copies (@p copies, freed by the caller) of its query, key, value,
// float mask, sinks and ALiBi slopes rounded to dtype @p t; @p d's mask pointing at its copy.
#define CLMHA__ATTENTION_ROUNDED 6
CLMHA__HIDDEN clmha_status clmha__attention_round_inputs(clmha_context *ctx,
                                                         clmha_attention_args *a,
                                                         clmha__attention_dims *d, clmha_dtype t,
                                                         float *copies[CLMHA__ATTENTION_ROUNDED]);

// ... and its results (@p count floats of @p x, NULL: none) rounded to @p t, once.
CLMHA__HIDDEN void clmha__attention_round_results(clmha_dtype t, float *x, size_t count);

// The internal forward arguments of call @p a on bare layer @p l for the cores (masks in their
// layouts, is_causal, dropout as training, rng, impl; per-head weights), and the layer's dropout
// p set to the call's.
CLMHA__HIDDEN clmha_forward_args clmha__attention_core_args(clmha_layer *l,
                                                            const clmha_attention_args *a,
                                                            const clmha__attention_dims *d);

// Head tiles (N*@p heads, @p seq, D) of tensor @p t for a core: *use is the caller's buffer
// itself in (N, H, L, D) layout at offset 0, else @p scratch, filled by a copy (NHLD) or by
// split_heads ((N, L, H, D), read as batch-first rows) (clmha__heads_place(), middle.c).
CLMHA__HIDDEN clmha_status clmha__attention_stage(clmha_layer *l, const clmha__attention_dims *d,
                                                  cl_mem scratch, const clmha_tensor *t,
                                                  size_t heads, size_t seq, cl_mem *use);

// The way back: head tiles @p tile (N*@p heads, @p seq, D) into the caller's @p out at
// @p out_offset in the call's layout (clmha__heads_put(), middle.c).
CLMHA__HIDDEN clmha_status clmha__attention_unstage(clmha_layer *l,
                                                    const clmha__attention_dims *d, cl_mem tile,
                                                    size_t heads, size_t seq, cl_mem out,
                                                    size_t out_offset);

// The KV-cache form (attention_kv.c): @p a with kv_cache, checked and resolved in @p d, on
// bare layer @p l through the decode core; the cache's lengths grow once it is enqueued.
CLMHA__HIDDEN clmha_status clmha__attention_kv_enqueue(clmha_layer *l,
                                                       const clmha_attention_args *a,
                                                       const clmha__attention_dims *d,
                                                       const clmha__attention_out *o,
                                                       cl_uint num_wait,
                                                       const cl_event *wait_list,
                                                       cl_event *event);

// D_v ≠ D (attention_pad.c): the calls run on copies padded with zeros to
// D' = max(D, D_v), the bare layer's head dimension (clmha__attention_width()).
CLMHA__HIDDEN size_t clmha__attention_width(const clmha__attention_dims *d);

// The first of the bare layer's staging slots that hold padded copies: the forward's query,
// key, value and output, then the backward's output gradient and query, key and value
// gradients (8 slots after the host backward's four gradients).
#define CLMHA__ATTENTION_PAD_SLOT (CLMHA__HOST_GRAD + 4)

// Call @p a (resolved in @p d) with query, key and value widened to D' in staging slots @p slot,
// slot + 1, slot + 2 (room made, nothing written), the scale fixed to the caller's: @p p,
// resolved in @p pd.
CLMHA__HIDDEN clmha_status clmha__attention_pad_call(clmha_layer *l,
                                                     const clmha_attention_args *a,
                                                     const clmha__attention_dims *d, int slot,
                                                     clmha_attention_args *p,
                                                     clmha__attention_dims *pd);

// Enqueues the copy of @p rows rows of @p from elements (the layer's: floats or doubles) at
// @p src_off of @p src into rows of @p to elements at @p dst_off of @p dst: zeros past @p from
// when @p to is wider, the first @p to columns when it is narrower. The first command waits for
// @p wait_list.
CLMHA__HIDDEN clmha_status clmha__attention_pad_rows(clmha_layer *l, cl_mem src, size_t src_off,
                                                     size_t from, cl_mem dst, size_t dst_off,
                                                     size_t to, size_t rows, cl_uint num_wait,
                                                     const cl_event *wait_list);

// Enqueues the padded copies of @p a's query, key and value into @p p's buffers (from
// clmha__attention_pad_call()), after @p wait_list.
CLMHA__HIDDEN clmha_status clmha__attention_pad_inputs(clmha_layer *l,
                                                       const clmha_attention_args *a,
                                                       const clmha__attention_dims *d,
                                                       const clmha_attention_args *p,
                                                       cl_uint num_wait,
                                                       const cl_event *wait_list);

#endif
