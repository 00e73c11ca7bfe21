// The layer a parsed .safetensors file describes, without OpenCL: clmha__safetensors_desc() maps
// the tensors to nn.MultiheadAttention's parameters (names and PyTorch shapes) and the metadata to
// the layer's descriptor; clmha__safetensors_to_double() gives a tensor's values as doubles
// (exactly, whatever its dtype).
#include "formats/safetensors.h"

#include "base/checked.h"
#include "base/half.h"
#include "base/message.h"
#include "formats/safetensors_private.h"
#include "layer/shape.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

// ---- tensor data as floats ----------------------------------------------------------------

void clmha__safetensors_to_double(const clmha__st_tensor *t, double *out) {
    const unsigned char *p = t->data;
    for (size_t i = 0; i < t->count; ++i) {
        if (t->dtype == CLMHA__ST_F16) {
            out[i] = clmha__f16_to_f32((uint16_t)(p[2 * i] | (p[2 * i + 1] << 8)));
        } else if (t->dtype == CLMHA__ST_BF16) {
            out[i] = clmha__bf16_to_f32((uint16_t)(p[2 * i] | (p[2 * i + 1] << 8)));
        } else if (t->dtype == CLMHA__ST_F32) {
            const unsigned char *q = p + 4 * i;
            uint32_t bits = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 |
                            (uint32_t)q[3] << 24;
            float f;
            memcpy(&f, &bits, sizeof f);
            out[i] = f;
        } else {
            uint64_t bits = clmha__st_le64(p + 8 * i);
            memcpy(&out[i], &bits, sizeof bits);
        }
    }
}

// ---- the descriptor -----------------------------------------------------------------------

static const char *const known_names[] = {
    "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
    "out_proj.weight", "out_proj.bias", "bias_k", "bias_v"};

// A positive decimal integer, digits only.
static bool parse_count(const char *s, size_t *out) {
    size_t v = 0;
    if (clmha__st_digits(s, strlen(s), &v) != 0 || v == 0) return false;
    *out = v;
    return true;
}

// A decimal number without sign: digits, optional fraction, optional exponent ("0.1", ".5",
// "1e-05", "0"). Independent of the C locale.
static bool parse_decimal(const char *s, double *out) {
    uint64_t mant = 0;
    long exp10 = 0;
    bool digits = false;
    for (; *s >= '0' && *s <= '9'; ++s) {
        digits = true;
        if (mant < 100000000000000000ull) mant = mant * 10 + (uint64_t)(*s - '0');
        else if (exp10 < 100000) ++exp10;  // digits past the 18th only scale
    }
    if (*s == '.') {
        for (++s; *s >= '0' && *s <= '9'; ++s) {
            digits = true;
            if (mant < 100000000000000000ull) {
                mant = mant * 10 + (uint64_t)(*s - '0');
                if (exp10 > -100000) --exp10;
            }
        }
    }
    if (!digits) return false;
    if (*s == 'e' || *s == 'E') {
        ++s;
        bool neg = *s == '-';
        if (*s == '-' || *s == '+') ++s;
        if (*s < '0' || *s > '9') return false;
        long e = 0;
        for (; *s >= '0' && *s <= '9'; ++s)
            if (e < 100000) e = e * 10 + (*s - '0');
        exp10 += neg ? -e : e;
    }
    if (*s) return false;
    double v = (double)mant;
    if (mant == 0 || exp10 == 0) {
        *out = v;
    } else if (exp10 > 400) {
        *out = INFINITY;
    } else if (exp10 < -400) {
        *out = 0.0;
    } else if (exp10 > 0) {
        *out = v * pow(10.0, (double)exp10);
    } else {
        *out = v / pow(10.0, (double)-exp10);
    }
    return true;
}

