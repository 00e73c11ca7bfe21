// A consumer of an installed clmha: built by tests/api/install_test.sh against the installed prefix
// only, once through find_package(clmha) (shared and static) and once through pkg-config.
// Runs one small forward pass on host arrays and compares it with the CPU reference.
// Exit status: 0 pass, 1 failure, 77 no OpenCL device (skip).
#include <clmha.h>

// Users of the static library get CLMHA_STATIC from clmha::clmha_static and from
// `pkg-config --static --cflags clmha`; users of the shared one do not (docs/abi.md).
#if defined(CLMHA_EXPECT_STATIC) != defined(CLMHA_STATIC)
#error "CLMHA_STATIC is not defined exactly for the static library's users"
#endif

#include <math.h>
#include <stdio.h>
#include <string.h>

enum { E = 8, H = 2, L = 5, N = 2 };

static float next_value(unsigned *state) {  // deterministic values in [-1, 1)
    *state = *state * 1664525u + 1013904223u;
    return (float)(*state >> 8) / (float)(1u << 23) - 1.0f;
}

int main(void) {
    if (strcmp(clmha_version(), CLMHA_VERSION_STRING) != 0) {
        fprintf(stderr, "library %s but header %s\n", clmha_version(), CLMHA_VERSION_STRING);
        return 1;
    }
    static float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E], x[L * N * E];
    static unsigned char pad[N * L];
    unsigned seed = 42;
    for (size_t i = 0; i < sizeof w_in / sizeof *w_in; ++i) w_in[i] = 0.4f * next_value(&seed);
    for (size_t i = 0; i < sizeof b_in / sizeof *b_in; ++i) b_in[i] = 0.1f * next_value(&seed);
    for (size_t i = 0; i < sizeof w_out / sizeof *w_out; ++i) w_out[i] = 0.4f * next_value(&seed);
    for (size_t i = 0; i < sizeof b_out / sizeof *b_out; ++i) b_out[i] = 0.1f * next_value(&seed);
    for (size_t i = 0; i < sizeof x / sizeof *x; ++i) x[i] = next_value(&seed);
    pad[1 * L + L - 1] = 1;  // the last key of batch item 1 is padding

    clmha_context *ctx = NULL;
    clmha_status st = clmha_context_create_from_env(&ctx);
    if (st == CLMHA_DEVICE_NOT_FOUND) {
        printf("skipped: no OpenCL device (%s)\n", clmha_last_create_error());
        return 77;
    }
    if (st) {
        fprintf(stderr, "context: %s\n", clmha_last_create_error());
        return 1;
    }
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    clmha_layer *layer = NULL;
    st = clmha_layer_create(&layer, ctx, &desc);
    if (!st) st = clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E);
    if (!st) st = clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E);
    if (!st) st = clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E);
    if (!st) st = clmha_layer_set_parameter(layer, "out_proj.bias", b_out, E);

    clmha_forward_args args = {.struct_size = sizeof args,
        .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
        .key_padding_mask = {.kind = CLMHA_MASK_BOOL_IGNORE,
                             .tensor = {.ndim = 2, .shape = {N, L}, .data = pad}},
        .need_weights = true};
    static float y[L * N * E], w[N * L * L];
    static double y_ref[L * N * E], w_ref[N * L * L];
    if (!st) st = clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * L);
    if (st) {
        fprintf(stderr, "clmha: %s\n", clmha_context_last_error(ctx));
        clmha_layer_release(layer);
        clmha_context_release(ctx);
        return 1;
    }
    clmha_reference_params params = {.struct_size = sizeof params,
                                     .in_proj_weight = w_in, .in_proj_bias = b_in,
                                     .out_proj_weight = w_out, .out_proj_bias = b_out};
    char message[512];
    st = clmha_reference_forward(&desc, &params, &args, y_ref, L * N * E, w_ref, N * L * L,
                                 message, sizeof message);
    if (st) {
        fprintf(stderr, "reference: %s\n", message);
        clmha_layer_release(layer);
        clmha_context_release(ctx);
        return 1;
    }
    double err_y = 0.0, err_w = 0.0;
    for (size_t i = 0; i < L * N * E; ++i) err_y = fmax(err_y, fabs(y[i] - y_ref[i]));
    for (size_t i = 0; i < N * L * L; ++i) err_w = fmax(err_w, fabs(w[i] - w_ref[i]));
    bool pass = err_y <= 1e-4 && err_w <= 1e-4;
    printf("clmha %s on %s: max error output %.3g, weights %.3g: %s\n", clmha_version(),
           clmha_context_device_name(ctx), err_y, err_w, pass ? "PASS" : "FAIL");
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    return pass ? 0 : 1;
}
