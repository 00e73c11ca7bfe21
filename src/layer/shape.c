// Shape checking of layer descriptors and forward arguments, shared by the OpenCL forward pass
// and the CPU reference so that both accept and refuse exactly the same calls.
#include "layer/shape.h"

#include "base/checked.h"
#include "base/message.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

clmha_status clmha__window_check(bool window, int64_t left, int64_t right, const char *where,
                                 char *msg, size_t msg_size) {
    if (!window) return CLMHA_SUCCESS;
    if (left < -1 || right < -1)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "%s.window_left (%lld) and %s.window_right (%lld) must each be -1 "
                          "(unbounded) or at least 0",
                          where, (long long)left, where, (long long)right);
    return CLMHA_SUCCESS;
}

void clmha__window_set(clmha__dims *d, bool window, int64_t left, int64_t right) {
    d->win_left = window ? left : -1;
    d->win_right = window ? right : -1;
}

clmha_status clmha__softcap_check(double softcap, const char *where, char *msg,
                                  size_t msg_size) {
    // Within float's normal range: the float32 and 16-bit kernels take c as a float, where a
    // larger value is infinity and a smaller one 0 or subnormal, and c * tanh(s / c) NaN (a
    // float64 layer would manage, but no such cap is of use).
    if (!(softcap == 0.0 || (softcap >= FLT_MIN && softcap <= FLT_MAX)))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "%s.softcap (%g) must be 0 (off) or from FLT_MIN to FLT_MAX "
                          "(1.2e-38 to 3.4e38)",
                          where, softcap);
    return CLMHA_SUCCESS;
}

clmha_status clmha__desc_check(const clmha_layer_desc *desc, clmha_layer_desc *out, char *msg,
                               size_t msg_size) {
    if (!desc) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "desc is NULL");
    if (desc->embed_dim == 0 || desc->num_heads == 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "embed_dim (%zu) and num_heads (%zu) must be positive", desc->embed_dim,
                          desc->num_heads);
    if (desc->embed_dim % desc->num_heads != 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "embed_dim (%zu) must be divisible by num_heads (%zu)", desc->embed_dim,
                          desc->num_heads);
    if (!(desc->dropout >= 0.0f && desc->dropout < 1.0f))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "dropout (%g) must be in [0, 1)", (double)desc->dropout);
    if (desc->num_kv_heads && desc->num_heads % desc->num_kv_heads != 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "num_kv_heads (%zu) must divide num_heads (%zu)", desc->num_kv_heads,
                          desc->num_heads);
    if (desc->dtype != CLMHA_DTYPE_F32 && desc->dtype != CLMHA_DTYPE_F64 &&
        desc->dtype != CLMHA_DTYPE_F16 && desc->dtype != CLMHA_DTYPE_BF16)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "dtype %d is not CLMHA_DTYPE_F32, _F64, _F16 or _BF16", (int)desc->dtype);
    clmha_status st = clmha__window_check(desc->window, desc->window_left, desc->window_right,
                                          "desc", msg, msg_size);
    if (!st) st = clmha__softcap_check(desc->softcap, "desc", msg, msg_size);
    if (st) return st;
    *out = *desc;
    if (out->num_kv_heads == 0) out->num_kv_heads = out->num_heads;
    if (out->kdim == 0) out->kdim = out->embed_dim;
    if (out->vdim == 0) out->vdim = out->embed_dim;
    // Parameter sizes must be representable: 3 * E * max(E, kdim, vdim) floats.
    size_t widest = out->embed_dim;
    if (out->kdim > widest) widest = out->kdim;
    if (out->vdim > widest) widest = out->vdim;
    size_t t;
    if (!clmha__mul(out->embed_dim, widest, &t) || !clmha__mul(t, 3 * sizeof(float), &t) ||
        out->embed_dim > SIZE_MAX / 16)
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                          "parameter sizes overflow (embed_dim %zu, kdim %zu, vdim %zu)",
                          out->embed_dim, out->kdim, out->vdim);
    return CLMHA_SUCCESS;
}

// Product of a tensor's shape, checked for overflow, with room for 4-byte elements.
static bool tensor_count(const clmha_tensor *t, size_t *count) {
    size_t c = 1;
    for (size_t i = 0; i < t->ndim; ++i)
        if (!clmha__mul(c, t->shape[i], &c)) return false;
    if (c > SIZE_MAX / sizeof(double)) return false;
    *count = c;
    return true;
}

