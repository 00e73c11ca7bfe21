// The fused core's backward pass (host side: src/cores/fused_backward.c), FlashAttention-2's
// algorithm: the probabilities are recomputed tile by tile from q, k and the log-sum-exp rows
// the forward kernel saved (cl/cores/fused.cl, lse_on), P = exp(score - lse), and never stored.
//
// Per batch*head plane, with S' keys (the appended bias_k and zero rows never masked) and
// scale = 1/sqrt(HD):
//   score = scale * q.k + masks, P = exp(score - lse), Pd = P * keep * keep_scale (dropout),
//   dPd = dO.v, dP = dPd * keep * keep_scale, Drow = sum_j P dP = dO.o,
//   dS = P * (dP - Drow), dq = scale * dS k, dk = scale * dS^T q, dv = Pd^T dO.
// Three kernels:
//   - fused_backward_drow: Drow = dO.o per query row (the rowsum(dO * O) identity, which saves
//     a pass over the keys);
//   - fused_backward_dkdv: one work-group per (plane, tile of B key rows), one key row per
//     work-item; it loops over the query tiles (q, dO, lse, Drow staged in local memory) and
//     accumulates its dk and dv rows in private memory, stored once;
//   - fused_backward_dq: one work-group per (plane, tile of B query rows), one query row per
//     work-item; it loops over the key tiles (k, v staged in local memory) and accumulates its dq
//     row in private memory, stored once.
// Each gradient element is thus a sum in one fixed order by one work-item: the result is the
// same on every run (no atomics).
//
// is_causal: key j > query i is masked for j < S. dkdv starts at the first query tile that has
// a row i >= the tile's first key when every key of its tile is a real one (j < S); dq skips the
// key tiles past its last row the same way, as the forward does.
//
// Build options: -DHD=<head dim> -DB=<work-group size = rows per tile> -DVW=<vector width: 1,
// 2, 4, 8 or 16, dividing HD>. Local memory per
// work-group: 2 * B * HD + 2 * B floats (dkdv), 2 * B * HD floats (dq); private: 4 * HD
// (dkdv) and 3 * HD (dq) floats per work-item.
// Needs cl/common.cl in front (mask kinds, mask_value, philox_word0).
//
// Layouts: q, o, dO, dq (N*H, L, HD); k, v, dk, dv (N*H, S', HD); lse, drow (N*H*L). Masks as
// the forward kernels take them. No early return and no divergent barrier: work-items past the
// last row compute on a clamped row and store nothing.

#ifndef HD
#define HD 64
#endif
#ifndef B
#define B 32
#endif
#ifndef VW
#define VW 1
#endif
// The inner products and row updates run on VW-wide vectors (VW divides HD): VT is floatVW,
// LOADV/STOREV read and write VW floats at element i of a private or local row. (A CPU driver
// maps them to its SIMD registers; scalar loops over HD it would only vectorise across
// work-items.)
#if VW == 1
#define VT float
#define LOADV(i, p) ((p)[(i)])
#define STOREV(v, i, p) ((p)[(i)] = (v))
inline float lanes_sum(float v) { return v; }
#else
#define VT_(n) float##n
#define VT__(n) VT_(n)
#define VT VT__(VW)
#define VLOAD_(n) vload##n
#define VLOAD__(n) VLOAD_(n)
#define VSTORE_(n) vstore##n
#define VSTORE__(n) VSTORE_(n)
#define LOADV(i, p) VLOAD__(VW)(0, (p) + (i))
#define STOREV(v, i, p) VSTORE__(VW)((v), 0, (p) + (i))
// The sum of the VW lanes of v, in lane order.
inline float lanes_sum(VT v) {
    float lane[VW];
    STOREV(v, 0, lane);
    float sum = 0.0f;
    for (uint i = 0; i < VW; ++i) sum += lane[i];
    return sum;
}
#endif

// The additive masks and is_causal of score (bh, i, j), j < src_len; attn_row is the start of
// row i of attn_mask for plane bh (already offset), kpm_row that of the batch item.
inline float masks_of(global const uchar *attn_mask, uint attn_kind, ulong attn_row,
                      global const uchar *kpm, uint kpm_kind, ulong kpm_row, uint causal,
                      ulong i, ulong j) {
    float x = mask_value(attn_mask, attn_kind, attn_row + j);
    x += mask_value(kpm, kpm_kind, kpm_row + j);
    return causal && j > i ? -INFINITY : x;
}

// Where row i of attn_mask starts for plane bh (layouts as in cl/common.cl), offset included.
inline ulong attn_row_of(uint attn_layout, ulong attn_off, ulong bh, ulong n, ulong i,
                         ulong tgt_len, ulong src_len) {
    ulong ar = 0;
    if (attn_layout == 1) ar = i * src_len;
    else if (attn_layout == 2) ar = (bh * tgt_len + i) * src_len;
    else if (attn_layout == 3) ar = (n * tgt_len + i) * src_len;
    return ar + attn_off;
}

