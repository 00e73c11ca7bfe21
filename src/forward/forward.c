// The forward pass, in the order the data flows:
//   validate → project (GEMM) → [the middle, middle.c: split heads (+ in_proj_bias,
//   bias_k/bias_v, zero key) → scores = Q·Kᵀ/√D (strided batched GEMM) → masks + softmax +
//   dropout (kernel) → A·V (strided batched GEMM) → merge heads] → output projection (GEMM,
//   bias) → attention weights (copy or head average).
// A core that reads the projected rows (clmha__core::reads_rows, the fused core) skips the
// split and the merge in a call with no appended keys, no KV cache, nothing saved and not
// partial, adding in_proj_bias itself (the rows path, clmha__core_call::rows).
// The middle is what attention as a function (attention.c) runs on the caller's head-split
// tensors. Its three inner stages (scores, softmax, A·V) are the attention core's (src/cores/): the
// first row of the dispatch table that runs the call (clmha__core_select()), whose flags say
// what it takes (head tiles or projected rows, grouped key/value heads, the scores buffer).
// The checks are in validate.c, partial attention in partial.c, the host-array form in
// forward_host.c. Everything is enqueued on the context's in-order queue; nothing here waits
// on the host.
#include "base/checked.h"
#include "base/struct_in.h"
#include "cores/core.h"
#include "cores/kernel_args.h"
#include "device/blas.h"
#include "device/held.h"
#include "base/half.h"
#include "forward/convert.h"
#include "forward/enqueue.h"
#include "forward/forward.h"
#include "forward/middle.h"
#include "forward/saved.h"
#include "layer/packed.h"
#include "layer/layer.h"
#include "layer/shape.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <clblast_c.h>

typedef clmha__arg arg;
#define ARG CLMHA__ARG

// ---- the stages ---------------------------------------------------------------------------------

// Region offsets (floats) inside the layer's scratch buffers for one call.
typedef struct scratch {
    size_t proj_q, proj_k, proj_v;  // in layer->proj
    size_t ld_q, ld_k, ld_v;        // row pitch of each projection
    size_t col_q, col_k, col_v;     // first column of each projection in its rows
} scratch;

// Whether call @p a's key and value are its query (same buffer and offset, kdim = vdim = E):
// one packed QKV projection.
static bool packed_qkv(const clmha_layer *l, const clmha_forward_args *a, const clmha__dims *d) {
    cl_mem key = d->key_is_query ? a->query.buffer : a->key.buffer;
    size_t key_off = d->key_is_query ? a->query.offset : a->key.offset;
    cl_mem value = d->value_is_key ? key : a->value.buffer;
    size_t value_off = d->value_is_key ? key_off : a->value.offset;
    return key == a->query.buffer && key_off == a->query.offset && d->l == d->s &&
           d->kdim == l->e && d->vdim == l->e && value == key && value_off == key_off;
}

