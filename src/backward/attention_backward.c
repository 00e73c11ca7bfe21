// The backward pass of attention as a function (clmha_attention_backward()): the forward call's
// tensors staged as head tiles on its bare layer (src/forward/attention.c), the backward core
// the dispatch picks (clmha__backward_select(), the same walk as clmha_layer_backward()'s), the
// gradients of the tiles back into the caller's layout:
//   check → core and scratch → wait → stage q, k, v, o, dO → the core's backward → dq, dk, dv.
#include "base/struct_in.h"
#include "cores/core.h"
#include "forward/attention.h"
#include "forward/attention_cache.h"
#include "forward/enqueue.h"

// The caller's gradients and the forward's results: present, of the context, large enough,
// the gradients writable and overlapping nothing.
static clmha_status check_buffers(clmha_context *ctx, const clmha_attention_backward_args *b,
                                  const clmha_attention_args *a,
                                  const clmha__attention_dims *d) {
    clmha_status st;
    if ((st = clmha__check_buffer(ctx, "query", a->query.buffer, a->query.offset,
                                  d->query_count, 4)) ||
        (st = clmha__check_buffer(ctx, "key", a->key.buffer, a->key.offset, d->key_count, 4)) ||
        (st = clmha__check_buffer(ctx, "value", a->value.buffer, a->value.offset,
                                  d->value_count, 4)) ||
        (st = clmha__check_buffer(ctx, "output", b->output, b->output_offset, d->output_count,
                                  4)) ||
        (b->lse &&
         (st = clmha__check_buffer(ctx, "lse", b->lse, b->lse_offset, d->lse_count, 4))) ||
        (st = clmha__check_buffer(ctx, "grad_output", b->grad_output, b->grad_output_offset,
                                  d->output_count, 4)) ||
        (st = clmha__check_buffer(ctx, "grad_query", b->grad_query, b->grad_query_offset,
                                  d->query_count, 4)) ||
        (st = clmha__check_buffer(ctx, "grad_key", b->grad_key, b->grad_key_offset,
                                  d->key_count, 4)) ||
        (st = clmha__check_buffer(ctx, "grad_value", b->grad_value, b->grad_value_offset,
                                  d->value_count, 4)) ||
        (st = clmha__check_writable(ctx, "grad_query", b->grad_query)) ||
        (st = clmha__check_writable(ctx, "grad_key", b->grad_key)) ||
        (st = clmha__check_writable(ctx, "grad_value", b->grad_value)))
        return st;
    const clmha_mask *m = d->attn.kind ? &d->attn : d->kpm.kind ? &d->kpm : NULL;
    if (m && (st = clmha__check_buffer(ctx, "attn_mask", m->tensor.buffer, m->tensor.offset,
                                       d->mask_count, clmha__mask_elem(m->kind))))
        return st;
    clmha__span all[10] = {
        clmha__span_of("grad_query", b->grad_query, b->grad_query_offset, d->query_count, 4),
        clmha__span_of("grad_key", b->grad_key, b->grad_key_offset, d->key_count, 4),
        clmha__span_of("grad_value", b->grad_value, b->grad_value_offset, d->value_count, 4),
        clmha__span_of("query", a->query.buffer, a->query.offset, d->query_count, 4),
        clmha__span_of("key", a->key.buffer, a->key.offset, d->key_count, 4),
        clmha__span_of("value", a->value.buffer, a->value.offset, d->value_count, 4),
        clmha__span_of("output", b->output, b->output_offset, d->output_count, 4),
        clmha__span_of("grad_output", b->grad_output, b->grad_output_offset, d->output_count,
                       4)};
    size_t k = 8;
    if (m)
        all[k++] = clmha__span_of("attn_mask", m->tensor.buffer, m->tensor.offset, d->mask_count,
                                  clmha__mask_elem(m->kind));
    if (b->lse) all[k++] = clmha__span_of("lse", b->lse, b->lse_offset, d->lse_count, 4);
    return clmha__check_overlaps(ctx, all, k, 3);
}

// Scratch tiles of the backward on bare layer @p l (its otherwise unused float32 copies,
// layer->staged): dO, dq, dk, dv, grown to @p d.
static clmha_status reserve(clmha_layer *l, const clmha__attention_dims *d) {
    size_t need[4] = {d->output_count, d->query_count, d->key_count, d->value_count};
    static const char *const what[4] = {"grad_output tiles", "grad_query tiles",
                                        "grad_key tiles", "grad_value tiles"};
    clmha_status st = clmha__layer_reserve(l, &d->core, false, false);
    for (int i = 0; i < 4 && !st; ++i)
        st = clmha__grow_buffer(l->ctx, &l->staged[i], &l->staged_caps[i], need[i], what[i]);
    return st;
}

// A result tile: the caller's buffer itself (NHLD at offset 0), else scratch @p scratch.
static cl_mem result_tile(const clmha__attention_dims *d, cl_mem out, size_t offset,
                          cl_mem scratch) {
    return d->layout == CLMHA_LAYOUT_NHLD && offset == 0 ? out : scratch;
}

