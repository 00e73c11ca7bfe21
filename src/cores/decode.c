// The decode core: the attention of calls with a KV cache (clmha_forward_args::kv_cache), split-K
// (kernels cl/cores/decode.cl). It takes the call's queries and new key and value rows straight
// from the input projection (clmha__core::takes_rows; it adds in_proj_bias), appends the keys
// and values to the cache, then cuts the cached keys each query row sees (all of them, or those
// of its sliding window and is_causal) into `parts` ranges scored by separate work-items
// (decode_partial: a partial softmax per range) and merges the ranges of each query row
// (decode_combine, which writes merged rows and the output's bias rows), so that a step with
// one query row per head still fills the device. Its scratch, the partial results, is its own
// (kept in its state).
#include "cores/decode.h"

#include "cache/kv_cache.h"
#include "cores/core.h"
#include "cores/fused_shared.h"
#include "cores/kernel_args.h"
#include "device/held.h"
#include "tuning_store/store.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef clmha__arg arg;
#define ARG CLMHA__ARG

CLMHA__HIDDEN extern const clmha__core clmha__core_decode;  // this core, at the end of this file

#define KINDS (CLMHA_KV_INT4 + 1)  // the kinds of cache (clmha_kv_dtype)

typedef struct state {
    cl_kernel zero, combine;             // built on first use
    // Per kind of cache (clmha_kv_dtype: the program built with -DKV_TYPE=kind) and pages of 8
    // or not ([1]: -DHALF_PAGES=1): [0][0] with the two above, the others on the first call
    // with such a cache.
    cl_kernel append[KINDS][2], partial[KINDS][2];
    size_t wg;                           // their launches' work-group
    clmha_status failed;                 // why they cannot be built here (then not retried)
    cl_mem part_acc, part_ms;            // the partial results, grown on demand (the layer's
                                         // elements)
    size_t acc_cap, ms_cap;
    size_t split[2];                     // the tuner's override (0, 0: none)
} state;

static state *state_of(const clmha_layer *l) { return clmha__core_state(l, &clmha__core_decode); }

