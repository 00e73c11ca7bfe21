// Trains a self-attention layer with clmha's forward and backward passes and plain SGD.
//
//   train_attention [STEPS]
//
// The task: sequences of L = 8 tokens, each a random 8-dimensional vector followed by a one-hot
// code of its position (E = 16 features in all); the target at position i is the previous
// token's vector (zeros at position 0, and in the position features). A causal layer with
// H = 2 heads must learn to attend from each position to the one before it (the position codes
// make that possible) and to copy the token through its value and output projections.
//
// Each step draws a fresh batch of N = 32 sequences, runs the forward pass with args.save, takes
// the MSE loss and its gradient dL/dY = 2 (Y - T) / count on the host, runs the backward pass
// into the four parameters' gradients and updates them with p -= LR * g (host arrays, then
// clmha_layer_set_parameter). It prints the loss every 10 steps and exits 0 when the mean loss
// of the last 10 steps is below a quarter of that of the first 10.
// Exit status: 0 success, 1 failure (or the loss did not fall enough), 2 usage, 77 no OpenCL
// device.
#include <clmha.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { E = 16, H = 2, L = 8, N = 32, TOKEN = 8 };
#define LR 4.0f
#define TARGET_RATIO 0.25

static const char *const names[] = {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                    "out_proj.bias"};
enum { NUM_PARAMS = 4 };

static float uniform(unsigned long long *state) {  // in [-1, 1), deterministic
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)(*state >> 40) / (float)(1ull << 23) - 1.0f;
}

static float normal(unsigned long long *state) {  // approximately N(0, 1)
    float sum = 0.0f;
    for (int i = 0; i < 12; ++i) sum += 0.5f * uniform(state) + 0.5f;
    return sum - 6.0f;
}

// A batch (L, N, E) and its target: token vectors, position codes, the previous token.
static void draw_batch(float *x, float *t, unsigned long long *state) {
    memset(x, 0, sizeof(float) * L * N * E);
    memset(t, 0, sizeof(float) * L * N * E);
    for (size_t i = 0; i < L; ++i)
        for (size_t n = 0; n < N; ++n) {
            float *row = x + (i * N + n) * E;
            for (size_t c = 0; c < TOKEN; ++c) row[c] = normal(state);
            row[TOKEN + i] = 1.0f;
            if (i + 1 < L) memcpy(t + ((i + 1) * N + n) * E, row, TOKEN * sizeof(float));
        }
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 200;
    if (argc > 2 || steps < 20) {
        fprintf(stderr, "usage: %s [STEPS (at least 20; default 200)]\n", argv[0]);
        return 2;
    }
    clmha_context *ctx = NULL;
    clmha_status st = clmha_context_create_from_env(&ctx);
    if (st == CLMHA_DEVICE_NOT_FOUND) {
        printf("skipped: no OpenCL device (%s)\n", clmha_last_create_error());
        return 77;
    }
    if (st) {
        fprintf(stderr, "%s\n", clmha_last_create_error());
        return 1;
    }
    int rc = 1;
    clmha_layer *layer = NULL;
    clmha_saved *saved = NULL;
    float *param[NUM_PARAMS] = {NULL}, *grad[NUM_PARAMS] = {NULL};
    size_t count[NUM_PARAMS];
    float *x = malloc(sizeof(float) * L * N * E), *t = malloc(sizeof(float) * L * N * E);
    float *y = malloc(sizeof(float) * L * N * E), *dy = malloc(sizeof(float) * L * N * E);
    if (!x || !t || !y || !dy) goto fail;

    // The layer, with PyTorch's initialisation: Xavier-uniform in_proj_weight, uniform
    // out_proj.weight in +-1/sqrt(E), zero biases.
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H,
                             .bias = true};
    if ((st = clmha_layer_create(&layer, ctx, &desc)) ||
        (st = clmha_saved_create(&saved, layer)))
        goto fail;
    unsigned long long state = 2024;
    for (int p = 0; p < NUM_PARAMS; ++p) {
        count[p] = clmha_layer_parameter_count(layer, names[p]);
        param[p] = calloc(count[p], sizeof(float));
        grad[p] = calloc(count[p], sizeof(float));
        if (!param[p] || !grad[p]) goto fail;
        float bound = p == 0 ? sqrtf(6.0f / (2 * E)) : p == 2 ? 1.0f / sqrtf(E) : 0.0f;
        for (size_t k = 0; k < count[p]; ++k) param[p][k] = bound * uniform(&state);
        if ((st = clmha_layer_set_parameter(layer, names[p], param[p], count[p]))) goto fail;
    }

    // One forward call's arguments, reused every step (the arrays' contents change).
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
                               .is_causal = true,
                               .save = saved};
    clmha_backward_args back = {.struct_size = sizeof back,
                                .forward = &args,
                                .saved = saved,
                                .grad_output = {.ndim = 3, .shape = {L, N, E}, .data = dy},
                                .in_proj_weight = {.data = grad[0]},
                                .in_proj_bias = {.data = grad[1]},
                                .out_proj_weight = {.data = grad[2]},
                                .out_proj_bias = {.data = grad[3]}};
    double first = 0, last = 0;
    printf("training self-attention (E=%d, H=%d, L=%d, batch %d) to copy the previous token, "
           "SGD lr %g, on %s\n",
           E, H, L, N, (double)LR, clmha_context_device_name(ctx));
    for (int step = 0; step < steps; ++step) {
        draw_batch(x, t, &state);
        if ((st = clmha_layer_forward_host(layer, &args, y, L * N * E, NULL, 0))) goto fail;
        double loss = 0;
        for (size_t i = 0; i < L * N * E; ++i) {
            float d = y[i] - t[i];
            loss += (double)d * d;
            dy[i] = 2.0f * d / (L * N * E);
        }
        loss /= L * N * E;
        if (step < 10) first += loss / 10;
        if (step >= steps - 10) last += loss / 10;
        if (step % 10 == 0 || step == steps - 1) printf("step %4d  loss %.5f\n", step, loss);
        if ((st = clmha_layer_backward_host(layer, &back))) goto fail;
        for (int p = 0; p < NUM_PARAMS; ++p) {
            for (size_t k = 0; k < count[p]; ++k) param[p][k] -= LR * grad[p][k];
            if ((st = clmha_layer_set_parameter(layer, names[p], param[p], count[p])))
                goto fail;
        }
    }
    printf("mean loss: first 10 steps %.5f, last 10 steps %.5f (ratio %.3f, want < %.2f)\n",
           first, last, last / first, TARGET_RATIO);
    rc = last < TARGET_RATIO * first ? 0 : 1;
    if (rc) fprintf(stderr, "the loss did not fall enough\n");
fail:
    if (st) fprintf(stderr, "%s: %s\n", clmha_status_string(st), clmha_context_last_error(ctx));
    for (int p = 0; p < NUM_PARAMS; ++p) free(param[p]), free(grad[p]);
    free(x), free(t), free(y), free(dy);
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    return rc;
}
