// The fused attention core: scores, masks, softmax, dropout and weights·V in one kernel
// (cl/cores/fused.cl) that streams tiles of keys through local memory and never stores the
// scores. Everything of it is here: its tiles (the device class's defaults or a stored
// tuning, fitted to the device), the build that refits them to what the built kernel allows,
// the loop budget of drivers that end long loops, the rebuild the tuner asks for, and the
// launch, and its per-layer state. It returns no weights: calls that ask for them run the
// unfused core. It reads head tiles, or the projected rows where the forward pass offers them
// (clmha__core::reads_rows), writing merged rows then.
#include "cores/fused.h"

#include "cores/block_mask.h"
#include "cores/core.h"
#include "cores/fused_backward.h"
#include "cores/kernel_args.h"
#include "device/held.h"
#include "layer/mods.h"
#include "tuning_store/store.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef clmha__arg arg;
#define ARG CLMHA__ARG
#define MASK_ARGS CLMHA__MASK_ARGS

// ---- state --------------------------------------------------------------------------------------

CLMHA__HIDDEN extern const clmha__core clmha__core_fused;  // this core, at the end of this file

// The core's state in a layer: made with the layer, the kernel built on first use.
typedef struct state {
    cl_kernel kernel;          // built on first use (clmha__layer_fused())
    clmha__fused_tiles tiles;  // what it was built with
    clmha_status failed;       // why it cannot be built here (then not retried)
    clmha__fused_backward *backward;  // the backward pass's (fused_backward.c), on first use
    clmha__block_mask blocks;  // with clmha_mask_mod: the tiles it forbids (block_mask.c)
} state;

static state *state_of(const clmha_layer *l) {
    return clmha__core_state(l, &clmha__core_fused);
}

