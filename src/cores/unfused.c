// The unfused attention core: scores = Q·Kᵀ/√D (CLBlast GEMM), masks + softmax + dropout
// (masked_softmax, cl/cores/unfused.cl), then weights·V (CLBlast GEMM); over all the scores at
// once, or chunk by chunk when they do not fit in one buffer (clmha__scores_chunks()). The only
// built-in core that returns attention weights, and the one every call can fall back on: its
// kernel is built with the layer.
#include "cores/unfused.h"

#include "context/gemm.h"
#include "cores/core.h"
#include "cores/kernel_args.h"
#include "cores/unfused_backward.h"
#include "cores/unfused_shared.h"
#include "device/held.h"

#include <stdio.h>
#include <stdlib.h>


typedef clmha__arg arg;
#define ARG CLMHA__ARG
#define MASK_ARGS CLMHA__MASK_ARGS

CLMHA__HIDDEN extern const clmha__core clmha__core_unfused;  // this core, at the end of this file

// The core's state in a layer.
typedef struct state {
    clmha__unfused_softmax softmax;     // masked_softmax and its work-group
    clmha__unfused_backward *backward;  // the backward pass's (unfused_backward.c), on first use
} state;

static state *state_of(const clmha_layer *l) {
    return clmha__core_state(l, &clmha__core_unfused);
}

size_t clmha__unfused_softmax_wg(const clmha_layer *layer) {
    return state_of(layer)->softmax.wg;
}

static void release(void *p) {
    state *s = p;
    if (!s) return;
    clmha__release_kernel(s->softmax.kernel);
    clmha__unfused_backward_release(s->backward);
    free(s);
}

// Builds masked_softmax with the layer (every call can fall back on this core). Its
// work-group: a power of two, its cap from the device class (smaller on CPUs, where a
// work-group is a loop on one core), and within what the built kernel allows
// (CL_KERNEL_WORK_GROUP_SIZE, which a driver may set below the device's limit): rebuilt smaller
// until it fits.
static clmha_status create(clmha_layer *l, void **out) {
    clmha_context *ctx = l->ctx;
    state *s = calloc(1, sizeof *s);
    if (!s) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    *out = s;
    for (size_t want = clmha__unfused_pow2_below(ctx->cls->softmax_wg, ctx->max_work_group);;) {
        char options[224];
        snprintf(options, sizeof options, "-DWG=%zu%s%s", want, clmha__layer_real_options(l),
                 clmha__layer_variant_options(l));
        cl_program prog;
        size_t wg;
        clmha_status st = clmha__program_get_mod(ctx, "unfused", options, l->mod_source, &prog);
        if (st || (st = clmha__kernel_make(ctx, prog, "masked_softmax", &s->softmax.kernel)) ||
            (st = clmha__kernel_limits(ctx, s->softmax.kernel, &wg, NULL)))
            return st;
        if (want <= wg || want == 1) {
            s->softmax.wg = want;
            return CLMHA_SUCCESS;
        }
        clmha__release_kernel(s->softmax.kernel);
        s->softmax.kernel = NULL;
        want = clmha__unfused_pow2_below(want / 2, wg);
    }
}

typedef clmha__unfused_chunk chunk;

