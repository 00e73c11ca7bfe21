// The `clmha` command-line program: `clmha devices`, `clmha demo`.
#include <clmha.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { EXIT_OK = 0, EXIT_REFUSED = 1, EXIT_USAGE = 2 };

static const char *usage =
    "usage: clmha <command> [options]\n"
    "\n"
    "commands:\n"
    "  devices              list every OpenCL platform and device with its spec string\n"
    "  demo [--device SPEC] run a random layer on a device and check it against the CPU\n"
    "                       reference (SPEC: \"P:D\", gpu, cpu, accelerator or a name part;\n"
    "                       default: $CLMHA_DEVICE, else the first GPU, else the first device)\n"
    "  --version            print the version\n";

static const char *type_name(cl_device_type t) {
    if (t & CL_DEVICE_TYPE_GPU) return "GPU";
    if (t & CL_DEVICE_TYPE_CPU) return "CPU";
    if (t & CL_DEVICE_TYPE_ACCELERATOR) return "accelerator";
    return "other";
}

static int cmd_devices(void) {
    size_t count = 0;
    if (clmha_devices_list(NULL, 0, &count) != CLMHA_SUCCESS) {
        fprintf(stderr, "clmha: could not list OpenCL platforms\n");
        return EXIT_REFUSED;
    }
    if (count == 0) {
        printf("no OpenCL device found (install a driver, e.g. pocl-opencl-icd)\n");
        return EXIT_OK;
    }
    clmha_device_info *infos = calloc(count, sizeof *infos);
    if (!infos) return EXIT_REFUSED;
    clmha_devices_list(infos, count, &count);
    for (size_t i = 0; i < count; ++i) {
        const clmha_device_info *d = &infos[i];
        printf("[%s] %s / %s\n", d->spec, d->platform_name, d->device_name);
        printf("      type %s, %u compute units, global %llu MiB, local %llu KiB, max alloc %llu "
               "MiB, fp16 %s, fp64 %s, driver %s\n",
               type_name(d->type), d->compute_units,
               (unsigned long long)(d->global_mem_bytes >> 20),
               (unsigned long long)(d->local_mem_bytes >> 10),
               (unsigned long long)(d->max_alloc_bytes >> 20), d->fp16 ? "yes" : "no",
               d->fp64 ? "yes" : "no", d->driver_version);
    }
    free(infos);
    return EXIT_OK;
}

// splitmix64-based uniform numbers in [-1, 1).
static float uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static double now_ms(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int cmd_demo(int argc, char **argv) {
    const char *spec = getenv("CLMHA_DEVICE");
    for (int i = 0; i < argc; ++i) {
        if (strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
            spec = argv[++i];
        } else if (strcmp(argv[i], "--help") == 0) {
            printf("usage: clmha demo [--device SPEC]\n");
            return EXIT_OK;
        } else {
            fprintf(stderr, "clmha demo: unknown argument '%s' (try --help)\n", argv[i]);
            return EXIT_USAGE;
        }
    }
    enum { E = 64, H = 8, N = 2, L = 48, S = 48, RUNS = 10 };
    clmha_layer_desc desc = {.embed_dim = E, .num_heads = H, .bias = true};
    static float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E], x[L * N * E], y[L * N * E];
    static float w[N * L * S];
    static double y_ref[L * N * E], w_ref[N * L * S];
    static unsigned char kpm[N * S];
    uint64_t rng = 42;
    float a = 1.0f / sqrtf((float)E);
    for (size_t i = 0; i < 3 * E * E; ++i) w_in[i] = a * uniform(&rng);
    for (size_t i = 0; i < E * E; ++i) w_out[i] = a * uniform(&rng);
    for (size_t i = 0; i < 3 * E; ++i) b_in[i] = 0.1f * uniform(&rng);
    for (size_t i = 0; i < E; ++i) b_out[i] = 0.1f * uniform(&rng);
    for (size_t i = 0; i < L * N * E; ++i) x[i] = uniform(&rng);
    for (size_t n = 0; n < N; ++n)  // the second sequence is padded after 40 tokens
        for (size_t j = 0; j < S; ++j) kpm[n * S + j] = n == 1 && j >= 40;

    clmha_forward_args args = {
        .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
        .key_padding_mask = {.kind = CLMHA_MASK_BOOL_IGNORE,
                             .tensor = {.ndim = 2, .shape = {N, S}, .data = kpm}},
        .need_weights = true};
    clmha_reference_params params = {.in_proj_weight = w_in, .in_proj_bias = b_in,
                                     .out_proj_weight = w_out, .out_proj_bias = b_out};

    clmha_context *ctx = NULL;
    clmha_layer *layer = NULL;
    int rc = EXIT_REFUSED;
    clmha_status st = clmha_context_create(&ctx, spec);
    if (st) {
        fprintf(stderr, "clmha demo: %s\n", clmha_last_create_error());
        return EXIT_REFUSED;
    }
    printf("device:  %s\n", clmha_context_device_name(ctx));
    printf("layer:   embed_dim %d, num_heads %d, bias, self-attention\n", E, H);
    printf("input:   query (L, N, E) = (%d, %d, %d), key_padding_mask (N, S) = (%d, %d)\n", L, N,
           E, N, S);
    if ((st = clmha_layer_create(&layer, ctx, &desc)) ||
        (st = clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E)) ||
        (st = clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.bias", b_out, E)))
        goto fail;
    double times[RUNS];
    for (int r = 0; r < RUNS + 1; ++r) {  // the first run compiles CLBlast's kernels
        double t0 = now_ms();
        if ((st = clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * S))) goto fail;
        if (r > 0) times[r - 1] = now_ms() - t0;
    }
    qsort(times, RUNS, sizeof times[0], cmp_double);
    char msg[512];
    st = clmha_reference_forward(&desc, &params, &args, y_ref, L * N * E, w_ref, N * L * S, msg,
                                 sizeof msg);
    if (st) {
        fprintf(stderr, "clmha demo: reference failed: %s\n", msg);
        goto done;
    }
    double err_y = 0, err_w = 0;
    for (size_t i = 0; i < L * N * E; ++i) err_y = fmax(err_y, fabs(y[i] - y_ref[i]));
    for (size_t i = 0; i < N * L * S; ++i) err_w = fmax(err_w, fabs(w[i] - w_ref[i]));
    printf("output:  (L, N, E) = (%d, %d, %d), weights (N, L, S) = (%d, %d, %d)\n", L, N, E, N, L,
           S);
    printf("error:   max |output - reference| = %.3e, max |weights - reference| = %.3e "
           "(tolerance 1e-4)\n",
           err_y, err_w);
    printf("time:    %.3f ms per forward (median of %d, host arrays in and out)\n",
           times[RUNS / 2], RUNS);
    rc = err_y <= 1e-4 && err_w <= 1e-4 ? EXIT_OK : EXIT_REFUSED;
    printf("result:  %s\n", rc == EXIT_OK ? "PASS" : "FAIL");
    goto done;
fail:
    fprintf(stderr, "clmha demo: %s: %s\n", clmha_status_string(st),
            clmha_context_last_error(ctx));
done:
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? EXIT_USAGE : EXIT_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("clmha %s\n", clmha_version());
        return EXIT_OK;
    }
    if (strcmp(argv[1], "devices") == 0) return cmd_devices();
    if (strcmp(argv[1], "demo") == 0) return cmd_demo(argc - 2, argv + 2);
    fprintf(stderr, "clmha: unknown command '%s'\n%s", argv[1], usage);
    return EXIT_USAGE;
}
