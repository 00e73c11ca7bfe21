// Attention as a function (clmha_attention_forward(), clmha_attention_output_counts()): scaled
// dot-product attention on projected, head-split tensors, run by the same attention cores,
// through the same dispatch (clmha__core_select()), as the layer's forward pass; on a bare
// layer of the context's attention cache (attention_cache.c), whose head tiles are the
// caller's buffers or copies of them (docs/design.md, "Attention as a function"):
//   check → core and scratch → wait → the middle (middle.c: the tiles in, the core, the
//   output and lse out, as in the layer's forward pass) → the weights.
// A 16-bit call runs that on float32 copies of its inputs and rounds its results once.
#include "forward/attention.h"

#include "cores/core.h"
#include "cores/kernel_args.h"
#include "forward/attention_cache.h"
#include "forward/convert.h"
#include "forward/enqueue.h"
#include "forward/middle.h"
#include "forward/staging.h"


typedef clmha__arg arg;
#define ARG CLMHA__ARG

// The mask the cores read, or NULL.
static const clmha_mask *mask_of(const clmha__attention_dims *d) {
    return d->attn.kind ? &d->attn : NULL;
}

// Every buffer: present, of the context, large enough; outputs writable and not overlapping
// each other or an input.
static clmha_status check_buffers(clmha_context *ctx, const clmha_attention_args *a,
                                  const clmha__attention_dims *d,
                                  const clmha__attention_out *o) {
    const clmha_mask *m = mask_of(d);
    size_t es = clmha__attention_elem(a), melem = m ? clmha__attention_mask_elem(a, m->kind) : 1;
    clmha_status st;
    if ((st = clmha__check_buffer(ctx, "query", a->query.buffer, a->query.offset,
                                  d->query_count, es)) ||
        (st = clmha__check_buffer(ctx, "key", a->key.buffer, a->key.offset, d->key_count, es)) ||
        (st = clmha__check_buffer(ctx, "value", a->value.buffer, a->value.offset,
                                  d->value_count, es)) ||
        (m && (st = clmha__check_buffer(ctx, "attn_mask", m->tensor.buffer, m->tensor.offset,
                                        d->mask_count, melem))) ||
        (a->alibi_slopes.ndim &&
         (st = clmha__check_buffer(ctx, "alibi_slopes", a->alibi_slopes.buffer,
                                   a->alibi_slopes.offset, d->core.h, es))) ||
        (a->sinks.ndim && (st = clmha__check_buffer(ctx, "sinks", a->sinks.buffer,
                                                    a->sinks.offset, d->core.h, es))) ||
        (a->mod_params.ndim && a->mod_params.shape[0] &&
         (st = clmha__check_buffer(ctx, "mod_params", a->mod_params.buffer,
                                   a->mod_params.offset, a->mod_params.shape[0],
                                   sizeof(float)))) ||  // p: floats in every dtype
        (st = clmha__check_buffer(ctx, "output", o->output, o->output_offset, d->output_count,
                                  es)) ||
        (st = clmha__check_writable(ctx, "output", o->output)) ||
        (o->lse && ((st = clmha__check_buffer(ctx, "lse", o->lse, o->lse_offset, d->lse_count,
                                              es)) ||
                    (st = clmha__check_writable(ctx, "lse", o->lse)))) ||
        (o->weights &&
         ((st = clmha__check_buffer(ctx, "weights", o->weights, o->weights_offset,
                                    d->weights_count, es)) ||
          (st = clmha__check_writable(ctx, "weights", o->weights)))))
        return st;
    clmha__span all[7];
    size_t k = 0, outputs;
    all[k++] = clmha__span_of("output", o->output, o->output_offset, d->output_count, es);
    if (o->lse) all[k++] = clmha__span_of("lse", o->lse, o->lse_offset, d->lse_count, es);
    if (o->weights)
        all[k++] =
            clmha__span_of("weights", o->weights, o->weights_offset, d->weights_count, es);
    outputs = k;
    all[k++] = clmha__span_of("query", a->query.buffer, a->query.offset, d->query_count, es);
    all[k++] = clmha__span_of("key", a->key.buffer, a->key.offset, d->key_count, es);
    all[k++] = clmha__span_of("value", a->value.buffer, a->value.offset, d->value_count, es);
    if (m)
        all[k++] = clmha__span_of("attn_mask", m->tensor.buffer, m->tensor.offset, d->mask_count,
                                  melem);
    return clmha__check_overlaps(ctx, all, k, outputs);
}

