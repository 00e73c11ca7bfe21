// Random cases of a whole layer call (random_case.h).
#include "random_case.h"

#include "base/half.h"

#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *kind_name(clmha_mask_kind k) {
    static const char *names[] = {"none", "ignore", "attend", "float"};
    return names[k];
}

rcase rcase_window_edge(const window_edge *w, size_t k, uint64_t seed, clmha_mask_kind kpm) {
    rcase c = rcase_base(seed);
    c.e = 16, c.h = 2, c.n = 1 + k % 2;
    c.l = w->l, c.s = w->s;
    c.window = true, c.win_left = w->left, c.win_right = w->right;
    c.is_causal = w->causal;
    c.add_bias_kv = w->appended & 1, c.add_zero_attn = w->appended >> 1;
    c.need_weights = false, c.batch_first = k % 3 == 0;
    c.am = k % 5 == 2 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE, c.layout = LAYOUT_PER_HEAD;
    c.kpm = k % 7 == 3 ? kpm : CLMHA_MASK_NONE, c.mask_p = 0.1;
    if (k % 6 == 4) c.training = true, c.dropout = 0.2f;
    return c;
}

void rcase_describe(const rcase *c, char *buf, size_t size) {
    static const char *layouts[] = {"L,S", "NH,L,S", "N,L,S"};
    int used = snprintf(buf, size, "E%zu H%zu N%zu L%zu S%zu", c->e, c->h,
                        c->unbatched ? (size_t)1 : c->n, c->l, c->self_attn ? c->l : c->s);
#define APPEND(...)                                                                            \
    if (used >= 0 && (size_t)used < size)                                                      \
    used += snprintf(buf + used, size - (size_t)used, __VA_ARGS__)
    if (c->kdim || c->vdim) APPEND(" kdim%zu vdim%zu", c->kdim, c->vdim);
    if (!c->bias) APPEND(" nobias");
    if (c->add_bias_kv) APPEND(" bias_kv");
    if (c->add_zero_attn) APPEND(" zero_attn");
    if (c->batch_first) APPEND(" batch_first");
    if (c->unbatched) APPEND(" unbatched");
    if (c->self_attn) APPEND(" self");
    if (c->value_is_key) APPEND(" value=key");
    if (c->kpm) APPEND(" kpm=%s", kind_name(c->kpm));
    if (c->am) APPEND(" am=%s(%s)", kind_name(c->am), layouts[c->layout]);
    if (c->is_causal) APPEND(" causal");
    if (c->window) APPEND(" window(%lld,%lld)", (long long)c->win_left, (long long)c->win_right);
    if (c->softcap > 0) APPEND(" softcap=%g", c->softcap);
    if (c->alibi) APPEND(c->alibi_random ? " alibi(random)" : " alibi");
    if (c->sinks) APPEND(" sinks");
    if (c->user) APPEND(" user(%s%s%s)", c->user & RC_USER_SCORE ? "score" : "",
                        c->user & RC_USER_MASK ? " mask" : "",
                        c->user & RC_USER_HOST ? "host forms" : "");
    if (c->mask_row) APPEND(" masked_row");
    if (c->mask_batch) APPEND(" masked_item");
    if (c->need_weights) APPEND(c->per_head ? " w=per_head" : " w=avg");
    if (c->dropout > 0) APPEND(" p=%.2g%s", (double)c->dropout, c->training ? " train" : " eval");
#undef APPEND
}

// A mask of @p count elements: boolean masks hold 0 or a random non-zero byte (non-zero means
// forbidden for IGNORE, allowed for ATTEND; a fraction mask_p is forbidden); float masks hold
// N(0, 1) values with a fraction mask_p of -inf.
static void *make_mask(prng *r, clmha_mask_kind kind, size_t count, double mask_p) {
    if (kind == CLMHA_MASK_FLOAT) {
        float *m = alloc_floats(count);
        for (size_t i = 0; i < count; ++i)
            m[i] = prng_uniform(r) < mask_p ? -INFINITY : (float)prng_normal(r);
        return m;
    }
    unsigned char *m = malloc(count ? count : 1);
    cr_assert_not_null(m, "out of memory");
    for (size_t i = 0; i < count; ++i) {
        bool forbidden = prng_uniform(r) < mask_p;
        unsigned char nonzero = (unsigned char)prng_range(r, 1, 255);
        m[i] = (forbidden == (kind == CLMHA_MASK_BOOL_IGNORE)) ? nonzero : 0;
    }
    return m;
}

