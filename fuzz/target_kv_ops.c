// Fuzz target: sequences of KV-cache operations, checked against a model of what each sequence
// holds and the CPU reference over it (see targets.h).
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
// Read front to back; bytes past the end read as 0.
//   seed       1 byte: parameters and every call's inputs
//   layer      bit 0 E 16 (else 8), bits 1-2 H (1, 2, 4, 2), 3 grouped-query attention (H/2
//              key/value heads), 4 bias, 5 add_bias_kv, 6 add_zero_attn, 7 kdim 12, vdim 4
//   variants   bit 0 sliding window, 1 softcap 3, 2 ALiBi, 3 sinks, bits 4-6 kv_dtype (0-4;
//              5-7 float32)
//   window     bits 0-3 left - 1, bits 4-7 right - 1 (-1: unbounded)
//   cache      bit 0 paged; bits 1-3: contiguous capacity 1 + 2 * value, paged page size 8
//              (bit 1 clear) or 16 and 1 + bits 2-3 pages; bits 4-5 batch 1 + value % 3;
//              bits 6 and 7 both set: options the creation must refuse
//   ops        up to MAX_OPS operations, each an op byte and the bytes it reads (see run_op):
//              op & 7: 0-1 append and attend, 2 attend only, 3 truncate, 4 reset, 5 fork,
//              6 a call the cache must refuse, 7 a packed call (seq_lens, kv_seq_lens)

enum { MAX_N = 3, MAX_TOK = 64, MAX_FEAT = 16, MAX_ROWS = 4, MAX_OPS = 12 };

// What the cache must hold: each sequence's key and value tokens, as given (the cache holds
// their projections; the reference projects them again).
typedef struct model {
    size_t n, e, kdim, vdim, capacity;  // capacity: per sequence (a paged pool's whole size)
    bool paged, forked;
    size_t page_size, num_pages;
    size_t len[MAX_N];
    float k[MAX_N][MAX_TOK][MAX_FEAT], v[MAX_N][MAX_TOK][MAX_FEAT];
} model;

typedef struct session {
    clmha_context *ctx;
    clmha_fuzz_layer fl;
    clmha_kv_cache *cache;
    clmha_kv_dtype kv_dtype;
    model m;
    uint64_t state;
} session;

// The layer from the first bytes (float32; every combination is a valid layer).
static clmha_layer_desc read_layer(clmha_fuzz_in *in, clmha_kv_dtype *kv_dtype) {
    static const size_t hs[4] = {1, 2, 4, 2};
    uint8_t a = clmha_fuzz_take(in), b = clmha_fuzz_take(in), w = clmha_fuzz_take(in);
    clmha_layer_desc d = {.struct_size = sizeof d};
    d.embed_dim = (a & 1) ? 16 : 8, d.num_heads = hs[(a >> 1) & 3];
    if ((a & 8) && d.num_heads >= 2) d.num_kv_heads = d.num_heads / 2;
    d.bias = (a >> 4) & 1, d.add_bias_kv = (a >> 5) & 1, d.add_zero_attn = (a >> 6) & 1;
    if (a & 0x80) d.kdim = 12, d.vdim = 4;
    d.window = b & 1, d.softcap = (b & 2) ? 3.0 : 0.0, d.alibi = (b >> 2) & 1;
    d.sinks = (b >> 3) & 1;
    d.window_left = (int64_t)(w & 15) - 1, d.window_right = (int64_t)(w >> 4) - 1;
    unsigned kd = (b >> 4) & 7;
    *kv_dtype = kd <= 4 ? (clmha_kv_dtype)kd : CLMHA_KV_FLOAT32;
    return d;
}

