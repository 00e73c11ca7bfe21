// `clmha bench`: times the device-buffer forward pass per shape: ms, GFLOP/s, scratch, stages;
// with --backward, the training step (bench_backward.c), with --decode, a decode step
// (bench_decode.c). Options, help and the forward here; what the three share is in
// bench_common.c.
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
    "                   [--causal] [--window LEFT,RIGHT] [--softcap C] [--alibi] [--sinks]\n"
"                   [--score-mod FILE.cl [--mod-params P.npy]]\n"
"                   [--impl auto|fused|unfused] [--backward] [--host] [--repeat R]\n"
"                   [--device SPEC] [--dtype f32|f64|f16|bf16] [--json]\n"
"       clmha bench --decode --cache-len S[,S...] [--kv-heads G] [--page-size P]\n"
"                   [--kv-dtype f32|f16|bf16|int8|int4] [--batch N] [--embed E]\n"
"                   [--heads H] [--window LEFT,RIGHT] [--softcap C] [--alibi] [--sinks]\n"
"                   [--score-mod FILE.cl [--mod-params P.npy]] [--repeat R]\n"
"                   [--device SPEC] [--json]\n";

static const char *usage_bench_about =
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
    "  --causal             is_causal: query i attends the keys j <= i (top-left)\n"
    "  --window LEFT,RIGHT  a sliding window on the random layer (clmha_layer_desc::window):\n"
    "                       query i attends the keys i - LEFT .. i + RIGHT, -1 leaving a side\n"
    "                       unbounded (--window 1023,0 --causal: Mistral's). The fused cores\n"
    "                       skip the key tiles it forbids, so their time grows linearly in L\n"
    "  --softcap C          the random layer soft-caps its scores to C*tanh(s/C)\n"
    "                       (clmha_layer_desc::softcap; 0: off)\n"
    "  --alibi              the random layer has ALiBi (clmha_layer_desc::alibi, the\n"
    "                       geometric slopes)\n"
    "  --sinks              the random layer has attention sinks (clmha_layer_desc::sinks,\n"
    "                       zero logits as created). All three also with --backward and\n"
    "                       --decode\n"
    "  --score-mod FILE.cl  the random layer has the user score and mask functions of this\n"
    "                       OpenCL C file (clmha_layer_desc::mod_source; see clmha run\n"
    "                       --help), to time them against the built-in variants; with\n"
    "                       --backward it must define clmha_score_mod_grad when it defines\n"
    "                       clmha_score_mod. Also with --decode\n"
    "  --mod-params P.npy   their p: a 1-D float32 (or float64, float16) array; default:\n"
    "                       none (p empty). Needs --score-mod\n"
    "\n";

// The help's run options (C11 compilers need not take string literals past 4095 characters).
static const char *usage_bench_run =
    "run:\n"
    "  --impl I             attention core: auto (default: fused without --need-weights,\n"
    "                       else unfused; on a CPU with the host BLAS and AVX-512 or\n"
    "                       AVX2, long calls without masks but --causal or a boolean\n"
    "                       key padding mask in C on the CPU),\n"
    "                       fused (the OpenCL kernel) or unfused\n"
    "  --backward           time the training step instead: see \"--backward\" below\n"
    "  --host               time the host-array calls instead: see \"--host\" below\n"
    "  --repeat R           timed runs per shape (default 10; with --backward, 0: no timed\n"
    "                       runs, the times are the measured layer's first step's)\n"
    "  --device SPEC        \"P:D\", gpu, cpu, accelerator or part of a device name (see\n"
    "                       clmha devices); default: $CLMHA_DEVICE, else the first GPU, else\n"
    "                       the first device\n"
    "  --json               one JSON object per shape and line: device, gemm (where the\n"
    "                       GEMMs run: clmha_context_gemm_note()), layer, batch, tgt_len,\n"
    "                       src_len, embed_dim, num_heads, kdim, vdim, batch_first,\n"
    "                       need_weights, impl (the core used), attention (\"self\"/\"cross\"),\n"
    "                       repeat, is_causal, window_left, window_right (null without a\n"
    "                       window), softcap (0: off), alibi, sinks, score_mod (the\n"
    "                       --score-mod file, null: none), dtype (see --dtype below),\n"
    "                       ms (median),\n"
    "                       ms_min, ms_max, flops, gflops, io_bytes, io_gbps, scratch_bytes,\n"
    "                       stages {name: ms}, host\n"

    "  --help, -h           print this help\n"
    "\n"
    "FLOPs counted (the GEMMs; masks, softmax and head split/merge are not counted):\n"
    "  2*N*E*(L*E + S*kdim + S*vdim + L*E)   Q, K, V and output projections\n"
    "  + 4*N*L*S'*E                          Q*K^T and weights*V (S' = S + add_bias_kv\n"
    "                                        + add_zero_attn)\n"
    "  = 2*N*E^2*(2L + 2S) + 4*N*L*S*E for kdim = vdim = E, and 8*N*L*E^2 + 4*N*L^2*E\n"
    "  for self-attention (L = S). With --causal or --window, L*S' counts only the (query,\n"
    "  key) pairs they allow (the appended keys all). GFLOP/s = FLOPs / median time.\n"
    "The GEMMs run in the host BLAS on CPU devices with native kernels, else in CLBlast\n"
    "(the 'gemm:' line); CLMHA_GEMM=clblast|host|auto chooses.\n"
    "\n";

