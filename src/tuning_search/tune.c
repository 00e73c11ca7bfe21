// clmha_context_tune(): the tuner's orchestration. It checks the options, sets up the GEMM
// shapes of the layer shapes, runs the GEMM search (gemm_search.c), applies and stores what it
// found through the tuning store, then searches the fused kernel's tiles (fused_search.c) and
// the decode core's split of the keys (decode_search.c), stores those too, and fills the
// report.
#define _POSIX_C_SOURCE 200809L

#include "base/struct_in.h"
#include "tuning_search/decode_search.h"
#include "tuning_search/fused_search.h"
#include "tuning_search/gemm_search.h"
#include "tuning_search/gemm_timing.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void add_shape(tuner *T, const char *label, size_t m, size_t n, size_t k, size_t batch,
                      bool tb) {
    gshape *s = &T->shapes[T->nshapes++];
    memset(s, 0, sizeof *s);
    snprintf(s->label, sizeof s->label, "%s", label);
    s->m = m, s->n = n, s->k = k, s->batch = batch, s->tb = tb;
}

static clmha_status check_options(clmha_context *ctx, const clmha_tune_options *o) {
    if (!o) return CLMHA_SUCCESS;
    if (!(o->budget_seconds >= 0) || o->budget_seconds > 86400)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "budget_seconds must be from 0 (default) to 86400 (got %g)",
                           o->budget_seconds);
    if (o->num_shapes > MAX_LAYERS)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "num_shapes is %zu, at most %d are tuned",
                           o->num_shapes, MAX_LAYERS);
    if (o->num_shapes && !o->shapes)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "shapes is NULL, num_shapes %zu",
                           o->num_shapes);
    for (size_t i = 0; i < o->num_shapes; ++i) {
        const clmha_tune_shape *s = &o->shapes[i];
        if (!s->batch || !s->tgt_len || !s->embed_dim || !s->num_heads ||
            s->embed_dim % s->num_heads)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "shapes[%zu] = (N %zu, L %zu, E %zu, H %zu): every size must be "
                               "positive and E a multiple of H",
                               i, s->batch, s->tgt_len, s->embed_dim, s->num_heads);
        // The largest tuning matrix: scores (N·H, L, L), and the projection (N·L, 3E).
        double scores = (double)s->batch * (double)s->num_heads * (double)s->tgt_len *
                        (double)s->tgt_len;
        double proj = (double)s->batch * (double)s->tgt_len * 3.0 * (double)s->embed_dim;
        if (scores > 128.0 * 1048576 || proj > 128.0 * 1048576 || s->embed_dim > 65536)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "shapes[%zu] = (N %zu, L %zu, E %zu, H %zu) is too large to tune "
                               "on (at most 2^27 elements per matrix)",
                               i, s->batch, s->tgt_len, s->embed_dim, s->num_heads);
    }
    return CLMHA_SUCCESS;
}

// The tuning in effect when the run starts and what is put back when nothing faster is found.
typedef struct start_state {
    bool before_known;       // the registry has a tuning for the device
    clmha__tuning before;    // that tuning
    clmha__tuning fallback;  // `before`, else CLBlast's generic parameters, kernel by kernel
} start_state;

// The tuning in effect before: the registry's, else CLBlast's generic parameters (what a
// device without a database entry of its own gets; see the limitation in clmha.h).
static void read_start(clmha_context *ctx, start_state *s) {
    clmha__tuning_meta before_meta;
    s->before_known = clmha__tuning_current(ctx->device, &s->before, &before_meta);
    s->fallback = clmha__tuning_clblast_generic;
    if (!s->before_known) return;
    if (s->before.has_xgemm)
        memcpy(s->fallback.xgemm, s->before.xgemm, sizeof s->fallback.xgemm);
    if (s->before.has_direct)
        memcpy(s->fallback.direct, s->before.direct, sizeof s->fallback.direct);
    if (s->before.has_routine) s->fallback.min_indirect = s->before.min_indirect;
}

