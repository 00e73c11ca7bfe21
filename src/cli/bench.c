// `clmha bench`: times the device-buffer forward pass per shape: ms, GFLOP/s, scratch, stages;
// with --backward, the training step (bench_backward.c). Options, help and the forward here.
#define _POSIX_C_SOURCE 200809L

#include "bench.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "base/checked.h"
#include "base/file_read.h"
#include "base/half.h"

static const char *usage_bench =
    "usage: clmha bench [--batch N] [--tgt-len L] [--src-len S] [--embed E] [--heads H]\n"
    "                   [--need-weights] [--batch-first] [--layer F.safetensors [--prefix P]]\n"
    "                   [--impl auto|fused|unfused] [--backward] [--repeat R] [--device SPEC]\n"
"                   [--dtype f32|f64|f16|bf16] [--json]\n"
"       clmha bench --decode --cache-len S[,S...] [--kv-heads G] [--batch N] [--embed E]\n"
"                   [--heads H] [--repeat R] [--device SPEC] [--json]\n"
    "\n"
    "Times the forward pass on device buffers (clmha_layer_forward): a warm-up\n"
    "(clmha_layer_bake at the shape: sizes the scratch, compiles the kernels), then R timed\n"
    "runs, each waited for with clFinish. Reports the median time per forward, GFLOP/s, the\n"
    "layer's device scratch in bytes and, from one more run with profiling on, the time of\n"
    "each stage (project, split, scores, softmax, av, fused, merge, out_proj, weights).\n"
    "Self-attention (key = value = query: one packed QKV projection) when L == S and the\n"
    "layer's kdim == vdim == E; else cross-attention with key = value, one (S, N, kdim)\n"
    "tensor (separate key and value tensors when kdim != vdim). Inputs are random.\n"
    "\n"
    "shape (N, L and S take comma-separated lists, e.g. --tgt-len 128,256,512: every\n"
    "combination is timed, one result per shape):\n"
    "  --batch N            batch size (default 8)\n"
    "  --tgt-len L          target (query) length (default 128)\n"
    "  --src-len S          source (key/value) length (default: L, self-attention)\n"
    "  --embed E            embed_dim of the random layer (default 512)\n"
    "  --heads H            num_heads of the random layer (default 8; must divide E)\n"
    "  --need-weights       also compute the attention weights (N, L, S), averaged over heads\n"
    "  --batch-first        inputs (N, L, E) instead of (L, N, E)\n"
    "  --layer F.safetensors  time this layer file (e.g. from tools/export_mha.py) instead\n"
    "                       of a random one (weights uniform in +-1/sqrt(E), bias); its\n"
    "                       embed_dim, num_heads, kdim, vdim and batch_first are used\n"
    "                       (--embed, --heads and --batch-first, when given, must agree;\n"
    "                       --heads also serves a file without num_heads metadata, as\n"
    "                       clmha run's --num-heads)\n"
    "  --prefix P           with --layer: the attention module P.<name> of a whole model's\n"
    "                       file (as clmha run --prefix)\n"
    "\n"
    "run:\n"
    "  --impl I             attention core: auto (default: fused without --need-weights,\n"
    "                       else unfused), fused or unfused\n"
    "  --backward           time the training step instead: see \"--backward\" below\n"
    "  --repeat R           timed runs per shape (default 10; with --backward, 0: no timed\n"
    "                       runs, the times are the measured layer's first step's)\n"
    "  --device SPEC        \"P:D\", gpu, cpu, accelerator or part of a device name (see\n"
    "                       clmha devices); default: $CLMHA_DEVICE, else the first GPU, else\n"
    "                       the first device\n"
    "  --json               one JSON object per shape and line: device, gemm (where the\n"
    "                       GEMMs run: clmha_context_gemm_note()), layer, batch, tgt_len,\n"
    "                       src_len, embed_dim, num_heads, kdim, vdim, batch_first,\n"
    "                       need_weights, impl (the core used), attention (\"self\"/\"cross\"),\n"
    "                       repeat, dtype (see --dtype below), ms (median),\n"
    "                       ms_min, ms_max, flops, gflops, io_bytes, io_gbps, scratch_bytes,\n"
    "                       stages {name: ms}\n"

    "  --help, -h           print this help\n"
    "\n"
    "FLOPs counted (the GEMMs; masks, softmax and head split/merge are not counted):\n"
    "  2*N*E*(L*E + S*kdim + S*vdim + L*E)   Q, K, V and output projections\n"
    "  + 4*N*L*S'*E                          Q*K^T and weights*V (S' = S + add_bias_kv\n"
    "                                        + add_zero_attn)\n"
    "  = 2*N*E^2*(2L + 2S) + 4*N*L*S*E for kdim = vdim = E, and 8*N*L*E^2 + 4*N*L^2*E\n"
    "  for self-attention (L = S). GFLOP/s = FLOPs / median time.\n"
    "The GEMMs run in the host BLAS on CPU devices with native kernels, else in CLBlast\n"
    "(the 'gemm:' line); CLMHA_GEMM=clblast|host|auto chooses.\n"
    "\n";

