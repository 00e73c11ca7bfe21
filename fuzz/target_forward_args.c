// Fuzz target: the forward call's arguments: shape checks and the CPU reference (see targets.h).
#include "targets.h"

#include "layer/shape.h"

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"

// ---- forward arguments -----------------------------------------------------------------------
//
// The input is read front to back; bytes past its end read as 0. Layout:
//   embed_dim num_heads kdim vdim   4 sizes (see clmha_fuzz_size)
//   layer flags                     bit 0 bias, 1 add_bias_kv, 2 add_zero_attn, 3 batch_first
//   dropout                         1 byte (table), 0xFF: 4 raw bytes of a float follow
//   L N S                           3 sizes; with the layer they make the "coherent" shapes
//   batched                         bit 0: 3-D inputs, else 2-D (unbatched)
//   query key value                 each a tensor spec (see clmha_fuzz_tensor_spec)
//   key_padding_mask attn_mask      each: kind byte, per_batch byte, tensor spec
//   call flags                      bit 0 is_causal, 1 need_weights, 2 per_head_weights,
//                                   3 training
//   reference variant               bit 3: q/k/v_proj_weight even when in_proj_weight could
//                                   be used; bits 0-2 and 4-6 pick one change to a correct
//                                   call (see clmha_fuzz_reference): 0 none, 4 output_count + 1,
//                                   5 query.data NULL, 6 weights_count + 1, 7 no out_proj_weight,
//                                   0x10 no in_proj_bias, 0x11 no bias_k, 0x12 output NULL,
//                                   0x13 weights NULL, 0x14 in_proj_weight alone (kdim or vdim
//                                   != E), 0x15 in_proj_weight and q/k/v_proj_weight
//   data seed                       1 byte
//   rng seed, rng offset            2 x 8 bytes

typedef struct clmha_fuzz_reader {
    const uint8_t *p;
    size_t n;
} clmha_fuzz_reader;

static uint8_t clmha_fuzz_u8(clmha_fuzz_reader *r) {
    if (!r->n) return 0;
    --r->n;
    return *r->p++;
}

static uint64_t clmha_fuzz_u64(clmha_fuzz_reader *r, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= (uint64_t)clmha_fuzz_u8(r) << (8 * i);
    return v;
}

// One size: 0x00-0x7F: 0-7 (low 3 bits); 0x80-0x9F: 0-31; 0xA0-0xBF: 2 more bytes (LE);
// 0xC0-0xDF: a value near an overflow boundary; 0xE0-0xFF: 8 more bytes (LE).
static size_t clmha_fuzz_size(clmha_fuzz_reader *r) {
    static const size_t special[32] = {
        SIZE_MAX,          SIZE_MAX - 1,           SIZE_MAX / 2,        SIZE_MAX / 2 + 1,
        SIZE_MAX / 3,      SIZE_MAX / 3 + 1,       SIZE_MAX / 4,        SIZE_MAX / 4 + 1,
        SIZE_MAX / 8,      SIZE_MAX / 8 + 1,       SIZE_MAX / 12 + 1,   SIZE_MAX / 16 + 1,
        SIZE_MAX / 24 + 1, (size_t)1 << 32,        ((size_t)1 << 32) + 1, (size_t)1 << 31,
        (size_t)1 << 30,   (size_t)1 << 21,        ((size_t)1 << 21) + 1, (size_t)1 << 16,
        65537,             4294967295u,            3037000500u,         2642246,
        (size_t)1 << 62,   ((size_t)1 << 61) + 1,  (size_t)1 << 42,     1431655766,
        2,                 3,                      6,                   12};
    uint8_t b = clmha_fuzz_u8(r);
    if (b < 0x80) return b & 7;
    if (b < 0xA0) return b & 31;
    if (b < 0xC0) return (size_t)clmha_fuzz_u64(r, 2);
    if (b < 0xE0) return special[b & 31];
    return (size_t)clmha_fuzz_u64(r, 8);
}

// A number of dimensions: 0xF8-0xFF give out-of-range values, else 0-4.
static size_t clmha_fuzz_ndim(clmha_fuzz_reader *r) {
    static const size_t special[8] = {5, 6, 8, 16, 255, SIZE_MAX / 2, SIZE_MAX - 1, SIZE_MAX};
    uint8_t b = clmha_fuzz_u8(r);
    return b >= 0xF8 ? special[b & 7] : b % 5;
}

