// Fuzz target: the backward call's arguments, run on the device and checked against the CPU
// reference's backward (see targets.h).
#include "targets.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"

// ---- input layout ----------------------------------------------------------------------------
//
// Read front to back; bytes past the end read as 0 (a short input is a small plain call).
//   seed         1 byte: parameters, inputs, masks and gradients
//   e_h          bits 0-1 E (4, 8, 8, 16), bits 2-3 H (1, 2, 4, 2), bit 4 grouped-query
//                attention (num_kv_heads H/2), bits 5-6 kdim (E, E, 4, 12), bit 7 vdim 12
//   layer        bit 0 bias, 1 add_bias_kv, 2 add_zero_attn, 3 batch_first, 4 sinks,
//                5 softcap, 6 ALiBi, 7 sliding window
//   window       bits 0-3 left - 1, bits 4-7 right - 1 (-1: unbounded); dropout: bits 0-1 of
//                the next byte (0, 0, 0.25, 0.5)
//   L S N        1 + byte % 6, 1 + byte % 6, 1 + byte % 3
//   form         bit 0 batched, 1 self-attention (no key, no value), 2 no value, 3 even where
//                the layer's kdim and vdim forbid that
//   masks        bits 0-1 key_padding_mask kind, 2-3 attn_mask kind, 4-5 attn_mask layout
//                ((L, S), per head (N*H, L, S) / (H, L, S), per batch (N, L, S))
//   call         bit 0 is_causal, 1 need_weights, 2 per_head_weights, 3 training,
//                4-5 impl (auto, fused, unfused, auto), 6 grad_weights, 7 accumulate
//   grads        2 bytes: bit i asks for gradient i of grad_names (those the call has)
//                (bit 15: the backward core unfused, else the forward's)
//   breakage     0x00-0x7F none; else one change that must be refused (see break_call)

enum { GRADS = 15 };

// The gradients in clmha_backward_args order (and clmha_reference_grads').
static const char *const grad_names[GRADS] = {
    "query",        "key",           "value",           "in_proj_weight", "q_proj_weight",
    "k_proj_weight", "v_proj_weight", "in_proj_bias",   "out_proj.weight", "out_proj.bias",
    "bias_k",       "bias_v",        "attn_mask",       "key_padding_mask", "sinks"};

static clmha_grad *grad_slot(clmha_backward_args *b, int i) {
    clmha_grad *slots[GRADS] = {&b->query,           &b->key,           &b->value,
                                &b->in_proj_weight,  &b->q_proj_weight, &b->k_proj_weight,
                                &b->v_proj_weight,   &b->in_proj_bias,  &b->out_proj_weight,
                                &b->out_proj_bias,   &b->bias_k,        &b->bias_v,
                                &b->attn_mask,       &b->key_padding_mask, &b->sinks};
    return slots[i];
}

static double **reference_slot(clmha_reference_grads *g, int i) {
    double **slots[GRADS] = {&g->query,          &g->key,           &g->value,
                             &g->in_proj_weight, &g->q_proj_weight, &g->k_proj_weight,
                             &g->v_proj_weight,  &g->in_proj_bias,  &g->out_proj_weight,
                             &g->out_proj_bias,  &g->bias_k,        &g->bias_v,
                             &g->attn_mask,      &g->key_padding_mask, &g->sinks};
    return slots[i];
}

// One call: its shapes, its arrays and its gradients' destinations.
typedef struct call {
    size_t e, l, s, n, kdim, vdim;
    bool batched, has_key, has_value;
    uint8_t flags;  // the call byte
    clmha_forward_args fwd;
    float *q, *k, *v, *kpm, *am;  // float masks as floats, boolean ones as bytes (same buffer)
    float *dy, *dw;               // grad_output, grad_weights
    size_t out_count, weights_count;
    float *grad[GRADS];           // destinations, their values before the call in before[]
    float *before[GRADS];
    size_t grad_count[GRADS];
} call;