// 1. Input projections: one GEMM for packed QKV (self-attention), one for K and V when they
//    are the same tensor, else one each.
// Without @p kv (a call with kv_attend_only) only the query projection. With @p rows (the
// fused core reads the projected rows where they are) rows 4 KiB apart get one cache line more
// (clmha__rows_pitch()).
static clmha_status project(clmha_layer *l, const clmha_forward_args *a, const clmha__dims *d,
                            bool kv, bool rows, scratch *s) {
    // kve: the key and value projections' width (E, or num_kv_heads * D with grouped-query
    // attention).
    size_t e = l->e, kve = l->kve, kd = d->kdim, vd = d->vdim;
    size_t rows_q = d->n * d->l, rows_kv = d->n * d->s;
    size_t wk = e * e, wv = e * e + kve * kd;  // offsets of W_k and W_v in w_in
    cl_mem key = d->key_is_query ? a->query.buffer : a->key.buffer;
    size_t key_off = d->key_is_query ? a->query.offset : a->key.offset;
    cl_mem value = d->value_is_key ? key : a->value.buffer;
    size_t value_off = d->value_is_key ? key_off : a->value.offset;
    bool kv_same = value == key && value_off == key_off && kd == vd;
#define PITCH(width) (rows ? clmha__rows_pitch(l, width) : (width))
    clmha_status st;
    if (!kv) {  // kv_attend_only: the queries alone
        *s = (scratch){.ld_q = e};
        return clmha__gemm_nt(l, "query projection", rows_q, e, e, a->query.buffer,
                              a->query.offset, e, l->w_in, 0, e, 0.0f, l->proj, 0, e);
    }

    if (packed_qkv(l, a, d)) {  // (L*N, E) · [W_q; W_k; W_v]ᵀ → (L*N, E + 2 KVE)
        size_t w = e + 2 * kve, ld = PITCH(w);
        *s = (scratch){.ld_q = ld, .ld_k = ld, .ld_v = ld, .col_k = e, .col_v = e + kve};
        return clmha__gemm_nt(l, "packed QKV projection", rows_q, w, e, a->query.buffer,
                              a->query.offset, e, l->w_in, 0, e, 0.0f, l->proj, 0, ld);
    }
    size_t ld_q = PITCH(e), ld_kv = kv_same ? PITCH(2 * kve) : PITCH(kve);
    *s = (scratch){.proj_k = rows_q * ld_q, .proj_v = rows_q * ld_q + rows_kv * ld_kv,
                   .ld_q = ld_q, .ld_k = ld_kv, .ld_v = ld_kv};
#undef PITCH
    if ((st = clmha__gemm_nt(l, "query projection", rows_q, e, e, a->query.buffer,
                      a->query.offset, e, l->w_in, 0, e, 0.0f, l->proj, s->proj_q, ld_q)))
        return st;
    if (kv_same) {  // W_k and W_v are consecutive rows of w_in: one GEMM → (S*N, 2 KVE)
        s->proj_v = s->proj_k;
        s->col_v = kve;
        return clmha__gemm_nt(l, "key/value projection", rows_kv, 2 * kve, kd, key,
                       key_off, kd, l->w_in, wk, kd, 0.0f, l->proj, s->proj_k, ld_kv);
    }
    if ((st = clmha__gemm_nt(l, "key projection", rows_kv, kve, kd, key, key_off, kd,
                      l->w_in, wk, kd, 0.0f, l->proj, s->proj_k, ld_kv)))
        return st;
    return clmha__gemm_nt(l, "value projection", rows_kv, kve, vd, value, value_off,
                          vd, l->w_in, wv, vd, 0.0f, l->proj, s->proj_v, ld_kv);
}

// 2–6. The middle (middle.c): the projected rows split into head tiles (N*H, T, D), adding
//    in_proj_bias, key and value with bias_k/bias_v and a zero row appended when the layer has
//    them; the core; its result merged back into rows (L*N or N*L, E) in layer->proj (a
//    partial call's head tiles and log-sum-exp rows to the caller's buffers instead). With
//    grouped-query attention the key and value tiles hold the kvh key/value heads for a core
//    that reads them so (clmha__core::grouped_kv), else every query head its own copy of its
//    group's.
// @p bare: the key and value tiles hold the call's tokens alone, without the appended keys (a
// partial call without appended_keys). No @p kv (kv_attend_only): they are not made at all.
static clmha__middle middle_of(clmha_layer *l, const clmha__dims *d, const scratch *s, bool kv,
                               bool bare, bool grouped, const clmha__partial_out *partial) {
    size_t heads = grouped ? l->kvh : l->h, group = grouped ? 1 : l->h / l->kvh;
    size_t s_out = bare ? d->s : d->s_padded;
    cl_mem bias = l->desc.bias ? l->b_in : NULL, extra = l->desc.add_bias_kv ? l->bias_kv : NULL;
    clmha__heads_in row = {.buffer = l->proj, .batch_first = d->batch_first, .n = d->n,
                           .bias = bias};
    clmha__middle m = {.query = row, .key = row, .value = row,
                       .out = {.buffer = l->proj, .batch_first = d->batch_first}};
    m.query.offset = s->proj_q, m.query.ld = s->ld_q, m.query.col = s->col_q;
    m.query.seq = m.query.seq_out = d->l, m.query.heads = l->h, m.query.group = 1;
    m.key.offset = s->proj_k, m.key.ld = s->ld_k, m.key.col = s->col_k, m.key.bias_col = l->e;
    m.value.offset = s->proj_v, m.value.ld = s->ld_v, m.value.col = s->col_v;
    m.value.bias_col = l->e + l->kve;
    m.key.extra = m.value.extra = extra, m.value.extra_off = l->kve;  // bias_k, then bias_v
    m.key.seq = m.value.seq = d->s, m.key.seq_out = m.value.seq_out = s_out;
    m.key.heads = m.value.heads = heads, m.key.group = m.value.group = group;
    if (!kv) m.key.buffer = m.value.buffer = NULL;
    if (partial) {
        m.out = (clmha__heads_out){.buffer = partial->heads, .offset = partial->heads_offset,
                                   .tiles = true};
        m.lse = partial->lse, m.lse_offset = partial->lse_offset;
    }
    return m;
}

