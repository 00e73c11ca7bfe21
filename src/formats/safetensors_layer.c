// The layer a parsed .safetensors file describes, without OpenCL: clmha__safetensors_select()
// picks a layer's tensors out of a file (a prefix, a seed module's names), and
// clmha__safetensors_desc_opts() maps the tensors to nn.MultiheadAttention's parameters (names
// and PyTorch shapes) and the metadata to the layer's descriptor; clmha__safetensors_to_double()
// gives a tensor's values as doubles (exactly, whatever its dtype).
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
    "out_proj.weight", "out_proj.bias", "bias_k", "bias_v", "alibi_slopes", "sinks",
    "mod_params"};

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
    } else if (exp10 < -300) {  // 10^-exp10 is past the double range: in two steps
        *out = v / 1e300 / pow(10.0, (double)(-exp10 - 300));
    } else {
        *out = v / pow(10.0, (double)-exp10);
    }
    return true;
}

bool clmha__st_decimal(const char *s, double *out) { return parse_decimal(s, out); }

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

// What clmha__safetensors_desc_opts() has read so far: the file, its name for messages, and
// the tensors and sizes found.
typedef struct {
    const clmha__st_file *f;
    const char *name;
    char *msg;
    size_t msg_size;
    const char *nkv;  // __metadata__ num_kv_heads, NULL when absent
    size_t e, three_e, kv_heads, heads, kdim, vdim;
    const clmha__st_tensor *ow, *ipw, *kw, *vw, *ib, *ob, *bk, *bv;
} desc_read;

// Every tensor's name is one of nn.MultiheadAttention's parameters.
static clmha_status check_names(const desc_read *r) {
    for (size_t i = 0; i < r->f->tensor_count; ++i) {
        bool known = false;
        for (size_t k = 0; k < sizeof known_names / sizeof *known_names && !known; ++k)
            known = strcmp(r->f->tensors[i].param, known_names[k]) == 0;
        if (!known)
            return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                              "%s: unknown tensor \"%.*s\" (a nn.MultiheadAttention file holds "
                              "in_proj_weight or q_proj_weight, k_proj_weight and v_proj_weight, "
                              "out_proj.weight, and optionally in_proj_bias with out_proj.bias, "
                              "bias_k with bias_v, alibi_slopes, sinks, mod_params)",
                              r->name, CLMHA__ST_QUOTE_MAX, r->f->tensors[i].name);
    }
    return CLMHA_SUCCESS;
}

// embed_dim (r->e, r->three_e) from out_proj.weight (E, E), and __metadata__ num_kv_heads.
static clmha_status read_embed_dim(desc_read *r) {
    char sbuf[256];
    const clmha__st_tensor *ow = clmha__safetensors_tensor(r->f, "out_proj.weight");
    r->ow = ow;
    if (!ow)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: the file has no tensor \"out_proj.weight\"", r->name);
    if (ow->ndim != 2 || ow->shape[0] == 0 || ow->shape[0] != ow->shape[1]) {
        size_t e0 = ow->ndim ? ow->shape[0] : 0;
        char want[128] = "";
        if (e0) snprintf(want, sizeof want, " = (%zu, %zu)", e0, e0);
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"out_proj.weight\" has shape %s, expected (E, E)%s with "
                          "E > 0",
                          r->name, clmha__st_shape_text(sbuf, sizeof sbuf, ow->ndim, ow->shape),
                          want);
    }
    r->e = ow->shape[0];
    if (!clmha__mul(r->e, 3, &r->three_e))
        return clmha__msg(r->msg, r->msg_size, CLMHA_SIZE_OVERFLOW,
                          "%s: embed_dim %zu is too large", r->name, r->e);

    // Grouped-query attention (__metadata__ num_kv_heads): the key/value shapes are checked
    // once num_heads is known, by check_kv_shapes().
    r->nkv = clmha__safetensors_meta(r->f, "num_kv_heads");
    r->kv_heads = 0;
    if (r->nkv && !parse_count(r->nkv, &r->kv_heads))
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ num_kv_heads is \"%.*s\", expected a positive "
                          "decimal integer such as \"2\"",
                          r->name, CLMHA__ST_QUOTE_MAX, r->nkv);
    return CLMHA_SUCCESS;
}

