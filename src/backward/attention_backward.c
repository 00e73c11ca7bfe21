// The backward pass of attention as a function (clmha_attention_backward()): the forward call's
// tensors staged as head tiles on its bare layer (src/forward/attention.c), the backward core
// the dispatch picks (clmha__backward_select(), the same walk as clmha_layer_backward()'s), the
// gradients of the tiles back into the caller's layout:
//   check → core and scratch → wait → stage q, k, v, o, dO → the core's backward → dq, dk, dv.
#include "backward/backward.h"
#include "base/struct_in.h"
#include "cores/core.h"
#include "cores/kernel_args.h"
#include "device/held.h"
#include "forward/attention.h"
#include "forward/attention_cache.h"
#include "forward/convert.h"
#include "forward/enqueue.h"
#include "forward/staging.h"
#include "layer/mods.h"

#include <stdlib.h>

typedef clmha__arg arg;
#define ARG CLMHA__ARG

// What a bare layer keeps for this backward, in its layer->backward slot (a bare layer never
// runs clmha_layer_backward(), whose state that slot holds otherwise): cl/backward.cl's
// merge_rows, which sums the gradients of the query heads that share a key/value head.
typedef struct state {
    cl_kernel merge_rows;
    cl_kernel sinks_grad;  // made on the first call with grad_sinks (clmha__sinks_grad())
} state;

static void state_release(void *p) {
    state *s = p;
    if (s) clmha__release_kernel(s->merge_rows), clmha__release_kernel(s->sinks_grad);
    free(s);
}

