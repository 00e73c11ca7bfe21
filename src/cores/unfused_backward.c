// The unfused core's backward pass (kernels cl/cores/unfused_backward.cl): the probabilities
// P are recomputed into layer->scores with the forward's own GEMM and masked_softmax (dropout
// off), dPd = dO·V'ᵀ goes to a second scores-sized buffer (its own, grown on demand), and
// softmax_backward turns the pair into Pd (dropout replayed) and dS in place; then three
// batched GEMMs give dV' = Pdᵀ·dO, dQ = scale·dS·K', dK' = scale·dSᵀ·Q, and mask_grad sums dS
// into the float masks' gradients; with soft-capping or a user score function dS goes through
// their derivative into a third buffer of the raw scores (score_backward). Twice N*H*L*S'
// floats of scratch (three times with either): it runs only when the scores fit in one chunk (clmha__scores_chunks()),
// and every batched GEMM sees offset-0 buffers (CLBlast 1.5.3's GemmStridedBatched ignores
// buffer offsets on one of its paths).
#include "cores/unfused_backward.h"

#include "context/gemm.h"
#include "cores/core.h"
#include "cores/kernel_args.h"
#include "device/held.h"
#include "layer/mods.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>


typedef clmha__arg arg;
#define ARG CLMHA__ARG

struct clmha__unfused_backward {
    cl_kernel softmax_backward, mask_grad;
    size_t wg;            // softmax_backward's work-group (its -DWG), within the kernel's limit
    size_t mask_wg;       // mask_grad's work-group, within its limit
    cl_mem grad_scores;   // dPd, then dS: (N*H, L, S'), grown on demand
    size_t grad_scores_cap;
    cl_kernel score_backward;  // with soft-capping or clmha_score_mod
    cl_mem raw_scores;    // with either: the scores before them, then dS through them
    size_t raw_scores_cap;
};

void clmha__unfused_backward_release(clmha__unfused_backward *ub) {
    if (!ub) return;
    clmha__release_kernel(ub->softmax_backward);
    clmha__release_kernel(ub->mask_grad);
    clmha__release_kernel(ub->score_backward);
    clmha__release_mem(ub->grad_scores);
    clmha__release_mem(ub->raw_scores);
    free(ub);
}

// Builds the kernels on first use (the state kept in *@p slot); softmax_backward's work-group as masked_softmax's (the
// device class's cap, rebuilt smaller while the built kernel allows less).
static clmha_status ensure(clmha__unfused_backward **slot, clmha_layer *l,
                           clmha__unfused_backward **out) {
    clmha_context *ctx = l->ctx;
    if (!*slot && !(*slot = calloc(1, sizeof **slot)))
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    clmha__unfused_backward *ub = *out = *slot;
    if (ub->softmax_backward) return CLMHA_SUCCESS;
    for (size_t want = clmha__unfused_pow2_below(ctx->cls->softmax_wg, ctx->max_work_group);;) {
        char options[224];
        snprintf(options, sizeof options, "-DWG=%zu%s%s", want, clmha__layer_real_options(l),
                 clmha__layer_variant_options(l));
        cl_program prog;
        size_t wg = 1, mask_wg = 1;
        clmha_status st = clmha__program_get_mod(ctx, "unfused_backward", options, l->mod_source, &prog);
        if (!st && !(st = clmha__kernel_make(ctx, prog, "softmax_backward",
                                             &ub->softmax_backward)) &&
            !(st = clmha__kernel_make(ctx, prog, "mask_grad", &ub->mask_grad)) &&
            !(st = clmha__kernel_make(ctx, prog, "score_backward", &ub->score_backward)) &&
            !(st = clmha__kernel_limits(ctx, ub->softmax_backward, &wg, NULL)) &&
            !(st = clmha__kernel_limits(ctx, ub->mask_grad, &mask_wg, NULL)) &&
            (want <= wg || want == 1)) {
            ub->wg = want;
            ub->mask_wg = clmha__unfused_pow2_below(64, mask_wg);
            return CLMHA_SUCCESS;
        }
        clmha__release_kernel(ub->softmax_backward);
        clmha__release_kernel(ub->mask_grad);
        clmha__release_kernel(ub->score_backward);
        ub->softmax_backward = ub->mask_grad = ub->score_backward = NULL;
        if (st) return st;
        want = clmha__unfused_pow2_below(want / 2, wg);
    }
}

