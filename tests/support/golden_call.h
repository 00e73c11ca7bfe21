// Golden cases (golden.h) as clmha calls: the layer descriptor, forward arguments and reference
// parameters a case describes, a device layer with its parameters, and the gradient tensors
// (grad.*) by the clmha fields they belong to. Shared by test_golden.c, test_backward_golden.c
// and test_backward.c; uses Criterion (a malformed case fails the calling test).
#ifndef CLMHA_TESTS_GOLDEN_CALL_H
#define CLMHA_TESTS_GOLDEN_CALL_H

#include <clmha.h>

#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include <stddef.h>

#include "golden.h"

// The case names of tests/golden/cases.inc and their number.
extern const char *const golden_case_names[];
extern const size_t golden_num_cases;

// The parameter of a suite parameterized by golden case: the name itself (no pointer), so that
// it is valid in the test's worker process.
struct golden_param {
    char name[GOLDEN_MAX_NAME];
};

// The parameters of such a suite (@p suite names it on stderr): every case, or those the case
// stride keeps (support.h).
struct criterion_test_params golden_params(const char *suite);

// A case's call. The tensors point into the golden_case, which must outlive it.
typedef struct golden_call {
    clmha_layer_desc desc;
    clmha_forward_args args;
    clmha_reference_params params;
} golden_call;

// Loads case @p name from CLMHA_GOLDEN_DIR into @p gc; fails the test when it cannot.
void golden_load_case(const char *name, golden_case *gc);

// The call case @p gc describes: the layer (its dtype, sliding window, softcap, alibi and sinks
// the case's), the inputs, masks and options, the parameters (alibi_slopes and sinks among them
// when the file has them; none for a float64 case: the reference takes float32 ones).
void golden_call_of(const golden_case *gc, golden_call *call);

// A host tensor of @p t (ndim 0 for NULL: absent).
clmha_tensor golden_host_tensor(const golden_tensor *t);

// A layer on @p ctx made from the case, with its parameters set; fails the test on error and
// for a float64 case (whose parameters are doubles).
clmha_layer *golden_layer_create(clmha_context *ctx, const golden_case *gc,
                                 const clmha_layer_desc *desc);

// The gradients a golden file may hold: the tensor name (grad.<PyTorch name>) and the offsets
// of the matching fields in clmha_reference_grads (double *) and clmha_backward_args
// (clmha_grad).
typedef struct golden_grad_field {
    const char *name;
    size_t ref_offset, args_offset;
} golden_grad_field;

extern const golden_grad_field golden_grad_fields[];
extern const size_t golden_num_grad_fields;

// The field's pointer in a clmha_reference_grads / its clmha_grad in clmha_backward_args.
double **golden_ref_grad(clmha_reference_grads *g, const golden_grad_field *f);
clmha_grad *golden_args_grad(clmha_backward_args *b, const golden_grad_field *f);

// true for grad.attn_mask and grad.key_padding_mask.
bool golden_grad_is_mask(const golden_grad_field *f);

#endif  // CLMHA_TESTS_GOLDEN_CALL_H