// The help's second part (C11 compilers need not take string literals past 4095 characters).
static const char *usage_bench_dtype =
    "--dtype T: the layer's dtype (clmha_dtype): f32 (default), f64, f16 or bf16. The inputs,\n"
    "outputs and parameters of f16 and bf16 layers are 16-bit values (float32 arithmetic),\n"
    "those of f64 layers doubles (float64 arithmetic, on devices with double precision). Also\n"
    "prints \"tensors\": the bytes of the call's inputs and outputs in its buffers, each read\n"
    "or written once, and their rate (--json adds dtype, io_bytes, io_gbps). With --backward,\n"
    "gradients in the layer's dtype; with --decode, the step of a layer of that dtype (an f64\n"
    "layer's cache holds doubles with --kv-dtype f32).\n"
    "\n"
    "--host: times the host-array calls instead, those of a program whose tensors are in\n"
    "host memory (and of the Python package): clmha_layer_forward_host() (with --backward,\n"
    "and clmha_layer_backward_host()) on random float32 arrays, copied in and the results\n"
    "(gradients) copied out on every run, through the layer's staging buffers (an untimed\n"
    "call first allocates them). The stage times stay the device call's. --json: \"host\":\n"
    "true. Not with --decode.\n"
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
    "G heads' keys and values: kv_bytes = 2 * N * G * (S + 1) * D * 4. --page-size P: a paged\n"
    "cache (clmha_kv_cache_create_with()) of P-token pages, a pool of just enough pages;\n"
    "--kv-dtype f32|f16|bf16|int8|int4: how the cache stores keys and values (int8: one\n"
    "scale per token and head; int4: one per 32 dimensions; kv_bytes counts 2, 1 + 4/D or\n"
    "0.5 + 4/32 bytes a value). --json adds page_size (0: contiguous) and kv_dtype.\n"
    "--window LEFT,RIGHT: a layer with a sliding window (clmha_layer_desc::window; -1 leaves a\n"
    "side unbounded): the step's token sees the LEFT + 1 latest tokens (is_causal bounds the\n"
    "right side), and kv_bytes counts those (S + 1 at most); --json adds window_left,\n"
    "window_right.\n"
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

