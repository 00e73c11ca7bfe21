// The host attention kernel's AVX-512 parts (device/host_attention_kernels.h): keys
// transposed in 16 × 16 blocks in registers, and per 6 rows of a block the tile's scores
// (6 × 64: 24 accumulators over the 64 dimensions), masked lanes past a row's last key, then
// acc += p·v (6 rows × 64 columns: 24 accumulators over the tile's values).
#include "device/host_attention_kernels.h"

#if CLMHA__HA_X86

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define HD CLMHA__HA_HD
#define BK CLMHA__HA_BK
#define MR CLMHA__HA_MR
#define KV (BK / 16)  // AVX-512 registers of a tile's scores per row

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

// clmha__ha_kernels::pack_keys: 16 × 16 blocks transposed in registers.
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

// clmha__ha_kernels::pack_values.
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

// acc += p·v for rows [r0, r0 + MR) over the tile's @p nk keys, @p v the first's value row.
TARGET static inline void add_pv(clmha__ha_block *b, size_t r0, size_t nk, const float *v,
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

// clmha__ha_kernels::tile_rows: all of the tile's 64 scores of a row in 4 registers.
TARGET static void tile_rows(clmha__ha_block *b, const float *qs, size_t r0, const float *kt,
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

const clmha__ha_kernels clmha__ha_avx512 = {"AVX-512", pack_keys, pack_values, tile_rows};

#endif
