// Reshapes and reductions of the backward pass (host side: src/backward/backward.c), around
// the attention cores' backward kernels (cl/cores/*_backward.cl).
//
// Row order of a (sequence, batch) tensor: row(n, t) = batch_first ? n * T + t : t * N + n.
// Head-major tiles are (N*H, T_pad, D). merge_rows: one work-item per row and head;
// appended_row_sums: one per output element (the biases' column sums are GEMMs with a column of
// ones, src/backward/backward.c). Every sum runs in a fixed order (no atomics), so results are the same
// on every run.

// Merges the first `seq` rows of each plane of head tiles (N*H, seq_pad, D) into rows (rows, ld)
// from column col0, at element out_off of out, the `group` consecutive heads that repeat one
// key/value head (grouped-query attention; group 1 otherwise) summed:
// out[row(n, t), col0 + k*D + d] = sum over g < group of tiles[n*H + k*group + g, t, d].
// One work-item per (row, output head) handles that head's D floats (per-element work-items
// spent most of their time in 64-bit divisions).
kernel void merge_rows(global const REAL *tiles, ulong seq, ulong seq_pad, global REAL *out,
                       ulong out_off, ulong ld, ulong col0, ulong n_batch, ulong n_heads,
                       ulong group, ulong head_dim, uint batch_first) {
    ulong heads_out = n_heads / group;
    ulong gid = get_global_id(0);
    if (gid >= n_batch * seq * heads_out) return;
    ulong row = gid / heads_out, k = gid % heads_out;
    ulong n = batch_first ? row / seq : row % n_batch;
    ulong t = batch_first ? row % seq : row / n_batch;
    global const REAL *src = tiles + ((n * n_heads + k * group) * seq_pad + t) * head_dim;
    global REAL *dst = out + out_off + row * ld + col0 + k * head_dim;
    ulong plane = seq_pad * head_dim;
    for (ulong d = 0; d < head_dim; ++d) {
        REAL sum = src[d];
        for (ulong g = 1; g < group; ++g) sum += src[g * plane + d];
        dst[d] = sum;
    }
}

// The gradient of bias_k or bias_v, (1, 1, (H/group)*D): row `row` (= S) of every plane of the
// key or value tiles' gradient (N*H, seq_pad, D), summed over the batch and over the `group`
// heads that repeat one key/value head:
// out[k*D + d] (+)= sum over n, g of tiles[n*H + k*group + g, row, d].
kernel void appended_row_sums(global const REAL *tiles, ulong seq_pad, ulong row,
                              ulong n_batch, ulong n_heads, ulong group, ulong head_dim,
                              global REAL *out, ulong out_off, uint accumulate) {
    ulong c = get_global_id(0);
    if (c >= n_heads / group * head_dim) return;
    ulong k = c / head_dim, d = c % head_dim;
    REAL sum = (REAL)0;
    for (ulong n = 0; n < n_batch; ++n)
        for (ulong g = 0; g < group; ++g)
            sum += tiles[((n * n_heads + k * group + g) * seq_pad + row) * head_dim + d];
    out[out_off + c] = accumulate ? out[out_off + c] + sum : sum;
}

// The sinks' gradient (clmha_layer_desc::sinks): a sink is one more logit of each row with a
// zero value, so its score's gradient is P_sink (0 - D), P_sink = exp(sink - lse) (the rows'
// log-sum-exp include the sink) and D = dO.O (the identity the fused backward uses; with a
// weights' gradient the unfused backward's sum_j P dP rows instead, has_drow). One
// work-item per head h sums over the batch items n, then the rows i, in order, from the head
// tiles o and d_o (N*H, L, D) and lse (N*H*L, from lse_off):
//   out[out_off + h] (+)= -sum_{n,i} exp(sinks[sinks_off + h] - lse[.]) * (d_o . o)[n*H + h, i]
kernel void sinks_grad(global const REAL *o, global const REAL *d_o, global const REAL *lse,
                       ulong lse_off, global const REAL *drow, uint has_drow,
                       global const REAL *sinks, ulong sinks_off,
                       global REAL *out, ulong out_off, uint accumulate, ulong n_batch,
                       ulong n_heads, ulong tgt_len, ulong head_dim) {
    ulong h = get_global_id(0);
    if (h >= n_heads) return;
    REAL sink = sinks[sinks_off + h], sum = (REAL)0;
    for (ulong n = 0; n < n_batch; ++n) {
        ulong bh = n * n_heads + h;
        for (ulong i = 0; i < tgt_len; ++i) {
            global const REAL *a = o + (bh * tgt_len + i) * head_dim;
            global const REAL *b = d_o + (bh * tgt_len + i) * head_dim;
            REAL dot = (REAL)0;
            if (has_drow)
                dot = drow[bh * tgt_len + i];
            else
                for (ulong c = 0; c < head_dim; ++c) dot = fma(a[c], b[c], dot);
            REAL l = lse[lse_off + bh * tgt_len + i];
            if (l != -INFINITY) sum -= exp(sink - l) * dot;
        }
    }
    out[out_off + h] = accumulate ? out[out_off + h] + sum : sum;
}
