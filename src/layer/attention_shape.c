// Shape checking of scaled dot-product attention calls (attention_shape.h), shared by the device
// function and the CPU reference.
#include "layer/attention_shape.h"

#include "base/checked.h"
#include "base/message.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { N_, H_, T_, F_ };  // indices of clmha__attention_sizes(): batch, heads, sequence, features

void clmha__attention_sizes(const clmha_tensor *t, clmha_attention_layout layout, size_t out[4]) {
    const size_t *s = t->shape;
    bool batched = t->ndim == 4;
    size_t a = batched ? s[1] : s[0], b = batched ? s[2] : s[1];
    out[N_] = batched ? s[0] : 1;
    out[H_] = layout == CLMHA_LAYOUT_NLHD ? b : a;
    out[T_] = layout == CLMHA_LAYOUT_NLHD ? a : b;
    out[F_] = batched ? s[3] : s[2];
}

// How the query's shape reads in @p layout, for messages.
static const char *pattern(clmha_attention_layout layout, bool batched, char which) {
    if (which == 'q')
        return layout == CLMHA_LAYOUT_NLHD ? (batched ? "(N, L, H, D)" : "(L, H, D)")
                                           : (batched ? "(N, H, L, D)" : "(H, L, D)");
    if (which == 'k')
        return layout == CLMHA_LAYOUT_NLHD ? (batched ? "(N, S, H_kv, D)" : "(S, H_kv, D)")
                                           : (batched ? "(N, H_kv, S, D)" : "(H_kv, S, D)");
    return layout == CLMHA_LAYOUT_NLHD ? (batched ? "(N, S, H_kv, D_v)" : "(S, H_kv, D_v)")
                                       : (batched ? "(N, H_kv, S, D_v)" : "(H_kv, S, D_v)");
}

// The product of @p count sizes, false on overflow (with room for 8-byte elements).
static bool product(const size_t *sizes, size_t count, size_t *out) {
    size_t c = 1;
    for (size_t i = 0; i < count; ++i)
        if (!clmha__mul(c, sizes[i], &c)) return false;
    if (c > SIZE_MAX / sizeof(double)) return false;
    *out = c;
    return true;
}

// The query, key and value: ranks, positive sizes, and their agreement.
static clmha_status check_tensors(const clmha_attention_args *a, size_t q[4], size_t k[4],
                                  size_t v[4], char *msg, size_t msg_size) {
    char shape[96];
    const clmha_tensor *t[3] = {&a->query, &a->key, &a->value};
    const char *name[3] = {"query", "key", "value"};
    bool batched = a->query.ndim == 4;
    for (int i = 0; i < 3; ++i) {
        if (t[i]->ndim != 3 && t[i]->ndim != 4)
            return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                              "%s has %zu dimensions: it must be %s, or 3-D unbatched", name[i],
                              t[i]->ndim, pattern(a->layout, true, "qkv"[i]));
        if (t[i]->ndim != a->query.ndim)
            return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                              "%s is %s but the query is %zu-D: it must be %s", name[i],
                              clmha__shape_str(shape, sizeof shape, t[i]->ndim, t[i]->shape),
                              a->query.ndim, pattern(a->layout, batched, "qkv"[i]));
        for (size_t j = 0; j < t[i]->ndim; ++j)
            if (!t[i]->shape[j])
                return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                                  "%s is %s: every size must be positive", name[i],
                                  clmha__shape_str(shape, sizeof shape, t[i]->ndim,
                                                   t[i]->shape));
    }
    clmha__attention_sizes(&a->query, a->layout, q);
    clmha__attention_sizes(&a->key, a->layout, k);
    clmha__attention_sizes(&a->value, a->layout, v);
    const char *ks = clmha__shape_str(shape, sizeof shape, a->key.ndim, a->key.shape);
    if (k[N_] != q[N_] || k[F_] != q[F_])
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "key is %s, %s: its N (%zu) and D (%zu) must equal the query's "
                          "(%zu, %zu)",
                          ks, pattern(a->layout, batched, 'k'), k[N_], k[F_], q[N_], q[F_]);
    const char *vs = clmha__shape_str(shape, sizeof shape, a->value.ndim, a->value.shape);
    if (v[N_] != k[N_] || v[H_] != k[H_] || v[T_] != k[T_])
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "value is %s, %s: its N, H_kv and S (%zu, %zu, %zu) must equal the "
                          "key's (%zu, %zu, %zu)",
                          vs, pattern(a->layout, batched, 'v'), v[N_], v[H_], v[T_], k[N_],
                          k[H_], k[T_]);
    if (!a->enable_gqa && k[H_] != q[H_])
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "the key and value have %zu heads, the query %zu: they must be equal, "
                          "or set enable_gqa (grouped-query attention: H_kv divides H)",
                          k[H_], q[H_]);
    if (q[H_] % k[H_])
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "enable_gqa: the key and value's %zu heads must divide the query's %zu",
                          k[H_], q[H_]);
    return CLMHA_SUCCESS;
}

