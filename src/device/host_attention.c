// Attention of head dimension 64 on the CPU itself (device/host_attention.h).
#include "device/host_attention.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "base/checked.h"
#include "device/host_attention_kernels.h"

#define HD CLMHA__HA_HD
#define BK CLMHA__HA_BK
#define MR CLMHA__HA_MR
#define QB CLMHA__HA_QB

bool clmha__host_attention_avx2_only;

// The kernels this CPU runs: AVX-512 where it has it, else AVX2 with FMA; NULL: neither.
static const clmha__ha_kernels *kernels(void) {
#if CLMHA__HA_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && !clmha__host_attention_avx2_only)
        return &clmha__ha_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &clmha__ha_avx2;
#endif
    return NULL;
}

const char *clmha__host_attention_isa(void) {
    const clmha__ha_kernels *k = kernels();
    return k ? k->name : NULL;
}

bool clmha__host_attention_fits(size_t head_dim) { return head_dim == HD && kernels(); }

// The floats of the keys' transposed copy (as many again for the values').
static size_t packed_floats(size_t keys) { return (keys / BK + 1) * BK * HD; }

size_t clmha__host_attention_scratch(size_t keys, bool kpm) {
    size_t tiles = keys / BK + 1, floats, gathered;
    if (!clmha__mul3(tiles, 2 * BK, HD, &floats)) return 0;  // the keys transposed, the values
    if (!kpm) return floats;
    return clmha__mul3(keys, 2, HD, &gathered) && clmha__add(floats, gathered, &floats) ? floats
                                                                                        : 0;
}

// One block: query rows [row0, row0 + QB) of one (batch, head) (fewer at the end: the last row
// repeated, not stored). @p q, @p out and @p lse (NULL: none) are the head's row 0, @p kt and
// @p vp its @p keys keys and values packed (none: zero rows).
static void run_block(const clmha__ha_kernels *ks, const clmha__host_attention *p,
                      const float *q, const float *kt, const float *vp, size_t keys, float *out,
                      float *lse, size_t row0, const float *bq) {
    clmha__ha_block b;
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
    size_t last_sees = row0 + QB;
    if (p->causal && last_sees < keys) keys = last_sees;
    for (size_t t0 = 0; t0 < keys; t0 += BK) {
        size_t nk = keys - t0 < BK ? keys - t0 : BK;
        for (size_t r0 = 0; r0 < QB; r0 += MR) {
            // Row r0's keys in this tile (negative: none).
            ptrdiff_t reach =
                !p->causal ? (ptrdiff_t)nk : (ptrdiff_t)(row0 + r0 + 1) - (ptrdiff_t)t0;
            if (reach + MR - 1 <= 0) continue;  // none of the MR rows sees a key here
            ks->tile_rows(&b, qs, r0, kt + t0 * HD, nk, vp + t0 * HD, HD, reach);
        }
    }
    for (size_t i = 0; i < QB && row0 + i < p->rows; ++i) {
        float sum = 0.0f;
        for (size_t c = 0; c < 16; ++c) sum += b.sums[i][c];
        bool dead = keys == 0;  // else sum >= 1 (the maximum's own p)
        float inv = dead ? 0.0f : 1.0f / sum;
        float *o = out + (row0 + i) * p->o_at[3];
        for (size_t d = 0; d < HD; ++d) o[d] = b.acc[i][d] * inv;
        if (lse) {  // the maximum back from log2 units
            float m = dead ? -INFINITY : b.max[i] * 0.6931471805599453f;
            float ls = dead ? 0.0f : logf(sum);
            lse[row0 + i] = dead ? -INFINITY : m + ls;
            if (p->lse_split) {
                lse[p->lse_split + row0 + i] = m;
                lse[2 * p->lse_split + row0 + i] = ls;
            }
        }
    }
}

// Packs the keys and values of (batch @p n, key/value head @p g) into @p kt and @p vp; with a
// key_padding_mask, the kept ones only, first gathered behind the values' copy. Returns how
// many.
static size_t pack(const clmha__ha_kernels *ks, const clmha__host_attention *p, size_t n,
                   size_t g, const float *bk, const float *bv, float *kt, float *vp) {
    const float *k = p->k + p->k_at[0] + n * p->k_at[1] + g * p->k_at[2];
    const float *v = p->v + p->v_at[0] + n * p->v_at[1] + g * p->v_at[2];
    size_t k_ld = p->k_at[3], v_ld = p->v_at[3], keys = p->keys;
    if (p->kpm) {
        const unsigned char *m = p->kpm + n * p->kpm_ld;
        float *gk = vp + packed_floats(p->keys), *gv = gk + p->keys * HD;
        keys = 0;
        for (size_t j = 0; j < p->keys; ++j) {
            if ((m[j] != 0) != p->kpm_attend) continue;  // left out
            for (size_t d = 0; d < HD; ++d) {
                gk[keys * HD + d] = k[j * k_ld + d];
                gv[keys * HD + d] = v[j * v_ld + d];
            }
            ++keys;
        }
        k = gk, v = gv, k_ld = v_ld = HD;
    }
    if (keys) {
        ks->pack_keys(k, k_ld, keys, bk, kt);
        ks->pack_values(v, v_ld, keys, bv, vp);
    }
    return keys;
}

void clmha__host_attention_run(const clmha__host_attention *p, size_t t, size_t team) {
    const clmha__ha_kernels *ks = kernels();
    if (!ks) return;  // (clmha__host_attention_fits() said no: never called)
    size_t blocks = (p->rows + QB - 1) / QB, per_batch = p->heads * blocks;
    size_t total = p->batch * per_batch;
    // Items first, first + step, ... up to last: a run of its own, or under is_causal every
    // team-th item.
    size_t first = total / team * t + (t < total % team ? t : total % team);
    size_t last = first + total / team + (t < total % team ? 1 : 0), step = 1;
    if (p->causal) first = t, last = total, step = team;
    float *kt = p->scratch + t * clmha__host_attention_scratch(p->keys, p->kpm != NULL);
    float *vp = kt + packed_floats(p->keys);
    size_t packed = SIZE_MAX;  // the (batch, key/value head) whose keys and values are packed
    size_t keys = 0;           // how many
    for (size_t w = first; w < last; w += step) {
        size_t n = w / per_batch, h = w % per_batch / blocks, blk = w % blocks;
        size_t g = h / p->kv_group, kv = n * p->heads + g;
        const float *bk = p->bk ? p->bk + g * HD : NULL, *bv = p->bv ? p->bv + g * HD : NULL;
        if (kv != packed) {
            keys = pack(ks, p, n, g, bk, bv, kt, vp);
            packed = kv;
        }
        run_block(ks, p, p->q + p->q_at[0] + n * p->q_at[1] + h * p->q_at[2], kt, vp, keys,
                  p->out + p->o_at[0] + n * p->o_at[1] + h * p->o_at[2],
                  p->lse ? p->lse + (n * p->heads + h) * p->rows : NULL, blk * QB,
                  p->bq ? p->bq + h * HD : NULL);
    }
}