// Whether the decimal @p s (as parse_decimal() accepts it) is below 1, decided on its digits
// and exponent, exactly: the double parse_decimal() gives may round a value below 1 up to 1.
static bool decimal_below_one(const char *s) {
    long point = -1, first = -1, digits = 0;  // position of the point, of the first digit > 0
    for (; (*s >= '0' && *s <= '9') || *s == '.'; ++s) {
        if (*s == '.') {
            point = digits;
        } else {
            if (first < 0 && *s != '0') first = digits;
            ++digits;
        }
    }
    if (first < 0) return true;  // zero
    if (point < 0) point = digits;
    long exp10 = 0;
    if (*s == 'e' || *s == 'E') {
        ++s;
        bool neg = *s == '-';
        if (*s == '-' || *s == '+') ++s;
        for (; *s >= '0' && *s <= '9'; ++s)
            if (exp10 < 100000000) exp10 = exp10 * 10 + (*s - '0');
        if (neg) exp10 = -exp10;
    }
    // The first non-zero digit has the weight 10^(point - first - 1 + exp10).
    return point - first - 1 + exp10 < 0;
}

// "true" / "false" / absent (false).
static clmha_status meta_bool(const clmha__st_file *f, const char *key, bool *out,
                              const char *name, char *msg, size_t msg_size) {
    const char *v = clmha__safetensors_meta(f, key);
    *out = false;
    if (!v || strcmp(v, "false") == 0) return CLMHA_SUCCESS;
    if (strcmp(v, "true") == 0) {
        *out = true;
        return CLMHA_SUCCESS;
    }
    return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                      "%s: __metadata__ %s is \"%.*s\", expected \"true\" or \"false\"", name, key,
                      CLMHA__ST_QUOTE_MAX, v);
}

// Checks that tensor @p t (may be NULL: then nothing to check) has exactly the shape @p want.
static clmha_status expect_shape(const clmha__st_tensor *t, size_t ndim, const size_t *want,
                                 const char *formula, const char *name, char *msg,
                                 size_t msg_size) {
    if (!t) return CLMHA_SUCCESS;
    bool ok = t->ndim == ndim;
    for (size_t i = 0; ok && i < ndim; ++i) ok = t->shape[i] == want[i];
    if (ok) return CLMHA_SUCCESS;
    char got[256], exp[128];
    return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                      "%s: tensor \"%s\" has shape %s, expected %s = %s", name, t->name,
                      clmha__st_shape_text(got, sizeof got, t->ndim, t->shape), formula,
                      clmha__st_shape_text(exp, sizeof exp, ndim, want));
}

// The tensors @p a and @p b (*ta, *tb; NULL when absent), which a layer has both of (when its
// option @p option is True) or neither.
static clmha_status expect_pair(const clmha__st_file *f, const char *a, const char *b,
                                const char *option, const clmha__st_tensor **ta,
                                const clmha__st_tensor **tb, const char *name, char *msg,
                                size_t msg_size) {
    *ta = clmha__safetensors_tensor(f, a);
    *tb = clmha__safetensors_tensor(f, b);
    if (!*ta == !*tb) return CLMHA_SUCCESS;
    return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                      "%s: the file has %s but no %s; a layer has both (%s = True) or neither",
                      name, *ta ? a : b, *ta ? b : a, option);
}