// --window LEFT,RIGHT: the bounds of a sliding window (clmha_layer_desc::window_left,
// window_right), each -1 (unbounded) or a whole number. EXIT_OK, or EXIT_USAGE after reporting.
static int parse_window(const char *text, int64_t bounds[2]) {
    const char *p = text;
    for (int i = 0; i < 2; ++i) {
        char *end = NULL;
        errno = 0;
        long long v = isdigit((unsigned char)*p) || *p == '-' ? strtoll(p, &end, 10) : -2;
        if (!end || errno || v < -1 || *end != (i == 0 ? ',' : '\0')) {
            clmha__cli_report("bench", "--window '%s': expected LEFT,RIGHT, each -1 (unbounded) "
                                       "or a whole number",
                              text);
            return EXIT_USAGE;
        }
        bounds[i] = v;
        p = end + 1;
    }
    return EXIT_OK;
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

// --host: one warm-up and then @p repeat timed calls of clmha_layer_forward_host() on host
// arrays of io's shape (random float32 inputs), into @p times. A failed call's status (or
// CLMHA_OUT_OF_MEMORY without host memory), its message on the context.
static clmha_status time_host_calls(clmha_layer *layer, const bench_io *io, size_t repeat,
                                    double *times) {
    float *in[3] = {NULL}, *out = NULL, *w = NULL;
    const size_t *c = io->counts;
    clmha_status st = CLMHA_OUT_OF_MEMORY;
    clmha_forward_args a = io->args;
    clmha_tensor *t[3] = {&a.query, &a.key, &a.value};
    uint64_t rng = 7;
    for (int i = 0; i < 3; ++i) {
        t[i]->buffer = NULL;
        if (!c[BENCH_QUERY + i]) continue;
        if (!(in[i] = malloc(c[BENCH_QUERY + i] * sizeof(float)))) goto done;
        for (size_t j = 0; j < c[BENCH_QUERY + i]; ++j) in[i][j] = clmha__cli_uniform(&rng);
        t[i]->data = in[i];
    }
    if (!(out = malloc(c[BENCH_OUTPUT] * sizeof *out)) ||
        (c[BENCH_WEIGHTS] && !(w = malloc(c[BENCH_WEIGHTS] * sizeof *w))))
        goto done;
    for (size_t r = 0; r <= repeat; ++r) {  // r = 0: the warm-up (the staging buffers)
        double t0 = clmha__cli_now_ms();
        if ((st = clmha_layer_forward_host(layer, &a, out, c[BENCH_OUTPUT], w,
                                           c[BENCH_WEIGHTS])))
            goto done;
        if (r) times[r - 1] = clmha__cli_now_ms() - t0;
    }
done:
    for (int i = 0; i < 3; ++i) free(in[i]);
    free(out);
    free(w);
    return st;
}

// Warm-up, then cfg->repeat timed forwards of @p layer on @p io's buffers (--host: on host
// arrays) into @p times. Warm-up: bake sizes the scratch and runs the forward once at this
// shape, which compiles the kernels. Bake runs cross-attention with separate key and value
// tensors, so the cross-attention path with key = value runs once more here. EXIT_OK, or
// EXIT_REFUSED after reporting.
static int time_forwards(clmha_context *ctx, const bench_config *cfg, clmha_layer *layer,
                         const bench_io *io, double *times) {
    const clmha_forward_args *args = &io->args;
    cl_mem out = io->bufs[BENCH_OUTPUT], weights = io->bufs[BENCH_WEIGHTS];
    clmha_status st = clmha_layer_bake(layer, io->n, io->l, io->s, cfg->need_weights);
    if (!st && !io->self) st = clmha_layer_forward(layer, args, out, 0, weights, 0, 0, NULL, NULL);
    if (!st && clFinish(clmha_context_cl_queue(ctx)) != CL_SUCCESS) st = CLMHA_OPENCL_ERROR;
    if (!st && cfg->host) {
        st = time_host_calls(layer, io, cfg->repeat, times);
    } else if (!st) {
        for (size_t r = 0; r < cfg->repeat; ++r) {
            double t0 = clmha__cli_now_ms();
            if ((st = clmha_layer_forward(layer, args, out, 0, weights, 0, 0, NULL, NULL))) break;
            if (!clmha__bench_finish(ctx, io->where)) return EXIT_REFUSED;
            times[r] = clmha__cli_now_ms() - t0;
        }
    }
    if (!st) return EXIT_OK;
    clmha__bench_call_failed(ctx, io->where, "forward pass", st);
    return EXIT_REFUSED;
}

// One more forward of @p layer on @p io's buffers, with a marker after every stage: the
// stages' times into res->stage_ms. EXIT_OK, or EXIT_REFUSED after reporting.
static int profile_stages(clmha_context *ctx, clmha_layer *layer, const bench_io *io,
                          bench_result *res) {
    cl_mem out = io->bufs[BENCH_OUTPUT], weights = io->bufs[BENCH_WEIGHTS];
    clmha_status st;
    if ((st = clmha_layer_set_profiling(layer, true)) ||
        (st = clmha_layer_forward(layer, &io->args, out, 0, weights, 0, 0, NULL, NULL)) ||
        (st = clmha_layer_stage_times(layer, res->stage_ms)) ||
        (st = clmha_layer_set_profiling(layer, false))) {
        clmha__bench_call_failed(ctx, io->where, "forward pass", st);
        return EXIT_REFUSED;
    }
    return clmha__bench_finish(ctx, io->where) ? EXIT_OK : EXIT_REFUSED;
}

// Times one shape: warm-up, cfg->repeat timed runs, one profiled run. Returns EXIT_OK or
// EXIT_REFUSED after reporting.
static int bench_shape(clmha_context *ctx, const bench_config *cfg, size_t n, size_t l, size_t s,
                       double *times, bench_result *res) {
    const clmha_layer_desc *d = &cfg->desc;
    *res = (bench_result){.n = n, .l = l, .s = s, .self = l == s && d->kdim == d->embed_dim &&
                                                          d->vdim == d->embed_dim};
    bench_io io = {0};
    clmha_layer *layer = NULL;
    int rc = EXIT_REFUSED;
    if (!(layer = clmha__bench_layer(ctx, cfg))) goto done;
    clmha_layer_set_impl(layer, cfg->impl);
    res->impl = clmha__bench_impl_used(cfg);
    res->s_padded = s + d->add_bias_kv + d->add_zero_attn;
    if (clmha__bench_io_make(ctx, cfg, layer, n, l, s, &io) != EXIT_OK ||
        time_forwards(ctx, cfg, layer, &io, times) != EXIT_OK)
        goto done;
    res->ms = clmha__bench_median(times, cfg->repeat, &res->ms_min, &res->ms_max);
    if (profile_stages(ctx, layer, &io, res) != EXIT_OK) goto done;

    res->scratch_bytes = clmha_layer_scratch_bytes(layer);
    res->io_bytes = 0;
    for (int i = 0; i < BENCH_BUFS; ++i) res->io_bytes += io.counts[i];
    res->io_bytes *= clmha__dtype_size(d->dtype);
    double projections, attention;
    clmha__bench_forward_flops(d, cfg->causal, n, l, s, &projections, &attention);
    res->flops = projections + attention;
    rc = EXIT_OK;
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
               "\"scratch_bytes\": %zu, \"host\": %s, \"stages\": {",
               clmha__dtype_name(d->dtype), res->ms, res->ms_min, res->ms_max, res->flops,
               res->flops / res->ms / 1e6, res->io_bytes, (double)res->io_bytes / res->ms / 1e6,
               res->scratch_bytes, cfg->host ? "true" : "false");
        clmha__bench_json_stages(res->stage_ms);
        fflush(stdout);
        return;
    }
    double total = 0;
    for (int i = 0; i < CLMHA_STAGE_COUNT; ++i) total += res->stage_ms[i];
    printf("shape:   N %zu, L %zu, S %zu (%s-attention%s), need_weights %s%s, %s core\n",
           res->n, res->l, res->s, res->self ? "self" : "cross",
           res->self ? ", packed QKV projection"
           : d->kdim == d->vdim ? ", key = value" : ", separate key and value",
           cfg->need_weights ? "on" : "off", cfg->causal ? ", is_causal" : "",
           clmha_impl_name(res->impl));
    printf("time:    %.3f ms per forward%s (median of %zu; min %.3f, max %.3f)\n", res->ms,
           cfg->host ? " on host arrays" : "", cfg->repeat, res->ms_min, res->ms_max);
    printf("speed:   %.2f GFLOP/s (%.4g GFLOP per forward)\n", res->flops / res->ms / 1e6,
           res->flops / 1e9);
    printf("tensors: %zu bytes of %s inputs and outputs, %.2f GB/s\n", res->io_bytes,
           clmha__dtype_name(d->dtype), (double)res->io_bytes / res->ms / 1e6);
    printf("scratch: %zu bytes (%.1f MiB)\n", res->scratch_bytes,
           (double)res->scratch_bytes / (1024.0 * 1024.0));
    printf("stages:  (one profiled run, %.3f ms)\n", total);
    clmha__bench_print_stages(res->stage_ms, total, false);
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