// Checks that an input tensor is (seq, batch, feat) in the layer's layout, or (seq, feat)
// unbatched; returns seq and batch.
static clmha_status input_dims(const char *name, const clmha_tensor *t, bool batched,
                               bool batch_first, size_t feat, size_t *seq, size_t *batch,
                               char *msg, size_t msg_size) {
    char s[96];
    size_t want_ndim = batched ? 3 : 2;
    // The dimension names of this tensor, in PyTorch's notation.
    const char *seq_name = name[0] == 'q' ? "L" : "S";
    const char *feat_name = name[0] == 'q' ? "E" : name[0] == 'k' ? "kdim" : "vdim";
    if (t->ndim != want_ndim)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "%s must be %s-D (%s%s%s, %s)%s, got %zu-D %s", name,
                          batched ? "3" : "2", batched && batch_first ? "N, " : "", seq_name,
                          batched && !batch_first ? ", N" : "", feat_name,
                          batched ? "" : " (unbatched, like the query)", t->ndim,
                          clmha__shape_str(s, sizeof s, t->ndim, t->shape));
    if (batched) {
        *seq = batch_first ? t->shape[1] : t->shape[0];
        *batch = batch_first ? t->shape[0] : t->shape[1];
    } else {
        *seq = t->shape[0];
        *batch = 1;
    }
    if (t->shape[t->ndim - 1] != feat)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "%s %s has %zu features, the layer expects %zu", name,
                          clmha__shape_str(s, sizeof s, t->ndim, t->shape),
                          t->shape[t->ndim - 1], feat);
    if (*seq == 0 || *batch == 0)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH, "%s %s has a zero size", name,
                          clmha__shape_str(s, sizeof s, t->ndim, t->shape));
    return CLMHA_SUCCESS;
}

static bool shape_is(const clmha_tensor *t, size_t ndim, size_t a, size_t b, size_t c) {
    size_t want[3] = {a, b, c};
    if (t->ndim != ndim) return false;
    for (size_t i = 0; i < ndim; ++i)
        if (t->shape[i] != want[i]) return false;
    return true;
}

static clmha_status check_mask_kind(const char *name, const clmha_mask *m, char *msg,
                                    size_t msg_size) {
    if (m->kind < CLMHA_MASK_NONE || m->kind > CLMHA_MASK_FLOAT)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK, "%s has an unknown kind (%d)", name,
                          (int)m->kind);
    if (m->kind == CLMHA_MASK_NONE && (m->tensor.ndim != 0 || m->per_batch))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                          "%s has %s but kind CLMHA_MASK_NONE: set its kind "
                          "(BOOL_IGNORE, BOOL_ATTEND or FLOAT)",
                          name, m->tensor.ndim ? "a tensor" : "per_batch set");
    return CLMHA_SUCCESS;
}

// Which inputs the call gives (d->batched, d->batch_first, d->key_is_query, d->value_is_key)
// and whether the layer allows that; the query's rank.
static clmha_status resolve_roles(const clmha_layer_desc *desc, const clmha_forward_args *args,
                                  clmha__dims *d, char *msg, size_t msg_size) {
    char s1[96];
    const clmha_tensor *q = &args->query;
    if (q->ndim != 2 && q->ndim != 3)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "query must be 3-D %s or 2-D (L, E) unbatched, got %zu-D %s",
                          desc->batch_first ? "(N, L, E)" : "(L, N, E)", q->ndim,
                          clmha__shape_str(s1, sizeof s1, q->ndim, q->shape));
    d->batched = q->ndim == 3;
    d->batch_first = d->batched && desc->batch_first;
    d->key_is_query = args->key.ndim == 0;
    d->value_is_key = args->value.ndim == 0;
    if (d->key_is_query && !d->value_is_key)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "value is given but key is not: give both, or neither for "
                          "self-attention");
    if (d->key_is_query && (d->kdim != d->e || d->vdim != d->e))
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "self-attention needs kdim (%zu) and vdim (%zu) equal to embed_dim "
                          "(%zu): pass key and value",
                          d->kdim, d->vdim, d->e);
    if (d->value_is_key && d->kdim != d->vdim)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "value defaults to key, but kdim (%zu) != vdim (%zu): pass value",
                          d->kdim, d->vdim);
    return CLMHA_SUCCESS;
}