static clmha_tensor host_tensor(const void *data, size_t ndim, size_t a, size_t b, size_t c) {
    clmha_tensor t = {.ndim = ndim, .shape = {a, b, c}, .data = data};
    return t;
}

// An input (seq, batch, feat) in the case's layout.
static clmha_tensor input_tensor(const instance *in, const float *data, size_t seq, size_t feat) {
    if (in->c.unbatched) return host_tensor(data, 2, seq, feat, 0);
    if (in->c.batch_first) return host_tensor(data, 3, in->n, seq, feat);
    return host_tensor(data, 3, seq, in->n, feat);
}

// The user functions that reproduce the built-in variants (rcase::user). p: soft-capping's c
// (0: off), ALiBi on (1) or off, the window's bounds (-1: unbounded), then the H slopes.
static const char user_score_source[] =
    "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k,\n"
    "                           __global const float *p) {\n"
    "    if (p[0] > 0.0f) s = p[0] * tanh(s / p[0]);\n"
    "    if (p[1] != 0.0f) s -= p[4 + h] * fabs((clmha_real)(q - k));\n"
    "    return s;\n"
    "}\n"
    "clmha_real clmha_score_mod_grad(clmha_real s, int b, int h, int q, int k,\n"
    "                                __global const float *p) {\n"
    "    if (p[0] <= 0.0f) return 1.0f;\n"
    "    clmha_real t = tanh(s / p[0]);\n"
    "    return 1.0f - t * t;\n"
    "}\n";
static const char user_mask_source[] =
    "/* a sliding window: key k is allowed iff q - left <= k <= q + right */\n"
    "int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) {\n"
    "    int left = (int)p[2], right = (int)p[3];\n"
    "    return (left < 0 || k >= q - left) && (right < 0 || k <= q + right);\n"
    "}\n";

// p and the source of in->c.user's user functions (layer_desc_of() moves the variants).
static void make_user_functions(instance *in) {
    const rcase *k = &in->c;
    if (!k->user) return;
    if (k->user & RC_USER_HOST) {  // the same functions in the layer and the reference
        cr_assert_eq(k->user, RC_USER_HOST, "RC_USER_HOST goes alone");
        in->mod_p = alloc_floats(USER_TEST_PARAMS);
        memcpy(in->mod_p, user_test_params, USER_TEST_PARAMS * sizeof *in->mod_p);
        size_t size = strlen(user_test_source) + 1;
        in->mod_source = malloc(size);
        cr_assert_not_null(in->mod_source, "out of memory");
        memcpy(in->mod_source, user_test_source, size);
        in->desc.mod_source = in->mod_source;
        in->desc.mod_params = in->mod_p;
        in->desc.mod_params_count = USER_TEST_PARAMS;
        in->params.score_mod = test_user_score;
        in->params.score_mod_grad = test_user_score_grad;
        in->params.mask_mod = test_user_mask;
        return;
    }
    bool appended = k->add_bias_kv || k->add_zero_attn;
    in->mod_p = alloc_floats(4 + k->h);
    float *p = in->mod_p;
    memset(p, 0, (4 + k->h) * sizeof *p);
    p[2] = p[3] = -1.0f;
    if (k->user & RC_USER_SCORE) {
        if (!appended) p[0] = (float)k->softcap;
        p[1] = k->alibi ? 1.0f : 0.0f;
        if (in->slopes) memcpy(p + 4, in->slopes, k->h * sizeof *p);
        else clmha_alibi_slopes(k->h, p + 4);
    }
    if (k->user & RC_USER_MASK) {
        p[2] = (float)(k->window ? k->win_left : -1);
        p[3] = (float)(k->window ? k->win_right : -1);
    }
    size_t size = sizeof user_score_source + sizeof user_mask_source;
    in->mod_source = malloc(size);
    cr_assert_not_null(in->mod_source, "out of memory");
    snprintf(in->mod_source, size, "%s%s", k->user & RC_USER_SCORE ? user_score_source : "",
             k->user & RC_USER_MASK ? user_mask_source : "");
}