// The options of one `clmha bench` call, and what they parse to.
typedef struct bench_args {
    const char *batch_opt, *tgt_opt, *src_opt, *embed_opt, *heads_opt, *repeat_opt, *layer_path,
        *device, *impl_opt, *cache_opt, *kv_heads_opt, *dtype_opt, *prefix, *window_opt,
        *softcap_opt, *page_opt, *kv_dtype_opt;
    clmha__cli_mod mod;  // --score-mod, --mod-params
    bool need_weights, batch_first, json, backward, decode, host, causal, alibi, sinks;
    double softcap;  // --softcap (0: off)
    size_t batches[BENCH_MAX_LIST], tgts[BENCH_MAX_LIST], srcs[BENCH_MAX_LIST],
        caches[BENCH_MAX_LIST];
    size_t nb, nt, ns, nc, e, h, repeat, kv_heads, page_size;
    int64_t window[2];  // --window LEFT,RIGHT
    clmha_impl impl;
    clmha_dtype dtype;
    clmha_kv_dtype kv_dtype;
} bench_args;

// Reads the options into @p a. False with *@p rc to return (--help, a usage error).
static bool parse_options(int argc, char **argv, bench_args *a, int *rc) {
    const clmha__cli_option opts[] = {
        {.name = "--impl", .value = &a->impl_opt},
        {.name = "--batch", .value = &a->batch_opt},
        {.name = "--tgt-len", .value = &a->tgt_opt},
        {.name = "--src-len", .value = &a->src_opt},
        {.name = "--embed", .value = &a->embed_opt},
        {.name = "--heads", .value = &a->heads_opt},
        {.name = "--need-weights", .flag = &a->need_weights},
        {.name = "--batch-first", .flag = &a->batch_first},
        {.name = "--layer", .value = &a->layer_path},
        {.name = "--prefix", .value = &a->prefix},
        {.name = "--repeat", .value = &a->repeat_opt},
        {.name = "--device", .value = &a->device, .allow_empty = true},
        {.name = "--json", .flag = &a->json},
        {.name = "--backward", .flag = &a->backward},
        {.name = "--host", .flag = &a->host},
        {.name = "--decode", .flag = &a->decode},
        {.name = "--cache-len", .value = &a->cache_opt},
        {.name = "--kv-heads", .value = &a->kv_heads_opt},
        {.name = "--page-size", .value = &a->page_opt},
        {.name = "--kv-dtype", .value = &a->kv_dtype_opt},
        {.name = "--dtype", .value = &a->dtype_opt},
        {.name = "--causal", .flag = &a->causal},
        {.name = "--window", .value = &a->window_opt},
        {.name = "--softcap", .value = &a->softcap_opt},
        {.name = "--alibi", .flag = &a->alibi},
        {.name = "--sinks", .flag = &a->sinks},
        {.name = "--score-mod", .value = &a->mod.source_path},
        {.name = "--mod-params", .value = &a->mod.params_path},
    };
    char usage[12288];
    snprintf(usage, sizeof usage, "%s%s%s%s%s%s%s", usage_bench, usage_bench_about,
             usage_bench_run, usage_bench_dtype, usage_bench_backward, usage_bench_decode,
             usage_bench_tail);
    return clmha__cli_parse_options("bench", argc, argv, opts, sizeof opts / sizeof opts[0],
                                    usage, rc);
}