clmha_status clmha__unfused_backward_supports(clmha__unfused_backward **slot, clmha_layer *l,
                                              const clmha__backward_call *call,
                                              clmha__core_answer *answer) {
    clmha__chunks plan;
    const clmha__dims *d = call->dims;
    if (!clmha__scores_chunks(l, d, &plan) || plan.count != 1) {
        // Asked for by CLMHA_IMPL_FUSED (its forward fell back): say why this core cannot;
        // else that the scores are too large for it, and what the fused backward needs.
        if (call->impl == CLMHA_IMPL_FUSED)
            clmha__core_answer_set(answer, CLMHA__CORE_REFUSES, CLMHA_UNSUPPORTED,
                                   "the unfused backward core cannot run this call: the scores "
                                   "(N·H·L·S' floats) exceed half the device's largest "
                                   "allocation: use the fused backward");
        else
            clmha__core_answer_set(
                answer, CLMHA__CORE_REFUSES, CLMHA_OUT_OF_MEMORY,
                "the unfused backward needs the scores (N*H*L*S' = %zu floats) in one buffer, "
                "more than half this device's largest allocation (%llu bytes), and the fused "
                "backward cannot run this call (it needs a forward call that ran the fused "
                "core, no weights gradient and no mask gradient)",
                d->scores_count, (unsigned long long)clmha__max_alloc(l->ctx));
        return CLMHA_SUCCESS;
    }
    clmha__unfused_backward *ub;
    clmha_status st = ensure(slot, l, &ub);
    if (st) return st;
    clmha__core_runs(answer);
    return CLMHA_SUCCESS;
}

// One strided batched GEMM over the N*H planes, row-major: C = alpha · op(A) · op(B), every
// buffer at offset 0 (see the top of this file).
static clmha_status gemm(clmha_layer *l, const char *what, bool trans_a, bool trans_b, size_t m,
                         size_t n, size_t k, double alpha, cl_mem a, size_t lda, size_t stride_a,
                         cl_mem b, size_t ldb, size_t stride_b, cl_mem c, size_t ldc,
                         size_t stride_c, size_t batches) {
    clmha__gemm_op op = {.ta = trans_a, .tb = trans_b, .f64 = l->rs == sizeof(double), .m = m,
                         .n = n, .k = k, .alpha = alpha,
                         .a = a, .lda = lda, .a_stride = stride_a,
                         .b = b, .ldb = ldb, .b_stride = stride_b,
                         .c = c, .ldc = ldc, .c_stride = stride_c, .batch = batches};
    return clmha__gemm(l->ctx, what, &op);
}

// The gradient of one float mask, @p count elements at @p off of @p out, of broadcast strides
// @p sn, @p sh, @p si along N, H, L (clmha__dims::attn_sn...; 0 where it is broadcast), from dS
// in @p ds: cl/cores/unfused_backward.cl's mask_grad.
static clmha_status mask_grad(clmha_layer *l, const clmha__unfused_backward *ub,
                              const clmha__dims *d, cl_mem ds, cl_mem out, size_t off,
                              size_t count, size_t sn, size_t sh, size_t si, bool accumulate) {
    cl_ulong out_off = off, n_el = count, tgt = d->l, heads = l->h, batch = d->n, src = d->s,
             srcp = d->s_padded, msn = sn, msh = sh, msi = si;
    cl_uint acc = accumulate;
    arg args[] = {ARG(ds),    ARG(out),   ARG(out_off), ARG(n_el), ARG(acc),
                  ARG(tgt),   ARG(heads), ARG(batch),   ARG(src),  ARG(srcp),
                  ARG(msn),   ARG(msh),   ARG(msi)};
    return clmha__launch(l->ctx, ub->mask_grad, "mask_grad", count, ub->mask_wg, args,
                         sizeof args / sizeof args[0]);
}

// dS through the soft-capping (clmha_layer_desc::softcap) and the user's score function
// (clmha_score_mod): the scores before them, scale · Q · K'ᵀ, into ub->raw_scores (grown on
// demand), then score_backward turns them into dS times the functions' derivative there, from
// dS in @p g; *@p out is that buffer.
static clmha_status score_backward(clmha_layer *l, clmha__unfused_backward *ub,
                                     const clmha__backward_call *call, double scale, cl_mem g,
                                     cl_mem *out) {
    const clmha__dims *d = call->dims;
    size_t hd = l->d, sp = d->s_padded, tl = d->l, planes = d->n * l->h;
    clmha_status st = clmha__layer_grow_core_scratch(l, &ub->raw_scores, &ub->raw_scores_cap,
                                                     d->scores_count,
                                                     "unfused backward raw scores");
    if (st || (st = gemm(l, "Q K^T", false, true, tl, sp, hd, scale, call->q, hd, tl * hd,
                         call->k, hd, sp * hd, ub->raw_scores, sp, tl * sp, planes)))
        return st;
    clmha__mask_args m = clmha__masks_of(l, call->args, d);
    cl_ulong count = d->scores_count, tgt = tl, heads = l->h, src = d->s, srcp = sp;
    arg args[] = {ARG(g),     ARG(ub->raw_scores), CLMHA__REAL_ARG(m.softcap, l->rs),
                  ARG(m.alibi),
                  ARG(m.alibi_off), ARG(m.mod_p),  ARG(m.mod_off),   ARG(tgt),
                  ARG(heads), ARG(src),            ARG(srcp),        ARG(count)};
    *out = ub->raw_scores;
    return clmha__launch(l->ctx, ub->score_backward, "score_backward", d->scores_count,
                         ub->mask_wg, args, sizeof args / sizeof args[0]);
}