// The options: layout, scale, dropout_p, impl, is_causal with a mask.
static clmha_status check_options(const clmha_attention_args *a, char *msg, size_t msg_size) {
    if (a->layout != CLMHA_LAYOUT_NHLD && a->layout != CLMHA_LAYOUT_NLHD)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "layout is %d: it must be CLMHA_LAYOUT_NHLD (0) or CLMHA_LAYOUT_NLHD (1)",
                          (int)a->layout);
    if (!isfinite(a->scale))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "scale is %g: it must be finite (0 means 1/sqrt(D))", a->scale);
    if (!(a->dropout_p >= 0.0f && a->dropout_p < 1.0f))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "dropout_p (%g) must be in [0, 1)", (double)a->dropout_p);
    if (a->impl != CLMHA_IMPL_AUTO && a->impl != CLMHA_IMPL_FUSED &&
        a->impl != CLMHA_IMPL_UNFUSED)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "impl is %d: it must be CLMHA_IMPL_AUTO, _FUSED or _UNFUSED",
                          (int)a->impl);
    if (a->is_causal && a->attn_mask.kind != CLMHA_MASK_NONE)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "attn_mask and is_causal are both set: give one (as "
                          "scaled_dot_product_attention; a causal mask can be part of attn_mask)");
    clmha_status st = clmha__window_check(a->window, a->window_left, a->window_right, "args",
                                          msg, msg_size);
    if (!st) st = clmha__softcap_check(a->softcap, "args", msg, msg_size);
    if (st) return st;
    if (a->kv_append && !a->kv_cache)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "kv_append is set but kv_cache is NULL: it says how many new tokens "
                          "of each sequence a call with a cache appends");
    return CLMHA_SUCCESS;
}

// The mask (after the tensors: d->core holds the call's sizes): its kind and shape, into d->attn,
// d->core's attn_kind, strides and count, d->mask_count.
static clmha_status check_mask(const clmha_attention_args *args, clmha__attention_dims *d,
                               char *msg, size_t msg_size) {
    const clmha_mask *m = &args->attn_mask;
    char shape[96];
    if (m->kind == CLMHA_MASK_NONE) {
        if (m->tensor.ndim || m->per_batch)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                              "attn_mask has kind CLMHA_MASK_NONE but a tensor or per_batch");
        return CLMHA_SUCCESS;
    }
    if (m->kind != CLMHA_MASK_BOOL_IGNORE && m->kind != CLMHA_MASK_BOOL_ATTEND &&
        m->kind != CLMHA_MASK_FLOAT)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK, "attn_mask has unknown kind %d",
                          (int)m->kind);
    if (m->per_batch)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                          "attn_mask.per_batch is set: a mask per batch item is (N, 1, L, S) "
                          "here, per_batch must be false");
    // SDPA's broadcast of (a, b, c, S') (leading ones added) to (N, H, L, S): each of a, b, c
    // is 1 or the call's size; the keys are not broadcast (S' = S).
    size_t n = d->core.n, h = d->core.h, l = d->core.l, s = d->core.s, x[4] = {1, 1, 1, 1};
    const clmha_tensor *t = &m->tensor;
    bool fits = t->ndim >= 1 && t->ndim <= args->query.ndim;
    for (size_t i = 0; fits && i < t->ndim; ++i) x[4 - t->ndim + i] = t->shape[i];
    fits = fits && (x[0] == 1 || x[0] == n) && (x[1] == 1 || x[1] == h) &&
           (x[2] == 1 || x[2] == l) && x[3] == s;
    if (!fits)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                          "attn_mask is %s: for N %zu, H %zu, L %zu and S %zu it must broadcast "
                          "to (N, H, L, S) as (a, b, c, S) with a 1 or N, b 1 or H, c 1 or L "
                          "(leading ones may be left out; unbatched at most 3-D: (b, c, S)); its "
                          "last dimension must be S (a mask broadcast over the keys, (..., 1), "
                          "is not taken: expand it to S)",
                          clmha__shape_str(shape, sizeof shape, t->ndim, t->shape), n, h, l, s);
    if (!product(t->shape, t->ndim, &d->mask_count))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "attn_mask's size overflows");
    d->attn = *m;
    d->core.attn_kind = m->kind;
    clmha__attn_strides(&d->core, x[0], x[1], x[2]);
    d->core.attn_count = d->mask_count;
    return CLMHA_SUCCESS;
}