// The checks of parse_values() that come after the sizes: --prefix, the heads, the core, the
// dtype.
static int check_values(bench_args *a) {
    if (a->prefix && !a->layer_path) {
        clmha__cli_report("bench", "--prefix goes with --layer");
        return EXIT_USAGE;
    }
    if (!a->layer_path && a->e % a->h != 0) {
        clmha__cli_report("bench", "--embed %zu is not a multiple of --heads %zu", a->e, a->h);
        return EXIT_USAGE;
    }
    if (a->kv_heads && a->h % a->kv_heads != 0) {
        clmha__cli_report("bench", "--kv-heads %zu does not divide --heads %zu", a->kv_heads,
                          a->h);
        return EXIT_USAGE;
    }
    if (!clmha__cli_parse_impl("bench", a->impl_opt, a->need_weights, "--need-weights",
                               &a->impl) ||
        !clmha__cli_parse_dtype("bench", a->dtype_opt, &a->dtype))
        return EXIT_USAGE;
    return EXIT_OK;
}

// Parses the option values of @p a and checks how they go together. EXIT_OK, or EXIT_USAGE
// after reporting.
static int parse_values(bench_args *a) {
    int rc;
    size_t one = 0;
    bool repeat_zero = a->repeat_opt && a->backward && strcmp(a->repeat_opt, "0") == 0;
    if ((a->batch_opt && (rc = parse_sizes("--batch", a->batch_opt, BENCH_MAX_LIST,
                                           BENCH_MAX_SIZE, a->batches, &a->nb))) ||
        (a->tgt_opt && (rc = parse_sizes("--tgt-len", a->tgt_opt, BENCH_MAX_LIST,
                                         BENCH_MAX_SIZE, a->tgts, &a->nt))) ||
        (a->src_opt && (rc = parse_sizes("--src-len", a->src_opt, BENCH_MAX_LIST,
                                         BENCH_MAX_SIZE, a->srcs, &a->ns))) ||
        (a->embed_opt && (rc = parse_sizes("--embed", a->embed_opt, 1, BENCH_MAX_SIZE, &a->e,
                                           &one))) ||
        (a->heads_opt && (rc = parse_sizes("--heads", a->heads_opt, 1, BENCH_MAX_SIZE, &a->h,
                                           &one))) ||
        (a->repeat_opt && !repeat_zero &&
         (rc = parse_sizes("--repeat", a->repeat_opt, 1, BENCH_MAX_REPEAT, &a->repeat, &one))))
        return rc;
    if (repeat_zero) a->repeat = 0;
    if (a->decode != (a->cache_opt != NULL) ||
        (a->decode && (a->backward || a->tgt_opt || a->src_opt || a->need_weights ||
                       a->layer_path || a->impl_opt || a->causal))) {
        clmha__cli_report("bench", "%s",
                          a->decode ? (a->cache_opt ? "--decode takes --batch, --embed, "
                                                      "--heads, --batch-first, --kv-heads, "
                                                      "--page-size, --window, "
                                                      "--softcap, --alibi, --sinks, "
                                                      "--score-mod, --mod-params, --repeat, "
                                                      "--device and --json only"
                                                    : "--decode needs --cache-len")
                                    : "--cache-len goes with --decode");
        return EXIT_USAGE;
    }
    if (a->cache_opt && (rc = parse_sizes("--cache-len", a->cache_opt, BENCH_MAX_LIST,
                                          BENCH_MAX_SIZE, a->caches, &a->nc)))
        return rc;
    if (a->host && a->decode) {
        clmha__cli_report("bench", "--host times the forward pass or the training step (not "
                                   "--decode)");
        return EXIT_USAGE;
    }
    if (a->kv_heads_opt && !a->decode) {
        clmha__cli_report("bench", "--kv-heads goes with --decode");
        return EXIT_USAGE;
    }
    if (a->kv_heads_opt && (rc = parse_sizes("--kv-heads", a->kv_heads_opt, 1, BENCH_MAX_SIZE,
                                             &a->kv_heads, &one)))
        return rc;
    if ((a->page_opt || a->kv_dtype_opt) && !a->decode) {
        clmha__cli_report("bench", "%s goes with --decode",
                          a->page_opt ? "--page-size" : "--kv-dtype");
        return EXIT_USAGE;
    }
    if (a->kv_dtype_opt && !clmha__cli_parse_kv_dtype("bench", a->kv_dtype_opt, &a->kv_dtype))
        return EXIT_USAGE;
    if (a->page_opt && (rc = parse_sizes("--page-size", a->page_opt, 1, BENCH_MAX_SIZE,
                                         &a->page_size, &one)))
        return rc;
    if (a->window_opt && (rc = parse_window(a->window_opt, a->window))) return rc;
    if ((a->window_opt || a->softcap_opt || a->alibi || a->sinks || a->mod.source_path) &&
        a->layer_path) {
        clmha__cli_report("bench", "%s goes with a random layer (not --layer: a layer file has "
                                   "its own configuration)",
                          a->window_opt    ? "--window"
                          : a->softcap_opt ? "--softcap"
                          : a->alibi       ? "--alibi"
                          : a->sinks       ? "--sinks"
                                           : "--score-mod");
        return EXIT_USAGE;
    }
    if (!clmha__cli_parse_softcap("bench", a->softcap_opt, &a->softcap) ||
        !clmha__cli_mod_options_ok("bench", &a->mod))
        return EXIT_USAGE;
    return check_values(a);
}

