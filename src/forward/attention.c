// Attention as a function (clmha_attention_forward(), clmha_attention_output_counts()): scaled
// dot-product attention on projected, head-split tensors, run by the same attention cores,
// through the same dispatch (clmha__core_select()), as the layer's forward pass; on a bare
// layer of the context's attention cache (attention_cache.c), whose head tiles are the
// caller's buffers or copies of them (docs/design.md, "Attention as a function"):
//   check → core and scratch → wait → stage the tiles → the core → output, lse, weights.
#include "forward/attention.h"

#include "cores/core.h"
#include "cores/kernel_args.h"
#include "forward/attention_cache.h"
#include "forward/enqueue.h"
#include "forward/staging.h"

#include <string.h>

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
    size_t melem = m ? clmha__mask_elem(m->kind) : 1;
    clmha_status st;
    if ((st = clmha__check_buffer(ctx, "query", a->query.buffer, a->query.offset,
                                  d->query_count, 4)) ||
        (st = clmha__check_buffer(ctx, "key", a->key.buffer, a->key.offset, d->key_count, 4)) ||
        (st = clmha__check_buffer(ctx, "value", a->value.buffer, a->value.offset,
                                  d->value_count, 4)) ||
        (m && (st = clmha__check_buffer(ctx, "attn_mask", m->tensor.buffer, m->tensor.offset,
                                        d->mask_count, melem))) ||
        (st = clmha__check_buffer(ctx, "output", o->output, o->output_offset, d->output_count,
                                  4)) ||
        (st = clmha__check_writable(ctx, "output", o->output)) ||
        (o->lse && ((st = clmha__check_buffer(ctx, "lse", o->lse, o->lse_offset, d->lse_count,
                                              4)) ||
                    (st = clmha__check_writable(ctx, "lse", o->lse)))) ||
        (o->weights &&
         ((st = clmha__check_buffer(ctx, "weights", o->weights, o->weights_offset,
                                    d->weights_count, 4)) ||
          (st = clmha__check_writable(ctx, "weights", o->weights)))))
        return st;
    clmha__span all[7];
    size_t k = 0, outputs;
    all[k++] = clmha__span_of("output", o->output, o->output_offset, d->output_count, 4);
    if (o->lse) all[k++] = clmha__span_of("lse", o->lse, o->lse_offset, d->lse_count, 4);
    if (o->weights)
        all[k++] = clmha__span_of("weights", o->weights, o->weights_offset, d->weights_count, 4);
    outputs = k;
    all[k++] = clmha__span_of("query", a->query.buffer, a->query.offset, d->query_count, 4);
    all[k++] = clmha__span_of("key", a->key.buffer, a->key.offset, d->key_count, 4);
    all[k++] = clmha__span_of("value", a->value.buffer, a->value.offset, d->value_count, 4);
    if (m)
        all[k++] = clmha__span_of("attn_mask", m->tensor.buffer, m->tensor.offset, d->mask_count,
                                  melem);
    return clmha__check_overlaps(ctx, all, k, outputs);
}

clmha_status clmha__attention_stage(clmha_layer *l, const clmha__attention_dims *d,
                                    cl_mem scratch, const clmha_tensor *t, size_t heads,
                                    size_t seq, size_t count, cl_mem *use) {
    clmha_context *ctx = l->ctx;
    *use = d->layout == CLMHA_LAYOUT_NHLD && t->offset == 0 ? t->buffer : scratch;
    if (*use == t->buffer) return CLMHA_SUCCESS;
    if (d->layout == CLMHA_LAYOUT_NHLD) {
        cl_int err = clEnqueueCopyBuffer(ctx->queue, t->buffer, scratch,
                                         t->offset * sizeof(float), 0, count * sizeof(float), 0,
                                         NULL, NULL);
        return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(attention input)")
                   : CLMHA_SUCCESS;
    }
    cl_ulong off = t->offset, ld = heads * l->d, zero = 0, n = d->core.n, h = heads, group = 1,
             s = seq, hd = l->d;
    cl_uint no = 0, bf = 1;
    arg args[] = {ARG(t->buffer), ARG(off),  ARG(ld),    ARG(zero),       ARG(ctx->dummy),
                  ARG(zero),      ARG(no),   ARG(ctx->dummy), ARG(zero),  ARG(no),
                  ARG(scratch),   ARG(zero), ARG(n),     ARG(h),          ARG(group),
                  ARG(s),         ARG(s),    ARG(hd),    ARG(bf)};
    return clmha__launch_heads(l, l->split_heads, "split_heads", d->core.n * heads, seq,
                               l->heads_wg, args, sizeof args / sizeof args[0]);
}

