// Head reshapes around the attention core: split projected rows into per-head tiles, merge
// them back, broadcast a bias over rows, and average weights over heads.
//
// Row order of a (sequence, batch) tensor: row(n, t) = batch_first ? n * T + t : t * N + n.
// Head-major tiles are (N*H, T, D): element ((n * H + h) * T + t) * D + d.
// Every kernel guards the tail, so any global size rounded up to the work-group size is safe.
// All are 1-D (over output rows or elements) but split/merge in their coalesced mapping (3-D).

#ifdef CLMHA_FORCE_BUILD_ERROR
#error "build failure forced by the test hook clmha__test_set_extra_build_options"
#endif

// Split and merge have two mappings onto work-items, chosen at build time by the device class
// (src/device/device_class.c), with the same arguments:
//   - default (CPUs): 1-D, one work-item per tile row (bh, t), which copies head_dim contiguous
//     floats, so the index arithmetic (64-bit divisions) runs once per row, not once per float,
//     and PoCL vectorises the copy;
//   - HEADS_COALESCED (GPUs): 3-D (d, t, bh) = (float of the row, sequence position, batch*head),
//     one work-item per float, so adjacent work-items read and write adjacent addresses (a
//     work-group covers whole rows of head_dim floats, several rows when head_dim is short).
//     Guards d < head_dim and t < seq_out; bh covers N*H exactly.
#ifndef HEADS_COALESCED
#define HEADS_COALESCED 0
#endif

// Splits projected rows into head tiles and appends the extra keys of add_bias_kv (row T) and
// add_zero_attn (the last row).
//   proj     (rows, ld) with the head columns starting at col0
//   bias     in_proj_bias slice for these columns (has_bias)
//   extra    bias_k or bias_v at extra_off (has_extra: row T is extra; rows after it are zero)
//   out      (N*n_heads, T_out, D); out head h copies the source columns of head h / group
//            (group > 1: key/value heads repeated for grouped-query attention)
kernel void split_heads(global const REAL *proj, ulong proj_off, ulong ld, ulong col0,
                        global const REAL *bias, ulong bias_off, uint has_bias,
                        global const REAL *extra, ulong extra_off, uint has_extra,
                        global REAL *out, ulong out_off, ulong n_batch, ulong n_heads,
                        ulong group, ulong seq, ulong seq_out, ulong head_dim,
                        uint batch_first) {
#if HEADS_COALESCED
    ulong d = get_global_id(0), t = get_global_id(1), bh = get_global_id(2);
    if (d >= head_dim || t >= seq_out) return;
    ulong n = bh / n_heads;
    ulong col = (bh - n * n_heads) / group * head_dim + d;
    REAL x = 0.0f;
    if (t < seq) {
        ulong row = batch_first ? n * seq + t : t * n_batch + n;
        x = proj[proj_off + row * ld + col0 + col];
        if (has_bias) x += bias[bias_off + col];
    } else if (t == seq && has_extra) {
        x = extra[extra_off + col];
    }
    out[out_off + (bh * seq_out + t) * head_dim + d] = x;
#else
    ulong gid = get_global_id(0);
    if (gid >= n_batch * n_heads * seq_out) return;
    ulong t = gid % seq_out;
    ulong bh = gid / seq_out;
    ulong n = bh / n_heads;
    ulong h = bh % n_heads;
    ulong col = h / group * head_dim;
    global REAL *dst = out + out_off + gid * head_dim;
    if (t < seq) {
        ulong row = batch_first ? n * seq + t : t * n_batch + n;
        global const REAL *src = proj + proj_off + row * ld + col0 + col;
        if (has_bias) {
            global const REAL *b = bias + bias_off + col;
            for (ulong d = 0; d < head_dim; ++d) dst[d] = src[d] + b[d];
        } else {
            for (ulong d = 0; d < head_dim; ++d) dst[d] = src[d];
        }
    } else if (t == seq && has_extra) {
        global const REAL *e = extra + extra_off + col;
        for (ulong d = 0; d < head_dim; ++d) dst[d] = e[d];
    } else {
        for (ulong d = 0; d < head_dim; ++d) dst[d] = 0.0f;
    }
#endif
}