// The sizes of the inputs (d->l, d->n, d->s, the element counts, d->s_padded), which must agree;
// the roles are resolved.
static clmha_status resolve_inputs(const clmha_layer_desc *desc, const clmha_forward_args *args,
                                   clmha__dims *d, char *msg, size_t msg_size) {
    char s1[96], s2[96];
    clmha_status st;
    const clmha_tensor *q = &args->query;
    const clmha_tensor *k = d->key_is_query ? q : &args->key;
    const clmha_tensor *v = d->value_is_key ? k : &args->value;
    size_t n_k, n_v, s_v;
    if ((st = input_dims("query", q, d->batched, d->batch_first, d->e, &d->l, &d->n, msg,
                         msg_size)))
        return st;
    if ((st = input_dims("key", k, d->batched, d->batch_first, d->kdim, &d->s, &n_k, msg,
                         msg_size)))
        return st;
    if ((st = input_dims("value", v, d->batched, d->batch_first, d->vdim, &s_v, &n_v, msg,
                         msg_size)))
        return st;
    if (n_k != d->n || n_v != d->n) {
        char s3[96];
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "batch sizes differ: query %s (N = %zu), key %s (N = %zu), value %s "
                          "(N = %zu)",
                          clmha__shape_str(s1, sizeof s1, q->ndim, q->shape), d->n,
                          clmha__shape_str(s2, sizeof s2, k->ndim, k->shape), n_k,
                          clmha__shape_str(s3, sizeof s3, v->ndim, v->shape), n_v);
    }
    if (s_v != d->s)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "key %s and value %s have different source lengths",
                          clmha__shape_str(s1, sizeof s1, k->ndim, k->shape),
                          clmha__shape_str(s2, sizeof s2, v->ndim, v->shape));
    const clmha_tensor *inputs[3] = {q, k, v};
    size_t *counts[3] = {&d->query_count, &d->key_count, &d->value_count};
    const char *names[3] = {"query", "key", "value"};
    for (int i = 0; i < 3; ++i)
        if (!tensor_count(inputs[i], counts[i]))
            return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                              "%s %s has more elements than memory can address", names[i],
                              clmha__shape_str(s1, sizeof s1, inputs[i]->ndim,
                                               inputs[i]->shape));
    d->s_padded = d->s + (desc->add_bias_kv ? 1 : 0) + (desc->add_zero_attn ? 1 : 0);
    return CLMHA_SUCCESS;
}

// Sums @p n lengths into @p total and their largest into @p longest; false on overflow.
static bool lens_sum(const size_t *lens, size_t n, size_t *total, size_t *longest) {
    size_t t = 0, m = 0;
    for (size_t i = 0; i < n; ++i) {
        if (!clmha__add(t, lens[i], &t)) return false;
        if (lens[i] > m) m = lens[i];
    }
    *total = t, *longest = m;
    return true;
}

// Checks that packed input @p name is 2-D (@p tokens, @p feat).
static clmha_status packed_input(const char *name, const clmha_tensor *t, size_t tokens,
                                 size_t feat, const char *lens, char *msg, size_t msg_size) {
    char s[96];
    if (t->ndim != 2 || t->shape[0] != tokens || t->shape[1] != feat)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "a packed call's %s must be 2-D (T, %zu) with T = %zu, the sum of %s; "
                          "got %zu-D %s",
                          name, feat, tokens, lens, t->ndim,
                          clmha__shape_str(s, sizeof s, t->ndim, t->shape));
    return CLMHA_SUCCESS;
}

