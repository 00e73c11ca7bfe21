// `clmha bench --backward`: times one training step per shape on device buffers (with --host:
// on host arrays): the forward call with args.save, then clmha_layer_backward() for the
// gradients of the inputs and of every parameter; also each alone. Reports ms, GFLOP/s (FLOP convention in bench.c's help) and the
// memory a step holds: the layer's scratch (the backward's included) and the saved state, next
// to the growth of the process's resident memory (the device memory of a CPU driver such as
// PoCL is host memory).
#define _POSIX_C_SOURCE 200809L

#include "bench.h"

#include "base/half.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

// The gradients the benchmark asks for: every input and every parameter the layer has.
enum {
    G_QUERY, G_KEY, G_VALUE, G_IN_W, G_Q_W, G_K_W, G_V_W, G_IN_B, G_OUT_W, G_OUT_B, G_BIAS_K,
    G_BIAS_V, G_SINKS, G_COUNT
};

static const char *const grad_name[G_COUNT] = {
    "query", "key", "value", "in_proj_weight", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias", "bias_k", "bias_v",
    "sinks"};

static clmha_grad *grad_slot(clmha_backward_args *b, int g) {
    clmha_grad *const all[G_COUNT] = {
        &b->query, &b->key, &b->value, &b->in_proj_weight, &b->q_proj_weight,
        &b->k_proj_weight, &b->v_proj_weight, &b->in_proj_bias, &b->out_proj_weight,
        &b->out_proj_bias, &b->bias_k, &b->bias_v, &b->sinks};
    return all[g];
}

// Floats of gradient @p g for @p io's call (0: the call or layer has none).
static size_t grad_floats(const clmha_layer_desc *d, const bench_io *io, int g) {
    size_t e = d->embed_dim;
    bool packed = d->kdim == e && d->vdim == e;
    switch (g) {
    case G_QUERY: return io->counts[BENCH_QUERY];
    case G_KEY: return io->self ? 0 : io->counts[BENCH_KEY];
    case G_VALUE: return io->self || io->kv_same ? 0 : io->counts[BENCH_VALUE];
    case G_IN_W: return packed ? 3 * e * e : 0;
    case G_Q_W: return packed ? 0 : e * e;
    case G_K_W: return packed ? 0 : e * d->kdim;
    case G_V_W: return packed ? 0 : e * d->vdim;
    case G_IN_B: return d->bias ? 3 * e : 0;
    case G_OUT_W: return e * e;
    case G_OUT_B: return d->bias ? e : 0;
    case G_BIAS_K:
    case G_BIAS_V: return d->add_bias_kv ? e : 0;
    case G_SINKS: return d->sinks ? d->num_heads : 0;
    default: return 0;
    }
}

// Resident memory of this process now, in bytes (Linux: /proc/self/statm); -1 when unknown.
static long long rss_now(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return -1;
    long long size = 0, resident = -1;
    if (fscanf(f, "%lld %lld", &size, &resident) != 2) resident = -1;
    fclose(f);
    long page = sysconf(_SC_PAGESIZE);
    return resident >= 0 && page > 0 ? resident * page : -1;
}

// The process's peak resident memory so far, in bytes (getrusage: KiB on Linux); -1 unknown.
static long long rss_peak(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return -1;
    return (long long)ru.ru_maxrss * 1024;
}

// What one shape measured.
typedef struct result {
    clmha_impl impl;
    double step_ms, step_min, step_max;  // forward (with save) + backward
    double fwd_ms, fwd_min, fwd_max;     // forward with save alone
    double bwd_ms, bwd_min, bwd_max;     // backward alone
    double proj_flops, attn_flops;       // of the forward (clmha__bench_forward_flops())
    double fwd_flops, bwd_flops, step_flops;  // P + A, 2 P + 2.5 A, their sum
    size_t scratch_bytes, saved_bytes;
    long long training_bytes;                 // scratch + saved
    long long fwd_growth, bwd_growth, peak_rss;  // bytes; -1 unknown
} result;

