// The middle of every attention call: the layer's forward pass runs its input projections, then
// this, then its output projection (forward.c); partial attention runs this alone, its result
// and log-sum-exp rows going to the caller (partial.c); attention as a function runs this on
// the caller's head-split tensors (attention.c):
//   heads in (split_heads from rows, a copy, or the caller's tiles in place) → the core →
//   heads out (merge_heads into rows, a copy, or in place) → the log-sum-exp rows.
// The core is the dispatch's answer (clmha__core_select()), asked by the caller before
// anything is enqueued; so is the scratch it needs.
#include "forward/middle.h"

#include "cores/core.h"
#include "cores/kernel_args.h"
#include "forward/enqueue.h"

#include <string.h>

typedef clmha__arg arg;
#define ARG CLMHA__ARG

clmha_status clmha__heads_place(clmha_layer *l, const clmha__heads_in *in, cl_mem scratch,
                                cl_mem *use) {
    clmha_context *ctx = l->ctx;
    size_t hd = l->d, rs = l->rs;
    *use = in->tiles && in->offset == 0 ? in->buffer : scratch;
    if (*use == in->buffer) return CLMHA_SUCCESS;
    if (in->tiles) {
        size_t count = in->n * in->heads * in->seq * hd;
        cl_int err = clEnqueueCopyBuffer(ctx->queue, in->buffer, scratch, in->offset * rs, 0,
                                         count * rs, 0, NULL, NULL);
        return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(head tiles)") : CLMHA_SUCCESS;
    }
    cl_ulong off = in->offset, ld = in->ld, col = in->col, bias_off = in->bias_col,
             extra_off = in->extra_off, zero = 0, n = in->n, h = in->heads, g = in->group,
             t = in->seq, t_out = in->seq_out, a_hd = hd;
    cl_uint has_bias = in->bias != NULL, has_extra = in->extra != NULL, bf = in->batch_first;
    cl_mem bias = in->bias ? in->bias : ctx->dummy, extra = in->extra ? in->extra : ctx->dummy;
    arg args[] = {ARG(in->buffer), ARG(off),      ARG(ld),        ARG(col),       ARG(bias),
                  ARG(bias_off),   ARG(has_bias), ARG(extra),     ARG(extra_off), ARG(has_extra),
                  ARG(scratch),    ARG(zero),     ARG(n),         ARG(h),         ARG(g),
                  ARG(t),          ARG(t_out),    ARG(a_hd),      ARG(bf)};
    return clmha__launch_heads(l, l->split_heads, "split_heads", in->n * in->heads, in->seq_out,
                               l->heads_wg, args, sizeof args / sizeof args[0]);
}

clmha_status clmha__heads_put(clmha_layer *l, cl_mem tile, size_t tile_offset, size_t n,
                              size_t heads, size_t seq, const clmha__heads_out *out) {
    clmha_context *ctx = l->ctx;
    size_t rs = l->rs, bytes = n * heads * seq * l->d * rs;
    cl_int err = CL_SUCCESS;
    if (tile == out->buffer && tile_offset == out->offset) return CLMHA_SUCCESS;  // in place
    if (out->tiles) {
        err = clEnqueueCopyBuffer(ctx->queue, tile, out->buffer, tile_offset * rs,
                                  out->offset * rs,
                                  bytes, 0, NULL, NULL);
        return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(result)") : CLMHA_SUCCESS;
    }
    cl_mem rows = out->offset ? l->proj : out->buffer;
    cl_ulong src_off = tile_offset, a_n = n, h = heads, t = seq, hd = l->d;
    cl_uint bf = out->batch_first;
    arg args[] = {ARG(tile), ARG(src_off), ARG(rows), ARG(a_n), ARG(h), ARG(t), ARG(hd), ARG(bf)};
    clmha_status st = clmha__launch_heads(l, l->merge_heads, "merge_heads", n * heads, seq,
                                          l->heads_wg, args, sizeof args / sizeof args[0]);
    if (st || !out->offset) return st;
    err = clEnqueueCopyBuffer(ctx->queue, rows, out->buffer, 0, out->offset * rs, bytes, 0, NULL,
                              NULL);
    return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(result)") : CLMHA_SUCCESS;
}