// The shapes: 1024³, then for each layer its packed QKV projection, output projection, QKᵀ
// and A·V (the GEMMs of one self-attention forward pass); the odd-sized correctness GEMMs.
// layers[0] gets the first layer shape.
static clmha_status setup_shapes(tuner *T, const clmha_tune_options *options,
                                 clmha_tune_shape *layers, clmha_tune_report *rep) {
    size_t nlayers = options && options->num_shapes ? options->num_shapes : 1;
    if (options && options->num_shapes)
        memcpy(layers, options->shapes, nlayers * sizeof layers[0]);
    else
        layers[0] = (clmha_tune_shape){.batch = 8, .tgt_len = 128, .embed_dim = 512,
                                       .num_heads = 8};
    add_shape(T, "sgemm 1024^3", 1024, 1024, 1024, 0, true);
    for (size_t i = 0; i < nlayers; ++i) {
        const clmha_tune_shape *l = &layers[i];
        size_t rows = l->batch * l->tgt_len, e = l->embed_dim, d = e / l->num_heads;
        size_t bh = l->batch * l->num_heads, L = l->tgt_len;
        char label[64];
        snprintf(label, sizeof label, "QKV projection (%zu, %zu, %zu)", rows, 3 * e, e);
        add_shape(T, label, rows, 3 * e, e, 0, true);
        snprintf(label, sizeof label, "output projection (%zu, %zu, %zu)", rows, e, e);
        add_shape(T, label, rows, e, e, 0, true);
        snprintf(label, sizeof label, "QK^T %zu x (%zu, %zu, %zu)", bh, L, L, d);
        add_shape(T, label, L, L, d, bh, true);
        snprintf(label, sizeof label, "AV %zu x (%zu, %zu, %zu)", bh, L, d, L);
        add_shape(T, label, L, d, L, bh, false);
    }
    snprintf(rep->layer, sizeof rep->layer, "%zu,%zu,%zu,%zu", layers[0].batch,
             layers[0].tgt_len, layers[0].embed_dim, layers[0].num_heads);
    T->checks[0] = (gshape){.label = "check sgemm NT (150, 97, 83)", .m = 150, .n = 97, .k = 83,
                            .tb = true};
    T->checks[1] = (gshape){.label = "check sgemm NN (75, 130, 61)", .m = 75, .n = 130, .k = 61};
    T->checks[2] = (gshape){.label = "check batched NT 3 x (37, 70, 19)", .m = 37, .n = 70,
                            .k = 19, .batch = 3, .tb = true};
    T->checks[3] = (gshape){.label = "check batched NN 3 x (70, 29, 45)", .m = 70, .n = 29,
                            .k = 45, .batch = 3};
    clmha_status st = CLMHA_SUCCESS;
    for (size_t i = 0; i < T->nshapes && !st; ++i) st = clmha__tuner_shape_alloc(T, &T->shapes[i]);
    T->nchecks = 4;
    for (size_t i = 0; i < T->nchecks && !st; ++i) st = clmha__tuner_shape_alloc(T, &T->checks[i]);
    return st;
}

static void fill_report(const tuner *T, clmha_tune_report *rep) {
    const gshape *g = &T->shapes[0], *proj = &T->shapes[1];
    rep->default_gflops = g->before > 0 ? flops(g) / g->before / 1e9 : 0;
    rep->tuned_gflops = g->after > 0 ? flops(g) / g->after / 1e9 : rep->default_gflops;
    rep->default_layer_gflops = proj->before > 0 ? flops(proj) / proj->before / 1e9 : 0;
    rep->tuned_layer_gflops =
        proj->after > 0 ? flops(proj) / proj->after / 1e9 : rep->default_layer_gflops;
    double fb = 0, fa = 0, tb = 0, ta = 0;
    for (size_t i = 1; i < T->nshapes; ++i) {
        const gshape *s = &T->shapes[i];
        fb += flops(s), tb += s->before;
        fa += flops(s), ta += s->after > 0 ? s->after : s->before;
    }
    rep->default_forward_gemm_gflops = tb > 0 ? fb / tb / 1e9 : 0;
    rep->tuned_forward_gemm_gflops = ta > 0 ? fa / ta / 1e9 : 0;
    rep->candidates = T->tried;
    rep->rejected = T->rejected;
    rep->seconds = elapsed(T);
}