// A mask kind: 0xF8-0xFF give values outside the enum, else 0-3.
static clmha_mask_kind clmha_fuzz_kind(clmha_fuzz_reader *r) {
    static const unsigned special[8] = {4, 5, 16, 255, 0x7FFFFFFFu, 0x80000000u, 0xFFFFFFFEu,
                                        0xFFFFFFFFu};
    uint8_t b = clmha_fuzz_u8(r);
    unsigned v = b >= 0xF8 ? special[b & 7] : b & 3u;
    return (clmha_mask_kind)v;
}

// The coherent shapes of the call (wrapping products: they are only proposals).
typedef struct clmha_fuzz_plan {
    size_t e, kdim, vdim, h, l, n, s;
    bool batched, batch_first;
} clmha_fuzz_plan;

enum { CLMHA_FUZZ_Q, CLMHA_FUZZ_K, CLMHA_FUZZ_V, CLMHA_FUZZ_KPM, CLMHA_FUZZ_ATTN };

// A tensor spec: one byte, low 2 bits the mode: 0 the coherent shape; 1 the coherent shape with
// dimension (next byte % 4) set to a size; 2 an arbitrary ndim and 4 sizes; 3 absent (ndim 0).
// For attn_mask, bits 2-3 pick the coherent layout: (L, S), (N*H, L, S) or (H, L, S)
// unbatched, (N, L, S), (H, L, S).
static void clmha_fuzz_tensor_spec(clmha_fuzz_reader *r, const clmha_fuzz_plan *p,
                                          int which, clmha_tensor *t) {
    uint8_t spec = clmha_fuzz_u8(r);
    memset(t, 0, sizeof *t);
    int mode = spec & 3;
    if (mode == 3) return;
    if (mode == 2) {
        t->ndim = clmha_fuzz_ndim(r);
        for (int i = 0; i < 4; ++i) t->shape[i] = clmha_fuzz_size(r);
        return;
    }
    size_t feat = which == CLMHA_FUZZ_Q ? p->e : which == CLMHA_FUZZ_K ? p->kdim : p->vdim;
    size_t seq = which == CLMHA_FUZZ_Q ? p->l : p->s;
    switch (which) {
    case CLMHA_FUZZ_Q:
    case CLMHA_FUZZ_K:
    case CLMHA_FUZZ_V:
        if (!p->batched) {
            t->ndim = 2, t->shape[0] = seq, t->shape[1] = feat;
        } else if (p->batch_first) {
            t->ndim = 3, t->shape[0] = p->n, t->shape[1] = seq, t->shape[2] = feat;
        } else {
            t->ndim = 3, t->shape[0] = seq, t->shape[1] = p->n, t->shape[2] = feat;
        }
        break;
    case CLMHA_FUZZ_KPM:
        if (p->batched) t->ndim = 2, t->shape[0] = p->n, t->shape[1] = p->s;
        else t->ndim = 1, t->shape[0] = p->s;
        break;
    default:
        switch ((spec >> 2) & 3) {
        case 0:
            t->ndim = 2, t->shape[0] = p->l, t->shape[1] = p->s;
            break;
        case 1:
            t->ndim = 3, t->shape[0] = p->batched ? p->n * p->h : p->h;
            t->shape[1] = p->l, t->shape[2] = p->s;
            break;
        case 2:
            t->ndim = 3, t->shape[0] = p->n, t->shape[1] = p->l, t->shape[2] = p->s;
            break;
        default:
            t->ndim = 3, t->shape[0] = p->h, t->shape[1] = p->l, t->shape[2] = p->s;
            break;
        }
        break;
    }
    if (mode == 1) {
        uint8_t i = clmha_fuzz_u8(r);
        t->shape[i % 4] = clmha_fuzz_size(r);
    }
}

