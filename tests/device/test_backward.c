// The device backward pass against the golden gradients: for every case of tests/golden and for
// each built-in core (suite backward_device, tests `unfused` and `fused`), a forward call
// clmha_layer_forward_host() saving into a clmha_saved, then clmha_layer_backward_host() with the
// same arguments, the case's grad_output (and grad_weights) and a destination for every grad.*
// tensor of the file, which every gradient must match within
//   |device - golden| <= DEVICE_TOL (1 + max|golden|)   per tensor.
// The fused backward neither takes a weights gradient nor returns mask gradients: for cases
// with need_weights or a float mask it runs the call without weights and without mask
// gradients, and is compared with clmha_reference_backward() of that call instead (the golden
// gradients do not apply to it). --verbose logs the error of every tensor. Skipped without an OpenCL device.
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "clmha.h"
#include "golden.h"
#include "golden_call.h"
#include "support.h"

#define DEVICE_TOL 1e-4
#define MAX_FIELDS 32

static bool has_float_mask(const golden_case *gc) {
    return gc->kpm == GOLDEN_MASK_FLOAT || gc->attn == GOLDEN_MASK_FLOAT;
}

static void run_case(clmha_context *ctx, const char *name, clmha_impl impl) {
    golden_case gc;
    golden_load_case(name, &gc);
    golden_call call;
    golden_call_of(&gc, &call);
    const golden_tensor *go = golden_find(&gc, "grad_output");
    const golden_tensor *gw = golden_find(&gc, "grad_weights");
    cr_assert_not_null(go, "%s: no grad_output", name);
    // Against the golden gradients, or (fused, weights or float masks) against the reference
    // backward pass of the call without weights and mask gradients.
    const bool golden = impl != CLMHA_IMPL_FUSED || (!gc.need_weights && !has_float_mask(&gc));
    clmha_forward_args fwd = call.args;
    if (!golden) fwd.need_weights = false, fwd.per_head_weights = false, gw = NULL;

    size_t count[MAX_FIELDS] = {0};
    const double *want[MAX_FIELDS] = {0};
    double *ref[MAX_FIELDS] = {0};
    clmha_reference_grads ref_grads = {.struct_size = sizeof ref_grads};
    for (size_t f = 0; f < golden_num_grad_fields; f++) {
        const golden_tensor *t = golden_find(&gc, golden_grad_fields[f].name);
        if (!t || (!golden && golden_grad_is_mask(&golden_grad_fields[f]))) continue;
        count[f] = t->count;
        if (golden) {
            want[f] = t->f64;
        } else {
            ref[f] = malloc(t->count * sizeof *ref[f]);
            cr_assert_not_null(ref[f]);
            *golden_ref_grad(&ref_grads, &golden_grad_fields[f]) = ref[f];
            want[f] = ref[f];
        }
    }
    if (!golden) {
        char msg[512] = "";
        clmha_status st = clmha_reference_backward(&call.desc, &call.params, &fwd, go->f32, NULL,
                                                   &ref_grads, msg, sizeof msg);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_reference_backward: %s: %s", name,
                     clmha_status_string(st), msg);
    }

    clmha_layer *layer = golden_layer_create(ctx, &gc, &call.desc);
    clmha_saved *saved = NULL;
    clmha_status st = clmha_saved_create(&saved, layer);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_saved_create: %s: %s", name,
                 clmha_status_string(st), clmha_context_last_error(ctx));

    // The forward call, saving what the backward pass needs.
    size_t n_out = 0, n_w = 0;
    fwd.save = saved;
    fwd.impl = impl;
    st = clmha_layer_output_counts(layer, &fwd, &n_out, &n_w);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_layer_output_counts: %s: %s", name,
                 clmha_status_string(st), clmha_context_last_error(ctx));
    float *out = alloc_floats(n_out);
    float *w = alloc_floats(n_w);
    st = clmha_layer_forward_host(layer, &fwd, out, n_out, n_w ? w : NULL, n_w);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_layer_forward_host (impl %s): %s: %s", name,
                 clmha_impl_name(impl), clmha_status_string(st), clmha_context_last_error(ctx));

    // The backward call: every gradient the comparison has.
    clmha_backward_args b;
    memset(&b, 0, sizeof b);
    b.struct_size = sizeof b;
    b.forward = &fwd;
    b.saved = saved;
    b.grad_output = golden_host_tensor(go);
    b.grad_weights = golden_host_tensor(gw);
    b.impl = impl;
    float *dev[MAX_FIELDS] = {0};
    for (size_t f = 0; f < golden_num_grad_fields; f++) {
        if (!want[f]) continue;
        dev[f] = alloc_floats(count[f]);
        for (size_t i = 0; i < count[f]; i++) dev[f][i] = NAN;  // catches entries never written
        golden_args_grad(&b, &golden_grad_fields[f])->data = dev[f];
    }
    st = clmha_layer_backward_host(layer, &b);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_layer_backward_host (impl %s): %s: %s", name,
                 clmha_impl_name(impl), clmha_status_string(st), clmha_context_last_error(ctx));

    for (size_t f = 0; f < golden_num_grad_fields; f++) {
        if (!want[f]) continue;
        double err = max_abs_err(dev[f], want[f], count[f]);
        double rel = err / (1.0 + max_abs_of(want[f], count[f]));
        cr_log_info("backward_device %s %s %s%s max_abs=%.3e rel=%.3e", name,
                    clmha_impl_name(impl), golden_grad_fields[f].name,
                    golden ? "" : " (vs reference, no weights)", err, rel);
        cr_expect_leq(rel, DEVICE_TOL, "%s: %s: %s error %.3e > %.0e (1 + max|want|)", name,
                      clmha_impl_name(impl), golden_grad_fields[f].name, err, DEVICE_TOL);
        free(dev[f]);
        free(ref[f]);
    }
    free(out);
    free(w);
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    golden_free(&gc);
}

// Every case (CLMHA_TEST_CASE_STRIDE selects a subset) on one context: a process per case would
// spend most of its time creating the context and loading the GEMM kernels.
static void run_all(clmha_impl impl) {
    clmha_context *ctx = context_or_skip();
    case_stride stride = case_stride_get("backward_device", golden_num_cases);
    for (size_t i = 0; i < golden_num_cases; i++) {
        if (!case_stride_keeps(stride, i)) continue;
        run_case(ctx, golden_case_names[i], impl);
    }
    clmha_context_release(ctx);
}

Test(backward_device, unfused, .timeout = 600) { run_all(CLMHA_IMPL_UNFUSED); }

Test(backward_device, fused, .timeout = 600) { run_all(CLMHA_IMPL_FUSED); }