// Names the device's tuning file in rep->path and, unless the options say no_store, writes
// @p t there (rep->stored; rep->message says why not). Fails only when out of memory.
static clmha_status store(tuner *T, const clmha__tuning *t, const clmha__tuning_meta *meta,
                          clmha_tune_report *rep) {
    clmha_context *ctx = T->ctx;
    char msg[1024];
    if (clmha__tuning_path(&T->tg, rep->path, sizeof rep->path, msg, sizeof msg)) {
        rep->path[0] = '\0';
        snprintf(rep->message, sizeof rep->message, "tuning applied but not stored: %.440s", msg);
        return CLMHA_SUCCESS;
    }
    if (T->opts && T->opts->no_store) return CLMHA_SUCCESS;
    char *text = clmha__tuning_to_json(&T->tg, t, meta);
    if (!text) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    if (clmha__tuning_write_file(rep->path, text, msg, sizeof msg)) {
        rep->stored = false;
        snprintf(rep->message, sizeof rep->message, "tuning applied but not stored: %.440s", msg);
    } else {
        rep->stored = true;
        rep->message[0] = '\0';
        clmha__tuning_set_note(ctx->device, "tuned in this process, stored in %s", rep->path);
    }
    free(text);
    return CLMHA_SUCCESS;
}

// Nothing faster: what was in effect is put back and the report says why.
static void keep_before(tuner *T, const start_state *s, const gemm_outcome *g,
                        clmha_tune_report *rep) {
    for (size_t i = 0; i < T->nshapes; ++i) T->shapes[i].after = 0;
    if (T->overridden) {  // back to what was in effect
        clmha__tuning_override(&T->tg, &s->fallback);
        if (!s->before_known)
            clmha__tuning_set_note(T->ctx->device, "a tuning run found nothing faster; "
                                                   "CLBlast's generic parameters are in effect");
    }
    // Why: no candidate timed; all of them rejected; the winner failed the final check (each
    // with the last failure's message); else none was faster (or each was cut after two runs,
    // over 2.5 times slower: gemm_search.c).
    bool ran = g->have_x || g->have_d;
    bool none = !ran && T->tried == 0, all_bad = !ran && T->tried && T->rejected == T->tried;
    bool failed = all_bad || (ran && !g->final_ok);
    snprintf(rep->message, sizeof rep->message, "%s%s%.400s",
             none      ? "the budget ran out before a candidate was timed"
             : all_bad ? "every candidate failed to build, run or check"
             : failed  ? "the chosen parameters failed the final check"
                       : "no candidate was faster than the current parameters",
             T->msg[0] && failed ? ": " : "", T->msg[0] && failed ? T->msg : "");
    if (s->before_known) clmha__tuning_format(&s->before, rep->parameters, sizeof rep->parameters);
}

// The GEMM parameters found: applied to the device (registry included) and stored.
static clmha_status apply_gemm(tuner *T, const gemm_outcome *g, clmha_tune_report *rep) {
    rep->improved = true;
    fill_report(T, rep);
    clmha__tuning_meta meta = {.default_gflops = rep->default_gflops,
                               .tuned_gflops = rep->tuned_gflops,
                               .default_layer_gflops = rep->default_layer_gflops,
                               .tuned_layer_gflops = rep->tuned_layer_gflops,
                               .seconds = rep->seconds,
                               .candidates = T->tried};
    snprintf(meta.layer, sizeof meta.layer, "%s", rep->layer);
    clmha__tuning_utc_now(meta.date, sizeof meta.date);
    clmha__tuning_format(&g->final, rep->parameters, sizeof rep->parameters);
    clmha_status st =
        clmha__tuning_apply(&T->tg, &g->final, &meta, CLMHA_TUNING_SOURCE_TUNED,
                            "tuned in this process (not stored)");
    return st ? st : store(T, &g->final, &meta, rep);
}