// Mask data of @p count elements for @p kind, in a buffer of exactly that size.
static void *clmha_fuzz_mask_data(uint64_t *state, clmha_mask_kind kind, size_t count) {
    if (!count) return NULL;
    if (kind == CLMHA_MASK_FLOAT) {
        static const float values[8] = {0.0f, 0.0f, 0.0f, -1.0f, 0.5f, 3.0f, -1e30f, -INFINITY};
        float *v = malloc(count * sizeof *v);
        if (!v) return NULL;
        for (size_t i = 0; i < count; ++i) v[i] = values[clmha_fuzz_next(state) & 7];
        return v;
    }
    unsigned char *v = malloc(count);
    if (!v) return NULL;
    for (size_t i = 0; i < count; ++i) v[i] = (unsigned char)((clmha_fuzz_next(state) & 3) == 0);
    return v;
}

// Checks what clmha__dims_resolve() promises about a call it accepted.
static void clmha_fuzz_check_dims(const clmha_layer_desc *desc,
                                         const clmha_forward_args *args, const clmha__dims *d) {
    size_t t;
    CLMHA_FUZZ_CHECK(d->n >= 1 && d->l >= 1 && d->s >= 1);
    CLMHA_FUZZ_CHECK(d->e == desc->embed_dim && d->h == desc->num_heads);
    CLMHA_FUZZ_CHECK(d->kdim == desc->kdim && d->vdim == desc->vdim);
    CLMHA_FUZZ_CHECK(d->h >= 1 && d->d >= 1 && d->d * d->h == d->e);
    CLMHA_FUZZ_CHECK(d->batched == (args->query.ndim == 3));
    CLMHA_FUZZ_CHECK(d->batch_first == (d->batched && desc->batch_first));
    if (!d->batched) CLMHA_FUZZ_CHECK(d->n == 1);
    CLMHA_FUZZ_CHECK(d->key_is_query == (args->key.ndim == 0));
    CLMHA_FUZZ_CHECK(d->value_is_key == (args->value.ndim == 0));
    CLMHA_FUZZ_CHECK(d->s_padded == d->s + desc->add_bias_kv + desc->add_zero_attn);

    // Element counts: the shapes' products, and what N, L, S and the features imply.
    const clmha_tensor *q = &args->query;
    const clmha_tensor *k = d->key_is_query ? q : &args->key;
    const clmha_tensor *v = d->value_is_key ? k : &args->value;
    const clmha_tensor *in[3] = {q, k, v};
    const size_t counts[3] = {d->query_count, d->key_count, d->value_count};
    const size_t feat[3] = {d->e, d->kdim, d->vdim}, seq[3] = {d->l, d->s, d->s};
    for (int i = 0; i < 3; ++i) {
        CLMHA_FUZZ_CHECK(in[i]->ndim == q->ndim);
        CLMHA_FUZZ_CHECK(!clmha_fuzz_prod_overflows(in[i]->shape, in[i]->ndim, &t));
        CLMHA_FUZZ_CHECK(t == counts[i] && t <= SIZE_MAX / sizeof(double));
        size_t want[3] = {seq[i], d->n, feat[i]};
        CLMHA_FUZZ_CHECK(!clmha_fuzz_prod_overflows(want, 3, &t) && t == counts[i]);
        CLMHA_FUZZ_CHECK(in[i]->shape[in[i]->ndim - 1] == feat[i]);
        if (d->batched) {
            CLMHA_FUZZ_CHECK(in[i]->shape[d->batch_first ? 0 : 1] == d->n);
            CLMHA_FUZZ_CHECK(in[i]->shape[d->batch_first ? 1 : 0] == seq[i]);
        } else {
            CLMHA_FUZZ_CHECK(in[i]->shape[0] == seq[i]);
        }
    }

    // Outputs, with nothing wrapped around.
    size_t nl, out, nh, scores;
    CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(d->n, d->l, &nl));
    CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(nl, d->e, &out) && out == d->output_count);
    CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(d->n, d->h, &nh));
    CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(nh, d->l, &t));
    CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(t, d->s_padded, &scores) &&
                     scores == d->scores_count);
    CLMHA_FUZZ_CHECK(d->output_count <= SIZE_MAX / sizeof(double));
    CLMHA_FUZZ_CHECK(d->scores_count <= SIZE_MAX / sizeof(double));
    if (!args->need_weights) {
        CLMHA_FUZZ_CHECK(d->weights_count == 0);
    } else if (args->per_head_weights) {
        CLMHA_FUZZ_CHECK(d->weights_count == d->scores_count);
    } else {
        CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(nl, d->s_padded, &t) && t == d->weights_count);
    }
    // The sizes of every buffer derived from these (bytes of doubles) are representable.
    size_t bytes;
    CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(d->weights_count, sizeof(double), &bytes));
    CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(d->query_count, sizeof(double), &bytes));
    CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(d->key_count, sizeof(double), &bytes));
    CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(d->value_count, sizeof(double), &bytes));

    // Masks.
    const clmha_mask *kpm = &args->key_padding_mask, *am = &args->attn_mask;
    CLMHA_FUZZ_CHECK(d->kpm_kind == kpm->kind && d->attn_kind == am->kind);
    CLMHA_FUZZ_CHECK((unsigned)d->kpm_kind <= CLMHA_MASK_FLOAT);
    CLMHA_FUZZ_CHECK((unsigned)d->attn_kind <= CLMHA_MASK_FLOAT);
    if (kpm->kind == CLMHA_MASK_NONE) {
        CLMHA_FUZZ_CHECK(d->kpm_count == 0 && kpm->tensor.ndim == 0 && !kpm->per_batch);
    } else {
        CLMHA_FUZZ_CHECK(!kpm->per_batch);
        CLMHA_FUZZ_CHECK(kpm->tensor.ndim == (d->batched ? 2u : 1u));
        CLMHA_FUZZ_CHECK(!clmha_fuzz_prod_overflows(kpm->tensor.shape, kpm->tensor.ndim, &t));
        CLMHA_FUZZ_CHECK(t == d->kpm_count && d->kpm_count == d->n * d->s);
    }
    if (am->kind == CLMHA_MASK_NONE) {
        CLMHA_FUZZ_CHECK(!d->attn_sn && !d->attn_sh && !d->attn_si && d->attn_count == 0);
        CLMHA_FUZZ_CHECK(am->tensor.ndim == 0 && !am->per_batch);
    } else {
        CLMHA_FUZZ_CHECK(!clmha_fuzz_prod_overflows(am->tensor.shape, am->tensor.ndim, &t));
        CLMHA_FUZZ_CHECK(t == d->attn_count);
        size_t ls = d->l * d->s;  // <= scores_count, cannot wrap
        // The strides address exactly the mask's elements: the last score's term is its last.
        CLMHA_FUZZ_CHECK((d->n - 1) * d->attn_sn + (d->h - 1) * d->attn_sh +
                             (d->l - 1) * d->attn_si + d->s == t);
        if (am->per_batch)
            CLMHA_FUZZ_CHECK(d->batched && am->tensor.ndim == 3 && t == d->n * ls &&
                             d->attn_sh == 0);
        else if (am->tensor.ndim == 2)
            CLMHA_FUZZ_CHECK(t == ls && d->attn_sn == 0 && d->attn_sh == 0);
        else
            CLMHA_FUZZ_CHECK(am->tensor.ndim == 3 && t == nh * ls);
    }
}