// Makes the cache the next byte describes; its status (a refusal must be clean).
static clmha_status make_cache(session *s, uint8_t b) {
    model *m = &s->m;
    m->n = 1 + ((b >> 4) & 3) % 3;
    clmha_kv_cache_options o = {.struct_size = sizeof o, .kv_dtype = s->kv_dtype};
    m->paged = b & 1;
    if (m->paged) {
        o.page_size = m->page_size = (b & 2) ? 16 : 8;
        o.num_pages = m->num_pages = 1 + ((b >> 2) & 3);
        m->capacity = m->page_size * m->num_pages;
    } else {
        o.capacity = m->capacity = 1 + 2 * ((b >> 1) & 7);
    }
    bool broken = (b & 0xC0) == 0xC0;
    if (broken) {
        // One option out of range, by the bits that chose the sizes.
        switch ((b >> 1) & 3) {
        case 0: o.page_size = 12, o.capacity = 0; break;
        case 1: o.kv_dtype = (clmha_kv_dtype)9; break;
        case 2: o.struct_size = 0; break;
        default: o.page_size = 8, o.num_pages = 0, o.capacity = 0; break;
        }
    }
    clmha_status st = clmha_kv_cache_create_with(&s->cache, s->fl.layer, m->n, &o);
    if (broken || st != CLMHA_SUCCESS) {
        CLMHA_FUZZ_CHECK(clmha_fuzz_clean_refusal(s->ctx, st) && s->cache == NULL);
        if (st == CLMHA_SUCCESS) clmha_kv_cache_release(s->cache);
        return st == CLMHA_SUCCESS ? CLMHA_INVALID_ARGUMENT : st;
    }
    return st;
}

// The cache's lengths are the model's; a paged pool holds no more pages than the lengths need
// (exactly those when no sequence was forked: nothing is shared).
static void check_lengths(const session *s) {
    const model *m = &s->m;
    size_t got[MAX_N];
    CLMHA_FUZZ_CHECK(clmha_kv_cache_lengths(s->cache, got, m->n) == CLMHA_SUCCESS);
    for (size_t i = 0; i < m->n; ++i) CLMHA_FUZZ_CHECK(got[i] == m->len[i]);
    if (!m->paged) return;
    size_t page_size, pages, free_pages, need = 0;
    CLMHA_FUZZ_CHECK(clmha_kv_cache_pages(s->cache, &page_size, &pages, &free_pages) ==
                     CLMHA_SUCCESS);
    CLMHA_FUZZ_CHECK(page_size == m->page_size && pages == m->num_pages && free_pages <= pages);
    for (size_t i = 0; i < m->n; ++i) need += (m->len[i] + page_size - 1) / page_size;
    if (m->forked) CLMHA_FUZZ_CHECK(pages - free_pages <= need);
    else CLMHA_FUZZ_CHECK(pages - free_pages == need);
}

