// What the device fuzz targets (target_backward_args.c, target_kv_ops.c, target_variants.c)
// share: the input reader, the process's one OpenCL context, small layers with random
// parameters (the same values given to the CPU reference) and the comparison with the
// reference's doubles. Private to those files.
#ifndef CLMHA_FUZZ_DEVICE_H
#define CLMHA_FUZZ_DEVICE_H

#include <clmha.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// The input, read front to back; bytes past its end read as 0, so every input is a complete
// description (a short one describes a small, plain call).
typedef struct clmha_fuzz_in {
    const uint8_t *p;
    size_t n;
} clmha_fuzz_in;

uint8_t clmha_fuzz_take(clmha_fuzz_in *in);

// The context every device target uses, made on the first call (clmha_context_create_from_env)
// and kept for the process: a context per input would rebuild the kernels every time. NULL
// when no device is available (the targets then return CLMHA_UNSUPPORTED).
clmha_context *clmha_fuzz_context(void);

// Deterministic values (splitmix64).
uint64_t clmha_fuzz_next(uint64_t *state);
// @p count floats uniform in [-scale, scale] (NULL when 0 or out of memory).
float *clmha_fuzz_uniform(uint64_t *state, size_t count, float scale);

// A layer made from a descriptor, with every parameter it has set to random values, and the
// reference's view of the same values.
typedef struct clmha_fuzz_layer {
    clmha_layer_desc desc;
    clmha_layer *layer;
    clmha_reference_params params;
    float *values[11];  // the parameters' arrays (clmha_fuzz_param_names order)
    size_t counts[11];  // their element counts (0: the layer has no such parameter)
} clmha_fuzz_layer;

// The parameters by name, in clmha_fuzz_layer's order.
extern const char *const clmha_fuzz_param_names[11];

// Makes @p fl->layer from @p desc on @p ctx and fills its parameters from @p seed. Returns the
// status of clmha_layer_create() (or of setting a parameter); on failure nothing is held and
// the context's last error says why.
clmha_status clmha_fuzz_layer_make(clmha_fuzz_layer *fl, clmha_context *ctx,
                                   const clmha_layer_desc *desc, uint64_t seed);
void clmha_fuzz_layer_free(clmha_fuzz_layer *fl);

// The largest |got - want| over @p n values, relative to 1 + the largest |want|; infinite when
// a value is NaN or infinite on one side only.
double clmha_fuzz_rel_err(const float *got, const double *want, size_t n);

// A refusal as the API promises it: a failure status with a message saying why.
bool clmha_fuzz_clean_refusal(clmha_context *ctx, clmha_status st);

#endif