// 7. Output projection: out = merged · out_proj.weightᵀ + out_proj.bias, @p merged the merged
//    rows (layer->proj, or the result tile of a core that takes or reads rows); @p fill: the
//    bias goes in with the GEMM (clmha__gemm_nt_bias()), else a clmha__core::takes_rows core
//    wrote it into the output rows and the GEMM adds to them.
clmha_status clmha__forward_out_project(clmha_layer *l, const clmha__dims *d, cl_mem merged,
                                cl_mem out, size_t out_off, bool fill) {
    size_t rows = d->n * d->l, e = l->e;
    if (l->desc.bias && fill)
        return clmha__gemm_nt_bias(l, "output projection", rows, e, e, merged, 0, e, l->w_out, 0,
                                   e, l->b_out, out, out_off, e);
    return clmha__gemm_nt(l, "output projection", rows, e, e, merged, 0, e,
                          l->w_out, 0, e, l->desc.bias ? 1.0f : 0.0f, out, out_off, e);
}

// ---- the pass -----------------------------------------------------------------------------------

// Enqueues the stages of a validated call: waits for @p wait_list, then the input projections →
// the middle (split, the core, merge: middle.c, as attention as a function runs it) → the output
// projection → the weights; the completion event in @p event.
static clmha_status enqueue_pass(clmha_layer *layer, const clmha_forward_args *args,
                                 const clmha__dims *d, const clmha__core *core,
                                 clmha__core_call *call, const clmha__partial_out *partial,
                                 cl_mem output, size_t output_offset, cl_mem weights,
                                 size_t weights_offset, cl_uint num_wait,
                                 const cl_event *wait_list, cl_event *event) {
    clmha_context *ctx = layer->ctx;
    clmha_status st;
    if ((st = clmha__enqueue_wait(ctx, num_wait, wait_list))) return st;
    // With profiling on, a marker ends each stage (slot 0 marks the start).
    clmha__layer_marks_release(layer);
    scratch s;
    if ((st = clmha__layer_mark(layer, 0))) return st;
    bool kv = !(args->kv_cache && args->kv_attend_only);
    // A core that reads the projected rows gets them where they are (one packed projection or
    // one for each of query, key/value or key and value) in a call with nothing appended to the
    // keys, whose head tiles nothing else needs (no KV cache, not saved, not partial).
    call->rows = core->reads_rows && kv && !args->kv_cache && !args->save && !partial &&
                 d->s_padded == d->s;
    if ((st = project(layer, args, d, kv, call->rows, &s)) ||
        (st = clmha__layer_mark(layer, 1 + CLMHA_STAGE_PROJECT)))
        return st;
    // A partial call without the appended keys leaves them out of the key and value tiles.
    bool bare = partial && !partial->appended_keys;
    if (core->takes_rows) call->output = output, call->output_offset = output_offset;
    clmha__middle m = middle_of(layer, d, &s, kv, bare, call->kv_group > 1, partial);
    if ((st = clmha__middle_run(layer, core, call, &m))) return st;
    if (partial) return clmha__enqueue_event(ctx, event);
    cl_mem merged =
        core->takes_rows || call->rows ? layer->tiles[CLMHA__TILE_OUT] : layer->proj;
    if ((st = clmha__forward_out_project(layer, d, merged, output, output_offset,
                                         !core->takes_rows)) ||
        (st = clmha__layer_mark(layer, 1 + CLMHA_STAGE_OUT_PROJ)))
        return st;
    if (args->need_weights &&
        ((!call->weights_written &&
          (st = clmha__weights_out(layer, d, args->per_head_weights, weights, weights_offset))) ||
         (st = clmha__layer_mark(layer, 1 + CLMHA_STAGE_WEIGHTS))))
        return st;
    return clmha__enqueue_event(ctx, event);
}