// Tensor @p t (N, heads, seq, D) or (N, seq, heads, D) of call @p d as the middle takes it.
static clmha__heads_in heads_in(const clmha_layer *l, const clmha__attention_dims *d,
                                const clmha_tensor *t, size_t heads, size_t seq) {
    return (clmha__heads_in){.buffer = t->buffer, .offset = t->offset,
                             .tiles = d->layout == CLMHA_LAYOUT_NHLD, .ld = heads * l->d,
                             .batch_first = true, .n = d->core.n, .seq = seq, .seq_out = seq,
                             .heads = heads, .group = 1};
}

// Where a result of the call's (N, H, seq, D) shape goes, in the call's layout.
static clmha__heads_out heads_out(const clmha__attention_dims *d, cl_mem out, size_t offset) {
    return (clmha__heads_out){.buffer = out, .offset = offset,
                              .tiles = d->layout == CLMHA_LAYOUT_NHLD, .batch_first = true};
}

clmha_status clmha__attention_stage(clmha_layer *l, const clmha__attention_dims *d,
                                    cl_mem scratch, const clmha_tensor *t, size_t heads,
                                    size_t seq, cl_mem *use) {
    clmha__heads_in in = heads_in(l, d, t, heads, seq);
    return clmha__heads_place(l, &in, scratch, use);
}

clmha_status clmha__attention_unstage(clmha_layer *l, const clmha__attention_dims *d,
                                      cl_mem tile, size_t heads, size_t seq, cl_mem out,
                                      size_t out_offset) {
    clmha__heads_out o = heads_out(d, out, out_offset);
    return clmha__heads_put(l, tile, 0, d->core.n, heads, seq, &o);
}

// The core for the call (the dispatch's answer) and the scratch it needs: what may fail
// before anything is enqueued.
static clmha_status prepare(clmha_layer *l, const clmha__attention_dims *d,
                            const clmha__attention_out *o, clmha__core_call *call,
                            const clmha__core **core) {
    clmha_status st;
    if ((st = clmha__core_select(l, call, core, NULL))) return st;
    if (!(*core)->grouped_kv && d->core.kvh != d->core.h)
        return clmha__fail(l->ctx, CLMHA_UNSUPPORTED,
                           "the %s core takes no grouped key/value heads (enable_gqa)",
                           (*core)->name);
    call->kv_group = (*core)->grouped_kv ? d->core.h / d->core.kvh : 1;
    if ((st = clmha__layer_reserve(l, &d->core, (*core)->uses_scores, false))) return st;
    if (o->lse && o->lse_offset &&
        (st = clmha__layer_grow(l, &l->partial_lse, &l->partial_lse_cap, d->lse_count,
                                "log-sum-exp rows")))
        return st;
    call->lse = !o->lse ? NULL : o->lse_offset ? l->partial_lse : o->lse;
    l->last_core = *core;
    return CLMHA_SUCCESS;
}

// D_v ≠ D: the call on copies padded to D' (attention_pad.c), its output cut back to D_v.
static clmha_status enqueue_padded(clmha_layer *l, const clmha_attention_args *a,
                                   const clmha__attention_dims *d, const clmha__attention_out *o,
                                   cl_uint num_wait, const cl_event *wait_list,
                                   cl_event *event) {
    int slot = CLMHA__ATTENTION_PAD_SLOT;
    size_t w = clmha__attention_width(d);
    clmha_attention_args p;
    clmha__attention_dims pd;
    clmha__attention_out po = *o;
    po.output_offset = 0;
    clmha_status st;
    if ((st = clmha__attention_pad_call(l, a, d, slot, &p, &pd)) ||
        (st = clmha__host_room(l, slot + 3, "padded output", pd.output_count * l->rs,
                               &po.output)) ||
        (st = clmha__attention_pad_inputs(l, a, d, &p, num_wait, wait_list)) ||
        (st = clmha__attention_enqueue(l, &p, &pd, &po, 0, NULL, NULL)) ||
        (st = clmha__attention_pad_rows(l, po.output, 0, w, o->output, o->output_offset, d->dv,
                                        d->output_count / d->dv, 0, NULL)))
        return st;
    return clmha__enqueue_event(l->ctx, event);
}