clmha_status clmha__safetensors_desc(const clmha__st_file *f, const char *name,
                                     clmha_layer_desc *desc, char *msg, size_t msg_size) {
    if (!f || !desc) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "NULL argument");
    if (!name) name = "(unnamed)";
    memset(desc, 0, sizeof *desc);
    clmha_status st;
    char sbuf[256];

    for (size_t i = 0; i < f->tensor_count; ++i) {
        bool known = false;
        for (size_t k = 0; k < sizeof known_names / sizeof *known_names && !known; ++k)
            known = strcmp(f->tensors[i].name, known_names[k]) == 0;
        if (!known)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: unknown tensor \"%.*s\" (a nn.MultiheadAttention file holds "
                              "in_proj_weight or q_proj_weight, k_proj_weight and v_proj_weight, "
                              "out_proj.weight, and optionally in_proj_bias with out_proj.bias, "
                              "bias_k with bias_v)",
                              name, CLMHA__ST_QUOTE_MAX, f->tensors[i].name);
    }

    // embed_dim from out_proj.weight (E, E).
    const clmha__st_tensor *ow = clmha__safetensors_tensor(f, "out_proj.weight");
    if (!ow)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the file has no tensor \"out_proj.weight\"", name);
    if (ow->ndim != 2 || ow->shape[0] == 0 || ow->shape[0] != ow->shape[1]) {
        size_t e0 = ow->ndim ? ow->shape[0] : 0;
        char want[128] = "";
        if (e0) snprintf(want, sizeof want, " = (%zu, %zu)", e0, e0);
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"out_proj.weight\" has shape %s, expected (E, E)%s with "
                          "E > 0",
                          name, clmha__st_shape_text(sbuf, sizeof sbuf, ow->ndim, ow->shape), want);
    }
    size_t e = ow->shape[0], three_e;
    if (!clmha__mul(e, 3, &three_e))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "%s: embed_dim %zu is too large",
                          name, e);

    // Grouped-query attention (__metadata__ num_kv_heads): the key/value shapes are checked
    // once num_heads is known, below.
    const char *nkv = clmha__safetensors_meta(f, "num_kv_heads");
    size_t kv_heads = 0;
    if (nkv && !parse_count(nkv, &kv_heads))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ num_kv_heads is \"%.*s\", expected a positive "
                          "decimal integer such as \"2\"",
                          name, CLMHA__ST_QUOTE_MAX, nkv);

    // The input projection: packed, or one weight per input.
    const clmha__st_tensor *ipw = clmha__safetensors_tensor(f, "in_proj_weight");
    const clmha__st_tensor *qw = clmha__safetensors_tensor(f, "q_proj_weight");
    const clmha__st_tensor *kw = clmha__safetensors_tensor(f, "k_proj_weight");
    const clmha__st_tensor *vw = clmha__safetensors_tensor(f, "v_proj_weight");
    size_t kdim = e, vdim = e;
    if (ipw) {
        if (qw || kw || vw)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the file holds both in_proj_weight and %s; it must hold "
                              "either in_proj_weight or q_proj_weight, k_proj_weight and "
                              "v_proj_weight",
                              name, qw ? "q_proj_weight" : kw ? "k_proj_weight" : "v_proj_weight");
        size_t want[2] = {three_e, e};
        if ((st = expect_shape(ipw, 2, want, "(3E, E)", name, msg, msg_size))) return st;
    } else {
        if (!qw || !kw || !vw)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the file has neither in_proj_weight nor q_proj_weight, "
                              "k_proj_weight and v_proj_weight (no \"%s\")",
                              name,
                              !qw ? "q_proj_weight" : !kw ? "k_proj_weight" : "v_proj_weight");
        size_t want[2] = {e, e};
        if ((st = expect_shape(qw, 2, want, "(E, E)", name, msg, msg_size))) return st;
        const clmha__st_tensor *kv[2] = {kw, vw};
        for (int i = 0; i < 2; ++i) {
            const clmha__st_tensor *t = kv[i];
            if (t->ndim != 2 || (t->shape[0] != e && !nkv) || t->shape[0] == 0 ||
                t->shape[1] == 0)
                return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                                  "%s: tensor \"%s\" has shape %s, expected (E, %s) = (%zu, %s) "
                                  "with %s > 0",
                                  name, t->name,
                                  clmha__st_shape_text(sbuf, sizeof sbuf, t->ndim, t->shape),
                                  i ? "vdim" : "kdim", e, i ? "vdim" : "kdim", i ? "vdim" : "kdim");
        }
        kdim = kw->shape[1];
        vdim = vw->shape[1];
    }

    // Biases come in pairs.
    const clmha__st_tensor *ib, *ob, *bk, *bv;
    if ((st = expect_pair(f, "in_proj_bias", "out_proj.bias", "bias", &ib, &ob, name, msg,
                          msg_size)))
        return st;
    if (!nkv &&
        (st = expect_shape(ib, 1, (size_t[]){three_e}, "(3E)", name, msg, msg_size)))
        return st;
    if ((st = expect_shape(ob, 1, (size_t[]){e}, "(E)", name, msg, msg_size))) return st;
    if ((st = expect_pair(f, "bias_k", "bias_v", "add_bias_kv", &bk, &bv, name, msg, msg_size)))
        return st;
    size_t want_kv[3] = {1, 1, e};
    if (!nkv && ((st = expect_shape(bk, 3, want_kv, "(1, 1, E)", name, msg, msg_size)) ||
                 (st = expect_shape(bv, 3, want_kv, "(1, 1, E)", name, msg, msg_size))))
        return st;

    // Metadata.
    const char *nh = clmha__safetensors_meta(f, "num_heads");
    size_t heads = 0;
    if (!nh)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ has no num_heads (the number of attention heads, a "
                          "decimal string such as \"8\")",
                          name);
    if (!parse_count(nh, &heads))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ num_heads is \"%.*s\", expected a positive decimal "
                          "integer such as \"8\"",
                          name, CLMHA__ST_QUOTE_MAX, nh);
    if (e % heads != 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ num_heads %zu does not divide embed_dim %zu (from "
                          "out_proj.weight)",
                          name, heads, e);
    if (nkv) {  // the shapes of grouped-query attention, now that D = E / num_heads is known
        if (heads % kv_heads != 0)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: __metadata__ num_kv_heads %zu does not divide num_heads %zu",
                              name, kv_heads, heads);
        size_t kve = kv_heads * (e / heads);
        if (ipw && kve != e)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the file holds in_proj_weight, but a layer with num_kv_heads "
                              "%zu below num_heads %zu has q_proj_weight, k_proj_weight and "
                              "v_proj_weight",
                              name, kv_heads, heads);
        const char *kv_shape = "(num_kv_heads*head_dim, kdim)";
        if (!ipw && ((st = expect_shape(kw, 2, (size_t[]){kve, kdim}, kv_shape, name, msg,
                                        msg_size)) ||
                     (st = expect_shape(vw, 2, (size_t[]){kve, vdim},
                                        "(num_kv_heads*head_dim, vdim)", name, msg, msg_size))))
            return st;
        if ((st = expect_shape(ib, 1, (size_t[]){e + 2 * kve}, "(E + 2*num_kv_heads*head_dim)",
                               name, msg, msg_size)) ||
            (st = expect_shape(bk, 3, (size_t[]){1, 1, kve}, "(1, 1, num_kv_heads*head_dim)",
                               name, msg, msg_size)) ||
            (st = expect_shape(bv, 3, (size_t[]){1, 1, kve}, "(1, 1, num_kv_heads*head_dim)",
                               name, msg, msg_size)))
            return st;
    }
    bool batch_first, add_zero_attn;
    if ((st = meta_bool(f, "batch_first", &batch_first, name, msg, msg_size))) return st;
    if ((st = meta_bool(f, "add_zero_attn", &add_zero_attn, name, msg, msg_size))) return st;
    float dropout = 0.0f;
    const char *dp = clmha__safetensors_meta(f, "dropout");
    if (dp) {
        // The range is checked on the decimal itself; the float the layer keeps may still
        // round up to 1, which is said as such.
        double v = 0.0;
        if (!parse_decimal(dp, &v) || !decimal_below_one(dp))
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: __metadata__ dropout is \"%.*s\", expected a decimal number in "
                              "[0, 1) such as \"0.1\"",
                              name, CLMHA__ST_QUOTE_MAX, dp);
        dropout = v < 1.0 ? (float)v : 1.0f;
        if (!(dropout < 1.0f))
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: __metadata__ dropout is \"%.*s\", which is below 1 but rounds "
                              "to 1 as a float (a layer keeps dropout as a float; the largest "
                              "below 1 is %.9g)",
                              name, CLMHA__ST_QUOTE_MAX, dp, (double)nextafterf(1.0f, 0.0f));
    }

    clmha_layer_desc d = {.struct_size = sizeof d,
                          .embed_dim = e,
                          .num_heads = heads,
                          .num_kv_heads = kv_heads,
                          .kdim = kdim,
                          .vdim = vdim,
                          .bias = ib != NULL,
                          .add_bias_kv = bk != NULL,
                          .add_zero_attn = add_zero_attn,
                          .batch_first = batch_first,
                          .dropout = dropout};
    clmha_layer_desc checked;
    char why[512];
    if ((st = clmha__desc_check(&d, &checked, why, sizeof why)))
        return clmha__msg(msg, msg_size, st == CLMHA_SIZE_OVERFLOW ? st : CLMHA_INVALID_FILE,
                          "%s: %s", name, why);
    *desc = checked;
    return CLMHA_SUCCESS;
}
