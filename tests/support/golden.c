// Loader for the golden test cases; see golden.h.
#include "golden.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Largest tensor the loader accepts (elements); golden files are tiny.
#define GOLDEN_MAX_COUNT ((size_t)1 << 24)
#define GOLDEN_MAX_FILE ((long)64 << 20)

typedef struct lexer {
    char *p;     // next unread character
    int line;    // line of p
    int tline;   // line of the last token
} lexer;

typedef struct loader {
    const char *path;
    golden_case *gc;
    lexer lx;
} loader;

static void fail(loader *ld, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (ld->lx.tline > 0)
        snprintf(ld->gc->error, sizeof ld->gc->error, "%s:%d: %s", ld->path, ld->lx.tline, msg);
    else
        snprintf(ld->gc->error, sizeof ld->gc->error, "%s: %s", ld->path, msg);
}

static bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// Next whitespace-separated token, NUL-terminated in place; NULL at the end of the input.
static char *next_token(lexer *lx) {
    for (;;) {
        while (*lx->p && is_space(*lx->p)) {
            if (*lx->p == '\n') lx->line++;
            lx->p++;
        }
        if (*lx->p == '#') {
            while (*lx->p && *lx->p != '\n') lx->p++;
            continue;
        }
        break;
    }
    if (!*lx->p) {
        lx->tline = lx->line;
        return NULL;
    }
    char *tok = lx->p;
    lx->tline = lx->line;
    while (*lx->p && !is_space(*lx->p) && *lx->p != '#') lx->p++;
    if (*lx->p == '#') {
        // A comment glued to a token: the NUL replaces the '#', and the rest of the comment
        // is skipped now (the newline that ends it is left for the next call).
        *lx->p++ = '\0';
        while (*lx->p && *lx->p != '\n') lx->p++;
        return tok;
    }
    if (*lx->p) {
        if (*lx->p == '\n') lx->line++;
        *lx->p++ = '\0';
    }
    return tok;
}

// Whether the next token is @p word; reads ahead without consuming or modifying anything.
static bool next_is(const lexer *lx, const char *word) {
    const char *p = lx->p;
    for (;;) {
        while (*p && is_space(*p)) p++;
        if (*p == '#') {
            while (*p && *p != '\n') p++;
            continue;
        }
        break;
    }
    size_t n = strlen(word);
    return strncmp(p, word, n) == 0 && (p[n] == '\0' || is_space(p[n]) || p[n] == '#');
}

static bool expect_token(loader *ld, const char *what, char **out) {
    char *t = next_token(&ld->lx);
    if (!t) {
        fail(ld, "unexpected end of file, expected %s", what);
        return false;
    }
    *out = t;
    return true;
}

static bool expect_word(loader *ld, const char *word) {
    char *t;
    if (!expect_token(ld, word, &t)) return false;
    if (strcmp(t, word) != 0) {
        fail(ld, "expected '%s', found '%.40s'", word, t);
        return false;
    }
    return true;
}

static bool parse_size(loader *ld, const char *what, const char *t, size_t *out) {
    if (*t < '0' || *t > '9') {
        fail(ld, "%s: '%.40s' is not a non-negative integer", what, t);
        return false;
    }
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(t, &end, 10);
    if (errno || *end || v > (unsigned long long)SIZE_MAX) {
        fail(ld, "%s: '%.40s' is not a valid size", what, t);
        return false;
    }
    *out = (size_t)v;
    return true;
}

static bool key_size(loader *ld, const char *key, size_t *out) {
    char *t;
    if (!expect_word(ld, key) || !expect_token(ld, key, &t)) return false;
    return parse_size(ld, key, t, out);
}

static bool key_bool(loader *ld, const char *key, bool *out) {
    char *t;
    if (!expect_word(ld, key) || !expect_token(ld, key, &t)) return false;
    if (strcmp(t, "0") != 0 && strcmp(t, "1") != 0) {
        fail(ld, "%s: expected 0 or 1, found '%.40s'", key, t);
        return false;
    }
    *out = t[0] == '1';
    return true;
}

static bool key_double(loader *ld, const char *key, double *out) {
    char *t;
    if (!expect_word(ld, key) || !expect_token(ld, key, &t)) return false;
    char *end = NULL;
    double v = strtod(t, &end);
    if (end == t || *end) {
        fail(ld, "%s: '%.40s' is not a number", key, t);
        return false;
    }
    *out = v;
    return true;
}