// The sizes of a packed call (clmha_forward_args::seq_lens), and what it refuses.
static clmha_status resolve_packed(const clmha_layer_desc *desc, const clmha_forward_args *args,
                                   clmha__dims *d, char *msg, size_t msg_size) {
    clmha_status st;
    const char *no = args->key_padding_mask.kind ? "key_padding_mask (the lengths say it)"
                     : args->attn_mask.kind      ? "attn_mask (it has no per-sequence shape)"
                     : args->need_weights        ? "need_weights (as PyTorch's fast path)"
                     : args->kv_append           ? "kv_append (kv_seq_lens says how many keys "
                                                   "each sequence appends)"
                                                 : NULL;
    if (no)
        return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                          "a packed call (seq_lens) does not take %s", no);
    if (args->num_seqs == 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "seq_lens is set but num_seqs is 0");
    d->packed = d->batched = true;
    d->n = args->num_seqs;
    d->seq_lens = args->seq_lens;
    d->kv_seq_lens = args->kv_seq_lens ? args->kv_seq_lens : args->seq_lens;
    if (!lens_sum(d->seq_lens, d->n, &d->t_q, &d->l) ||
        !lens_sum(d->kv_seq_lens, d->n, &d->t_kv, &d->s))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "the sequence lengths overflow");
    if (d->t_q == 0)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "a packed call needs at least one query: every seq_lens is 0");
    for (size_t i = 0; i < d->n; ++i)
        if (d->seq_lens[i] && !d->kv_seq_lens[i])
            return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                              "sequence %zu of the packed call has %zu queries but no keys "
                              "(kv_seq_lens[%zu] = 0)", i, d->seq_lens[i], i);
    if (d->key_is_query && args->kv_seq_lens && d->kv_seq_lens != d->seq_lens &&
        memcmp(d->kv_seq_lens, d->seq_lens, d->n * sizeof *d->seq_lens))
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "self-attention (no key) takes its keys from the queries: "
                          "kv_seq_lens must be NULL or equal seq_lens");
    const clmha_tensor *q = &args->query;
    const clmha_tensor *k = d->key_is_query ? q : &args->key;
    const clmha_tensor *v = d->value_is_key ? k : &args->value;
    if ((st = packed_input("query", q, d->t_q, d->e, "seq_lens", msg, msg_size)) ||
        (st = packed_input("key", k, d->t_kv, d->kdim, "kv_seq_lens", msg, msg_size)) ||
        (st = packed_input("value", v, d->t_kv, d->vdim, "kv_seq_lens", msg, msg_size)))
        return st;
    const clmha_tensor *inputs[3] = {q, k, v};
    size_t *counts[3] = {&d->query_count, &d->key_count, &d->value_count};
    for (int i = 0; i < 3; ++i)
        if (!tensor_count(inputs[i], counts[i]))
            return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                              "the packed inputs have more elements than memory can address");
    d->s_padded = d->s + (desc->add_bias_kv ? 1 : 0) + (desc->add_zero_attn ? 1 : 0);
    return CLMHA_SUCCESS;
}

// key_padding_mask: (N, S) or (S); d->kpm_kind, d->kpm_count.
static clmha_status resolve_kpm(const clmha_mask *kpm, clmha__dims *d, char *msg,
                                size_t msg_size) {
    char s1[96];
    clmha_status st;
    if ((st = check_mask_kind("key_padding_mask", kpm, msg, msg_size))) return st;
    d->kpm_kind = kpm->kind;
    if (kpm->kind == CLMHA_MASK_NONE) return CLMHA_SUCCESS;
    bool ok = d->batched ? shape_is(&kpm->tensor, 2, d->n, d->s, 0)
                         : shape_is(&kpm->tensor, 1, d->s, 0, 0);
    if (!ok && d->batched)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                          "key_padding_mask must be (N, S) = (%zu, %zu), got %zu-D %s", d->n,
                          d->s, kpm->tensor.ndim,
                          clmha__shape_str(s1, sizeof s1, kpm->tensor.ndim, kpm->tensor.shape));
    if (!ok)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                          "key_padding_mask must be (S) = (%zu,) for unbatched inputs, got "
                          "%zu-D %s",
                          d->s, kpm->tensor.ndim,
                          clmha__shape_str(s1, sizeof s1, kpm->tensor.ndim, kpm->tensor.shape));
    if (kpm->per_batch)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                          "per_batch applies to attn_mask only, not key_padding_mask");
    d->kpm_count = d->batched ? d->n * d->s : d->s;
    return CLMHA_SUCCESS;
}

void clmha__attn_strides(clmha__dims *d, size_t a, size_t b, size_t c) {
    d->attn_si = c > 1 ? d->s : 0;
    d->attn_sh = b > 1 ? c * d->s : 0;
    d->attn_sn = a > 1 ? b * c * d->s : 0;
}

// attn_mask: (L, S), (N*H, L, S), or per_batch (N, L, S); d->attn_kind, its strides,
// d->attn_count.
static clmha_status resolve_attn_mask(const clmha_mask *am, clmha__dims *d, char *msg,
                                      size_t msg_size) {
    char s1[96];
    clmha_status st;
    if ((st = check_mask_kind("attn_mask", am, msg, msg_size))) return st;
    d->attn_kind = am->kind;
    if (am->kind == CLMHA_MASK_NONE) return CLMHA_SUCCESS;
    size_t nh;
    if (!clmha__mul(d->n, d->h, &nh))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "N*H overflows");
    const clmha_tensor *t = &am->tensor;
    if (am->per_batch && !d->batched) {
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                          "attn_mask per_batch needs batched (3-D) inputs; the query is "
                          "unbatched 2-D, so give the mask as (L, S) or (num_heads, L, S)");
    } else if (am->per_batch) {
        if (!shape_is(t, 3, d->n, d->l, d->s))
            return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                              "attn_mask with per_batch must be (N, L, S) = (%zu, %zu, %zu) "
                              "for batched inputs, got %zu-D %s",
                              d->n, d->l, d->s, t->ndim,
                              clmha__shape_str(s1, sizeof s1, t->ndim, t->shape));
        clmha__attn_strides(d, d->n, 1, d->l);
    } else if (shape_is(t, 2, d->l, d->s, 0)) {
        clmha__attn_strides(d, 1, 1, d->l);
    } else if (shape_is(t, 3, nh, d->l, d->s)) {
        clmha__attn_strides(d, d->n, d->h, d->l);
    } else {
        return clmha__msg(msg, msg_size, CLMHA_INVALID_MASK,
                          "attn_mask must be (L, S) = (%zu, %zu) or (%s, L, S) = (%zu, %zu, "
                          "%zu), got %zu-D %s",
                          d->l, d->s, d->batched ? "N*num_heads" : "num_heads", nh, d->l, d->s,
                          t->ndim, clmha__shape_str(s1, sizeof s1, t->ndim, t->shape));
    }
    if (!tensor_count(t, &d->attn_count))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "attn_mask size overflows");
    return CLMHA_SUCCESS;
}

