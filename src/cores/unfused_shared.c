// What the unfused core's forward and backward both run (unfused_shared.h): the steps 3 and 4
// of the attention, scores and masked softmax.
#include "cores/unfused_shared.h"

#include "context/gemm.h"
#include "cores/kernel_args.h"

#include <math.h>

typedef clmha__arg arg;
#define ARG CLMHA__ARG
#define MASK_ARGS CLMHA__MASK_ARGS

size_t clmha__unfused_pow2_below(size_t cap, size_t limit) {
    size_t w = 1;
    while (w * 2 <= cap && w * 2 <= limit) w *= 2;
    return w;
}

// 3. Scores = Q · Kᵀ / √D for the rows of a chunk (unfused_shared.h).
clmha_status clmha__unfused_scores(clmha_layer *l, const clmha__dims *d, clmha__unfused_chunk c,
                                   cl_mem qt, cl_mem kt, size_t group, double scale) {
    size_t hd = l->d, sp = d->s_padded;
    if (scale == 0.0) scale = 1.0 / sqrt((double)hd);
    // Grouped-query attention (@p group query heads per key/value plane): the group's query
    // planes are consecutive, so one product per key/value plane takes all their rows.
    clmha__gemm_op op = {.tb = true, .f64 = l->rs == 8, .m = d->l * group, .n = sp, .k = hd,
                         .alpha = scale,
                         .a = qt, .lda = hd, .a_stride = d->l * group * hd,
                         .b = kt, .ldb = hd, .b_stride = sp * hd,
                         .c = l->scores, .ldc = sp, .c_stride = d->l * group * sp,
                         .batch = d->n * l->h / group};
    if (clmha__unfused_chunk_is_all(l, d, c)) return clmha__gemm(l->ctx, "QK^T", &op);
    for (size_t r = c.first, end = c.first + c.rows; r < end;) {
        size_t plane = r / d->l, rows = d->l - r % d->l;  // the rest of this plane
        if (rows > end - r) rows = end - r;
        // Query row r of the (N*H*L, D) tile; keys of the plane's key/value plane; the chunk's
        // row r - first.
        op.m = rows;
        op.a_off = r * hd;
        op.b_off = plane / group * sp * hd;
        op.c_off = (r - c.first) * sp;
        op.batch = 1;
        clmha_status st = clmha__gemm(l->ctx, "QK^T chunk", &op);
        if (st) return st;
        r += rows;
    }
    return CLMHA_SUCCESS;
}

// 4. Masks, softmax and dropout on the scores of a chunk (unfused_shared.h).
clmha_status clmha__unfused_masked_softmax(clmha_layer *l, const clmha__unfused_softmax *sm,
                                           const clmha_forward_args *a, const clmha__dims *d,
                                           clmha__unfused_chunk c, bool no_dropout,
                                           cl_mem lse) {
    cl_ulong rows = c.rows, first = c.first, tgt = d->l, heads = l->h, src = d->s,
             srcp = d->s_padded;
    clmha__mask_args m = clmha__masks_of(l, a, d);
    if (no_dropout) m.dropout_on = 0;
    cl_mem lse_buf = lse ? lse : l->ctx->dummy;
    cl_uint has_lse = lse != NULL;
    arg args[] = {ARG(l->scores), ARG(rows), ARG(first), ARG(tgt),     ARG(heads),
                  ARG(src),       ARG(srcp), ARG(lse_buf), ARG(has_lse), MASK_ARGS(m)};
    return clmha__launch(l->ctx, sm->kernel, "masked_softmax", rows * sm->wg, sm->wg, args,
                         sizeof args / sizeof args[0]);
}

clmha_status clmha__unfused_probabilities(clmha_layer *l, const clmha__unfused_softmax *sm,
                                          const clmha_forward_args *a, const clmha__dims *d,
                                          cl_mem q, cl_mem k, double scale) {
    clmha__unfused_chunk all = {0, d->n * l->h * d->l};
    // The saved tiles: a key plane per head.
    clmha_status st = clmha__unfused_scores(l, d, all, q, k, 1, scale);
    return st ? st : clmha__unfused_masked_softmax(l, sm, a, d, all, true, NULL);
}