static clmha_status forward_direct(clmha_layer *layer, const clmha_forward_args *args,
                                   cl_mem output, size_t output_offset, cl_mem weights,
                                   size_t weights_offset, cl_uint num_wait,
                                   const cl_event *wait_list, cl_event *event);


static clmha_status forward_converted(clmha_layer *layer, const clmha_forward_args *args,
                                      cl_mem output, size_t output_offset, cl_mem weights,
                                      size_t weights_offset, cl_uint num_wait,
                                      const cl_event *wait_list, cl_event *event);

// Rows of a packed tensor (@p feat elements of @p elem bytes per row, the sequences' @p lens
// rows one after another from element @p packed_off of @p packed) copied to or from (@p back)
// their places in the padded tensor @p padded (n sequences of @p longest rows, batch first or
// not), one rectangular copy per sequence.
static clmha_status pad_rows(clmha_layer *l, cl_mem packed, size_t packed_off, cl_mem padded,
                             size_t n, size_t longest, size_t feat, size_t elem,
                             const size_t *lens, bool back) {
    size_t row = feat * elem, first = 0;
    bool bf = l->desc.batch_first;
    for (size_t i = 0; i < n; first += lens[i], ++i) {
        if (!lens[i]) continue;
        size_t at_packed[3] = {(packed_off + first * feat) * elem, 0, 0};
        size_t at_padded[3] = {(bf ? i * longest : i) * row, 0, 0};
        size_t region[3] = {row, lens[i], 1}, pitch = bf ? row : n * row;
        cl_int err = clEnqueueCopyBufferRect(
            l->ctx->queue, back ? padded : packed, back ? packed : padded,
            back ? at_padded : at_packed, back ? at_packed : at_padded, region,
            back ? pitch : row, 0, back ? row : pitch, 0, 0, NULL, NULL);
        if (err) return clmha__cl_fail(l->ctx, err, "clEnqueueCopyBufferRect(packed rows)");
    }
    return CLMHA_SUCCESS;
}

// Packed tensor @p t (@p feat elements a row) as padded slot @p slot, (n, longest, feat) in the
// layer's order, zeros where no sequence has rows; @p t then points at it.
static clmha_status pad_input(clmha_layer *l, int slot, const char *what, clmha_tensor *t,
                              size_t n, size_t longest, size_t feat, const size_t *lens) {
    size_t elem = clmha__dtype_size(l->desc.dtype), count = n * longest * feat, zero = 0;
    clmha_status st = clmha__grow_buffer(l->ctx, &l->staged[slot], &l->staged_caps[slot],
                                         (count * elem + 3) / 4, what);
    if (st) return st;
    cl_int err = clEnqueueFillBuffer(l->ctx->queue, l->staged[slot], &zero, elem, 0,
                                     count * elem, 0, NULL, NULL);
    if (err) return clmha__cl_fail(l->ctx, err, "clEnqueueFillBuffer(padded input)");
    if ((st = pad_rows(l, t->buffer, t->offset, l->staged[slot], n, longest, feat, elem, lens,
                       false)))
        return st;
    bool bf = l->desc.batch_first;
    *t = (clmha_tensor){.ndim = 3, .shape = {bf ? n : longest, bf ? longest : n, feat},
                        .buffer = l->staged[slot]};
    return CLMHA_SUCCESS;
}

