// Times the device-buffer forward pass at one shape: median of R runs after a warm-up.
// usage: bench_forward [N L S E H [R [need_weights]]]   (defaults: 8 128 128 512 8 10 0)
// FLOPs: 2·N·E²·(2L + 2S) for the four projections plus 4·N·L·S·E for QKᵀ and AV (for L = S
// this is 8·N·L·E² + 4·N·L²·E).
#define _POSIX_C_SOURCE 200809L
#include <clmha.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    size_t n = 8, l = 128, s = 128, e = 512, h = 8, reps = 10;
    int need_weights = 0;
    if (argc > 5) {
        n = strtoul(argv[1], NULL, 10), l = strtoul(argv[2], NULL, 10);
        s = strtoul(argv[3], NULL, 10), e = strtoul(argv[4], NULL, 10);
        h = strtoul(argv[5], NULL, 10);
    }
    if (argc > 6) reps = strtoul(argv[6], NULL, 10);
    if (argc > 7) need_weights = atoi(argv[7]);
    if (reps < 1 || reps > 1000) reps = 10;

    clmha_context *ctx = NULL;
    clmha_layer *layer = NULL;
    cl_mem q = NULL, kv = NULL, out = NULL, w = NULL;
    double *times = calloc(reps, sizeof *times);
    int rc = 1;
    if (!times || clmha_context_create_from_env(&ctx)) {
        fprintf(stderr, "bench: %s\n", clmha_last_create_error());
        free(times);
        return 1;
    }
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = e, .num_heads = h, .bias = true};
    if (clmha_layer_create(&layer, ctx, &desc) || clmha_layer_bake(layer, n, l, s, need_weights))
        goto fail;
    cl_context cl = clmha_context_cl_context(ctx);
    cl_int err;
    q = clCreateBuffer(cl, CL_MEM_READ_WRITE, n * l * e * 4, NULL, &err);
    kv = clCreateBuffer(cl, CL_MEM_READ_WRITE, n * s * e * 4, NULL, &err);
    out = clCreateBuffer(cl, CL_MEM_READ_WRITE, n * l * e * 4, NULL, &err);
    w = clCreateBuffer(cl, CL_MEM_READ_WRITE, n * l * s * 4, NULL, &err);
    if (!q || !kv || !out || !w) goto fail;
    float zero = 0.0f;
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    clEnqueueFillBuffer(queue, q, &zero, 4, 0, n * l * e * 4, 0, NULL, NULL);
    clEnqueueFillBuffer(queue, kv, &zero, 4, 0, n * s * e * 4, 0, NULL, NULL);
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {l, n, e}, .buffer = q},
                               .need_weights = need_weights};
    args.key = (clmha_tensor){.ndim = 3, .shape = {s, n, e}, .buffer = kv};  // value = key
    for (size_t r = 0; r <= reps; ++r) {
        double t0 = now_ms();
        if (clmha_layer_forward(layer, &args, out, 0, w, 0, 0, NULL, NULL)) goto fail;
        clFinish(queue);
        if (r > 0) times[r - 1] = now_ms() - t0;  // run 0 is the warm-up
    }
    // One more, profiled, for the split of time across stages.
    double stage_ms[CLMHA_STAGE_COUNT];
    if (clmha_layer_set_profiling(layer, true) ||
        clmha_layer_forward(layer, &args, out, 0, w, 0, 0, NULL, NULL) ||
        clmha_layer_stage_times(layer, stage_ms))
        goto fail;
    qsort(times, reps, sizeof *times, cmp);
    double ms = times[reps / 2];
    double flops = 2.0 * n * e * e * (2.0 * l + 2.0 * s) + 4.0 * n * l * s * e;
    printf("N %zu L %zu S %zu E %zu H %zu need_weights %d: median %.3f ms, %.1f GFLOP/s, "
           "scratch %zu bytes (%s)\n",
           n, l, s, e, h, need_weights, ms, flops / ms / 1e6, clmha_layer_scratch_bytes(layer),
           clmha_context_device_name(ctx));
    for (int i = 0; i < CLMHA_STAGE_COUNT; ++i)
        printf("  %-9s %8.3f ms\n", clmha_stage_name((clmha_stage)i), stage_ms[i]);
    rc = 0;
fail:
    if (rc) fprintf(stderr, "bench: %s\n", clmha_context_last_error(ctx));
    if (q) clReleaseMemObject(q);
    if (kv) clReleaseMemObject(kv);
    if (out) clReleaseMemObject(out);
    if (w) clReleaseMemObject(w);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    free(times);
    return rc;
}