// Drow[r] = dO[r].o[r] for every query row r of every plane (n_rows = N*H*L), summed over the
// head dimension in order.
kernel void fused_backward_drow(global const float *d_o, global const float *o,
                                global float *drow, ulong n_rows) {
    ulong r = get_global_id(0);
    if (r < n_rows) {
        global const float *a = d_o + r * HD;
        global const float *b = o + r * HD;
        float s = 0.0f;
        for (uint d = 0; d < HD; ++d) s = fma(a[d], b[d], s);
        drow[r] = s;
    }
}

// NDRange: (ceil(S' / B) * B, N*H) in groups of (B, 1).
kernel __attribute__((reqd_work_group_size(B, 1, 1)))
void fused_backward_dkdv(global const float *q, global const float *k, global const float *v,
                         global const float *d_o, global const float *lse,
                         global const float *drow, global float *dk, global float *dv,
                         ulong tgt_len, ulong n_heads, ulong src_len, ulong src_len_padded,
                         float scale,
                         global const uchar *attn_mask, ulong attn_off, uint attn_kind,
                         uint attn_layout,
                         global const uchar *kpm, ulong kpm_off, uint kpm_kind, uint causal,
                         uint dropout_on, uint dropout_threshold, float keep_scale,
                         uint seed_lo, uint seed_hi_xor_off_hi, uint offset_lo) {
    local float qs[B * HD];   // the query tile's rows
    local float dos[B * HD];  // the query tile's dO rows
    local float ls[B];        // their log-sum-exp (-inf: no probability, also past the end)
    local float ds[B];        // their Drow

    uint lid = get_local_id(0);
    ulong bh = get_group_id(1);
    ulong n = bh / n_heads;
    ulong j0 = get_group_id(0) * B;
    ulong j = j0 + lid;
    ulong jc = min(j, src_len_padded - 1);  // rows past the end compute on the last key
    ulong kpm_row = kpm_off + n * src_len;

    float kr[HD], vr[HD], dkr[HD], dvr[HD];
    global const float *kp = k + (bh * src_len_padded + jc) * HD;
    global const float *vp = v + (bh * src_len_padded + jc) * HD;
    for (uint d = 0; d < HD; ++d) {
        kr[d] = kp[d];
        vr[d] = vp[d];
        dkr[d] = 0.0f;
        dvr[d] = 0.0f;
    }

    // With is_causal and a tile of real keys only, the query tiles whose rows all come before
    // the tile's first key see only masked scores (P = 0): start at the tile holding row j0.
    ulong i_begin = causal && min(j0 + B, src_len_padded) <= src_len ? j0 / B * B : 0;
    global const float *qb = q + bh * tgt_len * HD;
    global const float *dob = d_o + bh * tgt_len * HD;
    for (ulong i0 = i_begin; i0 < tgt_len; i0 += B) {
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile is no longer read
        for (uint t = lid; t < B * HD; t += B) {
            ulong i = i0 + t / HD;
            bool in = i < tgt_len;
            qs[t] = in ? qb[i0 * HD + t] : 0.0f;
            dos[t] = in ? dob[i0 * HD + t] : 0.0f;
        }
        {
            ulong i = i0 + lid;
            bool in = i < tgt_len;
            ls[lid] = in ? lse[bh * tgt_len + i] : -INFINITY;
            ds[lid] = in ? drow[bh * tgt_len + i] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        uint rows = (uint)min((ulong)B, tgt_len - i0);  // the same for the whole group
        for (uint ii = 0; ii < rows; ++ii) {
            ulong i = i0 + ii;
            local const float *qi = qs + ii * HD;
            local const float *doi = dos + ii * HD;
            VT sv = (VT)(0.0f), dv_ = (VT)(0.0f);
            for (uint d = 0; d < HD; d += VW) {
                sv = fma(LOADV(d, qi), LOADV(d, kr), sv);
                dv_ = fma(LOADV(d, doi), LOADV(d, vr), dv_);
            }
            float s = lanes_sum(sv) * scale, dpd = lanes_sum(dv_);
            if (jc < src_len)
                s += masks_of(attn_mask, attn_kind,
                              attn_row_of(attn_layout, attn_off, bh, n, i, tgt_len, src_len),
                              kpm, kpm_kind, kpm_row, causal, i, jc);
            float l = ls[ii];
            // A fully masked row (lse = -inf) has no probabilities: 0, not exp(-inf + inf).
            float p = l == -INFINITY ? 0.0f : exp(s - l);
            float pd = p, dp = dpd;
            if (dropout_on) {
                uint w = philox_word0((uint)jc, (uint)i, (uint)bh, offset_lo, seed_lo,
                                      seed_hi_xor_off_hi);
                float f = w >= dropout_threshold ? keep_scale : 0.0f;
                pd = p * f;
                dp = dpd * f;
            }
            float dsv = p * (dp - ds[ii]);
            for (uint d = 0; d < HD; d += VW) {
                STOREV(fma((VT)(pd), LOADV(d, doi), LOADV(d, dvr)), d, dvr);
                STOREV(fma((VT)(dsv), LOADV(d, qi), LOADV(d, dkr)), d, dkr);
            }
        }
    }
    if (j < src_len_padded) {
        global float *dkp = dk + (bh * src_len_padded + j) * HD;
        global float *dvp = dv + (bh * src_len_padded + j) * HD;
        for (uint d = 0; d < HD; ++d) {
            dkp[d] = dkr[d] * scale;
            dvp[d] = dvr[d];
        }
    }
}

// NDRange: (ceil(L / B) * B, N*H) in groups of (B, 1).
kernel __attribute__((reqd_work_group_size(B, 1, 1)))
void fused_backward_dq(global const float *q, global const float *k, global const float *v,
                       global const float *d_o, global const float *lse,
                       global const float *drow, global float *dq,
                       ulong tgt_len, ulong n_heads, ulong src_len, ulong src_len_padded,
                       float scale,
                       global const uchar *attn_mask, ulong attn_off, uint attn_kind,
                       uint attn_layout,
                       global const uchar *kpm, ulong kpm_off, uint kpm_kind, uint causal,
                       uint dropout_on, uint dropout_threshold, float keep_scale,
                       uint seed_lo, uint seed_hi_xor_off_hi, uint offset_lo) {
    local float ks[B * HD];  // the key tile's rows
    local float vs[B * HD];  // the value tile's rows

    uint lid = get_local_id(0);
    ulong bh = get_group_id(1);
    ulong n = bh / n_heads;
    ulong i0 = get_group_id(0) * B;
    ulong last = min(i0 + B, tgt_len) - 1;  // the group's last real row
    ulong i = i0 + lid;
    ulong ic = min(i, last);
    ulong attn_row = attn_row_of(attn_layout, attn_off, bh, n, ic, tgt_len, src_len);
    ulong kpm_row = kpm_off + n * src_len;

    float qr[HD], dor[HD], dqr[HD];
    global const float *qp = q + (bh * tgt_len + ic) * HD;
    global const float *dop = d_o + (bh * tgt_len + ic) * HD;
    for (uint d = 0; d < HD; ++d) {
        qr[d] = qp[d];
        dor[d] = dop[d];
        dqr[d] = 0.0f;
    }
    float l = lse[bh * tgt_len + ic];
    float drow_i = drow[bh * tgt_len + ic];

    global const float *kb = k + bh * src_len_padded * HD;
    global const float *vb = v + bh * src_len_padded * HD;
    for (ulong j0 = 0; j0 < src_len_padded; j0 += B) {
        // With is_causal, a tile of masked keys only (all j > last, none appended) is skipped;
        // the condition is the same for the whole group, so the barriers stay uniform.
        bool skip = causal && j0 > last && j0 + B <= src_len;
        if (!skip) {
            barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile is no longer read
            for (uint t = lid; t < B * HD; t += B) {
                bool in = j0 + t / HD < src_len_padded;
                ks[t] = in ? kb[j0 * HD + t] : 0.0f;
                vs[t] = in ? vb[j0 * HD + t] : 0.0f;
            }
            barrier(CLK_LOCAL_MEM_FENCE);
            uint keys = (uint)min((ulong)B, src_len_padded - j0);
            for (uint jj = 0; jj < keys; ++jj) {
                ulong j = j0 + jj;
                local const float *kj = ks + jj * HD;
                local const float *vj = vs + jj * HD;
                VT sv = (VT)(0.0f), dv_ = (VT)(0.0f);
                for (uint d = 0; d < HD; d += VW) {
                    sv = fma(LOADV(d, qr), LOADV(d, kj), sv);
                    dv_ = fma(LOADV(d, dor), LOADV(d, vj), dv_);
                }
                float s = lanes_sum(sv) * scale, dpd = lanes_sum(dv_);
                if (j < src_len)
                    s += masks_of(attn_mask, attn_kind, attn_row, kpm, kpm_kind, kpm_row, causal,
                                  ic, j);
                float p = l == -INFINITY ? 0.0f : exp(s - l);
                float dp = dpd;
                if (dropout_on) {
                    uint w = philox_word0((uint)j, (uint)ic, (uint)bh, offset_lo, seed_lo,
                                          seed_hi_xor_off_hi);
                    dp = w >= dropout_threshold ? dpd * keep_scale : 0.0f;
                }
                float dsv = p * (dp - drow_i);
                for (uint d = 0; d < HD; d += VW)
                    STOREV(fma((VT)(dsv), LOADV(d, kj), LOADV(d, dqr)), d, dqr);
            }
        }
    }
    if (i < tgt_len) {
        global float *dqp = dq + (bh * tgt_len + i) * HD;
        for (uint d = 0; d < HD; ++d) dqp[d] = dqr[d] * scale;
    }
}