static void input_shape(const call *c, bool batch_first, size_t seq, size_t feat,
                        clmha_tensor *t) {
    if (!c->batched) {
        t->ndim = 2, t->shape[0] = seq, t->shape[1] = feat;
    } else if (batch_first) {
        t->ndim = 3, t->shape[0] = c->n, t->shape[1] = seq, t->shape[2] = feat;
    } else {
        t->ndim = 3, t->shape[0] = seq, t->shape[1] = c->n, t->shape[2] = feat;
    }
}

static size_t tensor_count(const clmha_tensor *t) {
    size_t c = t->ndim ? 1 : 0;
    for (size_t i = 0; i < t->ndim; ++i) c *= t->shape[i];
    return c;
}

// Mask values: floats from a small table (-inf forbids), bytes forbidding one key in four.
static void *mask_values(uint64_t *state, clmha_mask_kind kind, size_t count) {
    static const float table[8] = {0.0f, 0.0f, 0.0f, -1.0f, 0.5f, 2.0f, -1e30f, -INFINITY};
    if (!count || kind == CLMHA_MASK_NONE) return NULL;
    if (kind == CLMHA_MASK_FLOAT) {
        float *v = malloc(count * sizeof *v);
        if (v)
            for (size_t i = 0; i < count; ++i) v[i] = table[clmha_fuzz_next(state) & 7];
        return v;
    }
    unsigned char *v = malloc(count);
    if (v)
        for (size_t i = 0; i < count; ++i) v[i] = (clmha_fuzz_next(state) & 3) == 0;
    return v;
}

// The masks of byte @p m on the call's shapes.
static void make_masks(call *c, uint8_t m, size_t h, uint64_t *state) {
    clmha_mask *kpm = &c->fwd.key_padding_mask, *am = &c->fwd.attn_mask;
    kpm->kind = (clmha_mask_kind)(m & 3);
    am->kind = (clmha_mask_kind)((m >> 2) & 3);
    if (kpm->kind != CLMHA_MASK_NONE) {
        if (c->batched) kpm->tensor.ndim = 2, kpm->tensor.shape[0] = c->n;
        else kpm->tensor.ndim = 1;
        kpm->tensor.shape[kpm->tensor.ndim - 1] = c->s;
        kpm->tensor.data = c->kpm = mask_values(state, kpm->kind, tensor_count(&kpm->tensor));
    }
    if (am->kind == CLMHA_MASK_NONE) return;
    clmha_tensor *t = &am->tensor;
    int layout = (m >> 4) & 3;
    if (layout == 1) {
        t->ndim = 3, t->shape[0] = c->batched ? c->n * h : h;
    } else if (layout == 2 && c->batched) {
        t->ndim = 3, t->shape[0] = c->n, am->per_batch = true;
    } else {
        t->ndim = 2;
    }
    t->shape[t->ndim - 2] = c->l, t->shape[t->ndim - 1] = c->s;
    t->data = c->am = mask_values(state, am->kind, tensor_count(t));
}

// The layer of the next bytes (the other fields stay 0: float32, no user functions).
static clmha_layer_desc read_desc(clmha_fuzz_in *in) {
    static const size_t es[4] = {4, 8, 8, 16}, hs[4] = {1, 2, 4, 2}, kds[4] = {0, 0, 4, 12};
    static const float dropouts[4] = {0.0f, 0.0f, 0.25f, 0.5f};
    uint8_t eh = clmha_fuzz_take(in), lf = clmha_fuzz_take(in), wb = clmha_fuzz_take(in);
    clmha_layer_desc d = {.struct_size = sizeof d};
    d.embed_dim = es[eh & 3], d.num_heads = hs[(eh >> 2) & 3];
    if (d.num_heads > d.embed_dim) d.num_heads = d.embed_dim;
    if ((eh & 0x10) && d.num_heads >= 2) d.num_kv_heads = d.num_heads / 2;
    d.kdim = kds[(eh >> 5) & 3], d.vdim = (eh & 0x80) ? 12 : 0;
    d.bias = lf & 1, d.add_bias_kv = (lf >> 1) & 1, d.add_zero_attn = (lf >> 2) & 1;
    d.batch_first = (lf >> 3) & 1, d.sinks = (lf >> 4) & 1;
    d.softcap = (lf & 0x20) ? 2.0 : 0.0, d.alibi = (lf >> 6) & 1, d.window = (lf >> 7) & 1;
    d.window_left = (int64_t)(wb & 15) - 1, d.window_right = (int64_t)(wb >> 4) - 1;
    d.dropout = dropouts[clmha_fuzz_take(in) & 3];
    return d;
}