clmha_layer_desc layer_desc_of(const instance *in) {
    const rcase *k = &in->c;
    clmha_layer_desc d = in->desc;
    if (!k->user || k->user == RC_USER_HOST) return d;
    if (k->user & RC_USER_SCORE) {
        if (!(k->add_bias_kv || k->add_zero_attn)) d.softcap = 0.0;
        d.alibi = false;
    }
    if (k->user & RC_USER_MASK) d.window = false;
    d.mod_source = in->mod_source;
    d.mod_params = in->mod_p;
    d.mod_params_count = 4 + k->h;
    return d;
}

void instance_make(instance *in, const rcase *c) {
    memset(in, 0, sizeof *in);
    in->c = *c;
    if (c->self_attn) in->c.s = c->l;
    const rcase *k = &in->c;
    prng r = {k->data_seed};
    const size_t e = k->e, n = k->unbatched ? 1 : k->n, l = k->l, s = k->s;
    in->n = n;
    in->kdim = k->kdim ? k->kdim : e;
    in->vdim = k->vdim ? k->vdim : e;
    in->kve = (k->kv_heads ? k->kv_heads : k->h) * (e / k->h);
    in->s_padded = s + k->add_bias_kv + k->add_zero_attn;
    const size_t kve = in->kve;

    in->desc = (clmha_layer_desc){.struct_size = sizeof(clmha_layer_desc),
                                  .embed_dim = e, .num_heads = k->h, .kdim = k->kdim,
                                  .vdim = k->vdim, .bias = k->bias,
                                  .add_bias_kv = k->add_bias_kv,
                                  .add_zero_attn = k->add_zero_attn,
                                  .batch_first = k->batch_first, .dropout = k->dropout,
                                  .num_kv_heads = k->kv_heads, .window = k->window,
                                  .window_left = k->win_left, .window_right = k->win_right,
                                  .softcap = k->softcap, .alibi = k->alibi,
                                  .sinks = k->sinks};

    // Parameters: weights ~ U(-1/sqrt(E), 1/sqrt(E)), bias_k / bias_v ~ N(0, 1).
    in->params.struct_size = sizeof in->params;
    const double bound = 1.0 / sqrt((double)e);
    if (in->kdim == e && in->vdim == e && kve == e) {
        in->w_in = uniform_floats(&r, 3 * e * e, bound);
        in->params.in_proj_weight = in->w_in;
    } else {
        in->wq = uniform_floats(&r, e * e, bound);
        in->wk = uniform_floats(&r, kve * in->kdim, bound);
        in->wv = uniform_floats(&r, kve * in->vdim, bound);
        in->params.q_proj_weight = in->wq;
        in->params.k_proj_weight = in->wk;
        in->params.v_proj_weight = in->wv;
    }
    in->wo = uniform_floats(&r, e * e, bound);
    in->params.out_proj_weight = in->wo;
    if (k->bias) {
        in->b_in = uniform_floats(&r, e + 2 * kve, bound);
        in->bo = uniform_floats(&r, e, bound);
        in->params.in_proj_bias = in->b_in;
        in->params.out_proj_bias = in->bo;
    }
    if (k->add_bias_kv) {
        in->bk = normal_floats(&r, kve);
        in->bv = normal_floats(&r, kve);
        in->params.bias_k = in->bk;
        in->params.bias_v = in->bv;
    }

    if (k->alibi_random) {  // ALiBi slopes ~ U(0, 1], (the geometric ones otherwise)
        in->slopes = uniform_floats(&r, k->h, 0.5);
        for (size_t h = 0; h < k->h; ++h) in->slopes[h] += 0.5f;
        in->params.alibi_slopes = in->slopes;
    }
    if (k->sinks) {  // sinks ~ N(0, 1)
        in->sinks = normal_floats(&r, k->h);
        in->params.sinks = in->sinks;
    }

    // Inputs ~ N(0, 1).
    clmha_forward_args *a = &in->args;
    a->struct_size = sizeof *a;
    in->query = normal_floats(&r, l * n * e);
    a->query = input_tensor(in, in->query, l, e);
    if (!k->self_attn) {
        in->key = normal_floats(&r, s * n * in->kdim);
        a->key = input_tensor(in, in->key, s, in->kdim);
        if (!k->value_is_key) {
            in->value = normal_floats(&r, s * n * in->vdim);
            a->value = input_tensor(in, in->value, s, in->vdim);
        }
    }

    // Masks.
    if (k->kpm) {
        in->kpm = make_mask(&r, k->kpm, n * s, k->mask_p);
        if (k->mask_batch) memset(in->kpm, 1, s);  // item 0 (kind BOOL_IGNORE) fully masked
        a->key_padding_mask.kind = k->kpm;
        a->key_padding_mask.tensor =
            k->unbatched ? host_tensor(in->kpm, 1, s, 0, 0) : host_tensor(in->kpm, 2, n, s, 0);
    }
    if (k->am) {
        size_t heads = k->layout == LAYOUT_PER_HEAD    ? n * k->h
                       : k->layout == LAYOUT_PER_BATCH ? n
                                                       : 1;
        in->am = make_mask(&r, k->am, heads * l * s, k->mask_p);
        if (k->mask_row) memset((unsigned char *)in->am + s, 1, s);  // row 1 (BOOL_IGNORE)
        a->attn_mask.kind = k->am;
        a->attn_mask.per_batch = k->layout == LAYOUT_PER_BATCH;
        a->attn_mask.tensor = k->layout == LAYOUT_SHARED ? host_tensor(in->am, 2, l, s, 0)
                                                         : host_tensor(in->am, 3, heads, l, s);
    }
    a->is_causal = k->is_causal;
    a->need_weights = k->need_weights;
    a->per_head_weights = k->per_head;
    a->training = k->training;
    a->rng = (clmha_dropout_rng){k->rng_seed, k->rng_offset};

    make_user_functions(in);
    in->output_count = n * l * e;
    in->weights_count = k->need_weights ? n * (k->per_head ? k->h : 1) * l * in->s_padded : 0;
}