// Applies @p part (the fused tiles or the decode split: what a later phase found) over the
// tuning in effect and stores the result with the GEMM figures of the file.
static clmha_status join_and_store(tuner *T, const clmha__tuning *part, clmha_tune_report *rep) {
    clmha_context *ctx = T->ctx;
    clmha__tuning now;
    clmha__tuning_meta meta = {0};
    clmha__tuning_current(ctx->device, &now, &meta);  // keeps the GEMM figures of the file
    if (!meta.date[0]) clmha__tuning_utc_now(meta.date, sizeof meta.date);
    clmha_status st = clmha__tuning_apply(&T->tg, part, &meta, CLMHA_TUNING_SOURCE_TUNED,
                                          "tuned in this process (not stored)");
    if (st || !clmha__tuning_current(ctx->device, &now, &meta)) return st;
    rep->improved = true;
    clmha__tuning_format(&now, rep->parameters, sizeof rep->parameters);
    return store(T, &now, &meta, rep);
}

// D. The fused attention kernel's tiles, until @p deadline; faster tiles join the tuning in
// effect and are stored with it.
static clmha_status phase_fused(tuner *T, const clmha_tune_shape *shape, double budget,
                                double deadline, clmha_tune_report *rep) {
    clmha_context *ctx = T->ctx;
    const clmha_tune_options *o = T->opts;
    if (o && o->progress)
        o->progress(fmin(1.0, elapsed(T) / budget), "timing fused attention tiles", o->user_data);
    clmha__fused_result fr;
    clmha__tune_fused(ctx, &T->rng, shape, deadline, o ? o->max_candidates : 0, &fr);
    T->tried += fr.tried;
    T->rejected += fr.rejected;
    if (fr.searched) {
        rep->default_fused_gflops = fr.flops / fr.default_ms / 1e6;
        rep->tuned_fused_gflops = fr.flops / fr.best_ms / 1e6;
    }
    clmha__tuner_trace(T, "fused tiles: %zu tried, %zu rejected, %s", fr.tried, fr.rejected,
                       fr.improved    ? "faster tiles found"
                       : fr.searched  ? "the defaults kept"
                                      : "not searched (the defaults failed, or no profiled time)");
    if (!fr.improved) return CLMHA_SUCCESS;
    clmha__tuning ft = {.has_fused = true};
    memcpy(ft.fused, fr.best, sizeof ft.fused);
    return join_and_store(T, &ft, rep);
}

// E. The decode core's split of the keys, with what is left of the whole budget; a faster
// split joins the tuning in effect and is stored with it.
static clmha_status phase_decode(tuner *T, const clmha_tune_shape *shape, double budget,
                                 clmha_tune_report *rep) {
    const clmha_tune_options *o = T->opts;
    if (o && o->progress)
        o->progress(fmin(1.0, elapsed(T) / budget), "timing the decode split", o->user_data);
    clmha__decode_result dr;
    clmha__tune_decode(T->ctx, &T->rng, shape, T->start + budget, o ? o->max_candidates : 0,
                       &dr);
    T->tried += dr.tried;
    T->rejected += dr.rejected;
    if (dr.searched) {
        rep->default_decode_ms = dr.default_ms;
        rep->tuned_decode_ms = dr.best_ms;
    }
    clmha__tuner_trace(T, "decode split: %zu tried, %zu rejected, %s (ITEMS_PER_CU=%zu "
                       "MIN_KEYS=%zu, %.3f ms against %.3f)",
                       dr.tried, dr.rejected,
                       !dr.searched ? "not timed" : dr.improved ? "a faster split found"
                                                                : "the default kept",
                       dr.best[0], dr.best[1], dr.best_ms, dr.default_ms);
    if (!dr.improved) return CLMHA_SUCCESS;
    clmha__tuning dt = {.has_decode = true};
    memcpy(dt.decode, dr.best, sizeof dt.decode);
    return join_and_store(T, &dt, rep);
}