// One training step's objects: a layer, its saved state, the forward arguments (in @p io) and
// the backward's (gradient buffers, grad_output).
typedef struct step {
    clmha_layer *layer;
    clmha_saved *saved;
    clmha_forward_args fwd;
    clmha_backward_args bwd;
    // --host: the same step on host arrays (clmha_layer_forward_host(),
    // clmha_layer_backward_host()): copies of the inputs and of grad_output, the output, and an
    // array per gradient; fwd and bwd then point at them (data fields, no buffers).
    bool host;
    float *host_in[3], *host_out, *host_w, *host_dy, *host_grads[G_COUNT];
    size_t out_count, w_count;  // w_count 0: no weights asked
} step;

static void step_free(step *st) {
    clmha_saved_release(st->saved);
    clmha_layer_release(st->layer);
    for (int i = 0; i < 3; ++i) free(st->host_in[i]);
    free(st->host_out);
    free(st->host_w);
    free(st->host_dy);
    for (int g = 0; g < G_COUNT; ++g) free(st->host_grads[g]);
    *st = (step){0};
}

// A host copy of @p count floats of @p buf (NULL after reporting a failure).
static float *host_copy(clmha_context *ctx, cl_mem buf, size_t count) {
    float *a = malloc((count ? count : 1) * sizeof *a);
    if (!a) {
        clmha__cli_report("bench", "out of host memory");
        return NULL;
    }
    cl_int err = clEnqueueReadBuffer(clmha_context_cl_queue(ctx), buf, CL_TRUE, 0,
                                     count * sizeof *a, a, 0, NULL, NULL);
    if (err == CL_SUCCESS) return a;
    clmha__cli_report("bench", "reading the inputs failed on %s: OpenCL error %d",
                      clmha_context_device_name(ctx), (int)err);
    free(a);
    return NULL;
}

// --host: points @p st's arguments at host arrays: copies of @p io's inputs and of
// @p grad_output, an output array and an array per gradient asked for. Reports a failure.
static int step_to_host(clmha_context *ctx, const bench_config *cfg, const bench_io *io,
                        cl_mem grad_output, step *st) {
    clmha_tensor *in[3] = {&st->fwd.query, &st->fwd.key, &st->fwd.value};
    for (int i = 0; i < 3; ++i) {
        if (!in[i]->buffer) continue;
        if (!(st->host_in[i] = host_copy(ctx, in[i]->buffer, io->counts[BENCH_QUERY + i])))
            return EXIT_REFUSED;
        in[i]->buffer = NULL;
        in[i]->data = st->host_in[i];
    }
    st->out_count = io->counts[BENCH_OUTPUT];
    st->w_count = cfg->need_weights ? io->counts[BENCH_WEIGHTS] : 0;
    if (!(st->host_dy = host_copy(ctx, grad_output, io->counts[BENCH_QUERY])) ||
        !(st->host_out = malloc(st->out_count * sizeof *st->host_out)) ||
        (st->w_count && !(st->host_w = malloc(st->w_count * sizeof *st->host_w))))
        goto oom;
    st->bwd.grad_output.buffer = NULL;
    st->bwd.grad_output.data = st->host_dy;
    for (int g = 0; g < G_COUNT; ++g) {
        clmha_grad *gr = grad_slot(&st->bwd, g);
        if (!gr->buffer) continue;
        if (!(st->host_grads[g] = calloc(grad_floats(&cfg->desc, io, g), sizeof(float))))
            goto oom;
        *gr = (clmha_grad){.data = st->host_grads[g]};
    }
    st->host = true;
    return EXIT_OK;
oom:
    clmha__cli_report("bench", "out of host memory");
    return EXIT_REFUSED;
}

