// The host attention kernel's AVX2 parts, for CPUs with AVX2 and FMA but no AVX-512
// (device/host_attention_kernels.h). Sixteen 8-float registers hold less than AVX-512's
// thirty-two of 16, so the tile's work is cut smaller: keys transposed in 8 × 8 blocks; per 6
// rows the scores in slices of 16 keys (12 accumulators over the 64 dimensions, stored to the
// block's p), the maxima and p = 2^(score − max) from there, then acc += p·v in slices of 16
// columns (12 accumulators over the tile's values, acc loaded and stored around each slice).
// Lanes past a row's last key get p = 0 by a mask of compares (AVX2 has no mask registers).
#include "device/host_attention_kernels.h"

#if CLMHA__HA_X86

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define HD CLMHA__HA_HD
#define BK CLMHA__HA_BK
#define MR CLMHA__HA_MR

#define TARGET __attribute__((target("avx2,fma")))
#define UNROLL_ROWS _Pragma("GCC unroll 6")
#define UNROLL_4 _Pragma("GCC unroll 4")

// 2^x for x <= 0: x = n + r, r in [-1/2, 1/2], 2^r by the AVX-512 kernel's polynomial, times
// 2^n built in the exponent bits; x below -126 gives 2^-126 (a sum of such terms is at least 1).
TARGET static inline __m256 exp2_nonpos(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Rows r[0..7] of 8 floats transposed in registers: r[d] becomes the 8 rows' element d.
TARGET static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4h + c]: rows 4h..4h+3 of element c (low half) and c + 4 (high half).
    for (int h = 0; h < 2; ++h) {
        u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
        u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
        u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
        u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
        r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}

// clmha__ha_kernels::pack_keys: 8 × 8 blocks transposed in registers.
TARGET static void pack_keys(const float *k, size_t k_ld, size_t keys, const float *bk,
                             float *kt) {
    for (size_t j0 = 0; j0 < keys; j0 += 8) {
        float *to = kt + j0 / BK * BK * HD + j0 % BK;
        for (size_t d0 = 0; d0 < HD; d0 += 8) {
            __m256 r[8], b = bk ? _mm256_loadu_ps(bk + d0) : _mm256_setzero_ps();
            for (size_t j = 0; j < 8; ++j)
                r[j] = j0 + j < keys ? _mm256_add_ps(_mm256_loadu_ps(k + (j0 + j) * k_ld + d0), b)
                                     : _mm256_setzero_ps();
            transpose8(r);
            for (size_t d = 0; d < 8; ++d) _mm256_store_ps(to + (d0 + d) * BK, r[d]);
        }
    }
    // The rest of a partial last tile: zero.
    for (size_t j0 = (keys + 7) / 8 * 8; j0 % BK; j0 += 8)
        for (size_t d = 0; d < HD; ++d)
            _mm256_store_ps(kt + j0 / BK * BK * HD + d * BK + j0 % BK, _mm256_setzero_ps());
}

// clmha__ha_kernels::pack_values.
TARGET static void pack_values(const float *v, size_t v_ld, size_t keys, const float *bv,
                               float *vp) {
    __m256 b[HD / 8];
    for (int c = 0; c < HD / 8; ++c)
        b[c] = bv ? _mm256_loadu_ps(bv + 8 * c) : _mm256_setzero_ps();
    for (size_t j = 0; j < keys; ++j)
        for (int c = 0; c < HD / 8; ++c)
            _mm256_store_ps(vp + j * HD + 8 * c,
                            _mm256_add_ps(_mm256_loadu_ps(v + j * v_ld + 8 * c), b[c]));
}