// The tuner, its budget split between the GEMM phases and the fused tiles (phase D).
static tuner *new_tuner(clmha_context *ctx, const clmha_tune_options *options, double *budget) {
    tuner *T = calloc(1, sizeof *T);
    if (!T) return NULL;
    T->ctx = ctx;
    T->tg = clmha__context_tuning_target(ctx);
    T->opts = options;
    T->start = now_s();
    *budget = options && options->budget_seconds > 0 ? options->budget_seconds : 300;
    // The GEMM phases get the budget but what the fused tiles and the decode split take at
    // the end (phases D and E).
    double fused_reserve = fmin(60.0, 0.2 * *budget);
    T->decode_reserve = fmin(30.0, 0.1 * *budget);
    T->budget = *budget - fused_reserve - T->decode_reserve;
    T->rng = 0x9E3779B97F4A7C15ull;
    return T;
}

clmha_status clmha_context_tune(clmha_context *ctx, const clmha_tune_options *options,
                                clmha_tune_report *report) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    clmha_tune_options opts_in;  // the caller's options in this library's layout (docs/abi.md)
    char why[512];
    clmha_status st = options ? CLMHA__STRUCT_IN(clmha_tune_options, &opts_in, options,
                                                 "options", why, sizeof why)
                              : CLMHA_SUCCESS;
    if (!st && report)
        st = CLMHA__STRUCT_OUT_CHECK(clmha_tune_report, report, "report", why, sizeof why);
    if (st) return clmha__fail(ctx, st, "%s", why);
    if (options) options = &opts_in;
    st = check_options(ctx, options);
    if (st) return st;
    clmha_tune_report rep;
    memset(&rep, 0, sizeof rep);
    double budget;
    tuner *T = new_tuner(ctx, options, &budget);
    if (!T) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    start_state start;
    read_start(ctx, &start);
    clmha_tune_shape layers[MAX_LAYERS];
    gemm_outcome g;
    st = setup_shapes(T, options, layers, &rep);
    // A context whose products run in the host BLAS (clmha_context_gemm()) never uses
    // CLBlast's GEMM parameters: the whole budget goes to the fused tiles and the decode
    // split.
    bool host_gemm = clmha_context_gemm(ctx) == CLMHA_GEMM_HOST;
    if (!st && !host_gemm)
        st = clmha__gemm_search(T, &start.fallback, start.before_known ? &start.before : NULL,
                                &g);
    if (st) goto done;
    if (host_gemm) {
        snprintf(rep.message, sizeof rep.message,
                 "CLBlast's GEMMs not searched: this context runs its products in the host "
                 "BLAS (CLMHA_GEMM=clblast to tune them)");
    } else if (g.improved) {
        st = apply_gemm(T, &g, &rep);
    } else {
        keep_before(T, &start, &g, &rep);
    }
    if (!st) st = phase_fused(T, &layers[0], budget, T->start + budget - T->decode_reserve, &rep);
    if (!st) st = phase_decode(T, &layers[0], budget, &rep);
    fill_report(T, &rep);
    if (!rep.improved) {
        rep.tuned_gflops = rep.default_gflops;
        rep.tuned_layer_gflops = rep.default_layer_gflops;
        rep.tuned_forward_gemm_gflops = rep.default_forward_gemm_gflops;
    }
    if (options && options->progress) options->progress(1.0, "done", options->user_data);
done:
    for (size_t i = 0; i < T->nshapes; ++i) clmha__tuner_shape_free(&T->shapes[i]);
    for (size_t i = 0; i < T->nchecks; ++i) clmha__tuner_shape_free(&T->checks[i]);
    if (st && T->overridden) clmha__tuning_override(&T->tg, &start.fallback);  // failed: undo
    free(T);
    if (report) clmha__struct_out(report, &rep, sizeof rep);  // no byte past its struct_size
    return st;
}