// The help's second part (C11 compilers need not take string literals past 4095 characters).
static const char *usage_bench_dtype =
    "--dtype T: the layer's dtype (clmha_dtype): f32 (default), f64, f16 or bf16. The inputs,\n"
    "outputs and parameters of f16 and bf16 layers are 16-bit values (float32 arithmetic),\n"
    "those of f64 layers doubles (float64 arithmetic, on devices with double precision). Also\n"
    "prints \"tensors\": the bytes of the call's inputs and outputs in its buffers, each read\n"
    "or written once, and their rate (--json adds dtype, io_bytes, io_gbps). Not with\n"
    "--decode or --backward.\n"
    "\n";

static const char *usage_bench_decode =
    "--decode: times one decode step instead: a KV cache (clmha_kv_cache) holds S tokens per\n"
    "sequence, filled once; each step appends one new token per sequence (self-attention,\n"
    "is_causal) and attends over the S + 1 tokens, then the cache is truncated back to S. It\n"
    "reports the median ms per token, the bytes of cached keys and values the step reads\n"
    "(2 * N * H * (S + 1) * D * 4) per second, and the device's copy bandwidth measured in the\n"
    "same run: the median of up to 15 clEnqueueCopyBuffer of a buffer of 256 MiB (less on\n"
    "small devices), counted as bytes read + written (STREAM's convention), and the ratio of\n"
    "the two. --json adds: decode\n"
    "(true), cache_len, kv_heads, kv_bytes, kv_gbps, copy_bytes, copy_gbps, fraction_of_copy,\n"
    "stages {name: ms} (\"ms\" is per step; tgt_len is 1, src_len S + 1). Stages: each stage's\n"
    "median over up to 9 more steps with a marker after every stage (the decode core's\n"
    "kernels count as \"fused\"). --kv-heads G: a grouped-query layer\n"
    "with G key/value heads (G divides H; H query heads share each), whose cache and step read\n"
    "G heads' keys and values: kv_bytes = 2 * N * G * (S + 1) * D * 4.\n"
    "\n";

static const char *usage_bench_backward =
    "--backward: times the forward call with args.save followed by clmha_layer_backward(),\n"
    "on device buffers (no host copies), for the gradients of the inputs (query; key and\n"
    "value in cross-attention) and of every parameter the layer has, written (not\n"
    "accumulated), from a random grad_output; the weights, with --need-weights, get no\n"
    "gradient. --impl picks the core of both passes (auto: as the forward's). Warm-up: the\n"
    "kernels compile on a throwaway layer at a small shape, then the measured layer runs one\n"
    "forward and one backward at the shape. Then R turns of: step (forward + backward),\n"
    "forward alone, backward alone, each waited for with clFinish; medians of each.\n"
    "  FLOPs (P and A: the projection and the attention terms of the forward's count above):\n"
    "  forward = P + A; backward = 2*P + 2.5*A (input and weight gradients of every\n"
    "  projection; 5 attention products against the forward's 2, as FlashAttention counts:\n"
    "  Q*K^T again, dV, dP, dQ, dK); step = 3*P + 3.5*A. For self-attention P = 8*N*L*E^2\n"
    "  and A = 4*N*L^2*E.\n"
    "  Memory: the layer's scratch after the step (clmha_layer_scratch_bytes(): the forward's\n"
    "  and the backward's, which works in the layer's scratch plus its core's own) and the\n"
    "  saved state (clmha_saved_bytes()); for comparison, the growth of the process's\n"
    "  resident memory over the measured layer's first forward and backward calls (on a CPU\n"
    "  driver whose device memory is host memory, as PoCL's; CLBlast's temporary buffers\n"
    "  count there too) and the process's peak resident memory (getrusage).\n"
    "  --json adds: backward (true), forward_ms, forward_ms_min, forward_ms_max,\n"
    "  forward_flops, forward_gflops, backward_ms, backward_ms_min, backward_ms_max,\n"
    "  backward_flops, backward_gflops, projection_flops (P), attention_flops (A),\n"
    "  flop_convention, saved_bytes, training_scratch_bytes (scratch + saved),\n"
    "  backward_rss_growth_bytes, forward_rss_growth_bytes,\n"
    "  step_rss_growth_bytes (forward's + backward's: what the step really touched; the\n"
    "  layer scratch that a call with save does not use is allocated but not resident on\n"
    "  PoCL), peak_rss_bytes (null: unknown). ms, ms_min, ms_max, flops and gflops are the\n"
    "  step's; there are no stages.\n"
    "\n";

static const char *usage_bench_tail =
    "exit status: 0 success, 1 refused input (bad layer file, device error, shape too large\n"
    "for the device), 2 usage error\n";

enum { BENCH_MAX_LIST = 64 };
#define BENCH_MAX_SIZE ((size_t)1 << 24)  // largest N, L, S, E or H accepted
#define BENCH_MAX_REPEAT ((size_t)100000)

// Parses @p text, a comma-separated list of at most @p max_count positive integers no larger
// than @p max_value, into @p out. Reports and returns EXIT_USAGE when it is not one.
static int parse_sizes(const char *flag, const char *text, size_t max_count, size_t max_value,
                       size_t *out, size_t *count) {
    *count = 0;
    const char *p = text;
    for (;;) {
        char *end = NULL;
        errno = 0;
        unsigned long long v = isdigit((unsigned char)*p) ? strtoull(p, &end, 10) : 0;
        if (!end || errno || v == 0 || v > max_value || (*end != '\0' && *end != ',')) {
            clmha__cli_report("bench", "%s '%s': expected %s from 1 to %zu", flag, text,
                              max_count > 1 ? "comma-separated whole numbers" : "a whole number",
                              max_value);
            return EXIT_USAGE;
        }
        if (*count == max_count) {
            clmha__cli_report("bench", "%s '%s': more than %zu value%s", flag, text, max_count,
                              max_count == 1 ? "" : "s");
            return EXIT_USAGE;
        }
        out[(*count)++] = (size_t)v;
        if (*end == '\0') return EXIT_OK;
        p = end + 1;
    }
}

