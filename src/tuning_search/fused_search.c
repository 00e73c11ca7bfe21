// The fused-tile search (see fused_search.h).
#define _POSIX_C_SOURCE 200809L

#include "tuning_search/fused_search.h"

#include "cores/fused.h"
#include "layer/layer.h"
#include "tuning_search/tuner_state.h"  // now_s, rand_unit
#include "tuning_search/random_layer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// The call every candidate is timed on: a random layer (profiling on), its input on the device,
// the double-precision reference output.
typedef struct fused_call {
    clmha__random_layer rl;
    clmha_forward_args args;  // the input in args.query (its buffer and its host copy)
    cl_mem qbuf, obuf;        // the input, the output
    float *x, *y;             // the input; the output read back
    double *ref;              // the reference output
    double scale;             // 1 + max |ref| (at least 1)
    size_t count;             // floats of the input and of the output
} fused_call;

// Makes @p fc for @p shape (the layer's parameters, then the input, drawn from @p rng). False
// when it could not be made; fused_call_free() frees what it made either way.
static bool fused_call_make(clmha_context *ctx, uint64_t *rng, const clmha_tune_shape *shape,
                            fused_call *fc) {
    size_t n = shape->batch, l = shape->tgt_len, e = shape->embed_dim, h = shape->num_heads;
    size_t count = fc->count = n * l * e;
    fc->x = malloc(count * sizeof *fc->x), fc->y = malloc(count * sizeof *fc->y);
    fc->ref = malloc(count * sizeof *fc->ref);
    if (!fc->x || !fc->y || !fc->ref || !clmha__random_layer_make(ctx, rng, e, h, &fc->rl))
        return false;
    for (size_t i = 0; i < count; ++i) fc->x[i] = rand_unit(rng);
    fc->args = (clmha_forward_args){.struct_size = sizeof fc->args,
                                    .query = {.ndim = 3, .shape = {l, n, e}, .data = fc->x},
                                    .impl = CLMHA_IMPL_FUSED};
    char msg[256];
    if (clmha_reference_forward(&fc->rl.desc, &fc->rl.rp, &fc->args, fc->ref, count, NULL, 0, msg,
                                sizeof msg))
        return false;
    fc->scale = 1.0;
    for (size_t i = 0; i < count; ++i) fc->scale = fmax(fc->scale, 1.0 + fabs(fc->ref[i]));
    cl_int err;
    fc->qbuf = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                              count * sizeof(float), fc->x, &err);
    clmha__held_new(CLMHA__HELD_MEM, fc->qbuf);
    if (err == CL_SUCCESS) {
        fc->obuf = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE, count * sizeof(float), NULL,
                                  &err);
        clmha__held_new(CLMHA__HELD_MEM, fc->obuf);
    }
    if (err != CL_SUCCESS) return false;
    fc->args.query.buffer = fc->qbuf;
    return !clmha_layer_set_profiling(fc->rl.layer, true);
}

static void fused_call_free(fused_call *fc) {
    clmha__release_mem(fc->qbuf);
    clmha__release_mem(fc->obuf);
    clmha__random_layer_free(&fc->rl);
    free(fc->x), free(fc->y), free(fc->ref);
}

// Times the fused stage of @p fc's layer on its call: one warm-up (builds, checks the output
// against the reference within 1e-4·(1 + max|ref|)), then @p reps profiled forwards.
static bool fused_time(const fused_call *fc, int reps, double *ms) {
    clmha_layer *layer = fc->rl.layer;
    if (clmha_layer_forward(layer, &fc->args, fc->obuf, 0, NULL, 0, 0, NULL, NULL) ||
        clEnqueueReadBuffer(layer->ctx->queue, fc->obuf, CL_TRUE, 0, fc->count * sizeof(float),
                            fc->y, 0, NULL, NULL) != CL_SUCCESS)
        return false;
    for (size_t i = 0; i < fc->count; ++i) {
        double e = fabs((double)fc->y[i] - fc->ref[i]);
        if (!(e <= 1e-4 * fc->scale)) return false;  // NaN fails too
    }
    double t[9];
    if (reps > 9) reps = 9;
    for (int r = 0; r < reps; ++r) {
        double stages[CLMHA_STAGE_COUNT];
        if (clmha_layer_forward(layer, &fc->args, fc->obuf, 0, NULL, 0, 0, NULL, NULL) ||
            clmha_layer_stage_times(layer, stages))
            return false;
        t[r] = stages[CLMHA_STAGE_FUSED];
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_double);
    *ms = t[reps / 2];
    return true;
}

