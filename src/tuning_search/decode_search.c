// The decode-split search (see decode_search.h).
#define _POSIX_C_SOURCE 200809L

#include "tuning_search/decode_search.h"

#include "cores/decode.h"
#include "layer/layer.h"
#include "tuning_search/tuner_state.h"  // now_s, rand_unit
#include "tuning_search/random_layer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// One cache length: its cache (filled once), the query and the reference output of one step.
typedef struct bench {
    size_t s;           // keys in the cache
    clmha_kv_cache *cache;
    double ref_scale;   // 1 + max |ref|
    double *ref;        // E doubles: the query row's output over the s keys
} bench;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// Times one decode step (the query over the whole cache, kv_attend_only) on @p b: one call
// whose output must match the reference within 1e-4 (1 + max |ref|), then @p reps profiled
// calls; *ms is the median of their decode stage.
static bool step_time(clmha_layer *layer, const bench *b, const float *q, float *y, int reps,
                      double *ms) {
    size_t e = layer->desc.embed_dim;
    clmha_forward_args a = {.struct_size = sizeof a, .kv_cache = b->cache, .kv_attend_only = true,
                            .query = {.ndim = 3, .shape = {1, 1, e}, .data = q}};
    if (clmha_layer_forward_host(layer, &a, y, e, NULL, 0)) return false;
    for (size_t i = 0; i < e; ++i)
        if (!(fabs((double)y[i] - b->ref[i]) <= 1e-4 * b->ref_scale)) return false;  // NaN too
    double t[9];
    if (reps > 9) reps = 9;
    for (int r = 0; r < reps; ++r) {
        double stages[CLMHA_STAGE_COUNT];
        if (clmha_layer_forward_host(layer, &a, y, e, NULL, 0) ||
            clmha_layer_stage_times(layer, stages))
            return false;
        t[r] = stages[CLMHA_STAGE_FUSED];
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_double);
    *ms = t[reps / 2];
    return true;
}

// The cache lengths every split is timed at.
static const size_t lengths[2] = {CLMHA__DECODE_TUNE_SHORT, CLMHA__DECODE_TUNE_LONG};

// The step every split is timed on: a random layer (profiling on), the query row, a cache per
// length.
typedef struct decode_call {
    clmha__random_layer rl;
    float *q, *y;   // the query row (E floats), the output row
    bench b[2];     // one per length
    size_t nb;      // those made
} decode_call;

// Both cache lengths of @p dc with @p split: the sum of the medians.
static bool split_time(decode_call *dc, const size_t split[2], int reps, double *ms) {
    clmha_layer *layer = dc->rl.layer;
    clmha__decode_set_split(layer, split);
    *ms = 0.0;
    for (size_t i = 0; i < dc->nb; ++i) {
        double t;
        if (!step_time(layer, &dc->b[i], dc->q, dc->y, reps, &t)) return false;
        *ms += t;
    }
    return true;
}

// Fills @p b's cache with @p s random keys and values (one call, its output not checked) and
// computes the reference of the query over them.
static bool bench_make(const clmha__random_layer *rl, uint64_t *rng, size_t s, const float *q,
                       float *y, bench *b) {
    clmha_layer *layer = rl->layer;
    size_t e = rl->desc.embed_dim;
    memset(b, 0, sizeof *b);
    b->s = s;
    float *kv = malloc(s * e * sizeof *kv);
    b->ref = malloc(e * sizeof *b->ref);
    if (!kv || !b->ref) {
        free(kv);
        return false;
    }
    for (size_t i = 0; i < s * e; ++i) kv[i] = rand_unit(rng);
    clmha_forward_args a = {.struct_size = sizeof a,
                            .query = {.ndim = 3, .shape = {1, 1, e}, .data = q},
                            .key = {.ndim = 3, .shape = {s, 1, e}, .data = kv},
                            .value = {.ndim = 3, .shape = {s, 1, e}, .data = kv}};
    char msg[256];
    bool ok = clmha_reference_forward(&rl->desc, &rl->rp, &a, b->ref, e, NULL, 0, msg,
                                      sizeof msg) == CLMHA_SUCCESS;
    ok = ok && clmha_kv_cache_create(&b->cache, layer, 1, s) == CLMHA_SUCCESS;
    a.kv_cache = b->cache;
    ok = ok && clmha_layer_forward_host(layer, &a, y, e, NULL, 0) == CLMHA_SUCCESS;
    free(kv);
    b->ref_scale = 1.0;
    for (size_t i = 0; ok && i < e; ++i) b->ref_scale = fmax(b->ref_scale, 1.0 + fabs(b->ref[i]));
    return ok;
}

// Makes @p dc for @p shape (the layer's parameters, the query, then the caches, drawn from
// @p rng), unless @p deadline has passed. False when it could not be made; decode_call_free()
// frees what it made either way.
static bool decode_call_make(clmha_context *ctx, uint64_t *rng, const clmha_tune_shape *shape,
                             double deadline, decode_call *dc) {
    size_t e = shape->embed_dim, h = shape->num_heads;
    dc->q = malloc(e * sizeof *dc->q), dc->y = malloc(e * sizeof *dc->y);
    if (!dc->q || !dc->y || now_s() > deadline ||
        !clmha__random_layer_make(ctx, rng, e, h, &dc->rl))
        return false;
    for (size_t i = 0; i < e; ++i) dc->q[i] = rand_unit(rng);
    for (; dc->nb < 2; ++dc->nb)
        if (!bench_make(&dc->rl, rng, lengths[dc->nb], dc->q, dc->y, &dc->b[dc->nb]))
            return false;
    return !clmha_layer_set_profiling(dc->rl.layer, true);
}

