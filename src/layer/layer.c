// Layers: configuration, parameters by PyTorch name, the kernels of cl/heads.cl, scratch space and
// profiling marks. (clmha_layer_create() and clmha_layer_release(), which add the cores' state,
// are in src/forward/layer_create.c.)
#include "layer/layer.h"

#include "base/half.h"
#include "base/struct_in.h"
#include "device/held.h"
#include "device/packed_weight.h"
#include "layer/mods.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Where each named parameter lives.
typedef struct param_slot {
    cl_mem buffer;
    size_t offset;  // elements
    size_t count;   // elements
    const char *shape;
} param_slot;

// Finds parameter @p name of @p l; on failure writes why to @p why (which may be NULL when
// @p why_size is 0).
static bool find_param(const clmha_layer *l, const char *name, param_slot *slot, char *why,
                       size_t why_size) {
    size_t e = l->e, kd = l->desc.kdim, vd = l->desc.vdim, kve = l->kve;
    bool same = kd == e && vd == e, gqa = kve != e;
    memset(slot, 0, sizeof *slot);
    if (strcmp(name, "in_proj_weight") == 0) {
        if (!same || gqa) {
            snprintf(why, why_size,
                     gqa ? "in_proj_weight does not exist with num_kv_heads (%zu) below "
                           "num_heads (%zu): set q_proj_weight, k_proj_weight, v_proj_weight"
                         : "in_proj_weight exists only when kdim == vdim == embed_dim (here "
                           "kdim %zu, vdim %zu, embed_dim %zu): set q_proj_weight, "
                           "k_proj_weight, v_proj_weight",
                     gqa ? l->kvh : kd, gqa ? l->h : vd, e);
            return false;
        }
        *slot = (param_slot){l->w_in, 0, 3 * e * e, "(3E, E)"};
    } else if (strcmp(name, "q_proj_weight") == 0) {
        *slot = (param_slot){l->w_in, 0, e * e, "(E, E)"};
    } else if (strcmp(name, "k_proj_weight") == 0) {
        *slot = (param_slot){l->w_in, e * e, kve * kd,
                             gqa ? "(num_kv_heads*head_dim, kdim)" : "(E, kdim)"};
    } else if (strcmp(name, "v_proj_weight") == 0) {
        *slot = (param_slot){l->w_in, e * e + kve * kd, kve * vd,
                             gqa ? "(num_kv_heads*head_dim, vdim)" : "(E, vdim)"};
    } else if (strcmp(name, "out_proj.weight") == 0 || strcmp(name, "out_proj_weight") == 0) {
        *slot = (param_slot){l->w_out, 0, e * e, "(E, E)"};
    } else if (strcmp(name, "in_proj_bias") == 0 || strcmp(name, "out_proj.bias") == 0 ||
               strcmp(name, "out_proj_bias") == 0) {
        if (!l->desc.bias) {
            snprintf(why, why_size, "%s does not exist: the layer was created with bias = false",
                     name);
            return false;
        }
        *slot = name[0] == 'i'
                    ? (param_slot){l->b_in, 0, e + 2 * kve, gqa ? "(E + 2*num_kv_heads*head_dim)"
                                                               : "(3E)"}
                    : (param_slot){l->b_out, 0, e, "(E)"};
    } else if (strcmp(name, "bias_k") == 0 || strcmp(name, "bias_v") == 0) {
        if (!l->desc.add_bias_kv) {
            snprintf(why, why_size,
                     "%s does not exist: the layer was created with add_bias_kv = false", name);
            return false;
        }
        *slot = (param_slot){l->bias_kv, name[5] == 'k' ? 0 : kve, kve,
                             gqa ? "(1, 1, num_kv_heads*head_dim)" : "(1, 1, E)"};
    } else if (strcmp(name, "alibi_slopes") == 0) {
        if (!l->desc.alibi) {
            snprintf(why, why_size,
                     "alibi_slopes does not exist: the layer was created with alibi = false");
            return false;
        }
        *slot = (param_slot){l->alibi, 0, l->h, "(H)"};
    } else if (strcmp(name, "sinks") == 0) {
        if (!l->desc.sinks) {
            snprintf(why, why_size, "sinks does not exist: the layer was created with sinks = false");
            return false;
        }
        *slot = (param_slot){l->sinks, 0, l->h, "(H)"};
    } else {
        snprintf(why, why_size,
                 "unknown parameter \"%s\" (expected in_proj_weight, q_proj_weight, "
                 "k_proj_weight, v_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias, "
                 "bias_k, bias_v, alibi_slopes or sinks)",
                 name);
        return false;
    }
    return true;
}