static clmha_status create(clmha_layer *l, void **out) {
    *out = calloc(1, sizeof(state));
    return *out ? CLMHA_SUCCESS : clmha__fail(l->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
}

static void release_kernels(state *s) {
    clmha__release_kernel(s->zero);
    clmha__release_kernel(s->combine);
    s->zero = s->combine = NULL;
    for (size_t k = 0; k < KINDS; ++k)
        for (size_t h = 0; h < 2; ++h) {
            clmha__release_kernel(s->append[k][h]);
            clmha__release_kernel(s->partial[k][h]);
            s->append[k][h] = s->partial[k][h] = NULL;
        }
}

static void release(void *p) {
    state *s = p;
    if (!s) return;
    release_kernels(s);
    clmha__release_mem(s->part_acc);
    clmha__release_mem(s->part_ms);
    free(s);
}

// Builds the four kernels for head_dim D, G query heads per KV head, the layer's element type
// (doubles for a float64 layer) and the vector width of the fused core narrowed to divide D (1
// where vector types are unsafe). GPUs get one sum per
// query head in a block's scores (SPLIT 1: their many work-items hide the FMA latency, and
// every extra sum is 16 more registers a work-item); CPUs the kernel's default.
static clmha_status build(clmha_layer *l, state *s, size_t group) {
    clmha_context *ctx = l->ctx;
    size_t vw = clmha__fused_row_vw(ctx, l->d);
    char options[240];
    snprintf(options, sizeof options, "-DHD=%zu -DG=%zu -DVW=%zu%s%s%s", l->d, group, vw,
             ctx->cls->coalesced ? " -DSPLIT=1" : "", clmha__layer_real_options(l),
             clmha__layer_variant_options(l));
    cl_program prog;
    clmha_status st = clmha__program_get_mod(ctx, "decode", options, l->mod_source, &prog);
    if (st || (st = clmha__kernel_make(ctx, prog, "decode_zero", &s->zero)) ||
        (st = clmha__kernel_make(ctx, prog, "decode_append", &s->append[0][0])) ||
        (st = clmha__kernel_make(ctx, prog, "decode_partial", &s->partial[0][0])) ||
        (st = clmha__kernel_make(ctx, prog, "decode_combine", &s->combine))) {
        release_kernels(s);
        return st;
    }
    // One work-item per group on CPUs (each runs its range's loop in vector registers); 64 on
    // GPUs, within every kernel's limit.
    s->wg = ctx->cls->coalesced ? 64 : 1;
    cl_kernel ks[] = {s->zero, s->append[0][0], s->partial[0][0], s->combine};
    for (size_t i = 0; i < 4; ++i) {
        size_t wg;
        if ((st = clmha__kernel_limits(ctx, ks[i], &wg, NULL))) {
            release_kernels(s);
            return st;
        }
        while (s->wg > wg) s->wg /= 2;
    }
    return CLMHA_SUCCESS;
}

// Whether a cache has pages of 8 (the decode program's HALF_PAGES: key blocks of 8).
static size_t half_pages(const clmha_kv_cache *c) { return c->paged && c->page_size == 8; }

// The append and attention kernels of a cache of another kv_dtype than float32, or of pages of
// 8: the same program built with -DKV_TYPE=kind and -DHALF_PAGES (cl/cores/decode.cl; int4
// with its group, and the vector width narrowed to at most half a group, whose bytes hold two
// dimensions), on the first call with such a cache.
static clmha_status build_kind(clmha_layer *l, state *s, const clmha_kv_cache *c) {
    clmha_context *ctx = l->ctx;
    size_t vw = clmha__fused_row_vw(ctx, l->d), kind = (size_t)c->kv_dtype, half = half_pages(c);
    if (c->kv_dtype == CLMHA_KV_INT4)
        while (vw > c->group / 2) vw /= 2;
    char options[288];
    snprintf(options, sizeof options,
             "-DHD=%zu -DG=%zu -DVW=%zu -DKV_TYPE=%zu -DKGS=%zu -DHALF_PAGES=%zu%s%s%s", l->d,
             l->h / l->kvh, vw, kind, c->group ? c->group : 1, half,
             ctx->cls->coalesced ? " -DSPLIT=1" : "", clmha__layer_real_options(l),
             clmha__layer_variant_options(l));
    cl_program prog;
    clmha_status st = clmha__program_get_mod(ctx, "decode", options, l->mod_source, &prog);
    if (!st) st = clmha__kernel_make(ctx, prog, "decode_append", &s->append[kind][half]);
    if (!st) st = clmha__kernel_make(ctx, prog, "decode_partial", &s->partial[kind][half]);
    return st;
}

static clmha_status ensure(clmha_layer *l, state **out) {
    state *s = *out = state_of(l);
    if (s->partial[0][0]) return CLMHA_SUCCESS;
    if (s->failed)
        return clmha__fail(l->ctx, s->failed,
                           "the decode kernels could not be built for head_dim %zu on this "
                           "device: %s",
                           l->d, clmha_status_string(s->failed));
    clmha_status st = build(l, s, l->h / l->kvh);
    if (st == CLMHA_UNSUPPORTED || st == CLMHA_BUILD_FAILED) s->failed = st;
    return st;
}

// What a call with a KV cache may not ask for: NULL, or its name (include/clmha.h,
// "Incremental decoding").
static const char *not_taken(const clmha_layer *l, const clmha_forward_args *a) {
    if (l->core) return "a user attention core (clmha_layer_set_attention())";
    if (a->need_weights) return "need_weights";
    if (a->attn_mask.kind != CLMHA_MASK_NONE) return "attn_mask";
    if (a->key_padding_mask.kind != CLMHA_MASK_NONE)
        return "key_padding_mask (say how many new tokens are real with kv_append)";
    if (a->training && l->desc.dropout > 0.0f) return "dropout (training)";
    if (a->save) return "save (the backward pass)";
    if (a->impl != CLMHA_IMPL_AUTO) return "impl other than CLMHA_IMPL_AUTO";
    return NULL;
}

// The calls with a KV cache are this core's, and only those: it refuses the options it does
// not take; it runs the others, once its kernels are built.
static clmha_status supports(clmha_layer *l, const clmha__core_call *call,
                             clmha__core_answer *answer) {
    const clmha_forward_args *a = call->args;
    if (!a->kv_cache) {
        clmha__core_answer_set(answer, CLMHA__CORE_PASSES, CLMHA_SUCCESS,
                               "it runs the calls with a KV cache only");
        return CLMHA_SUCCESS;
    }
    const char *no = not_taken(l, a);
    if (no) {
        clmha__core_answer_set(answer, CLMHA__CORE_REFUSES, CLMHA_UNSUPPORTED,
                               "a forward call with kv_cache runs the decode core, which does "
                               "not take %s",
                               no);
        return CLMHA_SUCCESS;
    }
    state *s;
    clmha__core_runs(answer);
    return ensure(l, &s);
}

static size_t test_parts;

void clmha__test_set_decode_parts(size_t parts) { test_parts = parts; }

void clmha__decode_default_split(const clmha_context *ctx, size_t split[2]) {
    split[0] = ctx->cls->coalesced ? 256 : 8;
    split[1] = 64;
}

size_t clmha__decode_parts(const clmha_context *ctx, const size_t split[2], size_t rows,
                           size_t longest) {
    size_t cu = ctx->info.compute_units ? ctx->info.compute_units : 1;
    size_t want = cu * split[0], keys = split[1] ? split[1] : 1;
    size_t parts = (want + rows - 1) / (rows ? rows : 1);
    size_t most = (longest + keys - 1) / keys;
    if (parts > most) parts = most;
    return parts ? parts : 1;
}

void clmha__decode_set_split(clmha_layer *layer, const size_t split[2]) {
    state *s = state_of(layer);
    if (!s) return;
    s->split[0] = split ? split[0] : 0;
    s->split[1] = split ? split[1] : 0;
}

// How many ranges each sequence's keys are cut into: the test hook, else $CLMHA_DECODE_PARTS,
// else clmha__decode_parts() with the tuner's override, the device's tuning or the defaults.
static size_t parts_for(const clmha_context *ctx, const state *s, size_t rows, size_t longest) {
    if (test_parts) return test_parts;
    const char *env = getenv("CLMHA_DECODE_PARTS");
    if (env && atoi(env) > 0) return (size_t)atoi(env);
    size_t split[2];
    if (s->split[0]) {
        split[0] = s->split[0], split[1] = s->split[1];
    } else if (!clmha__tuning_decode(ctx->device, split)) {
        clmha__decode_default_split(ctx, split);
    }
    return clmha__decode_parts(ctx, split, rows, longest);
}

// The most keys a query row of the call sees, the longest range its parts cut: the longest
// sequence after the call (@p longest), or, where a sliding window bounds both sides (is_causal
// bounds the right one at 0), the window's width plus the keys before its start in its first
// key block of 16 (cl/cores/decode.cl: the parts start on key blocks), if that is fewer. So a
// step over a long cache with a narrow window gets the parts of a step over a short cache.
static size_t window_span(const clmha__dims *d, bool causal, size_t longest) {
    int64_t left = d->win_left, right = causal ? 0 : d->win_right;
    if (!clmha__windowed(d) || left < 0 || right < 0 || (uint64_t)left >= longest ||
        (uint64_t)right >= longest)
        return longest;
    uint64_t span = (uint64_t)left + (uint64_t)right + 16;  // + 1 key, + 15 before the start
    return span < longest ? (size_t)span : longest;
}

// A paged cache's copies on write (clmha__kv_plan::copies): the whole page of keys and of values
// of each shared, partly filled page a sequence appends into, to the page it takes, before the
// append writes there.
static clmha_status copy_on_write(clmha_context *ctx, const clmha__kv_plan *kv) {
    const clmha_kv_cache *c = kv->cache;
    size_t rows = c->page_size;  // a page's rows of D elements (and scales), head by head
    cl_mem bufs[4] = {c->k, c->v, c->ks, c->vs};
    size_t scales = rows * c->groups * sizeof(float);
    size_t bytes[4] = {rows * c->row_bytes, rows * c->row_bytes, scales, scales};
    for (size_t j = 0; j < kv->num_copies; ++j)
        for (size_t kh = 0; kh < c->kv_heads; ++kh)
            for (int b = 0; b < 4; ++b) {
                if (!bufs[b]) continue;
                size_t from = (kh * c->num_pages + kv->copies[2 * j]) * bytes[b];
                size_t to = (kh * c->num_pages + kv->copies[2 * j + 1]) * bytes[b];
                cl_int err = clEnqueueCopyBuffer(ctx->queue, bufs[b], bufs[b], from, to,
                                                 bytes[b], 0, NULL, NULL);
                if (err) return clmha__cl_fail(ctx, err, "clEnqueueCopyBuffer(KV cache page)");
            }
    return CLMHA_SUCCESS;
}

// Zeroes a cache's keys (and a quantised cache's key scales) before its first use:
// decode_partial reads a key block whole, the positions past a sequence's length too (their
// scores dropped), which must hold numbers. A kernel rather than clEnqueueFillBuffer, whose
// writes Oclgrind 21.10's uninitialised-value check does not see; 32-bit words, which every
// kind of cache's buffers are a multiple of (blocks of 16 positions).
static clmha_status zero_keys(clmha_layer *l, state *s, const clmha_kv_cache *c) {
    clmha_context *ctx = l->ctx;
    cl_ulong rows = c->num_pages * c->kv_heads * c->page_size;  // fits: allocated
    cl_ulong words[2] = {rows * c->row_bytes / 4, rows * c->groups};
    cl_mem bufs[2] = {c->k, c->ks};
    for (int b = 0; b < 2; ++b) {
        if (!words[b]) continue;
        arg args[] = {ARG(bufs[b]), ARG(words[b])};
        clmha_status st = clmha__launch(ctx, s->zero, "decode_zero", words[b], s->wg, args,
                                        sizeof args / sizeof args[0]);
        if (st) return st;
    }
    return CLMHA_SUCCESS;
}

// log2 of a paged cache's page size (a power of two); 0 for a contiguous cache.
static cl_uint page_shift(const clmha_kv_cache *c) {
    cl_uint shift = 0;
    while (c->paged && ((size_t)1 << shift) < c->page_size) ++shift;
    return shift;
}

// decode_append: the call's new key and value rows (in_proj_bias added) into the cache, one
// work-item per row of a key/value head.
static clmha_status append_rows(clmha_layer *l, const state *s, const clmha__core_call *call,
                                cl_kernel append) {
    const clmha__dims *d = call->dims;
    const clmha__kv_plan *kv = call->kv;
    const clmha_kv_cache *c = kv->cache;
    clmha_context *ctx = l->ctx;
    cl_mem kscale = c->groups ? c->ks : ctx->dummy, vscale = c->groups ? c->vs : ctx->dummy;
    cl_uint has_bias = l->desc.bias, pshift = page_shift(c), batch_first = d->batch_first;
    cl_mem bias = has_bias ? l->b_in : ctx->dummy;
    cl_ulong rows = d->n * c->kv_heads * d->s, src = d->s, kvh = c->kv_heads;
    cl_ulong k_at = call->k_at, k_ld = call->k_ld, v_at = call->v_at, v_ld = call->v_ld;
    cl_ulong kb_at = l->e, vb_at = l->e + l->kve, n_batch = d->n, psize = c->page_size;
    cl_ulong pages_ld = kv->pages_ld, num_pages = c->num_pages;
    arg args[] = {ARG(l->proj),   ARG(k_at),     ARG(k_ld),      ARG(v_at),
                  ARG(v_ld),      ARG(bias),     ARG(has_bias),  ARG(kb_at),
                  ARG(vb_at),     ARG(c->k),     ARG(c->v),      ARG(kscale),
                  ARG(vscale),    ARG(kv->lens), ARG(pages_ld),  ARG(pshift),
                  ARG(psize),     ARG(num_pages), ARG(n_batch),  ARG(batch_first),
                  ARG(src),       ARG(kvh),      ARG(rows)};
    return clmha__launch(ctx, append, "decode_append", rows, s->wg, args,
                         sizeof args / sizeof args[0]);
}

static clmha_status run(clmha_layer *l, clmha__core_call *call) {
    const clmha__dims *d = call->dims;
    const clmha__kv_plan *kv = call->kv;
    const clmha_kv_cache *c = kv->cache;
    clmha_context *ctx = l->ctx;
    state *s;
    clmha_status st = ensure(l, &s);
    if (st) return st;
    cl_ulong kvh = c->kv_heads, psize = c->page_size, heads = l->h, tgt = d->l;
    cl_ulong pages_ld = kv->pages_ld, num_pages = c->num_pages;
    cl_uint pshift = page_shift(c);
    size_t kind = (size_t)c->kv_dtype, half = half_pages(c);
    if (!s->partial[kind][half] && (st = build_kind(l, s, c))) return st;
    cl_kernel append = s->append[kind][half], partial = s->partial[kind][half];
    cl_mem kscale = c->groups ? c->ks : ctx->dummy, vscale = c->groups ? c->vs : ctx->dummy;
    if (!c->keys_zeroed && (st = zero_keys(l, s, c))) return st;
    kv->cache->keys_zeroed = true;
    // The queries and new keys and values are the projected rows; in_proj_bias is added here.
    cl_ulong n_batch = d->n, q_at = call->q_at, q_ld = call->q_ld;
    cl_uint batch_first = d->batch_first, has_bias = l->desc.bias;
    cl_mem bias = has_bias ? l->b_in : ctx->dummy;
    if (call->kv_append && (st = copy_on_write(ctx, kv))) return st;
    if (call->kv_append && (st = append_rows(l, s, call, append))) return st;
    size_t q_rows = d->n * l->h * d->l;
    cl_uint causal = call->args->is_causal;
    cl_uint parts = (cl_uint)parts_for(ctx, s, d->n * c->kv_heads * d->l,
                                       window_span(d, causal, kv->max_new));
    if ((st = clmha__layer_grow_core_scratch(l, &s->part_acc, &s->acc_cap, q_rows * parts * l->d,
                                             "decode partial results")) ||
        (st = clmha__layer_grow_core_scratch(l, &s->part_ms, &s->ms_cap, q_rows * parts * 2,
                                             "decode partial maxima and sums")))
        return st;
    clmha__real scale = clmha__real_of(clmha__core_scale(l, call->scale));
    cl_long win_left = d->win_left, win_right = d->win_right;
    cl_ulong items = d->n * c->kv_heads * d->l * parts;
    clmha__mask_args m = clmha__masks_of(l, call->args, d);  // the score variants' values
    {
        arg args[] = {ARG(l->proj),   ARG(q_at),    ARG(q_ld),        ARG(bias),
                      ARG(has_bias),  ARG(n_batch), ARG(batch_first), ARG(c->k),
                      ARG(c->v),      ARG(kscale),  ARG(vscale),      ARG(kv->lens), ARG(pages_ld),
                      ARG(pshift),    ARG(psize),   ARG(num_pages),     ARG(tgt),     ARG(heads),
                      ARG(kvh),       ARG(parts),       ARG(causal),
                      ARG(win_left),  ARG(win_right), CLMHA__REAL_ARG(scale, l->rs),
                      CLMHA__REAL_ARG(m.softcap, l->rs),
                      ARG(m.alibi),   ARG(m.alibi_off), ARG(m.mod_p),    ARG(m.mod_off),
                      ARG(s->part_acc),
                      ARG(s->part_ms), ARG(items)};
        if ((st = clmha__launch(ctx, partial, "decode_partial", items, s->wg, args,
                                sizeof args / sizeof args[0])))
            return st;
    }
    cl_mem bias_kv = l->desc.add_bias_kv ? l->bias_kv : ctx->dummy;
    cl_uint has_bias_kv = l->desc.add_bias_kv, zero_attn = l->desc.add_zero_attn;
    cl_ulong rows = q_rows, y_off = call->output_offset;
    cl_uint has_b_out = l->desc.bias;
    cl_mem b_out = has_b_out ? l->b_out : ctx->dummy;
    cl_mem merged = l->tiles[CLMHA__TILE_OUT];
    arg args[] = {ARG(s->part_acc), ARG(s->part_ms),  ARG(parts),        ARG(l->proj),
                  ARG(q_at),        ARG(q_ld),        ARG(bias),         ARG(has_bias),
                  ARG(bias_kv),     ARG(has_bias_kv), ARG(zero_attn),    ARG(heads),
                  ARG(kvh),         ARG(tgt),         CLMHA__REAL_ARG(scale, l->rs),
                  CLMHA__REAL_ARG(m.softcap, l->rs),
                  ARG(m.sinks),     ARG(m.sinks_off), ARG(merged),
                  ARG(n_batch),     ARG(batch_first), ARG(call->output), ARG(y_off),
                  ARG(b_out),       ARG(has_b_out),   ARG(rows)};
    if ((st = clmha__launch(ctx, s->combine, "decode_combine", rows, s->wg, args,
                            sizeof args / sizeof args[0])))
        return st;
    return clmha__layer_mark(l, 1 + CLMHA_STAGE_FUSED);
}

// clmha_attention_merge(): b merged into a, row by row, with kernel merge_partials (this core's
// program: the merge of ranges that decode_combine does, for two results; in doubles for
// clmha_attention_merge_f64()).
static clmha_status merge(clmha_context *ctx, const clmha__merge_call *m) {
    cl_program prog;
    cl_kernel k = NULL;
    clmha_status st;
    const char *options = m->rs == 8 ? "-DHD=1 -DG=1 -DVW=1 -DCLMHA_F64" : "-DHD=1 -DG=1 -DVW=1";
    if ((st = clmha__program_get(ctx, "decode", options, &prog)) ||
        (st = clmha__kernel_make(ctx, prog, "merge_partials", &k)))
        return st;
    cl_int err = m->num_wait ? clEnqueueBarrierWithWaitList(ctx->queue, m->num_wait,
                                                            m->wait_list, NULL)
                             : CL_SUCCESS;
    if (err != CL_SUCCESS) {
        clmha__release_kernel(k);
        return clmha__cl_fail(ctx, err, "clEnqueueBarrierWithWaitList");
    }
    cl_ulong a_off = m->heads_offset, la_off = m->lse_offset, b_off = m->other_heads_offset,
             lb_off = m->other_lse_offset, hd = m->head_dim, n = m->rows;
    arg args[] = {ARG(m->heads),     ARG(a_off),        ARG(m->lse),  ARG(la_off),
                  ARG(m->other_heads), ARG(b_off),      ARG(m->other_lse), ARG(lb_off),
                  ARG(hd),           ARG(n)};
    st = clmha__launch(ctx, k, "merge_partials", m->rows,
                       ctx->max_work_group < 64 ? ctx->max_work_group : 64, args,
                       sizeof args / sizeof args[0]);
    clmha__release_kernel(k);
    return st;
}

const clmha__core clmha__core_decode = {.name = "decode",
                                        .kv_cache = true,
                                        .grouped_kv = true,
                                        .takes_rows = true,
                                        .create = create,
                                        .release = release,
                                        .supports = supports,
                                        .uses_scores = false,
                                        .run = run,
                                        .merge = merge};
