// The backward pass of the layer (clmha_layer_backward()), in the order the gradients flow,
// the reverse of the forward pass:
//   validate → M = merge(O) (the saved attention result) → out_proj.weight: dYᵀ·M,
//   out_proj.bias: Σ dY, dM = dY·W_o → dO = split(dM)
//   → the attention core's backward (src/cores/): dQ, dK', dV' tiles and the mask gradients
//   → bias_k / bias_v: the appended row of dK' / dV', summed over the batch
//   → merge dQ, dK, dV into rows → in_proj_bias: column sums; W_q, W_k, W_v: dPᵀ·x;
//     the inputs: dP·W (summed into one gradient when key or value was not given).
// Everything is enqueued on the context's in-order queue; nothing here waits on the host.
// The host-array form is in backward_host.c.
#include "backward/backward.h"

#include "base/half.h"
#include "base/struct_in.h"
#include "context/gemm.h"
#include "context/programs.h"
#include "cores/core.h"
#include "cores/kernel_args.h"
#include "device/held.h"
#include "forward/convert.h"
#include "forward/enqueue.h"
#include "forward/forward.h"
#include "forward/saved.h"
#include "layer/mods.h"
#include "layer/packed.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>


typedef clmha__arg arg;
#define ARG CLMHA__ARG

// ---- the per-layer state: the kernels of cl/backward.cl ------------------------------------------

// The backward pass keeps no scratch of its own but a column of ones (counted in the layer's
// scratch): it works in the layer's (clmha__layer_reserve()),
// idle while it runs and exactly the sizes it needs: the projection buffer holds the rows of
// dM, then dQ (N*L, E), dK and dV (N*S, E); the head tiles hold dO and dQ (N*H, L, D), dK' and
// dV' (N*H, S', D). (The forward's tiles of a call that saved are in its clmha_saved.)
typedef struct state {
    cl_kernel merge_rows, appended_row_sums, sinks_grad;
    cl_mem ones;  // ones_cap floats of 1: the bias gradients' column sums are GEMMs with it
    size_t ones_cap;
    cl_mem drow;  // the unfused backward's D rows for the sinks' gradient (drow_cap floats)
    size_t drow_cap;
} state;

static void state_release(void *p) {
    state *s = p;
    if (!s) return;
    clmha__release_kernel(s->merge_rows);
    clmha__release_kernel(s->appended_row_sums);
    clmha__release_kernel(s->sinks_grad);
    clmha__release_mem(s->ones);
    clmha__release_mem(s->drow);
    free(s);
}

