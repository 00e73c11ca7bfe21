// `clmha demo`: a random layer on a device, checked against the CPU reference and timed.
#define _POSIX_C_SOURCE 200809L

#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "heatmap.h"

static const char *usage_demo =
    "usage: clmha demo [--device SPEC] [--heatmap OUT.png]\n"
    "\n"
    "Runs a random layer (embed_dim 64, 8 heads, L = S = 48, N = 2, padding mask) on a\n"
    "device, checks it against the double-precision CPU reference (tolerance 1e-4) and\n"
    "prints the device, the shapes, the max error and the time per forward.\n"
    "\n"
    "options:\n"
    "  --device SPEC      \"P:D\", gpu, cpu, accelerator or part of a device name (see\n"
    "                     clmha devices); default: $CLMHA_DEVICE, else the first GPU, else\n"
    "                     the first device\n"
    "  --heatmap OUT.png  also write the attention weights of batch item 1, whose last 8\n"
    "                     keys are padding (the dark columns), as a PNG: one tile per head,\n"
    "                     the mean over the heads and a colour scale\n"
    "  --help, -h         print this help\n"
    "\n"
    "exit status: 0 PASS, 1 FAIL or device error, 2 usage error\n";

enum { E = 64, H = 8, N = 2, L = 48, S = 48, RUNS = 10, PADDED = 1, VALID = 40 };

// The demo's layer and inputs: random parameters and query; sequence PADDED is padded after
// VALID tokens.
typedef struct demo_data {
    float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E], x[L * N * E], y[L * N * E];
    float w[N * L * S], w_heads[N * H * L * S];
    double y_ref[L * N * E], w_ref[N * L * S];
    unsigned char kpm[N * S];
} demo_data;

static void fill(demo_data *d) {
    uint64_t rng = 42;
    float a = 1.0f / sqrtf((float)E);
    for (size_t i = 0; i < 3 * E * E; ++i) d->w_in[i] = a * clmha__cli_uniform(&rng);
    for (size_t i = 0; i < E * E; ++i) d->w_out[i] = a * clmha__cli_uniform(&rng);
    for (size_t i = 0; i < 3 * E; ++i) d->b_in[i] = 0.1f * clmha__cli_uniform(&rng);
    for (size_t i = 0; i < E; ++i) d->b_out[i] = 0.1f * clmha__cli_uniform(&rng);
    for (size_t i = 0; i < L * N * E; ++i) d->x[i] = clmha__cli_uniform(&rng);
    for (size_t n = 0; n < N; ++n)
        for (size_t j = 0; j < S; ++j) d->kpm[n * S + j] = n == PADDED && j >= VALID;
}

// The layer on @p ctx with @p d's parameters.
static clmha_status make_layer(clmha_context *ctx, const clmha_layer_desc *desc,
                               const demo_data *d, clmha_layer **layer) {
    clmha_status st;
    if ((st = clmha_layer_create(layer, ctx, desc)) ||
        (st = clmha_layer_set_parameter(*layer, "in_proj_weight", d->w_in, 3 * E * E)) ||
        (st = clmha_layer_set_parameter(*layer, "in_proj_bias", d->b_in, 3 * E)) ||
        (st = clmha_layer_set_parameter(*layer, "out_proj.weight", d->w_out, E * E)))
        return st;
    return clmha_layer_set_parameter(*layer, "out_proj.bias", d->b_out, E);
}

// RUNS timed forward calls after one that compiles the kernels; *median_ms their median.
static clmha_status time_forward(clmha_layer *layer, const clmha_forward_args *args,
                                 demo_data *d, double *median_ms) {
    double times[RUNS];
    for (int r = 0; r < RUNS + 1; ++r) {
        double t0 = clmha__cli_now_ms();
        clmha_status st = clmha_layer_forward_host(layer, args, d->y, L * N * E, d->w, N * L * S);
        if (st) return st;
        if (r > 0) times[r - 1] = clmha__cli_now_ms() - t0;
    }
    qsort(times, RUNS, sizeof times[0], clmha__cli_cmp_double);
    *median_ms = times[RUNS / 2];
    return CLMHA_SUCCESS;
}