// Optional: window <left> <right>, each -1 or an integer >= 0 below 2^63.
static bool parse_window(loader *ld) {
    golden_case *gc = ld->gc;
    if (!next_is(&ld->lx, "window")) return true;
    if (!expect_word(ld, "window")) return false;
    int64_t *bound[2] = {&gc->window_left, &gc->window_right};
    for (int i = 0; i < 2; i++) {
        char *t;
        if (!expect_token(ld, "window", &t)) return false;
        size_t v = 0;
        if (strcmp(t, "-1") == 0) {
            *bound[i] = -1;
            continue;
        }
        if (!parse_size(ld, "window", t, &v)) return false;
        if ((uint64_t)v > (uint64_t)INT64_MAX) {
            fail(ld, "window: %.40s is above 2^63 - 1", t);
            return false;
        }
        *bound[i] = (int64_t)v;
    }
    gc->window = true;
    return true;
}

// Optional, after the window: softcap <c> (finite, > 0), then alibi, then sinks.
static bool parse_variants(loader *ld) {
    golden_case *gc = ld->gc;
    if (next_is(&ld->lx, "softcap")) {
        if (!key_double(ld, "softcap", &gc->softcap)) return false;
        if (!(isfinite(gc->softcap) && gc->softcap > 0.0)) {
            fail(ld, "softcap %g is not a finite number > 0", gc->softcap);
            return false;
        }
    }
    if (next_is(&ld->lx, "alibi")) {
        if (!expect_word(ld, "alibi")) return false;
        gc->alibi = true;
    }
    if (next_is(&ld->lx, "sinks")) {
        if (!expect_word(ld, "sinks")) return false;
        gc->sinks = true;
    }
    return true;
}

static bool key_kind(loader *ld, const char *key, golden_mask_kind *out) {
    char *t;
    if (!expect_word(ld, key) || !expect_token(ld, key, &t)) return false;
    for (int k = GOLDEN_MASK_NONE; k <= GOLDEN_MASK_FLOAT; k++) {
        if (strcmp(t, golden_mask_kind_name((golden_mask_kind)k)) == 0) {
            *out = (golden_mask_kind)k;
            return true;
        }
    }
    fail(ld, "%s: unknown mask kind '%.40s'", key, t);
    return false;
}

const char *golden_mask_kind_name(golden_mask_kind kind) {
    switch (kind) {
    case GOLDEN_MASK_NONE: return "none";
    case GOLDEN_MASK_BOOL_IGNORE: return "bool_ignore";
    case GOLDEN_MASK_BOOL_ATTEND: return "bool_attend";
    case GOLDEN_MASK_FLOAT: return "float";
    }
    return "?";
}

const char *golden_layer_dtype_name(int dtype) {
    switch (dtype) {
    case GOLDEN_LAYER_F32: return "f32";
    case GOLDEN_LAYER_F16: return "f16";
    case GOLDEN_LAYER_BF16: return "bf16";
    case GOLDEN_LAYER_F64: return "f64";
    }
    return "?";
}

const golden_tensor *golden_find(const golden_case *gc, const char *name) {
    if (!gc || !name) return NULL;
    for (size_t i = 0; i < gc->num_tensors; i++)
        if (strcmp(gc->tensors[i].name, name) == 0) return &gc->tensors[i];
    return NULL;
}

void golden_free(golden_case *gc) {
    if (!gc) return;
    for (size_t i = 0; i < gc->num_tensors && gc->tensors; i++) {
        free(gc->tensors[i].f32);
        free(gc->tensors[i].u8);
        free(gc->tensors[i].f64);
    }
    free(gc->tensors);
    char err[sizeof gc->error];
    memcpy(err, gc->error, sizeof err);
    memset(gc, 0, sizeof *gc);
    memcpy(gc->error, err, sizeof err);  // keep the message of a failed load readable
}

