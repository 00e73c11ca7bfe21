// The gradients of `clmha run` (see grads.h): the files a call gets and the backward pass.
#include "grads.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/half.h"
#include "cli.h"

// The clmha_backward_args fields a gradient file can come from.
enum {
    SLOT_QUERY, SLOT_KEY, SLOT_VALUE, SLOT_IN_PROJ_WEIGHT, SLOT_Q_PROJ_WEIGHT, SLOT_K_PROJ_WEIGHT,
    SLOT_V_PROJ_WEIGHT, SLOT_IN_PROJ_BIAS, SLOT_OUT_PROJ_WEIGHT, SLOT_OUT_PROJ_BIAS, SLOT_BIAS_K,
    SLOT_BIAS_V, SLOT_ATTN_MASK, SLOT_KEY_PADDING_MASK, SLOT_SINKS
};

static clmha_grad *slot_of(clmha_backward_args *b, int slot) {
    switch (slot) {
    case SLOT_QUERY: return &b->query;
    case SLOT_KEY: return &b->key;
    case SLOT_VALUE: return &b->value;
    case SLOT_IN_PROJ_WEIGHT: return &b->in_proj_weight;
    case SLOT_Q_PROJ_WEIGHT: return &b->q_proj_weight;
    case SLOT_K_PROJ_WEIGHT: return &b->k_proj_weight;
    case SLOT_V_PROJ_WEIGHT: return &b->v_proj_weight;
    case SLOT_IN_PROJ_BIAS: return &b->in_proj_bias;
    case SLOT_OUT_PROJ_WEIGHT: return &b->out_proj_weight;
    case SLOT_OUT_PROJ_BIAS: return &b->out_proj_bias;
    case SLOT_BIAS_K: return &b->bias_k;
    case SLOT_BIAS_V: return &b->bias_v;
    case SLOT_ATTN_MASK: return &b->attn_mask;
    case SLOT_SINKS: return &b->sinks;
    default: return &b->key_padding_mask;
    }
}

// Adds DIR/<name>.npy of the given shape. Returns false when out of memory.
static bool add_file(clmha__cli_grads *g, const char *dir, const char *name, int slot,
                     size_t ndim, const size_t *shape) {
    clmha__cli_grad_file *f = &g->file[g->count];
    memset(f, 0, sizeof *f);
    f->name = name;
    f->slot = slot;
    f->ndim = ndim;
    f->count = 1;
    for (size_t i = 0; i < ndim; ++i) f->count *= (f->shape[i] = shape[i]);
    size_t len = strlen(dir) + strlen(name) + 6;
    if (!(f->path = malloc(len))) return false;
    snprintf(f->path, len, "%s%s%s.npy", dir,
             dir[0] && dir[strlen(dir) - 1] == '/' ? "" : "/", name);
    ++g->count;
    return true;
}

static bool add_tensor(clmha__cli_grads *g, const char *dir, const char *name, int slot,
                       const clmha_tensor *t) {
    return add_file(g, dir, name, slot, t->ndim, t->shape);
}

bool clmha__cli_grads_add(clmha__cli_grads *g, const char *dir, const char *name, size_t ndim,
                          const size_t *shape) {
    return g->count < CLMHA__CLI_MAX_GRADS && ndim <= 4 &&
           add_file(g, dir, name, -1, ndim, shape);
}

bool clmha__cli_grads_plan(const char *dir, clmha_layer *layer, const clmha_forward_args *args,
                           bool key_file, bool value_file, clmha__cli_grads *g) {
    memset(g, 0, sizeof *g);
    clmha_layer_desc desc = {.struct_size = sizeof desc};
    clmha_layer_get_desc(layer, &desc);
    g->dtype = desc.dtype;
    size_t e = desc.embed_dim;
    bool ok = add_tensor(g, dir, "query", SLOT_QUERY, &args->query);
    if (ok && key_file) ok = add_tensor(g, dir, "key", SLOT_KEY, &args->key);
    if (ok && value_file) ok = add_tensor(g, dir, "value", SLOT_VALUE, &args->value);
    if (ok && clmha_layer_parameter_count(layer, "in_proj_weight")) {
        ok = add_file(g, dir, "in_proj_weight", SLOT_IN_PROJ_WEIGHT, 2, (size_t[]){3 * e, e});
    } else if (ok) {
        ok = add_file(g, dir, "q_proj_weight", SLOT_Q_PROJ_WEIGHT, 2, (size_t[]){e, e}) &&
             add_file(g, dir, "k_proj_weight", SLOT_K_PROJ_WEIGHT, 2, (size_t[]){e, desc.kdim}) &&
             add_file(g, dir, "v_proj_weight", SLOT_V_PROJ_WEIGHT, 2, (size_t[]){e, desc.vdim});
    }
    if (ok && desc.bias)
        ok = add_file(g, dir, "in_proj_bias", SLOT_IN_PROJ_BIAS, 1, (size_t[]){3 * e});
    if (ok)
        ok = add_file(g, dir, "out_proj.weight", SLOT_OUT_PROJ_WEIGHT, 2, (size_t[]){e, e});
    if (ok && desc.bias)
        ok = add_file(g, dir, "out_proj.bias", SLOT_OUT_PROJ_BIAS, 1, (size_t[]){e});
    if (ok && desc.add_bias_kv)
        ok = add_file(g, dir, "bias_k", SLOT_BIAS_K, 3, (size_t[]){1, 1, e}) &&
             add_file(g, dir, "bias_v", SLOT_BIAS_V, 3, (size_t[]){1, 1, e});
    if (ok && desc.sinks)
        ok = add_file(g, dir, "sinks", SLOT_SINKS, 1, (size_t[]){desc.num_heads});
    if (ok && args->attn_mask.kind == CLMHA_MASK_FLOAT)
        ok = add_tensor(g, dir, "attn_mask", SLOT_ATTN_MASK, &args->attn_mask.tensor);
    if (ok && args->key_padding_mask.kind == CLMHA_MASK_FLOAT)
        ok = add_tensor(g, dir, "key_padding_mask", SLOT_KEY_PADDING_MASK,
                        &args->key_padding_mask.tensor);
    // With --value alone, the key is the query's tensor given again: its gradient as the key
    // goes into query.npy too.
    if (ok && !key_file && args->key.ndim) g->file[0].with_key = true;
    if (!ok) {
        clmha__cli_report("run", "out of memory");
        clmha__cli_grads_free(g);
    }
    return ok;
}