cl_int clmha__bench_fill_random(cl_command_queue queue, cl_mem buf, size_t count,
                                uint64_t *rng) {
    return clmha__bench_fill_random_as(queue, buf, count, CLMHA_DTYPE_F32, rng);
}

cl_int clmha__bench_fill_random_as(cl_command_queue queue, cl_mem buf, size_t count,
                                   clmha_dtype dtype, uint64_t *rng) {
    enum { CHUNK = 1 << 20 };
    size_t elem = clmha__dtype_size(dtype);
    // One chunk of elements of the dtype: floats, doubles (the same floats, widened: the
    // sequence is the same for every dtype) or 16-bit values.
    void *host = malloc((count < CHUNK ? count : CHUNK) * elem);
    if (!host) return CL_OUT_OF_HOST_MEMORY;
    cl_int err = CL_SUCCESS;
    for (size_t done = 0; done < count && err == CL_SUCCESS;) {
        size_t n = count - done < CHUNK ? count - done : CHUNK;
        for (size_t i = 0; i < n; ++i) {
            float x = clmha__cli_uniform(rng);
            if (dtype == CLMHA_DTYPE_F32) ((float *)host)[i] = x;
            else if (dtype == CLMHA_DTYPE_F64) ((double *)host)[i] = x;
            else if (dtype == CLMHA_DTYPE_F16) ((uint16_t *)host)[i] = clmha__f32_to_f16(x);
            else ((uint16_t *)host)[i] = clmha__f32_to_bf16(x);
        }
        err = clEnqueueWriteBuffer(queue, buf, CL_TRUE, done * elem, n * elem, host, 0, NULL,
                                   NULL);
        done += n;
    }
    free(host);
    return err;
}

void clmha__bench_json_head(const clmha_context *ctx, const bench_config *cfg, size_t n,
                            size_t l, size_t s, clmha_impl impl, bool self) {
    const clmha_layer_desc *d = &cfg->desc;
    printf("{\"device\": ");
    clmha__bench_json_string(clmha_context_device_name(ctx));
    char gemm[640];
    clmha_context_gemm_note(ctx, gemm, sizeof gemm);
    printf(", \"gemm\": ");
    clmha__bench_json_string(gemm);
    printf(", \"layer\": ");
    if (cfg->layer_path)
        clmha__bench_json_string(cfg->layer_path);
    else
        printf("null");
    printf(", \"batch\": %zu, \"tgt_len\": %zu, \"src_len\": %zu, \"embed_dim\": %zu, "
           "\"num_heads\": %zu, \"kdim\": %zu, \"vdim\": %zu, \"batch_first\": %s, "
           "\"need_weights\": %s, \"impl\": \"%s\", \"attention\": \"%s\", \"repeat\": %zu, ",
           n, l, s, d->embed_dim, d->num_heads, d->kdim, d->vdim,
           d->batch_first ? "true" : "false", cfg->need_weights ? "true" : "false",
           clmha_impl_name(impl), self ? "self" : "cross", cfg->repeat);
}

void clmha__bench_json_string(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; ++p) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    putchar('"');
}

double clmha__bench_median(double *times, size_t count, double *min, double *max) {
    qsort(times, count, sizeof *times, clmha__cli_cmp_double);
    *min = times[0];
    *max = times[count - 1];
    return count % 2 ? times[count / 2] : 0.5 * (times[count / 2 - 1] + times[count / 2]);
}

void clmha__bench_forward_flops(const clmha_layer_desc *d, size_t n, size_t l, size_t s,
                                double *projections, double *attention) {
    double dn = (double)n, dl = (double)l, ds = (double)s, de = (double)d->embed_dim;
    double s_padded = ds + d->add_bias_kv + d->add_zero_attn;
    *projections =
        2.0 * dn * de * (dl * de + ds * (double)d->kdim + ds * (double)d->vdim + dl * de);
    *attention = 4.0 * dn * dl * s_padded * de;
}

// The result of one shape.
typedef struct bench_result {
    size_t n, l, s, s_padded;
    bool self;
    clmha_impl impl;  // the core that ran: fused or unfused
    double ms, ms_min, ms_max, flops;
    size_t io_bytes;  // the call's tensors in the caller's buffers, read and written once
    size_t scratch_bytes;
    double stage_ms[CLMHA_STAGE_COUNT];
} bench_result;

