// Loads a torch.nn.MultiheadAttention exported from PyTorch and runs it on a batch of inputs.
//
//   load_pytorch_layer LAYER.safetensors [BATCH [TGT_LEN [SRC_LEN]]]
//
// The layer file holds the module's state_dict under PyTorch's names and its options in the
// metadata; tools/export_mha.py writes one:
//
//   /usr/bin/python3 tools/export_mha.py --embed-dim 32 --num-heads 4 --batch-first layer.safetensors
//
// The program draws random inputs of the layer's layout ((N, L, E) with batch_first, else
// (L, N, E); key and value of kdim/vdim features when the layer has them), runs the forward pass
// with need_weights on the host-array path, prints the shapes and a checksum, and compares with
// the CPU reference using the parameters read back from the device (tolerance 1e-4).
// Exit status: 0 success, 1 failure, 2 usage, 77 no OpenCL device.
#include <clmha.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static float next_normal(unsigned long long *state) {  // approximately N(0, 1), deterministic
    float sum = 0.0f;
    for (int i = 0; i < 12; ++i) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        sum += (float)(*state >> 40) / (float)(1ull << 24);
    }
    return sum - 6.0f;
}

static size_t parse_size(const char *text, const char *what) {
    char *end;
    unsigned long v = strtoul(text, &end, 10);
    if (*end || v == 0 || v > 4096) {
        fprintf(stderr, "%s must be an integer in [1, 4096], got \"%s\"\n", what, text);
        exit(2);
    }
    return (size_t)v;
}

// A random (seq, batch, feat) tensor in the layer's layout; the data is malloc'ed.
static clmha_tensor random_input(const clmha_layer_desc *desc, size_t seq, size_t batch,
                                 size_t feat, unsigned long long *state) {
    clmha_tensor t = {.ndim = 3};
    t.shape[0] = desc->batch_first ? batch : seq;
    t.shape[1] = desc->batch_first ? seq : batch;
    t.shape[2] = feat;
    float *data = malloc(seq * batch * feat * sizeof *data);
    if (data)
        for (size_t i = 0; i < seq * batch * feat; ++i) data[i] = next_normal(state);
    t.data = data;
    return t;
}