// The shapes, inputs and masks (the forward call), from the next bytes.
static bool read_call(clmha_fuzz_in *in, const clmha_layer_desc *d, uint64_t *state, call *c) {
    memset(c, 0, sizeof *c);
    c->e = d->embed_dim;
    c->kdim = d->kdim ? d->kdim : c->e, c->vdim = d->vdim ? d->vdim : c->e;
    c->l = 1 + clmha_fuzz_take(in) % 6, c->s = 1 + clmha_fuzz_take(in) % 6;
    c->n = 1 + clmha_fuzz_take(in) % 3;
    uint8_t form = clmha_fuzz_take(in);
    c->batched = form & 1;
    if (!c->batched) c->n = 1;
    // Self-attention needs kdim == vdim == E, and no value kdim == vdim: without bit 3 the
    // inputs are given where the layer needs them (most inputs then make valid calls).
    bool strict = !(form & 8);
    c->has_key = !(form & 2) || (strict && (c->kdim != c->e || c->vdim != c->e));
    c->has_value = c->has_key && (!(form & 4) || (strict && c->kdim != c->vdim));
    if (!c->has_key) c->s = c->l;
    c->fwd.struct_size = sizeof c->fwd;
    input_shape(c, d->batch_first, c->l, c->e, &c->fwd.query);
    c->fwd.query.data = c->q = clmha_fuzz_uniform(state, tensor_count(&c->fwd.query), 1.0f);
    if (c->has_key) {
        input_shape(c, d->batch_first, c->s, c->kdim, &c->fwd.key);
        c->fwd.key.data = c->k = clmha_fuzz_uniform(state, tensor_count(&c->fwd.key), 1.0f);
    }
    if (c->has_value) {
        input_shape(c, d->batch_first, c->s, c->vdim, &c->fwd.value);
        c->fwd.value.data = c->v = clmha_fuzz_uniform(state, tensor_count(&c->fwd.value), 1.0f);
    }
    make_masks(c, clmha_fuzz_take(in), d->num_heads, state);
    uint8_t cf = c->flags = clmha_fuzz_take(in);
    c->fwd.is_causal = cf & 1, c->fwd.need_weights = (cf >> 1) & 1;
    c->fwd.per_head_weights = (cf >> 2) & 1, c->fwd.training = (cf >> 3) & 1;
    c->fwd.impl = (clmha_impl)(((cf >> 4) & 3) % 3);
    c->fwd.rng.seed = clmha_fuzz_next(state), c->fwd.rng.offset = clmha_fuzz_next(state) & 0xFF;
    return c->q && (!c->has_key || c->k) && (!c->has_value || c->v);
}

static void call_free(call *c) {
    free(c->q), free(c->k), free(c->v), free(c->kpm), free(c->am), free(c->dy), free(c->dw);
    for (int i = 0; i < GRADS; ++i) free(c->grad[i]), free(c->before[i]);
}