static bool parse_tensor(loader *ld) {
    golden_case *gc = ld->gc;
    char *t;
    if (!expect_token(ld, "tensor name", &t)) return false;
    if (strlen(t) >= GOLDEN_MAX_NAME) {
        fail(ld, "tensor name '%.40s...' too long", t);
        return false;
    }
    if (golden_find(gc, t)) {
        fail(ld, "duplicate tensor '%s'", t);
        return false;
    }
    golden_tensor tn;
    memset(&tn, 0, sizeof tn);
    strcpy(tn.name, t);
    if (!expect_token(ld, "tensor dtype", &t)) return false;
    if (strcmp(t, "f32") == 0)
        tn.dtype = GOLDEN_F32;
    else if (strcmp(t, "u8") == 0)
        tn.dtype = GOLDEN_U8;
    else if (strcmp(t, "f64") == 0)
        tn.dtype = GOLDEN_F64;
    else {
        fail(ld, "tensor %s: unknown dtype '%.40s'", tn.name, t);
        return false;
    }
    if (!expect_token(ld, "tensor ndim", &t) || !parse_size(ld, "ndim", t, &tn.ndim))
        return false;
    if (tn.ndim < 1 || tn.ndim > GOLDEN_MAX_DIMS) {
        fail(ld, "tensor %s: ndim %zu not in 1..%d", tn.name, tn.ndim, GOLDEN_MAX_DIMS);
        return false;
    }
    tn.count = 1;
    for (size_t d = 0; d < tn.ndim; d++) {
        if (!expect_token(ld, "tensor dimension", &t) ||
            !parse_size(ld, "dimension", t, &tn.shape[d]))
            return false;
        if (tn.shape[d] == 0 || tn.shape[d] > GOLDEN_MAX_COUNT ||
            tn.count > GOLDEN_MAX_COUNT / tn.shape[d]) {
            fail(ld, "tensor %s: dimension %zu is 0 or the tensor is too large", tn.name, d);
            return false;
        }
        tn.count *= tn.shape[d];
    }
    // Grow the table first so that the data, once allocated, always has an owner.
    golden_tensor *grown = realloc(gc->tensors, (gc->num_tensors + 1) * sizeof *grown);
    if (!grown) {
        fail(ld, "out of memory");
        return false;
    }
    gc->tensors = grown;
    golden_tensor *dst = &gc->tensors[gc->num_tensors++];
    *dst = tn;
    switch (tn.dtype) {
    case GOLDEN_F32: dst->f32 = malloc(tn.count * sizeof(float)); break;
    case GOLDEN_U8: dst->u8 = malloc(tn.count); break;
    case GOLDEN_F64: dst->f64 = malloc(tn.count * sizeof(double)); break;
    }
    if (!dst->f32 && !dst->u8 && !dst->f64) {
        fail(ld, "out of memory");
        return false;
    }
    for (size_t i = 0; i < tn.count; i++) {
        t = next_token(&ld->lx);
        if (!t) {
            fail(ld, "tensor %s: file ends after %zu of %zu values", tn.name, i, tn.count);
            return false;
        }
        char *end = NULL;
        switch (tn.dtype) {
        case GOLDEN_F32: dst->f32[i] = strtof(t, &end); break;
        case GOLDEN_F64: dst->f64[i] = strtod(t, &end); break;
        case GOLDEN_U8:
            if (strcmp(t, "0") == 0 || strcmp(t, "1") == 0) {
                dst->u8[i] = (uint8_t)(t[0] - '0');
                end = t + 1;
            } else {
                end = t;
            }
            break;
        }
        if (end == t || *end) {
            fail(ld, "tensor %s: value %zu of %zu, '%.40s', is not a valid %s", tn.name, i,
                 tn.count, t, tn.dtype == GOLDEN_U8 ? "0/1" : "number");
            return false;
        }
    }
    return true;
}

static bool check_mask(loader *ld, const char *name, golden_mask_kind kind) {
    const golden_tensor *t = golden_find(ld->gc, name);
    if (kind == GOLDEN_MASK_NONE) {
        if (t) {
            fail(ld, "tensor %s present but its kind is none", name);
            return false;
        }
        return true;
    }
    if (!t) {
        fail(ld, "mask kind %s given but tensor %s is missing", golden_mask_kind_name(kind),
             name);
        return false;
    }
    // A float mask holds the layer's element type: doubles in a float64 case.
    golden_dtype want = GOLDEN_U8;
    if (kind == GOLDEN_MASK_FLOAT)
        want = ld->gc->dtype == GOLDEN_LAYER_F64 ? GOLDEN_F64 : GOLDEN_F32;
    if (t->dtype != want) {
        fail(ld, "tensor %s must be %s for kind %s", name,
             want == GOLDEN_U8 ? "u8" : want == GOLDEN_F64 ? "f64" : "f32",
             golden_mask_kind_name(kind));
        return false;
    }
    return true;
}