// The element counts of @p d, false on overflow.
static bool counts(const size_t q[4], const size_t k[4], const size_t v[4],
                   clmha__attention_dims *d) {
    size_t out[4] = {q[N_], q[H_], q[T_], v[F_]}, w[4] = {q[N_], q[H_], q[T_], k[T_]};
    size_t e[2] = {q[H_], q[F_]};
    return product(q, 4, &d->query_count) && product(k, 4, &d->key_count) &&
           product(v, 4, &d->value_count) && product(out, 4, &d->output_count) &&
           product(out, 3, &d->lse_count) && product(w, 4, &d->weights_count) &&
           product(e, 2, &d->core.e);
}

// A packed call's (T, heads, feat) tensor @p t: its shape, checked against @p tokens.
static clmha_status packed_tensor(const char *name, const clmha_tensor *t, size_t tokens,
                                  const char *lens, char *msg, size_t msg_size) {
    char shape[96];
    if (t->ndim != 3 || t->shape[0] != tokens || !t->shape[1] || !t->shape[2])
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "a packed call's %s must be 3-D (T, heads, D) with T = %zu, the sum of "
                          "%s; got %s",
                          name, tokens, lens, clmha__shape_str(shape, sizeof shape, t->ndim,
                                                               t->shape));
    return CLMHA_SUCCESS;
}

// A packed call (args->seq_lens): the lengths, the (T, H, D) tensors read as one (1, T, H, D)
// call of the NLHD layout for the shared checks (*a, a copy of the caller's), and what it
// refuses.
static clmha_status resolve_packed(const clmha_attention_args *args, clmha_attention_args *a,
                                   clmha__dims *c, char *msg, size_t msg_size) {
    const char *no = args->attn_mask.kind ? "attn_mask (it has no per-sequence shape)"
                     : args->kv_cache     ? "kv_cache"
                                          : NULL;
    if (no)
        return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                          "a packed call (seq_lens) does not take %s", no);
    if (!args->num_seqs)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "seq_lens is set but num_seqs is 0");
    c->packed = true;
    c->seq_lens = args->seq_lens;
    c->kv_seq_lens = args->kv_seq_lens ? args->kv_seq_lens : args->seq_lens;
    size_t lq = 0, lk = 0;
    for (size_t i = 0; i < args->num_seqs; ++i) {
        size_t x = c->seq_lens[i], y = c->kv_seq_lens[i];
        if (x > SIZE_MAX - c->t_q || y > SIZE_MAX - c->t_kv)
            return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "the sequence lengths overflow");
        if (x && !y)
            return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                              "sequence %zu of the packed call has %zu queries but no keys "
                              "(kv_seq_lens[%zu] = 0)", i, x, i);
        c->t_q += x, c->t_kv += y;
        lq = x > lq ? x : lq, lk = y > lk ? y : lk;
    }
    if (!c->t_q)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "a packed call needs at least one query: every seq_lens is 0");
    clmha_status st;
    if ((st = packed_tensor("query", &args->query, c->t_q, "seq_lens", msg, msg_size)) ||
        (st = packed_tensor("key", &args->key, c->t_kv, "kv_seq_lens", msg, msg_size)) ||
        (st = packed_tensor("value", &args->value, c->t_kv, "kv_seq_lens", msg, msg_size)))
        return st;
    *a = *args;
    a->layout = CLMHA_LAYOUT_NLHD;
    clmha_tensor *t[3] = {&a->query, &a->key, &a->value};
    for (int i = 0; i < 3; ++i) {  // (T, heads, D) as (1, T, heads, D)
        t[i]->ndim = 4;
        memmove(t[i]->shape + 1, t[i]->shape, 3 * sizeof *t[i]->shape);
        t[i]->shape[0] = 1;
    }
    c->n = args->num_seqs, c->l = lq, c->s = lk;
    return CLMHA_SUCCESS;
}