// The state of bare layer @p l, made (its kernel built) on the first grouped-query call.
static clmha_status state_of(clmha_layer *l, state **out) {
    if (!l->backward) {
        state *s = calloc(1, sizeof *s);
        if (!s) return clmha__fail(l->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
        l->backward = s;
        l->backward_release = state_release;
        cl_program prog;
        clmha_status st =
            clmha__program_get(l->ctx, "backward", clmha__layer_real_options(l), &prog);
        if (!st) st = clmha__kernel_make(l->ctx, prog, "merge_rows", &s->merge_rows);
        if (st) return st;
    }
    *out = l->backward;
    return (*out)->merge_rows ? CLMHA_SUCCESS
                              : clmha__fail(l->ctx, CLMHA_BUILD_FAILED,
                                            "merge_rows could not be built before");
}

// split_heads from rows (N, S, heads_in * D) of @p rows at @p rows_off into tiles
// (N*@p heads, S, D) of @p out at @p out_off, query head h reading key/value head h / group.
static clmha_status split(clmha_layer *l, const clmha__attention_dims *d, cl_mem rows,
                          size_t rows_off, size_t heads_in, size_t heads, size_t group,
                          cl_mem out, size_t out_off) {
    clmha_context *ctx = l->ctx;
    cl_ulong off = rows_off, ld = heads_in * l->d, zero = 0, o = out_off, n = d->core.n,
             h = heads, g = group, s = d->core.s, hd = l->d;
    cl_uint no = 0, bf = 1;
    arg args[] = {ARG(rows),    ARG(off),  ARG(ld), ARG(zero),       ARG(ctx->dummy),
                  ARG(zero),    ARG(no),   ARG(ctx->dummy), ARG(zero), ARG(no),
                  ARG(out),     ARG(o),    ARG(n),  ARG(h),          ARG(g),
                  ARG(s),       ARG(s),    ARG(hd), ARG(bf)};
    return clmha__launch_heads(l, l->split_heads, "split_heads", d->core.n * heads, d->core.s,
                               l->heads_wg, args, sizeof args / sizeof args[0]);
}

// Grouped-query attention: the key or value @p t (H_kv heads) as one plane per query head in
// @p tile (N*H, S, D), which the backward cores take: NLHD rows split with the group repeated;
// NHLD tiles first merged into rows (layer->proj).
static clmha_status expand(clmha_layer *l, const clmha__attention_dims *d,
                           const clmha_tensor *t, cl_mem tile) {
    size_t kvh = d->core.kvh, h = d->core.h;
    if (d->layout == CLMHA_LAYOUT_NLHD)
        return split(l, d, t->buffer, t->offset, kvh, h, h / kvh, tile, 0);
    cl_ulong off = t->offset, n = d->core.n, heads = kvh, seq = d->core.s, hd = l->d;
    cl_uint bf = 1;
    arg args[] = {ARG(t->buffer), ARG(off), ARG(l->proj), ARG(n), ARG(heads), ARG(seq), ARG(hd),
                  ARG(bf)};
    clmha_status st = clmha__launch_heads(l, l->merge_heads, "merge_heads", d->core.n * kvh,
                                          d->core.s, l->heads_wg, args,
                                          sizeof args / sizeof args[0]);
    return st ? st : split(l, d, l->proj, 0, kvh, h, h / kvh, tile, 0);
}

// Grouped-query attention: the gradient tiles @p tile (N*H, S, D) of a key or value, each
// group of H / H_kv query heads summed (merge_rows, in a fixed order) into the caller's @p out
// at @p out_off: straight into NLHD rows; through layer->proj and split_heads for NHLD.
static clmha_status reduce(clmha_layer *l, const clmha__attention_dims *d, cl_mem tile,
                           cl_mem out, size_t out_off) {
    state *s;
    clmha_status st = state_of(l, &s);
    if (st) return st;
    size_t kvh = d->core.kvh, h = d->core.h;
    bool nlhd = d->layout == CLMHA_LAYOUT_NLHD;
    cl_mem rows = nlhd ? out : l->proj;
    cl_ulong seq = d->core.s, off = nlhd ? out_off : 0, ld = kvh * l->d, zero = 0,
             n = d->core.n, heads = h, g = h / kvh, hd = l->d;
    cl_uint bf = 1;
    arg args[] = {ARG(tile), ARG(seq), ARG(seq), ARG(rows), ARG(off), ARG(ld),
                  ARG(zero), ARG(n),   ARG(heads), ARG(g),  ARG(hd),  ARG(bf)};
    if ((st = clmha__launch(l->ctx, s->merge_rows, "merge_rows", d->core.n * d->core.s * kvh,
                            l->heads_wg, args, sizeof args / sizeof args[0])) ||
        nlhd)
        return st;
    return split(l, d, l->proj, 0, kvh, kvh, 1, out, out_off);
}

// The caller's gradients and the forward's results: present, of the context, large enough,
// the gradients writable and overlapping nothing.
static clmha_status check_buffers(clmha_context *ctx, const clmha_attention_backward_args *b,
                                  const clmha_attention_args *a,
                                  const clmha__attention_dims *d) {
    clmha_status st;
    size_t es = clmha__attention_elem(a);  // every tensor's element, masks' below
    if ((st = clmha__check_buffer(ctx, "query", a->query.buffer, a->query.offset,
                                  d->query_count, es)) ||
        (st = clmha__check_buffer(ctx, "key", a->key.buffer, a->key.offset, d->key_count, es)) ||
        (st = clmha__check_buffer(ctx, "value", a->value.buffer, a->value.offset,
                                  d->value_count, es)) ||
        (st = clmha__check_buffer(ctx, "output", b->output, b->output_offset, d->output_count,
                                  es)) ||
        (b->lse &&
         (st = clmha__check_buffer(ctx, "lse", b->lse, b->lse_offset, d->lse_count, es))) ||
        (st = clmha__check_buffer(ctx, "grad_output", b->grad_output, b->grad_output_offset,
                                  d->output_count, es)) ||
        (st = clmha__check_buffer(ctx, "grad_query", b->grad_query, b->grad_query_offset,
                                  d->query_count, es)) ||
        (st = clmha__check_buffer(ctx, "grad_key", b->grad_key, b->grad_key_offset,
                                  d->key_count, es)) ||
        (st = clmha__check_buffer(ctx, "grad_value", b->grad_value, b->grad_value_offset,
                                  d->value_count, es)) ||
        (st = clmha__check_writable(ctx, "grad_query", b->grad_query)) ||
        (st = clmha__check_writable(ctx, "grad_key", b->grad_key)) ||
        (st = clmha__check_writable(ctx, "grad_value", b->grad_value)))
        return st;
    const clmha_mask *m = d->attn.kind ? &d->attn : NULL;
    if (m && (st = clmha__check_buffer(ctx, "attn_mask", m->tensor.buffer, m->tensor.offset,
                                       d->mask_count, clmha__attention_mask_elem(a, m->kind))))
        return st;
    if (b->grad_attn_mask && (!m || m->kind != CLMHA_MASK_FLOAT))
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "grad_attn_mask is set but attn_mask is not a float mask");
    if (b->grad_attn_mask &&
        ((st = clmha__check_buffer(ctx, "grad_attn_mask", b->grad_attn_mask,
                                   b->grad_attn_mask_offset, d->mask_count, es)) ||
         (st = clmha__check_writable(ctx, "grad_attn_mask", b->grad_attn_mask))))
        return st;
    if (a->sinks.ndim && (st = clmha__check_buffer(ctx, "sinks", a->sinks.buffer,
                                                   a->sinks.offset, d->core.h, es)))
        return st;
    if (b->grad_sinks &&
        ((st = clmha__check_buffer(ctx, "grad_sinks", b->grad_sinks, b->grad_sinks_offset,
                                   d->core.h, es)) ||
         (st = clmha__check_writable(ctx, "grad_sinks", b->grad_sinks))))
        return st;
    clmha__span all[11] = {
        clmha__span_of("grad_query", b->grad_query, b->grad_query_offset, d->query_count, es),
        clmha__span_of("grad_key", b->grad_key, b->grad_key_offset, d->key_count, es),
        clmha__span_of("grad_value", b->grad_value, b->grad_value_offset, d->value_count, es),
        clmha__span_of("query", a->query.buffer, a->query.offset, d->query_count, es),
        clmha__span_of("key", a->key.buffer, a->key.offset, d->key_count, es),
        clmha__span_of("value", a->value.buffer, a->value.offset, d->value_count, es),
        clmha__span_of("output", b->output, b->output_offset, d->output_count, es),
        clmha__span_of("grad_output", b->grad_output, b->grad_output_offset, d->output_count,
                       es)};
    size_t k = 8, outputs = 3;
    if (b->grad_attn_mask) {  // an output: first, with the gradients
        all[k++] = all[3];
        all[3] = clmha__span_of("grad_attn_mask", b->grad_attn_mask, b->grad_attn_mask_offset,
                                d->mask_count, es);
        outputs = 4;
    }
    if (m)
        all[k++] = clmha__span_of("attn_mask", m->tensor.buffer, m->tensor.offset, d->mask_count,
                                  clmha__attention_mask_elem(a, m->kind));
    if (b->lse) all[k++] = clmha__span_of("lse", b->lse, b->lse_offset, d->lse_count, es);
    return clmha__check_overlaps(ctx, all, k, outputs);
}