// The layer and call lines of a layer case.
static bool parse_layer_call(loader *ld) {
    golden_case *gc = ld->gc;
    char *t;
    if (!expect_word(ld, "layer") || !key_size(ld, "embed_dim", &gc->embed_dim) ||
        !key_size(ld, "num_heads", &gc->num_heads) || !key_size(ld, "kdim", &gc->kdim) ||
        !key_size(ld, "vdim", &gc->vdim) || !key_bool(ld, "bias", &gc->bias) ||
        !key_bool(ld, "add_bias_kv", &gc->add_bias_kv) ||
        !key_bool(ld, "add_zero_attn", &gc->add_zero_attn) ||
        !key_bool(ld, "batch_first", &gc->batch_first) ||
        !key_double(ld, "dropout", &gc->dropout))
        return false;
    // Optional: num_kv_heads <G> (grouped-query attention), the last key of the layer line.
    if (next_is(&ld->lx, "num_kv_heads")) {
        if (!key_size(ld, "num_kv_heads", &gc->num_kv_heads)) return false;
        if (gc->num_kv_heads == 0 || gc->num_heads == 0 ||
            gc->num_kv_heads > gc->num_heads || gc->num_heads % gc->num_kv_heads != 0) {
            fail(ld, "num_kv_heads %zu must be in 1..num_heads and divide num_heads %zu",
                 gc->num_kv_heads, gc->num_heads);
            return false;
        }
    }
    // Optional: dtype <f16|bf16|f64> (a 16-bit or float64 layer), after num_kv_heads; absent:
    // float32.
    if (next_is(&ld->lx, "dtype")) {
        if (!expect_word(ld, "dtype") || !expect_token(ld, "dtype", &t)) return false;
        if (strcmp(t, "f16") == 0)
            gc->dtype = GOLDEN_LAYER_F16;
        else if (strcmp(t, "bf16") == 0)
            gc->dtype = GOLDEN_LAYER_BF16;
        else if (strcmp(t, "f64") == 0)
            gc->dtype = GOLDEN_LAYER_F64;
        else {
            fail(ld, "dtype: unknown layer dtype '%.40s' (f16, bf16 or f64)", t);
            return false;
        }
    }
    // Optional: window <left> <right> (a sliding window), then softcap <c>, alibi and sinks,
    // last.
    if (!parse_window(ld) || !parse_variants(ld)) return false;

    if (!expect_word(ld, "call") || !key_bool(ld, "need_weights", &gc->need_weights) ||
        !key_bool(ld, "per_head_weights", &gc->per_head_weights) ||
        !key_bool(ld, "is_causal", &gc->is_causal) ||
        !key_bool(ld, "training", &gc->training) || !key_kind(ld, "kpm", &gc->kpm) ||
        !key_kind(ld, "attn", &gc->attn) || !key_bool(ld, "attn_per_batch", &gc->attn_per_batch))
        return false;
    return true;
}

// The sdpa line of an SDPA case.
static bool parse_sdpa_line(loader *ld) {
    golden_case *gc = ld->gc;
    char *t;
    gc->sdpa = true;
    if (!expect_word(ld, "sdpa") || !expect_word(ld, "layout") ||
        !expect_token(ld, "layout", &t))
        return false;
    if (strcmp(t, "nhld") != 0 && strcmp(t, "nlhd") != 0) {
        fail(ld, "layout: '%.40s' is neither nhld nor nlhd", t);
        return false;
    }
    gc->sdpa_nlhd = t[1] == 'l';
    if (!key_bool(ld, "is_causal", &gc->is_causal) || !key_double(ld, "scale", &gc->scale) ||
        !key_bool(ld, "enable_gqa", &gc->enable_gqa) || !key_kind(ld, "attn", &gc->attn) ||
        !parse_window(ld) || !parse_variants(ld))
        return false;
    if (!(isfinite(gc->scale) && gc->scale >= 0.0)) {
        fail(ld, "scale %g is not a finite number >= 0", gc->scale);
        return false;
    }
    return true;
}

// The ALiBi slopes: alibi_slopes only with alibi, f32, (H): the layer's num_heads, or the query
// heads of an SDPA case (its query's dimension -3, -2 in nlhd).
static bool check_slopes(loader *ld) {
    golden_case *gc = ld->gc;
    const golden_tensor *s = golden_find(gc, "alibi_slopes");
    if (!s) return true;
    if (!gc->alibi) {
        fail(ld, "tensor alibi_slopes present but the case has no alibi");
        return false;
    }
    size_t heads = gc->num_heads;
    if (gc->sdpa) {
        const golden_tensor *q = golden_find(gc, "query");
        heads = q && q->ndim >= 3 ? q->shape[q->ndim - (gc->sdpa_nlhd ? 2 : 3)] : 0;
    }
    if (s->dtype != GOLDEN_F32 || s->ndim != 1 || s->shape[0] != heads) {
        fail(ld, "tensor alibi_slopes must be f32 of shape (%zu), one slope per head", heads);
        return false;
    }
    return true;
}