static clmha_status create(clmha_layer *l, void **out) {
    *out = calloc(1, sizeof(state));
    return *out ? CLMHA_SUCCESS : clmha__fail(l->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
}

static void release(void *p) {
    state *s = p;
    if (!s) return;
    clmha__release_kernel(s->kernel);
    clmha__fused_backward_release(s->backward);
    clmha__block_mask_release(&s->blocks);
    free(s);
}

cl_kernel clmha__fused_kernel(const clmha_layer *layer) { return state_of(layer)->kernel; }

size_t clmha__fused_backward_tile(const clmha_layer *layer) {
    return clmha__fused_backward_rows(state_of(layer)->backward);
}

clmha__fused_tiles clmha__fused_tiles_of(const clmha_layer *layer) {
    return state_of(layer)->tiles;
}

bool clmha__fused_ran(const clmha_layer *layer) {
    return layer->last_core == &clmha__core_fused;
}

// ---- tiles --------------------------------------------------------------------------------------

clmha__fused_tiles clmha__fused_tiles_for(const clmha_context *ctx, size_t hd) {
    // The device class's defaults (src/device/device_class.c), unless a stored tuning has its
    // own.
    const clmha__device_class *cls = ctx->cls;
    size_t pref_tiles[CLMHA__FUSED_PARAMS] = {0};  // BQ, BK, RPW, VW of a stored tuning
    clmha__tuning_fused(ctx->device, pref_tiles);
    // A tuning stored for the tiled mapping (bq > 1; the lanes search keeps bq 1) does not
    // carry over to a class of the lanes mapping: its one or two rows per work-item would fill
    // a sixteenth of each vector.
    if (cls->lanes && pref_tiles[0] > 1) memset(pref_tiles, 0, sizeof pref_tiles);
    clmha__fused_tiles t = {.bq = pref_tiles[0] ? pref_tiles[0] : cls->bq,
                            .bk = pref_tiles[1] ? pref_tiles[1] : cls->bk,
                            .rpw = pref_tiles[2] ? pref_tiles[2] : cls->rpw,
                            .vw = pref_tiles[3] ? pref_tiles[3] : clmha__fused_default_vw(ctx)};
    clmha__fused_tiles_fit(ctx, hd, &t);
    return t;
}

void clmha__fused_tiles_fit(const clmha_context *ctx, size_t hd, clmha__fused_tiles *t) {
    clmha__fused_tiles_fit_limits(ctx->cls, clmha__local_mem(ctx), ctx->max_work_group, hd, t);
    if (ctx->quirks.no_vload) t->vw = 1;  // Clover aborts on vloadN (tools/driver-bugs)
}

void clmha__fused_tiles_fit_limits(const clmha__device_class *cls, cl_ulong local_mem,
                                   size_t max_wg, size_t hd, clmha__fused_tiles *t) {
    // Leave room for what the compiler adds to local memory.
    cl_ulong local = local_mem > 1024 ? (local_mem - 1024) / sizeof(float) : 0;  // floats
    size_t bq = 1;
    while (bq * 2 <= t->bq && bq * 2 <= max_wg) bq *= 2;
    t->bq = bq;
    if (!t->rpw) t->rpw = 1;
    t->q_local = cls->coalesced;
    t->acc_local = false;
    t->lanes = cls->lanes && !cls->coalesced;
    if (t->lanes) {
        // The lanes mapping's arrays within the budget: fewer rows, then fewer keys per tile
        // (down to 8), else the tiled mapping with one row per work-item, fitted below.
        while (clmha__fused_private_floats(t, hd) > cls->private_floats && t->rpw > 1)
            t->rpw /= 2;
        while (clmha__fused_private_floats(t, hd) > cls->private_floats && t->bk > 8) t->bk /= 2;
        if (clmha__fused_private_floats(t, hd) > cls->private_floats) {
            t->lanes = false;
            t->rpw = 1;
            t->bk = 32;
            bq = 1;
            while (bq * 2 <= 64 && bq * 2 <= max_wg) bq *= 2;
            t->bq = bq;
        }
    }
    // Private arrays within the class's budget, so that they stay in registers: one row per
    // work-item, then fewer keys per tile (down to 8), then the query rows in local memory,
    // then the accumulators too.
    while (clmha__fused_private_floats(t, hd) > cls->private_floats) {
        if (t->rpw > 1) --t->rpw;
        else if (t->bk > 8) t->bk /= 2;
        else if (!t->q_local) t->q_local = true;
        else if (!t->acc_local) t->acc_local = true;
        else if (t->bk > 1) t->bk /= 2;
        else break;
    }
    // Local memory: fewer keys per tile (down to 8), then smaller work-groups where query rows
    // live in local memory (down to 32), then anything that helps; bk 0 when nothing fits.
    while (t->bk > 0 && clmha__fused_local_floats(t, hd) > local) {
        bool rows_local = t->q_local || t->acc_local;
        if (t->bk > 8) t->bk /= 2;
        else if (rows_local && t->bq > 32) t->bq /= 2;
        else if (t->bk > 1) t->bk /= 2;
        else if (rows_local && t->bq > 1) t->bq /= 2;
        else t->bk = 0;
    }
    size_t want = t->vw;
    t->vw = 16;
    while (t->vw > 1 && (t->vw > want || hd % t->vw || (t->bk && t->bk % t->vw))) t->vw /= 2;
}

// ---- build --------------------------------------------------------------------------------------

// Builds the fused kernel with tiles @p t, then asks the kernel what it allows: while its
// work-group limit (CL_KERNEL_WORK_GROUP_SIZE) is below bq, or the local memory it uses
// (CL_KERNEL_LOCAL_MEM_SIZE) exceeds the device's, rebuilds with half the work-items (bq); or
// with half the keys per tile (bk), down to 8 while rows live in local memory (q_local,
// acc_local), then half the work-items, whose rows that local memory holds. Drivers may report
// a smaller limit for a kernel than for the device (rusticl: 32 for this kernel at bq 64), and
// more local memory than the tiles need (rusticl: twice PoCL's count for the same kernel); a
// launch past either is undefined.
static clmha_status build_fused(clmha_layer *l, clmha__fused_tiles t) {
    clmha_context *ctx = l->ctx;
    for (;;) {
        if (!t.bk || !t.bq) {
            clmha__fused_tiles one = t;
            one.bk = one.bq = 1;
            return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                               "the fused core needs %zu bytes of local memory for one key at "
                               "head_dim %zu and a work-group of one work-item; the device has "
                               "%llu (use CLMHA_IMPL_UNFUSED)",
                               clmha__fused_local_floats(&one, l->d) * l->rs, l->d,
                               (unsigned long long)clmha__local_mem(ctx));
        }
        char options[320];
        snprintf(options, sizeof options,
                 "-DHD=%zu -DBQ=%zu -DBK=%zu -DRPW=%zu -DVW=%zu -DQ_LOCAL=%d -DACC_LOCAL=%d "
                 "-DLANES=%d%s%s",
                 l->d, t.bq, t.bk, t.rpw, t.vw, (int)t.q_local, (int)t.acc_local, (int)t.lanes,
                 clmha__layer_real_options(l), clmha__layer_variant_options(l));
        cl_program prog;
        cl_kernel k = NULL;
        clmha_status st = clmha__program_get_mod(ctx, "fused", options, l->mod_source, &prog);
        if (st || (st = clmha__kernel_make(ctx, prog, "fused_attention", &k))) return st;
        size_t wg;
        cl_ulong local;
        if ((st = clmha__kernel_limits(ctx, k, &wg, &local))) {
            clmha__release_kernel(k);
            return st;
        }
        if (t.bq <= wg && local <= clmha__local_mem(ctx)) {
            state *s = state_of(l);
            s->kernel = k;
            s->tiles = t;
            return CLMHA_SUCCESS;
        }
        clmha__release_kernel(k);
        if (t.bq > wg) {
            while (t.bq > wg) t.bq /= 2;
        } else if (t.bk > 8 || t.bq == 1 || !(t.q_local || t.acc_local)) {
            t.bk /= 2;
            while (t.vw > 1 && t.bk % t.vw) t.vw /= 2;
        } else {
            t.bq /= 2;  // the query rows or accumulators in local memory scale with bq
        }
    }
}