size_t clmha_layer_parameter_count(const clmha_layer *layer, const char *name) {
    param_slot slot;
    if (!layer || !name || !find_param(layer, name, &slot, NULL, 0)) return 0;  // no message
    return slot.count;
}

static void CL_CALLBACK run_free_packed(void *p) {
    clmha__packed_weight_free(*(struct clmha__packed_weight **)p);
}

// Frees @p w once the products queued before, which may read it, have run: in a native kernel
// after them, or (where it cannot be queued) after clFinish().
static void free_packed(clmha_context *ctx, struct clmha__packed_weight *w) {
    if (!w) return;
    if (clEnqueueNativeKernel(ctx->queue, run_free_packed, &w, sizeof w, 0, NULL, NULL, 0, NULL,
                              NULL) == CL_SUCCESS)
        return;
    clFinish(ctx->queue);
    clmha__packed_weight_free(w);
}

// Keeps the packed copy of the weight that @p slot is in (if it has one) equal to its buffer
// after @p count elements of @p values (floats) were written at the slot (@p written: the
// write succeeded; else the buffer's contents are unknown and the copy is dropped). The write
// was blocking on the in-order queue, so every product queued before it, which could read the
// copy, has run.
static void update_packed(clmha_layer *l, const param_slot *slot, size_t count,
                          const void *values, bool written) {
    struct clmha__packed_weight **p = slot->buffer == l->w_in    ? &l->packed_in
                                      : slot->buffer == l->w_out ? &l->packed_out
                                                                 : NULL;
    if (!p || !*p) return;
    size_t k = (*p)->k;
    if (!written || l->rs != 4 || slot->offset % k || count % k) {
        free_packed(l->ctx, *p);
        *p = NULL;
        return;
    }
    clmha__packed_weight_write(*p, slot->offset / k, count / k, values);
}

// Shared by set and get: checks the name and the count, then copies @p count elements of
// @p data, floats or (@p f64) doubles, converting them to and from the layer's elements: a
// 16-bit layer's parameters are values of its dtype (what is written is rounded to it, through
// float32), a float64 layer's are doubles, any other's floats.
static clmha_status param_copy(clmha_layer *layer, const char *name, void *data, size_t count,
                               bool write, bool f64) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    if (!name || !data)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s is NULL", name ? "data" : "name");
    param_slot slot;
    char why[512];
    if (!find_param(layer, name, &slot, why, sizeof why))
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s", why);
    if (count != slot.count)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "%s has shape %s = %zu elements for this layer (E %zu, kdim %zu, "
                           "vdim %zu), got %zu",
                           name, slot.shape, slot.count, layer->e, layer->desc.kdim,
                           layer->desc.vdim, count);
    size_t rs = layer->rs;
    clmha_dtype t = layer->desc.dtype;
    bool direct = (f64 ? 8 : 4) == rs && (!write || t == CLMHA_DTYPE_F32 || rs == 8);
    void *staging = NULL;
    if (!direct && !(staging = malloc(count * rs)))
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory (%s)", name);
    if (!direct && write) {
        const float *fs = data;
        const double *ds = data;
        for (size_t i = 0; i < count; ++i) {
            if (rs == 8) {
                ((double *)staging)[i] = f64 ? ds[i] : (double)fs[i];
            } else {
                float v = f64 ? clmha__double_to_float(ds[i]) : fs[i];
                ((float *)staging)[i] = clmha__dtype_round(t, v);
            }
        }
    }
    void *dev = direct ? data : staging;
    cl_int err = write ? clEnqueueWriteBuffer(ctx->queue, slot.buffer, CL_TRUE, slot.offset * rs,
                                              count * rs, dev, 0, NULL, NULL)
                       : clEnqueueReadBuffer(ctx->queue, slot.buffer, CL_TRUE, slot.offset * rs,
                                             count * rs, dev, 0, NULL, NULL);
    if (write) update_packed(layer, &slot, count, dev, err == CL_SUCCESS);
    if (err == CL_SUCCESS && !direct && !write) {
        for (size_t i = 0; i < count; ++i) {
            if (f64) ((double *)data)[i] = ((float *)staging)[i];  // widened exactly
            else ((float *)data)[i] = clmha__double_to_float(((double *)staging)[i]);
        }
    }
    free(staging);
    if (err != CL_SUCCESS)
        return clmha__cl_fail(ctx, err, write ? "clEnqueueWriteBuffer" : "clEnqueueReadBuffer");
    return CLMHA_SUCCESS;
}