// A packed call (clmha_attention_args::seq_lens): one call per sequence on its rows of the
// packed tensors (clmha__attention_packed_args()), one after another on the queue; the
// log-sum-exp rows of sequence i go to its (H, L_i) block from H·t_i.
static clmha_status enqueue_packed(clmha_layer *l, const clmha_attention_args *a,
                                   const clmha__attention_dims *d, const clmha__attention_out *o,
                                   cl_uint num_wait, const cl_event *wait_list,
                                   cl_event *event) {
    if (o->weights)
        return clmha__fail(l->ctx, CLMHA_UNSUPPORTED,
                           "a packed call (seq_lens) returns no attention weights");
    clmha_status st;
    char msg[512];
    if ((st = clmha__enqueue_wait(l->ctx, num_wait, wait_list))) return st;
    size_t q0 = 0, k0 = 0, h = d->core.h;
    for (size_t i = 0; i < d->core.n; q0 += d->core.seq_lens[i], k0 += d->core.kv_seq_lens[i],
                ++i) {
        if (!d->core.seq_lens[i]) continue;
        clmha_attention_args sub;
        clmha__attention_dims sd;
        clmha__attention_packed_args(d, a, i, q0, k0, &sub);
        if ((st = clmha__attention_resolve(&sub, &sd, msg, sizeof msg)))
            return clmha__fail(l->ctx, st, "sequence %zu: %s", i, msg);
        clmha__attention_out so = {.output = o->output, .lse = o->lse,
                                   .output_offset = o->output_offset + q0 * h * d->dv,
                                   .lse_offset = o->lse_offset + q0 * h};
        if ((st = clmha__attention_enqueue(l, &sub, &sd, &so, 0, NULL, NULL))) return st;
    }
    return clmha__enqueue_event(l->ctx, event);
}

clmha_status clmha__attention_enqueue(clmha_layer *l, const clmha_attention_args *a,
                                      const clmha__attention_dims *d,
                                      const clmha__attention_out *o, cl_uint num_wait,
                                      const cl_event *wait_list, cl_event *event) {
    if (d->core.packed) return enqueue_packed(l, a, d, o, num_wait, wait_list, event);
    if (a->kv_cache) return clmha__attention_kv_enqueue(l, a, d, o, num_wait, wait_list, event);
    if (d->dv != d->core.d) return enqueue_padded(l, a, d, o, num_wait, wait_list, event);
    clmha_context *ctx = l->ctx;
    clmha_forward_args f = clmha__attention_core_args(l, a, d);
    f.need_weights = o->weights != NULL;
    clmha__core_call call = {.args = &f, .dims = &d->core, .weights = o->weights,
                             .weights_offset = o->weights_offset, .need_lse = o->lse != NULL,
                             .scale = d->scale};
    const clmha__core *core;
    clmha_status st;
    if ((st = prepare(l, d, o, &call, &core))) return st;
    // Nothing is enqueued before this point.
    if ((st = clmha__enqueue_wait(ctx, num_wait, wait_list))) return st;
    clmha__layer_marks_release(l);
    size_t h = d->core.h, kvh = d->core.kvh;
    clmha__middle m = {.query = heads_in(l, d, &a->query, h, d->core.l),
                       .key = heads_in(l, d, &a->key, kvh, d->core.s),
                       .value = heads_in(l, d, &a->value, kvh, d->core.s),
                       .out = heads_out(d, o->output, o->output_offset),
                       .lse = o->lse, .lse_offset = o->lse_offset};
    if ((st = clmha__middle_run(l, core, &call, &m)) ||
        (o->weights && !call.weights_written &&
         (st = clmha__weights_out(l, &d->core, true, o->weights, o->weights_offset))))
        return st;
    return clmha__enqueue_event(ctx, event);
}

// ---- 16-bit calls ----------------------------------------------------------------------------

// Tensor @p t (@p count elements of the call's dtype) widened into float32 copy @p slot, @p t
// then pointing at it.
static clmha_status widen_16(clmha_layer *l, int slot, const char *what, clmha_tensor *t,
                          size_t count) {
    clmha_status st = clmha__convert_in(l, slot, what, t->buffer, t->offset, count, &t->buffer);
    t->offset = 0;
    return st;
}

// The float32 call of @p a (sizes @p d): @p w and @p wd, the inputs widened.
static clmha_status widen_inputs(clmha_layer *l, const clmha_attention_args *a,
                                 const clmha__attention_dims *d, clmha_attention_args *w,
                                 clmha__attention_dims *wd) {
    *w = *a;
    *wd = *d;
    w->dtype = CLMHA_DTYPE_F32;
    clmha_status st;
    if ((st = widen_16(l, CLMHA__STAGED_QUERY, "float32 query", &w->query, d->query_count)) ||
        (st = widen_16(l, CLMHA__STAGED_KEY, "float32 key", &w->key, d->key_count)) ||
        (st = widen_16(l, CLMHA__STAGED_VALUE, "float32 value", &w->value, d->value_count)) ||
        (a->sinks.ndim &&
         (st = widen_16(l, CLMHA__STAGED_SINKS, "float32 sinks", &w->sinks, d->core.h))) ||
        (a->alibi_slopes.ndim && (st = widen_16(l, CLMHA__STAGED_SLOPES, "float32 alibi_slopes",
                                                &w->alibi_slopes, d->core.h))))
        return st;
    if (d->attn.kind != CLMHA_MASK_FLOAT) return CLMHA_SUCCESS;
    // The cores read the mask through d->attn; the packed and padded forms through args too.
    if ((st = widen_16(l, CLMHA__STAGED_ATTN, "float32 attn_mask", &wd->attn.tensor,
                    d->mask_count)))
        return st;
    w->attn_mask.tensor.buffer = wd->attn.tensor.buffer;
    w->attn_mask.tensor.offset = 0;
    return CLMHA_SUCCESS;
}