// The per-head weights of the padded batch item as a PNG. Reports a failure.
static bool write_heatmap(clmha_layer *layer, clmha_forward_args args, demo_data *d,
                          const char *path) {
    clmha_context *ctx = clmha_layer_context(layer);
    args.per_head_weights = true;  // (N, H, L, S): item PADDED is the PADDED-th H * L * S
    clmha_status st =
        clmha_layer_forward_host(layer, &args, d->y, L * N * E, d->w_heads, N * H * L * S);
    if (st) {
        clmha__cli_report("demo", "%s: %s", clmha_status_string(st),
                          clmha_context_last_error(ctx));
        return false;
    }
    char msg[1024];
    if (clmha__heatmap_write(path, d->w_heads + (size_t)PADDED * H * L * S, H, L, S, msg,
                             sizeof msg) != CLMHA_SUCCESS) {
        clmha__cli_report("demo", "--heatmap %s: %s", path, msg);
        return false;
    }
    printf("heatmap: %s (attention weights of batch item %d, keys %d to %d padding; %d heads "
           "and their mean)\n",
           path, PADDED, VALID, S - 1, H);
    return true;
}

int clmha__cli_demo(int argc, char **argv) {
    const char *device = NULL, *heatmap = NULL;
    const clmha__cli_option opts[] = {
        {.name = "--device", .value = &device, .allow_empty = true},
        {.name = "--heatmap", .value = &heatmap},
    };
    int rc;
    if (!clmha__cli_parse_options("demo", argc, argv, opts, sizeof opts / sizeof opts[0],
                                  usage_demo, &rc))
        return rc;
    static demo_data d;
    fill(&d);
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H,
                             .bias = true};
    clmha_forward_args args = {
        .struct_size = sizeof args,
        .query = {.ndim = 3, .shape = {L, N, E}, .data = d.x},
        .key_padding_mask = {.kind = CLMHA_MASK_BOOL_IGNORE,
                             .tensor = {.ndim = 2, .shape = {N, S}, .data = d.kpm}},
        .need_weights = true};
    clmha_reference_params params = {.struct_size = sizeof params,
                                     .in_proj_weight = d.w_in, .in_proj_bias = d.b_in,
                                     .out_proj_weight = d.w_out, .out_proj_bias = d.b_out};

    if (heatmap && !clmha__cli_output_path_ok("demo", "--heatmap", heatmap)) return EXIT_REFUSED;
    clmha_layer *layer = NULL;
    rc = EXIT_REFUSED;
    clmha_status st = CLMHA_SUCCESS;
    clmha_context *ctx = clmha__cli_open_context("demo", device);
    if (!ctx) goto done;
    printf("device:  %s\n", clmha_context_device_name(ctx));
    printf("layer:   embed_dim %d, num_heads %d, bias, self-attention\n", E, H);
    printf("input:   query (L, N, E) = (%d, %d, %d), key_padding_mask (N, S) = (%d, %d)\n", L, N,
           E, N, S);
    double median_ms;
    if ((st = make_layer(ctx, &desc, &d, &layer)) ||
        (st = time_forward(layer, &args, &d, &median_ms)))
        goto fail;
    char msg[1024];
    st = clmha_reference_forward(&desc, &params, &args, d.y_ref, L * N * E, d.w_ref, N * L * S,
                                 msg, sizeof msg);
    if (st) {
        clmha__cli_report("demo", "reference failed: %s", msg);
        goto done;
    }
    double err_y = 0, err_w = 0;
    for (size_t i = 0; i < L * N * E; ++i) err_y = fmax(err_y, fabs(d.y[i] - d.y_ref[i]));
    for (size_t i = 0; i < N * L * S; ++i) err_w = fmax(err_w, fabs(d.w[i] - d.w_ref[i]));
    printf("output:  (L, N, E) = (%d, %d, %d), weights (N, L, S) = (%d, %d, %d)\n", L, N, E, N, L,
           S);
    printf("error:   max |output - reference| = %.3e, max |weights - reference| = %.3e "
           "(tolerance 1e-4)\n",
           err_y, err_w);
    printf("time:    %.3f ms per forward (median of %d, host arrays in and out)\n", median_ms,
           RUNS);
    bool pass = err_y <= 1e-4 && err_w <= 1e-4;
    if (heatmap && !write_heatmap(layer, args, &d, heatmap)) goto done;
    printf("result:  %s\n", pass ? "PASS" : "FAIL");
    rc = pass ? EXIT_OK : EXIT_REFUSED;
    goto done;
fail:
    clmha__cli_report("demo", "%s: %s", clmha_status_string(st), clmha_context_last_error(ctx));
done:
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    return rc;
}