// The random layer's parameters (PyTorch-like scale), made before the device opens, set in
// @p cfg: 4 E^2 + 4 E floats, in_proj_weight (3E, E), out_proj.weight (E, E) and the biases.
// NULL after reporting.
static float *random_params(size_t e, bench_config *cfg) {
    float *params = NULL;
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
        return NULL;
    }
    cfg->w_in = params;
    cfg->w_out = params + 3 * e * e;
    cfg->b_in = params + 4 * e * e;
    cfg->b_out = params + 4 * e * e + 3 * e;
    uint64_t rng = 42;
    float a = 1.0f / sqrtf((float)e);
    for (size_t i = 0; i < 4 * e * e; ++i) params[i] = a * clmha__cli_uniform(&rng);
    for (size_t i = 4 * e * e; i < 4 * e * e + 4 * e; ++i)
        params[i] = 0.1f * clmha__cli_uniform(&rng);
    return params;
}

// Whether --layer names a regular file that opens (reported when not): opening a FIFO or a
// device must not block (base/file_read.h).
static bool layer_file_opens(const char *layer_path) {
    FILE *f = NULL;
    size_t layer_size;
    char msg[1024];
    if (clmha__file_open_regular(layer_path, &f, &layer_size, NULL, msg, sizeof msg)) {
        clmha__cli_report("bench", "--layer %s: %s", layer_path,
                          clmha__cli_without_path(msg, layer_path));
        return false;
    }
    fclose(f);
    return true;
}