// A layer and saved state for @p io, with the backward's arguments pointing at @p grads and
// @p grad_output. Reports a failure.
static int step_make(clmha_context *ctx, const bench_config *cfg, const bench_io *io,
                     cl_mem grad_output, const cl_mem *grads, step *st) {
    *st = (step){0};
    if (!(st->layer = clmha__bench_layer(ctx, cfg))) return EXIT_REFUSED;
    clmha_layer_set_impl(st->layer, cfg->impl);
    clmha_status s = clmha_saved_create(&st->saved, st->layer);
    if (s) {
        clmha__cli_report("bench", "clmha_saved_create: %s: %s", clmha_status_string(s),
                          clmha_context_last_error(ctx));
        step_free(st);
        return EXIT_REFUSED;
    }
    st->fwd = io->args;
    st->fwd.save = st->saved;
    st->bwd = (clmha_backward_args){.struct_size = sizeof st->bwd, .forward = &st->fwd,
                                    .saved = st->saved, .grad_output = io->args.query,
                                    .impl = cfg->impl};
    st->bwd.grad_output.buffer = grad_output;
    st->bwd.grad_output.offset = 0;
    for (int g = 0; g < G_COUNT; ++g)
        if (grads[g]) *grad_slot(&st->bwd, g) = (clmha_grad){.buffer = grads[g]};
    return EXIT_OK;
}

static clmha_status run_forward(const step *st, const bench_io *io) {
    if (st->host)
        return clmha_layer_forward_host(st->layer, &st->fwd, st->host_out, st->out_count,
                                        st->host_w, st->w_count);
    return clmha_layer_forward(st->layer, &st->fwd, io->bufs[BENCH_OUTPUT], 0,
                               io->bufs[BENCH_WEIGHTS], 0, 0, NULL, NULL);
}

static clmha_status run_backward(const step *st) {
    if (st->host) return clmha_layer_backward_host(st->layer, &st->bwd);
    return clmha_layer_backward(st->layer, &st->bwd, 0, NULL, NULL);
}

// Reports the failed call @p what when @p s says it failed, else waits for the queue (reports
// a failure). False after reporting.
static bool called(clmha_context *ctx, const char *where, const char *what, clmha_status s) {
    if (!s) return clmha__bench_finish(ctx, where);
    clmha__bench_call_failed(ctx, where, what, s);
    return false;
}

// The buffers of a step: the inputs and outputs (io), the output's gradient and a buffer per
// gradient asked for (NULL where none).
typedef struct step_buffers {
    bench_io io;
    cl_mem dy, grads[G_COUNT];
} step_buffers;

static void buffers_free(step_buffers *b) {
    for (int g = 0; g < G_COUNT; ++g)
        if (b->grads[g]) clReleaseMemObject(b->grads[g]);
    if (b->dy) clReleaseMemObject(b->dy);
    clmha__bench_io_free(&b->io);
}

// @p io for shape (n, l, s), made through a probe layer (the measured layer comes later).
// EXIT_OK, or EXIT_REFUSED after reporting.
static int probed_io(clmha_context *ctx, const bench_config *cfg, size_t n, size_t l, size_t s,
                     bench_io *io) {
    clmha_layer *probe = clmha__bench_layer(ctx, cfg);
    if (!probe) return EXIT_REFUSED;
    int rc = clmha__bench_io_make(ctx, cfg, probe, n, l, s, io);
    clmha_layer_release(probe);
    return rc;
}

