// The block mask of a layer's clmha_mask_mod (host side: src/cores/block_mask.c), built with
// the layer's user functions (-DUSER_MASK=1; cl/common.cl in front): per plane bh = n * H + h
// and tile of `rows` query rows by `keys` keys (as the fused kernel that reads it walks them),
// MOD_BLOCK_NONE where the function forbids every real key of the tile to every row of it,
// MOD_BLOCK_ALL where it allows them all, MOD_BLOCK_SOME otherwise, and never NONE for a tile
// that holds an appended key (add_bias_kv, add_zero_attn: j >= src_len), which is always seen.
// Layout: [bh][ceil(L / rows)][ceil(S' / keys)] bytes. Query row i is at position q_pos + i and
// key j at k_pos + j (partial attention's positions; 0 elsewhere: the fused cores run no KV
// cache).

// One work-item per tile; it stops at the first pair of answers that makes the tile SOME.
kernel void mod_block_mask(global uchar *out, ulong n_heads, ulong tgt_len, ulong src_len,
                           ulong src_len_padded, ulong rows, ulong keys, ulong tiles,
                           global const float *mod_p, ulong mod_off, ulong q_pos,
                           ulong k_pos) {
    ulong t = get_global_id(0);
    if (t >= tiles) return;
    ulong q_tiles = (tgt_len + rows - 1) / rows, k_tiles = (src_len_padded + keys - 1) / keys;
    ulong kt = t % k_tiles, qt = t / k_tiles % q_tiles, bh = t / k_tiles / q_tiles;
    ulong n = bh / n_heads, h = bh - n * n_heads;
    ulong i0 = qt * rows, i1 = min(i0 + rows, tgt_len);
    ulong j0 = kt * keys, j1 = min(j0 + keys, src_len_padded), jr = min(j1, src_len);
    bool any = false, all = true;
    for (ulong i = i0; i < i1 && (all || !any); ++i) {
        for (ulong j = j0; j < jr; ++j) {
            bool allowed = USER_ALLOWS(n, h, q_pos + i, k_pos + j);
            any |= allowed;
            all &= allowed;
        }
    }
    uchar v = !any && j0 < jr ? MOD_BLOCK_NONE : all ? MOD_BLOCK_ALL : MOD_BLOCK_SOME;
    if (v == MOD_BLOCK_NONE && j1 > src_len) v = MOD_BLOCK_SOME;  // an appended key
    out[t] = v;
}
