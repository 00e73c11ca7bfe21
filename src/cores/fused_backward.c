// The fused core's backward pass (FlashAttention-2's algorithm, kernels
// cl/cores/fused_backward.cl): the probabilities are recomputed tile by tile from the saved
// q, k and log-sum-exp rows and never stored, so its only scratch is Drow, one float per query
// row (N*H*L). Its state (kernels, tile, that scratch) hangs off the fused core's
// (clmha__fused_backward_slot()), made on first use and freed with it.
#include "cores/fused.h"

#include "cores/core.h"
#include "cores/kernel_args.h"
#include "device/held.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

typedef clmha__arg arg;
#define ARG CLMHA__ARG
#define MASK_ARGS CLMHA__MASK_ARGS

struct clmha__fused_backward {
    cl_kernel drow, dkdv, dq;
    size_t b;              // work-group size = rows per tile (the kernels' -DB)
    size_t vw;             // vector width of the inner products (-DVW)
    clmha_status failed;   // why the kernels cannot be built here (then not retried)
    cl_mem drow_buf;       // Drow, N*H*L floats, grown on demand
    size_t drow_cap;
};

static void release_kernels(clmha__fused_backward *fb) {
    clmha__release_kernel(fb->drow);
    clmha__release_kernel(fb->dkdv);
    clmha__release_kernel(fb->dq);
    fb->drow = fb->dkdv = fb->dq = NULL;
}

void clmha__fused_backward_release(clmha__fused_backward *fb) {
    if (!fb) return;
    release_kernels(fb);
    clmha__release_mem(fb->drow_buf);
    free(fb);
}

size_t clmha__fused_backward_tile(const clmha_layer *layer) {
    const clmha__fused_backward *fb = *clmha__fused_backward_slot(layer);
    return fb && fb->dkdv ? fb->b : 0;
}

// ---- tile and build -----------------------------------------------------------------------------

// Local memory of the larger kernel (dkdv: the query tile's q and dO rows, their lse and Drow)
// in floats.
static size_t local_floats(size_t b, size_t hd) { return 2 * b * hd + 2 * b; }

// Local memory the tile may use, in bytes: the device's less 1 KiB (room for what the compiler
// adds), and at most 32 KiB, so that a GPU keeps a few work-groups resident per compute unit.
static cl_ulong local_budget(const clmha_context *ctx) {
    cl_ulong dev = clmha__local_mem(ctx);
    cl_ulong budget = dev > 1024 ? dev - 1024 : 0;
    return budget < 32768 ? budget : 32768;
}

// The largest power of two up to 64 within @p max_wg whose tile fits in the budget; 0 when not
// even one row does. (64 rows: each key row of dkdv then reads a query tile of 64 rows per
// barrier pair, and more buys little once the tile is past the cache line.)
static size_t tile_for(const clmha_context *ctx, size_t max_wg, size_t hd) {
    size_t b = 1;
    while (b * 2 <= 64 && b * 2 <= max_wg) b *= 2;
    cl_ulong budget = local_budget(ctx);
    while (b > 1 && local_floats(b, hd) * sizeof(float) > budget) b /= 2;
    return local_floats(b, hd) * sizeof(float) <= budget ? b : 0;
}