// The reference's rows for sequence @p i's @p rows queries @p q (E floats each, @p stride
// apart), which sat at positions before + 0 … before + rows - 1 of a sequence now holding the
// model's tokens: a one-shot call whose earlier query rows are zeros (the reference has no
// cache, and is_causal, the window and ALiBi are top-left there: row r is at position r).
// Compared with the device's rows @p got (same stride); skipped without keys.
static void check_rows(const session *s, size_t i, size_t before, size_t rows, const float *q,
                       const float *got, size_t stride, bool causal) {
    const model *m = &s->m;
    size_t len = m->len[i], lq = before + rows, e = m->e;
    if (!len || !rows || s->kv_dtype == CLMHA_KV_INT8 || s->kv_dtype == CLMHA_KV_INT4) return;
    float *qa = calloc(lq * e, sizeof *qa), *ka = malloc(len * m->kdim * sizeof *ka);
    float *va = malloc(len * m->vdim * sizeof *va), *g = malloc(rows * e * sizeof *g);
    double *want = malloc(lq * e * sizeof *want);
    if (qa && ka && va && g && want) {
        for (size_t r = 0; r < rows; ++r) {
            memcpy(qa + (before + r) * e, q + r * stride, e * sizeof *qa);
            memcpy(g + r * e, got + r * stride, e * sizeof *g);
        }
        for (size_t t = 0; t < len; ++t) {
            memcpy(ka + t * m->kdim, m->k[i][t], m->kdim * sizeof *ka);
            memcpy(va + t * m->vdim, m->v[i][t], m->vdim * sizeof *va);
        }
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = causal};
        a.query = (clmha_tensor){.ndim = 2, .shape = {lq, e}, .data = qa};
        a.key = (clmha_tensor){.ndim = 2, .shape = {len, m->kdim}, .data = ka};
        a.value = (clmha_tensor){.ndim = 2, .shape = {len, m->vdim}, .data = va};
        char msg[512] = "";
        clmha_status st = clmha_reference_forward(&s->fl.desc, &s->fl.params, &a, want, lq * e,
                                                  NULL, 0, msg, sizeof msg);
        if (st != CLMHA_SUCCESS) fprintf(stderr, "reference refused: %s\n", msg);
        CLMHA_FUZZ_CHECK(st == CLMHA_SUCCESS);
        double tol = s->kv_dtype == CLMHA_KV_FLOAT32 ? 2e-3 : 5e-2;
        double err = clmha_fuzz_rel_err(g, want + before * e, rows * e);
        if (!(err <= tol))
            fprintf(stderr, "sequence %zu (%zu tokens, %zu rows from %zu): error %g\n", i, len,
                    rows, before, err);
        CLMHA_FUZZ_CHECK(err <= tol);
    }
    free(qa), free(ka), free(va), free(g), free(want);
}

// A refused call: cleanly, and the lengths as they were.
static void check_refused(const session *s, clmha_status st) {
    CLMHA_FUZZ_CHECK(clmha_fuzz_clean_refusal(s->ctx, st));
    check_lengths(s);
}

// The inputs of one call: queries (rows, N, E) or packed (T, E), keys and values likewise.
// Row r of sequence i is row q_base[i] + r * q_step of the query (and of the output); its
// token j is row k_base[i] + j * k_step of the key and the value.
typedef struct step {
    float *q, *k, *v;
    size_t counts[MAX_N];  // tokens each sequence appends
    size_t q_rows[MAX_N], q_base[MAX_N], k_base[MAX_N], q_step, k_step;
} step;

// Whether the appends fit (a paged cache may still run out of pages: shared pages are copied).
static bool fits(const model *m, const size_t *counts) {
    for (size_t i = 0; i < m->n; ++i)
        if (m->len[i] + counts[i] > m->capacity) return false;
    return true;
}

// After a call that succeeded: the model takes the appended tokens, and each sequence's query
// rows are compared with the reference.
static void accept_step(session *s, const step *t, const float *out, bool causal) {
    model *m = &s->m;
    size_t before[MAX_N];
    for (size_t i = 0; i < m->n; ++i) {
        before[i] = m->len[i];
        for (size_t j = 0; j < t->counts[i]; ++j) {
            size_t row = t->k_base[i] + j * t->k_step;
            memcpy(m->k[i][m->len[i] + j], t->k + row * m->kdim, m->kdim * sizeof(float));
            memcpy(m->v[i][m->len[i] + j], t->v + row * m->vdim, m->vdim * sizeof(float));
        }
        m->len[i] += t->counts[i];
    }
    check_lengths(s);
    for (size_t i = 0; i < m->n; ++i) {
        size_t off = t->q_base[i] * m->e;
        check_rows(s, i, before[i], t->q_rows[i], t->q + off, out + off, t->q_step * m->e,
                   causal);
    }
}

// What op 6 breaks in an otherwise correct call: options the decode core does not take.
enum { BREAK_NONE, BREAK_WEIGHTS, BREAK_KPM, BREAK_SAVE, BREAK_KEY_ATTEND_ONLY, BREAK_UNFUSED };

// What a call must do: succeed (a paged cache may still run out of pages), be refused, or
// either (what the model does not decide).
enum { MUST_FAIL, MUST_PASS, MAY_PASS };