clmha_layer *clmha__bench_layer(clmha_context *ctx, const bench_config *cfg) {
    clmha_layer *layer = NULL;
    if (cfg->layer_path) {
        clmha_load_options load = {.struct_size = sizeof load, .prefix = cfg->layer_prefix,
                                   .num_heads = cfg->layer_heads, .dtype = cfg->desc.dtype};
        if (clmha_layer_load_prefixed(&layer, ctx, cfg->layer_path, &load) != CLMHA_SUCCESS) {
            clmha__cli_report(
                "bench", "--layer %s: %s", cfg->layer_path,
                clmha__cli_without_path(clmha_context_last_error(ctx), cfg->layer_path));
            return NULL;
        }
        return layer;
    }
    size_t e = cfg->desc.embed_dim, h = cfg->desc.num_heads;
    size_t kvh = cfg->desc.num_kv_heads ? cfg->desc.num_kv_heads : h, kve = kvh * (e / h);
    clmha_status st;
    // Grouped-query attention (--kv-heads): W_q, then the first KVE rows of W_k's and W_v's
    // blocks of the random in_proj_weight.
    if ((st = clmha_layer_create(&layer, ctx, &cfg->desc)) ||
        (kve == e &&
         (st = clmha_layer_set_parameter(layer, "in_proj_weight", cfg->w_in, 3 * e * e))) ||
        (kve != e &&
         ((st = clmha_layer_set_parameter(layer, "q_proj_weight", cfg->w_in, e * e)) ||
          (st = clmha_layer_set_parameter(layer, "k_proj_weight", cfg->w_in + e * e, kve * e)) ||
          (st = clmha_layer_set_parameter(layer, "v_proj_weight", cfg->w_in + 2 * e * e,
                                          kve * e)))) ||
        (st = clmha_layer_set_parameter(layer, "in_proj_bias", cfg->b_in, e + 2 * kve)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.weight", cfg->w_out, e * e)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.bias", cfg->b_out, e))) {
        clmha__cli_report("bench", "random layer (embed_dim %zu, num_heads %zu): %s: %s", e,
                          cfg->desc.num_heads, clmha_status_string(st),
                          clmha_context_last_error(ctx));
        clmha_layer_release(layer);
        return NULL;
    }
    return layer;
}

int clmha__bench_io_make(clmha_context *ctx, const bench_config *cfg, clmha_layer *layer,
                         size_t n, size_t l, size_t s, bench_io *io) {
    const clmha_layer_desc *d = &cfg->desc;
    size_t e = d->embed_dim, kd = d->kdim, vd = d->vdim;
    *io = (bench_io){.n = n, .l = l, .s = s, .self = l == s && kd == e && vd == e,
                     .kv_same = kd == vd};
    snprintf(io->where, sizeof io->where, "N %zu, L %zu, S %zu", n, l, s);
    const char *where = io->where;
    size_t *counts = io->counts;
    if (!clmha__mul3(n, l, e, &counts[0]) || !clmha__mul3(n, s, kd, &counts[1]) ||
        !clmha__mul3(n, s, vd, &counts[2]) || !clmha__mul3(n, l, s, &counts[4]) ||
        counts[0] > SIZE_MAX / 4 || counts[1] > SIZE_MAX / 4 || counts[2] > SIZE_MAX / 4) {
        clmha__cli_report("bench", "%s, E %zu: the tensor sizes overflow", where, e);
        return EXIT_REFUSED;
    }
    clmha_forward_args *args = &io->args;
    *args = (clmha_forward_args){.struct_size = sizeof *args, .need_weights = cfg->need_weights};
    args->query = (clmha_tensor){.ndim = 3, .shape = {l, n, e}};
    if (!io->self) {
        args->key = (clmha_tensor){.ndim = 3, .shape = {s, n, kd}};
        if (!io->kv_same) args->value = (clmha_tensor){.ndim = 3, .shape = {s, n, vd}};
    }
    if (d->batch_first) {
        clmha_tensor *t[3] = {&args->query, &args->key, &args->value};
        for (int i = 0; i < 3; ++i) {
            size_t seq = t[i]->shape[0];
            t[i]->shape[0] = t[i]->shape[1];
            t[i]->shape[1] = seq;
        }
    }
    size_t out_count = 0, w_count = 0;
    if (clmha_layer_output_counts(layer, args, &out_count, &w_count) != CLMHA_SUCCESS) {
        clmha__cli_report("bench", "%s: %s", where, clmha_context_last_error(ctx));
        return EXIT_REFUSED;
    }
    counts[3] = out_count;
    counts[4] = w_count;
    if (io->self) counts[1] = 0;
    if (io->self || io->kv_same) counts[2] = 0;

    // The buffers, with random inputs and a zeroed output.
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    cl_context cl = clmha_context_cl_context(ctx);
    cl_ulong max_alloc = 0;
    clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof max_alloc,
                    &max_alloc, NULL);
    static const char *names[BENCH_BUFS] = {"query", "key", "value", "output", "weights"};
    uint64_t rng = 7;
    cl_int err = CL_SUCCESS;
    const char *what = NULL;
    size_t elem = clmha__dtype_size(d->dtype);  // the layer's elements: 8, 4 or 2 bytes
    for (int i = 0; i < BENCH_BUFS; ++i) {
        if (!counts[i]) continue;
        what = names[i];
        if (max_alloc && (cl_ulong)counts[i] * elem > max_alloc) {
            clmha__cli_report("bench",
                              "%s: the %s buffer needs %zu bytes, more than the largest allocation "
                              "of %s (%llu bytes)",
                              where, names[i], counts[i] * elem, clmha_context_device_name(ctx),
                              (unsigned long long)max_alloc);
            return EXIT_REFUSED;
        }
        io->bufs[i] = clCreateBuffer(cl, CL_MEM_READ_WRITE, counts[i] * elem, NULL, &err);
        if (err != CL_SUCCESS) goto cl_fail;
        if (i < 3) {
            err = clmha__bench_fill_random_as(queue, io->bufs[i], counts[i], d->dtype, &rng);
        } else {
            uint16_t zero = 0;  // +0 in every dtype (float64 and float32 too)
            err = clEnqueueFillBuffer(queue, io->bufs[i], &zero, sizeof zero, 0,
                                      counts[i] * elem, 0, NULL, NULL);
        }
        if (err != CL_SUCCESS) goto cl_fail;
    }
    what = "clFinish";
    if ((err = clFinish(queue)) != CL_SUCCESS) goto cl_fail;
    args->query.buffer = io->bufs[BENCH_QUERY];
    if (!io->self) args->key.buffer = io->bufs[BENCH_KEY];
    if (!io->self && !io->kv_same) args->value.buffer = io->bufs[BENCH_VALUE];
    return EXIT_OK;
