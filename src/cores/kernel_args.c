// Kernel arguments and launches shared by the attention cores and the forward pass
// (kernel_args.h).
#include "cores/kernel_args.h"

#include "base/philox.h"
#include "device/held.h"

#include <stdio.h>

// clmha__cl_fail_on() for clSetKernelArg: names the kernel and the argument.
static clmha_status arg_fail(clmha_context *ctx, cl_int err, const char *name, cl_uint arg) {
    char what[128];
    snprintf(what, sizeof what, "%s, argument %u", name, arg);
    return clmha__cl_fail_on(ctx, err, "clSetKernelArg", what);
}

clmha_status clmha__kernel_make(clmha_context *ctx, cl_program prog, const char *name,
                                cl_kernel *out) {
    cl_int err;
    *out = clCreateKernel(prog, name, &err);
    clmha__held_new(CLMHA__HELD_KERNEL, *out);
    if (err != CL_SUCCESS) return clmha__cl_fail_on(ctx, err, "clCreateKernel", name);
    return CLMHA_SUCCESS;
}

clmha_status clmha__set_args(clmha_context *ctx, cl_kernel k, const char *name,
                             const clmha__arg *args, cl_uint nargs) {
    for (cl_uint i = 0; i < nargs; ++i) {
        cl_int err = clSetKernelArg(k, i, args[i].size, args[i].value);
        if (err != CL_SUCCESS) return arg_fail(ctx, err, name, i);
    }
    return CLMHA_SUCCESS;
}

clmha_status clmha__launch_rows(clmha_context *ctx, cl_kernel k, const char *name, size_t rows,
                                size_t cols, size_t wg, const clmha__arg *args, cl_uint nargs) {
    clmha_status st = clmha__set_args(ctx, k, name, args, nargs);
    if (st) return st;
    size_t global[2] = {(cols + wg - 1) / wg * wg, rows}, local[2] = {wg, 1};
    cl_int err = clEnqueueNDRangeKernel(ctx->queue, k, 2, NULL, global, local, 0, NULL, NULL);
    if (err != CL_SUCCESS) return clmha__cl_fail_on(ctx, err, "clEnqueueNDRangeKernel", name);
    return CLMHA_SUCCESS;
}

clmha_status clmha__launch(clmha_context *ctx, cl_kernel k, const char *name, size_t total,
                           size_t wg, const clmha__arg *args, cl_uint nargs) {
    clmha_status st = clmha__set_args(ctx, k, name, args, nargs);
    if (st) return st;
    size_t global = (total + wg - 1) / wg * wg;
    cl_int err = clEnqueueNDRangeKernel(ctx->queue, k, 1, NULL, &global, &wg, 0, NULL, NULL);
    if (err != CL_SUCCESS) return clmha__cl_fail_on(ctx, err, "clEnqueueNDRangeKernel", name);
    return CLMHA_SUCCESS;
}

// A window bound for the kernels: -1 (unbounded) for one that allows every key of the call, at
// least the largest position (query positions are below q_pos + L, keys below k_pos + S'), so
// that the kernels take the paths without a window where it masks nothing and p + bound never
// overflows there.
static cl_long window_bound(int64_t bound, const clmha__dims *d) {
    size_t ql = d->q_pos + d->l, ks = d->k_pos + d->s_padded;
    size_t reach = ql > ks ? ql : ks;
    return bound < 0 || (uint64_t)bound >= reach ? -1 : (cl_long)bound;
}

clmha__mask_args clmha__masks_of(const clmha_layer *l, const clmha_forward_args *a,
                                 const clmha__dims *d) {
    float p = l->desc.dropout;
    bool dropout_on = a->training && p > 0.0f;
    cl_ulong mod_off;
    cl_mem mod_p = clmha__mod_params_of(l, &mod_off);
    return (clmha__mask_args){
        .attn = d->attn_kind ? a->attn_mask.tensor.buffer : l->ctx->dummy,
        .attn_off = d->attn_kind ? a->attn_mask.tensor.offset : 0,
        .attn_kind = d->attn_kind,
        .attn_sn = d->attn_sn,
        .attn_sh = d->attn_sh,
        .attn_si = d->attn_si,
        .kpm = d->kpm_kind ? a->key_padding_mask.tensor.buffer : l->ctx->dummy,
        .kpm_off = d->kpm_kind ? a->key_padding_mask.tensor.offset : 0,
        .kpm_kind = d->kpm_kind,
        .causal = a->is_causal,
        .win_left = window_bound(d->win_left, d),
        .win_right = window_bound(d->win_right, d),
        .softcap = clmha__real_of(d->softcap),
        .alibi = !d->alibi ? l->ctx->dummy : l->alibi_call ? l->alibi_call : l->alibi,
        .alibi_off = d->alibi && l->alibi_call ? l->alibi_call_off : 0,
        .sinks = !d->sinks ? l->ctx->dummy : l->sinks_call ? l->sinks_call : l->sinks,
        .sinks_off = d->sinks && l->sinks_call ? l->sinks_call_off : 0,
        .mod_p = mod_p,
        .mod_off = mod_off,
        .mod_blocks = l->ctx->dummy,
        .q_pos = d->q_pos,
        .k_pos = d->k_pos,
        .dropout_on = dropout_on,
        .threshold = clmha__dropout_threshold(p),
        .keep_scale = clmha__real_of(dropout_on ? 1.0 / (1.0 - (double)p) : 1.0),
        .seed_lo = (cl_uint)a->rng.seed,
        .seed_hi = (cl_uint)(a->rng.seed >> 32) ^ (cl_uint)(a->rng.offset >> 32),
        .off_lo = (cl_uint)a->rng.offset,
        .rs = l->rs};
}