// The input projection, packed (in_proj_weight) or one weight per input; r->kdim, r->vdim.
static clmha_status read_in_proj(desc_read *r) {
    const char *name = r->name;
    size_t e = r->e;
    char sbuf[256];
    clmha_status st;
    r->ipw = clmha__safetensors_tensor(r->f, "in_proj_weight");
    const clmha__st_tensor *qw = clmha__safetensors_tensor(r->f, "q_proj_weight");
    const clmha__st_tensor *kw = r->kw = clmha__safetensors_tensor(r->f, "k_proj_weight");
    const clmha__st_tensor *vw = r->vw = clmha__safetensors_tensor(r->f, "v_proj_weight");
    r->kdim = r->vdim = e;
    if (r->ipw) {
        if (qw || kw || vw)
            return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                              "%s: the file holds both in_proj_weight and %s; it must hold "
                              "either in_proj_weight or q_proj_weight, k_proj_weight and "
                              "v_proj_weight",
                              name, qw ? "q_proj_weight" : kw ? "k_proj_weight" : "v_proj_weight");
        size_t want[2] = {r->three_e, e};
        return expect_shape(r->ipw, 2, want, "(3E, E)", name, r->msg, r->msg_size);
    }
    if (!qw || !kw || !vw)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: the file has neither in_proj_weight nor q_proj_weight, "
                          "k_proj_weight and v_proj_weight (no \"%s\")",
                          name, !qw ? "q_proj_weight" : !kw ? "k_proj_weight" : "v_proj_weight");
    size_t want[2] = {e, e};
    if ((st = expect_shape(qw, 2, want, "(E, E)", name, r->msg, r->msg_size))) return st;
    const clmha__st_tensor *kv[2] = {kw, vw};
    for (int i = 0; i < 2; ++i) {
        const clmha__st_tensor *t = kv[i];
        if (t->ndim != 2 || (t->shape[0] != e && !r->nkv) || t->shape[0] == 0 || t->shape[1] == 0)
            return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                              "%s: tensor \"%s\" has shape %s, expected (E, %s) = (%zu, %s) "
                              "with %s > 0",
                              name, t->name,
                              clmha__st_shape_text(sbuf, sizeof sbuf, t->ndim, t->shape),
                              i ? "vdim" : "kdim", e, i ? "vdim" : "kdim", i ? "vdim" : "kdim");
    }
    r->kdim = kw->shape[1];
    r->vdim = vw->shape[1];
    return CLMHA_SUCCESS;
}

// The biases, which come in pairs; their shapes without num_kv_heads (with it: check_kv_shapes).
static clmha_status read_biases(desc_read *r) {
    const char *name = r->name;
    clmha_status st;
    if ((st = expect_pair(r->f, "in_proj_bias", "out_proj.bias", "bias", &r->ib, &r->ob, name,
                          r->msg, r->msg_size)))
        return st;
    if (!r->nkv && (st = expect_shape(r->ib, 1, (size_t[]){r->three_e}, "(3E)", name, r->msg,
                                      r->msg_size)))
        return st;
    if ((st = expect_shape(r->ob, 1, (size_t[]){r->e}, "(E)", name, r->msg, r->msg_size)))
        return st;
    if ((st = expect_pair(r->f, "bias_k", "bias_v", "add_bias_kv", &r->bk, &r->bv, name, r->msg,
                          r->msg_size)))
        return st;
    size_t want_kv[3] = {1, 1, r->e};
    if (!r->nkv &&
        ((st = expect_shape(r->bk, 3, want_kv, "(1, 1, E)", name, r->msg, r->msg_size)) ||
         (st = expect_shape(r->bv, 3, want_kv, "(1, 1, E)", name, r->msg, r->msg_size))))
        return st;
    return CLMHA_SUCCESS;
}

// r->heads: __metadata__ num_heads, or @p num_heads (0: none given) when the file has none.
static clmha_status read_heads(desc_read *r, size_t num_heads) {
    const char *name = r->name;
    const char *nh = clmha__safetensors_meta(r->f, "num_heads");
    size_t heads = 0;
    if (!nh && !num_heads)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ has no num_heads (the number of attention heads, a "
                          "decimal string such as \"8\"): pass num_heads "
                          "(clmha_load_options::num_heads, --num-heads in the clmha program)",
                          name);
    if (nh && !parse_count(nh, &heads))
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ num_heads is \"%.*s\", expected a positive decimal "
                          "integer such as \"8\"",
                          name, CLMHA__ST_QUOTE_MAX, nh);
    if (nh && num_heads && heads != num_heads)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: num_heads %zu was asked for, but the file's __metadata__ says "
                          "num_heads %zu",
                          name, num_heads, heads);
    if (!nh) heads = num_heads;
    if (r->e % heads != 0)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: %s num_heads %zu does not divide embed_dim %zu (from "
                          "%s)",
                          name, nh ? "__metadata__" : "the given", heads, r->e, r->ow->name);
    r->heads = heads;
    return CLMHA_SUCCESS;
}