// The layer's backward state, made (kernels built) on the first call.
static clmha_status state_get(clmha_layer *l, state **out) {
    if (l->backward) {
        *out = l->backward;
        return CLMHA_SUCCESS;
    }
    state *s = calloc(1, sizeof *s);
    if (!s) return clmha__fail(l->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    cl_program prog;
    clmha_status st = clmha__program_get(l->ctx, "backward", clmha__layer_real_options(l), &prog);
    if (!st) st = clmha__kernel_make(l->ctx, prog, "merge_rows", &s->merge_rows);
    if (!st) st = clmha__kernel_make(l->ctx, prog, "appended_row_sums", &s->appended_row_sums);
    if (st) {
        state_release(s);
        return st;
    }
    l->backward = s;
    l->backward_release = state_release;
    *out = s;
    return CLMHA_SUCCESS;
}

// ---- the call's gradients ------------------------------------------------------------------------

// The gradients a call can ask for, in clmha_backward_args order.
enum {
    G_QUERY, G_KEY, G_VALUE, G_IN_W, G_Q_W, G_K_W, G_V_W, G_IN_B, G_OUT_W, G_OUT_B, G_BIAS_K,
    G_BIAS_V, G_ATTN, G_KPM, G_SINKS, G_COUNT
};

static const char *const grad_name[G_COUNT] = {
    "query", "key", "value", "in_proj_weight", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias", "bias_k", "bias_v",
    "attn_mask", "key_padding_mask", "sinks"};

const clmha_grad *clmha__backward_grad(const clmha_backward_args *a, int g) {
    const clmha_grad *const all[G_COUNT] = {
        &a->query, &a->key, &a->value, &a->in_proj_weight, &a->q_proj_weight, &a->k_proj_weight,
        &a->v_proj_weight, &a->in_proj_bias, &a->out_proj_weight, &a->out_proj_bias,
        &a->bias_k, &a->bias_v, &a->attn_mask, &a->key_padding_mask, &a->sinks};
    return g >= 0 && g < G_COUNT ? all[g] : NULL;
}

// A host-array call stages each gradient in a slot of its own (backward_host.c).
_Static_assert(G_COUNT <= CLMHA__HOST_COUNT - CLMHA__HOST_GRAD, "a staging slot per gradient");
// A 16-bit layer's call widens each gradient in a slot of its own (backward_converted()).
_Static_assert(G_COUNT <= CLMHA__STAGED_COUNT - CLMHA__STAGED_GRAD, "a float32 copy per gradient");

int clmha__backward_grad_count(void) { return G_COUNT; }

// Floats of gradient @p g for sizes @p d (0: the layer or call has no such gradient), and why
// not in *why.
static size_t grad_floats(const clmha_layer *l, const clmha__dims *d, int g, const char **why) {
    size_t e = l->e, kve = l->kve;  // kve: the key/value width (grouped-query attention)
    bool packed = d->kdim == e && d->vdim == e && kve == e;
    *why = NULL;
    switch (g) {
    case G_QUERY: return d->query_count;
    case G_KEY:
        *why = "key was not given (self-attention): the query's gradient holds all of it";
        return d->key_is_query ? 0 : d->key_count;
    case G_VALUE:
        *why = "value was not given: its gradient is part of key's (or query's)";
        return d->value_is_key ? 0 : d->value_count;
    case G_IN_W:
        *why = kve != e ? "the layer has no in_proj_weight (grouped-query attention): ask for "
                          "q_proj_weight, k_proj_weight and v_proj_weight"
                        : "the layer has no in_proj_weight (kdim or vdim differs from "
                          "embed_dim): ask for q_proj_weight, k_proj_weight and v_proj_weight";
        return packed ? 3 * e * e : 0;
    case G_Q_W: return e * e;
    case G_K_W: return kve * d->kdim;
    case G_V_W: return kve * d->vdim;
    case G_IN_B: *why = "the layer has no bias"; return l->desc.bias ? e + 2 * kve : 0;
    case G_OUT_W: return e * e;
    case G_OUT_B: *why = "the layer has no bias"; return l->desc.bias ? e : 0;
    case G_BIAS_K:
    case G_BIAS_V: *why = "the layer has no add_bias_kv"; return l->desc.add_bias_kv ? kve : 0;
    case G_ATTN:
        *why = "attn_mask is not a float mask (CLMHA_MASK_FLOAT): a boolean mask has no gradient";
        return d->attn_kind == CLMHA_MASK_FLOAT ? d->attn_count : 0;
    case G_KPM:
        *why = "key_padding_mask is not a float mask (CLMHA_MASK_FLOAT): a boolean mask has no "
               "gradient";
        return d->kpm_kind == CLMHA_MASK_FLOAT ? d->kpm_count : 0;
    case G_SINKS: *why = "the layer has no sinks"; return l->desc.sinks ? l->h : 0;
    default: return 0;
    }
}

size_t clmha__backward_grad_floats(const clmha_layer *l, const clmha__dims *d, int g) {
    const char *why;
    return grad_floats(l, d, g, &why);
}

static bool wanted(const clmha_grad *g, bool on_device) {
    return on_device ? g->buffer != NULL : g->data != NULL;
}

// ---- validation ----------------------------------------------------------------------------------

// Bytes of a device call's inputs, masks, grad_output and grad_weights: the layer's dtype's.
static size_t io_elem(const clmha_layer *l) { return clmha__dtype_size(l->desc.dtype); }

// Bytes of a device call's gradients: the layer's dtype's, or float32 with CLMHA_GRAD_F32.
static size_t grad_elem(const clmha_layer *l, const clmha_backward_args *a) {
    return a->grad_dtype == CLMHA_GRAD_F32 && l->rs == sizeof(float) ? sizeof(float)
                                                                      : io_elem(l);
}

// Checks a tensor's shape against the expected one.
static clmha_status check_shape(clmha_context *ctx, const char *name, const clmha_tensor *t,
                                size_t ndim, const size_t *shape) {
    bool ok = t->ndim == ndim;
    for (size_t i = 0; ok && i < ndim; ++i) ok = t->shape[i] == shape[i];
    if (ok) return CLMHA_SUCCESS;
    char want[96] = "", got[96] = "";
    for (size_t i = 0; i < ndim; ++i)
        snprintf(want + strlen(want), sizeof want - strlen(want), "%s%zu", i ? ", " : "",
                 shape[i]);
    for (size_t i = 0; i < t->ndim && i < 4; ++i)
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%zu", i ? ", " : "",
                 t->shape[i]);
    return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH, "%s is (%s), the call needs (%s)", name, got,
                       want);
}

// The forward arguments must be those of the saved call: same sizes and options.
static clmha_status check_same_call(clmha_context *ctx, const clmha_saved *sv,
                                    const clmha_forward_args *f, const clmha__dims *d) {
    const clmha__dims *s = &sv->dims;
    if (d->n != s->n || d->l != s->l || d->s != s->s || d->batched != s->batched ||
        d->key_is_query != s->key_is_query || d->value_is_key != s->value_is_key ||
        d->attn_sn != s->attn_sn || d->attn_sh != s->attn_sh || d->attn_si != s->attn_si ||
        d->attn_kind != s->attn_kind ||
        d->kpm_kind != s->kpm_kind)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "args->forward is not the call args->saved holds: it saved N %zu, "
                           "L %zu, S %zu%s%s with its masks; args->forward has N %zu, L %zu, "
                           "S %zu%s%s",
                           s->n, s->l, s->s, s->key_is_query ? ", no key" : "",
                           s->value_is_key ? ", no value" : "", d->n, d->l, d->s,
                           d->key_is_query ? ", no key" : "", d->value_is_key ? ", no value" : "");
    if (d->packed != sv->packed ||
        (d->packed && (memcmp(d->seq_lens, sv->lens, d->n * sizeof *sv->lens) ||
                       memcmp(d->kv_seq_lens, sv->lens + d->n, d->n * sizeof *sv->lens))))
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "args->forward is not the call args->saved holds: %s",
                           sv->packed ? "its sequence lengths differ" : "it is packed, the "
                           "saved call was not (or the reverse)");
    const char *diff = f->is_causal != sv->is_causal           ? "is_causal"
                       : f->need_weights != sv->need_weights   ? "need_weights"
                       : f->per_head_weights != sv->per_head_weights ? "per_head_weights"
                       : f->training != sv->training           ? "training"
                       : (f->training && (f->rng.seed != sv->rng.seed ||
                                          f->rng.offset != sv->rng.offset))
                           ? "rng"
                           : NULL;
    if (diff)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "args->forward differs from the saved call in %s: pass the forward "
                           "call's own arguments",
                           diff);
    return CLMHA_SUCCESS;
}