// Compiles the kernels of a step on a throwaway layer at a small shape (N, L and S capped at
// 64), so that the measured layer's first calls at the real shape grow the resident memory by
// their buffers only, not by the compilers' memory.
static int precompile(clmha_context *ctx, const bench_config *cfg, const bench_io *real) {
    step_buffers b = {0};
    step st = {0};
    size_t n = real->n < 8 ? real->n : 8, l = real->l < 64 ? real->l : 64;
    size_t s = real->self ? l : real->s < 64 ? real->s : 64;
    const clmha_layer_desc *d = &cfg->desc;
    if (!real->self && s == l && d->kdim == d->embed_dim && d->vdim == d->embed_dim)
        s = l == 1 ? 2 : l - 1;  // stays cross-attention
    int rc = EXIT_REFUSED;
    cl_int err = CL_SUCCESS;
    if (probed_io(ctx, cfg, n, l, s, &b.io) != EXIT_OK) goto done;
    cl_context cl = clmha_context_cl_context(ctx);
    size_t elem = clmha__dtype_size(d->dtype);  // the layer's elements (16-bit gradients too)
    for (int g = 0; g < G_COUNT; ++g) {
        size_t count = grad_floats(&cfg->desc, &b.io, g);
        if (count &&
            !(b.grads[g] = clCreateBuffer(cl, CL_MEM_READ_WRITE, count * elem, NULL, &err)))
            break;
    }
    if (err == CL_SUCCESS)
        b.dy = clCreateBuffer(cl, CL_MEM_READ_WRITE, b.io.counts[BENCH_QUERY] * elem, NULL,
                              &err);
    uint64_t rng = 11;
    if (err == CL_SUCCESS)
        err = clmha__bench_fill_random_as(clmha_context_cl_queue(ctx), b.dy,
                                          b.io.counts[BENCH_QUERY], d->dtype, &rng);
    if (err != CL_SUCCESS) {
        clmha__cli_report("bench", "warm-up buffers failed on %s: OpenCL error %d",
                          clmha_context_device_name(ctx), (int)err);
        goto done;
    }
    if (step_make(ctx, cfg, &b.io, b.dy, b.grads, &st) != EXIT_OK) goto done;
    clmha_status s1 = run_forward(&st, &b.io);
    if (s1) {
        clmha__bench_call_failed(ctx, b.io.where, "warm-up forward pass (with save)", s1);
        goto done;
    }
    if (called(ctx, b.io.where, "warm-up backward pass", run_backward(&st))) rc = EXIT_OK;
done:
    step_free(&st);
    buffers_free(&b);
    return rc;
}

// --json: one line, every field of the result.
static void print_json(const clmha_context *ctx, const bench_config *cfg, const bench_io *io,
                       const result *r) {
    double fwd = r->fwd_flops, bwd = r->bwd_flops, total = r->step_flops;
    clmha__bench_json_head(ctx, cfg, io->n, io->l, io->s, r->impl, io->self);
    printf("\"backward\": true, \"dtype\": \"%s\", \"host\": %s, ",
           clmha__dtype_name(cfg->desc.dtype), cfg->host ? "true" : "false");
    printf("\"ms\": %.6g, \"ms_min\": %.6g, \"ms_max\": %.6g, \"flops\": %.0f, "
           "\"gflops\": %.6g, ",
           r->step_ms, r->step_min, r->step_max, total, total / r->step_ms / 1e6);
    printf("\"forward_ms\": %.6g, \"forward_ms_min\": %.6g, \"forward_ms_max\": %.6g, "
           "\"forward_flops\": %.0f, \"forward_gflops\": %.6g, ",
           r->fwd_ms, r->fwd_min, r->fwd_max, fwd, fwd / r->fwd_ms / 1e6);
    printf("\"backward_ms\": %.6g, \"backward_ms_min\": %.6g, \"backward_ms_max\": %.6g, "
           "\"backward_flops\": %.0f, \"backward_gflops\": %.6g, ",
           r->bwd_ms, r->bwd_min, r->bwd_max, bwd, bwd / r->bwd_ms / 1e6);
    printf("\"projection_flops\": %.0f, \"attention_flops\": %.0f, "
           "\"flop_convention\": \"forward = P + A; backward = 2 P + 2.5 A; ms and flops: "
           "forward + backward = 3 P + 3.5 A (P: projection GEMMs, A: Q K^T and weights V "
           "of the forward)\", ",
           r->proj_flops, r->attn_flops);
    printf("\"scratch_bytes\": %zu, \"saved_bytes\": %zu, \"training_scratch_bytes\": %lld, ",
           r->scratch_bytes, r->saved_bytes, r->training_bytes);
    if (r->bwd_growth >= 0)
        printf("\"backward_rss_growth_bytes\": %lld, ", r->bwd_growth);
    else
        printf("\"backward_rss_growth_bytes\": null, ");
    if (r->fwd_growth >= 0 && r->bwd_growth >= 0)
        printf("\"forward_rss_growth_bytes\": %lld, \"step_rss_growth_bytes\": %lld, ",
               r->fwd_growth, r->fwd_growth + r->bwd_growth);
    else
        printf("\"forward_rss_growth_bytes\": null, \"step_rss_growth_bytes\": null, ");
    if (r->peak_rss >= 0)
        printf("\"peak_rss_bytes\": %lld}\n", r->peak_rss);
    else
        printf("\"peak_rss_bytes\": null}\n");
}

