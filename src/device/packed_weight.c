// A projection weight packed once for the host path's products (device/packed_weight.h).
#include "device/packed_weight.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/checked.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PACKED_KERNEL 1
#include <immintrin.h>
#else
#define PACKED_KERNEL 0
#endif

#define PANEL CLMHA__PACKED_PANEL
#define MR 6     // rows of A per micro-kernel: 12 accumulators of 16 floats
#define KC 128   // k per block: a panel's block is 16 KiB, half an L1
#define MC 192   // rows of A per block: 96 KiB of A's k block, in L2

static bool cpu_has_kernel(void) {
#if PACKED_KERNEL
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
#else
    return false;
#endif
}

clmha__packed_weight *clmha__packed_weight_new(size_t rows, size_t k) {
    size_t panels = (rows + PANEL - 1) / PANEL, floats, bytes;
    if (!cpu_has_kernel() || !rows || !k || !clmha__mul3(panels, k, PANEL, &floats) ||
        !clmha__mul(floats, sizeof(float), &bytes))
        return NULL;
    clmha__packed_weight *w = malloc(sizeof *w);
    if (!w) return NULL;
    // (bytes is a multiple of 128: 32 floats a row of a panel, as aligned_alloc wants)
    w->panels = aligned_alloc(64, bytes);
    if (!w->panels) {
        free(w);
        return NULL;
    }
    memset(w->panels, 0, bytes);
    w->rows = rows;
    w->k = k;
    return w;
}

void clmha__packed_weight_free(clmha__packed_weight *w) {
    if (!w) return;
    free(w->panels);
    free(w);
}

void clmha__packed_weight_write(clmha__packed_weight *w, size_t first, size_t count,
                                const float *src) {
    for (size_t r = 0; r < count; ++r) {
        size_t row = first + r;
        float *to = w->panels + row / PANEL * w->k * PANEL + row % PANEL;
        const float *from = src + r * w->k;
        for (size_t p = 0; p < w->k; ++p) to[p * PANEL] = from[p];
    }
}

bool clmha__packed_weight_fits(const clmha__packed_weight *w, size_t first, size_t n,
                               size_t k) {
    return w && k == w->k && first % PANEL == 0 && first <= w->rows && n <= w->rows - first;
}

#if PACKED_KERNEL

#define TARGET __attribute__((target("avx512f")))
// The rows' loop unrolled whole (at -O2 GCC would keep the accumulators in memory), the k loop
// twice.
#define UNROLL _Pragma("GCC unroll 6")
#define UNROLL_K _Pragma("GCC unroll 2")

// Rows [0, mr) × the panel's columns [0, cols) of C: the products over @p kc values of k summed
// from zero, then added to C's partial sums of the k before (or, at the first block, @p start,
// to the bias and, when @p accumulate, to C's values): oneDNN's order, in shorter blocks.
// @p mr constant after inlining, so the accumulators stay in registers.
static inline __attribute__((always_inline)) TARGET void micro(
    int mr, const float *a, size_t lda, const float *panel, size_t kc, float *c, size_t ldc,
    int cols, bool start, const float *bias, bool accumulate) {
    __mmask16 m0 = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
    __mmask16 m1 = (__mmask16)(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1);
    __m512 acc[MR][2];
    UNROLL
    for (int i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    UNROLL_K
    for (size_t p = 0; p < kc; ++p) {
        __m512 w0 = _mm512_load_ps(panel + p * PANEL), w1 = _mm512_load_ps(panel + p * PANEL + 16);
        UNROLL
        for (int i = 0; i < mr; ++i) {
            __m512 x = _mm512_set1_ps(a[i * lda + p]);
            acc[i][0] = _mm512_fmadd_ps(x, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, w1, acc[i][1]);
        }
    }
    bool add_bias = start && bias, add_c = !start || accumulate;
    __m512 b0 = add_bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    __m512 b1 = add_bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    UNROLL
    for (int i = 0; i < mr; ++i) {
        __m512 v0 = acc[i][0], v1 = acc[i][1];
        if (add_bias) {
            v0 = _mm512_add_ps(v0, b0);
            v1 = _mm512_add_ps(v1, b1);
        }
        if (add_c) {
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c + i * ldc), v0);
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, c + i * ldc + 16), v1);
        }
        _mm512_mask_storeu_ps(c + i * ldc, m0, v0);
        _mm512_mask_storeu_ps(c + i * ldc + 16, m1, v1);
    }
}

// micro() for @p mr rows, 1 to MR, each a constant.
static TARGET void tile(int mr, const float *a, size_t lda, const float *panel, size_t kc,
                        float *c, size_t ldc, int cols, bool start, const float *bias,
                        bool accumulate) {
    switch (mr) {
    case 6: micro(6, a, lda, panel, kc, c, ldc, cols, start, bias, accumulate); break;
    case 5: micro(5, a, lda, panel, kc, c, ldc, cols, start, bias, accumulate); break;
    case 4: micro(4, a, lda, panel, kc, c, ldc, cols, start, bias, accumulate); break;
    case 3: micro(3, a, lda, panel, kc, c, ldc, cols, start, bias, accumulate); break;
    case 2: micro(2, a, lda, panel, kc, c, ldc, cols, start, bias, accumulate); break;
    default: micro(1, a, lda, panel, kc, c, ldc, cols, start, bias, accumulate); break;
    }
}

static TARGET void gemm(const clmha__packed_weight *w, size_t first, size_t m, size_t n,
                        const float *a, size_t lda, float *c, size_t ldc, const float *bias,
                        bool accumulate, size_t c0, size_t c1) {
    size_t k = w->k;
    for (size_t i0 = 0; i0 < m; i0 += MC) {
        size_t i1 = i0 + MC < m ? i0 + MC : m;
        for (size_t p0 = 0; p0 < k; p0 += KC) {
            size_t kc = p0 + KC < k ? KC : k - p0;
            for (size_t j = c0; j < c1 && j < n; j += PANEL) {
                const float *panel = w->panels + (first + j) / PANEL * k * PANEL + p0 * PANEL;
                size_t left = (c1 < n ? c1 : n) - j;
                int cols = left < PANEL ? (int)left : PANEL;
                for (size_t i = i0; i < i1; i += MR) {
                    int mr = i1 - i < MR ? (int)(i1 - i) : MR;
                    tile(mr, a + i * lda + p0, lda, panel, kc, c + i * ldc + j, ldc, cols,
                         p0 == 0, bias ? bias + j : NULL, accumulate);
                }
            }
        }
    }
}

#endif

void clmha__packed_weight_gemm(const clmha__packed_weight *w, size_t first, size_t m, size_t n,
                               const float *a, size_t lda, float *c, size_t ldc,
                               const float *bias, bool accumulate, size_t c0, size_t c1) {
#if PACKED_KERNEL
    gemm(w, first, m, n, a, lda, c, ldc, bias, accumulate, c0, c1);
#else
    (void)w, (void)first, (void)m, (void)n, (void)a, (void)lda, (void)c, (void)ldc, (void)bias,
        (void)accumulate, (void)c0, (void)c1;
#endif
}
