// Fuzz target: attention variants and packed lengths from raw values, checked against the CPU
// reference's acceptance and results (see targets.h).
#include "targets.h"

#include <float.h>
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
//   seed        1 byte: parameters and inputs
//   e_h         bits 0-1 E (4, 8, 16, 12), bits 2-3 H (1, 2, 4, 3), bits 4-6 num_kv_heads
//               (0-3: 0, that is H; then 1, 2, 4, 3: those that do not divide H are refused),
//               bit 7 kdim 12, vdim 4
//   flags       bit 0 bias, 1 add_bias_kv, 2 add_zero_attn, 3 window, 4 ALiBi, 5 sinks,
//               6 training (dropout 0.25), 7 is_causal
//   window      2 bytes: left and right (window_values)
//   softcap     1 byte (softcap_values)
//   call        bit 0 packed, bits 1-3 num_seqs (0-7, at most MAX_SEQS lengths read),
//               bit 4 kv_seq_lens given, 5 self-attention (no key, no value), 6 one option a
//               packed call refuses (need_weights, attn_mask, kv_append by bit 7), 7 that
//               option's choice
//   lengths     packed: num_seqs query lengths, then with bit 4 num_seqs key lengths (each a
//               byte, length_values); plain: L, S, N (1 + byte % 5, 1 + byte % 5, byte % 3: 0 an
//               unbatched call)

enum { MAX_SEQS = 4, MAX_ROWS = 40 };

static const int64_t window_values[12] = {-1, 0, 1, 2, 3, 5, -2, INT64_MIN, INT64_MAX,
                                          (int64_t)1 << 40, -1000, 1 << 24};
static const size_t length_values[16] = {0, 1, 2, 3, 4, 5, 1, 2, 3, 6, SIZE_MAX, SIZE_MAX / 2 + 1,
                                         (size_t)1 << 32, SIZE_MAX / 16 + 1, 0, 7};

static double softcap_value(uint8_t b) {
    static const double v[16] = {0.0, 0.0, 0.5, 2.0, 30.0, -1.0, NAN, INFINITY, -INFINITY,
                                 1e-300, DBL_MAX, 1e300, -0.0, 1e-3, 3e38, 5.0};
    return v[b & 15];
}

static clmha_layer_desc read_desc(clmha_fuzz_in *in, bool *training, bool *causal) {
    static const size_t es[4] = {4, 8, 16, 12}, hs[4] = {1, 2, 4, 3};
    uint8_t eh = clmha_fuzz_take(in), f = clmha_fuzz_take(in);
    clmha_layer_desc d = {.struct_size = sizeof d};
    d.embed_dim = es[eh & 3], d.num_heads = hs[(eh >> 2) & 3];
    // Key/value heads: mostly none (num_heads), some dividing it, some not (refused).
    static const size_t kv[8] = {0, 0, 0, 0, 1, 2, 4, 3};
    d.num_kv_heads = kv[(eh >> 4) & 7];
    if (eh & 0x80) d.kdim = 12, d.vdim = 4;
    d.bias = f & 1, d.add_bias_kv = (f >> 1) & 1, d.add_zero_attn = (f >> 2) & 1;
    d.window = (f >> 3) & 1, d.alibi = (f >> 4) & 1, d.sinks = (f >> 5) & 1;
    *training = (f >> 6) & 1, *causal = (f >> 7) & 1;
    d.dropout = *training ? 0.25f : 0.0f;
    d.window_left = window_values[clmha_fuzz_take(in) % 12];
    d.window_right = window_values[clmha_fuzz_take(in) % 12];
    d.softcap = softcap_value(clmha_fuzz_take(in));
    return d;
}

// The call's shapes and arrays.
typedef struct call {
    clmha_forward_args a;
    size_t seq_lens[MAX_SEQS], kv_seq_lens[MAX_SEQS], kv_append[3];
    float *q, *k, *v, *mask;
    size_t q_count, k_count, v_count;
} call;

// sum of @p n lengths; false when it wraps.
static bool sum_lengths(const size_t *v, size_t n, size_t *out) {
    size_t s = 0;
    for (size_t i = 0; i < n; ++i)
        if (__builtin_add_overflow(s, v[i], &s)) return false;
    *out = s;
    return true;
}