// The shapes of grouped-query attention (when the file has num_kv_heads), now that
// D = E / num_heads is known.
static clmha_status check_kv_shapes(const desc_read *r) {
    const char *name = r->name;
    size_t kv_heads = r->kv_heads, heads = r->heads;
    clmha_status st;
    if (!r->nkv) return CLMHA_SUCCESS;
    if (heads % kv_heads != 0)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ num_kv_heads %zu does not divide num_heads %zu",
                          name, kv_heads, heads);
    size_t kve = kv_heads * (r->e / heads);
    if (r->ipw && kve != r->e)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: the file holds in_proj_weight, but a layer with num_kv_heads "
                          "%zu below num_heads %zu has q_proj_weight, k_proj_weight and "
                          "v_proj_weight",
                          name, kv_heads, heads);
    const char *kv_shape = "(num_kv_heads*head_dim, kdim)";
    if (!r->ipw && ((st = expect_shape(r->kw, 2, (size_t[]){kve, r->kdim}, kv_shape, name,
                                       r->msg, r->msg_size)) ||
                    (st = expect_shape(r->vw, 2, (size_t[]){kve, r->vdim},
                                       "(num_kv_heads*head_dim, vdim)", name, r->msg,
                                       r->msg_size))))
        return st;
    if ((st = expect_shape(r->ib, 1, (size_t[]){r->e + 2 * kve}, "(E + 2*num_kv_heads*head_dim)",
                           name, r->msg, r->msg_size)) ||
        (st = expect_shape(r->bk, 3, (size_t[]){1, 1, kve}, "(1, 1, num_kv_heads*head_dim)", name,
                           r->msg, r->msg_size)) ||
        (st = expect_shape(r->bv, 3, (size_t[]){1, 1, kve}, "(1, 1, num_kv_heads*head_dim)", name,
                           r->msg, r->msg_size)))
        return st;
    return CLMHA_SUCCESS;
}

// __metadata__ dropout (absent: 0), a decimal in [0, 1) that stays below 1 as a float.
static clmha_status read_dropout(const desc_read *r, float *out) {
    const char *dp = clmha__safetensors_meta(r->f, "dropout");
    *out = 0.0f;
    if (!dp) return CLMHA_SUCCESS;
    // The range is checked on the decimal itself; the float the layer keeps may still round up
    // to 1, which is said as such.
    double v = 0.0;
    if (!parse_decimal(dp, &v) || !decimal_below_one(dp))
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ dropout is \"%.*s\", expected a decimal number in "
                          "[0, 1) such as \"0.1\"",
                          r->name, CLMHA__ST_QUOTE_MAX, dp);
    float dropout = v < 1.0 ? (float)v : 1.0f;
    if (!(dropout < 1.0f))
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ dropout is \"%.*s\", which is below 1 but rounds "
                          "to 1 as a float (a layer keeps dropout as a float; the largest "
                          "below 1 is %.9g)",
                          r->name, CLMHA__ST_QUOTE_MAX, dp, (double)nextafterf(1.0f, 0.0f));
    *out = dropout;
    return CLMHA_SUCCESS;
}

// One bound of __metadata__ window: "-1" (unbounded) or a decimal integer from 0 to
// INT64_MAX, digits only; @p len characters of @p s.
static bool parse_bound(const char *s, size_t len, int64_t *out) {
    if (len == 2 && s[0] == '-' && s[1] == '1') {
        *out = -1;
        return true;
    }
    size_t v = 0;
    if (clmha__st_digits(s, len, &v) != 0 || (uint64_t)v > (uint64_t)INT64_MAX) return false;
    *out = (int64_t)v;
    return true;
}

// __metadata__ window "LEFT,RIGHT" (absent: no window): the sliding window's bounds
// (clmha_layer_desc::window_left, window_right), each "-1" or an integer >= 0.
static clmha_status read_window(const desc_read *r, bool *window, int64_t *left,
                                int64_t *right) {
    const char *w = clmha__safetensors_meta(r->f, "window");
    *window = false;
    *left = *right = 0;
    if (!w) return CLMHA_SUCCESS;
    const char *comma = strchr(w, ',');
    if (!comma || !parse_bound(w, (size_t)(comma - w), left) ||
        !parse_bound(comma + 1, strlen(comma + 1), right))
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ window is \"%.*s\", expected \"LEFT,RIGHT\": two "
                          "integers, each -1 (unbounded) or from 0 to 2^63-1, such as \"1023,0\"",
                          r->name, CLMHA__ST_QUOTE_MAX, w);
    *window = true;
    return CLMHA_SUCCESS;
}

