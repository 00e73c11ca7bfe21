// Golden gradients of the CPU reference: for every case of tests/golden, clmha_reference_backward()
// with the case's grad_output (and grad_weights with need_weights) must give every grad.* tensor
// of the file (PyTorch autograd in float64, or on fully masked rows the generator's own float64
// implementation with clmha's zero rule, tools/make_golden.py) within
//   |ref - golden| <= REF_TOL (1 + max|golden|)   per tensor,
// the bound test_golden.c uses for the forward reference. --verbose logs the error of every
// tensor and, at the end, the largest error of each gradient over all cases. The device's
// backward pass is checked against the same files by test_backward.c.
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "clmha.h"
#include "golden.h"
#include "golden_call.h"
#include "support.h"

#define REF_TOL 1e-9

// Checks one case; raises worst_abs / worst_rel (per gradient field) and the tensor count.
static void check_case(const char *name, double *worst_abs, double *worst_rel, size_t *tensors) {
    golden_case gc;
    golden_load_case(name, &gc);
    golden_call call;
    golden_call_of(&gc, &call);
    const golden_tensor *go = golden_find(&gc, "grad_output");
    const golden_tensor *gw = golden_find(&gc, "grad_weights");
    cr_assert_not_null(go, "%s: no grad_output", name);
    cr_assert_eq(gw != NULL, gc.need_weights, "%s: grad_weights present iff need_weights", name);

    // Every grad.* of the file gets a destination; there is no other gradient to ask for.
    clmha_reference_grads grads = {.struct_size = sizeof grads};
    double *got[32] = {0};
    const golden_tensor *want[32] = {0};
    for (size_t f = 0; f < golden_num_grad_fields; f++) {
        want[f] = golden_find(&gc, golden_grad_fields[f].name);
        if (!want[f]) continue;
        cr_assert_eq(want[f]->dtype, GOLDEN_F64, "%s: %s is not f64", name, want[f]->name);
        got[f] = malloc(want[f]->count * sizeof *got[f]);
        cr_assert_not_null(got[f]);
        for (size_t i = 0; i < want[f]->count; i++) got[f][i] = NAN;
        *golden_ref_grad(&grads, &golden_grad_fields[f]) = got[f];
    }
    size_t in_file = 0;
    for (size_t t = 0; t < gc.num_tensors; t++)
        if (!strncmp(gc.tensors[t].name, "grad.", 5)) ++in_file;

    char msg[512] = "";
    clmha_status st = clmha_reference_backward(&call.desc, &call.params, &call.args, go->f32,
                                               gw ? gw->f32 : NULL, &grads, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_reference_backward: %s: %s", name,
                 clmha_status_string(st), msg);
    size_t checked = 0;
    for (size_t f = 0; f < golden_num_grad_fields; f++) {
        if (!want[f]) continue;
        double err = max_abs_err_d(got[f], want[f]->f64, want[f]->count);
        double rel = err / (1.0 + max_abs_of(want[f]->f64, want[f]->count));
        cr_log_info("backward_golden %s %s max_abs=%.3e rel=%.3e", name, want[f]->name, err,
                    rel);
        cr_expect_leq(rel, REF_TOL, "%s: %s: error %.3e > %.0e (1 + max|golden|)", name,
                      want[f]->name, err, REF_TOL);
        worst_abs[f] = fmax(worst_abs[f], err);
        worst_rel[f] = fmax(worst_rel[f], rel);
        ++checked;
        free(got[f]);
    }
    cr_expect_eq(checked, in_file, "%s: %zu grad.* tensors in the file, %zu known", name,
                 in_file, checked);
    cr_expect_geq(checked, 3, "%s: too few gradients (%zu)", name, checked);
    *tensors += checked;
    golden_free(&gc);
}

Test(backward_golden, reference, .timeout = 300) {
    double worst_abs[32] = {0}, worst_rel[32] = {0};
    size_t tensors = 0;
    for (size_t c = 0; c < golden_num_cases; c++)
        check_case(golden_case_names[c], worst_abs, worst_rel, &tensors);
    for (size_t f = 0; f < golden_num_grad_fields; f++)
        cr_log_info("backward_golden all cases %s max_abs=%.3e max_rel=%.3e",
                    golden_grad_fields[f].name, worst_abs[f], worst_rel[f]);
    cr_log_info("backward_golden: %zu cases, %zu gradient tensors", golden_num_cases, tensors);
}