// The tiles of layer @p l: the device's (clmha__fused_tiles_for()), for a float64 layer fitted
// again to half the private and local budgets (a double takes the room of two floats) and at
// most 8 lanes (an AVX-512 register's doubles), nor more than the device's native double width
// where it gives one: PoCL on an AVX2 CPU (native 4) builds double8 with 34 warnings on stderr
// ("AVX vector argument of type double8 without 'avx512f' enabled changes the ABI").
static clmha__fused_tiles layer_tiles(const clmha_layer *l) {
    clmha_context *ctx = l->ctx;
    clmha__fused_tiles t = clmha__fused_tiles_for(ctx, l->d);
    if (l->rs != 8) return t;
    clmha__device_class cls = *ctx->cls;
    cls.private_floats /= 2;
    cl_uint native = 0;
    clGetDeviceInfo(ctx->device, CL_DEVICE_NATIVE_VECTOR_WIDTH_DOUBLE, sizeof native, &native,
                    NULL);
    size_t most = native && native < 8 ? native : 8;
    while (t.vw > most) t.vw /= 2;
    clmha__fused_tiles_fit_limits(&cls, clmha__local_mem(ctx) / 2, ctx->max_work_group, l->d,
                                  &t);
    if (ctx->quirks.no_vload) t.vw = 1;
    return t;
}