// __metadata__ softcap (absent: 0, off): a decimal number, 0 or positive and finite (a positive
// decimal that underflows to 0 is refused rather than taken as off).
static clmha_status read_softcap(const desc_read *r, double *out) {
    const char *c = clmha__safetensors_meta(r->f, "softcap");
    *out = 0.0;
    if (!c) return CLMHA_SUCCESS;
    double v = 0.0;
    bool nonzero = false;  // a digit other than 0 before the exponent
    for (const char *p = c; *p && *p != 'e' && *p != 'E'; ++p) nonzero |= *p >= '1' && *p <= '9';
    if (!parse_decimal(c, &v) || isinf(v) || (nonzero && v == 0.0))
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ softcap is \"%.*s\", expected a decimal number, 0 "
                          "(off) or positive and finite, such as \"50.0\"",
                          r->name, CLMHA__ST_QUOTE_MAX, c);
    *out = v;
    return CLMHA_SUCCESS;
}

// __metadata__ alibi ("true"/"false", absent: false) and the tensor alibi_slopes, (num_heads),
// which only an ALiBi layer has (absent: the layer keeps its geometric slopes).
static clmha_status read_alibi(const desc_read *r, bool *alibi) {
    clmha_status st = meta_bool(r->f, "alibi", alibi, r->name, r->msg, r->msg_size);
    if (st) return st;
    const clmha__st_tensor *t = clmha__safetensors_tensor(r->f, "alibi_slopes");
    if (t && !*alibi)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: the file has tensor \"%.*s\" but __metadata__ alibi is not "
                          "\"true\" (only an ALiBi layer has slopes)",
                          r->name, CLMHA__ST_QUOTE_MAX, t->name);
    return expect_shape(t, 1, (size_t[]){r->heads}, "(num_heads)", r->name, r->msg,
                        r->msg_size);
}

// The tensor sinks, (num_heads): its presence makes a layer with attention sinks
// (clmha_layer_desc::sinks); there is no metadata key.
static clmha_status read_sinks(const desc_read *r, bool *sinks) {
    const clmha__st_tensor *t = clmha__safetensors_tensor(r->f, "sinks");
    *sinks = t != NULL;
    return expect_shape(t, 1, (size_t[]){r->heads}, "(num_heads)", r->name, r->msg,
                        r->msg_size);
}

// __metadata__ mod_source (the user functions' OpenCL C, clmha_layer_desc::mod_source; absent:
// none) and the tensor mod_params, p (count), which only a layer with a source has (absent: no
// p). The layer's loader writes p after creating it.
static clmha_status read_mods(const desc_read *r, const char **source, size_t *count) {
    *source = clmha__safetensors_meta(r->f, "mod_source");
    const clmha__st_tensor *t = clmha__safetensors_tensor(r->f, "mod_params");
    *count = t ? t->count : 0;
    if (t && !*source)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: the file has tensor \"%.*s\" but no __metadata__ mod_source (p is "
                          "the user functions' parameters)",
                          r->name, CLMHA__ST_QUOTE_MAX, t->name);
    if (t && t->ndim != 1)
        return clmha__msg(r->msg, r->msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" has %zu dimensions, expected 1 (count)", r->name,
                          CLMHA__ST_QUOTE_MAX, t->name, t->ndim);
    return CLMHA_SUCCESS;
}