// A packed call through a KV cache: one batched call on copies padded to the longest sequence,
// each sequence appending its own kv_seq_lens keys (kv_append), the output rows of its real
// queries copied back. The decode core's work is per sequence's cached and new tokens anyway.
static clmha_status forward_packed_cached(clmha_layer *l, const clmha_forward_args *args,
                                          const clmha__dims *d, cl_mem output,
                                          size_t output_offset, cl_uint num_wait,
                                          const cl_event *wait_list, cl_event *event) {
    size_t elem = clmha__dtype_size(l->desc.dtype), n = d->n;
    size_t kd = l->desc.kdim ? l->desc.kdim : d->e, vd = l->desc.vdim ? l->desc.vdim : d->e;
    clmha_forward_args pad = *args;
    pad.seq_lens = pad.kv_seq_lens = NULL, pad.num_seqs = 0;
    pad.kv_append = args->kv_attend_only ? NULL : d->kv_seq_lens;
    clmha_status st;
    size_t out_floats = (n * d->l * d->e * elem + 3) / 4;
    if ((st = clmha__enqueue_wait(l->ctx, num_wait, wait_list)) ||
        (st = pad_input(l, CLMHA__STAGED_PAD_QUERY, "padded query", &pad.query, n, d->l, d->e,
                        d->seq_lens)) ||
        (args->key.ndim &&
         (st = pad_input(l, CLMHA__STAGED_PAD_KEY, "padded key", &pad.key, n, d->s, kd,
                         d->kv_seq_lens))) ||
        (args->value.ndim &&
         (st = pad_input(l, CLMHA__STAGED_PAD_VALUE, "padded value", &pad.value, n, d->s, vd,
                         d->kv_seq_lens))) ||
        (st = clmha__grow_buffer(l->ctx, &l->staged[CLMHA__STAGED_PAD_OUTPUT],
                                 &l->staged_caps[CLMHA__STAGED_PAD_OUTPUT], out_floats,
                                 "padded output")) ||
        (st = clmha_layer_forward(l, &pad, l->staged[CLMHA__STAGED_PAD_OUTPUT], 0, NULL, 0, 0,
                                  NULL, NULL)) ||
        (st = pad_rows(l, output, output_offset, l->staged[CLMHA__STAGED_PAD_OUTPUT], n, d->l,
                       d->e, elem, d->seq_lens, true)))
        return st;
    return clmha__enqueue_event(l->ctx, event);
}

// A packed variable-length batch (clmha_forward_args::seq_lens): checked as one call (the
// packed tensors' sizes, the output's, the aliasing), then run as one unbatched call per
// sequence on its rows of the packed query, key, value and output (layer/packed.h), one after
// another on the in-order queue, after the caller's wait list; the event marks the end of the
// last. Each sequence's projections, core and output projection run over its own tokens only,
// so the work is that of the real tokens; a call that saves keeps each sequence's state in a
// part of its clmha_saved.
static clmha_status forward_packed(clmha_layer *layer, const clmha_forward_args *args,
                                   cl_mem output, size_t output_offset, cl_uint num_wait,
                                   const cl_event *wait_list, cl_event *event) {
    size_t elem = clmha__dtype_size(layer->desc.dtype);
    clmha__dims d;
    clmha_status st;
    if ((st = clmha__forward_check_call(layer, args, &d)) ||
        (st = clmha__forward_check_inputs(layer, args, &d, elem)) ||
        (st = clmha__forward_check_results(layer, args, &d, output, output_offset, NULL, 0,
                                           elem)))
        return st;
    if (args->kv_cache)  // one padded call (the cache's sequences are the call's)
        return forward_packed_cached(layer, args, &d, output, output_offset, num_wait,
                                     wait_list, event);
    if (args->save && (st = clmha__saved_packed_prepare(args->save, layer, &d))) return st;
    if ((st = clmha__enqueue_wait(layer->ctx, num_wait, wait_list))) return st;
    clmha__packed_at at = {0, 0};
    for (size_t i = 0; i < d.n; at = clmha__packed_next(&d, i, at), ++i) {
        if (!d.seq_lens[i]) continue;
        clmha_forward_args sub;
        clmha__packed_args(&d, args, i, at, elem, &sub);
        sub.save = args->save ? args->save->parts[i] : NULL;
        if ((st = clmha_layer_forward(layer, &sub, output, output_offset + at.q0 * d.e, NULL, 0,
                                      0, NULL, NULL)))
            return st;
    }
    if (args->save) clmha__saved_packed_filled(args->save, args, &d);
    return clmha__enqueue_event(layer->ctx, event);
}