clmha_status clmha__backward_resolve(clmha_layer *l, const clmha_backward_args *a,
                                     clmha_forward_args *fwd, clmha__dims *d, bool on_device) {
    clmha_context *ctx = l->ctx;
    if (l->desc.dtype == CLMHA_DTYPE_F64 && a->grad_dtype == CLMHA_GRAD_F32)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "grad_dtype CLMHA_GRAD_F32 is for 16-bit layers: a float64 layer's "
                           "gradients are float64");
    clmha_status st16 = clmha__layer_mods_grad_check(l, "the backward pass");
    if (st16) return st16;
    if (a->grad_dtype != CLMHA_GRAD_LAYER && a->grad_dtype != CLMHA_GRAD_F32)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "grad_dtype %d is not CLMHA_GRAD_LAYER or CLMHA_GRAD_F32",
                           (int)a->grad_dtype);
    if (!a->forward) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "args->forward is NULL");
    char msg[512];
    clmha_status st = CLMHA__STRUCT_IN(clmha_forward_args, fwd, a->forward, "args->forward", msg,
                                       sizeof msg);
    if (st) return clmha__fail(ctx, st, "%s", msg);
    clmha_saved *sv = a->saved;
    if (!sv) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "args->saved is NULL");
    if (sv->layer != l)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "args->saved belongs to another layer");
    if (!sv->filled)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "args->saved holds no forward call: pass it as args.save to a "
                           "forward call first (a failed call leaves it empty)");
    // A device call's inputs are elements of the layer's dtype (a 16-bit layer's, 2 bytes).
    if ((st = on_device ? clmha__forward_check_call(l, fwd, d)
                        : clmha__forward_validate(l, fwd, false, d)) ||
        (on_device && (st = clmha__forward_check_inputs(l, fwd, d, io_elem(l)))))
        return st;
    if ((st = check_same_call(ctx, sv, fwd, d))) return st;
    // grad_output: the output's shape, which is the query's.
    if ((st = check_shape(ctx, "grad_output", &a->grad_output, fwd->query.ndim,
                          fwd->query.shape)))
        return st;
    if (a->grad_weights.ndim) {
        if (!fwd->need_weights)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "grad_weights is given but the forward call returned no weights "
                               "(need_weights off)");
        size_t shape[4], n = 0;
        if (d->batched) shape[n++] = d->n;
        if (fwd->per_head_weights) shape[n++] = d->h;
        shape[n++] = d->l;
        shape[n++] = d->s_padded;
        if ((st = check_shape(ctx, "grad_weights", &a->grad_weights, n, shape))) return st;
    }
    for (int g = 0; g < G_COUNT; ++g) {
        const clmha_grad *gr = clmha__backward_grad(a, g);
        if (!wanted(gr, on_device)) continue;
        const char *why;
        if (!grad_floats(l, d, g, &why))
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "a gradient of %s is asked for, but "
                               "%s", grad_name[g], why);
    }
    if (wanted(&a->in_proj_weight, on_device) &&
        (wanted(&a->q_proj_weight, on_device) || wanted(&a->k_proj_weight, on_device) ||
         wanted(&a->v_proj_weight, on_device)))
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "in_proj_weight's gradient and that of one of its blocks "
                           "(q/k/v_proj_weight) are both asked for: ask for one or the other");
    if (a->impl != CLMHA_IMPL_AUTO && a->impl != CLMHA_IMPL_FUSED &&
        a->impl != CLMHA_IMPL_UNFUSED)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "impl %d is not CLMHA_IMPL_AUTO, _FUSED or _UNFUSED", (int)a->impl);
    if (!on_device) {
        if (!a->grad_output.data)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "grad_output.data is NULL");
        if (a->grad_weights.ndim && !a->grad_weights.data)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "grad_weights.data is NULL");
    }
    return CLMHA_SUCCESS;
}