// Builds the three kernels with the largest tile that fits, then asks each built kernel what it
// allows: while a work-group limit (CL_KERNEL_WORK_GROUP_SIZE, which drivers may set below the
// device's) is below the tile, or the local memory used exceeds the device's, rebuilds with a
// smaller tile.
static clmha_status build(clmha_layer *l, clmha__fused_backward *fb) {
    clmha_context *ctx = l->ctx;
    size_t b = tile_for(ctx, ctx->max_work_group, l->d);
    // The forward's vector width (the class's, or a CPU's native one), narrowed to divide HD;
    // 1 where vloadN is unsafe.
    size_t want = clmha__fused_default_vw(ctx), vw = 16;
    while (vw > 1 && (vw > want || l->d % vw)) vw /= 2;
    if (ctx->quirks.no_vload) vw = 1;
    while (b) {
        char options[80];
        snprintf(options, sizeof options, "-DHD=%zu -DB=%zu -DVW=%zu", l->d, b, vw);
        cl_program prog;
        clmha_status st = clmha__program_get(ctx, "fused_backward", options, &prog);
        if (st || (st = clmha__kernel_make(ctx, prog, "fused_backward_drow", &fb->drow)) ||
            (st = clmha__kernel_make(ctx, prog, "fused_backward_dkdv", &fb->dkdv)) ||
            (st = clmha__kernel_make(ctx, prog, "fused_backward_dq", &fb->dq))) {
            release_kernels(fb);
            return st;
        }
        size_t wg_min = b;
        bool fits = true;
        cl_kernel ks[] = {fb->drow, fb->dkdv, fb->dq};
        for (size_t i = 0; i < sizeof ks / sizeof ks[0]; ++i) {
            size_t wg;
            cl_ulong local;
            if ((st = clmha__kernel_limits(ctx, ks[i], &wg, &local))) {
                release_kernels(fb);
                return st;
            }
            if (wg < wg_min) wg_min = wg;
            if (local > clmha__local_mem(ctx)) fits = false;
        }
        if (wg_min >= b && fits) {
            fb->b = b;
            fb->vw = vw;
            return CLMHA_SUCCESS;
        }
        release_kernels(fb);
        size_t next = wg_min < b ? tile_for(ctx, wg_min, l->d) : b / 2;
        b = next < b ? next : b / 2;
    }
    return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                       "the fused backward kernels need %zu bytes of local memory for one row "
                       "per tile at head_dim %zu; the device has %llu",
                       local_floats(1, l->d) * sizeof(float), l->d,
                       (unsigned long long)clmha__local_mem(ctx));
}