// The attention sinks: the tensor sinks exactly with sinks, f32, (H) (the heads as for the
// slopes), and its gradient grad.sinks, f64 of the same shape, in a file with gradients.
static bool check_sinks(loader *ld) {
    golden_case *gc = ld->gc;
    const golden_tensor *s = golden_find(gc, "sinks");
    const golden_tensor *g = golden_find(gc, "grad.sinks");
    if (!gc->sinks) {
        if (s || g)
            fail(ld, "tensor %s present but the case has no sinks", s ? "sinks" : "grad.sinks");
        return !s && !g;
    }
    size_t heads = gc->num_heads;
    if (gc->sdpa) {
        const golden_tensor *q = golden_find(gc, "query");
        heads = q && q->ndim >= 3 ? q->shape[q->ndim - (gc->sdpa_nlhd ? 2 : 3)] : 0;
    }
    if (!s || s->dtype != GOLDEN_F32 || s->ndim != 1 || s->shape[0] != heads) {
        fail(ld, "tensor sinks must be present, f32 of shape (%zu), one sink per head", heads);
        return false;
    }
    bool grads = golden_find(gc, "grad.query") != NULL;
    if (grads != (g != NULL) || (g && (g->dtype != GOLDEN_F64 || g->ndim != 1 ||
                                       g->shape[0] != heads))) {
        fail(ld, "tensor grad.sinks must be present exactly with the other gradients, f64 of "
                 "shape (%zu)", heads);
        return false;
    }
    return true;
}

// What an SDPA file must hold (golden.h), each tensor of its dtype.
static bool check_sdpa(loader *ld) {
    golden_case *gc = ld->gc;
    static const struct {
        const char *name;
        golden_dtype dtype;
    } need[] = {{"query", GOLDEN_F32},      {"key", GOLDEN_F32},        {"value", GOLDEN_F32},
                {"output", GOLDEN_F64},     {"lse", GOLDEN_F64},        {"weights", GOLDEN_F64},
                {"grad_output", GOLDEN_F32}, {"grad.query", GOLDEN_F64}, {"grad.key", GOLDEN_F64},
                {"grad.value", GOLDEN_F64}};
    for (size_t i = 0; i < sizeof need / sizeof *need; i++) {
        const golden_tensor *tn = golden_find(gc, need[i].name);
        if (!tn || tn->dtype != need[i].dtype) {
            fail(ld, "tensor %s is %s", need[i].name,
                 !tn ? "missing" : need[i].dtype == GOLDEN_F32 ? "not f32" : "not f64");
            return false;
        }
    }
    const golden_tensor *gm = golden_find(gc, "grad.attn_mask");
    if ((gc->attn == GOLDEN_MASK_FLOAT) != (gm != NULL) || (gm && gm->dtype != GOLDEN_F64)) {
        fail(ld, "grad.attn_mask must be present (f64) exactly with a float attn_mask");
        return false;
    }
    return true;
}

