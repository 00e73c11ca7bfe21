// Fused attention core: out = softmax(mask(Q*K^T*scale)) * V for every (batch, head), without
// storing the scores. Online softmax over tiles of keys (FlashAttention's recurrence): each
// work-item owns one query row, keeps its running maximum, running sum and a D-wide
// accumulator in private memory, and the work-group shares each tile of keys and values through
// local memory.
//
// Build options: -DHD=<head dim> -DBQ=<query rows per work-group = work-group size>
//                -DBK=<keys per tile>. Local memory: 2*HD*BK floats.
// Needs cl/common.cl in front (mask kinds, mask_value, philox_word0, max_nan).
//
// Layouts as the unfused path: q (N*H, L, HD), k and v (N*H, S', HD), out (N*H, L, HD); the
// masks cover the first S keys, the appended keys (add_bias_kv, add_zero_attn) are never
// masked. A query row whose every key is masked gives zeros, as in the unfused path. Dropout
// drops weight (bh, i, j) exactly where masked_softmax does (same Philox counter and key).
//
// NDRange: (ceil(L / BQ) * BQ, N*H) in groups of (BQ, 1). No early return and no divergent
// barrier: work-items past the last row compute on a clamped row and store nothing.

#ifndef HD
#define HD 64
#endif
#ifndef BQ
#define BQ 32
#endif
#ifndef BK
#define BK 64
#endif

// exp(x) for x <= 0 (the only arguments here: scores minus a running maximum), in plain
// arithmetic so that compilers vectorise the loops around it: exp(x) = 2^n * e^r with
// n = round(x / ln 2), |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (truncation
// error below 1e-8 relative, under float rounding).
// -inf and anything below -87 give 0; NaN stays NaN.
inline float exp_nonpos(float x) {
    float n = rint(x * 1.44269504088896341f);
    float r = fma(n, -0.693145751953125f, x);
    r = fma(n, -1.428606765330187045e-06f, r);
    float p = 1.0f / 5040.0f;
    p = fma(p, r, 1.0f / 720.0f);
    p = fma(p, r, 1.0f / 120.0f);
    p = fma(p, r, 1.0f / 24.0f);
    p = fma(p, r, 1.0f / 6.0f);
    p = fma(p, r, 0.5f);
    p = fma(p, r, 1.0f);
    p = fma(p, r, 1.0f);
    int e = (int)fmax(n, -126.0f) + 127;
    float y = p * as_float(e << 23);
    return x < -87.0f ? 0.0f : y;
}

kernel __attribute__((reqd_work_group_size(BQ, 1, 1)))
void fused_attention(global const float *q, global const float *k, global const float *v,
                     global float *out, ulong tgt_len, ulong n_heads, ulong src_len,
                     ulong src_len_padded, float scale,
                     global const uchar *attn_mask, ulong attn_off, uint attn_kind,
                     uint attn_layout,
                     global const uchar *kpm, ulong kpm_off, uint kpm_kind, uint causal,
                     uint dropout_on, uint dropout_threshold, float keep_scale,
                     uint seed_lo, uint seed_hi_xor_off_hi, uint offset_lo) {
    local float kt[HD][BK];  // the tile's keys, transposed
    local float vt[BK][HD];  // the tile's values

    uint lid = get_local_id(0);
    ulong bh = get_group_id(1);
    ulong n = bh / n_heads;
    ulong first = get_group_id(0) * BQ;
    ulong last = min(first + BQ, tgt_len) - 1;  // the group's last real row
    ulong i = first + lid;
    bool real = i < tgt_len;
    ulong row = real ? i : last;

    ulong attn_row = 0;
    if (attn_layout == 1) attn_row = row * src_len;
    else if (attn_layout == 2) attn_row = (bh * tgt_len + row) * src_len;
    else if (attn_layout == 3) attn_row = (n * tgt_len + row) * src_len;
    attn_row += attn_off;
    ulong kpm_row = kpm_off + n * src_len;

    float qr[HD], acc[HD];
    global const float *qp = q + (bh * tgt_len + row) * HD;
    for (uint d = 0; d < HD; ++d) {
        qr[d] = qp[d] * scale;
        acc[d] = 0.0f;
    }
    float m = -INFINITY;  // running maximum (NaN once a NaN score appears)
    float sum = 0.0f;     // running sum of exp(score - m)

    global const float *kb = k + bh * src_len_padded * HD;
    global const float *vb = v + bh * src_len_padded * HD;
    for (ulong j0 = 0; j0 < src_len_padded; j0 += BK) {
        // With is_causal, a tile of masked keys only (all j > last, none appended) is skipped.
        // The condition is the same for the whole group, so the barriers stay uniform.
        bool skip = causal && j0 > last && j0 + BK <= src_len;
        if (!skip) {
            barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile is no longer read
            for (uint t = lid; t < BK * HD; t += BQ) {
                uint jj = t / HD, d = t % HD;
                ulong j = j0 + jj;
                bool in = j < src_len_padded;
                kt[d][jj] = in ? kb[j * HD + d] : 0.0f;
                vt[jj][d] = in ? vb[j * HD + d] : 0.0f;
            }
            barrier(CLK_LOCAL_MEM_FENCE);

            float s[BK];
            for (uint jj = 0; jj < BK; ++jj) s[jj] = 0.0f;
            for (uint d = 0; d < HD; ++d) {
                float qd = qr[d];
                for (uint jj = 0; jj < BK; ++jj) s[jj] = fma(qd, kt[d][jj], s[jj]);
            }

            float tile_max = -INFINITY;
            for (uint jj = 0; jj < BK; ++jj) {
                ulong j = j0 + jj;
                float x = s[jj];
                if (j >= src_len_padded) {
                    x = -INFINITY;
                } else if (j < src_len) {
                    x += mask_value(attn_mask, attn_kind, attn_row + j);
                    x += mask_value(kpm, kpm_kind, kpm_row + j);
                    if (causal && j > row) x = -INFINITY;
                }
                s[jj] = x;
                tile_max = max_nan(tile_max, x);
            }

            float m_new = max_nan(m, tile_max);
            // While every key so far is masked (m_new = -inf) nothing is accumulated.
            bool none = m_new == -INFINITY;
            float base = none ? 0.0f : m_new;
            float corr = exp_nonpos(m - base);  // 0 on the first live tile (m = -inf)
            sum *= corr;
            for (uint d = 0; d < HD; ++d) acc[d] *= corr;
            for (uint jj = 0; jj < BK; ++jj) {
                float p = exp_nonpos(s[jj] - base);
                sum += p;
                if (dropout_on) {
                    uint w = philox_word0((uint)(j0 + jj), (uint)row, (uint)bh, offset_lo,
                                          seed_lo, seed_hi_xor_off_hi);
                    p = w >= dropout_threshold ? p * keep_scale : 0.0f;
                }
                s[jj] = p;
            }
            for (uint jj = 0; jj < BK; ++jj) {
                float p = s[jj];
                for (uint d = 0; d < HD; ++d) acc[d] = fma(p, vt[jj][d], acc[d]);
            }
            m = m_new;
        }
    }

    // A fully masked row (m = -inf) has sum 0 and gives zeros; NaN propagates.
    float inv = m == -INFINITY ? 0.0f : 1.0f / sum;
    if (real) {
        global float *op = out + (bh * tgt_len + i) * HD;
        for (uint d = 0; d < HD; ++d) op[d] = acc[d] * inv;
    }
}