clmha_status clmha_layer_set_parameter(clmha_layer *layer, const char *name, const float *data,
                                       size_t count) {
    return param_copy(layer, name, (float *)data, count, true, false);  // not written through
}

clmha_status clmha_layer_get_parameter(clmha_layer *layer, const char *name, float *data,
                                       size_t count) {
    return param_copy(layer, name, data, count, false, false);
}

clmha_status clmha_layer_set_parameter_f64(clmha_layer *layer, const char *name,
                                           const double *data, size_t count) {
    return param_copy(layer, name, (double *)data, count, true, true);  // not written through
}

clmha_status clmha_layer_get_parameter_f64(clmha_layer *layer, const char *name, double *data,
                                           size_t count) {
    return param_copy(layer, name, data, count, false, true);
}

clmha_status clmha__zero_buffer(clmha_context *ctx, size_t count, size_t elem, const char *what,
                                cl_mem *out) {
    if (count > SIZE_MAX / elem || (cl_ulong)count * elem > ctx->info.max_alloc_bytes)
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY,
                           "%s need %zu elements of %zu bytes, more than this device's largest "
                           "allocation (%llu bytes)",
                           what, count, elem, (unsigned long long)ctx->info.max_alloc_bytes);
    cl_int err;
    clmha__count(ctx, 0, 1);
    *out = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE, count * elem, NULL, &err);
    clmha__held_new(CLMHA__HELD_MEM, *out);
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clCreateBuffer(parameters)");
    cl_uchar zero = 0;
    err = clEnqueueFillBuffer(ctx->queue, *out, &zero, sizeof zero, 0, count * elem, 0, NULL,
                              NULL);
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clEnqueueFillBuffer(parameters)");
    return CLMHA_SUCCESS;
}

static clmha_status make_kernel(clmha_context *ctx, cl_program prog, const char *name,
                                cl_kernel *out) {
    cl_int err;
    *out = clCreateKernel(prog, name, &err);
    clmha__held_new(CLMHA__HELD_KERNEL, *out);
    if (err != CL_SUCCESS) return clmha__cl_fail_on(ctx, err, "clCreateKernel", name);
    return CLMHA_SUCCESS;
}

// Layer @p l's alibi_slopes: the geometric ones (clmha__alibi_slope()), in its dtype.
static clmha_status make_alibi(clmha_layer *l) {
    clmha_context *ctx = l->ctx;
    clmha_status st = clmha__zero_buffer(ctx, l->h, l->rs, "alibi_slopes", &l->alibi);
    double *slopes = st ? NULL : malloc(l->h * sizeof *slopes);
    if (st) return st;
    if (!slopes) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    for (size_t h = 0; h < l->h; ++h) slopes[h] = clmha__alibi_slope(l->h, h);
    st = clmha_layer_set_parameter_f64(l, "alibi_slopes", slopes, l->h);
    free(slopes);
    return st;
}