// 5. Attention output (N*H, L, D) = weights · V for the rows of @p c: all of them in one
//    strided batched GEMM, a chunk in one plain GEMM per plane it touches.
static clmha_status attend(clmha_layer *l, const clmha__dims *d, chunk c, size_t group) {
    size_t hd = l->d, sp = d->s_padded;
    clmha__gemm_op op = {.f64 = l->rs == 8, .m = d->l * group, .n = hd, .k = sp, .alpha = 1.0,
                         .a = l->scores, .lda = sp, .a_stride = d->l * group * sp,
                         .b = l->tiles[CLMHA__TILE_V], .ldb = hd, .b_stride = sp * hd,
                         .c = l->tiles[CLMHA__TILE_OUT], .ldc = hd,
                         .c_stride = d->l * group * hd, .batch = d->n * l->h / group};
    if (clmha__unfused_chunk_is_all(l, d, c)) return clmha__gemm(l->ctx, "AV", &op);
    for (size_t r = c.first, end = c.first + c.rows; r < end;) {
        size_t plane = r / d->l, rows = d->l - r % d->l;
        if (rows > end - r) rows = end - r;
        op.m = rows;
        op.a_off = (r - c.first) * sp;
        op.b_off = plane / group * sp * hd;
        op.c_off = r * hd;
        op.batch = 1;
        clmha_status st = clmha__gemm(l->ctx, "AV chunk", &op);
        if (st) return st;
        r += rows;
    }
    return CLMHA_SUCCESS;
}

// 8 for one chunk of the scores (stage 8 then has nothing left to do): per-head weights are
// copied to their rows; averaged ones are summed over the heads of the chunk, added to the
// running sums in layer->head_sums, and written to the rows of their batch item, divided by H,
// with the item's last head (the chunks of a block of rows come in head order, and a chunk of
// whole planes holds whole batch items or a divisor of H of one item's heads:
// clmha__scores_chunks()). The caller's buffer is only written, never read.
static clmha_status chunk_weights(clmha_layer *l, const clmha_forward_args *a,
                                  const clmha__dims *d, chunk c, cl_mem w, size_t w_off) {
    clmha_context *ctx = l->ctx;
    size_t sp = d->s_padded, h = l->h, plane_rows = d->l;
    if (a->per_head_weights) {
        cl_int err = clEnqueueCopyBuffer(ctx->queue, l->scores, w, 0,
                                         (w_off + c.first * sp) * l->rs, c.rows * sp * l->rs,
                                         0, NULL, NULL);
        return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(weights chunk)")
                   : CLMHA_SUCCESS;
    }
    size_t plane = c.first / plane_rows, i = c.first % plane_rows, item = plane / h,
           head = plane % h;
    // Whole planes: groups of H heads (whole batch items), or fewer heads of one item. Rows of
    // one plane: one head.
    size_t planes = c.rows >= plane_rows ? c.rows / plane_rows : 1;
    size_t group = planes >= h ? h : planes;
    cl_ulong off = w_off + (item * plane_rows + i) * sp, groups = planes / group,
             heads = group, part = (c.rows >= plane_rows ? plane_rows : c.rows) * sp;
    cl_uint first = head == 0, last = head + group == h;
    clmha__real divisor = clmha__real_of((double)h);
    cl_mem sums = first && last ? ctx->dummy : l->head_sums;
    arg args[] = {ARG(l->scores), ARG(sums),  ARG(w),    ARG(off),
                  ARG(groups),    ARG(heads), ARG(part), ARG(first),
                  ARG(last),      CLMHA__REAL_ARG(divisor, l->rs)};
    return clmha__launch(ctx, l->accumulate_heads, "accumulate_heads", groups * part,
                         l->heads_wg, args, sizeof args / sizeof args[0]);
}