cl_fail:
    clmha__cli_report("bench", "%s: %s%s failed on %s: OpenCL error %d", where, what,
                      strcmp(what, "clFinish") ? " buffer" : "", clmha_context_device_name(ctx),
                      (int)err);
    return EXIT_REFUSED;
}

void clmha__bench_io_free(bench_io *io) {
    for (int i = 0; i < BENCH_BUFS; ++i)
        if (io->bufs[i]) clReleaseMemObject(io->bufs[i]);
    memset(io->bufs, 0, sizeof io->bufs);
}

// Times one shape: warm-up, cfg->repeat timed runs, one profiled run. Returns EXIT_OK or
// EXIT_REFUSED after reporting.
static int bench_shape(clmha_context *ctx, const bench_config *cfg, size_t n, size_t l, size_t s,
                       double *times, bench_result *res) {
    const clmha_layer_desc *d = &cfg->desc;
    *res = (bench_result){.n = n, .l = l, .s = s, .self = l == s && d->kdim == d->embed_dim &&
                                                          d->vdim == d->embed_dim};
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    bench_io io = {0};
    clmha_layer *layer = NULL;
    int rc = EXIT_REFUSED;
    cl_int err = CL_SUCCESS;
    const char *where = io.where;
    snprintf(io.where, sizeof io.where, "N %zu, L %zu, S %zu", n, l, s);

    if (!(layer = clmha__bench_layer(ctx, cfg))) goto done;
    clmha_layer_set_impl(layer, cfg->impl);
    res->impl = cfg->impl != CLMHA_IMPL_AUTO ? cfg->impl
                : cfg->need_weights         ? CLMHA_IMPL_UNFUSED
                                            : CLMHA_IMPL_FUSED;
    res->s_padded = s + d->add_bias_kv + d->add_zero_attn;
    if (clmha__bench_io_make(ctx, cfg, layer, n, l, s, &io) != EXIT_OK) goto done;
    const clmha_forward_args *args = &io.args;
    cl_mem out = io.bufs[BENCH_OUTPUT], weights = io.bufs[BENCH_WEIGHTS];

    // Warm-up: bake sizes the scratch and runs the forward once at this shape, which compiles
    // the kernels. Bake runs cross-attention with separate key and value tensors, so the
    // cross-attention path with key = value runs once more here.
    clmha_status st = clmha_layer_bake(layer, n, l, s, cfg->need_weights);
    if (!st && !io.self) st = clmha_layer_forward(layer, args, out, 0, weights, 0, 0, NULL, NULL);
    if (!st && clFinish(queue) != CL_SUCCESS) st = CLMHA_OPENCL_ERROR;
    if (st) goto forward_fail;

    for (size_t r = 0; r < cfg->repeat; ++r) {
        double t0 = clmha__cli_now_ms();
        if ((st = clmha_layer_forward(layer, args, out, 0, weights, 0, 0, NULL, NULL)))
            goto forward_fail;
        if ((err = clFinish(queue)) != CL_SUCCESS) goto cl_fail;
        times[r] = clmha__cli_now_ms() - t0;
    }
    res->ms = clmha__bench_median(times, cfg->repeat, &res->ms_min, &res->ms_max);

    // One more run with a marker after every stage.
    if ((st = clmha_layer_set_profiling(layer, true)) ||
        (st = clmha_layer_forward(layer, args, out, 0, weights, 0, 0, NULL, NULL)) ||
        (st = clmha_layer_stage_times(layer, res->stage_ms)) ||
        (st = clmha_layer_set_profiling(layer, false)))
        goto forward_fail;
    if ((err = clFinish(queue)) != CL_SUCCESS) goto cl_fail;

    res->scratch_bytes = clmha_layer_scratch_bytes(layer);
    res->io_bytes = 0;
    for (int i = 0; i < BENCH_BUFS; ++i) res->io_bytes += io.counts[i];
    res->io_bytes *= clmha__dtype_size(d->dtype);
    double projections, attention;
    clmha__bench_forward_flops(d, n, l, s, &projections, &attention);
    res->flops = projections + attention;
    rc = EXIT_OK;
    goto done;
forward_fail:
    clmha__cli_report("bench", "forward pass failed on %s at %s: %s: %s",
                      clmha_context_device_name(ctx), where, clmha_status_string(st),
                      clmha_context_last_error(ctx));
    goto done;
cl_fail:
    clmha__cli_report("bench", "%s: clFinish failed on %s: OpenCL error %d", where,
                      clmha_context_device_name(ctx), (int)err);
done:
    clmha__bench_io_free(&io);
    clmha_layer_release(layer);
    return rc;
}

