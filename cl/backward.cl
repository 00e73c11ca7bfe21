// Reshapes and reductions of the backward pass (host side: src/backward/backward.c), around
// the attention cores' backward kernels (cl/cores/*_backward.cl).
//
// Row order of a (sequence, batch) tensor: row(n, t) = batch_first ? n * T + t : t * N + n.
// Head-major tiles are (N*H, T_pad, D). merge_rows: one work-item per row and head;
// appended_row_sums: one per output element (the biases' column sums are GEMMs with a column of
// ones, src/backward/backward.c). Every sum runs in a fixed order (no atomics), so results are the same
// on every run.

// Merges the first `seq` rows of each plane of head tiles (N*H, seq_pad, D) into rows (rows, ld)
// from column col0, at element out_off of out: out[row(n, t), col0 + h*D + d] =
// tiles[n*H + h, t, d]. One work-item per (row, head) copies that head's D floats (per-element
// work-items spent most of their time in 64-bit divisions).
kernel void merge_rows(global const float *tiles, ulong seq, ulong seq_pad, global float *out,
                       ulong out_off, ulong ld, ulong col0, ulong n_batch, ulong n_heads,
                       ulong head_dim, uint batch_first) {
    ulong gid = get_global_id(0);
    if (gid >= n_batch * seq * n_heads) return;
    ulong row = gid / n_heads, h = gid % n_heads;
    ulong n = batch_first ? row / seq : row % n_batch;
    ulong t = batch_first ? row % seq : row / n_batch;
    global const float *src = tiles + ((n * n_heads + h) * seq_pad + t) * head_dim;
    global float *dst = out + out_off + row * ld + col0 + h * head_dim;
    for (ulong d = 0; d < head_dim; ++d) dst[d] = src[d];
}

// The gradient of bias_k or bias_v, (1, 1, E): row `row` (= S) of every plane of the key or
// value tiles' gradient (N*H, seq_pad, D), summed over the batch:
// out[h*D + d] (+)= sum over n of tiles[n*H + h, row, d].
kernel void appended_row_sums(global const float *tiles, ulong seq_pad, ulong row,
                              ulong n_batch, ulong n_heads, ulong head_dim, global float *out,
                              ulong out_off, uint accumulate) {
    ulong c = get_global_id(0);
    if (c >= n_heads * head_dim) return;
    ulong h = c / head_dim, d = c % head_dim;
    float sum = 0.0f;
    for (ulong n = 0; n < n_batch; ++n)
        sum += tiles[((n * n_heads + h) * seq_pad + row) * head_dim + d];
    out[out_off + c] = accumulate ? out[out_off + c] + sum : sum;
}