// Elements of gradient @p i for this call and layer (0: the call has no such gradient).
static size_t grad_elements(const call *c, const clmha_fuzz_layer *fl, int i) {
    switch (i) {
    case 0: return tensor_count(&c->fwd.query);
    case 1: return c->has_key ? tensor_count(&c->fwd.key) : 0;
    case 2: return c->has_value ? tensor_count(&c->fwd.value) : 0;
    case 12:
    case 13: {
        const clmha_mask *m = i == 12 ? &c->fwd.attn_mask : &c->fwd.key_padding_mask;
        return m->kind == CLMHA_MASK_FLOAT ? tensor_count(&m->tensor) : 0;
    }
    default:
        // A block of in_proj_weight together with it is refused: ask for one form only.
        if (i >= 4 && i <= 6 && fl->counts[0]) return 0;
        return clmha_layer_parameter_count(fl->layer, grad_names[i]);
    }
}

// Destinations for the gradients @p ask selects among those the call has, filled with random
// values: what accumulate adds to, and what a refused call must leave as they are.
static bool make_grads(call *c, const clmha_fuzz_layer *fl, unsigned ask, bool accumulate,
                       uint64_t *state, clmha_backward_args *b) {
    for (int i = 0; i < GRADS; ++i) {
        size_t count = (ask >> i) & 1 ? grad_elements(c, fl, i) : 0;
        if (!count) continue;
        c->grad_count[i] = count;
        c->grad[i] = clmha_fuzz_uniform(state, count, 1.0f);
        c->before[i] = malloc(count * sizeof(float));
        if (!c->grad[i] || !c->before[i]) return false;
        memcpy(c->before[i], c->grad[i], count * sizeof(float));
        grad_slot(b, i)->data = c->grad[i];
        grad_slot(b, i)->accumulate = accumulate;
    }
    return true;
}

enum { SPARE = 4096 };  // floats of a destination the call must refuse (larger than any)

// A destination for gradient @p i, which the call does not have.
static bool add_spare(call *c, clmha_backward_args *b, int i, uint64_t *state) {
    if (c->grad[i]) return false;
    c->grad[i] = clmha_fuzz_uniform(state, SPARE, 1.0f);
    c->before[i] = malloc(SPARE * sizeof(float));
    if (!c->grad[i] || !c->before[i]) return false;
    memcpy(c->before[i], c->grad[i], SPARE * sizeof(float));
    c->grad_count[i] = SPARE;
    grad_slot(b, i)->data = c->grad[i];
    return true;
}

// Breakage @p kind (1-13) of a correct backward call @p b; @p other holds a forward call of
// another shape and @p fresh an unfilled saved object where the breakage needs them. Returns
// whether it applies (some need what the call has not), and then the call must be refused.
static bool break_call(int kind, call *c, const clmha_fuzz_layer *fl, clmha_backward_args *b,
                       clmha_forward_args *other, clmha_saved *fresh, uint64_t *state) {
    const clmha_layer_desc *d = &fl->desc;
    switch (kind) {
    case 1: b->grad_output.shape[b->grad_output.ndim - 1] += 1; return true;
    case 2: b->saved = NULL; return true;
    case 3: b->saved = fresh; return fresh != NULL;
    case 4:
        if (c->l < 2) return false;
        *other = c->fwd;  // one query row less (and masks of the wrong length)
        other->query.shape[c->batched && d->batch_first ? 1 : 0] -= 1;
        b->forward = other;
        return true;
    case 5: b->struct_size = 0; return true;
    case 6:
        if (!b->grad_weights.ndim) {
            b->grad_weights = (clmha_tensor){.ndim = 2, .shape = {c->l, c->s}, .data = c->dw};
            return !c->fwd.need_weights;
        }
        b->grad_weights.shape[b->grad_weights.ndim - 1] += 1;
        return true;
    case 7:
        if (!d->add_bias_kv) return add_spare(c, b, 10, state);
        if (!d->sinks) return add_spare(c, b, 14, state);
        if (!fl->counts[0]) return add_spare(c, b, 3, state);
        // A block of in_proj_weight together with in_proj_weight.
        return (c->grad[3] || add_spare(c, b, 3, state)) && add_spare(c, b, 4, state);
    case 8: b->impl = (clmha_impl)7; return true;
    case 9: b->forward = NULL; return true;
    case 10: b->grad_output.data = NULL; return true;
    case 11: return c->fwd.attn_mask.kind != CLMHA_MASK_FLOAT && add_spare(c, b, 12, state);
    case 12: return !c->has_key && add_spare(c, b, 1, state);
    default: b->grad_dtype = (clmha_grad_dtype)9; return true;
    }
}