// The device buffers of a call: sizes, flags and overlaps.
static clmha_status check_buffers(clmha_layer *l, const clmha_backward_args *a,
                                  const clmha_forward_args *f, const clmha__dims *d) {
    clmha_context *ctx = l->ctx;
    clmha_status st;
    size_t io = io_elem(l), ge = grad_elem(l, a);
    if ((st = clmha__check_buffer(ctx, "grad_output", a->grad_output.buffer,
                                  a->grad_output.offset, d->output_count, io)))
        return st;
    size_t wcount = d->weights_count;
    if (a->grad_weights.ndim &&
        (st = clmha__check_buffer(ctx, "grad_weights", a->grad_weights.buffer,
                                  a->grad_weights.offset, wcount, io)))
        return st;
    clmha__span all[G_COUNT + 7];
    size_t n = 0;
    for (int g = 0; g < G_COUNT; ++g) {
        const clmha_grad *gr = clmha__backward_grad(a, g);
        if (!gr->buffer) continue;
        const char *why;
        size_t count = grad_floats(l, d, g, &why);
        if ((st = clmha__check_buffer(ctx, grad_name[g], gr->buffer, gr->offset, count, ge)) ||
            (st = clmha__check_writable(ctx, grad_name[g], gr->buffer)))
            return st;
        cl_mem_flags flags = 0;
        clGetMemObjectInfo(gr->buffer, CL_MEM_FLAGS, sizeof flags, &flags, NULL);
        if (gr->accumulate && (flags & CL_MEM_WRITE_ONLY))
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "%s's gradient accumulates but its buffer is CL_MEM_WRITE_ONLY",
                               grad_name[g]);
        all[n++] = clmha__span_of(grad_name[g], gr->buffer, gr->offset, count, ge);
    }
    size_t outputs = n;
    all[n++] = clmha__span_of("grad_output", a->grad_output.buffer, a->grad_output.offset,
                              d->output_count, io);
    if (a->grad_weights.ndim)
        all[n++] = clmha__span_of("grad_weights", a->grad_weights.buffer,
                                  a->grad_weights.offset, wcount, io);
    all[n++] = clmha__span_of("query", f->query.buffer, f->query.offset, d->query_count, io);
    if (!d->key_is_query)
        all[n++] = clmha__span_of("key", f->key.buffer, f->key.offset, d->key_count, io);
    if (!d->value_is_key)
        all[n++] = clmha__span_of("value", f->value.buffer, f->value.offset, d->value_count, io);
    if (d->kpm_kind)
        all[n++] = clmha__span_of("key_padding_mask", f->key_padding_mask.tensor.buffer,
                                  f->key_padding_mask.tensor.offset, d->kpm_count,
                                  d->kpm_kind == CLMHA_MASK_FLOAT ? io
                                                  : clmha__mask_elem(d->kpm_kind));
    if (d->attn_kind)
        all[n++] = clmha__span_of("attn_mask", f->attn_mask.tensor.buffer,
                                  f->attn_mask.tensor.offset, d->attn_count,
                                  d->attn_kind == CLMHA_MASK_FLOAT ? io
                                                  : clmha__mask_elem(d->attn_kind));
    return clmha__check_overlaps(ctx, all, n, outputs);
}

// ---- the stages ----------------------------------------------------------------------------------

// Row-major C (m, n) = op(A)·op(B) + beta·C, in the layer's elements (doubles for float64).
static clmha_status gemm(clmha_layer *l, const char *what, bool ta, bool tb, size_t m,
                         size_t n, size_t k, cl_mem a, size_t a_off, size_t lda, cl_mem b,
                         size_t b_off, size_t ldb, float beta, cl_mem c, size_t c_off,
                         size_t ldc) {
    clmha__gemm_op op = {.ta = ta, .tb = tb, .f64 = l->rs == sizeof(double), .m = m, .n = n,
                         .k = k, .alpha = 1.0, .beta = beta, .a = a, .a_off = a_off,
                         .lda = lda, .b = b, .b_off = b_off, .ldb = ldb, .c = c, .c_off = c_off,
                         .ldc = ldc};
    return clmha__gemm(l->ctx, what, &op);
}

// One call's working set.
typedef struct pass {
    clmha_layer *l;
    state *s;
    cl_mem rows;                   // the layer's projection buffer: rows of dM / dQ, dK, dV
    size_t rq_off, rk_off, rv_off;  // where those rows start in it (floats)
    const clmha_backward_args *a;
    const clmha_forward_args *f;
    const clmha__dims *d;
    const clmha_saved *sv;
    bool written[G_COUNT];  // this call has written the destination once (later parts add)
} pass;

// beta for the next product into gradient @p g: 1 when it accumulates or was written already.
static float beta_of(pass *p, int g) {
    float beta = clmha__backward_grad(p->a, g)->accumulate || p->written[g] ? 1.0f : 0.0f;
    p->written[g] = true;
    return beta;
}

// Merges the first @p seq rows of each plane of @p tiles into rows of p->rows from @p out_off,
// @p group heads summed into one (grouped-query attention: the gradient of a key/value head that
// @p group query heads repeated; 1 otherwise), rows of E / group floats.
static clmha_status merge_rows(pass *p, cl_mem tiles, size_t seq, size_t seq_pad,
                               size_t out_off, size_t group) {
    const clmha__dims *d = p->d;
    cl_ulong a_seq = seq, a_pad = seq_pad, off = out_off, ld = d->e / group, col0 = 0, n = d->n,
             h = d->h, g = group, hd = d->d;
    cl_uint bf = d->batch_first;
    arg args[] = {ARG(tiles), ARG(a_seq), ARG(a_pad), ARG(p->rows), ARG(off), ARG(ld),
                  ARG(col0),  ARG(n),     ARG(h),     ARG(g),       ARG(hd),  ARG(bf)};
    return clmha__launch(p->l->ctx, p->s->merge_rows, "merge_rows", d->n * seq * (d->h / group),
                         p->l->heads_wg, args, sizeof args / sizeof args[0]);
}

// Gradient @p g's @p width floats from element @p out_at = the sums of the columns of @p rows
// rows of x (leading dimension @p width) from @p x_off: the gradient of a bias added to every row, as the GEMM
// xᵀ·1 (a column sum in a kernel of its own ran several times slower on CPU devices than the
// host BLAS's product).
static clmha_status column_sums(pass *p, cl_mem x, size_t x_off, size_t rows, int g,
                                size_t out_at, size_t width) {
    clmha_layer *l = p->l;
    const clmha_grad *gr = clmha__backward_grad(p->a, g);
    // rows <= p->s->ones_cap: made before anything was enqueued
    return gemm(l, "bias gradient", true, false, width, 1, rows, x, x_off, width,
                p->s->ones, 0, 1, gr->accumulate ? 1.0f : 0.0f, gr->buffer, gr->offset + out_at,
                1);
}