// The scores of rows [r0, r0 + MR) (@p q0 row r0's scaled query) against the tile's keys
// [j0, j0 + 16) (@p kt the tile), into the block's p.
TARGET static inline void scores_16(clmha__ha_block *b, const float *q0, size_t r0,
                                    const float *kt, size_t j0) {
    __m256 s[MR][2];
    UNROLL_ROWS
    for (int i = 0; i < MR; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
    UNROLL_4
    for (int d = 0; d < HD; ++d) {
        __m256 k0 = _mm256_load_ps(kt + d * BK + j0), k1 = _mm256_load_ps(kt + d * BK + j0 + 8);
        UNROLL_ROWS
        for (int i = 0; i < MR; ++i) {
            __m256 x = _mm256_broadcast_ss(q0 + i * HD + d);
            s[i][0] = _mm256_fmadd_ps(x, k0, s[i][0]);
            s[i][1] = _mm256_fmadd_ps(x, k1, s[i][1]);
        }
    }
    UNROLL_ROWS
    for (int i = 0; i < MR; ++i) {
        _mm256_store_ps(b->p[r0 + i] + j0, s[i][0]);
        _mm256_store_ps(b->p[r0 + i] + j0 + 8, s[i][1]);
    }
}

// acc += p·v for rows [r0, r0 + MR) over the tile's @p nk keys, @p v the first's value row:
// columns [c0, c0 + 16).
TARGET static inline void add_pv_16(clmha__ha_block *b, size_t r0, size_t nk, const float *v,
                                    size_t v_ld, size_t c0) {
    __m256 o[MR][2];
    UNROLL_ROWS
    for (int i = 0; i < MR; ++i) {
        o[i][0] = _mm256_load_ps(b->acc[r0 + i] + c0);
        o[i][1] = _mm256_load_ps(b->acc[r0 + i] + c0 + 8);
    }
    _Pragma("GCC unroll 2")
    for (size_t j = 0; j < nk; ++j) {
        __m256 v0 = _mm256_loadu_ps(v + j * v_ld + c0), v1 = _mm256_loadu_ps(v + j * v_ld + c0 + 8);
        UNROLL_ROWS
        for (int i = 0; i < MR; ++i) {
            __m256 x = _mm256_broadcast_ss(b->p[r0 + i] + j);
            o[i][0] = _mm256_fmadd_ps(x, v0, o[i][0]);
            o[i][1] = _mm256_fmadd_ps(x, v1, o[i][1]);
        }
    }
    UNROLL_ROWS
    for (int i = 0; i < MR; ++i) {
        _mm256_store_ps(b->acc[r0 + i] + c0, o[i][0]);
        _mm256_store_ps(b->acc[r0 + i] + c0 + 8, o[i][1]);
    }
}

// The largest of @p x's 8 lanes.
TARGET static inline float max8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// Row r of the block after its scores of the tile's first @p regs × 8 keys are in p, of which
// it sees the first @p sees: the maximum, p = 2^(score − max) (0 past the row's last key), the
// sum and acc rescaled when the maximum grows.
TARGET static inline void softmax_row(clmha__ha_block *b, size_t r, size_t regs, size_t sees) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    __m256 valid[BK / 8], top = neg_inf;
    for (size_t c = 0; c < regs; ++c) {
        int left = (int)sees - 8 * (int)c;  // this register's keys the row sees (any sign)
        valid[c] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane));
        top = _mm256_max_ps(top, _mm256_blendv_ps(neg_inf, _mm256_load_ps(b->p[r] + 8 * c),
                                                  valid[c]));
    }
    float tile_max = max8(top);  // -inf where the row sees none
    float old = b->max[r], now = tile_max > old ? tile_max : old;
    // 0 at the first tile (old -inf); no call while the maximum holds (most tiles).
    float alpha = now > old ? exp2f(old - now) : 1.0f;
    b->max[r] = now;
    __m256 m = _mm256_set1_ps(now), sum = _mm256_setzero_ps();
    for (size_t c = 0; c < regs; ++c) {
        __m256 x = _mm256_load_ps(b->p[r] + 8 * c);
        __m256 e = _mm256_and_ps(valid[c], exp2_nonpos(_mm256_sub_ps(x, m)));
        _mm256_store_ps(b->p[r] + 8 * c, e);
        sum = _mm256_add_ps(sum, e);
    }
    __m256 s = _mm256_load_ps(b->sums[r]);
    if (alpha != 1.0f) {
        __m256 a = _mm256_set1_ps(alpha);
        s = _mm256_mul_ps(s, a);
        UNROLL_4
        for (int c = 0; c < HD; c += 8)
            _mm256_store_ps(b->acc[r] + c, _mm256_mul_ps(a, _mm256_load_ps(b->acc[r] + c)));
    }
    _mm256_store_ps(b->sums[r], _mm256_add_ps(s, sum));
}

// clmha__ha_kernels::tile_rows: only the keys the last of the rows sees are computed on.
TARGET static void tile_rows(clmha__ha_block *b, const float *qs, size_t r0, const float *kt,
                             size_t nk, const float *v, size_t v_ld, ptrdiff_t reach) {
    ptrdiff_t last = reach + MR - 1;  // the last row's keys: at least 1 (the caller's rule)
    size_t seen = last < (ptrdiff_t)nk ? (size_t)last : nk;
    const float *q0 = qs + r0 * HD;
    for (size_t j0 = 0; j0 < seen; j0 += 16) scores_16(b, q0, r0, kt, j0);
    size_t regs = (seen + 7) / 8;
    for (int i = 0; i < MR; ++i) {
        ptrdiff_t sees = reach + i;
        softmax_row(b, r0 + (size_t)i, regs,
                    sees <= 0 ? 0 : sees >= (ptrdiff_t)seen ? seen : (size_t)sees);
    }
    for (size_t c0 = 0; c0 < HD; c0 += 16) add_pv_16(b, r0, seen, v, v_ld, c0);
}

const clmha__ha_kernels clmha__ha_avx2 = {"AVX2", pack_keys, pack_values, tile_rows};

#endif