clmha_status clmha__unfused_backward_run(clmha__unfused_backward **slot,
                                        const clmha__unfused_softmax *sm, clmha_layer *l,
                                        clmha__backward_call *call) {
    clmha_context *ctx = l->ctx;
    const clmha_forward_args *a = call->args;
    const clmha__dims *d = call->dims;
    clmha__unfused_backward *ub;
    clmha_status st;
    if ((st = ensure(slot, l, &ub)) || (st = clmha__layer_reserve(l, d, true, false)) ||
        (st = clmha__layer_grow_core_scratch(l, &ub->grad_scores, &ub->grad_scores_cap,
                                             d->scores_count,
                                             "unfused backward score gradients")))
        return st;
    size_t hd = l->d, sp = d->s_padded, tl = d->l, planes = d->n * l->h;
    double scale = clmha__core_scale(l, call->scale);
    cl_mem p = l->scores, g = ub->grad_scores;

    // P, then dPd = dO · V'ᵀ.
    if ((st = clmha__unfused_probabilities(l, sm, a, d, call->q, call->k, call->scale)) ||
        (st = gemm(l, "dO V^T", false, true, tl, sp, hd, 1.0,
                   call->d_o, hd, tl * hd, call->v, hd, sp * hd, g, sp, tl * sp, planes)))
        return st;

    // Pd into p, dS into g.
    clmha__mask_args m = clmha__masks_of(l, a, d);
    cl_uint gw_mode = call->grad_weights ? (a->per_head_weights ? 1 : 2) : 0;
    cl_mem gw = call->grad_weights ? call->grad_weights : ctx->dummy;
    cl_ulong gw_off = call->grad_weights ? call->grad_weights_offset : 0, tgt = tl,
             heads = l->h, srcp = sp;
    clmha__real inv_heads = clmha__real_of(1.0 / (double)l->h);
    cl_mem drow = call->drow ? call->drow : ctx->dummy;
    cl_uint drow_on = call->drow != NULL;
    arg sb_args[] = {ARG(p),          ARG(g),           ARG(gw),           ARG(gw_off),
                     ARG(gw_mode),    CLMHA__REAL_ARG(inv_heads, l->rs), ARG(tgt), ARG(heads),
                     ARG(srcp),       ARG(m.dropout_on), ARG(m.threshold),
                     CLMHA__REAL_ARG(m.keep_scale, l->rs),
                     ARG(m.seed_lo),  ARG(m.seed_hi),   ARG(m.off_lo),     ARG(drow),
                     ARG(drow_on)};
    size_t rows = planes * tl;
    if ((st = clmha__launch(ctx, ub->softmax_backward, "softmax_backward", rows * ub->wg, ub->wg,
                            sb_args, sizeof sb_args / sizeof sb_args[0])))
        return st;

    // With soft-capping, dS through it into its own buffer (g keeps dS of the capped scores,
    // which is the masks' gradient).
    cl_mem ds = g;
    if ((d->softcap > 0.0 || (l->mods & CLMHA__MOD_SCORE)) &&
        (st = score_backward(l, ub, call, scale, g, &ds)))
        return st;

    // dV' = Pdᵀ · dO, dQ = scale · dS · K', dK' = scale · dSᵀ · Q.
    if ((st = gemm(l, "Pd^T dO", true, false, sp, hd, tl, 1.0, p,
                   sp, tl * sp, call->d_o, hd, tl * hd, call->dv, hd, sp * hd, planes)) ||
        (st = gemm(l, "dS K", false, false, tl, hd, sp, scale, ds,
                   sp, tl * sp, call->k, hd, sp * hd, call->dq, hd, tl * hd, planes)) ||
        (st = gemm(l, "dS^T Q", true, false, sp, hd, tl, scale, ds,
                   sp, tl * sp, call->q, hd, tl * hd, call->dk, hd, sp * hd, planes)))
        return st;

    // The masks' gradients: dS summed over what each mask is broadcast along.
    if (call->grad_attn_mask &&
        (st = mask_grad(l, ub, d, g, call->grad_attn_mask, call->grad_attn_offset,
                        d->attn_count, d->attn_sn, d->attn_sh, d->attn_si,
                        call->grad_attn_accumulate)))
        return st;
    if (call->grad_kpm &&  // key_padding_mask (N, S): one row of keys per batch item
        (st = mask_grad(l, ub, d, g, call->grad_kpm, call->grad_kpm_offset, d->n * d->s, d->s,
                        0, 0, call->grad_kpm_accumulate)))
        return st;
    return CLMHA_SUCCESS;
}
