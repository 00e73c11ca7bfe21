// The arguments of attention as a function: the caller's struct read and checked
// (clmha__attention_check_args()), and the call as the attention cores take it
// (clmha__attention_core_args()); shared by the forward (attention.c), its KV-cache form
// (attention_kv.c) and the backward (src/backward/attention_backward.c).
#include "forward/attention.h"

#include "base/struct_in.h"
#include "context/context.h"
#include "forward/enqueue.h"

// The call's dtype: float32, float16, bfloat16; float64 where the device has double
// precision.
static clmha_status check_dtype(clmha_context *ctx, const clmha_attention_args *a) {
    switch (a->dtype) {
    case CLMHA_DTYPE_F32: return CLMHA_SUCCESS;
    case CLMHA_DTYPE_F64:
        if (!ctx->info.fp64)
            return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                               "dtype CLMHA_DTYPE_F64 needs a device with double precision "
                               "(cl_khr_fp64); %s has none",
                               ctx->info.device_name);
        return CLMHA_SUCCESS;
    case CLMHA_DTYPE_F16:
    case CLMHA_DTYPE_BF16: return CLMHA_SUCCESS;
    }
    return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                       "dtype is %d: it must be a clmha_dtype (CLMHA_DTYPE_F32, _F64, _F16 or "
                       "_BF16)",
                       (int)a->dtype);
}

clmha_status clmha__attention_check_args(clmha_context *ctx, const clmha_attention_args *args,
                                         clmha_attention_args *in, clmha__attention_dims *d) {
    char msg[512];
    clmha_status st = CLMHA__STRUCT_IN(clmha_attention_args, in, args, "args", msg, sizeof msg);
    if (!st) st = clmha__attention_resolve(in, d, msg, sizeof msg);
    if (st) return clmha__fail(ctx, st, "%s", msg);
    return check_dtype(ctx, in);
}

size_t clmha__attention_elem(const clmha_attention_args *a) {
    return a->dtype == CLMHA_DTYPE_F64                                      ? sizeof(double)
           : a->dtype == CLMHA_DTYPE_F16 || a->dtype == CLMHA_DTYPE_BF16 ? sizeof(uint16_t)
                                                                            : sizeof(float);
}

bool clmha__attention_16(const clmha_attention_args *a) {
    return a->dtype == CLMHA_DTYPE_F16 || a->dtype == CLMHA_DTYPE_BF16;
}

size_t clmha__attention_mask_elem(const clmha_attention_args *a, clmha_mask_kind kind) {
    return kind == CLMHA_MASK_FLOAT ? clmha__attention_elem(a) : clmha__mask_elem(kind);
}

clmha_forward_args clmha__attention_core_args(clmha_layer *l, const clmha_attention_args *a,
                                              const clmha__attention_dims *d) {
    l->desc.dropout = a->dropout_p;  // the bare layer's: the cores read the call's p there
    // The call's ALiBi slopes (NULL: the bare layer's geometric ones, clmha__masks_of()).
    l->alibi_call = a->alibi && a->alibi_slopes.ndim ? a->alibi_slopes.buffer : NULL;
    l->alibi_call_off = a->alibi_slopes.offset;
    l->sinks_call = a->sinks.ndim ? a->sinks.buffer : NULL;
    l->sinks_call_off = a->sinks.offset;
    // The call's p of the user functions (the bare layer, built with the call's mod_source,
    // has none of its own).
    l->mod_params_call = a->mod_params.ndim ? a->mod_params.buffer : NULL;
    l->mod_params_call_off = a->mod_params.offset;
    return (clmha_forward_args){.struct_size = sizeof(clmha_forward_args), .attn_mask = d->attn,
                                .is_causal = a->is_causal, .per_head_weights = true,
                                .training = a->dropout_p > 0.0f, .rng = a->rng, .impl = a->impl};
}