// The state of @p l's fused backward pass, its kernels built (on first use).
static clmha_status ensure(clmha_layer *l, clmha__fused_backward **out) {
    clmha__fused_backward **slot = clmha__fused_backward_slot(l);
    if (!*slot && !(*slot = calloc(1, sizeof **slot)))
        return clmha__fail(l->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    clmha__fused_backward *fb = *out = *slot;
    if (fb->dkdv) return CLMHA_SUCCESS;
    if (fb->failed)
        return clmha__fail(l->ctx, fb->failed,
                           "the fused backward kernels could not be built for head_dim %zu on "
                           "this device: %s",
                           l->d, clmha_status_string(fb->failed));
    clmha_status st = build(l, fb);
    // A device that cannot build or hold the kernels will not later; an out-of-memory may pass.
    if (st == CLMHA_UNSUPPORTED || st == CLMHA_BUILD_FAILED) fb->failed = st;
    return st;
}

// ---- loop budget --------------------------------------------------------------------------------

// As clmha__fused_loops_fit() for the forward kernel: a loop of @p n iterations whose body runs
// @p body iterations costs n + 1 + n * body to a driver that counts every condition check.
static double loop_cost(double n, double body) { return n + 1 + n * body; }

// Whether every backward kernel's work-item stays below half the device's loop limit
// (clmha__fused_loop_limit(); always on devices without one). Counted as if the compiler kept
// every loop: dkdv walks ceil(L / B) query tiles, dq ceil(S' / B) key tiles, each tile a
// staging loop of HD iterations and B rows of two HD-long loops (and Philox's ten rounds with
// dropout). The HD-long loops count HD iterations, though they run HD / VW (conservative).
static bool loops_fit(const clmha_layer *l, const clmha__fused_backward *fb,
                      const clmha__dims *d, bool dropout) {
    size_t limit = clmha__fused_loop_limit(l);
    if (!limit) return true;
    double hd = (double)l->d, b = (double)fb->b;
    double row = 2 * loop_cost(hd, 0) + (dropout ? loop_cost(10, 0) : 0);
    double tile = loop_cost(hd, 0) + loop_cost(b, row);
    double dkdv = 2 * loop_cost(hd, 0) + loop_cost(ceil((double)d->l / b), tile);
    double dq = 2 * loop_cost(hd, 0) + loop_cost(ceil((double)d->s_padded / b), tile);
    double worst = dkdv > dq ? dkdv : dq;
    return worst <= (double)limit / 2;
}

// ---- the hooks ----------------------------------------------------------------------------------

const char clmha__fused_backward_loop_why[] =
    "its loops would exceed the device's loop limit at these sequence lengths";

clmha_status clmha__fused_backward_supports(clmha_layer *l, const clmha__backward_call *call,
                                            bool *yes, const char **why) {
    *yes = false;
    *why = NULL;
    if (!call->lse) {
        *why = "the forward call did not run the fused core (no saved log-sum-exp rows)";
        return CLMHA_SUCCESS;
    }
    if (call->grad_weights) {
        *why = "it takes no gradient of the attention weights";
        return CLMHA_SUCCESS;
    }
    if (call->grad_attn_mask || call->grad_kpm) {
        *why = "it computes no mask gradient";
        return CLMHA_SUCCESS;
    }
    clmha__fused_backward *fb;
    clmha_status st = ensure(l, &fb);
    if (st == CLMHA_UNSUPPORTED || st == CLMHA_BUILD_FAILED) {
        *why = "its kernels cannot be built for this head_dim on this device";
        return CLMHA_SUCCESS;
    }
    if (st) return st;
    const clmha_forward_args *a = call->args;
    if (!loops_fit(l, fb, call->dims, a->training && l->desc.dropout > 0.0f)) {
        *why = clmha__fused_backward_loop_why;
        return CLMHA_SUCCESS;
    }
    *yes = true;
    return CLMHA_SUCCESS;
}

// Enqueues one 2-D kernel over (ceil(rows / b) * b, planes) in groups of (b, 1).
static clmha_status launch_2d(clmha_context *ctx, cl_kernel k, const char *name, size_t rows,
                              size_t planes, size_t b, const arg *args, cl_uint nargs) {
    clmha_status st = clmha__set_args(ctx, k, name, args, nargs);
    if (st) return st;
    size_t global[2] = {(rows + b - 1) / b * b, planes}, local[2] = {b, 1};
    cl_int err = clEnqueueNDRangeKernel(ctx->queue, k, 2, NULL, global, local, 0, NULL, NULL);
    return err != CL_SUCCESS ? clmha__cl_fail(ctx, err, name) : CLMHA_SUCCESS;
}

// Drow = rowsum(dO * o) into the scratch, then dk and dv (one work-group per tile of key rows),
// then dq (one per tile of query rows). The kernels only read what the others write through
// the in-order queue.
clmha_status clmha__fused_backward_run(clmha_layer *l, clmha__backward_call *call) {
    clmha_context *ctx = l->ctx;
    const clmha__dims *d = call->dims;
    clmha__fused_backward *fb;
    clmha_status st = ensure(l, &fb);
    if (st) return st;
    size_t planes = d->n * l->h;
    cl_ulong rows = planes * d->l;
    if ((st = clmha__grow_buffer(ctx, &fb->drow_buf, &fb->drow_cap, rows ? rows : 1,
                                  "fused backward Drow")))
        return st;
    arg drow_args[] = {ARG(call->d_o), ARG(call->o), ARG(fb->drow_buf), ARG(rows)};
    if ((st = clmha__launch(ctx, fb->drow, "fused_backward_drow", rows, fb->b, drow_args,
                            sizeof drow_args / sizeof drow_args[0])))
        return st;

    cl_ulong tgt = d->l, heads = l->h, src = d->s, srcp = d->s_padded;
    float scale = (float)(1.0 / sqrt((double)l->d));
    clmha__mask_args m = clmha__masks_of(l, call->args, d);
    arg dkdv_args[] = {ARG(call->q),   ARG(call->k),   ARG(call->v),   ARG(call->d_o),
                       ARG(call->lse), ARG(fb->drow_buf), ARG(call->dk), ARG(call->dv),
                       ARG(tgt),       ARG(heads),     ARG(src),       ARG(srcp),
                       ARG(scale),     MASK_ARGS(m)};
    if ((st = launch_2d(ctx, fb->dkdv, "fused_backward_dkdv", d->s_padded, planes, fb->b,
                        dkdv_args, sizeof dkdv_args / sizeof dkdv_args[0])))
        return st;
    arg dq_args[] = {ARG(call->q),   ARG(call->k),      ARG(call->v),  ARG(call->d_o),
                     ARG(call->lse), ARG(fb->drow_buf), ARG(call->dq), ARG(tgt),
                     ARG(heads),     ARG(src),          ARG(srcp),     ARG(scale),
                     MASK_ARGS(m)};
    return launch_2d(ctx, fb->dq, "fused_backward_dq", d->l, planes, fb->b, dq_args,
                     sizeof dq_args / sizeof dq_args[0]);
}