// Arrays for the call's tensors where they are small (else NULL data: only the checks run).
static void fill(call *c, uint64_t *state) {
    const clmha_tensor *t[3] = {&c->a.query, &c->a.key, &c->a.value};
    float **dst[3] = {&c->q, &c->k, &c->v};
    size_t *count[3] = {&c->q_count, &c->k_count, &c->v_count};
    for (int i = 0; i < 3; ++i) {
        size_t n;
        if (!t[i]->ndim || clmha_fuzz_prod_overflows(t[i]->shape, t[i]->ndim, &n) ||
            n > MAX_ROWS * 16)
            continue;
        *dst[i] = clmha_fuzz_uniform(state, n ? n : 1, 1.0f);
        *count[i] = n;
    }
    c->a.query.data = c->q, c->a.key.data = c->k, c->a.value.data = c->v;
}

// A packed call: the lengths, query (T, E), key (T_kv, kdim), value (T_kv, vdim); T and T_kv
// the sums (wrapped when they overflow: such calls must be refused).
static void read_packed(clmha_fuzz_in *in, uint8_t cb, const clmha_layer_desc *d, call *c) {
    size_t e = d->embed_dim, kdim = d->kdim ? d->kdim : e, vdim = d->vdim ? d->vdim : e;
    size_t n = (cb >> 1) & 7, read = n < MAX_SEQS ? n : MAX_SEQS;
    for (size_t i = 0; i < read; ++i) c->seq_lens[i] = length_values[clmha_fuzz_take(in) & 15];
    if (cb & 0x10)
        for (size_t i = 0; i < read; ++i)
            c->kv_seq_lens[i] = length_values[clmha_fuzz_take(in) & 15];
    // num_seqs past the lengths given: the sequences past MAX_SEQS read zeros (the arrays hold
    // MAX_SEQS, so such a call keeps num_seqs at MAX_SEQS).
    c->a.num_seqs = read;
    c->a.seq_lens = c->seq_lens;
    c->a.kv_seq_lens = (cb & 0x10) ? c->kv_seq_lens : NULL;
    size_t t = 0, tk = 0;
    (void)sum_lengths(c->seq_lens, read, &t);
    if (!sum_lengths((cb & 0x10) ? c->kv_seq_lens : c->seq_lens, read, &tk)) tk = 0;
    c->a.query = (clmha_tensor){.ndim = 2, .shape = {t, e}};
    if (!(cb & 0x20)) {
        c->a.key = (clmha_tensor){.ndim = 2, .shape = {tk, kdim}};
        c->a.value = (clmha_tensor){.ndim = 2, .shape = {tk, vdim}};
    }
    if (cb & 0x40) {
        static const float zero[1] = {0.0f};
        if (!(cb & 0x80)) c->a.need_weights = true;
        else c->a.kv_append = c->kv_append;  // refused without a cache, and with packing
        if (cb & 0x80)
            c->a.attn_mask = (clmha_mask){.kind = CLMHA_MASK_FLOAT,
                                          .tensor = {.ndim = 2, .shape = {1, 1}, .data = zero}};
    }
}

// A plain call: (L, N, E) (batch_first off) or unbatched (L, E), keys likewise with S.
static void read_plain(clmha_fuzz_in *in, uint8_t cb, const clmha_layer_desc *d, call *c) {
    size_t e = d->embed_dim, kdim = d->kdim ? d->kdim : e, vdim = d->vdim ? d->vdim : e;
    size_t l = 1 + clmha_fuzz_take(in) % 5, s = 1 + clmha_fuzz_take(in) % 5;
    size_t n = clmha_fuzz_take(in) % 3;
    bool self = cb & 0x20;
    if (self) s = l;
    if (n) {
        c->a.query = (clmha_tensor){.ndim = 3, .shape = {l, n, e}};
        if (!self) {
            c->a.key = (clmha_tensor){.ndim = 3, .shape = {s, n, kdim}};
            c->a.value = (clmha_tensor){.ndim = 3, .shape = {s, n, vdim}};
        }
    } else {
        c->a.query = (clmha_tensor){.ndim = 2, .shape = {l, e}};
        if (!self) {
            c->a.key = (clmha_tensor){.ndim = 2, .shape = {s, kdim}};
            c->a.value = (clmha_tensor){.ndim = 2, .shape = {s, vdim}};
        }
    }
    if (cb & 0x40) c->a.need_weights = true, c->a.per_head_weights = cb >> 7;
}

// The layer refused: cleanly, and the reference refuses the descriptor the same way.
static void check_layer_refused(clmha_context *ctx, const clmha_layer_desc *d, clmha_status st,
                                const call *c) {
    CLMHA_FUZZ_CHECK(clmha_fuzz_clean_refusal(ctx, st));
    if (st == CLMHA_OUT_OF_MEMORY || st == CLMHA_BUILD_FAILED || st == CLMHA_OPENCL_ERROR) return;
    char msg[512] = "";
    clmha_status rst = clmha_reference_forward(d, NULL, &c->a, NULL, 0, NULL, 0, msg, sizeof msg);
    if (rst != st)
        fprintf(stderr, "layer: %s\nreference: %s\n", clmha_context_last_error(ctx), msg);
    CLMHA_FUZZ_CHECK(rst == st);
}