static void set_best(clmha__fused_result *res, const clmha__fused_tiles *used) {
    res->best[0] = used->bq, res->best[1] = used->bk;
    res->best[2] = used->rpw, res->best[3] = used->vw;
}

// Times the candidate @p tiles (as the layer fits them) unless they come to the default
// @p def; records it in *res.
static void fused_try(fused_call *fc, const clmha__fused_tiles *tiles,
                      const clmha__fused_tiles *def, clmha__fused_result *res) {
    clmha__fused_tiles used;
    if (clmha__layer_set_fused_tiles(fc->rl.layer, tiles, &used)) {
        ++res->tried, ++res->rejected;
        return;
    }
    if (used.bq == def->bq && used.bk == def->bk && used.rpw == def->rpw && used.vw == def->vw)
        return;  // the default, timed before
    ++res->tried;
    double ms;
    if (!fused_time(fc, 3, &ms)) {
        ++res->rejected;
        return;
    }
    // A lead must hold in a second, longer timing.
    if (ms < res->best_ms && fused_time(fc, 5, &ms) && ms < 0.97 * res->best_ms) {
        res->best_ms = ms;
        set_best(res, &used);
        res->improved = true;
    }
}

// The candidates, in order, until @p deadline or @p max_tried of them (0: no limit). Tiled
// mapping: work-group sizes 32 to 128 (within the device limit), keys per tile 16 to 64, one or
// two rows per work-item, the device class's default vector width (CPUs: the native float
// width) or scalar.
static void fused_candidates(clmha_context *ctx, fused_call *fc, const clmha__fused_tiles *def,
                             double deadline, size_t max_tried, clmha__fused_result *res) {
    size_t vw = clmha__fused_default_vw(ctx);
    static const size_t bqs[] = {64, 32, 128}, bks[] = {32, 64, 16}, rpws[] = {2, 1};
    // The lanes mapping: one work-item per group (a tuning with bq > 1 is taken for the tiled
    // mapping's), 16 to 64 rows and 32 to 128 keys per tile, the native width only (its rows
    // are the vector lanes: scalar would be one row per vector).
    static const size_t lane_bqs[] = {1}, lane_bks[] = {64, 32, 128}, lane_rpws[] = {32, 64, 16};
    bool lanes = def->lanes;
    const size_t *cand_bq = lanes ? lane_bqs : bqs, *cand_bk = lanes ? lane_bks : bks,
                 *cand_rpw = lanes ? lane_rpws : rpws;
    size_t n_bq = lanes ? 1 : 3, n_rpw = lanes ? 3 : 2;
    size_t vws[2] = {vw > 16 ? 16 : vw, 1};
    size_t n_vw = vws[0] > 1 && !lanes ? 2 : 1;
    for (size_t a = 0; a < n_bq; ++a)
        for (size_t b = 0; b < 3; ++b)
            for (size_t c = 0; c < n_rpw; ++c)
                for (size_t v = 0; v < n_vw; ++v) {
                    if ((max_tried && res->tried >= max_tried) || now_s() > deadline) return;
                    clmha__fused_tiles tiles = {.bq = cand_bq[a], .bk = cand_bk[b],
                                                .rpw = cand_rpw[c], .vw = vws[v]};
                    if (tiles.bq > ctx->max_work_group) continue;
                    fused_try(fc, &tiles, def, res);
                }
}

// D. The fused attention kernel's tiles on the first layer shape (self-attention, random
// parameters and inputs): every candidate must reproduce the double-precision reference's
// output; the fastest fused stage wins. The default tiles are timed first: the yardstick. A
// driver whose profiled times are zero (rusticl on llvmpipe) cannot rank tiles: not searched.
void clmha__tune_fused(clmha_context *ctx, uint64_t *rng, const clmha_tune_shape *shape,
                       double deadline, size_t max_tried, clmha__fused_result *res) {
    memset(res, 0, sizeof *res);
    size_t n = shape->batch, l = shape->tgt_len, e = shape->embed_dim;
    res->flops = 4.0 * (double)n * (double)l * (double)l * (double)e;
    fused_call fc = {0};
    if (fused_call_make(ctx, rng, shape, &fc)) {
        clmha__fused_tiles def = clmha__fused_tiles_for(ctx, fc.rl.layer->d), used;
        if (!clmha__layer_set_fused_tiles(fc.rl.layer, &def, &used) &&
            fused_time(&fc, 5, &res->default_ms) && res->default_ms > 0) {
            res->searched = true;
            res->best_ms = res->default_ms;
            set_best(res, &used);
            fused_candidates(ctx, &fc, &def, deadline, max_tried, res);
        }
    }
    fused_call_free(&fc);
}