static void bench_print(const clmha_context *ctx, const bench_config *cfg,
                        const bench_result *res) {
    const clmha_layer_desc *d = &cfg->desc;
    if (cfg->json) {
        clmha__bench_json_head(ctx, cfg, res->n, res->l, res->s, res->impl, res->self);
        printf("\"dtype\": \"%s\", \"ms\": %.6g, \"ms_min\": %.6g, \"ms_max\": %.6g, "
               "\"flops\": %.0f, \"gflops\": %.6g, \"io_bytes\": %zu, \"io_gbps\": %.6g, "
               "\"scratch_bytes\": %zu, \"stages\": {",
               clmha__dtype_name(d->dtype), res->ms, res->ms_min, res->ms_max, res->flops,
               res->flops / res->ms / 1e6, res->io_bytes, (double)res->io_bytes / res->ms / 1e6,
               res->scratch_bytes);
        for (int i = 0; i < CLMHA_STAGE_COUNT; ++i)
            printf("%s\"%s\": %.6g", i ? ", " : "", clmha_stage_name((clmha_stage)i),
                   res->stage_ms[i]);
        printf("}}\n");
        fflush(stdout);
        return;
    }
    double total = 0;
    for (int i = 0; i < CLMHA_STAGE_COUNT; ++i) total += res->stage_ms[i];
    printf("shape:   N %zu, L %zu, S %zu (%s-attention%s), need_weights %s, %s core\n",
           res->n, res->l, res->s, res->self ? "self" : "cross",
           res->self ? ", packed QKV projection"
           : d->kdim == d->vdim ? ", key = value" : ", separate key and value",
           cfg->need_weights ? "on" : "off", clmha_impl_name(res->impl));
    printf("time:    %.3f ms per forward (median of %zu; min %.3f, max %.3f)\n", res->ms,
           cfg->repeat, res->ms_min, res->ms_max);
    printf("speed:   %.2f GFLOP/s (%.4g GFLOP per forward)\n", res->flops / res->ms / 1e6,
           res->flops / 1e9);
    printf("tensors: %zu bytes of %s inputs and outputs, %.2f GB/s\n", res->io_bytes,
           clmha__dtype_name(d->dtype), (double)res->io_bytes / res->ms / 1e6);
    printf("scratch: %zu bytes (%.1f MiB)\n", res->scratch_bytes,
           (double)res->scratch_bytes / (1024.0 * 1024.0));
    printf("stages:  (one profiled run, %.3f ms)\n", total);
    for (int i = 0; i < CLMHA_STAGE_COUNT; ++i)
        printf("  %-9s %10.3f ms %5.1f%%\n", clmha_stage_name((clmha_stage)i), res->stage_ms[i],
               total > 0 ? 100.0 * res->stage_ms[i] / total : 0.0);
    fflush(stdout);
}

// Which GEMM parameters the run uses; on a CPU left with CLBlast's generic ones (5-6x slower
// there than tuned), the advice to tune. With the GEMMs in the host BLAS, CLBlast's parameters
// are not used (a tuning's fused tiles still are).
static void print_tuning(const clmha_context *ctx) {
    char note[1024] = "";
    clmha_context_tuning_note(ctx, note, sizeof note);
    bool host = clmha_context_gemm(ctx) == CLMHA_GEMM_HOST;
    printf("tuning:  %s%s\n", note,
           host ? " (CLBlast's GEMM parameters unused: the GEMMs run in the host BLAS)" : "");
    if (host) return;
    cl_device_type type = 0;
    clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_TYPE, sizeof type, &type, NULL);
    if (clmha_context_tuning_source(ctx) == CLMHA_TUNING_SOURCE_CLBLAST &&
        (type & CL_DEVICE_TYPE_CPU))
        printf("hint:    CLBlast's generic GEMM parameters are slow on CPUs: run `clmha tune` "
               "once (about 5 minutes) for this device\n");
}