// The text lines: the shape, the times and speeds, the memory.
static void print_text(const bench_config *cfg, const bench_io *io, const result *r) {
    double fwd = r->fwd_flops, bwd = r->bwd_flops, total = r->step_flops;
    const double mib = 1024.0 * 1024.0;
    printf("shape:    N %zu, L %zu, S %zu (%s-attention%s), need_weights %s, %s core "
           "(forward and backward%s)\n",
           io->n, io->l, io->s, io->self ? "self" : "cross",
           io->self ? ", packed QKV projection"
           : io->kv_same ? ", key = value" : ", separate key and value",
           cfg->need_weights ? "on" : "off", clmha_impl_name(r->impl),
           cfg->host ? ", on host arrays" : "");
    if (cfg->repeat)
        printf("step:     %.3f ms forward + backward (median of %zu; min %.3f, max %.3f), "
               "%.2f GFLOP/s (%.4g GFLOP)\n",
               r->step_ms, cfg->repeat, r->step_min, r->step_max, total / r->step_ms / 1e6,
               total / 1e9);
    else
        printf("step:     %.3f ms forward + backward (the first step, --repeat 0), "
               "%.2f GFLOP/s (%.4g GFLOP)\n",
               r->step_ms, total / r->step_ms / 1e6, total / 1e9);
    printf("forward:  %.3f ms with save (min %.3f, max %.3f), %.2f GFLOP/s (%.4g GFLOP)\n",
           r->fwd_ms, r->fwd_min, r->fwd_max, fwd / r->fwd_ms / 1e6, fwd / 1e9);
    printf("backward: %.3f ms (min %.3f, max %.3f), %.2f GFLOP/s (%.4g GFLOP)\n", r->bwd_ms,
           r->bwd_min, r->bwd_max, bwd / r->bwd_ms / 1e6, bwd / 1e9);
    printf("memory:   scratch %.1f MiB (layer, forward and backward) + %.1f MiB (saved) = "
           "%.1f MiB\n",
           r->scratch_bytes / mib, r->saved_bytes / mib, r->training_bytes / mib);
    if (r->fwd_growth >= 0 && r->bwd_growth >= 0)
        printf("          resident memory added by the first step: %.1f MiB (forward %.1f, "
               "backward %.1f)\n",
               (r->fwd_growth + r->bwd_growth) / mib, r->fwd_growth / mib, r->bwd_growth / mib);
    if (r->peak_rss >= 0)
        printf("          peak resident memory of the process: %.1f MiB\n", r->peak_rss / mib);
}