// Whether @p buf is CL_MEM_WRITE_ONLY: a core does not write its result there itself (a GEMM
// may read its C operand back).
static bool write_only(cl_mem buf) {
    cl_mem_flags flags = 0;
    return clGetMemObjectInfo(buf, CL_MEM_FLAGS, sizeof flags, &flags, NULL) == CL_SUCCESS &&
           (flags & CL_MEM_WRITE_ONLY);
}

// A clmha__core::takes_rows core reads the projected rows where they are.
static void point_at_rows(clmha__core_call *call, const clmha__middle *m) {
    call->q_at = m->query.offset + m->query.col, call->q_ld = m->query.ld;
    call->k_at = m->key.offset + m->key.col, call->k_ld = m->key.ld;
    call->v_at = m->value.offset + m->value.col, call->v_ld = m->value.ld;
}

// The heads in, the core, the result out: on the layer's tiles, some of them the caller's
// buffers for the call (@p t; the layer's own in @p own).
static clmha_status run_on(clmha_layer *l, const clmha__core *core, clmha__core_call *call,
                           const clmha__middle *m, cl_mem *t, const cl_mem *own) {
    const clmha__dims *d = call->dims;
    clmha_status st;
    if (core->takes_rows || call->rows) {
        point_at_rows(call, m);
    } else if ((st = clmha__heads_place(l, &m->query, own[CLMHA__TILE_Q], &t[CLMHA__TILE_Q])) ||
               (m->key.buffer &&
                ((st = clmha__heads_place(l, &m->key, own[CLMHA__TILE_K], &t[CLMHA__TILE_K])) ||
                 (st = clmha__heads_place(l, &m->value, own[CLMHA__TILE_V],
                                          &t[CLMHA__TILE_V]))))) {
        return st;
    }
    if ((st = clmha__layer_mark(l, 1 + CLMHA_STAGE_SPLIT)) || (st = core->run(l, call)))
        return st;
    if (!core->takes_rows && !call->rows &&
        (st = clmha__heads_put(l, t[CLMHA__TILE_OUT], 0, d->n, l->h, d->l, &m->out)))
        return st;
    return clmha__layer_mark(l, 1 + CLMHA_STAGE_MERGE);
}

clmha_status clmha__middle_run(clmha_layer *l, const clmha__core *core, clmha__core_call *call,
                               const clmha__middle *m) {
    clmha_context *ctx = l->ctx;
    cl_mem own[CLMHA__TILE_COUNT], *t = l->tiles;
    memcpy(own, t, sizeof own);
    if (!core->takes_rows && m->out.tiles && m->out.offset == 0 && !write_only(m->out.buffer))
        t[CLMHA__TILE_OUT] = m->out.buffer;  // the core writes the result in place
    clmha_status st = run_on(l, core, call, m, t, own);
    memcpy(t, own, sizeof own);
    if (st || !m->lse || call->lse == m->lse) return st;
    size_t rows = call->dims->n * l->h * call->dims->l;
    cl_int err = clEnqueueCopyBuffer(ctx->queue, call->lse, m->lse, 0, m->lse_offset * l->rs,
                                     rows * l->rs, 0, NULL, NULL);
    return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(log-sum-exp rows)")
               : CLMHA_SUCCESS;
}

clmha_status clmha__weights_out(clmha_layer *l, const clmha__dims *d, bool per_head, cl_mem w,
                                size_t w_off) {
    clmha_context *ctx = l->ctx;
    if (per_head) {
        cl_int err = clEnqueueCopyBuffer(ctx->queue, l->scores, w, 0, w_off * l->rs,
                                         d->scores_count * l->rs, 0, NULL, NULL);
        return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(weights)") : CLMHA_SUCCESS;
    }
    cl_ulong off = w_off, n = d->n, h = l->h, plane = d->l * d->s_padded;
    arg args[] = {ARG(l->scores), ARG(w), ARG(off), ARG(n), ARG(h), ARG(plane)};
    return clmha__launch(ctx, l->average_heads, "average_heads", d->n * plane, l->heads_wg,
                         args, sizeof args / sizeof args[0]);
}