// Runs the CPU reference on a small accepted call with data of exactly the sizes the shapes
// need, correct or with one change that it must refuse (see the layout above), and checks the
// status and, for a correct call, the result.
static void clmha_fuzz_reference(const clmha_layer_desc *desc, clmha_forward_args args,
                                        const clmha__dims *d, unsigned variant, uint64_t seed) {
    const size_t e = d->e;
    // Cost bound (elements and multiply-adds), computed without overflow.
    size_t terms[] = {d->query_count, d->key_count, d->value_count, d->kpm_count, d->attn_count,
                      d->output_count, d->weights_count, d->scores_count};
    size_t total = 0, t;
    for (size_t i = 0; i < sizeof terms / sizeof *terms; ++i)
        if (__builtin_add_overflow(total, terms[i], &total)) return;
    size_t widest = e > d->kdim ? e : d->kdim;
    widest = widest > d->vdim ? widest : d->vdim;
    if (__builtin_mul_overflow(e, widest, &t) || __builtin_mul_overflow(t, (size_t)4, &t) ||
        __builtin_add_overflow(total, t, &total) || total > 4096)
        return;
    size_t rows = d->n * (d->l + 2 * d->s), flops;  // all small now
    if (__builtin_mul_overflow(rows, e * widest, &flops) || flops > ((size_t)1 << 18)) return;
    if (d->scores_count * d->d > ((size_t)1 << 18)) return;

    uint64_t state = seed;
    clmha_reference_params params = {.struct_size = sizeof params};
    const bool packed = e == d->kdim && e == d->vdim && (variant & 8) == 0;
    float *w_in = NULL, *w_q = NULL, *w_k = NULL, *w_v = NULL, *b_in = NULL, *w_out = NULL,
          *b_out = NULL, *b_k = NULL, *b_v = NULL;
    float *q = NULL, *k = NULL, *v = NULL;
    void *kpm = NULL, *am = NULL;
    double *out = NULL, *weights = NULL;
    if (packed) {
        w_in = clmha_fuzz_uniform(&state, 3 * e * e, 0.5f);
        if (!w_in) goto done;
    } else {
        w_q = clmha_fuzz_uniform(&state, e * e, 0.5f);
        w_k = clmha_fuzz_uniform(&state, e * d->kdim, 0.5f);
        w_v = clmha_fuzz_uniform(&state, e * d->vdim, 0.5f);
        if (!w_q || !w_k || !w_v) goto done;
    }
    w_out = clmha_fuzz_uniform(&state, e * e, 0.5f);
    if (!w_out) goto done;
    if (desc->bias) {
        b_in = clmha_fuzz_uniform(&state, 3 * e, 0.5f);
        b_out = clmha_fuzz_uniform(&state, e, 0.5f);
        if (!b_in || !b_out) goto done;
    }
    if (desc->add_bias_kv) {
        b_k = clmha_fuzz_uniform(&state, e, 0.5f);
        b_v = clmha_fuzz_uniform(&state, e, 0.5f);
        if (!b_k || !b_v) goto done;
    }
    params = (clmha_reference_params){.struct_size = sizeof(clmha_reference_params),
                                      .in_proj_weight = w_in, .q_proj_weight = w_q,
                                      .k_proj_weight = w_k, .v_proj_weight = w_v,
                                      .in_proj_bias = b_in, .out_proj_weight = w_out,
                                      .out_proj_bias = b_out, .bias_k = b_k, .bias_v = b_v};

    q = clmha_fuzz_uniform(&state, d->query_count, 1.0f);
    if (!q) goto done;
    args.query.data = q;
    if (!d->key_is_query) {
        if (!(k = clmha_fuzz_uniform(&state, d->key_count, 1.0f))) goto done;
        args.key.data = k;
    }
    if (!d->value_is_key) {
        if (!(v = clmha_fuzz_uniform(&state, d->value_count, 1.0f))) goto done;
        args.value.data = v;
    }
    if (d->kpm_kind) {
        if (!(kpm = clmha_fuzz_mask_data(&state, d->kpm_kind, d->kpm_count))) goto done;
        args.key_padding_mask.tensor.data = kpm;
    }
    if (d->attn_kind) {
        if (!(am = clmha_fuzz_mask_data(&state, d->attn_kind, d->attn_count))) goto done;
        args.attn_mask.tensor.data = am;
    }
    out = malloc(d->output_count * sizeof *out);
    if (!out) goto done;
    if (d->weights_count && !(weights = malloc(d->weights_count * sizeof *weights))) goto done;

    size_t out_count = d->output_count, w_count = d->weights_count;
    double *out_arg = out, *weights_arg = weights;
    clmha_status want = CLMHA_SUCCESS;
    const bool square = e == d->kdim && e == d->vdim;
    switch ((variant & 7) | ((variant >> 1) & 0x38)) {
    case 4:
        out_count += 1, want = CLMHA_SHAPE_MISMATCH;
        break;
    case 5:
        args.query.data = NULL, want = CLMHA_INVALID_ARGUMENT;
        break;
    case 6:
        w_count += 1, want = CLMHA_SHAPE_MISMATCH;
        break;
    case 7:
        params.out_proj_weight = NULL, want = CLMHA_INVALID_ARGUMENT;
        break;
    case 8:
        params.in_proj_bias = NULL;
        if (desc->bias) want = CLMHA_INVALID_ARGUMENT;
        break;
    case 9:
        params.bias_k = NULL;
        if (desc->add_bias_kv) want = CLMHA_INVALID_ARGUMENT;
        break;
    case 10:
        out_arg = NULL, want = CLMHA_INVALID_ARGUMENT;
        break;
    case 11:
        weights_arg = NULL;
        if (args.need_weights) want = CLMHA_INVALID_ARGUMENT;
        break;
    case 12:  // in_proj_weight alone, for a layer that cannot use it (never read)
        if (!square) {
            params.in_proj_weight = w_q;
            params.q_proj_weight = params.k_proj_weight = params.v_proj_weight = NULL;
            want = CLMHA_INVALID_ARGUMENT;
        }
        break;
    case 13:  // in_proj_weight as well as q/k/v_proj_weight: the separate ones are used
        if (!square) params.in_proj_weight = w_q;
        break;
    default:
        break;
    }
    char msg[512] = "";
    clmha_status st = clmha_reference_forward(desc, &params, &args, out_arg, out_count,
                                              weights_arg, w_count, msg, sizeof msg);
    CLMHA_FUZZ_CHECK(st == want);
    if (st != CLMHA_SUCCESS) {
        CLMHA_FUZZ_CHECK(msg[0] != '\0');
        goto done;
    }

    // Finite outputs (inputs, weights and masks are finite or -inf); attention weights are
    // non-negative and each per-head row sums to 0 (fully masked) or 1 (without dropout).
    for (size_t i = 0; i < d->output_count; ++i) CLMHA_FUZZ_CHECK(isfinite(out[i]));
    for (size_t i = 0; i < d->weights_count; ++i)
        CLMHA_FUZZ_CHECK(isfinite(weights[i]) && weights[i] >= 0.0);
    if (weights && !(args.training && desc->dropout > 0.0f)) {
        size_t sp = d->s_padded;
        for (size_t row = 0; row < d->weights_count / sp; ++row) {
            double sum = 0.0;
            for (size_t j = 0; j < sp; ++j) sum += weights[row * sp + j];
            if (args.per_head_weights) CLMHA_FUZZ_CHECK(sum == 0.0 || fabs(sum - 1.0) < 1e-9);
            else CLMHA_FUZZ_CHECK(sum <= 1.0 + 1e-9);
        }
    }
done:
    free(w_in), free(w_q), free(w_k), free(w_v), free(b_in), free(w_out), free(b_out);
    free(b_k), free(b_v), free(q), free(k), free(v), free(kpm), free(am), free(out);
    free(weights);
}