// The unfused core: stages 3 to 5 over all the scores at once, or chunk by chunk
// when they do not fit in one buffer (clmha__scores_chunks()). Chunk by chunk, the weights are
// written as each chunk is done, and the profiling marks see the three stages as one (scores).
static clmha_status run(clmha_layer *l, clmha__core_call *call) {
    const clmha_forward_args *a = call->args;
    const clmha__dims *d = call->dims;
    cl_mem w = call->weights;
    size_t w_off = call->weights_offset, group = call->kv_group ? call->kv_group : 1;
    // The log-sum-exp rows where the call needs them (attention as a function, partial
    // attention, and a layer with sinks saving for its backward: the sinks' gradient); not
    // for another call that only saves for its backward (which recomputes).
    cl_mem lse = call->need_lse || d->sinks ? call->lse : NULL;
    call->lse_written = lse != NULL;
    clmha_status st;
    clmha__chunks plan;
    if (!clmha__scores_chunks(l, d, &plan))  // clmha__layer_reserve() refused it already
        return clmha__fail(l->ctx, CLMHA_OUT_OF_MEMORY, "scores: one row does not fit");
    if (plan.count == 1) {
        chunk all = {0, d->n * l->h * d->l};
        if ((st = clmha__unfused_scores(l, d, all, l->tiles[CLMHA__TILE_Q],
                                        l->tiles[CLMHA__TILE_K], group, call->scale)) ||
            (st = clmha__layer_mark(l, 1 + CLMHA_STAGE_SCORES)))
            return st;
        if ((st = clmha__unfused_masked_softmax(l, &state_of(l)->softmax, a, d, all, false,
                                                lse)) ||
            (st = clmha__layer_mark(l, 1 + CLMHA_STAGE_SOFTMAX)))
            return st;
        if ((st = attend(l, d, all, group)) || (st = clmha__layer_mark(l, 1 + CLMHA_STAGE_AV)))
            return st;
        return CLMHA_SUCCESS;
    }
    size_t total = d->n * l->h * d->l;
    for (size_t k = 0; k < plan.count; ++k) {
        chunk c;
        if (plan.whole) {  // planes in order
            c.first = k * plan.rows;
            c.rows = total - c.first < plan.rows ? total - c.first : plan.rows;
        } else {  // k = ((item * blocks) + block) * H + head
            size_t blocks = (d->l + plan.rows - 1) / plan.rows, head = k % l->h;
            size_t block = k / l->h % blocks, item = k / l->h / blocks;
            size_t i = block * plan.rows;
            c.first = ((item * l->h + head) * d->l + i);
            c.rows = d->l - i < plan.rows ? d->l - i : plan.rows;
        }
        if ((st = clmha__unfused_scores(l, d, c, l->tiles[CLMHA__TILE_Q],
                                        l->tiles[CLMHA__TILE_K], group, call->scale)) ||
            (st = clmha__unfused_masked_softmax(l, &state_of(l)->softmax, a, d, c, false,
                                                lse)))
            return st;
        if (a->need_weights && (st = chunk_weights(l, a, d, c, w, w_off))) return st;
        if ((st = attend(l, d, c, group))) return st;
    }
    call->weights_written = a->need_weights;
    return clmha__layer_mark(l, 1 + CLMHA_STAGE_SCORES);
}

// The backward hooks: the backward pass (unfused_backward.c) gets its state's place in this
// core's state, and the masked_softmax it recomputes the probabilities with.
static clmha_status backward_supports(clmha_layer *l, const clmha__backward_call *call,
                                      clmha__core_answer *answer) {
    return clmha__unfused_backward_supports(&state_of(l)->backward, l, call, answer);
}

static clmha_status backward(clmha_layer *l, clmha__backward_call *call) {
    state *s = state_of(l);
    return clmha__unfused_backward_run(&s->backward, &s->softmax, l, call);
}

// Every call that reaches it (the last row): a call with a KV cache is the decode core's,
// which refuses what it does not take; a call that needs the log-sum-exp rows is never asked.
static clmha_status supports(clmha_layer *l, const clmha__core_call *call,
                             clmha__core_answer *answer) {
    (void)l, (void)call;
    clmha__core_runs(answer);
    return CLMHA_SUCCESS;
}

const clmha__core clmha__core_unfused = {.name = "unfused",
                                         .impl = CLMHA_IMPL_UNFUSED,
                                         .returns_weights = true,
                                         .writes_lse = true,
                                         .grouped_kv = true,
                                         .create = create,
                                         .release = release,
                                         .supports = supports,
                                         .uses_scores = true,
                                         .run = run,
                                         .backward_supports = backward_supports,
                                         .backward = backward};