void instance_free(instance *in) {
    float *arrays[] = {in->w_in, in->wq,  in->wk,    in->wv,  in->b_in, in->wo,
                       in->bo,   in->bk,  in->bv,    in->query, in->key, in->value,
                       in->slopes, in->sinks, in->mod_p};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; ++i) free(arrays[i]);
    free(in->mod_source);
    free(in->kpm);
    free(in->am);
}

static void set_param(clmha_layer *layer, const char *name, const float *data, size_t count) {
    if (!data) return;
    clmha_status st = clmha_layer_set_parameter(layer, name, data, count);
    cr_assert_eq(st, CLMHA_SUCCESS, "set_parameter(%s): %s", name,
                 clmha_context_last_error(clmha_layer_context(layer)));
}

clmha_layer *instance_layer(clmha_context *ctx, const instance *in) {
    clmha_layer *layer = NULL;
    clmha_layer_desc desc = layer_desc_of(in);
    clmha_status st = clmha_layer_create(&layer, ctx, &desc);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_layer_create: %s", clmha_context_last_error(ctx));
    const size_t e = in->c.e, kve = in->kve;
    set_param(layer, "in_proj_weight", in->w_in, 3 * e * e);
    set_param(layer, "q_proj_weight", in->wq, e * e);
    set_param(layer, "k_proj_weight", in->wk, kve * in->kdim);
    set_param(layer, "v_proj_weight", in->wv, kve * in->vdim);
    set_param(layer, "in_proj_bias", in->b_in, e + 2 * kve);
    set_param(layer, "out_proj.weight", in->wo, e * e);
    set_param(layer, "out_proj.bias", in->bo, e);
    set_param(layer, "bias_k", in->bk, kve);
    set_param(layer, "bias_v", in->bv, kve);
    if (desc.alibi) set_param(layer, "alibi_slopes", in->slopes, in->c.h);
    set_param(layer, "sinks", in->sinks, in->c.h);
    return layer;
}