// The parameters of layer @p l (its sizes set) as zero-filled device buffers (alibi_slopes
// geometric).
static clmha_status make_parameters(clmha_layer *l) {
    clmha_context *ctx = l->ctx;
    const clmha_layer_desc *d = &l->desc;
    size_t e = l->e, kve = l->kve, rs = l->rs;
    clmha_status st;
    char what[160];
    snprintf(what, sizeof what, "q/k/v_proj_weight (embed_dim %zu, kdim %zu, vdim %zu)", e,
             d->kdim, d->vdim);
    if ((st = clmha__zero_buffer(ctx, e * e + kve * (d->kdim + d->vdim), rs, what, &l->w_in)))
        return st;
    if ((st = clmha__zero_buffer(ctx, e * e, rs, "out_proj.weight", &l->w_out))) return st;
    // Their packed copies, zero as the buffers; none where they would not be read (NULL is
    // no failure: the products then take the host BLAS's own path).
    if (ctx->host_blas && rs == 4) {
        if (d->kdim == e && d->vdim == e) l->packed_in = clmha__packed_weight_new(e + 2 * kve, e);
        l->packed_out = clmha__packed_weight_new(e, e);
    }
    if (d->bias) {
        if ((st = clmha__zero_buffer(ctx, e + 2 * kve, rs, "in_proj_bias", &l->b_in))) return st;
        if ((st = clmha__zero_buffer(ctx, e, rs, "out_proj.bias", &l->b_out))) return st;
    }
    if (d->add_bias_kv &&
        (st = clmha__zero_buffer(ctx, 2 * kve, rs, "bias_k/bias_v", &l->bias_kv)))
        return st;
    if (d->alibi && (st = make_alibi(l))) return st;
    if (d->sinks && (st = clmha__zero_buffer(ctx, l->h, rs, "sinks", &l->sinks))) return st;
    return CLMHA_SUCCESS;
}

// The element-wise kernels of layer @p l: split and merge heads and their kin, a 16-bit
// layer's conversions; l->heads_limit and l->heads_wg.
static clmha_status make_kernels(clmha_layer *l) {
    clmha_context *ctx = l->ctx;
    clmha_dtype dtype = l->desc.dtype;
    clmha_status st;
    // Split and merge heads: the device class's mapping (one work-item per tile row, or per
    // float on GPUs).
    cl_program heads;
    char heads_options[64];
    snprintf(heads_options, sizeof heads_options, "%s%s",
             ctx->cls->coalesced ? "-DHEADS_COALESCED=1" : "", clmha__layer_real_options(l));
    if ((st = clmha__program_get(ctx, "heads", heads_options, &heads))) return st;
    if ((st = make_kernel(ctx, heads, "split_heads", &l->split_heads))) return st;
    if ((st = make_kernel(ctx, heads, "merge_heads", &l->merge_heads))) return st;
    if ((st = make_kernel(ctx, heads, "fill_rows", &l->fill_rows))) return st;
    if ((st = make_kernel(ctx, heads, "average_heads", &l->average_heads))) return st;
    if ((st = make_kernel(ctx, heads, "accumulate_heads", &l->accumulate_heads))) return st;
    // A 16-bit layer's conversions (cl/convert.cl).
    if (dtype == CLMHA_DTYPE_F16 || dtype == CLMHA_DTYPE_BF16) {
        cl_program convert;
        bool half = dtype == CLMHA_DTYPE_F16;
        if ((st = clmha__program_get(ctx, "convert", "", &convert)) ||
            (st = make_kernel(ctx, convert, half ? "f16_to_f32" : "bf16_to_f32", &l->to_f32)) ||
            (st = make_kernel(ctx, convert, half ? "f32_to_f16" : "f32_to_bf16", &l->from_f32)))
            return st;
    }
    // The element-wise kernels: groups of up to 64 (the coalesced split/merge: up to 256),
    // within the smallest of their limits.
    l->heads_limit = ctx->max_work_group;
    cl_kernel elementwise[] = {l->split_heads,      l->merge_heads, l->fill_rows,
                               l->average_heads,    l->accumulate_heads, l->to_f32,
                               l->from_f32};
    for (size_t i = 0; i < sizeof elementwise / sizeof elementwise[0]; ++i) {
        if (!elementwise[i]) continue;  // a float32 layer has no conversions
        size_t wg;
        if ((st = clmha__kernel_limits(ctx, elementwise[i], &wg, NULL))) return st;
        if (wg < l->heads_limit) l->heads_limit = wg;
    }
    l->heads_wg = l->heads_limit < 64 ? l->heads_limit : 64;
    return CLMHA_SUCCESS;
}