// The buffers of the measured step at shape (n, l, s): the inputs (io, through a probe layer:
// the measured layer comes after the warm-up), the output's gradient (random) and a buffer per
// gradient (zeroed, so that it is resident), all written when it returns. EXIT_OK, or
// EXIT_REFUSED after reporting; buffers_free() frees what it made either way.
static int buffers_make(clmha_context *ctx, const bench_config *cfg, size_t n, size_t l, size_t s,
                        step_buffers *b) {
    if (probed_io(ctx, cfg, n, l, s, &b->io) != EXIT_OK) return EXIT_REFUSED;
    cl_context cl = clmha_context_cl_context(ctx);
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    cl_int err = CL_SUCCESS;
    const char *what = "grad_output";
    size_t dy_count = b->io.counts[BENCH_QUERY];
    clmha_dtype t = cfg->desc.dtype;
    size_t elem = clmha__dtype_size(t);  // the layer's elements (16-bit gradients too)
    b->dy = clCreateBuffer(cl, CL_MEM_READ_WRITE, dy_count * elem, NULL, &err);
    uint64_t rng = 13;
    if (err == CL_SUCCESS) err = clmha__bench_fill_random_as(queue, b->dy, dy_count, t, &rng);
    for (int g = 0; g < G_COUNT && err == CL_SUCCESS; ++g) {
        size_t count = grad_floats(&cfg->desc, &b->io, g);
        if (!count) continue;
        what = grad_name[g];
        b->grads[g] = clCreateBuffer(cl, CL_MEM_READ_WRITE, count * elem, NULL, &err);
        uint16_t zero = 0;  // +0 in every dtype
        if (err == CL_SUCCESS)
            err = clEnqueueFillBuffer(queue, b->grads[g], &zero, sizeof zero, 0, count * elem, 0,
                                      NULL, NULL);
    }
    if (err != CL_SUCCESS) {
        clmha__cli_report("bench", "%s: the %s gradient buffer failed on %s: OpenCL error %d",
                          b->io.where, what, clmha_context_device_name(ctx), (int)err);
        return EXIT_REFUSED;
    }
    return clmha__bench_finish(ctx, b->io.where) ? EXIT_OK : EXIT_REFUSED;
}

// Warm-up: the kernels compile on a throwaway layer at a small shape; then @p st, the measured
// layer, runs its first forward and backward at this shape, with the resident memory before and
// after each (what they allocated: scratch, saved state, the backward's own scratch) into *r.
// @p t gets the clock before the forward, between the two and after the backward. EXIT_OK, or
// EXIT_REFUSED after reporting.
static int first_step(clmha_context *ctx, const bench_config *cfg, const step_buffers *b,
                      step *st, result *r, double t[3]) {
    const char *where = b->io.where;
    if (precompile(ctx, cfg, &b->io) != EXIT_OK ||
        step_make(ctx, cfg, &b->io, b->dy, b->grads, st) != EXIT_OK ||
        (cfg->host && step_to_host(ctx, cfg, &b->io, b->dy, st) != EXIT_OK))
        return EXIT_REFUSED;
    long long rss0 = rss_now();
    t[0] = clmha__cli_now_ms();
    if (!called(ctx, where, "forward pass (with save)", run_forward(st, &b->io)))
        return EXIT_REFUSED;
    t[1] = clmha__cli_now_ms();
    long long rss1 = rss_now();
    if (!called(ctx, where, "backward pass", run_backward(st))) return EXIT_REFUSED;
    t[2] = clmha__cli_now_ms();
    long long rss2 = rss_now();
    r->fwd_growth = rss0 >= 0 && rss1 >= 0 ? rss1 - rss0 : -1;
    r->bwd_growth = rss1 >= 0 && rss2 >= 0 ? rss2 - rss1 : -1;
    return EXIT_OK;
}

// The times of the timed turns, in ms: whole steps (the caller's array), forwards alone,
// backwards alone; room for cfg->repeat (at least 1) each.
typedef struct turn_times {
    double *step, *fwd, *bwd;
} turn_times;