size_t clmha__cli_grads_outputs(const clmha__cli_grads *g, clmha__cli_out *out) {
    for (size_t i = 0; i < g->count; ++i) {
        const clmha__cli_grad_file *f = &g->file[i];
        out[i] = (clmha__cli_out){.flag = "--grads-dir", .path = f->path, .data = f->data,
                                  .f64 = f->data64, .ndim = f->ndim,
                                  .half = g->dtype == CLMHA_DTYPE_F16 && !g->grad_f32};
        memcpy(out[i].shape, f->shape, sizeof f->shape);
    }
    return g->count;
}

bool clmha__cli_grads_compute(clmha_layer *layer, const clmha_forward_args *args,
                              clmha_saved *saved, clmha_tensor grad_output,
                              clmha_tensor grad_weights, clmha_impl impl, clmha__cli_grads *g) {
    clmha_backward_args b = {.struct_size = sizeof b, .forward = args, .saved = saved,
                             .grad_output = grad_output, .grad_weights = grad_weights,
                             .impl = impl,
                             .grad_dtype = g->grad_f32 ? CLMHA_GRAD_F32 : CLMHA_GRAD_LAYER};
    bool f64 = g->dtype == CLMHA_DTYPE_F64;  // double arrays (clmha_layer_backward_host_f64)
    size_t elem = f64 ? sizeof(double) : sizeof(float);
    for (size_t i = 0; i < g->count; ++i) {
        clmha__cli_grad_file *f = &g->file[i];
        if (f->with_key) {
            if (!(f->key_part = malloc((f->count ? f->count : 1) * elem))) goto oom;
            b.key.data = f->key_part;
        }
        void *data = malloc((f->count ? f->count : 1) * elem);
        if (!data) goto oom;
        if (f64) f->data64 = data;
        else f->data = data;
        slot_of(&b, f->slot)->data = data;
    }
    clmha_status st = f64 ? clmha_layer_backward_host_f64(layer, &b)
                          : clmha_layer_backward_host(layer, &b);
    if (st != CLMHA_SUCCESS) {
        clmha_context *ctx = clmha_layer_context(layer);
        clmha__cli_report("run", "backward pass failed on %s: %s: %s",
                          clmha_context_device_name(ctx), clmha_status_string(st),
                          clmha_context_last_error(ctx));
        return false;
    }
    for (size_t i = 0; i < g->count; ++i) {
        clmha__cli_grad_file *f = &g->file[i];
        // The tensor's two uses summed as autograd sums them: in the gradients' dtype.
        bool round = !g->grad_f32 && g->dtype != CLMHA_DTYPE_F32;
        for (size_t k = 0; f->with_key && k < f->count; ++k) {
            if (f64) {
                f->data64[k] += ((const double *)(const void *)f->key_part)[k];
                continue;
            }
            f->data[k] += f->key_part[k];
            if (round) f->data[k] = clmha__dtype_round(g->dtype, f->data[k]);
        }
    }
    return true;
oom:
    clmha__cli_report("run", "out of host memory for the gradients");
    return false;
}

void clmha__cli_grads_free(clmha__cli_grads *g) {
    for (size_t i = 0; i < g->count; ++i) {
        free(g->file[i].path);
        free(g->file[i].data);
        free(g->file[i].data64);
        free(g->file[i].key_part);
    }
    memset(g, 0, sizeof *g);
}
