// Training with clmha's forward and backward passes: STEPS steps of plain SGD on one fixed batch
// (tests/training/sgd.txt, written by tools/make_training_case.py: E=8, H=2, bias,
// cross-attention L=5 on S=6, N=3, a float (L, S) attn_mask with -inf entries, MSE loss
// against a fixed target), from the same float32 parameters and data as a PyTorch float64 run.
// Each step: forward with args.save, the loss and dL/dY = 2(Y - T)/count on the host, the
// backward pass into the parameters' gradients, p -= lr * g on the host, set_parameter.
// Asserted, for the fused core (need_weights off) and the unfused one:
//   - the loss of every step: |clmha - torch| <= TRAIN_LOSS_RTOL * torch;
//   - the final parameters: max |clmha - torch| <= TRAIN_PARAM_TOL * (1 + max |torch|) each.
// One line per core goes to stderr: training <impl> loss_maxrel=... param_maxnorm=...
// Also in 16-bit storage with float32 master weights (include/clmha.h, clmha_dtype): a bfloat16
// layer and a float16 one, whose parameters are set from the float32 masters each step
// (rounded by the layer), inputs rounded likewise, the gradients asked for as float32
// (CLMHA_GRAD_F32) and applied to the masters; float16 with loss scaling as PyTorch's
// GradScaler does it (dL/dY times 2^10, the gradients divided by it in float32). Asserted
// within TRAIN16_LOSS_RTOL and TRAIN16_PARAM_TOL of the float64 run.
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clmha.h"
#include "base/half.h"
#include "golden.h"
#include "support.h"

#ifndef CLMHA_TEST_DATA_DIR
#error "CLMHA_TEST_DATA_DIR (the path of tests/, a string) must be defined"
#endif

#define TRAIN_LOSS_RTOL 1e-4
#define TRAIN_PARAM_TOL 1e-4
#define TRAIN16_LOSS_RTOL 5e-3
#define TRAIN16_PARAM_TOL 5e-3
#define LOSS_SCALE 1024.0

static const char *const param_names[] = {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                          "out_proj.bias"};
enum { NUM_PARAMS = sizeof param_names / sizeof *param_names };

static const char *dtype_label(clmha_dtype t) {
    return t == CLMHA_DTYPE_BF16 ? "bfloat16" : t == CLMHA_DTYPE_F16 ? "float16" : "float32";
}

static const golden_tensor *need(const golden_case *gc, const char *name) {
    const golden_tensor *t = golden_find(gc, name);
    cr_assert_not_null(t, "tests/training/sgd.txt has no tensor %s", name);
    return t;
}

static clmha_tensor tensor_of(const golden_tensor *t) {
    clmha_tensor x = {.ndim = t->ndim, .data = t->f32};
    for (size_t i = 0; i < t->ndim; ++i) x.shape[i] = t->shape[i];
    return x;
}

