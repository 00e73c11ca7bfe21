// Attention as a function with a KV cache (clmha_attention_args::kv_cache): incremental
// decoding on already projected keys and values. The cores that run calls with a cache
// (clmha__core::kv_cache, the decode core) read the projected rows (clmha__core::takes_rows):
// the call's query, new keys and new values are laid out as a layer's batch-first projected
// rows in the bare layer's layer->proj (a copy in (N, L, H, D) order, merged from the heads in
// (N, H, L, D) order), the core appends the keys and values to the cache and writes the merged
// rows (N, L, H, D) to the output tile, which goes to the caller's output in its layout:
//   check → plan the cache → core and scratch → wait → rows → the core → output → commit.
#include "forward/attention.h"

#include "cores/core.h"
#include "cores/kernel_args.h"
#include "forward/enqueue.h"

typedef clmha__arg arg;
#define ARG CLMHA__ARG

// What the KV-cache form does not take; the decode core's own refusals (masks, dropout) come
// from the dispatch.
static clmha_status refuse(clmha_layer *l, const clmha__attention_dims *d,
                           const clmha__attention_out *o) {
    const char *why = o->lse       ? "log-sum-exp rows"
                      : o->weights ? "attention weights"
                      : d->dv != d->core.d ? "value head dimension D_v other than D"
                                           : NULL;
    return why ? clmha__fail(l->ctx, CLMHA_UNSUPPORTED,
                             "a call with kv_cache (the decode core) returns or takes no %s", why)
               : CLMHA_SUCCESS;
}

// Tensor @p t (@p heads heads of @p seq tokens) as batch-first rows (N, seq, heads·D) at
// element @p at of layer->proj: a copy of (N, L, H, D) order, merge_heads of (N, H, L, D) order
// (through head tile @p scratch, as merge_heads writes from element 0).
static clmha_status to_rows(clmha_layer *l, const clmha__attention_dims *d,
                            const clmha_tensor *t, size_t heads, size_t seq, size_t at,
                            cl_mem scratch) {
    clmha_context *ctx = l->ctx;
    size_t rs = l->rs, bytes = d->core.n * seq * heads * l->d * rs;  // floats or doubles
    cl_mem rows = t->buffer;
    size_t from = t->offset;
    if (d->layout == CLMHA_LAYOUT_NHLD) {
        cl_ulong off = t->offset, n = d->core.n, h = heads, s = seq, hd = l->d;
        cl_uint bf = 1;
        arg args[] = {ARG(t->buffer), ARG(off), ARG(scratch), ARG(n), ARG(h), ARG(s), ARG(hd),
                      ARG(bf)};
        clmha_status st = clmha__launch_heads(l, l->merge_heads, "merge_heads",
                                              d->core.n * heads, seq, l->heads_wg, args,
                                              sizeof args / sizeof args[0]);
        if (st) return st;
        rows = scratch, from = 0;
    }
    cl_int err = clEnqueueCopyBuffer(ctx->queue, rows, l->proj, from * rs, at * rs, bytes, 0,
                                     NULL, NULL);
    return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(rows for the KV cache)")
               : CLMHA_SUCCESS;
}

// The merged rows (N, L, H, D) of the output tile into the caller's output: a copy, or
// split_heads for (N, H, L, D).
static clmha_status from_rows(clmha_layer *l, const clmha__attention_dims *d,
                              const clmha__attention_out *o) {
    clmha_context *ctx = l->ctx;
    cl_mem merged = l->tiles[CLMHA__TILE_OUT];
    if (d->layout == CLMHA_LAYOUT_NLHD) {
        cl_int err = clEnqueueCopyBuffer(ctx->queue, merged, o->output, 0,
                                         o->output_offset * l->rs, d->output_count * l->rs, 0,
                                         NULL, NULL);
        return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(result)") : CLMHA_SUCCESS;
    }
    cl_ulong zero = 0, ld = l->e, out = o->output_offset, n = d->core.n, h = l->h, group = 1,
             s = d->core.l, hd = l->d;
    cl_uint no = 0, bf = 1;
    arg args[] = {ARG(merged),    ARG(zero), ARG(ld),  ARG(zero),       ARG(ctx->dummy),
                  ARG(zero),      ARG(no),   ARG(ctx->dummy), ARG(zero), ARG(no),
                  ARG(o->output), ARG(out),  ARG(n),   ARG(h),          ARG(group),
                  ARG(s),         ARG(s),    ARG(hd),  ARG(bf)};
    return clmha__launch_heads(l, l->split_heads, "split_heads", d->core.n * l->h, d->core.l,
                               l->heads_wg, args, sizeof args / sizeof args[0]);
}

// The core's call on the rows, after everything was checked and planned: nothing is enqueued
// before the wait.
static clmha_status enqueue_rows(clmha_layer *l, const clmha_attention_args *a,
                                 const clmha__attention_dims *d, const clmha__attention_out *o,
                                 const clmha__core *core, clmha__core_call *call,
                                 cl_uint num_wait, const cl_event *wait_list) {
    size_t n = d->core.n, kve = d->core.kvh * l->d;
    call->q_at = 0, call->q_ld = l->e;
    call->k_at = n * d->core.l * l->e, call->k_ld = kve;
    call->v_at = call->k_at + n * d->core.s * kve, call->v_ld = kve;
    call->output = o->output, call->output_offset = 0;  // no output bias to write there
    clmha_status st;
    if ((st = clmha__enqueue_wait(l->ctx, num_wait, wait_list))) return st;
    clmha__layer_marks_release(l);
    if ((st = to_rows(l, d, &a->query, d->core.h, d->core.l, call->q_at,
                      l->tiles[CLMHA__TILE_Q])) ||
        (st = to_rows(l, d, &a->key, d->core.kvh, d->core.s, call->k_at,
                      l->tiles[CLMHA__TILE_K])) ||
        (st = to_rows(l, d, &a->value, d->core.kvh, d->core.s, call->v_at,
                      l->tiles[CLMHA__TILE_V])) ||
        (st = core->run(l, call)))
        return st;
    return from_rows(l, d, o);
}

clmha_status clmha__attention_kv_enqueue(clmha_layer *l, const clmha_attention_args *a,
                                         const clmha__attention_dims *d,
                                         const clmha__attention_out *o, cl_uint num_wait,
                                         const cl_event *wait_list, cl_event *event) {
    clmha_status st = refuse(l, d, o);
    if (st) return st;
    clmha_forward_args f = clmha__attention_core_args(l, a, d);
    f.kv_cache = a->kv_cache;
    f.kv_append = a->kv_append;
    clmha__kv_plan plan;
    if ((st = clmha__kv_plan_make(a->kv_cache, l, true, d->core.n, d->core.s, a->kv_append,
                                  &plan)))
        return st;
    clmha__core_call call = {.args = &f, .dims = &d->core, .kv = &plan, .kv_append = true,
                             .scale = d->scale, .kv_group = d->core.h / d->core.kvh};
    const clmha__core *core;
    if (!(st = clmha__core_select(l, &call, &core, NULL)) && !core->takes_rows)
        st = clmha__fail(l->ctx, CLMHA_UNSUPPORTED,
                         "the %s core runs calls with a KV cache but not on projected rows",
                         core->name);
    if (!st && !(st = clmha__layer_reserve(l, &d->core, core->uses_scores, false)) &&
        !(st = enqueue_rows(l, a, d, o, core, &call, num_wait, wait_list)) &&
        !(st = clmha__enqueue_event(l->ctx, event)))
        clmha__kv_plan_commit(&plan);
    clmha__kv_plan_release(&plan);
    return st;
}
