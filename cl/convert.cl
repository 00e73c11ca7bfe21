// Element conversions of 16-bit layers (src/forward/convert.c): their query, key, value and
// float masks are widened to float32 before the float32 pass, and its output and weights
// narrowed back, rounding to nearest even. One work-item per element; `n` elements, the 16-bit
// side at element offset `off` (the caller's buffer), the float32 side at 0 (the layer's).
// float16 through vload_half / vstore_half_rte (core OpenCL 1.2: no cl_khr_fp16 needed);
// bfloat16 is the upper half of a float32's bits.

kernel void f16_to_f32(global const half *src, ulong off, global float *dst, ulong n) {
    ulong i = get_global_id(0);
    if (i < n) dst[i] = vload_half(off + i, src);
}

kernel void f32_to_f16(global const float *src, global half *dst, ulong off, ulong n) {
    ulong i = get_global_id(0);
    if (i < n) vstore_half_rte(src[i], off + i, dst);
}

kernel void bf16_to_f32(global const ushort *src, ulong off, global float *dst, ulong n) {
    ulong i = get_global_id(0);
    if (i < n) dst[i] = as_float((uint)src[off + i] << 16);
}

// Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate (a carry into the
// exponent is right, up to infinity); a NaN stays a quiet NaN.
kernel void f32_to_bf16(global const float *src, global ushort *dst, ulong off, ulong n) {
    ulong i = get_global_id(0);
    if (i >= n) return;
    uint x = as_uint(src[i]);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        dst[off + i] = (ushort)((x >> 16) | 0x40u);
        return;
    }
    dst[off + i] = (ushort)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