// Merges head tiles (N*H, L, D) back into rows (rows, E) in the query's row order: default, one
// work-item per (row, head) copying head_dim contiguous floats; coalesced, one per float.
kernel void merge_heads(global const REAL *heads, ulong heads_off, global REAL *out,
                        ulong n_batch,
                        ulong n_heads, ulong seq, ulong head_dim, uint batch_first) {
#if HEADS_COALESCED
    ulong d = get_global_id(0), t = get_global_id(1), bh = get_global_id(2);
    if (d >= head_dim || t >= seq) return;
    ulong n = bh / n_heads;
    ulong h = bh - n * n_heads;
    ulong row = batch_first ? n * seq + t : t * n_batch + n;
    out[(row * n_heads + h) * head_dim + d] = heads[heads_off + (bh * seq + t) * head_dim + d];
#else
    ulong gid = get_global_id(0);
    if (gid >= n_batch * seq * n_heads) return;
    ulong h = gid % n_heads;
    ulong row = gid / n_heads;
    ulong n = batch_first ? row / seq : row % n_batch;
    ulong t = batch_first ? row % seq : row / n_batch;
    global const REAL *src = heads + heads_off + ((n * n_heads + h) * seq + t) * head_dim;
    global REAL *dst = out + gid * head_dim;
    for (ulong d = 0; d < head_dim; ++d) dst[d] = src[d];
#endif
}

// out[r, c] = bias[c] (or 0 without bias) for rows x cols: the C operand of a GEMM with beta 1.
// A 2-D range, columns across (dimension 0) and rows down: no index division, so that a CPU
// driver stores whole vectors (the 1-D form's 64-bit remainder per element cost PoCL ~2% of a
// small forward pass).
kernel void fill_rows(global REAL *out, ulong out_off, global const REAL *bias, uint has_bias,
                      ulong rows, ulong cols) {
    ulong c = get_global_id(0), r = get_global_id(1);
    if (c >= cols || r >= rows) return;
    out[out_off + r * cols + c] = has_bias ? bias[c] : 0.0f;
}

// out[n, i, j] = sum over h of w[n * H + h, i, j], divided by H (PyTorch sums, then divides).
kernel void average_heads(global const REAL *w, global REAL *out, ulong out_off,
                          ulong n_batch, ulong n_heads, ulong plane) {
    ulong gid = get_global_id(0);
    if (gid >= n_batch * plane) return;
    ulong n = gid / plane;
    ulong k = gid % plane;
    REAL sum = 0.0f;
    for (ulong h = 0; h < n_heads; ++h) sum += w[(n * n_heads + h) * plane + k];
    out[out_off + gid] = sum / (REAL)n_heads;
}

// The head average of weights that arrive in chunks (the unfused core when the scores exceed
// the largest allocation): w holds n_groups groups of n_heads consecutive heads, each `part`
// elements (whole planes, or rows of one plane). Their sum is added to the running sum in
// `sums` (a scratch buffer, used only when n_groups is 1), unless `first` (the chunk starts a
// batch item's heads); when `last` (the chunk ends them) the total divided by `divisor` (H)
// goes to out[g, k], which is never read (the caller's buffer may be write-only). Called with
// first and last it equals average_heads.
kernel void accumulate_heads(global const REAL *w, global REAL *sums, global REAL *out,
                             ulong out_off, ulong n_groups, ulong n_heads, ulong part,
                             uint first, uint last, REAL divisor) {
    ulong gid = get_global_id(0);
    if (gid >= n_groups * part) return;
    ulong g = gid / part;
    ulong k = gid % part;
    REAL sum = 0.0f;
    for (ulong h = 0; h < n_heads; ++h) sum += w[(g * n_heads + h) * part + k];
    REAL total = first ? sum : sums[gid] + sum;
    if (last) out[out_off + gid] = total / divisor;
    else sums[gid] = total;
}