// Runs @p a through the cache (@p q_rows query rows in all) and checks the outcome against
// @p expect; a call that succeeds gives the reference's rows.
static clmha_status call_cache(session *s, clmha_forward_args *a, const step *t, size_t q_rows,
                               int expect, bool causal) {
    size_t count = q_rows * s->m.e;
    float *out = malloc((count ? count : 1) * sizeof *out);
    if (!out) return CLMHA_OUT_OF_MEMORY;
    a->kv_cache = s->cache;
    clmha_status st = clmha_layer_forward_host(s->fl.layer, a, out, count, NULL, 0);
    if (st == CLMHA_SUCCESS) {
        CLMHA_FUZZ_CHECK(expect != MUST_FAIL);
        accept_step(s, t, out, causal);
    } else {
        check_refused(s, st);
        if (expect == MUST_PASS && !(s->m.paged && st == CLMHA_OUT_OF_MEMORY)) {
            fprintf(stderr, "a valid call was refused: %s\n", clmha_context_last_error(s->ctx));
            CLMHA_FUZZ_CHECK(expect != MUST_PASS);
        }
    }
    free(out);
    return st;
}

static bool alloc_step(step *t, size_t q_floats, size_t k_floats, size_t v_floats,
                       uint64_t *state) {
    t->q = clmha_fuzz_uniform(state, q_floats ? q_floats : 1, 1.0f);
    t->k = clmha_fuzz_uniform(state, k_floats ? k_floats : 1, 1.0f);
    t->v = clmha_fuzz_uniform(state, v_floats ? v_floats : 1, 1.0f);
    return t->q && t->k && t->v;
}

// Ops 0-2 and 6: a batched call, rows (1 + bits 3-4) query rows per sequence, causal (bit 6);
// appending 1 + (next byte % 4) tokens, of which sequence i takes bits 2i-2i+1 of the byte
// after (bit 7 set: kv_append NULL, all of them), or (op 2) attending only.
static clmha_status op_batched(session *s, clmha_fuzz_in *in, uint8_t op, int brk) {
    const model *m = &s->m;
    bool attend_only = (op & 7) == 2 || brk == BREAK_KEY_ATTEND_ONLY, causal = op & 0x40;
    bool with_key = (op & 7) != 2;  // BREAK_KEY_ATTEND_ONLY gives keys to an attend-only call
    size_t rows = 1 + ((op >> 3) & 3), s_new = with_key ? 1 + clmha_fuzz_take(in) % 4 : 0;
    uint8_t cb = with_key ? clmha_fuzz_take(in) : 0;
    step t = {.q_step = m->n, .k_step = m->n};
    bool valid = brk == BREAK_NONE;
    for (size_t i = 0; i < m->n; ++i) {
        t.q_rows[i] = rows, t.q_base[i] = t.k_base[i] = i;
        t.counts[i] = attend_only ? 0 : (cb & 0x80) ? s_new : (cb >> (2 * i)) & 3;
        valid = valid && t.counts[i] <= s_new;
    }
    valid = valid && fits(m, t.counts);
    clmha_forward_args a = {.struct_size = sizeof a, .is_causal = causal};
    clmha_saved *saved = NULL;
    unsigned char kpm[MAX_N * 4] = {0};
    clmha_status st = CLMHA_OUT_OF_MEMORY;
    if (!alloc_step(&t, rows * m->n * m->e, s_new * m->n * m->kdim, s_new * m->n * m->vdim,
                    &s->state))
        goto done;
    a.query = (clmha_tensor){.ndim = 3, .shape = {rows, m->n, m->e}, .data = t.q};
    if (with_key) {
        a.key = (clmha_tensor){.ndim = 3, .shape = {s_new, m->n, m->kdim}, .data = t.k};
        a.value = (clmha_tensor){.ndim = 3, .shape = {s_new, m->n, m->vdim}, .data = t.v};
    }
    a.kv_append = (cb & 0x80) || attend_only ? NULL : t.counts;
    a.kv_attend_only = attend_only;
    if (brk == BREAK_WEIGHTS) a.need_weights = true;
    if (brk == BREAK_KPM && with_key)
        a.key_padding_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_IGNORE,
                                          .tensor = {.ndim = 2, .shape = {m->n, s_new},
                                                     .data = kpm}};
    if (brk == BREAK_SAVE && clmha_saved_create(&saved, s->fl.layer) == CLMHA_SUCCESS)
        a.save = saved;
    if (brk == BREAK_UNFUSED) a.impl = CLMHA_IMPL_UNFUSED;
    // A breakage that could not be made (no saved object, no keys for the mask) is no breakage.
    if ((brk == BREAK_SAVE && !saved) || (brk == BREAK_KPM && !with_key)) goto done;
    st = call_cache(s, &a, &t, rows * m->n, valid ? MUST_PASS : MUST_FAIL, causal);