void clmha__attention_packed_args(const clmha__attention_dims *d, const clmha_attention_args *a,
                                  size_t i, size_t q0, size_t k0, clmha_attention_args *sub) {
    const clmha__dims *c = &d->core;
    *sub = *a;
    sub->seq_lens = sub->kv_seq_lens = NULL;
    sub->num_seqs = 0;
    sub->layout = CLMHA_LAYOUT_NLHD;
    sub->rng.offset += (uint64_t)i << 32;
    clmha_tensor *t[3] = {&sub->query, &sub->key, &sub->value};
    size_t rows[3] = {c->seq_lens[i], c->kv_seq_lens[i], c->kv_seq_lens[i]};
    size_t first[3] = {q0, k0, k0};
    for (int j = 0; j < 3; ++j) {
        size_t heads = t[j]->shape[1], feat = t[j]->shape[2], skip = first[j] * heads * feat;
        *t[j] = (clmha_tensor){.ndim = 4, .shape = {1, rows[j], heads, feat},
                               .buffer = t[j]->buffer, .offset = t[j]->offset + skip,
                               .data = t[j]->data ? (const float *)t[j]->data + skip : NULL};
    }
}

clmha_status clmha__attention_resolve(const clmha_attention_args *args_in,
                                      clmha__attention_dims *d, char *msg, size_t msg_size) {
    memset(d, 0, sizeof *d);
    size_t q[4], k[4], v[4];
    clmha_status st;
    clmha_attention_args packed;
    const clmha_attention_args *args = args_in;
    if (args_in->seq_lens) {
        if ((st = resolve_packed(args_in, &packed, &d->core, msg, msg_size))) return st;
        args = &packed;
    } else if (args_in->kv_seq_lens || args_in->num_seqs) {
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "%s is set but seq_lens is NULL: only a packed call takes it",
                          args_in->kv_seq_lens ? "kv_seq_lens" : "num_seqs");
    }
    if ((st = check_options(args, msg, msg_size)) ||
        (st = check_tensors(args, q, k, v, msg, msg_size)))
        return st;
    if (!counts(q, k, v, d))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                          "the sizes of the query, key, value or results overflow");
    clmha__dims *c = &d->core;
    c->batched = args->query.ndim == 4;
    c->batch_first = true;
    if (c->packed) {  // the weights have no packed shape; N, L, S the sequences'
        d->weights_count = 0;
        c->s_padded = c->s;
    } else {
        c->n = q[N_], c->l = q[T_], c->s = c->s_padded = k[T_];
    }
    c->h = q[H_], c->d = q[F_], c->kvh = k[H_];
    c->kdim = c->vdim = c->e;
    c->query_count = d->query_count, c->key_count = d->key_count;
    c->value_count = d->value_count;
    c->output_count = d->output_count;
    c->weights_count = c->scores_count = d->weights_count;
    d->layout = args->layout;
    d->dv = v[F_];
    d->scale = args->scale != 0.0 ? args->scale : 1.0 / sqrt((double)q[F_]);
    clmha__window_set(c, args->window, args->window_left, args->window_right);
    c->softcap = args->softcap;
    c->alibi = args->alibi;
    c->sinks = args->sinks.ndim != 0;
    c->mod_source = args->mod_source && *args->mod_source ? args->mod_source : NULL;
    if (args->mod_params.ndim && (!c->mod_source || args->mod_params.ndim != 1))
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          c->mod_source ? "mod_params must be one-dimensional (count); got %zu "
                                          "dimensions"
                                        : "mod_params is given (%zu dimensions) without "
                                          "mod_source",
                          args->mod_params.ndim);
    if (args->sinks.ndim && (args->sinks.ndim != 1 || args->sinks.shape[0] != c->h))
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "sinks must be (H) = (%zu), one logit per query head; got %zu "
                          "dimensions (first %zu)",
                          c->h, args->sinks.ndim, args->sinks.shape[0]);
    const clmha_tensor *slopes = &args->alibi_slopes;
    if (slopes->ndim && (!args->alibi || slopes->ndim != 1 || slopes->shape[0] != c->h))
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          args->alibi ? "alibi_slopes must be (H) = (%zu), one slope per query "
                                        "head; got %zu dimensions (first %zu)"
                                      : "alibi_slopes is given (H %zu; %zu dimensions, first "
                                        "%zu) but alibi is false",
                          c->h, slopes->ndim, slopes->shape[0]);
    return check_mask(args, d, msg, msg_size);
}
