// Golden cases as clmha calls (golden_call.h).
#include "golden_call.h"

#include "support.h"

#include <stdio.h>
#include <string.h>

#ifndef CLMHA_GOLDEN_DIR
#error "CLMHA_GOLDEN_DIR (the path of tests/golden, a string) must be defined"
#endif

// The case names, written by tools/make_golden.py next to the case files.
const char *const golden_case_names[] = {
#include "golden/cases.inc"
};
const size_t golden_num_cases = sizeof golden_case_names / sizeof *golden_case_names;

static const char *const param_names[] = {
    "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
    "out_proj.weight", "out_proj.bias", "bias_k", "bias_v", "alibi_slopes", "sinks",
};
#define NUM_PARAM_NAMES (sizeof param_names / sizeof *param_names)

struct criterion_test_params golden_params(const char *suite) {
    case_stride stride = case_stride_get(suite, golden_num_cases);
    struct golden_param *params = cr_malloc(golden_num_cases * sizeof *params);
    if (!params) return cr_make_param_array(struct golden_param, NULL, 0);
    size_t n = 0;
    for (size_t i = 0; i < golden_num_cases; i++) {
        if (!case_stride_keeps(stride, i)) continue;
        memset(&params[n], 0, sizeof params[n]);
        snprintf(params[n].name, sizeof params[n].name, "%s", golden_case_names[i]);
        ++n;
    }
    return cr_make_param_array(struct golden_param, params, n, case_params_free);
}

void golden_load_case(const char *name, golden_case *gc) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.txt", CLMHA_GOLDEN_DIR, name);
    const char *err = golden_load(path, gc);
    cr_assert_null(err, "%s", err ? err : "");
    cr_assert_str_eq(gc->name, name, "%s: file names case '%s'", path, gc->name);
}

static const float *param_data(const golden_case *gc, const char *name) {
    const golden_tensor *t = golden_find(gc, name);
    // A float64 case's parameters are doubles, which clmha_reference_params (float32) cannot
    // hold: none are given (test_f64.c sets the layer's with clmha_layer_set_parameter_f64()).
    if (!t || gc->dtype == GOLDEN_LAYER_F64) return NULL;
    cr_assert_eq(t->dtype, GOLDEN_F32, "%s: parameter %s is not f32", gc->name, name);
    return t->f32;
}

static clmha_dtype layer_dtype(int dtype) {
    switch (dtype) {
    case GOLDEN_LAYER_F16: return CLMHA_DTYPE_F16;
    case GOLDEN_LAYER_BF16: return CLMHA_DTYPE_BF16;
    case GOLDEN_LAYER_F64: return CLMHA_DTYPE_F64;
    default: return CLMHA_DTYPE_F32;
    }
}

clmha_tensor golden_host_tensor(const golden_tensor *t) {
    clmha_tensor ct;
    memset(&ct, 0, sizeof ct);
    if (!t) return ct;  // ndim 0: absent
    ct.ndim = t->ndim;
    for (size_t d = 0; d < t->ndim; d++) ct.shape[d] = t->shape[d];
    switch (t->dtype) {
    case GOLDEN_F32: ct.data = t->f32; break;
    case GOLDEN_U8: ct.data = t->u8; break;
    case GOLDEN_F64: ct.data = t->f64; break;
    }
    return ct;
}

static clmha_mask_kind mask_kind(golden_mask_kind k) {
    switch (k) {
    case GOLDEN_MASK_NONE: return CLMHA_MASK_NONE;
    case GOLDEN_MASK_BOOL_IGNORE: return CLMHA_MASK_BOOL_IGNORE;
    case GOLDEN_MASK_BOOL_ATTEND: return CLMHA_MASK_BOOL_ATTEND;
    case GOLDEN_MASK_FLOAT: return CLMHA_MASK_FLOAT;
    }
    return CLMHA_MASK_NONE;
}