// Takes the configuration of the --layer file into cfg->desc, and checks it against --embed,
// --heads and --batch-first. False after reporting.
static bool adopt_layer_desc(clmha_context *ctx, bench_config *cfg, const bench_args *a) {
    clmha_layer *layer = clmha__bench_layer(ctx, cfg);
    if (!layer) return false;
    clmha_layer_get_desc(layer, &cfg->desc);
    clmha_layer_release(layer);
    const clmha_layer_desc *d = &cfg->desc;
    bool embed = a->embed_opt && d->embed_dim != a->e;
    bool heads = a->heads_opt && d->num_heads != a->h;
    if (embed || heads || (a->batch_first && !d->batch_first)) {
        clmha__cli_report("bench",
                          "--layer %s has embed_dim %zu, num_heads %zu, batch_first %s: "
                          "it disagrees with %s",
                          a->layer_path, d->embed_dim, d->num_heads,
                          d->batch_first ? "true" : "false",
                          embed ? "--embed" : heads ? "--heads" : "--batch-first");
        return false;
    }
    return true;
}

// The text output's head: device, GEMM path, layer, tuning.
static void print_head(const clmha_context *ctx, const bench_config *cfg,
                       const char *layer_path) {
    const clmha_layer_desc *d = &cfg->desc;
    printf("device:  %s\n", clmha_context_device_name(ctx));
    char gemm[640];
    clmha_context_gemm_note(ctx, gemm, sizeof gemm);
    printf("gemm:    %s\n", gemm);
    char window[64] = "", softcap[48] = "";
    if (d->window)
        snprintf(window, sizeof window, ", window (%lld, %lld)", (long long)d->window_left,
                 (long long)d->window_right);
    if (d->softcap > 0.0) snprintf(softcap, sizeof softcap, ", softcap %.9g", d->softcap);
    printf("layer:   embed_dim %zu, num_heads %zu, kdim %zu, vdim %zu%s%s%s%s%s%s%s%s%s%s (%s)\n",
           d->embed_dim, d->num_heads, d->kdim, d->vdim, d->bias ? ", bias" : "",
           d->add_bias_kv ? ", add_bias_kv" : "", d->add_zero_attn ? ", add_zero_attn" : "",
           d->batch_first ? ", batch_first" : "", window, softcap, d->alibi ? ", alibi" : "",
           d->sinks ? ", sinks" : "", cfg->score_mod_path ? ", score-mod " : "",
           cfg->score_mod_path ? cfg->score_mod_path : "", layer_path ? layer_path : "random");
    print_tuning(ctx);
    fflush(stdout);
}