static clmha_status enqueue(clmha_layer *l, const clmha_attention_backward_args *b,
                            const clmha_attention_args *a, const clmha__attention_dims *d,
                            cl_uint num_wait, const cl_event *wait_list, cl_event *event) {
    clmha_context *ctx = l->ctx;
    clmha_forward_args f = clmha__attention_core_args(l, a, d);
    size_t h = d->core.h, ln = d->core.l, s = d->core.s;
    clmha_status st;
    if ((st = reserve(l, d)) ||
        (b->lse && b->lse_offset &&
         (st = clmha__grow_buffer(ctx, &l->partial_lse, &l->partial_lse_cap, d->lse_count,
                                  "log-sum-exp rows"))))
        return st;
    cl_mem *t = l->tiles, *g = l->staged;
    clmha__backward_call call = {
        .args = &f, .dims = &d->core, .impl = b->impl, .scale = d->scale,
        .lse = !b->lse ? NULL : b->lse_offset ? l->partial_lse : b->lse,
        .dq = result_tile(d, b->grad_query, b->grad_query_offset, g[1]),
        .dk = result_tile(d, b->grad_key, b->grad_key_offset, g[2]),
        .dv = result_tile(d, b->grad_value, b->grad_value_offset, g[3])};
    const clmha__core *core;
    if ((st = clmha__backward_select(l, &call, &core))) return st;
    // Nothing is enqueued before this point.
    clmha_tensor out = {.buffer = b->output, .offset = b->output_offset};
    clmha_tensor dout = {.buffer = b->grad_output, .offset = b->grad_output_offset};
    cl_int err = CL_SUCCESS;
    if ((st = clmha__enqueue_wait(ctx, num_wait, wait_list)) ||
        (st = clmha__attention_stage(l, d, t[CLMHA__TILE_Q], &a->query, h, ln, d->query_count,
                                     &call.q)) ||
        (st = clmha__attention_stage(l, d, t[CLMHA__TILE_K], &a->key, h, s, d->key_count,
                                     &call.k)) ||
        (st = clmha__attention_stage(l, d, t[CLMHA__TILE_V], &a->value, h, s, d->value_count,
                                     &call.v)) ||
        (st = clmha__attention_stage(l, d, t[CLMHA__TILE_OUT], &out, h, ln, d->output_count,
                                     &call.o)) ||
        (st = clmha__attention_stage(l, d, g[0], &dout, h, ln, d->output_count, &call.d_o)))
        return st;
    if (call.lse == l->partial_lse)
        err = clEnqueueCopyBuffer(ctx->queue, b->lse, l->partial_lse,
                                  b->lse_offset * sizeof(float), 0, d->lse_count * sizeof(float),
                                  0, NULL, NULL);
    if (err) return clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(lse)");
    if ((st = core->backward(l, &call)) ||
        (st = clmha__attention_unstage(l, d, call.dq, h, ln, d->query_count, b->grad_query,
                                       b->grad_query_offset)) ||
        (st = clmha__attention_unstage(l, d, call.dk, h, s, d->key_count, b->grad_key,
                                       b->grad_key_offset)) ||
        (st = clmha__attention_unstage(l, d, call.dv, h, s, d->value_count, b->grad_value,
                                       b->grad_value_offset)))
        return st;
    return clmha__enqueue_event(ctx, event);
}

// Reads and checks the call: the struct, the forward's args, the limits of this version.
static clmha_status check_call(clmha_context *ctx, const clmha_attention_backward_args *args,
                               clmha_attention_backward_args *b, clmha_attention_args *a,
                               clmha__attention_dims *d) {
    char msg[512];
    clmha_status st = CLMHA__STRUCT_IN(clmha_attention_backward_args, b, args, "args", msg,
                                       sizeof msg);
    if (st) return clmha__fail(ctx, st, "%s", msg);
    if (!b->forward) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "args->forward is NULL");
    if ((st = clmha__attention_check_args(ctx, b->forward, a, d, false, false))) return st;
    if (d->core.kvh != d->core.h)
        return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                           "the backward of grouped-query attention (%zu key/value heads for %zu "
                           "query heads) is not there yet",
                           d->core.kvh, d->core.h);
    if (b->impl != CLMHA_IMPL_AUTO && b->impl != CLMHA_IMPL_FUSED &&
        b->impl != CLMHA_IMPL_UNFUSED)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "impl is %d: it must be CLMHA_IMPL_AUTO, _FUSED or _UNFUSED",
                           (int)b->impl);
    return CLMHA_SUCCESS;
}

clmha_status clmha_attention_backward(clmha_context *ctx,
                                      const clmha_attention_backward_args *args,
                                      cl_uint num_wait, const cl_event *wait_list,
                                      cl_event *event) {
    if (event) *event = NULL;
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    clmha_attention_backward_args b;
    clmha_attention_args a;
    clmha__attention_dims d;
    clmha_layer *l;
    clmha_status st;
    if ((st = check_call(ctx, args, &b, &a, &d)) ||
        (st = clmha__check_wait_list(ctx, num_wait, wait_list)) ||
        (st = check_buffers(ctx, &b, &a, &d)) ||
        (st = clmha__attention_lock(ctx, d.core.h, d.core.kvh, d.core.d, &l)))
        return st;
    st = enqueue(l, &b, &a, &d, num_wait, wait_list, event);
    clmha__attention_unlock(ctx);
    return st;
}
