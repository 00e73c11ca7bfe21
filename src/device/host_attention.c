// Attention of head dimension 64 on the CPU itself (device/host_attention.h).
#include "device/host_attention.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "base/checked.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HOST_KERNEL 1
#include <immintrin.h>
#else
#define HOST_KERNEL 0
#endif

#define HD CLMHA__HOST_ATTENTION_HD
#define BK 64        // keys per tile: 64 × 64 transposed floats, 16 KiB
#define KV (BK / 16) // AVX-512 registers of a tile's scores per row
#define MR 6         // rows per micro-kernel: 24 accumulators
#define NT 2         // micro-kernels per block of rows
#define QB (MR * NT) // rows per block

bool clmha__host_attention_fits(size_t head_dim) {
#if HOST_KERNEL
    __builtin_cpu_init();
    return head_dim == HD && __builtin_cpu_supports("avx512f");
#else
    (void)head_dim;
    return false;
#endif
}

size_t clmha__host_attention_scratch(size_t keys) {
    size_t tiles = keys / BK + 1, floats;  // the keys transposed, then the values
    return clmha__mul3(tiles, 2 * BK, HD, &floats) ? floats : 0;
}

#if HOST_KERNEL

#define TARGET __attribute__((target("avx512f")))
#define UNROLL_ROWS _Pragma("GCC unroll 6")
#define UNROLL_4 _Pragma("GCC unroll 4")  // (also the loops over a row's registers)

// 2^x for x <= 0: x = n + r, r in [-1/2, 1/2], 2^r by its degree-6 Taylor polynomial (within
// ~1 ulp), times 2^n; x below -127 gives 2^-127 (a sum of such terms is at least 1).
TARGET static inline __m512 exp2_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// Rows r[0..15] of 16 floats transposed in registers: r[d] becomes the 16 rows' element d
// (unpacks within 128-bit lanes, then the lanes shuffled).
TARGET static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4i + c]: in 128-bit lane L, rows 4i..4i+3 of element 4L + c.
    for (int i = 0; i < 4; ++i) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; ++c) {
        __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
        __m512 x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
        r[4 + c] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
        r[8 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
    }
}

// The keys of one (batch, key/value head), @p k its key 0 (rows k_ld apart), transposed into
// tiles: kt[tile][d][j] = k[tile·BK + j][d] + bk[d], zero past the last key; 16 × 16 blocks
// transposed in registers.
TARGET static void pack_keys(const float *k, size_t k_ld, size_t keys, const float *bk,
                             float *kt) {
    for (size_t j0 = 0; j0 < keys; j0 += 16) {
        float *to = kt + j0 / BK * BK * HD + j0 % BK;
        for (size_t d0 = 0; d0 < HD; d0 += 16) {
            __m512 r[16], b = bk ? _mm512_loadu_ps(bk + d0) : _mm512_setzero_ps();
            for (size_t j = 0; j < 16; ++j)
                r[j] = j0 + j < keys ? _mm512_add_ps(_mm512_loadu_ps(k + (j0 + j) * k_ld + d0), b)
                                     : _mm512_setzero_ps();
            transpose16(r);
            for (size_t d = 0; d < 16; ++d) _mm512_store_ps(to + (d0 + d) * BK, r[d]);
        }
    }
    // The rest of a partial last tile: zero.
    for (size_t j0 = (keys + 15) / 16 * 16; j0 % BK; j0 += 16)
        for (size_t d = 0; d < HD; ++d)
            _mm512_store_ps(kt + j0 / BK * BK * HD + d * BK + j0 % BK, _mm512_setzero_ps());
}

// The values of one (batch, key/value head), @p v its key 0's (rows v_ld apart), copied
// contiguous: vp[j][d] = v[j][d] + bv[d].
TARGET static void pack_values(const float *v, size_t v_ld, size_t keys, const float *bv,
                               float *vp) {
    __m512 b[HD / 16];
    for (int c = 0; c < HD / 16; ++c)
        b[c] = bv ? _mm512_loadu_ps(bv + 16 * c) : _mm512_setzero_ps();
    for (size_t j = 0; j < keys; ++j)
        for (int c = 0; c < HD / 16; ++c)
            _mm512_store_ps(vp + j * HD + 16 * c,
                            _mm512_add_ps(_mm512_loadu_ps(v + j * v_ld + 16 * c), b[c]));
}

// The running state of a block's rows.
typedef struct block_state {
    float acc[QB][HD] __attribute__((aligned(64)));  // sum of p·v
    float sums[QB][16] __attribute__((aligned(64))); // sum of p, in 16 lanes
    float p[QB][BK] __attribute__((aligned(64)));    // the tile's p
    float max[QB];                                   // the running maxima (log2 units)
} block_state;