clmha_status clmha__safetensors_desc_opts(const clmha__st_file *f, const char *name,
                                          size_t num_heads, clmha_batch_first batch_first_opt,
                                          bool default_batch_first, clmha_layer_desc *desc,
                                          char *msg, size_t msg_size) {
    if (!f || !desc) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "NULL argument");
    if (!name) name = "(unnamed)";
    memset(desc, 0, sizeof *desc);
    clmha_status st;
    desc_read r = {.f = f, .name = name, .msg = msg, .msg_size = msg_size};
    if ((st = check_names(&r)) || (st = read_embed_dim(&r)) || (st = read_in_proj(&r)) ||
        (st = read_biases(&r)) || (st = read_heads(&r, num_heads)) || (st = check_kv_shapes(&r)))
        return st;
    bool batch_first, add_zero_attn;
    if ((st = meta_bool(f, "batch_first", &batch_first, name, msg, msg_size))) return st;
    if (batch_first_opt == CLMHA_BATCH_FIRST_AUTO && !clmha__safetensors_meta(f, "batch_first"))
        batch_first = default_batch_first;
    else if (batch_first_opt != CLMHA_BATCH_FIRST_AUTO)
        batch_first = batch_first_opt == CLMHA_BATCH_FIRST_YES;
    if ((st = meta_bool(f, "add_zero_attn", &add_zero_attn, name, msg, msg_size))) return st;
    float dropout;
    if ((st = read_dropout(&r, &dropout))) return st;
    bool window;
    int64_t win_left, win_right;
    if ((st = read_window(&r, &window, &win_left, &win_right))) return st;
    double softcap;
    bool alibi, sinks;
    if ((st = read_softcap(&r, &softcap)) || (st = read_alibi(&r, &alibi)) ||
        (st = read_sinks(&r, &sinks)))
        return st;
    const char *mod_source;
    size_t mod_count;
    if ((st = read_mods(&r, &mod_source, &mod_count))) return st;

    clmha_layer_desc d = {.struct_size = sizeof d,
                          .embed_dim = r.e,
                          .num_heads = r.heads,
                          .num_kv_heads = r.kv_heads,
                          .kdim = r.kdim,
                          .vdim = r.vdim,
                          .bias = r.ib != NULL,
                          .add_bias_kv = r.bk != NULL,
                          .add_zero_attn = add_zero_attn,
                          .batch_first = batch_first,
                          .dropout = dropout,
                          .window = window,
                          .window_left = win_left,
                          .window_right = win_right,
                          .softcap = softcap,
                          .alibi = alibi,
                          .sinks = sinks,
                          .mod_source = mod_source,
                          .mod_params_count = mod_count};
    clmha_layer_desc checked;
    char why[512];
    if ((st = clmha__desc_check(&d, &checked, why, sizeof why)))
        return clmha__msg(msg, msg_size, st == CLMHA_SIZE_OVERFLOW ? st : CLMHA_INVALID_FILE,
                          "%s: %s", name, why);
    *desc = checked;
    return CLMHA_SUCCESS;
}

// ---- name sets and prefixes ---------------------------------------------------------------

// The seed modules' name sets: the four projections' module names, in the order q, k, v, out.
static const struct {
    const char *set;
    const char *module[4];
} seed_sets[] = {
    {"continuiti", {"query_project", "key_project", "value_project", "out_project"}},
    {"w_q/w_k/w_v/w_concat", {"w_q", "w_k", "w_v", "w_concat"}},
};
#define SEED_SETS (sizeof seed_sets / sizeof *seed_sets)
#define TORCH_SET SEED_SETS  // the set index of nn.MultiheadAttention's names

// What @p param (a name with the prefix stripped) is: its set (TORCH_SET for PyTorch's names),
// the projection (0 q, 1 k, 2 v, 3 out; -1 for PyTorch's names) and whether it is a bias.
// False for a name of no set.
static bool classify(const char *param, size_t *set, int *proj, bool *bias) {
    for (size_t k = 0; k < sizeof known_names / sizeof *known_names; ++k)
        if (strcmp(param, known_names[k]) == 0) {
            *set = TORCH_SET, *proj = -1, *bias = false;
            return true;
        }
    for (size_t s = 0; s < SEED_SETS; ++s)
        for (int p = 0; p < 4; ++p) {
            size_t n = strlen(seed_sets[s].module[p]);
            if (strncmp(param, seed_sets[s].module[p], n) != 0) continue;
            const char *rest = param + n;
            if (strcmp(rest, ".weight") == 0 || strcmp(rest, ".bias") == 0) {
                *set = s, *proj = p, *bias = rest[1] == 'b';
                return true;
            }
        }
    return false;
}

// The name @p full with the prefix (@p plen bytes of @p prefix, plus a '.' when @p dot) stripped,
// or NULL when it is not under the prefix.
static const char *strip_prefix(const char *full, const char *prefix, size_t plen, bool dot) {
    if (strncmp(full, prefix, plen) != 0) return NULL;
    if (!dot) return full + plen;
    return full[plen] == '.' ? full + plen + 1 : NULL;
}