static clmha_status forward(clmha_layer *layer, const clmha_forward_args *args, cl_mem output,
                            size_t output_offset, cl_mem weights, size_t weights_offset,
                            cl_uint num_wait, const cl_event *wait_list, cl_event *event) {
    if (event) *event = NULL;
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    clmha_forward_args in;
    clmha_status st = clmha__forward_args_in(ctx, &in, &args);
    if (st) return st;
    if ((st = clmha__check_wait_list(ctx, num_wait, wait_list))) return st;
    clmha_dtype t = layer->desc.dtype;
    if (args->seq_lens)  // one call per sequence
        return forward_packed(layer, args, output, output_offset, num_wait, wait_list, event);
    return t == CLMHA_DTYPE_F32 || t == CLMHA_DTYPE_F64
               ? forward_direct(layer, args, output, output_offset, weights, weights_offset,
                                num_wait, wait_list, event)
               : forward_converted(layer, args, output, output_offset, weights, weights_offset,
                                   num_wait, wait_list, event);
}

// A 16-bit layer's call: its query, key, value and float masks widened into the layer's
// float32 copies, the float32 pass over those (with no wait list: the queue is in order), its
// output and weights narrowed into the caller's buffers.
static clmha_status forward_converted(clmha_layer *layer, const clmha_forward_args *args,
                                      cl_mem output, size_t output_offset, cl_mem weights,
                                      size_t weights_offset, cl_uint num_wait,
                                      const cl_event *wait_list, cl_event *event) {
    clmha_context *ctx = layer->ctx;
    size_t elem = clmha__dtype_size(layer->desc.dtype);
    clmha__dims d;
    clmha_status st;
    if ((st = clmha__forward_check_call(layer, args, &d)) ||
        (st = clmha__forward_check_inputs(layer, args, &d, elem)) ||
        (st = clmha__forward_check_results(layer, args, &d, output, output_offset, weights,
                                   weights_offset, elem)))
        return st;
    clmha_forward_args f = *args;
    cl_mem out32, weights32 = NULL;
    if ((st = clmha__convert_result(layer, CLMHA__STAGED_OUTPUT, "float32 output", d.output_count,
                                    &out32)) ||
        (args->need_weights &&
         (st = clmha__convert_result(layer, CLMHA__STAGED_WEIGHTS, "float32 weights",
                                     d.weights_count, &weights32))) ||
        (st = clmha__enqueue_wait(ctx, num_wait, wait_list)) ||
        (st = clmha__convert_inputs(layer, &d, &f)))
        return st;
    if ((st = forward_direct(layer, &f, out32, 0, weights32, 0, 0, NULL, NULL)) ||
        (st = clmha__convert_out(layer, CLMHA__STAGED_OUTPUT, output, output_offset,
                                 d.output_count)) ||
        (args->need_weights &&
         (st = clmha__convert_out(layer, CLMHA__STAGED_WEIGHTS, weights, weights_offset,
                                  d.weights_count))))
        return st;
    return clmha__enqueue_event(ctx, event);
}