// Reads parameter @p name back from the layer (NULL when the layer has none).
static float *read_param(clmha_layer *layer, const char *name, int *failed) {
    size_t count = clmha_layer_parameter_count(layer, name);
    if (!count) return NULL;
    float *p = malloc(count * sizeof *p);
    if (!p || clmha_layer_get_parameter(layer, name, p, count)) *failed = 1;
    return p;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 5) {
        fprintf(stderr, "usage: %s LAYER.safetensors [BATCH [TGT_LEN [SRC_LEN]]]\n", argv[0]);
        return 2;
    }
    size_t batch = argc > 2 ? parse_size(argv[2], "BATCH") : 4;
    size_t tgt = argc > 3 ? parse_size(argv[3], "TGT_LEN") : 10;
    size_t src = argc > 4 ? parse_size(argv[4], "SRC_LEN") : tgt;

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
    clmha_layer *layer = NULL;
    if ((st = clmha_layer_load(&layer, ctx, argv[1]))) {
        fprintf(stderr, "%s\n", clmha_context_last_error(ctx));
        clmha_context_release(ctx);
        return 1;
    }
    clmha_layer_desc desc = {.struct_size = sizeof desc};
    clmha_layer_get_desc(layer, &desc);
    printf("device: %s\n", clmha_context_device_name(ctx));
    printf("layer:  %s: embed_dim %zu, num_heads %zu, kdim %zu, vdim %zu, bias %d, "
           "add_bias_kv %d, add_zero_attn %d, batch_first %d, dropout %g\n",
           argv[1], desc.embed_dim, desc.num_heads, desc.kdim, desc.vdim, desc.bias,
           desc.add_bias_kv, desc.add_zero_attn, desc.batch_first, (double)desc.dropout);

    // Inputs: self-attention when the layer and the lengths allow it, else key and value.
    unsigned long long state = 2024;
    bool self = desc.kdim == desc.embed_dim && desc.vdim == desc.embed_dim && src == tgt;
    clmha_forward_args args = {.struct_size = sizeof args, .need_weights = true};
    args.query = random_input(&desc, tgt, batch, desc.embed_dim, &state);
    if (!self) {
        args.key = random_input(&desc, src, batch, desc.kdim, &state);
        args.value = random_input(&desc, src, batch, desc.vdim, &state);
    }

    size_t out_count = 0, w_count = 0;
    float *out = NULL, *w = NULL;
    double *out_ref = NULL, *w_ref = NULL;
    float *p[9] = {NULL};
    int result = 1;
    if ((st = clmha_layer_output_counts(layer, &args, &out_count, &w_count))) {
        fprintf(stderr, "%s\n", clmha_context_last_error(ctx));
        goto done;
    }
    out = malloc(out_count * sizeof *out);
    w = malloc(w_count * sizeof *w);
    out_ref = malloc(out_count * sizeof *out_ref);
    w_ref = malloc(w_count * sizeof *w_ref);
    if (!out || !w || !out_ref || !w_ref || !args.query.data || (!self && !args.key.data) ||
        (!self && !args.value.data)) {
        fprintf(stderr, "out of memory\n");
        goto done;
    }
    if ((st = clmha_layer_forward_host(layer, &args, out, out_count, w, w_count))) {
        fprintf(stderr, "%s\n", clmha_context_last_error(ctx));
        goto done;
    }
    double sum = 0.0, abs_sum = 0.0;
    for (size_t i = 0; i < out_count; ++i) {
        sum += out[i];
        abs_sum += fabs(out[i]);
    }
    size_t s_total = w_count / (batch * tgt);  // S' = S + add_bias_kv + add_zero_attn
    printf("input:  query (%zu, %zu, %zu)", args.query.shape[0], args.query.shape[1],
           args.query.shape[2]);
    if (self)
        printf(", key = value = query\n");
    else
        printf(", key (%zu, %zu, %zu), value (%zu, %zu, %zu)\n", args.key.shape[0],
               args.key.shape[1], args.key.shape[2], args.value.shape[0], args.value.shape[1],
               args.value.shape[2]);
    printf("output: (%zu, %zu, %zu), weights (%zu, %zu, %zu)\n", args.query.shape[0],
           args.query.shape[1], desc.embed_dim, batch, tgt, s_total);
    printf("checksum: sum %.6f, sum |x| %.6f\n", sum, abs_sum);

    // The reference, with the parameters as the device holds them.
    static const char *names[9] = {"in_proj_weight", "q_proj_weight", "k_proj_weight",
                                   "v_proj_weight",  "in_proj_bias",  "out_proj.weight",
                                   "out_proj.bias",  "bias_k",        "bias_v"};
    int failed = 0;
    bool packed = desc.kdim == desc.embed_dim && desc.vdim == desc.embed_dim;
    for (int i = 0; i < 9; ++i) {
        if (packed && i >= 1 && i <= 3) continue;  // in_proj_weight holds them
        if (!packed && i == 0) continue;
        p[i] = read_param(layer, names[i], &failed);
    }
    if (failed) {
        fprintf(stderr, "reading parameters: %s\n", clmha_context_last_error(ctx));
        goto done;
    }
    clmha_reference_params params = {.struct_size = sizeof params,
        .in_proj_weight = p[0], .q_proj_weight = p[1], .k_proj_weight = p[2],
        .v_proj_weight = p[3], .in_proj_bias = p[4], .out_proj_weight = p[5],
        .out_proj_bias = p[6], .bias_k = p[7], .bias_v = p[8]};
    char message[512];
    if ((st = clmha_reference_forward(&desc, &params, &args, out_ref, out_count, w_ref, w_count,
                                      message, sizeof message))) {
        fprintf(stderr, "reference: %s\n", message);
        goto done;
    }
    double err = 0.0;
    for (size_t i = 0; i < out_count; ++i) err = fmax(err, fabs(out[i] - out_ref[i]));
    for (size_t i = 0; i < w_count; ++i) err = fmax(err, fabs(w[i] - w_ref[i]));
    printf("max |device - reference| = %.3g (tolerance 1e-4)\n", err);
    result = err <= 1e-4 ? 0 : 1;

done:
    for (int i = 0; i < 9; ++i) free(p[i]);
    free(out);
    free(w);
    free(out_ref);
    free(w_ref);
    free((void *)args.query.data);
    free((void *)args.key.data);
    free((void *)args.value.data);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    return result;
}