done:
    clmha_saved_release(saved);
    free(t.q), free(t.k), free(t.v);
    return st;
}

// Op 7: a packed call, sequence i with bits 2i-2i+1 of the next byte as its query rows and of
// the byte after as its new tokens; causal (bit 6).
static clmha_status op_packed(session *s, clmha_fuzz_in *in, uint8_t op) {
    const model *m = &s->m;
    uint8_t qb = clmha_fuzz_take(in), kb = clmha_fuzz_take(in);
    bool causal = op & 0x40;
    step t = {.q_step = 1, .k_step = 1};
    size_t seq_lens[MAX_N], kv_lens[MAX_N], total = 0, total_kv = 0;
    for (size_t i = 0; i < m->n; ++i) {
        seq_lens[i] = t.q_rows[i] = (qb >> (2 * i)) & 3;
        kv_lens[i] = t.counts[i] = (kb >> (2 * i)) & 3;
        t.q_base[i] = total, t.k_base[i] = total_kv;
        total += seq_lens[i], total_kv += kv_lens[i];
    }
    clmha_status st = CLMHA_OUT_OF_MEMORY;
    if (alloc_step(&t, total * m->e, total_kv * m->kdim, total_kv * m->vdim, &s->state)) {
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = causal,
                                .seq_lens = seq_lens, .kv_seq_lens = kv_lens,
                                .num_seqs = m->n};
        a.query = (clmha_tensor){.ndim = 2, .shape = {total, m->e}, .data = t.q};
        a.key = (clmha_tensor){.ndim = 2, .shape = {total_kv, m->kdim}, .data = t.k};
        a.value = (clmha_tensor){.ndim = 2, .shape = {total_kv, m->vdim}, .data = t.v};
        // A sequence with queries but no new tokens is refused, even when the cache holds some
        // of its tokens (packed calls check S = 0 per sequence): either outcome passes here.
        bool keyless = false;
        for (size_t i = 0; i < m->n; ++i) keyless = keyless || (seq_lens[i] && !kv_lens[i]);
        int expect = !fits(m, t.counts)         ? MUST_FAIL
                     : total && total_kv && !keyless ? MUST_PASS
                                                     : MAY_PASS;
        st = call_cache(s, &a, &t, total, expect, causal);
    }
    free(t.q), free(t.k), free(t.v);
    return st;
}

// Op 3: sequence i keeps (byte i % (its length + 2)) tokens (one more than it holds: refused);
// bit 3 of the op gives one length too many (refused).
static clmha_status op_truncate(session *s, clmha_fuzz_in *in, uint8_t op) {
    model *m = &s->m;
    size_t lengths[MAX_N + 1], count = m->n + ((op >> 3) & 1);
    bool valid = count == m->n;
    for (size_t i = 0; i < count; ++i) {
        lengths[i] = clmha_fuzz_take(in) % ((i < m->n ? m->len[i] : 0) + 2);
        if (i < m->n) valid = valid && lengths[i] <= m->len[i];
    }
    clmha_status st = clmha_kv_cache_truncate(s->cache, lengths, count);
    if (!valid) {
        check_refused(s, st);
        return st;
    }
    CLMHA_FUZZ_CHECK(st == CLMHA_SUCCESS);
    for (size_t i = 0; i < m->n; ++i) m->len[i] = lengths[i];
    check_lengths(s);
    return st;
}