// Appends to @p buf a list of the prefixes of the file's attention modules: the names of the
// tensors ending in in_proj_weight, q_proj_weight, query_project.weight or w_q.weight, without
// that ending.
static void list_prefixes(const clmha__st_file *f, char *buf, size_t size) {
    static const char *const ends[] = {"in_proj_weight", "q_proj_weight",
                                       "query_project.weight", "w_q.weight"};
    size_t used = strlen(buf), found = 0, shown = 0;
    const char *listed[5];
    size_t listed_len[5];
    for (size_t i = 0; i < f->tensor_count; ++i) {
        const char *n = f->tensors[i].name;
        size_t len = strlen(n);
        for (size_t k = 0; k < sizeof ends / sizeof *ends; ++k) {
            size_t el = strlen(ends[k]);
            if (len < el || strcmp(n + len - el, ends[k]) != 0) continue;
            if (len > el && n[len - el - 1] != '.') continue;  // "xin_proj_weight"
            bool seen = false;
            for (size_t j = 0; j < shown && !seen; ++j)
                seen = listed_len[j] == len - el && strncmp(listed[j], n, len - el) == 0;
            if (seen) break;
            ++found;
            if (shown < 5) {
                listed[shown] = n, listed_len[shown] = len - el;
                int w = snprintf(buf + used, used < size ? size - used : 0, "%s\"%.*s\"",
                                 shown ? ", " : "", (int)(len - el < CLMHA__ST_QUOTE_MAX
                                                              ? len - el
                                                              : CLMHA__ST_QUOTE_MAX),
                                 n);
                if (w > 0) used += (size_t)w;
                ++shown;
            }
            break;
        }
    }
    if (used >= size) return;
    if (!found)
        snprintf(buf + used, size - used,
                 "none: no tensor's name ends in in_proj_weight, q_proj_weight, "
                 "query_project.weight or w_q.weight");
    else if (found > shown)
        snprintf(buf + used, size - used, " and %zu more", found - shown);
    else if (listed_len[0] == 0 && found == 1)
        snprintf(buf + used, size - used, " (the empty prefix: load the file without one)");
}

// What clmha__safetensors_select() finds under the prefix: the first tensor of each name set,
// a seed module's tensors by projection and kind, and the set of the last tensor.
typedef struct {
    const clmha__st_tensor *first[SEED_SETS + 1];
    const clmha__st_tensor *seed[4][2];  // [projection][bias]
    const clmha__st_tensor *alibi;       // alibi_slopes, of every name set
    const clmha__st_tensor *sinks;       // sinks, likewise
    const clmha__st_tensor *mod_params;  // mod_params, likewise
    size_t matched, sets, set;
} select_found;

// The error for tensor @p t (named @p param without the prefix) of no name set.
static clmha_status unknown_tensor(const clmha__st_file *f, const char *name, const char *prefix,
                                   const clmha__st_tensor *t, const char *param, char *msg,
                                   size_t msg_size) {
    if (!prefix || !*prefix)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: unknown tensor \"%.*s\" (a layer file holds the parameters of "
                          "nn.MultiheadAttention: in_proj_weight or q_proj_weight, k_proj_weight "
                          "and v_proj_weight, out_proj.weight, and optionally in_proj_bias with "
                          "out_proj.bias, bias_k with bias_v; or of continuiti's "
                          "MultiHeadAttention: query_project, key_project, value_project, "
                          "out_project .weight (and .bias); or w_q, w_k, w_v, w_concat .weight "
                          "(and .bias). A whole model's file needs a prefix)",
                          name, CLMHA__ST_QUOTE_MAX, t->name);
    char modules[512] = "";
    list_prefixes(f, modules, sizeof modules);
    return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                      "%s: tensor \"%.*s\" under the prefix \"%.*s\" is not a parameter of an "
                      "attention module (as \"%.*s\"); the file's attention modules have the "
                      "prefixes %s",
                      name, CLMHA__ST_QUOTE_MAX, t->name, CLMHA__ST_QUOTE_MAX, prefix,
                      CLMHA__ST_QUOTE_MAX, param, modules);
}