static clmha_status appended_row(pass *p, cl_mem tiles, int g) {
    const clmha_grad *gr = clmha__backward_grad(p->a, g);
    const clmha__dims *d = p->d;
    cl_ulong pad = d->s_padded, row = d->s, n = d->n, h = d->h, hd = d->d, o = gr->offset;
    cl_ulong group = p->l->h / p->l->kvh;  // the repeated key/value heads' sum
    cl_uint acc = gr->accumulate;
    arg args[] = {ARG(tiles), ARG(pad), ARG(row), ARG(n), ARG(h), ARG(group), ARG(hd),
                  ARG(gr->buffer), ARG(o), ARG(acc)};
    return clmha__launch(p->l->ctx, p->s->appended_row_sums, "appended_row_sums", p->l->kve,
                         p->l->heads_wg, args, sizeof args / sizeof args[0]);
}

// 1. The output projection: out_proj.weight and .bias, and dM = dY·W_o split into dO tiles.
static clmha_status out_projection(pass *p) {
    clmha_layer *l = p->l;
    clmha_context *ctx = l->ctx;
    const clmha__dims *d = p->d;
    size_t rows = d->n * d->l, e = d->e;
    cl_mem dy = p->a->grad_output.buffer, m = p->rows;
    size_t dy_off = p->a->grad_output.offset, m_off = p->rq_off;
    clmha_status st;
    const clmha_grad *gw = &p->a->out_proj_weight, *gb = &p->a->out_proj_bias;
    if (gw->buffer) {  // dW_o (E, E) = dYᵀ · M, M the merged attention result
        if ((st = merge_rows(p, p->sv->tiles[CLMHA__TILE_OUT], d->l, d->l, m_off, 1)) ||
            (st = gemm(l, "out_proj.weight gradient", true, false, e, e, rows,
                       dy, dy_off, e, m, m_off, e, beta_of(p, G_OUT_W), gw->buffer, gw->offset,
                       e)))
            return st;
    }
    if (gb->buffer && (st = column_sums(p, dy, dy_off, rows, G_OUT_B, 0, e))) return st;
    if ((st = gemm(l, "attention result gradient", false, false, rows, e, e, dy,
                   dy_off, e, l->w_out, 0, e, 0.0f, m, m_off, e)))
        return st;
    cl_ulong zero = 0, one = 1, a_off = m_off, ld = e, n = d->n, h = d->h, t = d->l, hd = d->d;
    cl_uint no = 0, bf = d->batch_first;
    cl_mem dummy = ctx->dummy, out = l->tiles[CLMHA__TILE_OUT];
    arg args[] = {ARG(m),     ARG(a_off), ARG(ld),  ARG(zero), ARG(dummy), ARG(zero),
                  ARG(no),    ARG(dummy), ARG(zero), ARG(no),  ARG(out),   ARG(zero),
                  ARG(n),     ARG(h),     ARG(one), ARG(t),    ARG(t),    ARG(hd),    ARG(bf)};
    return clmha__launch_heads(l, l->split_heads, "split_heads", d->n * d->h, d->l, l->heads_wg,
                               args, sizeof args / sizeof args[0]);
}