clmha_status clmha__layer_new(clmha_layer **out, clmha_context *ctx,
                              const clmha_layer_desc *desc) {
    if (!out) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    char msg[512];
    clmha_layer_desc d, in;  // in: the caller's desc in this library's layout (docs/abi.md)
    clmha_status st = CLMHA__STRUCT_IN(clmha_layer_desc, &in, desc, "desc", msg, sizeof msg);
    if (!st) st = clmha__desc_check(&in, &d, msg, sizeof msg);
    if (st) return clmha__fail(ctx, st, "%s", msg);
    if (d.dtype == CLMHA_DTYPE_F64 && !ctx->info.fp64)
        return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                           "float64 layers (CLMHA_DTYPE_F64) need a device with double "
                           "precision (cl_khr_fp64); %s has none",
                           ctx->info.device_name);

    clmha_layer *l = calloc(1, sizeof *l);
    if (!l) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    clmha_context_retain(ctx);
    l->ctx = ctx;
    l->desc = d;
    l->e = d.embed_dim;
    l->h = d.num_heads;
    l->d = d.embed_dim / d.num_heads;
    l->kvh = d.num_kv_heads;
    l->kve = l->kvh * l->d;
    l->rs = d.dtype == CLMHA_DTYPE_F64 ? 8 : 4;

    if ((st = make_parameters(l)) ||
        (st = clmha__layer_mods_init(l, in.mod_source, in.mod_params, in.mod_params_count)) ||
        (st = make_kernels(l)))
        goto fail;

    cl_int err = clFinish(ctx->queue);  // the parameter fills
    if (err != CL_SUCCESS) {
        st = clmha__cl_fail(ctx, err, "clFinish");
        goto fail;
    }
    *out = l;
    return CLMHA_SUCCESS;
fail:
    clmha__layer_free(l);
    return st;
}

static void release_mem(cl_mem *m) {
    clmha__release_mem(*m);
    *m = NULL;
}

static void release_kernel(cl_kernel *k) {
    clmha__release_kernel(*k);
    *k = NULL;
}

clmha_status clmha__layer_new_bare(clmha_layer **out, clmha_context *ctx, size_t heads,
                                   size_t kv_heads, size_t head_dim, clmha_dtype dtype,
                                   const clmha__dims *call) {
    *out = NULL;
    clmha_layer *l = calloc(1, sizeof *l);
    if (!l) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    l->ctx = ctx;
    l->bare = true;
    l->e = heads * head_dim;
    l->h = heads;
    l->d = head_dim;
    l->kvh = kv_heads;
    l->kve = kv_heads * head_dim;
    l->rs = dtype == CLMHA_DTYPE_F64 ? 8 : 4;
    l->desc = (clmha_layer_desc){.struct_size = sizeof l->desc, .embed_dim = l->e,
                                 .num_heads = heads, .kdim = l->e, .vdim = l->e,
                                 .num_kv_heads = kv_heads, .batch_first = true,
                                 .softcap = call->softcap > 0.0 ? 1.0 : 0.0,
                                 .alibi = call->alibi, .sinks = call->sinks, .dtype = dtype};
    clmha_status st = clmha__layer_mods_init(l, call->mod_source, NULL, 0);
    if (!st) st = make_kernels(l);
    if (!st && call->alibi) st = make_alibi(l);
    if (st) {
        clmha__layer_free(l);
        return st;
    }
    *out = l;
    return CLMHA_SUCCESS;
}

void clmha__layer_free(clmha_layer *layer) {
    if (!layer) return;
    clmha__layer_marks_release(layer);
    if (layer->backward_release) layer->backward_release(layer->backward);
    release_mem(&layer->w_in);
    release_mem(&layer->b_in);
    release_mem(&layer->w_out);
    free_packed(layer->ctx, layer->packed_in);
    free_packed(layer->ctx, layer->packed_out);
    release_mem(&layer->b_out);
    release_mem(&layer->bias_kv);
    release_mem(&layer->alibi);
    release_mem(&layer->sinks);
    release_mem(&layer->no_sinks);
    clmha__layer_mods_free(layer);
    release_mem(&layer->partial_lse);
    release_mem(&layer->proj);
    for (int i = 0; i < CLMHA__TILE_COUNT; ++i) release_mem(&layer->tiles[i]);
    release_mem(&layer->scores);
    release_mem(&layer->head_sums);
    release_kernel(&layer->split_heads);
    release_kernel(&layer->merge_heads);
    release_kernel(&layer->fill_rows);
    release_kernel(&layer->average_heads);
    release_kernel(&layer->accumulate_heads);
    release_kernel(&layer->to_f32);
    release_kernel(&layer->from_f32);
    for (int i = 0; i < CLMHA__STAGED_COUNT; ++i) release_mem(&layer->staged[i]);
    for (int i = 0; i < CLMHA__HOST_COUNT; ++i) release_mem(&layer->host[i]);
    if (!layer->bare) clmha_context_release(layer->ctx);
    free(layer);
}