// Scratch tiles of the backward on bare layer @p l (its otherwise unused float32 copies,
// layer->staged, whose sizes count floats: twice the elements for a float64 layer): dO, dq,
// dk, dv, grown to @p d.
static clmha_status reserve(clmha_layer *l, const clmha__attention_dims *d) {
    size_t full = d->core.n * d->core.s * d->core.e;  // (N*H, S, D): one plane per query head
    size_t per = l->rs / sizeof(float);
    size_t need[4] = {d->output_count * per, d->query_count * per, full * per, full * per};
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

// The key or value as the backward cores take it (one plane per query head).
static clmha_status stage_kv(clmha_layer *l, const clmha__attention_dims *d, cl_mem scratch,
                             const clmha_tensor *t, cl_mem *use) {
    if (d->core.kvh == d->core.h)
        return clmha__attention_stage(l, d, scratch, t, d->core.h, d->core.s, use);
    *use = scratch;
    return expand(l, d, t, scratch);
}

// A key or value gradient back into the caller's layout (its groups summed).
static clmha_status unstage_kv(clmha_layer *l, const clmha__attention_dims *d, cl_mem tile,
                               cl_mem out, size_t out_off) {
    if (d->core.kvh == d->core.h)
        return clmha__attention_unstage(l, d, tile, d->core.h, d->core.s, out, out_off);
    return reduce(l, d, tile, out, out_off);
}

// @p sinks_add: the sinks' gradient is added to grad_sinks (a packed call's later sequences).
static clmha_status enqueue(clmha_layer *l, const clmha_attention_backward_args *b,
                            const clmha_attention_args *a, const clmha__attention_dims *d,
                            bool sinks_add, cl_uint num_wait, const cl_event *wait_list,
                            cl_event *event);

// D_v ≠ D: the backward on copies padded to D' (src/forward/attention_pad.c): query, key,
// value, output and its gradient widened, the gradients cut back to D, D and D_v.
static clmha_status enqueue_padded(clmha_layer *l, const clmha_attention_backward_args *b,
                                   const clmha_attention_args *a, const clmha__attention_dims *d,
                                   bool sinks_add, cl_uint num_wait, const cl_event *wait_list,
                                   cl_event *event) {
    int slot = CLMHA__ATTENTION_PAD_SLOT;
    size_t w = clmha__attention_width(d), dk = d->core.d, dv = d->dv;
    clmha_attention_args p;
    clmha__attention_dims pd;
    clmha_attention_backward_args pb = *b;
    pb.forward = &p;
    pb.output_offset = pb.grad_output_offset = 0;
    pb.grad_query_offset = pb.grad_key_offset = pb.grad_value_offset = 0;
    size_t out_rows = d->output_count / dv;
    cl_mem *room[5] = {&pb.output, &pb.grad_output, &pb.grad_query, &pb.grad_key,
                       &pb.grad_value};
    size_t rows[5] = {out_rows, out_rows, d->query_count / dk, d->key_count / dk,
                      d->value_count / dv};
    static const char *const what[5] = {"padded output", "padded grad_output",
                                        "padded grad_query", "padded grad_key",
                                        "padded grad_value"};
    clmha_status st = clmha__attention_pad_call(l, a, d, slot, &p, &pd);
    for (int i = 0; i < 5 && !st; ++i)
        st = clmha__host_room(l, slot + 3 + i, what[i], rows[i] * w * l->rs, room[i]);
    if (st ||
        (st = clmha__attention_pad_inputs(l, a, d, &p, num_wait, wait_list)) ||
        (st = clmha__attention_pad_rows(l, b->output, b->output_offset, dv, pb.output, 0, w,
                                        out_rows, 0, NULL)) ||
        (st = clmha__attention_pad_rows(l, b->grad_output, b->grad_output_offset, dv,
                                        pb.grad_output, 0, w, out_rows, 0, NULL)) ||
        (st = enqueue(l, &pb, &p, &pd, sinks_add, 0, NULL, NULL)) ||
        (st = clmha__attention_pad_rows(l, pb.grad_query, 0, w, b->grad_query,
                                        b->grad_query_offset, dk, rows[2], 0, NULL)) ||
        (st = clmha__attention_pad_rows(l, pb.grad_key, 0, w, b->grad_key, b->grad_key_offset,
                                        dk, rows[3], 0, NULL)) ||
        (st = clmha__attention_pad_rows(l, pb.grad_value, 0, w, b->grad_value,
                                        b->grad_value_offset, dv, rows[4], 0, NULL)))
        return st;
    return clmha__enqueue_event(l->ctx, event);
}

// Zeros @p count elements (floats or doubles: all bits zero) of gradient @p buf from
// @p offset (keys that no query of a packed call sees).
static clmha_status zero_grad(clmha_layer *l, cl_mem buf, size_t offset, size_t count) {
    double zero = 0.0;
    size_t rs = l->rs;
    cl_int err = count ? clEnqueueFillBuffer(l->ctx->queue, buf, &zero, rs, offset * rs,
                                             count * rs, 0, NULL, NULL)
                       : CL_SUCCESS;
    return err ? clmha__cl_fail(l->ctx, err, "clEnqueueFillBuffer(gradient rows)")
               : CLMHA_SUCCESS;
}

// A packed call (the forward in src/forward/attention.c): one backward call per sequence on
// its rows of the output, the log-sum-exp blocks and the gradients; the sinks' gradient summed
// over the sequences; the keys of a sequence without queries get zero gradients.
static clmha_status enqueue_packed(clmha_layer *l, const clmha_attention_backward_args *b,
                                   const clmha_attention_args *a, const clmha__attention_dims *d,
                                   cl_uint num_wait, const cl_event *wait_list,
                                   cl_event *event) {
    const clmha__dims *c = &d->core;
    size_t h = c->h, kvh = c->kvh, dk = c->d, dv = d->dv, q0 = 0, k0 = 0;
    bool first = true;
    char msg[512];
    clmha_status st;
    if ((st = clmha__enqueue_wait(l->ctx, num_wait, wait_list))) return st;
    for (size_t i = 0; i < c->n; q0 += c->seq_lens[i], k0 += c->kv_seq_lens[i], ++i) {
        size_t kr = c->kv_seq_lens[i];
        if (!c->seq_lens[i]) {
            if ((st = zero_grad(l, b->grad_key, b->grad_key_offset + k0 * kvh * dk,
                                kr * kvh * dk)) ||
                (st = zero_grad(l, b->grad_value, b->grad_value_offset + k0 * kvh * dv,
                                kr * kvh * dv)))
                return st;
            continue;
        }
        clmha_attention_args sub;
        clmha__attention_dims sd;
        clmha__attention_packed_args(d, a, i, q0, k0, &sub);
        if ((st = clmha__attention_resolve(&sub, &sd, msg, sizeof msg)))
            return clmha__fail(l->ctx, st, "sequence %zu: %s", i, msg);
        clmha_attention_backward_args sb = *b;
        sb.forward = &sub;
        sb.output_offset += q0 * h * dv, sb.grad_output_offset += q0 * h * dv;
        sb.lse_offset += q0 * h;
        sb.grad_query_offset += q0 * h * dk;
        sb.grad_key_offset += k0 * kvh * dk, sb.grad_value_offset += k0 * kvh * dv;
        if ((st = enqueue(l, &sb, &sub, &sd, !first, 0, NULL, NULL))) return st;
        first = false;
    }
    return clmha__enqueue_event(l->ctx, event);
}

static clmha_status enqueue(clmha_layer *l, const clmha_attention_backward_args *b,
                            const clmha_attention_args *a, const clmha__attention_dims *d,
                            bool sinks_add, cl_uint num_wait, const cl_event *wait_list,
                            cl_event *event) {
    if (d->core.packed) return enqueue_packed(l, b, a, d, num_wait, wait_list, event);
    if (d->dv != d->core.d)
        return enqueue_padded(l, b, a, d, sinks_add, num_wait, wait_list, event);
    clmha_context *ctx = l->ctx;
    clmha_forward_args f = clmha__attention_core_args(l, a, d);
    size_t h = d->core.h, ln = d->core.l;
    clmha_status st;
    state *s = NULL;
    if ((st = reserve(l, d)) ||
        (b->lse && b->lse_offset &&
         (st = clmha__layer_grow(l, &l->partial_lse, &l->partial_lse_cap, d->lse_count,
                                 "log-sum-exp rows"))))
        return st;
    cl_mem *t = l->tiles, *g = l->staged;
    bool grouped = d->core.kvh != h;
    clmha__backward_call call = {
        .args = &f, .dims = &d->core, .impl = b->impl, .scale = d->scale,
        .lse = !b->lse ? NULL : b->lse_offset ? l->partial_lse : b->lse,
        .dq = result_tile(d, b->grad_query, b->grad_query_offset, g[1]),
        .dk = grouped ? g[2] : result_tile(d, b->grad_key, b->grad_key_offset, g[2]),
        .dv = grouped ? g[3] : result_tile(d, b->grad_value, b->grad_value_offset, g[3])};
    call.grad_attn_mask = b->grad_attn_mask;  // a float mask's gradient, in its own shape
    call.grad_attn_offset = b->grad_attn_mask_offset;
    const clmha__core *core;
    state *sums;
    if ((grouped && (st = state_of(l, &sums))) ||
        (st = clmha__backward_select(l, &call, &core)))
        return st;
    // Nothing is enqueued before this point.
    clmha_tensor out = {.buffer = b->output, .offset = b->output_offset};
    clmha_tensor dout = {.buffer = b->grad_output, .offset = b->grad_output_offset};
    cl_int err = CL_SUCCESS;
    if ((st = clmha__enqueue_wait(ctx, num_wait, wait_list)) ||
        (st = clmha__attention_stage(l, d, t[CLMHA__TILE_Q], &a->query, h, ln, &call.q)) ||
        (st = stage_kv(l, d, t[CLMHA__TILE_K], &a->key, &call.k)) ||
        (st = stage_kv(l, d, t[CLMHA__TILE_V], &a->value, &call.v)) ||
        (st = clmha__attention_stage(l, d, t[CLMHA__TILE_OUT], &out, h, ln, &call.o)) ||
        (st = clmha__attention_stage(l, d, g[0], &dout, h, ln, &call.d_o)))
        return st;
    if (b->lse && b->lse_offset)  // the rows into the layer's copy, which the core reads
        err = clEnqueueCopyBuffer(ctx->queue, b->lse, l->partial_lse, b->lse_offset * l->rs, 0,
                                  d->lse_count * l->rs, 0, NULL, NULL);
    if (err) return clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(lse)");
    if ((st = core->backward(l, &call)) ||
        (b->grad_sinks &&  // from the forward's log-sum-exp rows (check_call: given)
         ((st = state_of(l, &s)) ||
          (st = clmha__sinks_grad(l, &s->sinks_grad, call.o, call.d_o, call.lse, 0, NULL,
                                  a->sinks.buffer, a->sinks.offset, b->grad_sinks,
                                  b->grad_sinks_offset, sinks_add, d->core.n, ln)))) ||
        (st = clmha__attention_unstage(l, d, call.dq, h, ln, b->grad_query, b->grad_query_offset)) ||
        (st = unstage_kv(l, d, call.dk, b->grad_key, b->grad_key_offset)) ||
        (st = unstage_kv(l, d, call.dv, b->grad_value, b->grad_value_offset)))
        return st;
    return clmha__enqueue_event(ctx, event);
}

// ---- 16-bit calls -------------------------------------------------------------------------------

// The float32 call of 16-bit backward @p b (forward @p a, sizes @p d): the forward's query, key,
// value and float mask and the output's gradient widened into float32 copies of bare layer
// @p l (slots the float32 backward leaves alone: it takes the first four for its tiles), room
// for the float32 gradients asked for; @p w, @p wd, @p wb point at them.
static clmha_status widen_16(clmha_layer *l, const clmha_attention_backward_args *b,
                             const clmha__attention_dims *d, clmha_attention_args *w,
                             clmha__attention_dims *wd, clmha_attention_backward_args *wb) {
    bool mask = d->attn.kind == CLMHA_MASK_FLOAT;
    clmha_tensor go = {.buffer = b->grad_output, .offset = b->grad_output_offset};
    clmha_tensor *in[7] = {&w->query, &w->key,   &w->value,       &wd->attn.tensor,
                           &go,       &w->sinks, &w->alibi_slopes};
    size_t h = d->core.h;
    size_t count[7] = {d->query_count, d->key_count,           d->value_count,
                       mask ? d->mask_count : 0,                d->output_count,
                       w->sinks.ndim ? h : 0, w->alibi_slopes.ndim ? h : 0};
    static const int slot[7] = {CLMHA__STAGED_PAD_QUERY, CLMHA__STAGED_PAD_KEY,
                                CLMHA__STAGED_PAD_VALUE, CLMHA__STAGED_ATTN,
                                CLMHA__STAGED_GRAD_OUTPUT, CLMHA__STAGED_SINKS,
                                CLMHA__STAGED_SLOPES};
    static const char *const what[7] = {"float32 query",       "float32 key",
                                        "float32 value",       "float32 attn_mask",
                                        "float32 grad_output", "float32 sinks",
                                        "float32 alibi_slopes"};
    clmha_status st = CLMHA_SUCCESS;
    for (int i = 0; i < 7 && !st; ++i) {
        if (!count[i]) continue;
        st = clmha__convert_in(l, slot[i], what[i], in[i]->buffer, in[i]->offset, count[i],
                               &in[i]->buffer);
        in[i]->offset = 0;
    }
    if (mask) w->attn_mask.tensor = wd->attn.tensor;  // (read there by the padded form)
    wb->grad_output = go.buffer;
    wb->grad_output_offset = wb->grad_query_offset = wb->grad_key_offset = 0;
    wb->grad_value_offset = wb->grad_attn_mask_offset = wb->grad_sinks_offset = 0;
    cl_mem *grad[5] = {&wb->grad_query, &wb->grad_key, &wb->grad_value, &wb->grad_attn_mask,
                       &wb->grad_sinks};
    size_t gcount[5] = {d->query_count, d->key_count, d->value_count, d->mask_count, h};
    for (int i = 0; i < 5 && !st; ++i)
        if (*grad[i])
            st = clmha__convert_result(l, CLMHA__STAGED_GRAD + i, "float32 gradient", gcount[i],
                                       grad[i]);
    return st;
}

// The float32 forward again on the widened inputs of @p w: its float32 output (and log-sum-exp
// rows where the fused backward can take them, as host_forward() asks) into @p wb, so that
// the gradients do not inherit the rounding of the caller's 16-bit output.
static clmha_status forward_16(clmha_layer *l, const clmha_attention_args *w,
                               const clmha__attention_dims *wd,
                               clmha_attention_backward_args *wb) {
    clmha__attention_out o = {0};
    clmha_status st;
    if ((st = clmha__convert_result(l, CLMHA__STAGED_OUTPUT, "float32 output",
                                    wd->output_count, &o.output)) ||
        (st = clmha__convert_result(l, CLMHA__STAGED_WEIGHTS, "float32 lse", wd->lse_count,
                                    &o.lse)))
        return st;
    st = CLMHA_UNSUPPORTED;
    if (!wb->grad_attn_mask && wb->impl != CLMHA_IMPL_UNFUSED)
        st = clmha__attention_enqueue(l, w, wd, &o, 0, NULL, NULL);
    if (st == CLMHA_UNSUPPORTED) {  // not tried, or refused before anything was enqueued
        if (!wb->grad_sinks) o.lse = NULL;  // the sinks' gradient reads them (unfused too)
        st = clmha__attention_enqueue(l, w, wd, &o, 0, NULL, NULL);
    }
    wb->output = o.output, wb->lse = o.lse;
    wb->output_offset = wb->lse_offset = 0;
    return st;
}

// A 16-bit backward call (clmha_attention_args::dtype float16 or bfloat16) on bare layer @p l
// (its dtype's): its tensors widened (widen_16()), the float32 forward again (forward_16()),
// the float32 backward, the gradients narrowed into the caller's buffers, each rounded once.
// The caller's output and lse are not read (their rounding would reach the gradients).
static clmha_status enqueue_16(clmha_layer *l, const clmha_attention_backward_args *b,
                               const clmha_attention_args *a, const clmha__attention_dims *d,
                               cl_uint num_wait, const cl_event *wait_list, cl_event *event) {
    clmha_attention_args w = *a;
    clmha__attention_dims wd = *d;
    clmha_attention_backward_args wb = *b;
    w.dtype = CLMHA_DTYPE_F32;
    wb.forward = &w;
    clmha_status st;
    if ((st = clmha__enqueue_wait(l->ctx, num_wait, wait_list)) ||
        (st = widen_16(l, b, d, &w, &wd, &wb)) || (st = forward_16(l, &w, &wd, &wb)) ||
        (st = enqueue(l, &wb, &w, &wd, false, 0, NULL, NULL)))
        return st;
    cl_mem dst[5] = {b->grad_query, b->grad_key, b->grad_value, b->grad_attn_mask,
                     b->grad_sinks};
    size_t off[5] = {b->grad_query_offset, b->grad_key_offset, b->grad_value_offset,
                     b->grad_attn_mask_offset, b->grad_sinks_offset};
    size_t count[5] = {d->query_count, d->key_count, d->value_count, d->mask_count, d->core.h};
    for (int i = 0; i < 5 && !st; ++i)
        if (dst[i]) st = clmha__convert_out(l, CLMHA__STAGED_GRAD + i, dst[i], off[i], count[i]);
    return st ? st : clmha__enqueue_event(l->ctx, event);
}

// CLMHA_UNSUPPORTED for a forward call whose user functions have clmha_score_mod without its
// derivative (both forms of the backward).
static clmha_status mods_grad_check(clmha_context *ctx, const clmha_attention_args *a) {
    unsigned mods = clmha__mods_scan(a->mod_source);
    if (!(mods & CLMHA__MOD_SCORE) || (mods & CLMHA__MOD_GRAD)) return CLMHA_SUCCESS;
    return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                       "the backward pass needs clmha_score_mod_grad: the forward call's "
                       "mod_source defines clmha_score_mod without its derivative");
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
    if ((st = clmha__attention_check_args(ctx, b->forward, a, d))) return st;
    if (a->kv_cache)
        return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                           "the forward call has a kv_cache: the KV-cache form has no backward");
    if ((st = mods_grad_check(ctx, a))) return st;
    if (b->grad_sinks && (!a->sinks.ndim || !b->lse))
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           a->sinks.ndim ? "grad_sinks needs lse, the forward's log-sum-exp "
                                           "rows (the sinks' probabilities are exp(sink - lse))"
                                         : "grad_sinks is set but the forward call has no sinks");
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
        (st = clmha__attention_lock(ctx, &d.core, clmha__attention_width(&d), a.dtype,
                                     &l)))
        return st;
    st = clmha__attention_16(&a) ? enqueue_16(l, &b, &a, &d, num_wait, wait_list, event)
                                 : enqueue(l, &b, &a, &d, false, num_wait, wait_list, event);
    clmha__attention_unlock(ctx);
    return st;
}