// 3. The input projections, after the core's backward (2, core->backward()): in_proj_bias, the
// weights, the inputs.
static clmha_status in_projections(pass *p) {
    clmha_layer *l = p->l;
    const clmha__dims *d = p->d;
    const clmha_backward_args *a = p->a;
    const clmha_forward_args *f = p->f;
    // kve: the key and value projections' width; group: the query heads that repeat each
    // key/value head (grouped-query attention; E and 1 otherwise).
    size_t e = d->e, kve = l->kve, group = l->h / l->kvh, kd = d->kdim, vd = d->vdim;
    size_t rq = d->n * d->l, rkv = d->n * d->s;
    clmha_status st;
    cl_mem *t = l->tiles;
    if (a->bias_k.buffer && (st = appended_row(p, t[CLMHA__TILE_K], G_BIAS_K))) return st;
    if (a->bias_v.buffer && (st = appended_row(p, t[CLMHA__TILE_V], G_BIAS_V))) return st;
    if ((st = merge_rows(p, t[CLMHA__TILE_Q], d->l, d->l, p->rq_off, 1)) ||
        (st = merge_rows(p, t[CLMHA__TILE_K], d->s, d->s_padded, p->rk_off, group)) ||
        (st = merge_rows(p, t[CLMHA__TILE_V], d->s, d->s_padded, p->rv_off, group)))
        return st;
    if (a->in_proj_bias.buffer &&
        ((st = column_sums(p, p->rows, p->rq_off, rq, G_IN_B, 0, e)) ||
         (st = column_sums(p, p->rows, p->rk_off, rkv, G_IN_B, e, kve)) ||
         (st = column_sums(p, p->rows, p->rv_off, rkv, G_IN_B, e + kve, kve))))
        return st;
    // The inputs as the forward read them.
    cl_mem xq = f->query.buffer, xk = d->key_is_query ? xq : f->key.buffer;
    size_t xq_off = f->query.offset, xk_off = d->key_is_query ? xq_off : f->key.offset;
    cl_mem xv = d->value_is_key ? xk : f->value.buffer;
    size_t xv_off = d->value_is_key ? xk_off : f->value.offset;
    // Weight blocks: dW (E, feat) = dPᵀ (E, rows) · x (rows, feat), into in_proj_weight's rows or
    // the separate block.
    struct {
        int g;
        size_t dp_off;
        cl_mem x;
        size_t x_off, rows, feat, block, width;
    } w[3] = {{G_Q_W, p->rq_off, xq, xq_off, rq, e, 0, e},
              {G_K_W, p->rk_off, xk, xk_off, rkv, kd, 1, kve},
              {G_V_W, p->rv_off, xv, xv_off, rkv, vd, 2, kve}};
    static const char *const wname[3] = {"q_proj_weight gradient",
                                         "k_proj_weight gradient",
                                         "v_proj_weight gradient"};
    for (int i = 0; i < 3; ++i) {
        bool packed = a->in_proj_weight.buffer != NULL;
        int g = packed ? G_IN_W : w[i].g;
        const clmha_grad *gr = clmha__backward_grad(a, g);
        if (!gr->buffer) continue;
        size_t off = gr->offset + (packed ? w[i].block * e * e : 0);
        float beta = gr->accumulate ? 1.0f : 0.0f;
        if ((st = gemm(l, wname[i], true, false, w[i].width, w[i].feat, w[i].rows, p->rows,
                       w[i].dp_off, w[i].width, w[i].x, w[i].x_off, w[i].feat, beta, gr->buffer,
                       off, w[i].feat)))
            return st;
    }
    // The inputs: dx (rows, feat) = dP (rows, E) · W (E, feat); key's and value's parts go to
    // the tensor they came from.
    int target[3] = {G_QUERY, d->key_is_query ? G_QUERY : G_KEY, 0};
    target[2] = d->value_is_key ? target[1] : G_VALUE;
    size_t w_off[3] = {0, e * e, e * e + kve * kd};
    static const char *const xname[3] = {"query gradient",
                                         "key gradient",
                                         "value gradient"};
    for (int i = 0; i < 3; ++i) {
        const clmha_grad *gr = clmha__backward_grad(a, target[i]);
        if (!gr->buffer) continue;
        if ((st = gemm(l, xname[i], false, false, w[i].rows, w[i].feat, w[i].width, p->rows,
                       w[i].dp_off, w[i].width, l->w_in, w_off[i], w[i].feat,
                       beta_of(p, target[i]), gr->buffer, gr->offset, w[i].feat)))
            return st;
    }
    return CLMHA_SUCCESS;
}

// ---- a packed call -------------------------------------------------------------------------------

// A packed call (clmha_forward_args::seq_lens; its forward in forward.c), checked as one call by
// clmha_layer_backward(): one backward call per sequence on its saved part, its rows of
// grad_output and of the inputs' gradients (keys that no query sees get zeros); the
// parameters' gradients (and the sinks') of the sequences are summed into their destinations in
// the sequences' order (the first overwrites unless the caller accumulates).

// @p g moved to row @p row0 of @p feat-wide rows.
static void rows_at(clmha_grad *g, size_t row0, size_t feat) {
    g->offset += row0 * feat;
    if (g->data) g->data += row0 * feat;
}

// Zeros @p rows rows of @p feat floats from row @p row0 of gradient @p g (when asked for and
// not accumulated).
static clmha_status zero_rows(clmha_layer *layer, const clmha_grad *g, size_t row0, size_t rows,
                              size_t feat, size_t elem) {
    if (!g->buffer || g->accumulate || !rows) return CLMHA_SUCCESS;
    double zero = 0.0;  // as many of its zero bytes as an element has (2, 4 or 8)
    cl_int err = clEnqueueFillBuffer(layer->ctx->queue, g->buffer, &zero, elem,
                                     (g->offset + row0 * feat) * elem, rows * feat * elem, 0,
                                     NULL, NULL);
    return err ? clmha__cl_fail(layer->ctx, err, "clEnqueueFillBuffer(gradient rows)")
               : CLMHA_SUCCESS;
}

static clmha_status backward_packed(clmha_layer *layer, const clmha_backward_args *args,
                                    const clmha_forward_args *f, const clmha__dims *d,
                                    cl_uint num_wait, const cl_event *wait_list,
                                    cl_event *event) {
    const clmha_saved *sv = args->saved;
    clmha__packed_at at = {0, 0};
    bool first = true;
    size_t io = io_elem(layer), ge = grad_elem(layer, args);
    clmha_status st;
    if ((st = clmha__enqueue_wait(layer->ctx, num_wait, wait_list))) return st;
    for (size_t i = 0; i < d->n; at = clmha__packed_next(d, i, at), ++i) {
        if (!d->seq_lens[i]) {  // keys that no query sees: their gradient is zero
            if ((st = zero_rows(layer, &args->key, at.k0, d->kv_seq_lens[i], d->kdim, ge)) ||
                (st = zero_rows(layer, &args->value, at.k0, d->kv_seq_lens[i], d->vdim, ge)))
                return st;
            continue;
        }
        clmha_forward_args sub_f;
        clmha__packed_args(d, f, i, at, io, &sub_f);
        clmha_backward_args sub = *args;
        sub.forward = &sub_f;
        sub.saved = sv->parts[i];
        clmha__packed_cut(&sub.grad_output, at.q0, d->seq_lens[i], d->e, io);
        rows_at(&sub.query, at.q0, d->e);
        rows_at(&sub.key, at.k0, d->kdim);
        rows_at(&sub.value, at.k0, d->vdim);
        if (!first) {  // the parameters' gradients add up over the sequences
            clmha_grad *sums[] = {&sub.in_proj_weight, &sub.q_proj_weight, &sub.k_proj_weight,
                                  &sub.v_proj_weight, &sub.in_proj_bias, &sub.out_proj_weight,
                                  &sub.out_proj_bias, &sub.bias_k, &sub.bias_v, &sub.sinks};
            for (size_t j = 0; j < sizeof sums / sizeof sums[0]; ++j) sums[j]->accumulate = true;
        }
        if ((st = clmha_layer_backward(layer, &sub, 0, NULL, NULL))) return st;
        first = false;
    }
    return clmha__enqueue_event(layer->ctx, event);
}

