// The host fused core: the fused core's computation (scores, softmax and weights·V with an
// online softmax, no scores stored) done by the CPU itself, in C (src/device/host_attention.c),
// from a native kernel in queue order, on the CPU devices whose products take the host path.
// It takes the plain calls only: CLMHA_IMPL_AUTO, head dimension 64, float32, no mask but
// is_causal or a boolean key_padding_mask (the masked keys left out of its copies; not both,
// and no attn_mask, float key_padding_mask, windows or user functions), no soft-capping,
// ALiBi, sinks, dropout, appended keys or KV cache, at least 128 query rows a sequence and 128
// keys with the AVX-512 kernel, 32 and 32 with the AVX2 one; every other call goes on to the
// fused core (cl/cores/fused.cl), as does CLMHA_IMPL_FUSED. It reads the projected rows
// (adding in_proj_bias) or the head tiles, and writes merged rows or head tiles, as the fused
// core does (clmha__core::reads_rows), and the log-sum-exp rows where the call asks for them
// as the fused core writes them (lse_on 1 or 2): a call that saves for the backward pass,
// whose backward is the fused core's, and partial attention.
#include "cores/host_fused.h"

#include "cores/core.h"

#include "base/checked.h"
#include "context/native.h"
#include "cores/kernel_args.h"
#include "device/host_attention.h"
#include "device/host_blas.h"

#include <stdlib.h>
#include <string.h>

// The most host memory a call's copies of the keys and values may take (all threads): past it
// the call goes on to the fused core.
#define HOST_FUSED_MAX_SCRATCH ((size_t)64 << 20)

static size_t calls;  // enqueued, for the tests

size_t clmha__host_fused_calls(void) { return __atomic_load_n(&calls, __ATOMIC_RELAXED); }

// The scratch floats of a call with @p keys keys (and a key_padding_mask: @p kpm) on a team
// of @p team, or 0 past the limit.
static size_t scratch_floats(size_t keys, bool kpm, size_t team) {
    size_t per = clmha__host_attention_scratch(keys, kpm), floats;
    return per && clmha__mul(per, team, &floats) && floats <= HOST_FUSED_MAX_SCRATCH / 4
               ? floats
               : 0;
}

// A call's arguments in its native kernel, whose buffers are q, k, v, out, in_proj_bias, the
// log-sum-exp rows and the key_padding_mask (the same buffer more than once on the rows path).
typedef struct host_call {
    clmha__host_attention a;  // its pointers set when it runs, its scratch freed then
    const clmha__host_blas *blas;
    size_t team;              // the threads the scratch has room for (the most that run)
    bool bias;                // the rows still lack in_proj_bias: add it
    bool lse;                 // write the log-sum-exp rows
    size_t bias_at[3];        // the query, key and value biases' first floats in in_proj_bias
    size_t kpm_at;            // the key_padding_mask's first byte (kpm_ld set: it has one)
} host_call;

static void team_member(void *arg, size_t t, size_t team) {
    clmha__host_attention_run(arg, t, team);
}

static void run_call(void *args, void *const *mem) {
    host_call *c = args;
    clmha__host_attention *a = &c->a;
    a->q = mem[0];
    a->k = mem[1];
    a->v = mem[2];
    a->out = mem[3];
    if (c->bias) {
        const float *b = mem[4];
        a->bq = b + c->bias_at[0];
        a->bk = b + c->bias_at[1];
        a->bv = b + c->bias_at[2];
    }
    if (c->lse) a->lse = mem[5];
    if (a->kpm_ld) a->kpm = (const unsigned char *)mem[6] + c->kpm_at;
    clmha__host_blas_team_run(c->blas, c->team, team_member, a);
    free(a->scratch);
}

// The fewest query rows a sequence and keys a call may have: the core copies each head's keys
// and values (the keys transposed) for its blocks of 12 rows, and wakes its team of threads,
// which smaller calls do not pay back. It depends on the kernel, against what PoCL makes of the
// OpenCL one on the same CPU. AVX-512, AMD EPYC, Zen 4, 2 cores, the forward's time with floors
// of 128 against 512, `clmha bench` medians of 8 alternated rounds: 0.88x at N 1, L 128, 0.97x
// at N 8, L 128, 0.88x at N 1, L 256, 0.77x at N 2, L 128 causal, the training step at N 8,
// L 128 0.99x; with floors of 64, N 4, L 64, S 1024 took 1.01x. (Under OpenMP's teams, before
// the host threads of device/host_pool.c, the stage took 1.05-1.2x the OpenCL kernel's time
// below 512 rows: the floor was 512.) AVX2, the same machine with AVX-512 hidden (PoCL's
// "haswell" code runs the OpenCL kernel at ~0.45 of the AVX2 kernel's speed), floors of 32
// against 128, paired medians of 6-8 rounds: N 4, L 64, S 1024 0.90x, N 2, L 64, S 256 0.84x,
// N 8, L 64 0.93x, N 8, L 32 0.87x, N 4, L 32, S 1024 0.99x.
size_t clmha__host_fused_floor(void) {
    const char *isa = clmha__host_attention_isa();
    return isa && strcmp(isa, "AVX2") == 0 ? 32 : 128;
}
// Why @p call is not a plain one (see the top of this file), or NULL when it is.
static const char *not_plain(const clmha_layer *l, const clmha__core_call *call) {
    const clmha_forward_args *a = call->args;
    const clmha__dims *d = call->dims;
    if (a->kv_cache) return "the call has a KV cache";
    bool kpm_bool = d->kpm_kind == CLMHA_MASK_BOOL_IGNORE || d->kpm_kind == CLMHA_MASK_BOOL_ATTEND;
    if (d->attn_kind || (d->kpm_kind && !kpm_bool) || clmha__windowed(d) || l->mods)
        return "the call has a mask other than is_causal or a boolean key_padding_mask";
    if (d->kpm_kind && a->is_causal) return "the call has both is_causal and a key_padding_mask";
    // (Partial attention's blocks at other positions: the fused core's case.)
    if (a->is_causal && d->q_pos != d->k_pos) return "is_causal at shifted positions";
    if (d->softcap != 0.0 || d->alibi || d->sinks) return "the call has a score variant";
    if (a->training && l->desc.dropout > 0.0f) return "the call has dropout";
    if (d->s_padded != d->s) return "the call has appended keys";
    size_t floor = clmha__host_fused_floor();
    if (d->l < floor || d->s < floor) return "too few query rows or keys";
    return NULL;
}