// A call on the layer's own elements (float32, or float64 for a float64 layer), or the float32
// pass of a 16-bit layer's (on its float32 copies).
static clmha_status forward_direct(clmha_layer *layer, const clmha_forward_args *args,
                                   cl_mem output, size_t output_offset, cl_mem weights,
                                   size_t weights_offset, cl_uint num_wait,
                                   const cl_event *wait_list, cl_event *event) {
    clmha__dims d;
    clmha_status st = clmha__forward_validate(layer, args, true, &d);
    if (st) return st;
    if ((st = clmha__forward_check_results(layer, args, &d, output, output_offset, weights,
                                   weights_offset, layer->rs)))
        return st;
    // The core: the first row of the table that runs the call (src/cores/core.c).
    clmha__core_call call = {.args = args, .dims = &d, .weights = weights,
                             .weights_offset = weights_offset};
    clmha__kv_plan plan = {0};
    if (args->kv_cache) {
        if ((st = clmha__kv_plan_make(args->kv_cache, layer, false, d.n,
                                      args->kv_attend_only ? 0 : d.s, args->kv_append, &plan)))
            return st;
        call.kv = &plan;
        call.kv_append = !args->kv_attend_only;
    }
    st = clmha__forward_planned(layer, args, &d, &call, NULL, output, output_offset, weights,
                         weights_offset, num_wait, wait_list, event);
    if (!st && args->kv_cache) clmha__kv_plan_commit(&plan);
    clmha__kv_plan_release(&plan);
    return st;
}

// The rest of a checked call: the core, the scratch, the saved state, the stages.
clmha_status clmha__forward_planned(clmha_layer *layer, const clmha_forward_args *args,
                                    const clmha__dims *dims, clmha__core_call *callp,
                                    const clmha__partial_out *partial, cl_mem output,
                                    size_t output_offset, cl_mem weights, size_t weights_offset,
                                    cl_uint num_wait, const cl_event *wait_list, cl_event *event) {
    clmha_status st;
    const clmha__dims d = *dims;
    clmha__core_call call = *callp;
    const clmha__core *core;
    bool fell_back;
    // A partial call needs the log-sum-exp rows: only a core that writes them runs it.
    call.need_lse = partial != NULL;
    if ((st = clmha__core_select(layer, &call, &core, &fell_back))) return st;
    if (partial && (st = clmha__layer_grow(layer, &layer->partial_lse, &layer->partial_lse_cap,
                                           d.n * layer->h * d.l,
                                           "partial attention log-sum-exp")))
        return st;
    if (partial) call.lse = layer->partial_lse;
    layer->last_core = core;
    if ((st = clmha__layer_reserve(layer, &d, core->uses_scores,
                                   core->uses_scores && args->need_weights &&
                                       !args->per_head_weights)))
        return st;

    clmha_saved *saved = args->save;
    // Grouped-query attention: a core that reads the key/value heads grouped gets them so,
    // except in a call that saves for the backward pass, whose cores take one key/value plane
    // per query head (the backward pass sums the repeated heads' gradients).
    call.kv_group = core->grouped_kv && !saved ? layer->h / layer->kvh : 1;
    if (saved && (st = clmha__saved_prepare(saved, layer, &d))) return st;
    // Nothing is enqueued before this point. A call that saves runs its head tiles in the
    // saved object's buffers (and a core that writes the log-sum-exp writes it there).
    if (saved) {
        clmha__saved_swap(saved, layer);
        call.lse = saved->lse;
        call.lse_split = true;  // the saved rows have room for them (clmha__saved_prepare())
    }
    st = enqueue_pass(layer, args, &d, core, &call, partial, output, output_offset, weights,
                      weights_offset, num_wait, wait_list, event);
    if (saved) {
        clmha__saved_swap(saved, layer);
        // fell_back: the core the call asked for could not run it here (a driver bug,
        // clmha_impl), and its backward may fall back too.
        if (!st) clmha__saved_filled(saved, args, &d, core, call.lse_written, fell_back);
        if (!st) saved->lse_split = call.lse_written && call.lse_split_written;
    }
    return st;
}

clmha_status clmha__forward_times_dropped(clmha_layer *layer, clmha_status st) {
    if (st && layer) clmha__layer_marks_release(layer);
    return st;
}

clmha_status clmha_layer_forward(clmha_layer *layer, const clmha_forward_args *args,
                                 cl_mem output, size_t output_offset, cl_mem weights,
                                 size_t weights_offset, cl_uint num_wait,
                                 const cl_event *wait_list, cl_event *event) {
    return clmha__forward_times_dropped(layer, forward(layer, args, output, output_offset, weights,
                                                   weights_offset, num_wait, wait_list, event));
}