// The weights' shape, for grad_weights.
static clmha_tensor weights_shape(const call *c, const clmha_layer_desc *d) {
    size_t sp = c->s + d->add_bias_kv + d->add_zero_attn;
    clmha_tensor t = {.ndim = 0};
    size_t dims[4], k = 0;
    if (c->batched) dims[k++] = c->n;
    if (c->fwd.per_head_weights) dims[k++] = d->num_heads;
    dims[k++] = c->l, dims[k++] = sp;
    t.ndim = k;
    memcpy(t.shape, dims, k * sizeof *dims);
    return t;
}

static bool grads_unchanged(const call *c) {
    for (int i = 0; i < GRADS; ++i)
        if (c->grad[i] && memcmp(c->grad[i], c->before[i], c->grad_count[i] * sizeof(float)))
            return false;
    return true;
}

// The reference's gradients for the destinations of @p b (the correct call): each within
// tolerance of what the device wrote (added to what was there with accumulate).
static void check_against_reference(const call *c, const clmha_fuzz_layer *fl,
                                    const clmha_backward_args *b) {
    clmha_reference_grads rg = {.struct_size = sizeof rg};
    double *want[GRADS] = {NULL};
    bool ok = true;
    for (int i = 0; i < GRADS; ++i)
        if (c->grad[i]) {
            ok = ok && (want[i] = calloc(c->grad_count[i], sizeof(double))) != NULL;
            *reference_slot(&rg, i) = want[i];
        }
    char msg[512] = "";
    clmha_status rst = ok ? clmha_reference_backward(&fl->desc, &fl->params, &c->fwd, c->dy,
                                                     b->grad_weights.ndim ? c->dw : NULL, &rg,
                                                     msg, sizeof msg)
                          : CLMHA_OUT_OF_MEMORY;
    if (rst != CLMHA_OUT_OF_MEMORY) {
        if (rst != CLMHA_SUCCESS) fprintf(stderr, "reference refused: %s\n", msg);
        CLMHA_FUZZ_CHECK(rst == CLMHA_SUCCESS);  // it accepts what the device accepted
        for (int i = 0; i < GRADS; ++i) {
            if (!want[i]) continue;
            if (grad_slot((clmha_backward_args *)b, i)->accumulate)
                for (size_t j = 0; j < c->grad_count[i]; ++j) want[i][j] += c->before[i][j];
            double err = clmha_fuzz_rel_err(c->grad[i], want[i], c->grad_count[i]);
            if (!(err <= 2e-3)) fprintf(stderr, "gradient %s: error %g\n", grad_names[i], err);
            CLMHA_FUZZ_CHECK(err <= 2e-3);
        }
    }
    for (int i = 0; i < GRADS; ++i) free(want[i]);
}

// The forward call that fills @p saved; its status.
static clmha_status run_forward(call *c, const clmha_fuzz_layer *fl, clmha_saved *saved) {
    size_t oc = 0, wc = 0;
    clmha_status st = clmha_layer_output_counts(fl->layer, &c->fwd, &oc, &wc);
    if (st != CLMHA_SUCCESS) return st;
    float *out = malloc(oc * sizeof *out), *w = wc ? malloc(wc * sizeof *w) : NULL;
    if (!out || (wc && !w)) {
        free(out), free(w);
        return CLMHA_OUT_OF_MEMORY;
    }
    c->fwd.save = saved;
    st = clmha_layer_forward_host(fl->layer, &c->fwd, out, oc, w, wc);
    c->out_count = oc, c->weights_count = wc;
    free(out), free(w);
    return st;
}