static clmha_status supports(clmha_layer *l, const clmha__core_call *call,
                             clmha__core_answer *answer) {
    const clmha__host_blas *hb = l->ctx->host_blas;
    const char *why = NULL;
    if (l->core) why = "the layer has a user core";
    else if (clmha__impl_of_call(l, call) != CLMHA_IMPL_AUTO) why = "the call names a core";
    else if (!hb || !clmha__host_blas_team(hb)) why = "no host path with an OpenMP team";
    else if (l->desc.dtype != CLMHA_DTYPE_F32 || !clmha__host_attention_fits(l->d))
        why = "it takes float32 heads of 64 on CPUs with AVX-512 or AVX2 only";
    else if (!(why = not_plain(l, call)) &&
             !scratch_floats(call->dims->s, call->dims->kpm_kind, clmha__host_blas_team(hb)))
        why = "its copies of the keys and values would take more than 64 MiB";
    if (why)
        clmha__core_answer_set(answer, CLMHA__CORE_PASSES, CLMHA_SUCCESS, "%s", why);
    else
        clmha__core_runs(answer);
    return CLMHA_SUCCESS;
}

static clmha_status run(clmha_layer *l, clmha__core_call *call) {
    const clmha__dims *d = call->dims;
    clmha_context *ctx = l->ctx;
    size_t hd = l->d, kvh = l->h / (call->kv_group ? call->kv_group : 1);
    host_call c = {.blas = ctx->host_blas};
    clmha__host_attention *a = &c.a;
    a->batch = d->n;
    a->heads = l->h;
    a->kv_group = l->h / kvh;
    a->rows = d->l;
    a->keys = d->s;
    a->scale = (float)clmha__core_scale(l, call->scale);
    a->causal = call->args->is_causal;
    cl_mem bufs[7] = {l->tiles[CLMHA__TILE_Q], l->tiles[CLMHA__TILE_K], l->tiles[CLMHA__TILE_V],
                      l->tiles[CLMHA__TILE_OUT], ctx->dummy, ctx->dummy, ctx->dummy};
    if (d->kpm_kind) {  // (N, S) or (S) bytes, at the tensor's offset (elements: bytes)
        const clmha_tensor *m = &call->args->key_padding_mask.tensor;
        bufs[6] = m->buffer;
        c.kpm_at = m->offset;
        a->kpm_ld = d->s;
        a->kpm_attend = d->kpm_kind == CLMHA_MASK_BOOL_ATTEND;
    }
    cl_ulong4 at[4] = {{{0, l->h * d->l * hd, d->l * hd, hd}},
                       {{0, kvh * d->s_padded * hd, d->s_padded * hd, hd}}};
    at[2] = at[1];
    at[3] = at[0];
    if (call->rows) {
        bufs[0] = bufs[1] = bufs[2] = l->proj;
        at[0] = clmha__rows_at(d, call->q_at, call->q_ld, hd, d->l);
        at[1] = clmha__rows_at(d, call->k_at, call->k_ld, hd, d->s);
        at[2] = clmha__rows_at(d, call->v_at, call->v_ld, hd, d->s);
        at[3] = clmha__rows_at(d, 0, l->e, hd, d->l);
        if (l->desc.bias) {
            c.bias = true;
            bufs[4] = l->b_in;
            c.bias_at[1] = l->e;
            c.bias_at[2] = l->e + l->kve;
        }
    }
    if (call->lse) {  // (N*H*L floats, 3 times that with lse_split: clmha__core_call)
        c.lse = true;
        bufs[5] = call->lse;
        a->lse_split = call->lse_split ? d->n * l->h * d->l : 0;
    }
    size_t *dst[4] = {a->q_at, a->k_at, a->v_at, a->o_at};
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) dst[i][j] = (size_t)at[i].s[j];
    c.team = clmha__host_blas_team(c.blas);
    size_t floats = scratch_floats(d->s, d->kpm_kind, c.team);
    if (!floats)
        return clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "the host fused core's scratch is too large");
    a->scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!a->scratch) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    clmha_status st = clmha__native_run(ctx, "host fused attention", run_call, &c, sizeof c,
                                        bufs, 7);
    if (st) {
        free(a->scratch);
        return st;
    }
    __atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED);
    call->lse_written = c.lse;
    call->lse_split_written = c.lse && call->lse_split;
    return clmha__layer_mark(l, 1 + CLMHA_STAGE_FUSED);
}

const clmha__core clmha__core_host_fused = {.name = "host_fused",
                                            .impl = CLMHA_IMPL_AUTO,
                                            .grouped_kv = true,
                                            .reads_rows = true,
                                            .supports = supports,
                                            .writes_lse = true,
                                            .uses_scores = false,
                                            .run = run};