// The reference on the call: its status, and (with room) its output and weights.
static clmha_status reference(const clmha_fuzz_layer *fl, const call *c, double *out, size_t oc,
                              double *w, size_t wc, char *msg, size_t size) {
    return clmha_reference_forward(&fl->desc, &fl->params, &c->a, out, oc, w, wc, msg, size);
}

// The call on the layer and on the reference: a refusal is clean and the reference's too, with
// the same status; a small accepted call gives the reference's output and weights.
static clmha_status run_call(const clmha_fuzz_layer *fl, call *c) {
    clmha_context *ctx = clmha_fuzz_context();
    size_t oc = 0, wc = 0;
    char msg[512] = "";
    clmha_status st = clmha_layer_output_counts(fl->layer, &c->a, &oc, &wc);
    bool small = c->q && (!c->a.key.ndim || c->k) && (!c->a.value.ndim || c->v) &&
                 oc <= MAX_ROWS * 16 && wc <= 4096;
    if (st != CLMHA_SUCCESS || !small) {
        if (st == CLMHA_SUCCESS) return st;  // no arrays for a call this large: checks only
        CLMHA_FUZZ_CHECK(clmha_fuzz_clean_refusal(ctx, st));
        clmha_status rst = reference(fl, c, NULL, 0, NULL, 0, msg, sizeof msg);
        if (rst != st)
            fprintf(stderr, "layer: %s\nreference: %s\n", clmha_context_last_error(ctx), msg);
        CLMHA_FUZZ_CHECK(rst == st);
        return st;
    }
    float *out = malloc((oc ? oc : 1) * sizeof *out), *w = malloc((wc ? wc : 1) * sizeof *w);
    double *want = malloc((oc ? oc : 1) * sizeof *want);
    double *want_w = malloc((wc ? wc : 1) * sizeof *want_w);
    if (!out || !w || !want || !want_w) {
        st = CLMHA_OUT_OF_MEMORY;
    } else {
        st = clmha_layer_forward_host(fl->layer, &c->a, out, oc, w, wc);
        clmha_status rst = reference(fl, c, want, oc, want_w, wc, msg, sizeof msg);
        if (rst != st)
            fprintf(stderr, "layer: %s\nreference: %s\n",
                    st ? clmha_context_last_error(ctx) : "accepted", rst ? msg : "accepted");
        CLMHA_FUZZ_CHECK(rst == st);
        if (st != CLMHA_SUCCESS) {
            CLMHA_FUZZ_CHECK(clmha_fuzz_clean_refusal(ctx, st));
        } else {
            double err = clmha_fuzz_rel_err(out, want, oc);
            double err_w = wc ? clmha_fuzz_rel_err(w, want_w, wc) : 0.0;
            if (!(err <= 2e-3 && err_w <= 2e-3))
                fprintf(stderr, "output error %g, weights error %g\n", err, err_w);
            CLMHA_FUZZ_CHECK(err <= 2e-3 && err_w <= 2e-3);
        }
    }
    free(out), free(w), free(want), free(want_w);
    return st;
}

int clmha_fuzz_variants(const uint8_t *data, size_t size) {
    clmha_context *ctx = clmha_fuzz_context();
    if (!ctx) return CLMHA_UNSUPPORTED;
    clmha_fuzz_in in = {data, size};
    uint64_t seed = clmha_fuzz_take(&in), state = seed * 0xD1B54A32D192ED03ull + 7;
    bool training, causal;
    clmha_layer_desc desc = read_desc(&in, &training, &causal);
    uint8_t cb = clmha_fuzz_take(&in);
    call c;
    memset(&c, 0, sizeof c);
    c.a.struct_size = sizeof c.a;
    c.a.is_causal = causal, c.a.training = training;
    c.a.rng.seed = clmha_fuzz_next(&state), c.a.rng.offset = clmha_fuzz_next(&state) & 0xFFFF;
    if (cb & 1) read_packed(&in, cb, &desc, &c);
    else read_plain(&in, cb, &desc, &c);
    fill(&c, &state);
    clmha_fuzz_layer fl;
    clmha_status st = clmha_fuzz_layer_make(&fl, ctx, &desc, seed);
    if (st != CLMHA_SUCCESS) {
        check_layer_refused(ctx, &desc, st, &c);
    } else {
        st = run_call(&fl, &c);
        clmha_fuzz_layer_free(&fl);
    }
    free(c.q), free(c.k), free(c.v);
    return st;
}
