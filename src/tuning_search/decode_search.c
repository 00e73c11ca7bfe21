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

// Both cache lengths: the sum of the medians.
static bool split_time(clmha_layer *layer, const size_t split[2], const bench *b, size_t nb,
                       const float *q, float *y, int reps, double *ms) {
    clmha__decode_set_split(layer, split);
    *ms = 0.0;
    for (size_t i = 0; i < nb; ++i) {
        double t;
        if (!step_time(layer, &b[i], q, y, reps, &t)) return false;
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

// E. Candidates: work-items per compute unit from 1 to 64 on CPUs (16 to 1024 on GPUs), keys
// per range 16 to 512; candidates that give the same range counts at both cache lengths as one
// already timed are skipped. A candidate within 3% of the best so far is timed again in turn
// with the default; the best ratio to the default wins when it is below 0.97.
void clmha__tune_decode(clmha_context *ctx, uint64_t *rng, const clmha_tune_shape *shape,
                        double deadline, clmha__decode_result *res) {
    memset(res, 0, sizeof *res);
    size_t e = shape->embed_dim, h = shape->num_heads;
    clmha__random_layer rl = {0};
    bench b[2] = {{0}};
    size_t nb = 0;
    float *q = malloc(e * sizeof *q), *y = malloc(e * sizeof *y);
    if (!q || !y || now_s() > deadline || !clmha__random_layer_make(ctx, rng, e, h, &rl))
        goto done;
    clmha_layer *layer = rl.layer;
    for (size_t i = 0; i < e; ++i) q[i] = rand_unit(rng);
    static const size_t lengths[2] = {CLMHA__DECODE_TUNE_SHORT, CLMHA__DECODE_TUNE_LONG};
    for (; nb < 2; ++nb)
        if (!bench_make(&rl, rng, lengths[nb], q, y, &b[nb])) goto done;
    if (clmha_layer_set_profiling(layer, true)) goto done;

    // The default split first: the yardstick.
    size_t def[2], rows = h;  // N = 1, one query row: N·KV heads·L query-row groups
    clmha__decode_default_split(ctx, def);
    // A driver whose profiled times are all zero (rusticl on llvmpipe) cannot rank splits.
    if (now_s() > deadline || !split_time(layer, def, b, nb, q, y, 5, &res->default_ms) ||
        !(res->default_ms > 0))
        goto done;
    res->searched = true;
    res->best_ms = res->default_ms;
    memcpy(res->best, def, sizeof def);
    double best_ratio = 1.0, lead = res->default_ms;  // lead: the screening time to beat
    size_t timed[64][2], ntimed = 0;
    timed[ntimed][0] = clmha__decode_parts(ctx, def, rows, lengths[0]);
    timed[ntimed++][1] = clmha__decode_parts(ctx, def, rows, lengths[1]);
    static const size_t items_cpu[] = {1, 2, 4, 8, 16, 32, 64},
                        items_gpu[] = {16, 32, 64, 128, 256, 512, 1024},
                        keys[] = {16, 32, 64, 128, 256, 512};
    const size_t *items = ctx->cls->coalesced ? items_gpu : items_cpu;
    for (size_t a = 0; a < sizeof items_cpu / sizeof items_cpu[0]; ++a)
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; ++k) {
            if (now_s() > deadline) goto done;
            size_t split[2] = {items[a], keys[k]};
            size_t p0 = clmha__decode_parts(ctx, split, rows, lengths[0]),
                   p1 = clmha__decode_parts(ctx, split, rows, lengths[1]);
            bool seen = false;
            for (size_t i = 0; i < ntimed && !seen; ++i)
                seen = timed[i][0] == p0 && timed[i][1] == p1;
            if (seen || ntimed == sizeof timed / sizeof timed[0]) continue;
            timed[ntimed][0] = p0, timed[ntimed++][1] = p1;
            ++res->tried;
            double ms;
            if (!split_time(layer, split, b, nb, q, y, 3, &ms)) {
                ++res->rejected;
                continue;
            }
            // A lead must hold against the default timed in turn with it (the machine's speed
            // drifts): the medians of three rounds each.
            if (ms < lead * 1.03) {
                double d[3], c[3];
                int r = 0;
                for (; r < 3; ++r)
                    if (!split_time(layer, def, b, nb, q, y, 3, &d[r]) ||
                        !split_time(layer, split, b, nb, q, y, 3, &c[r]))
                        break;
                if (r < 3) continue;
                qsort(d, 3, sizeof d[0], cmp_double);
                qsort(c, 3, sizeof c[0], cmp_double);
                double ratio = c[1] / d[1];
                if (ratio < 0.97 && ratio < best_ratio) {
                    best_ratio = ratio, lead = ms;
                    res->default_ms = d[1], res->best_ms = c[1];
                    memcpy(res->best, split, sizeof split);
                    res->improved = true;
                }
            }
        }
done:
    for (size_t i = 0; i < 2; ++i) {  // a failed bench_make may leave either
        clmha_kv_cache_release(b[i].cache);
        free(b[i].ref);
    }
    clmha__random_layer_free(&rl);
    free(q), free(y);
}