int clmha__cli_bench(int argc, char **argv) {
    const char *batch_opt = NULL, *tgt_opt = NULL, *src_opt = NULL, *embed_opt = NULL,
               *heads_opt = NULL, *repeat_opt = NULL, *layer_path = NULL, *device = NULL,
               *impl_opt = NULL, *cache_opt = NULL, *kv_heads_opt = NULL, *dtype_opt = NULL,
               *prefix = NULL;
    bool need_weights = false, batch_first = false, json = false, backward = false,
         decode = false;
    const clmha__cli_option opts[] = {
        {.name = "--impl", .value = &impl_opt},
        {.name = "--batch", .value = &batch_opt},
        {.name = "--tgt-len", .value = &tgt_opt},
        {.name = "--src-len", .value = &src_opt},
        {.name = "--embed", .value = &embed_opt},
        {.name = "--heads", .value = &heads_opt},
        {.name = "--need-weights", .flag = &need_weights},
        {.name = "--batch-first", .flag = &batch_first},
        {.name = "--layer", .value = &layer_path},
        {.name = "--prefix", .value = &prefix},
        {.name = "--repeat", .value = &repeat_opt},
        {.name = "--device", .value = &device, .allow_empty = true},
        {.name = "--json", .flag = &json},
        {.name = "--backward", .flag = &backward},
        {.name = "--decode", .flag = &decode},
        {.name = "--cache-len", .value = &cache_opt},
        {.name = "--kv-heads", .value = &kv_heads_opt},
        {.name = "--dtype", .value = &dtype_opt},
    };
    char usage[8192];
    snprintf(usage, sizeof usage, "%s%s%s%s%s", usage_bench, usage_bench_dtype,
             usage_bench_backward, usage_bench_decode, usage_bench_tail);
    int rc;
    if (!clmha__cli_parse_options("bench", argc, argv, opts, sizeof opts / sizeof opts[0],
                                  usage, &rc))
        return rc;
    size_t batches[BENCH_MAX_LIST] = {8}, tgts[BENCH_MAX_LIST] = {128}, srcs[BENCH_MAX_LIST];
    size_t nb = 1, nt = 1, ns = 0, e = 512, h = 8, repeat = 10, one = 0;
    if ((batch_opt && (rc = parse_sizes("--batch", batch_opt, BENCH_MAX_LIST, BENCH_MAX_SIZE,
                                        batches, &nb))) ||
        (tgt_opt && (rc = parse_sizes("--tgt-len", tgt_opt, BENCH_MAX_LIST, BENCH_MAX_SIZE,
                                      tgts, &nt))) ||
        (src_opt && (rc = parse_sizes("--src-len", src_opt, BENCH_MAX_LIST, BENCH_MAX_SIZE,
                                      srcs, &ns))) ||
        (embed_opt && (rc = parse_sizes("--embed", embed_opt, 1, BENCH_MAX_SIZE, &e, &one))) ||
        (heads_opt && (rc = parse_sizes("--heads", heads_opt, 1, BENCH_MAX_SIZE, &h, &one))) ||
        (repeat_opt && !(backward && strcmp(repeat_opt, "0") == 0) &&
         (rc = parse_sizes("--repeat", repeat_opt, 1, BENCH_MAX_REPEAT, &repeat, &one))))
        return rc;
    if (repeat_opt && backward && strcmp(repeat_opt, "0") == 0) repeat = 0;
    size_t caches[BENCH_MAX_LIST], nc = 0;
    if (decode != (cache_opt != NULL) || (decode && (backward || tgt_opt || src_opt ||
                                                     need_weights || layer_path || impl_opt))) {
        clmha__cli_report("bench", "%s",
                          decode ? (cache_opt ? "--decode takes --batch, --embed, --heads, "
                                                "--batch-first, --repeat, --device and --json "
                                                "only"
                                              : "--decode needs --cache-len")
                                 : "--cache-len goes with --decode");
        return EXIT_USAGE;
    }
    if (cache_opt &&
        (rc = parse_sizes("--cache-len", cache_opt, BENCH_MAX_LIST, BENCH_MAX_SIZE, caches, &nc)))
        return rc;
    size_t kv_heads = 0;
    if (kv_heads_opt && !decode) {
        clmha__cli_report("bench", "--kv-heads goes with --decode");
        return EXIT_USAGE;
    }
    if (kv_heads_opt &&
        (rc = parse_sizes("--kv-heads", kv_heads_opt, 1, BENCH_MAX_SIZE, &kv_heads, &one)))
        return rc;
    if (prefix && !layer_path) {
        clmha__cli_report("bench", "--prefix goes with --layer");
        return EXIT_USAGE;
    }
    if (!layer_path && e % h != 0) {
        clmha__cli_report("bench", "--embed %zu is not a multiple of --heads %zu", e, h);
        return EXIT_USAGE;
    }
    if (kv_heads && h % kv_heads != 0) {
        clmha__cli_report("bench", "--kv-heads %zu does not divide --heads %zu", kv_heads, h);
        return EXIT_USAGE;
    }
    clmha_impl impl;
    if (!clmha__cli_parse_impl("bench", impl_opt, need_weights, "--need-weights", &impl))
        return EXIT_USAGE;
    clmha_dtype dtype;
    if (!clmha__cli_parse_dtype("bench", dtype_opt, &dtype)) return EXIT_USAGE;
    if (dtype != CLMHA_DTYPE_F32 && (decode || backward)) {
        bool f64 = dtype == CLMHA_DTYPE_F64;
        clmha__cli_report("bench", "--dtype %s: %s times float32 layers only%s", dtype_opt,
                          decode ? "--decode" : "--backward",
                          decode ? (f64 ? " (float64 layers have no KV cache yet)" : "")
                          : f64  ? " (float64 layers have no backward pass yet)"
                                 : " (16-bit layers have no backward pass yet)");
        return EXIT_USAGE;
    }

    bench_config cfg = {.layer_path = layer_path, .layer_prefix = prefix,
                        .layer_heads = layer_path && heads_opt ? h : 0,
                        .need_weights = need_weights, .json = json, .impl = impl,
                        .repeat = repeat};
    cfg.desc = (clmha_layer_desc){.struct_size = sizeof cfg.desc,
                                  .embed_dim = e, .num_heads = h, .kdim = e, .vdim = e,
                                  .bias = true, .batch_first = batch_first,
                                  .num_kv_heads = kv_heads, .dtype = dtype};
    float *params = NULL;
    double *times = NULL;
    clmha_context *ctx = NULL;
    clmha_layer *layer = NULL;
    rc = EXIT_REFUSED;
    if (layer_path) {
        // A regular file only: opening a FIFO or a device must not block (base/file_read.h).
        FILE *f = NULL;
        size_t layer_size;
        char msg[1024];
        if (clmha__file_open_regular(layer_path, &f, &layer_size, NULL, msg, sizeof msg)) {
            clmha__cli_report("bench", "--layer %s: %s", layer_path,
                              clmha__cli_without_path(msg, layer_path));
            goto done;
        }
        fclose(f);
    }
    if (!(times = malloc((repeat ? repeat : 1) * sizeof *times))) {
        clmha__cli_report("bench", "out of host memory");
        goto done;
    }
    if (!layer_path) {  // random parameters, PyTorch-like scale, made before the device opens
        // 4 E^2 + 4 E floats: in_proj_weight (3E, E), out_proj.weight (E, E) and the biases.
        size_t count = 0, bytes = 0;
        bool fits = clmha__mul(e, e, &count) && clmha__mul(count, 4, &count) &&
                    count <= SIZE_MAX - 4 * e && clmha__mul(count += 4 * e, sizeof *params, &bytes);
        // More than the machine's memory is refused without asking malloc (which may overcommit,
        // or abort under a sanitizer, rather than fail).
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        double ram = pages > 0 && page > 0 ? (double)pages * (double)page : 0;
        if (!fits || (ram > 0 && (double)bytes > ram) || !(params = malloc(bytes))) {
            clmha__cli_report("bench",
                              "--embed %zu: cannot allocate %zu floats (%.3g GB) of host memory "
                              "for the random layer's parameters (4*E^2 + 4*E; this machine has "
                              "%.3g GB)",
                              e, count, ((double)e * e * 4 + 4.0 * e) * 4 / 1e9, ram / 1e9);
            goto done;
        }
        cfg.w_in = params;
        cfg.w_out = params + 3 * e * e;
        cfg.b_in = params + 4 * e * e;
        cfg.b_out = params + 4 * e * e + 3 * e;
        uint64_t rng = 42;
        float a = 1.0f / sqrtf((float)e);
        for (size_t i = 0; i < 4 * e * e; ++i) params[i] = a * clmha__cli_uniform(&rng);
        for (size_t i = 4 * e * e; i < 4 * e * e + 4 * e; ++i)
            params[i] = 0.1f * clmha__cli_uniform(&rng);
    }
    if (!(ctx = clmha__cli_open_context("bench", device))) goto done;
    if (layer_path) {  // the file's configuration
        if (!(layer = clmha__bench_layer(ctx, &cfg))) goto done;
        clmha_layer_get_desc(layer, &cfg.desc);
        clmha_layer_release(layer);
        layer = NULL;
        const clmha_layer_desc *d = &cfg.desc;
        if ((embed_opt && d->embed_dim != e) || (heads_opt && d->num_heads != h) ||
            (batch_first && !d->batch_first)) {
            clmha__cli_report("bench",
                              "--layer %s has embed_dim %zu, num_heads %zu, batch_first %s: "
                              "it disagrees with %s",
                              layer_path, d->embed_dim, d->num_heads,
                              d->batch_first ? "true" : "false",
                              embed_opt && d->embed_dim != e   ? "--embed"
                              : heads_opt && d->num_heads != h ? "--heads"
                                                               : "--batch-first");
            goto done;
        }
    }
    if (!json) {
        const clmha_layer_desc *d = &cfg.desc;
        printf("device:  %s\n", clmha_context_device_name(ctx));
        char gemm[640];
        clmha_context_gemm_note(ctx, gemm, sizeof gemm);
        printf("gemm:    %s\n", gemm);
        printf("layer:   embed_dim %zu, num_heads %zu, kdim %zu, vdim %zu%s%s%s%s (%s)\n",
               d->embed_dim, d->num_heads, d->kdim, d->vdim, d->bias ? ", bias" : "",
               d->add_bias_kv ? ", add_bias_kv" : "", d->add_zero_attn ? ", add_zero_attn" : "",
               d->batch_first ? ", batch_first" : "", layer_path ? layer_path : "random");
        print_tuning(ctx);
        fflush(stdout);
    }
    for (size_t ib = 0; ib < nb && decode; ++ib)
        for (size_t ic = 0; ic < nc; ++ic)
            if (clmha__bench_decode_shape(ctx, &cfg, batches[ib], caches[ic], times) != EXIT_OK)
                goto done;
    for (size_t ib = 0; ib < nb && !decode; ++ib)
        for (size_t it = 0; it < nt; ++it)
            for (size_t is = 0; is < (ns ? ns : 1); ++is) {
                bench_result res;
                size_t s = ns ? srcs[is] : tgts[it];
                if (backward) {
                    if (clmha__bench_backward_shape(ctx, &cfg, batches[ib], tgts[it], s,
                                                    times) != EXIT_OK)
                        goto done;
                    continue;
                }
                if (bench_shape(ctx, &cfg, batches[ib], tgts[it], s, times, &res) != EXIT_OK)
                    goto done;
                bench_print(ctx, &cfg, &res);
            }
    rc = EXIT_OK;
done:
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    free(params);
    free(times);
    return rc;
}