// Op 5: sequence (next byte % (N + 1)) shared into sequence (the byte after % (N + 1)); N is
// past the batch (refused), and a contiguous cache refuses every fork.
static clmha_status op_fork(session *s, clmha_fuzz_in *in) {
    model *m = &s->m;
    size_t src = clmha_fuzz_take(in) % (m->n + 1), dst = clmha_fuzz_take(in) % (m->n + 1);
    clmha_status st = clmha_kv_cache_fork(s->cache, src, dst);
    if (!m->paged || src >= m->n || dst >= m->n) {
        check_refused(s, st);
        CLMHA_FUZZ_CHECK(m->paged || src >= m->n || dst >= m->n || st == CLMHA_UNSUPPORTED);
        return st;
    }
    CLMHA_FUZZ_CHECK(st == CLMHA_SUCCESS);
    if (src != dst) {
        memcpy(m->k[dst], m->k[src], sizeof m->k[src]);
        memcpy(m->v[dst], m->v[src], sizeof m->v[src]);
        m->len[dst] = m->len[src];
        m->forked = true;
    }
    check_lengths(s);
    return st;
}

static clmha_status run_op(session *s, clmha_fuzz_in *in) {
    uint8_t op = clmha_fuzz_take(in);
    clmha_status st;
    switch (op & 7) {
    case 3: return op_truncate(s, in, op);
    case 4:
        st = clmha_kv_cache_reset(s->cache);
        CLMHA_FUZZ_CHECK(st == CLMHA_SUCCESS);
        memset(s->m.len, 0, sizeof s->m.len);
        check_lengths(s);
        return st;
    case 5: return op_fork(s, in);
    case 6: return op_batched(s, in, op & ~7, 1 + (op >> 3) % 5);  // a batched append, broken
    case 7: return op_packed(s, in, op);
    default: return op_batched(s, in, op, BREAK_NONE);
    }
}

int clmha_fuzz_kv_ops(const uint8_t *data, size_t size) {
    clmha_context *ctx = clmha_fuzz_context();
    if (!ctx) return CLMHA_UNSUPPORTED;
    clmha_fuzz_in in = {data, size};
    session *s = calloc(1, sizeof *s);  // the model is 25 KB: not on the stack
    if (!s) return CLMHA_OUT_OF_MEMORY;
    s->ctx = ctx;
    uint64_t seed = clmha_fuzz_take(&in);
    s->state = seed * 0x9E3779B97F4A7C15ull + 1;
    clmha_layer_desc desc = read_layer(&in, &s->kv_dtype);
    clmha_status st = clmha_fuzz_layer_make(&s->fl, ctx, &desc, seed);
    CLMHA_FUZZ_CHECK(st == CLMHA_SUCCESS || st == CLMHA_OUT_OF_MEMORY);  // all valid layers
    if (st == CLMHA_SUCCESS) {
        s->m.e = desc.embed_dim;
        s->m.kdim = desc.kdim ? desc.kdim : desc.embed_dim;
        s->m.vdim = desc.vdim ? desc.vdim : desc.embed_dim;
        st = make_cache(s, clmha_fuzz_take(&in));
        if (st == CLMHA_SUCCESS) {
            check_lengths(s);
            for (int i = 0; i < MAX_OPS && in.n; ++i) st = run_op(s, &in);
            clmha_kv_cache_release(s->cache);
        }
        clmha_fuzz_layer_free(&s->fl);
    }
    free(s);
    return st;
}
