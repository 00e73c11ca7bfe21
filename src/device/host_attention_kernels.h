// The instruction-set parts of the host attention kernel (device/host_attention.h): the copies
// of the keys and values and the micro-kernel over one key tile, once in AVX-512
// (host_attention_avx512.c) and once in AVX2 with FMA (host_attention_avx2.c). The rest (which
// set runs, the items of a thread, a block's rows scaled, its results stored) is
// host_attention.c's, the same for both.
#ifndef CLMHA_DEVICE_HOST_ATTENTION_KERNELS_H
#define CLMHA_DEVICE_HOST_ATTENTION_KERNELS_H

#include <stddef.h>

#include "base/defs.h"
#include "device/host_attention.h"

#define CLMHA__HA_HD CLMHA__HOST_ATTENTION_HD
#define CLMHA__HA_BK 64                  // keys per tile: 64 × 64 transposed floats, 16 KiB
#define CLMHA__HA_MR 6                   // rows per micro-kernel
#define CLMHA__HA_QB (2 * CLMHA__HA_MR)  // rows per block: two micro-kernels

// The running state of a block's rows.
typedef struct clmha__ha_block {
    float acc[CLMHA__HA_QB][CLMHA__HA_HD] __attribute__((aligned(64)));  // sum of p·v
    // Sum of p, in lanes (16 with AVX-512, 8 with AVX2; the rest stay 0).
    float sums[CLMHA__HA_QB][16] __attribute__((aligned(64)));
    float p[CLMHA__HA_QB][CLMHA__HA_BK] __attribute__((aligned(64)));  // the tile's p
    float max[CLMHA__HA_QB];  // the running maxima (log2 units)
} clmha__ha_block;

typedef struct clmha__ha_kernels {
    const char *name;  // "AVX-512", "AVX2"
    // The keys of one (batch, key/value head), @p k its key 0 (rows k_ld apart), transposed
    // into tiles: kt[tile][d][j] = k[tile·BK + j][d] + bk[d] (@p bk NULL: 0), zero past the
    // last key.
    void (*pack_keys)(const float *k, size_t k_ld, size_t keys, const float *bk, float *kt);
    // The values of one (batch, key/value head), @p v its key 0's (rows v_ld apart), copied
    // contiguous: vp[j][d] = v[j][d] + bv[d].
    void (*pack_values)(const float *v, size_t v_ld, size_t keys, const float *bv, float *vp);
    // Rows [r0, r0 + MR) of block @p b (@p qs its rows of HD floats, scaled to log2 units)
    // against key tile @p kt with @p nk keys (1..BK) and value rows @p v (v_ld apart): the
    // scores, the maxima, p = 2^(score − max), the sums and acc rescaled when a maximum grows,
    // then acc += p·v. @p reach: with is_causal, how many of the tile's keys row r0 may see
    // (row r0 + i: reach + i, clamped to 0..nk; negative where the tile starts past the row's
    // last key); else nk. The caller calls only where row r0 + MR − 1 sees a key.
    void (*tile_rows)(clmha__ha_block *b, const float *qs, size_t r0, const float *kt,
                      size_t nk, const float *v, size_t v_ld, ptrdiff_t reach);
} clmha__ha_kernels;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CLMHA__HA_X86 1
CLMHA__HIDDEN extern const clmha__ha_kernels clmha__ha_avx512, clmha__ha_avx2;
#else
#define CLMHA__HA_X86 0
#endif

#endif