// The backward call and its checks, after a forward call that succeeded.
static clmha_status run_backward(call *c, const clmha_fuzz_layer *fl, clmha_saved *saved,
                                 clmha_fuzz_in *in, uint64_t *state) {
    clmha_context *ctx = clmha_fuzz_context();
    unsigned ask = clmha_fuzz_take(in);
    ask |= (unsigned)clmha_fuzz_take(in) << 8;
    uint8_t brk = clmha_fuzz_take(in);
    // Room past the output's and the weights' counts: a breakage may make the shapes larger.
    c->dy = clmha_fuzz_uniform(state, 2 * c->out_count + 64, 1.0f);
    c->dw = clmha_fuzz_uniform(state, 2 * c->weights_count + 64, 1.0f);
    if (!c->dy || !c->dw) return CLMHA_OUT_OF_MEMORY;
    clmha_backward_args b = {.struct_size = sizeof b, .forward = &c->fwd, .saved = saved};
    b.grad_output = c->fwd.query;
    b.grad_output.shape[b.grad_output.ndim - 1] = c->e;
    b.grad_output.data = c->dy;
    if (c->fwd.need_weights && (c->flags & 0x40)) {
        b.grad_weights = weights_shape(c, &fl->desc);
        b.grad_weights.data = c->dw;
    }
    b.impl = (ask & 0x8000) ? CLMHA_IMPL_UNFUSED : c->fwd.impl;
    if (!make_grads(c, fl, ask, (c->flags & 0x80) != 0, state, &b)) return CLMHA_OUT_OF_MEMORY;
    clmha_forward_args other;
    clmha_saved *fresh = NULL;
    bool broken = false;
    if (brk >= 0x80) {
        int kind = 1 + (brk & 15) % 13;
        if (kind == 3 && clmha_saved_create(&fresh, fl->layer) != CLMHA_SUCCESS) fresh = NULL;
        broken = break_call(kind, c, fl, &b, &other, fresh, state);
    }
    clmha_status st = clmha_layer_backward_host(fl->layer, &b);
    clmha_saved_release(fresh);
    if (broken || st != CLMHA_SUCCESS) {
        CLMHA_FUZZ_CHECK(clmha_fuzz_clean_refusal(ctx, st));
        CLMHA_FUZZ_CHECK(grads_unchanged(c));
        return st;
    }
    check_against_reference(c, fl, &b);
    return st;
}

int clmha_fuzz_backward_args(const uint8_t *data, size_t size) {
    clmha_context *ctx = clmha_fuzz_context();
    if (!ctx) return CLMHA_UNSUPPORTED;
    clmha_fuzz_in in = {data, size};
    uint64_t seed = clmha_fuzz_take(&in), state = seed * 0x2545F4914F6CDD1Dull;
    clmha_layer_desc desc = read_desc(&in);
    call c;
    bool made = read_call(&in, &desc, &state, &c);
    clmha_fuzz_layer fl;
    clmha_status st = made ? clmha_fuzz_layer_make(&fl, ctx, &desc, seed) : CLMHA_OUT_OF_MEMORY;
    if (st == CLMHA_SUCCESS) {
        clmha_saved *saved = NULL;
        // Every layer this target describes is valid.
        CLMHA_FUZZ_CHECK(clmha_saved_create(&saved, fl.layer) == CLMHA_SUCCESS);
        st = run_forward(&c, &fl, saved);
        if (st == CLMHA_SUCCESS) st = run_backward(&c, &fl, saved, &in, &state);
        else CLMHA_FUZZ_CHECK(clmha_fuzz_clean_refusal(ctx, st));
        clmha_saved_release(saved);
        clmha_fuzz_layer_free(&fl);
    } else if (st != CLMHA_OUT_OF_MEMORY) {
        CLMHA_FUZZ_CHECK(st == CLMHA_SUCCESS);  // every layer this target describes is valid
    }
    call_free(&c);
    return st;
}