// ---- the host-array form ------------------------------------------------------------------------

// The host arrays of clmha_attention_backward_host(): what the call reads is there, the output
// gradient's count is the output's, a mask gradient asks for a float mask.
static clmha_status check_host(clmha_context *ctx, const clmha_attention_args *a,
                               const clmha__attention_dims *d, const void *grad_output,
                               size_t grad_output_count, const void *grad_attn_mask) {
    const char *missing = !a->query.data                                   ? "query.data"
                          : !a->key.data                                   ? "key.data"
                          : !a->value.data                                 ? "value.data"
                          : a->attn_mask.kind && !a->attn_mask.tensor.data ? "attn_mask.tensor.data"
                          : !grad_output                                   ? "grad_output"
                                                                           : NULL;
    if (missing) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s is NULL", missing);
    if (grad_output_count != d->output_count)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "grad_output_count is %zu, the output has %zu elements",
                           grad_output_count, d->output_count);
    if (grad_attn_mask && a->attn_mask.kind != CLMHA_MASK_FLOAT)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "grad_attn_mask is set but attn_mask is not a float mask");
    return CLMHA_SUCCESS;
}

// The forward pass again: with the log-sum-exp rows where the fused backward can take them (no
// mask gradient asked, the fused core not ruled out by impl), so that the backward runs fused,
// in memory linear in S; without them (the unfused backward) where the fused forward cannot run
// the call (CLMHA_UNSUPPORTED: nothing was enqueued, e.g. on llvmpipe past its loop limit).
static clmha_status host_forward(clmha_layer *l, clmha_attention_args *a,
                                 clmha__attention_dims *d, bool mask_grad,
                                 clmha_attention_backward_args *b) {
    clmha__attention_out o;
    clmha_status st = CLMHA_UNSUPPORTED;
    if (!mask_grad && a->impl != CLMHA_IMPL_UNFUSED &&
        !(st = clmha__attention_upload(l, a, d, true, false, &o)))
        st = clmha__attention_enqueue(l, a, d, &o, 0, NULL, NULL);
    if (st == CLMHA_UNSUPPORTED) {  // not tried, or refused before anything was enqueued
        if ((st = clmha__attention_upload(l, a, d, false, false, &o)) ||
            (st = clmha__attention_enqueue(l, a, d, &o, 0, NULL, NULL)))
            return st;
        o.lse = NULL;
    }
    if (st) return st;
    b->output = o.output;
    b->lse = o.lse;
    return CLMHA_SUCCESS;
}