void golden_call_of(const golden_case *gc, golden_call *call) {
    memset(call, 0, sizeof *call);
    clmha_layer_desc *desc = &call->desc;
    desc->struct_size = sizeof *desc;
    desc->embed_dim = gc->embed_dim;
    desc->num_heads = gc->num_heads;
    desc->kdim = gc->kdim;
    desc->vdim = gc->vdim;
    desc->bias = gc->bias;
    desc->add_bias_kv = gc->add_bias_kv;
    desc->add_zero_attn = gc->add_zero_attn;
    desc->batch_first = gc->batch_first;
    desc->dropout = (float)gc->dropout;
    desc->num_kv_heads = gc->num_kv_heads;  // 0 (num_heads) unless a GQA case
    desc->dtype = layer_dtype(gc->dtype);
    desc->window = gc->window;  // the layer line's sliding window, if any
    desc->window_left = gc->window_left;
    desc->window_right = gc->window_right;
    desc->softcap = gc->softcap;  // the score variants; the slopes are a parameter (below)
    desc->alibi = gc->alibi;
    desc->sinks = gc->sinks;  // the sinks are a parameter too (below)

    clmha_forward_args *args = &call->args;
    args->struct_size = sizeof *args;
    args->query = golden_host_tensor(golden_find(gc, "query"));
    args->key = golden_host_tensor(golden_find(gc, "key"));      // absent: same as query
    args->value = golden_host_tensor(golden_find(gc, "value"));  // absent: same as key
    args->key_padding_mask.kind = mask_kind(gc->kpm);
    args->key_padding_mask.tensor = golden_host_tensor(golden_find(gc, "key_padding_mask"));
    args->attn_mask.kind = mask_kind(gc->attn);
    args->attn_mask.per_batch = gc->attn_per_batch;
    args->attn_mask.tensor = golden_host_tensor(golden_find(gc, "attn_mask"));
    args->is_causal = gc->is_causal;
    args->need_weights = gc->need_weights;
    args->per_head_weights = gc->per_head_weights;
    args->training = gc->training;

    clmha_reference_params *rp = &call->params;
    rp->struct_size = sizeof *rp;
    rp->in_proj_weight = param_data(gc, "in_proj_weight");
    rp->q_proj_weight = param_data(gc, "q_proj_weight");
    rp->k_proj_weight = param_data(gc, "k_proj_weight");
    rp->v_proj_weight = param_data(gc, "v_proj_weight");
    rp->in_proj_bias = param_data(gc, "in_proj_bias");
    rp->out_proj_weight = param_data(gc, "out_proj.weight");
    rp->out_proj_bias = param_data(gc, "out_proj.bias");
    rp->bias_k = param_data(gc, "bias_k");
    rp->bias_v = param_data(gc, "bias_v");
    rp->alibi_slopes = param_data(gc, "alibi_slopes");  // NULL: the geometric slopes
    rp->sinks = param_data(gc, "sinks");                // with sinks only
}

clmha_layer *golden_layer_create(clmha_context *ctx, const golden_case *gc,
                                 const clmha_layer_desc *desc) {
    clmha_layer *layer = NULL;
    clmha_status st = clmha_layer_create(&layer, ctx, desc);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_layer_create: %s: %s", gc->name,
                 clmha_status_string(st), clmha_context_last_error(ctx));
    for (size_t i = 0; i < NUM_PARAM_NAMES; i++) {
        const golden_tensor *t = golden_find(gc, param_names[i]);
        if (!t) continue;
        cr_assert_eq(t->dtype, GOLDEN_F32, "%s: parameter %s is not f32 (test_f64.c makes the"
                     " layers of float64 cases)", gc->name, param_names[i]);
        st = clmha_layer_set_parameter(layer, param_names[i], t->f32, t->count);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_layer_set_parameter(%s): %s: %s", gc->name,
                     param_names[i], clmha_status_string(st), clmha_context_last_error(ctx));
    }
    return layer;
}

// ---- gradients -------------------------------------------------------------------------------

#define GRAD_FIELD(file_name, field)                                                           \
    {file_name, offsetof(clmha_reference_grads, field), offsetof(clmha_backward_args, field)}

const golden_grad_field golden_grad_fields[] = {
    GRAD_FIELD("grad.query", query),
    GRAD_FIELD("grad.key", key),
    GRAD_FIELD("grad.value", value),
    GRAD_FIELD("grad.in_proj_weight", in_proj_weight),
    GRAD_FIELD("grad.q_proj_weight", q_proj_weight),
    GRAD_FIELD("grad.k_proj_weight", k_proj_weight),
    GRAD_FIELD("grad.v_proj_weight", v_proj_weight),
    GRAD_FIELD("grad.in_proj_bias", in_proj_bias),
    GRAD_FIELD("grad.out_proj.weight", out_proj_weight),
    GRAD_FIELD("grad.out_proj.bias", out_proj_bias),
    GRAD_FIELD("grad.bias_k", bias_k),
    GRAD_FIELD("grad.bias_v", bias_v),
    GRAD_FIELD("grad.attn_mask", attn_mask),
    GRAD_FIELD("grad.key_padding_mask", key_padding_mask),
    GRAD_FIELD("grad.sinks", sinks),
};
const size_t golden_num_grad_fields = sizeof golden_grad_fields / sizeof *golden_grad_fields;

double **golden_ref_grad(clmha_reference_grads *g, const golden_grad_field *f) {
    return (double **)((char *)g + f->ref_offset);
}

clmha_grad *golden_args_grad(clmha_backward_args *b, const golden_grad_field *f) {
    return (clmha_grad *)((char *)b + f->args_offset);
}

bool golden_grad_is_mask(const golden_grad_field *f) {
    return f->ref_offset == offsetof(clmha_reference_grads, attn_mask) ||
           f->ref_offset == offsetof(clmha_reference_grads, key_padding_mask);
}