rcase rcase_base(uint64_t data_seed) {
    rcase c = {.e = 8, .h = 2, .n = 2, .l = 3, .s = 5, .bias = true, .need_weights = true,
               .mask_p = 0.3, .rng_seed = 0x0123456789ABCDEFull, .rng_offset = 7,
               .data_seed = data_seed};
    return c;
}

rcase rcase_random(prng *r) {
    rcase c = rcase_base(prng_next(r));
    c.h = prng_range(r, 1, 4);
    c.e = c.h * prng_range(r, 1, 6);
    c.n = prng_range(r, 1, 4);
    c.l = prng_range(r, 1, 7);
    c.s = prng_range(r, 1, 7);
    c.bias = prng_range(r, 0, 3) != 0;
    c.add_bias_kv = prng_bool(r);
    c.add_zero_attn = prng_bool(r);
    c.batch_first = prng_bool(r);
    c.unbatched = prng_range(r, 0, 4) == 0;
    switch (prng_range(r, 0, 3)) {
    case 0: c.self_attn = true; break;
    case 1:
        c.kdim = prng_range(r, 1, 9);
        c.vdim = prng_bool(r) ? c.kdim : prng_range(r, 1, 9);
        c.value_is_key = c.kdim == c.vdim && prng_bool(r);
        break;
    case 2: c.value_is_key = prng_bool(r); break;
    default: break;
    }
    c.kpm = (clmha_mask_kind)prng_range(r, 0, 3);
    c.am = (clmha_mask_kind)prng_range(r, 0, 3);
    c.layout = (attn_layout)prng_range(r, 0, c.unbatched ? 1 : 2);
    c.is_causal = prng_range(r, 0, 2) == 0;
    c.need_weights = prng_range(r, 0, 3) != 0;
    c.per_head = prng_bool(r);
    if (prng_range(r, 0, 3) == 0) {
        c.dropout = 0.25f;
        c.training = prng_bool(r);
        c.rng_seed = prng_next(r);
        c.rng_offset = prng_next(r);
    }
    return c;
}

static void round_floats(clmha_dtype t, float *x, size_t count) {
    for (size_t i = 0; x && i < count; ++i) x[i] = clmha__dtype_round(t, x[i]);
}

void instance_as_dtype(instance *in, clmha_dtype t) {
    in->desc.dtype = t;
    size_t e = in->c.e, kve = e, kd = in->kdim, vd = in->vdim;
    round_floats(t, in->w_in, in->w_in ? 3 * e * e : 0);
    round_floats(t, in->wq, in->wq ? e * e : 0);
    round_floats(t, in->wk, in->wk ? kve * kd : 0);
    round_floats(t, in->wv, in->wv ? kve * vd : 0);
    round_floats(t, in->b_in, in->b_in ? 3 * e : 0);
    round_floats(t, in->wo, e * e);
    round_floats(t, in->bo, in->bo ? e : 0);
    round_floats(t, in->bk, in->bk ? e : 0);
    round_floats(t, in->bv, in->bv ? e : 0);
    size_t q = 1, k = 1, v = 1;
    for (size_t i = 0; i < in->args.query.ndim; ++i) q *= in->args.query.shape[i];
    round_floats(t, in->query, q);
    if (in->args.key.ndim) {
        for (size_t i = 0; i < in->args.key.ndim; ++i) k *= in->args.key.shape[i];
        round_floats(t, in->key, k);
    }
    if (in->args.value.ndim) {
        for (size_t i = 0; i < in->args.value.ndim; ++i) v *= in->args.value.shape[i];
        round_floats(t, in->value, v);
    }
    const clmha_mask *masks[] = {&in->args.key_padding_mask, &in->args.attn_mask};
    float *data[] = {in->kpm, in->am};
    for (int m = 0; m < 2; ++m) {
        if (masks[m]->kind != CLMHA_MASK_FLOAT) continue;
        size_t c = 1;
        for (size_t i = 0; i < masks[m]->tensor.ndim; ++i) c *= masks[m]->tensor.shape[i];
        round_floats(t, data[m], c);
    }
}
