// What the device fuzz targets share (see device.h).
#include "device.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "targets.h"

uint8_t clmha_fuzz_take(clmha_fuzz_in *in) {
    if (!in->n) return 0;
    --in->n;
    return *in->p++;
}

clmha_context *clmha_fuzz_context(void) {
    // libFuzzer runs one input at a time on one thread, and so does the replay test: no lock.
    static clmha_context *ctx;
    static bool tried;
    if (!tried) {
        tried = true;
        if (clmha_context_create_from_env(&ctx) != CLMHA_SUCCESS) ctx = NULL;
    }
    return ctx;
}

uint64_t clmha_fuzz_next(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float *clmha_fuzz_uniform(uint64_t *state, size_t count, float scale) {
    if (!count) return NULL;
    float *v = malloc(count * sizeof *v);
    if (!v) return NULL;
    for (size_t i = 0; i < count; ++i)
        v[i] = scale * (float)((double)(clmha_fuzz_next(state) >> 11) * 0x1p-52 - 1.0);
    return v;
}

const char *const clmha_fuzz_param_names[11] = {
    "in_proj_weight", "q_proj_weight",   "k_proj_weight", "v_proj_weight",
    "in_proj_bias",   "out_proj.weight", "out_proj.bias", "bias_k",
    "bias_v",         "alibi_slopes",    "sinks"};

// Where the reference reads parameter i (clmha_fuzz_param_names order).
static const float **reference_slot(clmha_reference_params *p, int i) {
    const float **slots[11] = {&p->in_proj_weight, &p->q_proj_weight, &p->k_proj_weight,
                               &p->v_proj_weight,  &p->in_proj_bias,  &p->out_proj_weight,
                               &p->out_proj_bias,  &p->bias_k,        &p->bias_v,
                               &p->alibi_slopes,   &p->sinks};
    return slots[i];
}

clmha_status clmha_fuzz_layer_make(clmha_fuzz_layer *fl, clmha_context *ctx,
                                   const clmha_layer_desc *desc, uint64_t seed) {
    memset(fl, 0, sizeof *fl);
    fl->desc = *desc;
    fl->params.struct_size = sizeof fl->params;
    clmha_status st = clmha_layer_create(&fl->layer, ctx, desc);
    if (st != CLMHA_SUCCESS) {
        fl->layer = NULL;
        return st;
    }
    uint64_t state = seed;
    for (int i = 0; i < 11; ++i) {
        // The row blocks of in_proj_weight are views of it: set one or the others.
        if (i >= 1 && i <= 3 && fl->counts[0]) continue;
        size_t count = clmha_layer_parameter_count(fl->layer, clmha_fuzz_param_names[i]);
        if (!count) continue;
        // Slopes positive (they are distances' factors), the rest around zero.
        float *v = clmha_fuzz_uniform(&state, count, i == 10 ? 1.0f : 0.5f);
        if (!v) {
            clmha_fuzz_layer_free(fl);
            return CLMHA_OUT_OF_MEMORY;
        }
        if (i == 9)
            for (size_t j = 0; j < count; ++j) v[j] = 0.05f + fabsf(v[j]);
        fl->values[i] = v, fl->counts[i] = count;
        *reference_slot(&fl->params, i) = v;
        st = clmha_layer_set_parameter(fl->layer, clmha_fuzz_param_names[i], v, count);
        CLMHA_FUZZ_CHECK(st == CLMHA_SUCCESS);
    }
    return CLMHA_SUCCESS;
}

void clmha_fuzz_layer_free(clmha_fuzz_layer *fl) {
    clmha_layer_release(fl->layer);
    for (int i = 0; i < 11; ++i) free(fl->values[i]);
    memset(fl, 0, sizeof *fl);
}

double clmha_fuzz_rel_err(const float *got, const double *want, size_t n) {
    double scale = 1.0, worst = 0.0;
    for (size_t i = 0; i < n; ++i)
        if (isfinite(want[i]) && fabs(want[i]) + 1.0 > scale) scale = fabs(want[i]) + 1.0;
    for (size_t i = 0; i < n; ++i) {
        double g = got[i], w = want[i];
        if (!isfinite(g) || !isfinite(w)) {
            // Both infinite of one sign, or both NaN, agree.
            if (!(isnan(g) && isnan(w)) && g != w) return INFINITY;
            continue;
        }
        if (fabs(g - w) > worst) worst = fabs(g - w);
    }
    return worst / scale;
}

bool clmha_fuzz_clean_refusal(clmha_context *ctx, clmha_status st) {
    const char *msg = clmha_context_last_error(ctx);
    return st != CLMHA_SUCCESS && msg && msg[0] != '\0';
}

bool clmha_fuzz_have_device(void) { return clmha_fuzz_context() != NULL; }