// acc += p·v for rows [r0, r0 + MR) over the tile's @p nk keys, @p v the first's value row.
TARGET static inline void add_pv(block_state *b, size_t r0, size_t nk, const float *v,
                                 size_t v_ld) {
    __m512 o[MR][HD / 16];
    UNROLL_ROWS
    for (int i = 0; i < MR; ++i) {
        UNROLL_4
        for (int c = 0; c < HD / 16; ++c) o[i][c] = _mm512_load_ps(b->acc[r0 + i] + 16 * c);
    }
    _Pragma("GCC unroll 2")
    for (size_t j = 0; j < nk; ++j) {
        const float *vr = v + j * v_ld;
        __m512 vv[HD / 16];
        UNROLL_4
        for (int c = 0; c < HD / 16; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
        UNROLL_ROWS
        for (int i = 0; i < MR; ++i) {
            __m512 x = _mm512_set1_ps(b->p[r0 + i][j]);
            UNROLL_4
            for (int c = 0; c < HD / 16; ++c) o[i][c] = _mm512_fmadd_ps(x, vv[c], o[i][c]);
        }
    }
    UNROLL_ROWS
    for (int i = 0; i < MR; ++i) {
        UNROLL_4
        for (int c = 0; c < HD / 16; ++c) _mm512_store_ps(b->acc[r0 + i] + 16 * c, o[i][c]);
    }
}

// The lanes of register @p c of a row's tile scores that hold one of its first @p have keys.
static inline __mmask16 lanes_of(size_t have, int c) {
    size_t from = 16 * (size_t)c, n = have > from ? have - from : 0;
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

// Micro-kernel rows [r0, r0 + MR) of block @p qs (rows of HD floats, scaled to log2 units)
// against key tile @p kt with @p nk keys (1..BK) and value rows @p v (v_ld apart). @p reach:
// with is_causal, how many of the tile's keys row r0 may see (row r0 + i: reach + i, clamped
// to 0..nk; negative where the tile starts past the row's last key); else nk.
TARGET static void tile_rows(block_state *b, const float *qs, size_t r0, const float *kt,
                             size_t nk, const float *v, size_t v_ld, ptrdiff_t reach) {
    __m512 sc[MR][KV];
    UNROLL_ROWS
    for (int i = 0; i < MR; ++i)
        UNROLL_4
        for (int c = 0; c < KV; ++c) sc[i][c] = _mm512_setzero_ps();
    const float *q0 = qs + r0 * HD;
    UNROLL_4
    for (int d = 0; d < HD; ++d) {
        __m512 kk[KV];
        UNROLL_4
        for (int c = 0; c < KV; ++c) kk[c] = _mm512_load_ps(kt + d * BK + 16 * c);
        UNROLL_ROWS
        for (int i = 0; i < MR; ++i) {
            __m512 x = _mm512_set1_ps(q0[i * HD + d]);
            UNROLL_4
            for (int c = 0; c < KV; ++c) sc[i][c] = _mm512_fmadd_ps(x, kk[c], sc[i][c]);
        }
    }
    // Lanes of keys past the tile's last, or past the row's last under is_causal: p 0.
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __mmask16 whole[KV];  // the tile's keys
    UNROLL_4
    for (int c = 0; c < KV; ++c) whole[c] = lanes_of(nk, c);
    UNROLL_ROWS
    for (int i = 0; i < MR; ++i) {
        size_t r = r0 + (size_t)i;
        ptrdiff_t sees = reach + i;
        __mmask16 valid[KV];
        UNROLL_4
        for (int c = 0; c < KV; ++c)
            valid[c] = sees >= (ptrdiff_t)nk ? whole[c] : lanes_of(sees > 0 ? (size_t)sees : 0, c);
        __m512 top = neg_inf;
        UNROLL_4
        for (int c = 0; c < KV; ++c) top = _mm512_mask_max_ps(top, valid[c], top, sc[i][c]);
        float tile_max = _mm512_reduce_max_ps(top);  // -inf where the row sees none
        float old = b->max[r], now = tile_max > old ? tile_max : old;
        // 0 at the first tile (old -inf); no call while the maximum holds (most tiles).
        float alpha = now > old ? exp2f(old - now) : 1.0f;
        b->max[r] = now;
        __m512 m = _mm512_set1_ps(now), sum = _mm512_setzero_ps();
        UNROLL_4
        for (int c = 0; c < KV; ++c) {
            __m512 e = _mm512_maskz_mov_ps(valid[c], exp2_nonpos(_mm512_sub_ps(sc[i][c], m)));
            _mm512_store_ps(b->p[r] + 16 * c, e);
            sum = _mm512_add_ps(sum, e);
        }
        __m512 s = _mm512_load_ps(b->sums[r]);
        if (alpha != 1.0f) {
            __m512 a = _mm512_set1_ps(alpha);
            s = _mm512_mul_ps(s, a);
            UNROLL_4
            for (int c = 0; c < HD; c += 16)
                _mm512_store_ps(b->acc[r] + c, _mm512_mul_ps(a, _mm512_load_ps(b->acc[r] + c)));
        }
        _mm512_store_ps(b->sums[r], _mm512_add_ps(s, sum));
    }
    ptrdiff_t last = reach + MR - 1;  // the last row's keys: at least 1 (run_block)
    add_pv(b, r0, last < (ptrdiff_t)nk ? (size_t)last : nk, v, v_ld);
}

// One block: query rows [row0, row0 + QB) of one (batch, head) (fewer at the end: the last row
// repeated, not stored). @p q, @p out and @p lse (NULL: none) are the head's row 0, @p kt and
// @p vp its keys and values packed.
TARGET static void run_block(const clmha__host_attention *p, const float *q, const float *kt,
                             const float *vp, float *out, float *lse, size_t row0,
                             const float *bq) {
    block_state b;
    float qs[QB * HD] __attribute__((aligned(64)));
    const float scale = p->scale * 1.4426950408889634f;  // log2(e): exp2 below
    for (size_t i = 0; i < QB; ++i) {
        size_t t = row0 + i < p->rows ? row0 + i : p->rows - 1;
        const float *row = q + t * p->q_at[3];
        for (size_t d = 0; d < HD; ++d) qs[i * HD + d] = (row[d] + (bq ? bq[d] : 0.0f)) * scale;
        b.max[i] = -INFINITY;
        for (size_t d = 0; d < HD; ++d) b.acc[i][d] = 0.0f;
        for (size_t c = 0; c < 16; ++c) b.sums[i][c] = 0.0f;
    }
    // Under is_causal row t sees t + 1 keys: the block's last row the most.
    size_t keys = p->keys, last_sees = row0 + QB;
    if (p->causal && last_sees < keys) keys = last_sees;
    for (size_t t0 = 0; t0 < keys; t0 += BK) {
        size_t nk = keys - t0 < BK ? keys - t0 : BK;
        for (size_t r0 = 0; r0 < QB; r0 += MR) {
            // Row r0's keys in this tile (negative: none).
            ptrdiff_t reach =
                !p->causal ? (ptrdiff_t)nk : (ptrdiff_t)(row0 + r0 + 1) - (ptrdiff_t)t0;
            if (reach + MR - 1 <= 0) continue;  // none of the MR rows sees a key here
            tile_rows(&b, qs, r0, kt + t0 * HD, nk, vp + t0 * HD, HD, reach);
        }
    }
    for (size_t i = 0; i < QB && row0 + i < p->rows; ++i) {
        float sum = _mm512_reduce_add_ps(_mm512_load_ps(b.sums[i])), inv = 1.0f / sum;
        float *o = out + (row0 + i) * p->o_at[3];
        for (size_t d = 0; d < HD; ++d) o[d] = b.acc[i][d] * inv;
        if (lse) {  // the maximum back from log2 units; no row is masked: sum >= 1
            float m = b.max[i] * 0.6931471805599453f, ls = logf(sum);
            lse[row0 + i] = m + ls;
            if (p->lse_split) {
                lse[p->lse_split + row0 + i] = m;
                lse[2 * p->lse_split + row0 + i] = ls;
            }
        }
    }
}

void clmha__host_attention_run(const clmha__host_attention *p, size_t t, size_t team) {
    size_t blocks = (p->rows + QB - 1) / QB, per_batch = p->heads * blocks;
    size_t total = p->batch * per_batch;
    // Items first, first + step, ... up to last: a run of its own, or under is_causal every
    // team-th item.
    size_t first = total / team * t + (t < total % team ? t : total % team);
    size_t last = first + total / team + (t < total % team ? 1 : 0), step = 1;
    if (p->causal) first = t, last = total, step = team;
    size_t per = clmha__host_attention_scratch(p->keys);
    float *kt = p->scratch + t * per, *vp = kt + per / 2;
    size_t packed = SIZE_MAX;  // the (batch, key/value head) whose keys and values are packed
    for (size_t w = first; w < last; w += step) {
        size_t n = w / per_batch, h = w % per_batch / blocks, blk = w % blocks;
        size_t g = h / p->kv_group, kv = n * p->heads + g;
        const float *bk = p->bk ? p->bk + g * HD : NULL, *bv = p->bv ? p->bv + g * HD : NULL;
        if (kv != packed) {
            pack_keys(p->k + p->k_at[0] + n * p->k_at[1] + g * p->k_at[2], p->k_at[3], p->keys,
                      bk, kt);
            pack_values(p->v + p->v_at[0] + n * p->v_at[1] + g * p->v_at[2], p->v_at[3],
                        p->keys, bv, vp);
            packed = kv;
        }
        run_block(p, p->q + p->q_at[0] + n * p->q_at[1] + h * p->q_at[2], kt, vp,
                  p->out + p->o_at[0] + n * p->o_at[1] + h * p->o_at[2],
                  p->lse ? p->lse + (n * p->heads + h) * p->rows : NULL, blk * QB,
                  p->bq ? p->bq + h * HD : NULL);
    }
}

#else

void clmha__host_attention_run(const clmha__host_attention *p, size_t t, size_t team) {
    (void)p;
    (void)t;
    (void)team;
}

#endif