static void decode_call_free(decode_call *dc) {
    for (size_t i = 0; i < 2; ++i) {  // a failed bench_make may leave either
        clmha_kv_cache_release(dc->b[i].cache);
        free(dc->b[i].ref);
    }
    clmha__random_layer_free(&dc->rl);
    free(dc->q), free(dc->y);
}

// Where the search stands.
typedef struct search {
    size_t def[2];            // the default split
    size_t rows;              // N·KV heads·L query-row groups (N = 1, one query row)
    double best_ratio, lead;  // the best candidate's ratio to the default; its screening time
    size_t timed[64][2], ntimed;  // the range counts (at both lengths) of the splits timed
} search;

// Whether @p split gives range counts at both cache lengths that no split timed so far gave
// (and there is room to note them): then they are noted.
static bool new_parts(clmha_context *ctx, search *sr, const size_t split[2]) {
    size_t p0 = clmha__decode_parts(ctx, split, sr->rows, lengths[0]),
           p1 = clmha__decode_parts(ctx, split, sr->rows, lengths[1]);
    bool seen = false;
    for (size_t i = 0; i < sr->ntimed && !seen; ++i)
        seen = sr->timed[i][0] == p0 && sr->timed[i][1] == p1;
    if (seen || sr->ntimed == sizeof sr->timed / sizeof sr->timed[0]) return false;
    sr->timed[sr->ntimed][0] = p0, sr->timed[sr->ntimed++][1] = p1;
    return true;
}

// A lead (@p split, screened at @p ms) must hold against the default timed in turn with it
// (the machine's speed drifts): the medians of three rounds each.
static void confirm(decode_call *dc, search *sr, const size_t split[2], double ms,
                    clmha__decode_result *res) {
    double d[3], c[3];
    for (int r = 0; r < 3; ++r)
        if (!split_time(dc, sr->def, 3, &d[r]) || !split_time(dc, split, 3, &c[r])) return;
    qsort(d, 3, sizeof d[0], cmp_double);
    qsort(c, 3, sizeof c[0], cmp_double);
    double ratio = c[1] / d[1];
    if (ratio < 0.97 && ratio < sr->best_ratio) {
        sr->best_ratio = ratio, sr->lead = ms;
        res->default_ms = d[1], res->best_ms = c[1];
        memcpy(res->best, split, 2 * sizeof split[0]);
        res->improved = true;
    }
}

// The candidates, in order, until @p deadline or @p max_tried of them (0: no limit).
static void candidates(clmha_context *ctx, decode_call *dc, search *sr, double deadline,
                       size_t max_tried, clmha__decode_result *res) {
    static const size_t items_cpu[] = {1, 2, 4, 8, 16, 32, 64},
                        items_gpu[] = {16, 32, 64, 128, 256, 512, 1024},
                        keys[] = {16, 32, 64, 128, 256, 512};
    const size_t *items = ctx->cls->coalesced ? items_gpu : items_cpu;
    for (size_t a = 0; a < sizeof items_cpu / sizeof items_cpu[0]; ++a)
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; ++k) {
            if ((max_tried && res->tried >= max_tried) || now_s() > deadline) return;
            size_t split[2] = {items[a], keys[k]};
            if (!new_parts(ctx, sr, split)) continue;
            ++res->tried;
            double ms;
            if (!split_time(dc, split, 3, &ms)) {
                ++res->rejected;
                continue;
            }
            if (ms < sr->lead * 1.03) confirm(dc, sr, split, ms, res);
        }
}

// E. Candidates: work-items per compute unit from 1 to 64 on CPUs (16 to 1024 on GPUs), keys
// per range 16 to 512; candidates that give the same range counts at both cache lengths as one
// already timed are skipped. A candidate within 3% of the best so far is timed again in turn
// with the default; the best ratio to the default wins when it is below 0.97. The default split
// is timed first: the yardstick.
void clmha__tune_decode(clmha_context *ctx, uint64_t *rng, const clmha_tune_shape *shape,
                        double deadline, size_t max_tried, clmha__decode_result *res) {
    memset(res, 0, sizeof *res);
    decode_call dc = {0};
    search sr = {.rows = shape->num_heads, .best_ratio = 1.0};
    if (decode_call_make(ctx, rng, shape, deadline, &dc)) {
        clmha__decode_default_split(ctx, sr.def);
        // A driver whose profiled times are all zero (rusticl on llvmpipe) cannot rank splits.
        if (now_s() <= deadline && split_time(&dc, sr.def, 5, &res->default_ms) &&
            res->default_ms > 0) {
            res->searched = true;
            res->best_ms = sr.lead = res->default_ms;
            memcpy(res->best, sr.def, sizeof sr.def);
            new_parts(ctx, &sr, sr.def);  // the default's range counts: timed
            candidates(ctx, &dc, &sr, deadline, max_tried, res);
        }
    }
    decode_call_free(&dc);
}