// ---- the public entry point ----------------------------------------------------------------------

static clmha_status args_in(clmha_context *ctx, clmha_backward_args *in,
                            const clmha_backward_args **args) {
    char msg[512];
    clmha_status st = CLMHA__STRUCT_IN(clmha_backward_args, in, *args, "args", msg, sizeof msg);
    if (st) return clmha__fail(ctx, st, "%s", msg);
    *args = in;
    return CLMHA_SUCCESS;
}

static clmha_status backward_run(clmha_layer *layer, const clmha_backward_args *args,
                                 const clmha_forward_args *f, const clmha__dims *d,
                                 cl_uint num_wait, const cl_event *wait_list, cl_event *event);

// A 16-bit layer's call: its inputs, float masks, grad_output and grad_weights widened into the
// layer's float32 copies, the float32 pass over those with its gradients in float32 copies of
// their own (holding the caller's widened values where they accumulate), each then narrowed
// into the caller's buffer; or, with CLMHA_GRAD_F32, written into the caller's float32 buffers
// by the pass itself.
static clmha_status backward_converted(clmha_layer *layer, const clmha_backward_args *args,
                                       const clmha_forward_args *f, const clmha__dims *d,
                                       cl_uint num_wait, const cl_event *wait_list,
                                       cl_event *event) {
    clmha_forward_args f32 = *f;
    clmha_backward_args b = *args;
    b.forward = &f32;
    bool narrow = args->grad_dtype != CLMHA_GRAD_F32;
    clmha_status st;
    if ((st = clmha__enqueue_wait(layer->ctx, num_wait, wait_list)) ||
        (st = clmha__convert_inputs(layer, d, &f32)) ||
        (st = clmha__convert_in(layer, CLMHA__STAGED_GRAD_OUTPUT, "float32 grad_output",
                                args->grad_output.buffer, args->grad_output.offset,
                                d->output_count, &b.grad_output.buffer)))
        return st;
    b.grad_output.offset = 0;
    if (args->grad_weights.ndim) {
        if ((st = clmha__convert_in(layer, CLMHA__STAGED_GRAD_WEIGHTS, "float32 grad_weights",
                                    args->grad_weights.buffer, args->grad_weights.offset,
                                    d->weights_count, &b.grad_weights.buffer)))
            return st;
        b.grad_weights.offset = 0;
    }
    for (int g = 0; narrow && g < G_COUNT; ++g) {
        clmha_grad *to = (clmha_grad *)clmha__backward_grad(&b, g);
        if (!to->buffer) continue;
        size_t count = clmha__backward_grad_floats(layer, d, g);
        if ((st = to->accumulate
                      ? clmha__convert_in(layer, CLMHA__STAGED_GRAD + g, "float32 gradient",
                                          to->buffer, to->offset, count, &to->buffer)
                      : clmha__convert_result(layer, CLMHA__STAGED_GRAD + g, "float32 gradient",
                                              count, &to->buffer)))
            return st;
        to->offset = 0;
    }
    if ((st = backward_run(layer, &b, &f32, d, 0, NULL, NULL))) return st;
    for (int g = 0; narrow && g < G_COUNT; ++g) {
        const clmha_grad *to = clmha__backward_grad(args, g);
        if (to->buffer &&
            (st = clmha__convert_out(layer, CLMHA__STAGED_GRAD + g, to->buffer, to->offset,
                                     clmha__backward_grad_floats(layer, d, g))))
            return st;
    }
    return clmha__enqueue_event(layer->ctx, event);
}

clmha_status clmha_layer_backward(clmha_layer *layer, const clmha_backward_args *args,
                                  cl_uint num_wait, const cl_event *wait_list, cl_event *event) {
    if (event) *event = NULL;
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    clmha_backward_args in;
    clmha_status st = args_in(ctx, &in, &args);
    if (st) return st;
    if ((st = clmha__check_wait_list(ctx, num_wait, wait_list))) return st;
    clmha_forward_args f;
    clmha__dims d;
    if ((st = clmha__backward_resolve(layer, args, &f, &d, true)) ||
        (st = check_buffers(layer, args, &f, &d)))
        return st;
    if (d.packed)  // one backward call per sequence
        return backward_packed(layer, args, &f, &d, num_wait, wait_list, event);
    if (io_elem(layer) != layer->rs)  // a 16-bit layer's: on float32 copies
        return backward_converted(layer, args, &f, &d, num_wait, wait_list, event);
    return backward_run(layer, args, &f, &d, num_wait, wait_list, event);
}