clmha_status clmha_layer_get_desc(const clmha_layer *layer, clmha_layer_desc *desc) {
    if (!layer || !desc) return CLMHA_INVALID_ARGUMENT;
    char msg[256];
    clmha_status st = CLMHA__STRUCT_OUT_CHECK(clmha_layer_desc, desc, "desc", msg, sizeof msg);
    if (st) return clmha__fail(layer->ctx, st, "%s", msg);
    clmha__struct_out(desc, &layer->desc, sizeof layer->desc);
    return CLMHA_SUCCESS;
}

clmha_context *clmha_layer_context(const clmha_layer *layer) {
    return layer ? layer->ctx : NULL;
}

clmha_status clmha_layer_set_attention(clmha_layer *layer, clmha_attention_fn fn,
                                       void *user_data) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    // Every dtype: the core is told its elements (clmha_core_args::dtype; a 16-bit layer's
    // core sees its float32 pass, forward/convert.c).
    layer->core = fn;
    layer->core_data = fn ? user_data : NULL;
    return CLMHA_SUCCESS;
}

clmha_status clmha_layer_set_impl(clmha_layer *layer, clmha_impl impl) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    if (impl != CLMHA_IMPL_AUTO && impl != CLMHA_IMPL_FUSED && impl != CLMHA_IMPL_UNFUSED)
        return clmha__fail(layer->ctx, CLMHA_INVALID_ARGUMENT,
                           "impl %d is not CLMHA_IMPL_AUTO, _FUSED or _UNFUSED", (int)impl);
    layer->impl = impl;
    return CLMHA_SUCCESS;
}

const char *clmha_impl_name(clmha_impl impl) {
    switch (impl) {
    case CLMHA_IMPL_AUTO: return "auto";
    case CLMHA_IMPL_FUSED: return "fused";
    case CLMHA_IMPL_UNFUSED: return "unfused";
    }
    return "?";
}

size_t clmha_layer_scratch_bytes(const clmha_layer *layer) {
    if (!layer) return 0;
    size_t elems = layer->proj_cap + layer->scores_cap + layer->head_sums_cap +
                   layer->partial_lse_cap + layer->cores_scratch_cap, staged = 0;
    for (int i = 0; i < CLMHA__TILE_COUNT; ++i) elems += layer->tile_caps[i];
    for (int i = 0; i < CLMHA__STAGED_COUNT; ++i) staged += layer->staged_caps[i];
    for (int i = 0; i < CLMHA__HOST_COUNT; ++i) staged += layer->host_caps[i];
    return elems * layer->rs + staged * sizeof(float);  // the staged copies: in floats
}

// Replaces *buf by one of @p need elements of @p elem bytes when it holds fewer:
// uninitialised, or (ones, floats only) every float 1, copied from a host array when the
// buffer is made.
static clmha_status grow(clmha_context *ctx, cl_mem *buf, size_t *cap, size_t need, size_t elem,
                         const char *what, bool ones) {
    if (need <= *cap && *buf) return CLMHA_SUCCESS;
    cl_ulong limit = clmha__max_alloc(ctx);
    if (need > SIZE_MAX / elem || (cl_ulong)need * elem > limit)
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY,
                           "%s scratch needs %zu elements of %zu bytes, more than this device's "
                           "largest allocation (%llu bytes)",
                           what, need, elem, (unsigned long long)limit);
    void *host = NULL;  // ones: floats, or doubles for elements of 8 bytes
    if (ones) {
        if (!(host = malloc(need * elem)))
            return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
        for (size_t i = 0; i < need; ++i)
            if (elem == sizeof(double)) ((double *)host)[i] = 1.0;
            else ((float *)host)[i] = 1.0f;
    }
    cl_int err;
    clmha__count(ctx, 0, 1);
    cl_mem m = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE | (ones ? CL_MEM_COPY_HOST_PTR : 0),
                              need * elem, host, &err);
    free(host);
    clmha__held_new(CLMHA__HELD_MEM, m);
    if (err != CL_SUCCESS) return clmha__cl_fail_on(ctx, err, "clCreateBuffer", what);
    release_mem(buf);  // freed by the driver once queued work that uses it has finished
    *buf = m;
    *cap = need;
    return CLMHA_SUCCESS;
}