// The forward pass again (host_forward()), the output gradient uploaded, room for the
// gradients: @p b filled with the layer's staging buffers.
static clmha_status host_prepare(clmha_layer *l, clmha_attention_args *a,
                                 clmha__attention_dims *d, const void *grad_output,
                                 bool mask_grad, clmha_attention_backward_args *b) {
    clmha_status st;
    size_t es = l->rs;  // the call's element (clmha__attention_elem())
    if ((st = host_forward(l, a, d, mask_grad, b)) ||
        (st = clmha__host_upload(l, CLMHA__HOST_GRAD_OUTPUT, "grad_output", grad_output,
                                 d->output_count * es, &b->grad_output)))
        return st;
    size_t count[4] = {d->query_count, d->key_count, d->value_count, d->mask_count};
    cl_mem *out[4] = {&b->grad_query, &b->grad_key, &b->grad_value, &b->grad_attn_mask};
    static const char *const what[4] = {"grad_query", "grad_key", "grad_value",
                                        "grad_attn_mask"};
    for (int i = 0; i < (mask_grad ? 4 : 3); ++i)
        if ((st = clmha__host_room(l, CLMHA__HOST_GRAD + i, what[i], count[i] * es, out[i])))
            return st;
    return CLMHA_SUCCESS;
}