clmha_status clmha__layer_fused(clmha_layer *l) {
    state *s = state_of(l);
    if (s->kernel) return CLMHA_SUCCESS;
    if (s->failed)
        return clmha__fail(l->ctx, s->failed,
                           "the fused core could not be built for this layer (head_dim %zu) on "
                           "this device: %s (use CLMHA_IMPL_UNFUSED)",
                           l->d, clmha_status_string(s->failed));
    clmha_status st = build_fused(l, layer_tiles(l));
    // A device that cannot build or hold the kernel will not later; an out-of-memory may pass.
    if (st == CLMHA_UNSUPPORTED || st == CLMHA_BUILD_FAILED) s->failed = st;
    return st;
}

// The loop iterations a loop of @p n iterations whose body runs loops of @p body iterations
// costs gallivm's limiter: n + 1 checks of the condition (measured: clover's count matches
// this within a few percent) plus the body's.
static double loop_cost(double n, double body) { return n + 1 + n * body; }

bool clmha__fused_loops_fit(const clmha_layer *l, const clmha__dims *d, bool causal,
                            bool dropout) {
    size_t limit = clmha__fused_loop_limit(l);
    if (!limit) return true;
    // Every loop of cl/cores/fused.cl for one work-item, as if the compiler kept them all (clover
    // does; rusticl unrolls some, and its count is lower).
    const clmha__fused_tiles *t = &state_of(l)->tiles;
    double hd = (double)l->d, bq = (double)t->bq, bk = (double)t->bk, rpw = (double)t->rpw,
           vw = (double)t->vw;
    // The lanes mapping never runs under a loop limit: forced onto llvmpipe (rusticl) it gave
    // wrong results even where this count fits (its class matches only PoCL, which has no such
    // limit; the test hook's limit on PoCL sends it to the unfused core too).
    if (t->lanes) return false;
    double rows = loop_cost(rpw, 0);
    double load = loop_cost(ceil(bk * hd / bq), 0);
    // The scores: VW keys at a time over head_dim, or (query rows in local memory, Q_LOCAL)
    // head_dim outermost over VW keys at a time.
    double scores = t->q_local
                        ? loop_cost(rpw, loop_cost(bk, 0)) +
                              loop_cost(hd, rows + loop_cost(bk / vw, rows))
                        : loop_cost(bk / vw, rows + loop_cost(hd, rows) + rows);
    double row = loop_cost(bk, 0) + 2 * loop_cost(bk / vw, 0) + 2 * loop_cost(vw, 0) +
                 loop_cost(hd, 0) + (dropout ? loop_cost(bk, loop_cost(10, 0)) : 0);  // Philox
    double av = loop_cost(hd / vw, rows + loop_cost(bk, rows) + rows);
    double per_tile = load + scores + loop_cost(rpw, row) + av;
    // The key tiles a group walks (key_tiles_of(): a window bounds them).
    double tiles = clmha__window_tiles(d, causal, bq * rpw, bk, ceil((double)d->s_padded / bk));
    // + the log-sum-exp rows (written only for a backward pass, counted always).
    double total = loop_cost(tiles, per_tile) + rows + 2 * loop_cost(rpw, loop_cost(hd, 0)) +
                   loop_cost(rpw, 0);
    if (t->q_local || t->acc_local)  // loading the query rows, storing the output rows
        total += 2 * loop_cost(ceil(rpw * hd), 0);
    // Half the limit: room for loops a compiler adds.
    return total <= (double)limit / 2;
}

clmha_status clmha__layer_set_fused_tiles(clmha_layer *l, const clmha__fused_tiles *t,
                                          clmha__fused_tiles *used) {
    state *s = state_of(l);
    clmha__fused_tiles u = *t;
    clmha__fused_tiles_fit(l->ctx, l->d, &u);
    clmha__release_kernel(s->kernel);
    s->kernel = NULL;
    s->failed = CLMHA_SUCCESS;
    clmha_status st = build_fused(l, u);
    if (used) *used = st ? u : s->tiles;
    return st;
}

// ---- the core -----------------------------------------------------------------------------------