clmha_status clmha__grow_buffer(clmha_context *ctx, cl_mem *buf, size_t *cap, size_t need,
                                const char *what) {
    return grow(ctx, buf, cap, need, sizeof(float), what, false);
}

clmha_status clmha__layer_grow(clmha_layer *layer, cl_mem *buf, size_t *cap, size_t need,
                               const char *what) {
    return grow(layer->ctx, buf, cap, need, layer->rs, what, false);
}

static clmha_status layer_grow(clmha_layer *layer, cl_mem *buf, size_t *cap, size_t need,
                               const char *what) {
    return clmha__layer_grow(layer, buf, cap, need, what);
}

// Bytes that growing a buffer of @p cap elements to @p need adds (a double: the sum of several
// is compared with the device's memory; a size past size_t is refused by grow()).
static double growth(size_t cap, size_t need, size_t elem) {
    return need > cap ? ((double)need - (double)cap) * (double)elem : 0.0;
}

// Refuses scratch that would bring what the layer holds on the device past the device's global
// memory, before anything is allocated: @p add bytes more, of which @p part (@p what) is the
// largest.
static clmha_status fits_global(clmha_layer *layer, double add, const char *what, double part) {
    cl_ulong global = clmha__global_mem(layer->ctx);
    double held = (double)clmha_layer_scratch_bytes(layer);
    if (held + add <= (double)global) return CLMHA_SUCCESS;
    return clmha__fail(layer->ctx, CLMHA_OUT_OF_MEMORY,
                       "scratch: %.0f bytes more (%s %.0f bytes) on the %.0f the layer holds, "
                       "more than this device's global memory (%llu bytes)",
                       add, what, part, held, (unsigned long long)global);
}

clmha_status clmha__layer_grow_core_scratch(clmha_layer *layer, cl_mem *buf, size_t *cap,
                                            size_t need, const char *what) {
    size_t before = *cap;
    double add = growth(*cap, need, layer->rs);
    clmha_status st = fits_global(layer, add, what, add);
    if (st) return st;
    st = grow(layer->ctx, buf, cap, need, layer->rs, what, false);
    layer->cores_scratch_cap += *cap - before;
    return st;
}

clmha_status clmha__layer_grow_ones(clmha_layer *layer, cl_mem *buf, size_t *cap, size_t need,
                                    const char *what) {
    size_t before = *cap;
    clmha_status st = grow(layer->ctx, buf, cap, need, layer->rs, what, true);
    layer->cores_scratch_cap += *cap - before;
    return st;
}

bool clmha__scores_chunks(const clmha_layer *layer, const clmha__dims *d,
                          clmha__chunks *chunks) {
    size_t budget = (size_t)(clmha__max_alloc(layer->ctx) / 2 / layer->rs);  // elements
    size_t h = layer->h, planes = d->n * h, sp = d->s_padded, total = planes * d->l;
    if (d->scores_count <= budget) {
        *chunks = (clmha__chunks){.rows = total, .whole = true, .count = 1};
        return true;
    }
    size_t plane = d->l * sp;  // <= scores_count: no overflow
    if (plane <= budget) {
        size_t g = budget / plane;  // planes per chunk: a multiple of H, or a divisor of it
        if (g >= h) g -= g % h;
        else
            while (h % g) --g;
        *chunks = (clmha__chunks){.rows = g * d->l, .whole = true,
                                  .count = (planes + g - 1) / g, .sums = g < h ? plane : 0};
        return true;
    }
    size_t rows = budget / sp;
    if (!rows) return false;
    *chunks = (clmha__chunks){.rows = rows, .whole = false,
                              .count = planes * ((d->l + rows - 1) / rows),
                              .sums = h > 1 ? rows * sp : 0};
    return true;
}

size_t clmha__rows_pitch(const clmha_layer *layer, size_t width) {
    return width * layer->rs % 4096 ? width : width + 64 / layer->rs;
}