clmha_status clmha__dims_resolve(const clmha_layer_desc *desc, const clmha_forward_args *args,
                                 clmha__dims *d, char *msg, size_t msg_size) {
    clmha_status st;
    memset(d, 0, sizeof *d);
    if (!args) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "args is NULL");
    if (args->query_position || args->key_position)  // partial attention's (partial.c)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "args->query_position and key_position are clmha_layer_attend()'s "
                          "(partial attention): 0 in every other call (got %zu and %zu)",
                          args->query_position, args->key_position);

    d->e = desc->embed_dim;
    d->kdim = desc->kdim ? desc->kdim : desc->embed_dim;
    d->vdim = desc->vdim ? desc->vdim : desc->embed_dim;
    d->h = desc->num_heads;
    d->kvh = desc->num_kv_heads ? desc->num_kv_heads : desc->num_heads;
    d->d = d->e / d->h;
    clmha__window_set(d, desc->window, desc->window_left, desc->window_right);
    d->softcap = desc->softcap;
    d->alibi = desc->alibi;
    d->sinks = desc->sinks;
    if (args->seq_lens) {
        if ((st = resolve_roles(desc, args, d, msg, msg_size)) ||
            (st = resolve_packed(desc, args, d, msg, msg_size)))
            return st;
        d->batch_first = false;
    } else if (args->kv_seq_lens || args->num_seqs) {
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "%s is set but seq_lens is NULL: only a packed call takes it",
                          args->kv_seq_lens ? "kv_seq_lens" : "num_seqs");
    }
    if ((!d->packed && ((st = resolve_roles(desc, args, d, msg, msg_size)) ||
                        (st = resolve_inputs(desc, args, d, msg, msg_size)))) ||
        (st = resolve_kpm(&args->key_padding_mask, d, msg, msg_size)) ||
        (st = resolve_attn_mask(&args->attn_mask, d, msg, msg_size)))
        return st;

    if (args->training && desc->dropout > 0.0f && !(desc->dropout < 1.0f))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "dropout must be in [0, 1)");

    // Outputs and scratch sizes.
    size_t t;
    if (!clmha__mul(d->packed ? 1 : d->n, d->packed ? d->t_q : d->l, &t) ||
        !clmha__mul(t, d->e, &d->output_count) ||
        !clmha__mul(d->n, d->h, &t) || !clmha__mul(t, d->l, &t) ||
        !clmha__mul(t, d->s_padded, &d->scores_count) ||
        d->scores_count > SIZE_MAX / sizeof(double) ||
        d->output_count > SIZE_MAX / sizeof(double))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                          "sizes overflow: N %zu, L %zu, S %zu, E %zu, H %zu", d->n, d->l, d->s,
                          d->e, d->h);
    if (args->need_weights)
        d->weights_count = args->per_head_weights ? d->scores_count
                                                  : d->n * d->l * d->s_padded;
    return CLMHA_SUCCESS;
}

clmha_status clmha__check_host_data(const clmha__dims *d, const clmha_forward_args *args,
                                    char *msg, size_t msg_size) {
    const char *culprit = !args->query.data                              ? "query.data"
                          : !d->key_is_query && !args->key.data          ? "key.data"
                          : !d->value_is_key && !args->value.data        ? "value.data"
                          : d->kpm_kind && !args->key_padding_mask.tensor.data
                              ? "key_padding_mask.tensor.data"
                          : d->attn_kind && !args->attn_mask.tensor.data ? "attn_mask.tensor.data"
                                                                         : NULL;
    if (culprit) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "%s is NULL", culprit);
    return CLMHA_SUCCESS;
}