clmha_status clmha__attention_unstage(clmha_layer *l, const clmha__attention_dims *d,
                                      cl_mem tile, size_t heads, size_t seq, size_t count,
                                      cl_mem out, size_t out_offset) {
    clmha_context *ctx = l->ctx;
    size_t bytes = count * sizeof(float);
    cl_int err = CL_SUCCESS;
    if (tile == out) return CLMHA_SUCCESS;  // written in place
    if (d->layout == CLMHA_LAYOUT_NHLD) {
        err = clEnqueueCopyBuffer(ctx->queue, tile, out, 0, out_offset * sizeof(float), bytes, 0,
                                  NULL, NULL);
        return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(result)") : CLMHA_SUCCESS;
    }
    cl_mem rows = out_offset ? l->proj : out;
    cl_ulong zero = 0, n = d->core.n, h = heads, t = seq, hd = l->d;
    cl_uint bf = 1;
    arg args[] = {ARG(tile), ARG(zero), ARG(rows), ARG(n), ARG(h), ARG(t), ARG(hd), ARG(bf)};
    clmha_status st = clmha__launch_heads(l, l->merge_heads, "merge_heads", d->core.n * heads,
                                          seq, l->heads_wg, args, sizeof args / sizeof args[0]);
    if (st || !out_offset) return st;
    err = clEnqueueCopyBuffer(ctx->queue, rows, out, 0, out_offset * sizeof(float), bytes, 0,
                              NULL, NULL);
    return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(result)") : CLMHA_SUCCESS;
}

// The log-sum-exp rows (when the core wrote them elsewhere than the caller's buffer) and the
// weights (when the core left them in layer->scores).
static clmha_status write_extras(clmha_layer *l, const clmha__attention_dims *d,
                                 const clmha__attention_out *o, const clmha__core_call *call) {
    clmha_context *ctx = l->ctx;
    cl_int err = CL_SUCCESS;
    if (o->lse && call->lse != o->lse)
        err = clEnqueueCopyBuffer(ctx->queue, call->lse, o->lse, 0, o->lse_offset * sizeof(float),
                                  d->lse_count * sizeof(float), 0, NULL, NULL);
    if (!err && o->weights && !call->weights_written)
        err = clEnqueueCopyBuffer(ctx->queue, l->scores, o->weights, 0,
                                  o->weights_offset * sizeof(float),
                                  d->weights_count * sizeof(float), 0, NULL, NULL);
    return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(lse or weights)") : CLMHA_SUCCESS;
}

// Whether @p buf is CL_MEM_WRITE_ONLY: the core does not write its result there itself (a
// GEMM may read its C operand back).
static bool write_only(cl_mem buf) {
    cl_mem_flags flags = 0;
    return clGetMemObjectInfo(buf, CL_MEM_FLAGS, sizeof flags, &flags, NULL) == CL_SUCCESS &&
           (flags & CL_MEM_WRITE_ONLY);
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
        (st = clmha__grow_buffer(l->ctx, &l->partial_lse, &l->partial_lse_cap, d->lse_count,
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
        (st = clmha__host_room(l, slot + 3, "padded output", pd.output_count * sizeof(float),
                               &po.output)) ||
        (st = clmha__attention_pad_inputs(l, a, d, &p, num_wait, wait_list)) ||
        (st = clmha__attention_enqueue(l, &p, &pd, &po, 0, NULL, NULL)) ||
        (st = clmha__attention_pad_rows(l, po.output, 0, w, o->output, o->output_offset, d->dv,
                                        d->output_count / d->dv, 0, NULL)))
        return st;
    return clmha__enqueue_event(l->ctx, event);
}

clmha_status clmha__attention_enqueue(clmha_layer *l, const clmha_attention_args *a,
                                      const clmha__attention_dims *d,
                                      const clmha__attention_out *o, cl_uint num_wait,
                                      const cl_event *wait_list, cl_event *event) {
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
    cl_mem own[CLMHA__TILE_COUNT], *t = l->tiles;
    memcpy(own, t, sizeof own);
    size_t h = d->core.h, kvh = d->core.kvh;
    if (d->layout == CLMHA_LAYOUT_NHLD && o->output_offset == 0 && !write_only(o->output))
        t[CLMHA__TILE_OUT] = o->output;  // the core writes the result in place
    if (!(st = clmha__attention_stage(l, d, own[CLMHA__TILE_Q], &a->query, h, d->core.l,
                                      d->query_count, &t[CLMHA__TILE_Q])) &&
        !(st = clmha__attention_stage(l, d, own[CLMHA__TILE_K], &a->key, kvh, d->core.s,
                                      d->key_count, &t[CLMHA__TILE_K])) &&
        !(st = clmha__attention_stage(l, d, own[CLMHA__TILE_V], &a->value, kvh, d->core.s,
                                      d->value_count, &t[CLMHA__TILE_V])))
        st = core->run(l, &call);
    cl_mem result = t[CLMHA__TILE_OUT];
    memcpy(t, own, sizeof own);
    if (st ||
        (st = clmha__attention_unstage(l, d, result, h, d->core.l, d->output_count, o->output,
                                       o->output_offset)) ||
        (st = write_extras(l, d, o, &call)))
        return st;
    return clmha__enqueue_event(ctx, event);
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
        (st = clmha__attention_lock(ctx, d.core.h, d.core.kvh, clmha__attention_width(&d),
                                     &layer)))
        return st;
    st = clmha__attention_enqueue(layer, &a, &d, o, num_wait, wait_list, event);
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