int clmha_fuzz_forward_args(const uint8_t *data, size_t size) {
    static const float dropouts[16] = {0.0f, 0.0f, 0.1f, 0.5f, 0.999f, 0.99999994f, 1.0f, -0.0f,
                                       -0.1f, 1e-30f, 1.5f, INFINITY, -INFINITY, NAN, 1e-45f,
                                       0.25f};
    clmha_fuzz_reader r = {data, size};
    clmha_layer_desc desc = {.struct_size = sizeof desc};
    desc.embed_dim = clmha_fuzz_size(&r);
    desc.num_heads = clmha_fuzz_size(&r);
    desc.kdim = clmha_fuzz_size(&r);
    desc.vdim = clmha_fuzz_size(&r);
    uint8_t lf = clmha_fuzz_u8(&r);
    desc.bias = lf & 1, desc.add_bias_kv = (lf >> 1) & 1, desc.add_zero_attn = (lf >> 2) & 1;
    desc.batch_first = (lf >> 3) & 1;
    uint8_t db = clmha_fuzz_u8(&r);
    if (db == 0xFF) {
        uint32_t bits = (uint32_t)clmha_fuzz_u64(&r, 4);
        memcpy(&desc.dropout, &bits, sizeof bits);
    } else {
        desc.dropout = dropouts[db & 15];
    }

    clmha_fuzz_plan plan = {.e = desc.embed_dim,
                            .kdim = desc.kdim ? desc.kdim : desc.embed_dim,
                            .vdim = desc.vdim ? desc.vdim : desc.embed_dim,
                            .h = desc.num_heads};
    plan.l = clmha_fuzz_size(&r);
    plan.n = clmha_fuzz_size(&r);
    plan.s = clmha_fuzz_size(&r);
    plan.batched = clmha_fuzz_u8(&r) & 1;
    plan.batch_first = desc.batch_first;

    clmha_forward_args args;
    memset(&args, 0, sizeof args);
    args.struct_size = sizeof args;
    clmha_fuzz_tensor_spec(&r, &plan, CLMHA_FUZZ_Q, &args.query);
    clmha_fuzz_tensor_spec(&r, &plan, CLMHA_FUZZ_K, &args.key);
    clmha_fuzz_tensor_spec(&r, &plan, CLMHA_FUZZ_V, &args.value);
    clmha_mask *masks[2] = {&args.key_padding_mask, &args.attn_mask};
    for (int i = 0; i < 2; ++i) {
        masks[i]->kind = clmha_fuzz_kind(&r);
        masks[i]->per_batch = clmha_fuzz_u8(&r) & 1;
        clmha_fuzz_tensor_spec(&r, &plan, i ? CLMHA_FUZZ_ATTN : CLMHA_FUZZ_KPM,
                               &masks[i]->tensor);
    }
    uint8_t cf = clmha_fuzz_u8(&r);
    args.is_causal = cf & 1, args.need_weights = (cf >> 1) & 1;
    args.per_head_weights = (cf >> 2) & 1, args.training = (cf >> 3) & 1;
    unsigned variant = clmha_fuzz_u8(&r);
    uint64_t seed = clmha_fuzz_u8(&r);
    args.rng.seed = clmha_fuzz_u64(&r, 8);
    args.rng.offset = clmha_fuzz_u64(&r, 8);

    // 1. The descriptor.
    char msg[512] = "";
    clmha_layer_desc checked;
    clmha_status st = clmha__desc_check(&desc, &checked, msg, sizeof msg);
    if (st != CLMHA_SUCCESS) {
        CLMHA_FUZZ_CHECK(st == CLMHA_INVALID_ARGUMENT || st == CLMHA_SIZE_OVERFLOW);
        CLMHA_FUZZ_CHECK(msg[0] != '\0');
        // The reference refuses it the same way before touching anything.
        clmha_status rst = clmha_reference_forward(&desc, NULL, &args, NULL, 0, NULL, 0, NULL, 0);
        CLMHA_FUZZ_CHECK(rst == st);
        return st;
    }
    CLMHA_FUZZ_CHECK(checked.embed_dim == desc.embed_dim && checked.num_heads == desc.num_heads);
    CLMHA_FUZZ_CHECK(checked.kdim == (desc.kdim ? desc.kdim : desc.embed_dim));
    CLMHA_FUZZ_CHECK(checked.vdim == (desc.vdim ? desc.vdim : desc.embed_dim));
    CLMHA_FUZZ_CHECK(checked.num_heads >= 1 && checked.embed_dim % checked.num_heads == 0);
    CLMHA_FUZZ_CHECK(checked.dropout >= 0.0f && checked.dropout < 1.0f);
    {
        size_t widest = checked.embed_dim, t;
        if (checked.kdim > widest) widest = checked.kdim;
        if (checked.vdim > widest) widest = checked.vdim;
        CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(checked.embed_dim, widest, &t) &&
                         !__builtin_mul_overflow(t, 3 * sizeof(float), &t));
    }

    // 2. The call.
    clmha__dims d;
    st = clmha__dims_resolve(&checked, &args, &d, msg, sizeof msg);
    if (st != CLMHA_SUCCESS) {
        CLMHA_FUZZ_CHECK(st == CLMHA_SHAPE_MISMATCH || st == CLMHA_INVALID_MASK ||
                         st == CLMHA_SIZE_OVERFLOW || st == CLMHA_INVALID_ARGUMENT);
        CLMHA_FUZZ_CHECK(msg[0] != '\0');
        // The reference runs the same checks first (its params are checked after them).
        char rmsg[512] = "";
        clmha_status rst = clmha_reference_forward(&desc, NULL, &args, NULL, 0, NULL, 0, rmsg,
                                                   sizeof rmsg);
        CLMHA_FUZZ_CHECK(rst == st && strcmp(rmsg, msg) == 0);
        return st;
    }
    clmha_fuzz_check_dims(&checked, &args, &d);
    // Without data, the host path refuses the call by naming the query.
    CLMHA_FUZZ_CHECK(clmha__check_host_data(&d, &args, NULL, 0) == CLMHA_INVALID_ARGUMENT);

    // 3. Small calls through the CPU reference (given the unchecked descriptor, as a user would).
    clmha_fuzz_reference(&desc, args, &d, variant, seed);
    return CLMHA_SUCCESS;
}
