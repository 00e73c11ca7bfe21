// The unfused core's backward kernels (host side: src/cores/unfused_backward.c), between its
// batched GEMMs. The host has recomputed the probabilities P (N*H, L, S') with the forward's
// masked_softmax, dropout off, and dPd = dO V'^T (N*H, L, S') into a second buffer.
//
// Build options: -DWG=<work-group size of softmax_backward, a power of two>.
// Needs cl/common.cl in front (philox_word0).

#ifndef WG
#define WG 64
#endif

// Weights-gradient modes (the forward call's weights layout): none, per head (N*H, L, S'),
// averaged over the heads (N, L, S').
#define GW_NONE 0
#define GW_PER_HEAD 1
#define GW_AVERAGED 2

// One work-group per score row (bh, i): with f = keep * keep_scale the dropout factor of
// weight (bh, i, j) (1 without dropout), replayed exactly as masked_softmax drew it,
//   dPd_j += grad_weights (divided by H when they were averaged),
//   dP_j = dPd_j * f,  Drow = sum_j P_j dP_j,  dS_j = P_j (dP_j - Drow),  Pd_j = P_j * f;
// p holds P and receives Pd (for dV' = Pd^T dO), g holds dPd and receives dS. Drow is summed in
// a fixed order (each work-item's strided part in order, then a fixed tree), so the result is
// the same on every run. A fully masked row has P = 0: dS = 0 and Pd = 0.
kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void softmax_backward(global float *p, global float *g, global const float *grad_weights,
                      ulong gw_off, uint gw_mode, float inv_heads, ulong tgt_len, ulong n_heads,
                      ulong src_len_padded,
                      uint dropout_on, uint dropout_threshold, float keep_scale,
                      uint seed_lo, uint seed_hi_xor_off_hi, uint offset_lo) {
    local float red[WG];
    // No early return: the host launches exactly one work-group per row, and every work-item
    // reaches every barrier (PoCL 3.1 miscompiles uniform returns in kernels with barriers).
    uint lid = get_local_id(0);
    ulong row = get_group_id(0);
    ulong bh = row / tgt_len;
    ulong i = row % tgt_len;
    ulong n = bh / n_heads;
    global float *x = p + row * src_len_padded;
    global float *y = g + row * src_len_padded;
    global const float *gw = grad_weights + gw_off +
                             (gw_mode == GW_AVERAGED ? (n * tgt_len + i) : row) * src_len_padded;
    float gw_scale = gw_mode == GW_AVERAGED ? inv_heads : 1.0f;

    float acc = 0.0f;
    for (ulong j = lid; j < src_len_padded; j += WG) {
        float dp = y[j];
        if (gw_mode != GW_NONE) dp += gw[j] * gw_scale;
        if (dropout_on) {
            uint w = philox_word0((uint)j, (uint)i, (uint)bh, offset_lo, seed_lo,
                                  seed_hi_xor_off_hi);
            dp = w >= dropout_threshold ? dp * keep_scale : 0.0f;
        }
        y[j] = dp;
        acc = fma(x[j], dp, acc);
    }
    red[lid] = acc;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (lid < s) red[lid] += red[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float drow = red[0];

    for (ulong j = lid; j < src_len_padded; j += WG) {
        float pj = x[j];
        y[j] = pj * (y[j] - drow);
        if (dropout_on) {
            uint w = philox_word0((uint)j, (uint)i, (uint)bh, offset_lo, seed_lo,
                                  seed_hi_xor_off_hi);
            x[j] = w >= dropout_threshold ? pj * keep_scale : 0.0f;
        }
    }
}

// Mask-gradient layouts: attn_mask shared (L, S), per head (N*H, L, S), per batch item
// (N, L, S), per head shared by the batch items (H, L, S) (the forward's attn_layout values),
// key_padding_mask (N, S).
#define MG_SHARED 1
#define MG_PER_HEAD 2
#define MG_PER_BATCH 3
#define MG_PER_HEAD_SHARED 4
#define MG_KPM 5

// One work-item per mask element: the gradient of the scores dS (N*H, L, S') summed over the
// dimensions the mask is broadcast along (every plane for a shared mask, the heads of the item
// per batch, the batch items per head shared, the heads and query rows of the item for
// key_padding_mask), in a fixed order,
// written to out[out_off + e] or added to it (accumulate). Only the first S keys have a mask.
kernel void mask_grad(global const float *ds, global float *out, ulong out_off, ulong count,
                      uint mode, uint accumulate, ulong tgt_len, ulong n_heads, ulong n_planes,
                      ulong src_len, ulong src_len_padded) {
    ulong e = get_global_id(0);
    if (e < count) {
        ulong j = e % src_len, r = e / src_len;
        float sum = 0.0f;
        if (mode == MG_SHARED) {
            for (ulong bh = 0; bh < n_planes; ++bh)
                sum += ds[(bh * tgt_len + r) * src_len_padded + j];
        } else if (mode == MG_PER_HEAD) {
            sum = ds[r * src_len_padded + j];
        } else if (mode == MG_PER_BATCH) {
            ulong n = r / tgt_len, i = r % tgt_len;
            for (ulong h = 0; h < n_heads; ++h)
                sum += ds[((n * n_heads + h) * tgt_len + i) * src_len_padded + j];
        } else if (mode == MG_PER_HEAD_SHARED) {
            for (ulong bh = r / tgt_len; bh < n_planes; bh += n_heads)
                sum += ds[(bh * tgt_len + r % tgt_len) * src_len_padded + j];
        } else {
            for (ulong h = 0; h < n_heads; ++h) {
                global const float *plane = ds + (r * n_heads + h) * tgt_len * src_len_padded;
                for (ulong i = 0; i < tgt_len; ++i) sum += plane[i * src_len_padded + j];
            }
        }
        out[out_off + e] = accumulate ? out[out_off + e] + sum : sum;
    }
}