// Classifies the tensors under the prefix (@p plen bytes of @p prefix, @p dot: see
// strip_prefix()) into @p out; fails on a tensor of no set, no tensor under the prefix, or
// tensors of two sets.
static clmha_status find_set(const clmha__st_file *f, const char *name, const char *prefix,
                             size_t plen, bool dot, select_found *out, char *msg,
                             size_t msg_size) {
    *out = (select_found){.set = TORCH_SET};
    for (size_t i = 0; i < f->tensor_count; ++i) {
        const clmha__st_tensor *t = &f->tensors[i];
        const char *param = plen ? strip_prefix(t->name, prefix, plen, dot) : t->name;
        if (!param) continue;
        ++out->matched;
        if (strcmp(param, "alibi_slopes") == 0) {  // clmha's own: no name set's
            out->alibi = t;
            continue;
        }
        if (strcmp(param, "sinks") == 0) {  // likewise
            out->sinks = t;
            continue;
        }
        if (strcmp(param, "mod_params") == 0) {  // likewise
            out->mod_params = t;
            continue;
        }
        size_t s;
        int proj;
        bool bias;
        if (!classify(param, &s, &proj, &bias))
            return unknown_tensor(f, name, plen ? prefix : NULL, t, param, msg, msg_size);
        if (!out->first[s]) out->first[s] = t, ++out->sets;
        out->set = s;
        if (s != TORCH_SET) out->seed[proj][bias] = t;
    }
    if (plen && !out->matched) {
        char modules[512] = "";
        list_prefixes(f, modules, sizeof modules);
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: no tensor's name starts with the prefix \"%.*s%s\"; the file's "
                          "attention modules have the prefixes %s",
                          name, CLMHA__ST_QUOTE_MAX, prefix, dot ? "." : "", modules);
    }
    if (out->sets > 1) {
        char list[512] = "";
        size_t used = 0;
        for (size_t s = 0; s <= SEED_SETS; ++s) {
            if (!out->first[s] || used >= sizeof list) continue;
            int w = snprintf(list + used, sizeof list - used, "%s\"%.*s\" (%s)",
                             used ? " and " : "", CLMHA__ST_QUOTE_MAX, out->first[s]->name,
                             s == TORCH_SET ? "nn.MultiheadAttention" : seed_sets[s].set);
            if (w > 0) used += (size_t)w;
        }
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the file mixes the parameter names of two modules: %s; a layer "
                          "is one module's parameters",
                          name, list);
    }
    return CLMHA_SUCCESS;
}

// A seed module's biases: all four or none (*count: 4 or 0), each as wide as its weight has
// rows.
static clmha_status check_seed_biases(const select_found *found, const char *name,
                                      size_t *count, char *msg, size_t msg_size) {
    const clmha__st_tensor *const(*seed)[2] = found->seed;
    const char *const *mod = seed_sets[found->set].module;
    size_t biases = 0;
    for (int p = 0; p < 4; ++p) biases += seed[p][1] != NULL;
    *count = biases;
    if (biases && biases < 4) {
        int have = 0, lack = 0;
        while (!seed[have][1]) ++have;
        while (seed[lack][1]) ++lack;
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the file has \"%.*s\" but no %s.bias; a %s module has the biases "
                          "of all four projections (bias = True) or none",
                          name, CLMHA__ST_QUOTE_MAX, seed[have][1]->name, mod[lack],
                          seed_sets[found->set].set);
    }
    return CLMHA_SUCCESS;
}

// The seed module's biases (checked by check_seed_biases()) into @p view from tensor @p n on:
// in_proj_bias (q, k, v concatenated) and out_proj.bias. Returns the new tensor count.
static size_t view_seed_biases(clmha__st_view *view, const clmha__st_tensor *const (*seed)[2],
                               size_t n) {
    clmha__st_tensor *ib = &view->tensors[n];
    *ib = *seed[0][1];
    snprintf(view->joined[0], sizeof view->joined[0], "%.80s + %.80s + %.80s", seed[0][1]->name,
             seed[1][1]->name, seed[2][1]->name);
    ib->name = view->joined[0];
    ib->param = "in_proj_bias";
    ib->shape[0] = seed[0][1]->shape[0] + seed[1][1]->shape[0] + seed[2][1]->shape[0];
    ib->count = ib->shape[0];
    ib->data = NULL;  // in the parts
    for (int p = 0; p < 3; ++p) view->parts[n][p] = seed[p][1];
    ++n;
    view->tensors[n] = *seed[3][1];
    view->tensors[n].param = "out_proj.bias";
    view->parts[n][0] = seed[3][1];
    return n + 1;
}