// The timed runs of @p st, in turns (step, forward, backward) so that a busy machine slows all
// three alike; the backward alone differentiates the forward alone just before it. False after
// reporting.
static bool timed_turns(clmha_context *ctx, size_t repeat, const step *st, const bench_io *io,
                        const turn_times *tt) {
    for (size_t i = 0; i < repeat; ++i) {
        double t0 = clmha__cli_now_ms();
        clmha_status sc = run_forward(st, io);
        if (!sc) sc = run_backward(st);
        if (!called(ctx, io->where, "training step", sc)) return false;
        double t1 = clmha__cli_now_ms();
        if (!called(ctx, io->where, "forward pass (with save)", run_forward(st, io)))
            return false;
        double t2 = clmha__cli_now_ms();
        if (!called(ctx, io->where, "backward pass", run_backward(st))) return false;
        double t3 = clmha__cli_now_ms();
        tt->step[i] = t1 - t0;
        tt->fwd[i] = t2 - t1;
        tt->bwd[i] = t3 - t2;
    }
    return true;
}

// The rest of *r: the medians of the turns (--repeat 0: the first step's times, @p first as
// first_step() took them), the memory, the FLOPs (FLOP convention in bench.c's help).
static void summarize(const bench_config *cfg, const step *st, const bench_io *io,
                      const double first[3], const turn_times *tt, result *r) {
    size_t count = cfg->repeat;
    if (!count) {  // --repeat 0: the first step's times (compiled kernels, new buffers)
        tt->step[0] = first[2] - first[0];
        tt->fwd[0] = first[1] - first[0];
        tt->bwd[0] = first[2] - first[1];
        count = 1;
    }
    r->step_ms = clmha__bench_median(tt->step, count, &r->step_min, &r->step_max);
    r->fwd_ms = clmha__bench_median(tt->fwd, count, &r->fwd_min, &r->fwd_max);
    r->bwd_ms = clmha__bench_median(tt->bwd, count, &r->bwd_min, &r->bwd_max);
    r->scratch_bytes = clmha_layer_scratch_bytes(st->layer);
    r->saved_bytes = clmha_saved_bytes(st->saved);
    r->training_bytes = (long long)(r->scratch_bytes + r->saved_bytes);
    r->peak_rss = rss_peak();
    clmha__bench_forward_flops(&cfg->desc, cfg->causal, io->n, io->l, io->s, &r->proj_flops,
                               &r->attn_flops);
    r->fwd_flops = r->proj_flops + r->attn_flops;
    r->bwd_flops = 2.0 * r->proj_flops + 2.5 * r->attn_flops;
    r->step_flops = r->fwd_flops + r->bwd_flops;
}

int clmha__bench_backward_shape(clmha_context *ctx, const bench_config *cfg, size_t n, size_t l,
                                size_t s, double *times) {
    step_buffers b = {0};
    step st = {0};
    result r = {.impl = clmha__bench_impl_used(cfg)};
    double first[3];
    size_t room = cfg->repeat ? cfg->repeat : 1;
    turn_times tt = {.step = times, .fwd = malloc(2 * room * sizeof *tt.fwd)};
    if (!tt.fwd) {
        clmha__cli_report("bench", "out of host memory");
        return EXIT_REFUSED;
    }
    tt.bwd = tt.fwd + room;
    int rc = EXIT_REFUSED;
    if (buffers_make(ctx, cfg, n, l, s, &b) == EXIT_OK &&
        first_step(ctx, cfg, &b, &st, &r, first) == EXIT_OK &&
        timed_turns(ctx, cfg->repeat, &st, &b.io, &tt)) {
        summarize(cfg, &st, &b.io, first, &tt, &r);
        if (cfg->json)
            print_json(ctx, cfg, &b.io, &r);
        else
            print_text(cfg, &b.io, &r);
        fflush(stdout);
        rc = EXIT_OK;
    }
    step_free(&st);
    buffers_free(&b);
    free(tt.fwd);
    return rc;
}