// Every shape of the call, in order: decode steps (--decode), training steps (--backward) or
// forward passes. EXIT_OK, or EXIT_REFUSED after reporting at the first that fails.
static int run_shapes(clmha_context *ctx, const bench_config *cfg, const bench_args *a,
                      double *times) {
    for (size_t ib = 0; ib < a->nb && a->decode; ++ib)
        for (size_t ic = 0; ic < a->nc; ++ic)
            if (clmha__bench_decode_shape(ctx, cfg, a->batches[ib], a->caches[ic], times) !=
                EXIT_OK)
                return EXIT_REFUSED;
    for (size_t ib = 0; ib < a->nb && !a->decode; ++ib)
        for (size_t it = 0; it < a->nt; ++it)
            for (size_t is = 0; is < (a->ns ? a->ns : 1); ++is) {
                bench_result res;
                size_t n = a->batches[ib], l = a->tgts[it], s = a->ns ? a->srcs[is] : l;
                if (a->backward) {
                    if (clmha__bench_backward_shape(ctx, cfg, n, l, s, times) != EXIT_OK)
                        return EXIT_REFUSED;
                    continue;
                }
                if (bench_shape(ctx, cfg, n, l, s, times, &res) != EXIT_OK) return EXIT_REFUSED;
                bench_print(ctx, cfg, &res);
            }
    return EXIT_OK;
}

int clmha__cli_bench(int argc, char **argv) {
    bench_args a = {.batches = {8}, .tgts = {128}, .nb = 1, .nt = 1, .e = 512, .h = 8,
                    .repeat = 10};
    int rc;
    if (!parse_options(argc, argv, &a, &rc)) return rc;
    if ((rc = parse_values(&a)) != EXIT_OK) return rc;
    bench_config cfg = {.layer_path = a.layer_path, .layer_prefix = a.prefix,
                        .layer_heads = a.layer_path && a.heads_opt ? a.h : 0,
                        .need_weights = a.need_weights, .json = a.json, .host = a.host,
                        .causal = a.causal, .impl = a.impl,
                        .repeat = a.repeat, .score_mod_path = a.mod.source_path,
                        .page_size = a.page_size, .kv_dtype = a.kv_dtype};
    cfg.desc = (clmha_layer_desc){.struct_size = sizeof cfg.desc,
                                  .embed_dim = a.e, .num_heads = a.h, .kdim = a.e, .vdim = a.e,
                                  .bias = true, .batch_first = a.batch_first,
                                  .num_kv_heads = a.kv_heads, .dtype = a.dtype,
                                  .window = a.window_opt != NULL, .window_left = a.window[0],
                                  .window_right = a.window[1], .softcap = a.softcap,
                                  .alibi = a.alibi, .sinks = a.sinks};
    float *params = NULL;
    double *times = NULL;
    clmha_context *ctx = NULL;
    rc = EXIT_REFUSED;
    if ((a.layer_path && !layer_file_opens(a.layer_path)) || !clmha__cli_mod_read("bench", &a.mod))
        goto done;
    cfg.desc.mod_source = a.mod.source;
    cfg.desc.mod_params = a.mod.params;
    cfg.desc.mod_params_count = a.mod.count;
    if (!(times = malloc((a.repeat ? a.repeat : 1) * sizeof *times))) {
        clmha__cli_report("bench", "out of host memory");
        goto done;
    }
    if (!a.layer_path && !(params = random_params(a.e, &cfg))) goto done;
    if (!(ctx = clmha__cli_open_context("bench", a.device))) goto done;
    if (a.layer_path && !adopt_layer_desc(ctx, &cfg, &a)) goto done;
    if (!a.json) print_head(ctx, &cfg, a.layer_path);
    rc = run_shapes(ctx, &cfg, &a, times);
done:
    clmha_context_release(ctx);
    free(params);
    free(times);
    clmha__cli_mod_free(&a.mod);
    return rc;
}