// The fused core runs a call when the layer has no user core and the call asks for it
// (CLMHA_IMPL_FUSED, or a call that needs the log-sum-exp rows) or leaves the choice
// (CLMHA_IMPL_AUTO), once its kernel is built. (The dispatch asks it about a call with weights
// only when the call's impl names it, and then refuses the call: it returns none.) CLMHA_IMPL_AUTO: a
// device that cannot build or launch the fused kernel gets the next core; a call that asked
// for this one gets the error. A driver whose loops end early (clmha__quirks::loop_limit) would
// give a wrong answer from the fused core past its loop budget: the unfused core computes the
// same result (the call falls back).
static clmha_status supports(clmha_layer *l, const clmha__core_call *call,
                             clmha__core_answer *answer) {
    const clmha_forward_args *a = call->args;
    clmha_impl impl = clmha__impl_of_call(l, call);
    clmha__core_reason no = CLMHA__CORE_PASSES;
    if (l->core) {
        clmha__core_answer_set(answer, no, CLMHA_SUCCESS, "the layer has a user core");
        return CLMHA_SUCCESS;
    }
    if (impl == CLMHA_IMPL_UNFUSED) {
        clmha__core_answer_set(answer, no, CLMHA_SUCCESS, "impl is CLMHA_IMPL_UNFUSED");
        return CLMHA_SUCCESS;
    }
    bool asked = impl == CLMHA_IMPL_FUSED || call->need_lse;
    clmha_status st = clmha__layer_fused(l);
    if (st) {
        if (asked) return st;
        clmha__core_answer_set(answer, no, CLMHA_SUCCESS, "its kernel cannot be built here (%s)",
                               clmha_status_string(st));
        return CLMHA_SUCCESS;
    }
    if (!clmha__fused_loops_fit(l, call->dims, a->is_causal,
                                a->training && l->desc.dropout > 0.0f)) {
        clmha__core_answer_set(answer, asked ? CLMHA__CORE_FALLS_BACK : no, CLMHA_SUCCESS,
                               "its loops would pass the device's loop limit at these sequence "
                               "lengths");
        return CLMHA_SUCCESS;
    }
    clmha__core_runs(answer);
    return CLMHA_SUCCESS;
}