// A seed module's tensors into @p view: its weights as q/k/v_proj_weight and out_proj.weight,
// its biases (all four or none) as in_proj_bias (q, k, v concatenated) and out_proj.bias.
static clmha_status view_seed(clmha__st_view *view, const select_found *found, const char *name,
                              char *msg, size_t msg_size) {
    static const char *const weight_param[4] = {"q_proj_weight", "k_proj_weight",
                                                "v_proj_weight", "out_proj.weight"};
    const clmha__st_tensor *const(*seed)[2] = found->seed;
    size_t set = found->set, n = 0, biases;
    const char *const *mod = seed_sets[set].module;
    clmha_status st = check_seed_biases(found, name, &biases, msg, msg_size);
    if (st) return st;
    for (int p = 0; p < 4; ++p) {
        const clmha__st_tensor *w = seed[p][0];
        if (!w)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the file has no %s.weight (a %s module has %s, %s, %s and "
                              "%s, each with .weight)",
                              name, mod[p], seed_sets[set].set, mod[0], mod[1], mod[2], mod[3]);
        view->tensors[n] = *w;
        view->tensors[n].param = weight_param[p];
        view->parts[n][0] = w;
        ++n;
    }
    if (biases) {
        for (int p = 0; p < 4; ++p) {
            const clmha__st_tensor *b = seed[p][1];
            const clmha__st_tensor *w = seed[p][0];
            if (b->ndim != 1 || w->ndim < 1 || b->shape[0] != w->shape[0]) {
                char got[256];
                return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                                  "%s: tensor \"%.*s\" has shape %s, expected (%zu,): as many "
                                  "values as \"%.*s\" has rows",
                                  name, CLMHA__ST_QUOTE_MAX, b->name,
                                  clmha__st_shape_text(got, sizeof got, b->ndim, b->shape),
                                  w->ndim ? w->shape[0] : 0, CLMHA__ST_QUOTE_MAX, w->name);
            }
        }
        n = view_seed_biases(view, seed, n);
    }
    view->file.tensor_count = n;
    return CLMHA_SUCCESS;
}

clmha_status clmha__safetensors_select(const clmha__st_file *f, const char *name,
                                       const char *prefix, clmha__st_view *view, char *msg,
                                       size_t msg_size) {
    if (!f || !view) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "NULL argument");
    if (!name) name = "(unnamed)";
    memset(view, 0, sizeof *view);
    size_t plen = prefix ? strlen(prefix) : 0;
    bool dot = plen && prefix[plen - 1] != '.';
    select_found found;
    clmha_status st = find_set(f, name, prefix, plen, dot, &found, msg, msg_size);
    if (st) return st;

    size_t set = found.set;
    view->file.meta = f->meta;
    view->file.meta_count = f->meta_count;
    view->file.tensors = view->tensors;
    view->name_set = set == TORCH_SET ? "nn.MultiheadAttention" : seed_sets[set].set;
    view->batch_first_set = set != TORCH_SET;
    if (set != TORCH_SET) {
        if ((st = view_seed(view, &found, name, msg, msg_size))) return st;
        const clmha__st_tensor *own[3] = {found.alibi, found.sinks, found.mod_params};
        static const char *const own_param[3] = {"alibi_slopes", "sinks", "mod_params"};
        for (int k = 0; k < 3; ++k) {
            if (!own[k]) continue;
            size_t n = view->file.tensor_count++;  // at most 7 before it
            view->tensors[n] = *own[k];
            view->tensors[n].param = own_param[k];
            view->parts[n][0] = own[k];
        }
        return CLMHA_SUCCESS;
    }
    size_t n = 0;  // the tensors as they are, known names only: at most 12
    for (size_t i = 0; i < f->tensor_count; ++i) {
        const clmha__st_tensor *t = &f->tensors[i];
        const char *param = plen ? strip_prefix(t->name, prefix, plen, dot) : t->name;
        if (!param) continue;
        view->tensors[n] = *t;
        view->tensors[n].param = param;
        view->parts[n][0] = t;
        ++n;
    }
    view->file.tensor_count = n;
    return CLMHA_SUCCESS;
}

void clmha__st_view_to_double(const clmha__st_view *view, size_t i, double *out) {
    for (size_t p = 0; p < 4 && view->parts[i][p]; ++p) {
        clmha__safetensors_to_double(view->parts[i][p], out);
        out += view->parts[i][p]->count;
    }
}

clmha_status clmha__safetensors_layer(const clmha__st_file *f, const char *name,
                                      const clmha__st_load *load, clmha__st_view *view,
                                      clmha_layer_desc *desc, char *msg, size_t msg_size) {
    clmha__st_load none = {.prefix = NULL};
    if (!load) load = &none;
    if (!name) name = "(unnamed)";
    clmha_status st = clmha__safetensors_select(f, name, load->prefix, view, msg, msg_size);
    if (st) return st;
    return clmha__safetensors_desc_opts(&view->file, name, load->num_heads, load->batch_first,
                                        view->batch_first_set, desc, msg, msg_size);
}
