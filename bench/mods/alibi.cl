// ALiBi as a user score function (bench/variant_ratio.py's user-alibi): the slopes in p, one
// per head; the same scores as clmha_layer_desc::alibi.
clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k, __global const float *p) {
    return s - p[h] * fabs((clmha_real)(q - k));
}

clmha_real clmha_score_mod_grad(clmha_real s, int b, int h, int q, int k,
                                __global const float *p) {
    return 1.0f;
}