// What a layer case's file must hold (golden_load()).
static bool check_layer(loader *ld) {
    golden_case *gc = ld->gc;
    static const char *const required[] = {"query", "output"};
    for (size_t i = 0; i < sizeof required / sizeof *required; i++) {
        if (!golden_find(gc, required[i])) {
            fail(ld, "tensor %s is missing", required[i]);
            return false;
        }
    }
    const golden_tensor *out = golden_find(gc, "output");
    const golden_tensor *w = golden_find(gc, "weights");
    if (out->dtype != GOLDEN_F64 || (w && w->dtype != GOLDEN_F64)) {
        fail(ld, "output and weights must be f64");
        return false;
    }
    if (gc->need_weights != (w != NULL)) {
        fail(ld, "need_weights is %d but weights is %s", (int)gc->need_weights,
             w ? "present" : "missing");
        return false;
    }
    // A float64 layer's values are all doubles: an f32 tensor would hold rounded values.
    if (gc->dtype == GOLDEN_LAYER_F64) {
        for (size_t i = 0; i < gc->num_tensors; i++) {
            if (gc->tensors[i].dtype == GOLDEN_F32) {
                fail(ld, "dtype f64: tensor %s is f32", gc->tensors[i].name);
                return false;
            }
        }
    }
    // A 16-bit layer's baseline: PyTorch's result in the dtype, f32, the expected shapes.
    if (gc->dtype == GOLDEN_LAYER_F16 || gc->dtype == GOLDEN_LAYER_BF16) {
        const golden_tensor *want[] = {out, w};
        const char *const names[] = {"torch.output", "torch.weights"};
        for (size_t i = 0; i < 2; i++) {
            const golden_tensor *b = golden_find(gc, names[i]);
            if (!want[i]) {
                if (b) {
                    fail(ld, "tensor %s present but need_weights is 0", names[i]);
                    return false;
                }
                continue;
            }
            if (!b) {
                fail(ld, "dtype %s: tensor %s is missing", golden_layer_dtype_name(gc->dtype),
                     names[i]);
                return false;
            }
            bool same_shape = b->dtype == GOLDEN_F32 && b->ndim == want[i]->ndim;
            for (size_t d = 0; same_shape && d < b->ndim; d++)
                same_shape = b->shape[d] == want[i]->shape[d];
            if (!same_shape) {
                fail(ld, "tensor %s must be f32 and of %s's shape", names[i], want[i]->name);
                return false;
            }
        }
    }
    return true;
}

static bool parse_body(loader *ld) {
    golden_case *gc = ld->gc;
    char *t;
    if (!expect_word(ld, "case") || !expect_token(ld, "case name", &t)) return false;
    if (strlen(t) >= sizeof gc->name) {
        fail(ld, "case name too long");
        return false;
    }
    strcpy(gc->name, t);
    if (!(next_is(&ld->lx, "sdpa") ? parse_sdpa_line(ld) : parse_layer_call(ld))) return false;

    for (;;) {
        if (!expect_token(ld, "'tensor' or 'end'", &t)) return false;
        if (strcmp(t, "end") == 0) break;
        if (strcmp(t, "tensor") != 0) {
            fail(ld, "expected 'tensor' or 'end', found '%.40s'", t);
            return false;
        }
        if (!parse_tensor(ld)) return false;
    }
    t = next_token(&ld->lx);
    if (t) {
        fail(ld, "text after 'end': '%.40s'", t);
        return false;
    }

    ld->lx.tline = 0;  // the checks below concern the whole file, not a line
    if (!check_mask(ld, "key_padding_mask", gc->kpm) || !check_mask(ld, "attn_mask", gc->attn) ||
        !check_slopes(ld) || !check_sinks(ld))
        return false;
    return gc->sdpa ? check_sdpa(ld) : check_layer(ld);
}

const char *golden_load(const char *path, golden_case *gc) {
    if (!gc) return "golden_load: NULL case";
    memset(gc, 0, sizeof *gc);
    loader ld = {.path = path ? path : "(null)", .gc = gc, .lx = {NULL, 1, 1}};
    if (!path) {
        fail(&ld, "NULL path");
        return gc->error;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(gc->error, sizeof gc->error, "%s: cannot open: %s", path, strerror(errno));
        return gc->error;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (cap - len < 4096 + 1) {
            if (cap > (size_t)GOLDEN_MAX_FILE) {
                snprintf(gc->error, sizeof gc->error, "%s: file too large", path);
                free(buf);
                fclose(f);
                return gc->error;
            }
            size_t ncap = cap ? cap * 2 : 65536;
            char *nb = realloc(buf, ncap);
            if (!nb) {
                snprintf(gc->error, sizeof gc->error, "%s: out of memory", path);
                free(buf);
                fclose(f);
                return gc->error;
            }
            buf = nb;
            cap = ncap;
        }
        size_t got = fread(buf + len, 1, cap - len - 1, f);
        len += got;
        if (got == 0) break;
    }
    bool read_error = ferror(f) != 0;
    fclose(f);
    if (read_error) {
        snprintf(gc->error, sizeof gc->error, "%s: read error", path);
        free(buf);
        return gc->error;
    }
    buf[len] = '\0';
    if (memchr(buf, '\0', len)) {
        snprintf(gc->error, sizeof gc->error, "%s: file contains a NUL byte", path);
        free(buf);
        return gc->error;
    }
    ld.lx.p = buf;
    bool ok = parse_body(&ld);
    free(buf);
    if (!ok) {
        golden_free(gc);  // keeps gc->error
        return gc->error;
    }
    return NULL;
}