// Waits for the call and reads the gradients asked for, @p es bytes each, all or none.
static clmha_status host_download(clmha_context *ctx, const clmha_attention_backward_args *b,
                                  const clmha__attention_dims *d, size_t es,
                                  void *const dst[4]) {
    cl_mem src[4] = {b->grad_query, b->grad_key, b->grad_value, b->grad_attn_mask};
    size_t bytes[4] = {d->query_count * es, d->key_count * es, d->value_count * es,
                       d->mask_count * es};
    static const char *const what[4] = {"grad_query", "grad_key", "grad_value",
                                        "grad_attn_mask"};
    cl_int err = clFinish(ctx->queue);
    if (err) return clmha__cl_fail_on(ctx, err, "clFinish", "the backward pass");
    return clmha__host_read_all(ctx, 4, src, dst, bytes, what);
}

// Both host forms: @p takes the dtype of their arrays, @p dst the gradients asked for (dq, dk,
// dv, the mask's).
static clmha_status backward_host(clmha_context *ctx, const clmha_attention_args *args,
                                  clmha_dtype takes, const char *function,
                                  const void *grad_output, size_t grad_output_count,
                                  void *const dst[4]) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    clmha_attention_args a;
    clmha__attention_dims d;
    clmha_layer *l;
    clmha_status st;
    const void *grad_attn_mask = dst[3];
    // A 16-bit call's inputs (clmha__attention_round_inputs()) and grad_output, rounded.
    float *copies[CLMHA__ATTENTION_ROUNDED + 1] = {NULL};
    float **go = &copies[CLMHA__ATTENTION_ROUNDED];
    clmha_dtype t = CLMHA_DTYPE_F32;
    if ((st = clmha__attention_check_args(ctx, args, &a, &d)) ||
        (st = clmha__attention_host_dtype(ctx, &a, takes, function)) ||
        (a.kv_cache && (st = clmha__fail(ctx, CLMHA_UNSUPPORTED,
                                         "args->kv_cache is set: the KV-cache form has no "
                                         "backward"))) ||
        (st = mods_grad_check(ctx, &a)) ||
        (st = check_host(ctx, &a, &d, grad_output, grad_output_count, grad_attn_mask)) ||
        (clmha__attention_16(&a) &&
         ((t = a.dtype, st = clmha__attention_round_inputs(ctx, &a, &d, t, copies)) ||
          (st = clmha__attention_round_copy(ctx, t, grad_output, d.output_count, go)))) ||
        (st = clmha__attention_lock(ctx, &d.core, clmha__attention_width(&d), a.dtype, &l)))
        goto done;
    if (*go) grad_output = *go;
    clmha_attention_backward_args b = {.struct_size = sizeof b, .forward = &a};
    if ((st = host_prepare(l, &a, &d, grad_output, grad_attn_mask != NULL, &b)) ||
        (st = enqueue(l, &b, &a, &d, false, 0, NULL, NULL)) ||
        (st = host_download(ctx, &b, &d, l->rs, dst)))
        clmha__host_drop(l);
    clmha__attention_unlock(ctx);
    size_t count[4] = {d.query_count, d.key_count, d.value_count, d.mask_count};
    for (int i = 0; !st && t != CLMHA_DTYPE_F32 && i < 4; ++i)
        clmha__attention_round_results(t, dst[i], count[i]);
done:
    for (int i = 0; i <= CLMHA__ATTENTION_ROUNDED; ++i) free(copies[i]);
    return st;
}

clmha_status clmha_attention_backward_host(clmha_context *ctx, const clmha_attention_args *args,
                                           const float *grad_output, size_t grad_output_count,
                                           float *grad_query, float *grad_key,
                                           float *grad_value, float *grad_attn_mask) {
    void *const dst[4] = {grad_query, grad_key, grad_value, grad_attn_mask};
    return backward_host(ctx, args, CLMHA_DTYPE_F32, "clmha_attention_backward_host()",
                         grad_output, grad_output_count, dst);
}

clmha_status clmha_attention_backward_host_f64(clmha_context *ctx,
                                               const clmha_attention_args *args,
                                               const double *grad_output,
                                               size_t grad_output_count, double *grad_query,
                                               double *grad_key, double *grad_value,
                                               double *grad_attn_mask) {
    void *const dst[4] = {grad_query, grad_key, grad_value, grad_attn_mask};
    return backward_host(ctx, args, CLMHA_DTYPE_F64, "clmha_attention_backward_host_f64()",
                         grad_output, grad_output_count, dst);
}