static void train(clmha_impl impl, clmha_dtype dtype) {
    bool sixteen = dtype != CLMHA_DTYPE_F32;
    double scale_by = dtype == CLMHA_DTYPE_F16 ? LOSS_SCALE : 1.0;  // the loss scale
    double loss_tol = sixteen ? TRAIN16_LOSS_RTOL : TRAIN_LOSS_RTOL;
    double param_tol = sixteen ? TRAIN16_PARAM_TOL : TRAIN_PARAM_TOL;
    clmha_context *ctx = context_or_skip();
    char path[1024];
    snprintf(path, sizeof path, "%s/training/sgd.txt", CLMHA_TEST_DATA_DIR);
    golden_case gc;
    const char *err = golden_load(path, &gc);
    cr_assert_null(err, "%s: %s", path, err);

    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = gc.embed_dim,
                             .num_heads = gc.num_heads, .kdim = gc.kdim, .vdim = gc.vdim,
                             .bias = gc.bias, .dtype = dtype};
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    float *param[NUM_PARAMS], *grad[NUM_PARAMS];
    size_t count[NUM_PARAMS];
    for (int i = 0; i < NUM_PARAMS; ++i) {
        const golden_tensor *t = need(&gc, param_names[i]);
        count[i] = t->count;
        param[i] = alloc_floats(count[i]);
        grad[i] = alloc_floats(count[i]);
        memcpy(param[i], t->f32, count[i] * sizeof(float));
        cr_assert_eq(clmha_layer_set_parameter(layer, param_names[i], param[i], count[i]),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    }
    const golden_tensor *target = need(&gc, "target"), *loss_want = need(&gc, "loss");
    double lr = need(&gc, "lr")->f64[0];
    size_t steps = loss_want->count, n = target->count;

    clmha_saved *saved = NULL;
    cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
    clmha_forward_args args = {
        .struct_size = sizeof args,
        .query = tensor_of(need(&gc, "query")),
        .key = tensor_of(need(&gc, "key")),
        .value = tensor_of(need(&gc, "value")),
        .attn_mask = {.kind = CLMHA_MASK_FLOAT, .tensor = tensor_of(need(&gc, "attn_mask"))},
        .impl = impl,
        .save = saved,
    };
    clmha_backward_args b = {
        .struct_size = sizeof b, .forward = &args, .saved = saved,
        .grad_output = tensor_of(target),  // shape; data set below
        .in_proj_weight = {.data = grad[0]}, .in_proj_bias = {.data = grad[1]},
        .out_proj_weight = {.data = grad[2]}, .out_proj_bias = {.data = grad[3]},
        .impl = impl, .grad_dtype = CLMHA_GRAD_F32,
    };
    float *y = alloc_floats(n), *dy = alloc_floats(n);
    b.grad_output.data = dy;
    double loss_err = 0;
    for (size_t step = 0; step < steps; ++step) {
        cr_assert_eq(clmha_layer_forward_host(layer, &args, y, n, NULL, 0), CLMHA_SUCCESS,
                     "step %zu: %s", step, clmha_context_last_error(ctx));
        double loss = 0;
        for (size_t i = 0; i < n; ++i) {
            double d = (double)y[i] - target->f32[i];
            loss += d * d;
            dy[i] = (float)(scale_by * 2.0 * d / (double)n);
        }
        loss /= (double)n;
        double rel = fabs(loss - loss_want->f64[step]) / loss_want->f64[step];
        if (rel > loss_err) loss_err = rel;
        cr_expect_leq(rel, loss_tol, "%s %s step %zu: loss %.9g, torch %.9g",
                      clmha_impl_name(impl), dtype_label(dtype), step, loss,
                      loss_want->f64[step]);
        cr_assert_eq(clmha_layer_backward_host(layer, &b), CLMHA_SUCCESS, "step %zu: %s", step,
                     clmha_context_last_error(ctx));
        for (int i = 0; i < NUM_PARAMS; ++i) {
            for (size_t k = 0; k < count[i]; ++k) {
                cr_assert(isfinite(grad[i][k]), "step %zu: %s's gradient overflowed", step,
                          param_names[i]);
                param[i][k] -= (float)(lr * grad[i][k] / scale_by);
            }
            cr_assert_eq(clmha_layer_set_parameter(layer, param_names[i], param[i], count[i]),
                         CLMHA_SUCCESS);
        }
    }
    double param_err = 0;
    for (int i = 0; i < NUM_PARAMS; ++i) {
        char name[64];
        snprintf(name, sizeof name, "final.%s", param_names[i]);
        const golden_tensor *want = need(&gc, name);
        cr_assert_eq(want->count, count[i]);
        cr_assert_eq(clmha_layer_get_parameter(layer, param_names[i], grad[i], count[i]),
                     CLMHA_SUCCESS);
        for (size_t k = 0; sixteen && k < count[i]; ++k)  // the layer holds the dtype's values
            grad[i][k] = param[i][k] = clmha__dtype_round(dtype, param[i][k]);
        cr_expect_eq(max_abs_diff(grad[i], param[i], count[i]), 0.0,
                     "%s on the device differs from the host copy", param_names[i]);
        double scale = 0;
        for (size_t k = 0; k < count[i]; ++k) scale = fmax(scale, fabs(want->f64[k]));
        double e = max_abs_err(param[i], want->f64, count[i]) / (1 + scale);
        cr_expect_leq(e, param_tol, "%s %s: final %s: max abs error %.3e (normalised)",
                      clmha_impl_name(impl), dtype_label(dtype), param_names[i], e);
        if (e > param_err) param_err = e;
    }
    fprintf(stderr, "training %s %s steps=%zu loss %.6g -> %.6g loss_maxrel=%.3e "
            "param_maxnorm=%.3e\n",
            clmha_impl_name(impl), dtype_label(dtype), steps, loss_want->f64[0],
            loss_want->f64[steps - 1], loss_err,
            param_err);

    free(y);
    free(dy);
    for (int i = 0; i < NUM_PARAMS; ++i) free(param[i]), free(grad[i]);
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    golden_free(&gc);
}

Test(training, sgd_fused, .timeout = 300) { train(CLMHA_IMPL_FUSED, CLMHA_DTYPE_F32); }

Test(training, sgd_unfused, .timeout = 300) { train(CLMHA_IMPL_UNFUSED, CLMHA_DTYPE_F32); }

Test(training, sgd_bf16_master_weights, .timeout = 300) {
    train(CLMHA_IMPL_FUSED, CLMHA_DTYPE_BF16);
    train(CLMHA_IMPL_UNFUSED, CLMHA_DTYPE_BF16);
}

Test(training, sgd_f16_loss_scaling, .timeout = 300) {
    train(CLMHA_IMPL_FUSED, CLMHA_DTYPE_F16);
    train(CLMHA_IMPL_UNFUSED, CLMHA_DTYPE_F16);
}