// A 16-bit call (clmha_attention_args::dtype float16 or bfloat16) on bare layer @p l (its
// dtype's: float32 scratch, the conversion kernels), as a 16-bit layer runs: the inputs widened
// into float32 copies after @p wait_list, the float32 call on them, the output, log-sum-exp rows
// and weights narrowed (rounded once) into the caller's buffers. A failure may leave the
// widening enqueued (it writes only the layer's copies).
static clmha_status enqueue_16(clmha_layer *l, const clmha_attention_args *a,
                               const clmha__attention_dims *d, const clmha__attention_out *o,
                               cl_uint num_wait, const cl_event *wait_list, cl_event *event) {
    clmha_attention_args w;
    clmha__attention_dims wd;
    clmha__attention_out wo = {0};
    clmha_status st;
    if ((st = clmha__convert_result(l, CLMHA__STAGED_OUTPUT, "float32 output", d->output_count,
                                    &wo.output)) ||
        (o->lse && (st = clmha__convert_result(l, CLMHA__STAGED_KPM, "float32 lse",
                                               d->lse_count, &wo.lse))) ||
        (o->weights && (st = clmha__convert_result(l, CLMHA__STAGED_WEIGHTS, "float32 weights",
                                                   d->weights_count, &wo.weights))) ||
        (st = clmha__enqueue_wait(l->ctx, num_wait, wait_list)) ||
        (st = widen_inputs(l, a, d, &w, &wd)) ||
        (st = clmha__attention_enqueue(l, &w, &wd, &wo, 0, NULL, NULL)) ||
        (st = clmha__convert_out(l, CLMHA__STAGED_OUTPUT, o->output, o->output_offset,
                                 d->output_count)) ||
        (o->lse && (st = clmha__convert_out(l, CLMHA__STAGED_KPM, o->lse, o->lse_offset,
                                            d->lse_count))) ||
        (o->weights && (st = clmha__convert_out(l, CLMHA__STAGED_WEIGHTS, o->weights,
                                                o->weights_offset, d->weights_count))))
        return st;
    return clmha__enqueue_event(l->ctx, event);
}

static clmha_status attention_forward(clmha_context *ctx, const clmha_attention_args *args,
                                      const clmha__attention_out *o, cl_uint num_wait,
                                      const cl_event *wait_list, cl_event *event) {
    clmha_attention_args a;
    clmha__attention_dims d;
    clmha_layer *layer;
    clmha_status st;
    if ((st = clmha__attention_check_args(ctx, args, &a, &d)) ||
        (st = clmha__check_wait_list(ctx, num_wait, wait_list)) ||
        (st = check_buffers(ctx, &a, &d, o)) ||
        (st = clmha__attention_lock(ctx, &d.core, clmha__attention_width(&d), a.dtype,
                                     &layer)))
        return st;
    st = clmha__attention_16(&a)
             ? enqueue_16(layer, &a, &d, o, num_wait, wait_list, event)
             : clmha__attention_enqueue(layer, &a, &d, o, num_wait, wait_list, event);
    clmha__attention_unlock(ctx);
    return st;
}

clmha_status clmha_attention_forward(clmha_context *ctx, const clmha_attention_args *args,
                                     cl_mem output, size_t output_offset, cl_mem lse,
                                     size_t lse_offset, cl_mem weights, size_t weights_offset,
                                     cl_uint num_wait, const cl_event *wait_list,
                                     cl_event *event) {
    if (event) *event = NULL;
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    clmha__attention_out o = {output, lse, weights, output_offset, lse_offset, weights_offset};
    return attention_forward(ctx, args, &o, num_wait, wait_list, event);
}

clmha_status clmha_attention_output_counts(clmha_context *ctx, const clmha_attention_args *args,
                                           size_t *output_count, size_t *lse_count,
                                           size_t *weights_count) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    clmha_attention_args a;
    clmha__attention_dims d;
    clmha_status st = clmha__attention_check_args(ctx, args, &a, &d);
    if (st) return st;
    if (output_count) *output_count = d.output_count;
    if (lse_count) *lse_count = d.lse_count;
    if (weights_count) *weights_count = d.weights_count;
    return CLMHA_SUCCESS;
}