// Elements of layer->proj a call of @p d needs: the query, key and value projections (E wide
// each at most: the key/value width is E or fewer with grouped-query attention), with their
// rows padded as the rows path lays them out (forward.c's project(): one packed QKV GEMM; the
// query's and one key/value GEMM; or three).
static size_t proj_need(const clmha_layer *layer, const clmha__dims *d) {
    size_t e = d->e, kve = layer->kve, lq = d->n * d->l, lkv = d->n * d->s;
    size_t need = lq * e + 2 * lkv * e;
    size_t packed = lq * clmha__rows_pitch(layer, e + 2 * kve);
    size_t kv_one = clmha__rows_pitch(layer, 2 * kve), kv_two = 2 * clmha__rows_pitch(layer, kve);
    size_t apart = lq * clmha__rows_pitch(layer, e) + lkv * (kv_one > kv_two ? kv_one : kv_two);
    if (packed > need) need = packed;
    return apart > need ? apart : need;
}

clmha_status clmha__layer_reserve(clmha_layer *layer, const clmha__dims *d, bool scores,
                                  bool head_sums) {
    clmha_context *ctx = layer->ctx;
    size_t q = d->n * d->l * d->e, kvp = d->n * d->s_padded * d->e;
    enum { PROJ = CLMHA__TILE_COUNT, SCORES, SUMS, PARTS };
    cl_mem *buf[PARTS] = {&layer->tiles[0], &layer->tiles[1], &layer->tiles[2],
                          &layer->tiles[3], &layer->proj, &layer->scores, &layer->head_sums};
    size_t *cap[PARTS] = {&layer->tile_caps[0], &layer->tile_caps[1], &layer->tile_caps[2],
                          &layer->tile_caps[3], &layer->proj_cap, &layer->scores_cap,
                          &layer->head_sums_cap};
    size_t need[PARTS] = {q, kvp, kvp, q, proj_need(layer, d), 0, 0};
    static const char *const name[PARTS] = {
        "query head tiles", "key head tiles", "value head tiles", "attention output tiles",
        "projection", "scores", "head sums"};
    clmha__chunks c = {0};
    if (scores && layer->core) {  // a user core gets all the scores, to return the weights
        need[SCORES] = d->scores_count;
    } else if (scores) {
        if (!clmha__scores_chunks(layer, d, &c))
            return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY,
                               "scores scratch: one row of %zu keys needs %zu bytes, more than "
                               "half this device's largest allocation (%llu bytes)",
                               d->s_padded, d->s_padded * layer->rs,
                               (unsigned long long)clmha__max_alloc(ctx));
        need[SCORES] = c.rows * d->s_padded;
        need[SUMS] = head_sums ? c.sums : 0;
    }
    double add = 0, part = 0;
    int largest = PROJ;
    for (int i = 0; i < PARTS; ++i) {
        double g = growth(*cap[i], need[i], layer->rs);
        add += g;
        if (g > part) part = g, largest = i;
    }
    clmha_status st = fits_global(layer, add, name[largest], part);
    // The projection first: its message is the one a call too large for the device gets.
    static const int order[PARTS] = {PROJ, 0, 1, 2, 3, SCORES, SUMS};
    for (int k = 0; k < PARTS && !st; ++k) {
        int i = order[k];
        if (need[i]) st = layer_grow(layer, buf[i], cap[i], need[i], name[i]);
    }
    return st;
}

// ---- profiling marks (the public calls are in src/forward/profiling.c) --------------------------

void clmha__layer_marks_release(clmha_layer *layer) {
    for (int i = 0; i <= CLMHA_STAGE_COUNT; ++i) {
        if (layer->marks[i]) clReleaseEvent(layer->marks[i]);
        layer->marks[i] = NULL;
    }
}

clmha_status clmha__layer_mark(clmha_layer *layer, int slot) {
    if (!layer->profiling) return CLMHA_SUCCESS;
    if (layer->marks[slot]) clReleaseEvent(layer->marks[slot]);
    layer->marks[slot] = NULL;
    cl_int err = clEnqueueMarkerWithWaitList(layer->ctx->queue, 0, NULL, &layer->marks[slot]);
    return err ? clmha__cl_fail(layer->ctx, err, "clEnqueueMarkerWithWaitList(profiling)")
               : CLMHA_SUCCESS;
}
