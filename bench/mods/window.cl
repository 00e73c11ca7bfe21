// A causal sliding window as a user mask function (bench/variant_ratio.py's user-window): key k
// for query q iff q - p[0] <= k <= q; the same keys as --window LEFT,0 --causal.
int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) {
    return k <= q && k >= q - (int)p[0];
}