// A checked call on the layer's own elements (or a 16-bit layer's float32 copies).
static clmha_status backward_run(clmha_layer *layer, const clmha_backward_args *args,
                                 const clmha_forward_args *fp, const clmha__dims *dp,
                                 cl_uint num_wait, const cl_event *wait_list, cl_event *event) {
    clmha_context *ctx = layer->ctx;
    const clmha_forward_args f = *fp;
    const clmha__dims d = *dp;
    clmha_status st;
    state *s = NULL;
    if ((st = state_get(layer, &s))) return st;
    const clmha_saved *sv = args->saved;
    clmha__backward_call call = {
        .args = &f, .dims = &d, .q = sv->tiles[CLMHA__TILE_Q], .k = sv->tiles[CLMHA__TILE_K],
        .v = sv->tiles[CLMHA__TILE_V], .o = sv->tiles[CLMHA__TILE_OUT],
        .lse = sv->has_lse ? sv->lse : NULL, .grad_weights = args->grad_weights.buffer,
        .grad_weights_offset = args->grad_weights.offset, .grad_attn_mask = args->attn_mask.buffer,
        .grad_attn_offset = args->attn_mask.offset,
        .grad_attn_accumulate = args->attn_mask.accumulate,
        .grad_kpm = args->key_padding_mask.buffer, .grad_kpm_offset = args->key_padding_mask.offset,
        .grad_kpm_accumulate = args->key_padding_mask.accumulate};
    if (!args->grad_weights.ndim) call.grad_weights = NULL;
    call.impl = args->impl;
    call.fell_back = sv->fell_back;
    call.lse_split_rows = sv->has_lse && sv->lse_split ? d.n * layer->h * d.l : 0;
    const clmha__core *core;
    if ((st = clmha__backward_select(layer, &call, &core))) return st;
    // The layer's scratch, sized for this call before the core sees it (a core that reserves
    // the scores, clmha__layer_reserve(), then grows nothing else).
    if ((st = clmha__layer_reserve(layer, &d, false, false))) return st;
    if ((args->in_proj_bias.buffer || args->out_proj_bias.buffer) &&
        (st = clmha__layer_grow_ones(layer, &s->ones, &s->ones_cap,
                                     d.n * (d.l > d.s ? d.l : d.s), "backward column of ones")))
        return st;
    // With a weights' gradient and the sinks' asked for, D = sum_j P dP rows from the core.
    if (args->sinks.buffer && call.grad_weights &&
        (st = clmha__layer_grow(layer, &s->drow, &s->drow_cap, d.n * layer->h * d.l,
                                 "backward D rows")))
        return st;
    call.drow = args->sinks.buffer && call.grad_weights ? s->drow : NULL;
    call.d_o = layer->tiles[CLMHA__TILE_OUT];
    call.dq = layer->tiles[CLMHA__TILE_Q];
    call.dk = layer->tiles[CLMHA__TILE_K];
    call.dv = layer->tiles[CLMHA__TILE_V];

    // Nothing is enqueued before this point.
    if ((st = clmha__enqueue_wait(ctx, num_wait, wait_list))) return st;
    size_t rq = d.n * d.l * d.e, rkv = d.n * d.s * layer->kve;
    pass p = {.l = layer, .s = s, .rows = layer->proj, .rq_off = 0, .rk_off = rq,
              .rv_off = rq + rkv, .a = args, .f = &f, .d = &d, .sv = sv};
    if ((st = out_projection(&p)) || (st = core->backward(layer, &call)))
        return st;
    if (args->sinks.buffer) {  // from the saved log-sum-exp rows, which hold the sinks' term
        if (!call.lse)
            return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                               "the sinks' gradient needs the forward's log-sum-exp rows, "
                               "which its core did not write");
        if ((st = clmha__sinks_grad(layer, &s->sinks_grad, call.o, call.d_o, call.lse, 0,
                                    call.drow, layer->sinks, 0, args->sinks.buffer,
                                    args->sinks.offset, args->sinks.accumulate, d.n, d.l)))
            return st;
    }
    if ((st = in_projections(&p))) return st;
    return clmha__enqueue_event(ctx, event);
}

clmha_status clmha__sinks_grad(clmha_layer *l, cl_kernel *kernel, cl_mem o, cl_mem d_o,
                               cl_mem lse,
                               size_t lse_off, cl_mem drow, cl_mem sinks, size_t sinks_off,
                               cl_mem out,
                               size_t out_off, bool accumulate, size_t n, size_t len) {
    cl_program prog;
    clmha_status st;
    if (!*kernel && ((st = clmha__program_get(l->ctx, "backward", clmha__layer_real_options(l),
                                              &prog)) ||
                     (st = clmha__kernel_make(l->ctx, prog, "sinks_grad", kernel))))
        return st;
    cl_ulong loff = lse_off, soff = sinks_off, ooff = out_off, nb = n, heads = l->h, tl = len,
             hd = l->d;
    cl_uint acc = accumulate, has_drow = drow != NULL;
    cl_mem dr = drow ? drow : l->ctx->dummy;
    arg args[] = {ARG(o),    ARG(d_o), ARG(lse), ARG(loff),  ARG(dr), ARG(has_drow),
                  ARG(sinks), ARG(soff), ARG(out), ARG(ooff), ARG(acc), ARG(nb),
                  ARG(heads), ARG(tl),   ARG(hd)};
    return clmha__launch(l->ctx, *kernel, "sinks_grad", l->h, 1, args,
                         sizeof args / sizeof args[0]);
}