// 3-5 fused: scores, masks, softmax, dropout and weights·V in one kernel that streams tiles
// of keys through local memory (cl/cores/fused.cl); the scores are never stored. One work-group
// per (tile of bq·rpw query rows, batch·head).
static clmha_status run(clmha_layer *l, clmha__core_call *call) {
    const clmha_forward_args *a = call->args;
    const clmha__dims *d = call->dims;
    clmha_context *ctx = l->ctx;
    cl_ulong tgt = d->l, heads = l->h, src = d->s, srcp = d->s_padded;
    clmha__real scale = clmha__real_of(clmha__core_scale(l, call->scale));
    clmha__mask_args m = clmha__masks_of(l, a, d);
    // The log-sum-exp rows for the backward pass, only when asked for (a flag: no cost else).
    cl_mem lse = call->lse ? call->lse : ctx->dummy;
    // 2: also each row's maximum and log(sum) apart (clmha__core_call::lse_split).
    cl_uint lse_on = !call->lse ? 0 : call->lse_split ? 2 : 1;
    cl_ulong group = call->kv_group ? call->kv_group : 1;  // query heads per key/value plane
    state *s = state_of(l);
    clmha_status st;
    // With clmha_mask_mod, the tiles it forbids: per work-item (lanes) or work-group.
    size_t bq = s->tiles.bq, rows = bq * s->tiles.rpw;
    if ((l->mods & CLMHA__MOD_MASK) &&
        (st = clmha__block_mask_get(l, &s->blocks, d, s->tiles.lanes ? s->tiles.rpw : rows,
                                    s->tiles.bk, &m.mod_blocks)))
        return st;
    // Where each row of each head is (cl/cores/fused.cl, AT): the head tiles, or (call->rows)
    // the projected rows and the merged rows.
    cl_mem q = l->tiles[CLMHA__TILE_Q], k = l->tiles[CLMHA__TILE_K], v = l->tiles[CLMHA__TILE_V];
    cl_ulong hd = l->d, kvh = l->h / group;
    cl_ulong4 q_at = {{0, heads * tgt * hd, tgt * hd, hd}};
    cl_ulong4 k_at = {{0, kvh * srcp * hd, srcp * hd, hd}}, v_at = k_at, o_at = q_at;
    // In the rows, in_proj_bias is still to be added (the kernel does).
    cl_mem bias = l->desc.bias && call->rows ? l->b_in : ctx->dummy;
    cl_ulong4 bias_at = {{l->desc.bias && call->rows, 0, l->e, l->e + l->kve}};
    if (call->rows) {
        q = k = v = l->proj;
        q_at = clmha__rows_at(d, call->q_at, call->q_ld, hd, tgt);
        k_at = clmha__rows_at(d, call->k_at, call->k_ld, hd, src);
        v_at = clmha__rows_at(d, call->v_at, call->v_ld, hd, src);
        o_at = clmha__rows_at(d, 0, l->e, hd, tgt);
    }
    arg args[] = {ARG(q), ARG(k), ARG(v), ARG(l->tiles[CLMHA__TILE_OUT]), ARG(q_at), ARG(k_at),
                  ARG(v_at), ARG(o_at), ARG(bias), ARG(bias_at),
                  ARG(tgt), ARG(heads), ARG(src), ARG(srcp), CLMHA__REAL_ARG(scale, l->rs),
                  MASK_ARGS(m),
                  ARG(lse), ARG(lse_on), ARG(group)};
    if ((st = clmha__set_args(ctx, s->kernel, "fused_attention", args,
                              sizeof args / sizeof args[0])))
        return st;
    size_t global[2] = {(d->l + rows - 1) / rows * bq, d->n * l->h}, local[2] = {bq, 1};
    cl_int err = clEnqueueNDRangeKernel(ctx->queue, s->kernel, 2, NULL, global, local, 0, NULL,
                                        NULL);
    if (err != CL_SUCCESS)
        return clmha__cl_fail_on(ctx, err, "clEnqueueNDRangeKernel", "fused_attention");
    call->lse_written = lse_on;
    call->lse_split_written = lse_on == 2;
    return clmha__layer_mark(l, 1 + CLMHA_STAGE_FUSED);
}

// The backward hooks: the backward pass (fused_backward.c) gets its state's place in this
// core's state.
static clmha_status backward_supports(clmha_layer *l, const clmha__backward_call *call,
                                      clmha__core_answer *answer) {
    return clmha__fused_backward_supports(&state_of(l)->backward, l, call, answer);
}

static clmha_status backward(clmha_layer *l, clmha__backward_call *call) {
    return clmha__fused_backward_run(&state_of(l)->backward, l, call);
}

// clmha_layer_bake(): the kernel, for the calls without weights of a layer on CLMHA_IMPL_AUTO
// (a pass with weights ran the unfused core). Where it cannot be built, those calls run the
// unfused core, which the pass has prepared.
static clmha_status bake(clmha_layer *l) {
    const state *s = state_of(l);
    if (l->core || l->impl == CLMHA_IMPL_UNFUSED || s->kernel || s->failed) return CLMHA_SUCCESS;
    clmha_status st = clmha__layer_fused(l);
    return st && state_of(l)->failed ? CLMHA_SUCCESS : st;
}

const clmha__core clmha__core_fused = {.name = "fused",
                                       .impl = CLMHA_IMPL_FUSED,
                                       .grouped_kv = true,
                                       .reads_rows = true,
                                       .create = create,
                                       .release = release,
                                       .bake = bake,
                                       .supports = supports,
                                       .writes_lse = true,
                                       .uses_scores = false,
                                       .run = run,
                                       .backward_supports = backward_supports,
                                       .backward = backward};
