// `clmha bench --decode`: times one decode step (one new token per sequence, attending over a
// KV cache of S tokens) and reports it as ms per token and as the bandwidth at which the step
// reads the cached keys and values, next to the device's copy bandwidth measured in the same
// run (clEnqueueCopyBuffer of a large buffer).
#include "cli/bench.h"

#include "base/half.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Copies timed for the copy bandwidth: a 256 MiB copy takes ~15 ms on a CPU device, so --repeat
// (the decode steps, ~0.1 ms each) does not set their count: 60000 steps would otherwise add
// 60000 copies, about 15 minutes.
#define COPY_REPEAT 15

// The copy bandwidth of the device in GB/s, bytes read + written (STREAM's convention): the
// median of @p repeat copies of one buffer of up to 256 MiB (a quarter of the largest
// allocation at most) into another. 0 after reporting a failure.
static double copy_gbps(clmha_context *ctx, size_t repeat, double *times, size_t *bytes_out) {
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    cl_context cl = clmha_context_cl_context(ctx);
    cl_ulong max_alloc = 0;
    clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof max_alloc,
                    &max_alloc, NULL);
    size_t bytes = (size_t)256 << 20;
    while (max_alloc && bytes > max_alloc / 4) bytes /= 2;
    *bytes_out = bytes;
    cl_int err;
    cl_mem a = clCreateBuffer(cl, CL_MEM_READ_WRITE, bytes, NULL, &err), b = NULL;
    if (err == CL_SUCCESS) b = clCreateBuffer(cl, CL_MEM_READ_WRITE, bytes, NULL, &err);
    double gbps = 0;
    if (err == CL_SUCCESS) {
        unsigned char pattern = 1;
        // Both buffers touched first, so that the copies do not time page faults.
        err = clEnqueueFillBuffer(queue, a, &pattern, 1, 0, bytes, 0, NULL, NULL);
        if (err == CL_SUCCESS) err = clEnqueueFillBuffer(queue, b, &pattern, 1, 0, bytes, 0, NULL, NULL);
        if (err == CL_SUCCESS) err = clEnqueueCopyBuffer(queue, a, b, 0, 0, bytes, 0, NULL, NULL);
        if (err == CL_SUCCESS) err = clFinish(queue);
        for (size_t r = 0; r < repeat && err == CL_SUCCESS; ++r) {
            double t0 = clmha__cli_now_ms();
            err = clEnqueueCopyBuffer(queue, a, b, 0, 0, bytes, 0, NULL, NULL);
            if (err == CL_SUCCESS) err = clFinish(queue);
            times[r] = clmha__cli_now_ms() - t0;
        }
        if (err == CL_SUCCESS) {
            double lo, hi, ms = clmha__bench_median(times, repeat, &lo, &hi);
            gbps = 2.0 * (double)bytes / ms / 1e6;
        }
    }
    if (err != CL_SUCCESS)
        clmha__cli_report("bench", "copy bandwidth: OpenCL error %d on %s", (int)err,
                          clmha_context_device_name(ctx));
    if (a) clReleaseMemObject(a);
    if (b) clReleaseMemObject(b);
    return gbps;
}

// One decode shape's objects: the layer, its cache, the prefill's and the step's buffers, the
// step's arguments and the lengths the cache is truncated back to after each step.
typedef struct decode_run {
    size_t n, cache_len;
    char where[96];             // "N 2, cache 512", for messages
    size_t *lens;               // n times cache_len
    clmha_layer *layer;
    clmha_kv_cache *cache;
    bench_io prefill, step;
    clmha_forward_args sa;      // the step's arguments: the cache, is_causal
} decode_run;

// What one decode shape measured.
typedef struct decode_result {
    double ms, lo, hi;                                    // per step: median, min, max
    double stages[CLMHA_STAGE_COUNT], stage_total;        // medians of the profiled steps
    size_t profiled;                                      // profiled steps
    double copy;                                          // the copy bandwidth, GB/s
    size_t copy_bytes;
} decode_result;

// Reports the failed call of a decode shape; EXIT_REFUSED.
static int step_failed(clmha_context *ctx, const decode_run *dr, clmha_status st) {
    clmha__bench_call_failed(ctx, dr->where, "decode step", st);
    return EXIT_REFUSED;
}

// The layer, its cache filled by the prefill (one query row with the whole cache as its key
// (= value) tensor) and the step's arguments (one new token per sequence, self-attention,
// is_causal). EXIT_OK, or EXIT_REFUSED after reporting.
static int decode_setup(clmha_context *ctx, const bench_config *cfg, decode_run *dr) {
    const clmha_layer_desc *d = &cfg->desc;
    size_t n = dr->n, cache_len = dr->cache_len;
    if (d->kdim != d->embed_dim || d->vdim != d->embed_dim) {
        clmha__cli_report("bench", "--decode needs a self-attention layer (kdim = vdim = "
                                   "embed_dim)");
        return EXIT_REFUSED;
    }
    if (!(dr->layer = clmha__bench_layer(ctx, cfg))) return EXIT_REFUSED;
    if (clmha__bench_io_make(ctx, cfg, dr->layer, n, 1, cache_len, &dr->prefill) != EXIT_OK ||
        clmha__bench_io_make(ctx, cfg, dr->layer, n, 1, 1, &dr->step) != EXIT_OK)
        return EXIT_REFUSED;
    // A paged cache: a pool of just the pages the sequences' cache_len + 1 tokens fill.
    size_t ps = cfg->page_size;
    clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = ps ? 0 : cache_len + 1,
                                .page_size = ps,
                                .num_pages = ps ? n * ((cache_len + 1 + ps - 1) / ps) : 0,
                                .kv_dtype = cfg->kv_dtype};
    clmha_status st = clmha_kv_cache_create_with(&dr->cache, dr->layer, n, &o);
    if (st) return step_failed(ctx, dr, st);
    clmha_forward_args pa = dr->prefill.args;
    dr->sa = dr->step.args;
    pa.kv_cache = dr->sa.kv_cache = dr->cache;
    dr->sa.is_causal = true;
    for (size_t i = 0; i < n; ++i) dr->lens[i] = cache_len;
    cl_mem pout = dr->prefill.bufs[BENCH_OUTPUT];
    if ((st = clmha_layer_forward(dr->layer, &pa, pout, 0, NULL, 0, 0, NULL, NULL)))
        return step_failed(ctx, dr, st);
    return EXIT_OK;
}

// Warm-up steps (kernels built, scratch sized), then cfg->repeat timed ones into @p times and
// their median into *res; each step appends a token, rolled back after it so that every step
// attends over cache_len + 1 tokens. EXIT_OK, or EXIT_REFUSED after reporting.
static int time_steps(clmha_context *ctx, const bench_config *cfg, const decode_run *dr,
                      double *times, decode_result *res) {
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    cl_mem sout = dr->step.bufs[BENCH_OUTPUT];
    clmha_status st;
    for (size_t r = 0; r < 2 + cfg->repeat; ++r) {
        double t0 = clmha__cli_now_ms();
        if ((st = clmha_layer_forward(dr->layer, &dr->sa, sout, 0, NULL, 0, 0, NULL, NULL)))
            return step_failed(ctx, dr, st);
        if (clFinish(queue) != CL_SUCCESS) {
            clmha__cli_report("bench", "%s: clFinish failed", dr->where);
            return EXIT_REFUSED;
        }
        if (r >= 2) times[r - 2] = clmha__cli_now_ms() - t0;
        if ((st = clmha_kv_cache_truncate(dr->cache, dr->lens, dr->n)))
            return step_failed(ctx, dr, st);
    }
    res->ms = clmha__bench_median(times, cfg->repeat, &res->lo, &res->hi);
    return EXIT_OK;
}

// Where the time goes: each stage's median over up to 9 profiled steps (markers after every
// stage; not part of the times above), into *res (@p times: room for the steps' times).
// EXIT_OK, or EXIT_REFUSED after reporting.
static int profile_steps(clmha_context *ctx, const bench_config *cfg, const decode_run *dr,
                         double *times, decode_result *res) {
    size_t profiled = res->profiled = cfg->repeat < 9 ? cfg->repeat : 9;
    double *per = calloc(profiled * CLMHA_STAGE_COUNT, sizeof *per);
    if (!per) {
        clmha__cli_report("bench", "out of host memory");
        return EXIT_REFUSED;
    }
    cl_mem sout = dr->step.bufs[BENCH_OUTPUT];
    clmha_status st = clmha_layer_set_profiling(dr->layer, true);
    for (size_t r = 0; r < profiled && !st; ++r)
        if (!(st = clmha_layer_forward(dr->layer, &dr->sa, sout, 0, NULL, 0, 0, NULL, NULL)) &&
            !(st = clmha_layer_stage_times(dr->layer, per + r * CLMHA_STAGE_COUNT)))
            st = clmha_kv_cache_truncate(dr->cache, dr->lens, dr->n);
    if (!st) st = clmha_layer_set_profiling(dr->layer, false);
    for (int i = 0; i < CLMHA_STAGE_COUNT && !st; ++i) {
        for (size_t r = 0; r < profiled; ++r) times[r] = per[r * CLMHA_STAGE_COUNT + i];
        double slo, shi;
        res->stages[i] = clmha__bench_median(times, profiled, &slo, &shi);
        res->stage_total += res->stages[i];
    }
    free(per);
    return st ? step_failed(ctx, dr, st) : EXIT_OK;
}

// Prints the result: a JSON line (--json) or the text lines.
static void print_decode(const clmha_context *ctx, const bench_config *cfg, const decode_run *dr,
                         const decode_result *res) {
    const clmha_layer_desc *d = &cfg->desc;
    size_t n = dr->n, cache_len = dr->cache_len, h = d->num_heads, hd = d->embed_dim / h;
    size_t kvh = d->num_kv_heads ? d->num_kv_heads : h;  // key/value heads
    // What the step reads of the cache: every key and value of every key/value head that its
    // token sees, cache_len + 1 tokens or, with a window, the window_left + 1 latest (the step
    // is causal).
    size_t seen = cache_len + 1;
    if (d->window && d->window_left >= 0 && (uint64_t)d->window_left < cache_len)
        seen = (size_t)d->window_left + 1;
    // Bytes a value: 4 (8 in a float64 layer's cache), 2 (float16, bfloat16), an int8 cache's
    // 1 and its row's float scale, an int4 cache's half and its group's (src/cache/kv_cache.c:
    // 32 dimensions, or the largest power of two dividing D).
    size_t group = 32;
    while (group > 2 && hd % group) group /= 2;
    double per = cfg->kv_dtype == CLMHA_KV_INT8   ? 1.0 + 4.0 / (double)hd
                 : cfg->kv_dtype == CLMHA_KV_INT4 ? 0.5 + 4.0 / (double)group
                 : cfg->kv_dtype == CLMHA_KV_FLOAT32 ? (d->dtype == CLMHA_DTYPE_F64 ? 8.0 : 4.0)
                                                     : 2.0;
    double kv_bytes = 2.0 * (double)n * (double)kvh * (double)seen * (double)hd * per;
    double ms = res->ms, gbps = kv_bytes / ms / 1e6, copy = res->copy;
    if (cfg->json) {
        bench_config step = *cfg;  // the step is is_causal (bottom-right: the new token last)
        step.causal = true;
        clmha__bench_json_head(ctx, &step, n, 1, cache_len + 1, CLMHA_IMPL_AUTO, true);
        printf("\"decode\": true, \"cache_len\": %zu, \"kv_heads\": %zu, \"page_size\": %zu, "
               "\"dtype\": \"%s\", \"kv_dtype\": \"%s\", \"ms\": %.6g, \"ms_min\": %.6g, "
               "\"ms_max\": %.6g, \"kv_bytes\": %.0f, \"kv_gbps\": %.6g, \"copy_bytes\": %zu, "
               "\"copy_gbps\": %.6g, \"fraction_of_copy\": %.4g, ",
               cache_len, kvh, cfg->page_size, clmha__dtype_name(d->dtype),
               clmha__cli_kv_dtype_name(cfg->kv_dtype), ms, res->lo, res->hi, kv_bytes, gbps,
               res->copy_bytes, copy, gbps / copy);
        if (d->window)
            printf("\"window_left\": %lld, \"window_right\": %lld, ",
                   (long long)d->window_left, (long long)d->window_right);
        printf("\"stages\": {");
        clmha__bench_json_stages(res->stages);
    } else {
        printf("shape:   N %zu, one new token per sequence over a cache of %zu (+1) tokens, "
               "%zu heads of %zu, %zu key/value heads (decode core)\n",
               n, cache_len, h, hd, kvh);
        if (cfg->page_size) printf("cache:   paged, pages of %zu tokens\n", cfg->page_size);
        if (cfg->kv_dtype != CLMHA_KV_FLOAT32)
            printf("cache:   %s keys and values\n", clmha__cli_kv_dtype_name(cfg->kv_dtype));
        if (d->dtype != CLMHA_DTYPE_F32)
            printf("layer:   %s (the cache's f32 kind: %s)\n", clmha__dtype_name(d->dtype),
                   d->dtype == CLMHA_DTYPE_F64 ? "doubles" : "floats");
        if (d->window)
            printf("window:  (%lld, %lld): the token sees %zu of them\n",
                   (long long)d->window_left, (long long)d->window_right, seen);
        printf("time:    %.4f ms per token (median of %zu; min %.4f, max %.4f)\n", ms,
               cfg->repeat, res->lo, res->hi);
        printf("kv read: %.1f MiB per step, %.2f GB/s\n", kv_bytes / 1048576.0, gbps);
        printf("copy:    %.2f GB/s (clEnqueueCopyBuffer of %zu MiB, bytes read + written)\n",
               copy, res->copy_bytes >> 20);
        printf("ratio:   %.2f of the copy bandwidth\n", gbps / copy);
        printf("stages:  (medians of %zu profiled steps, %.3f ms together)\n", res->profiled,
               res->stage_total);
        clmha__bench_print_stages(res->stages, res->stage_total, true);
    }
    fflush(stdout);
}

static void decode_run_free(decode_run *dr) {
    clmha_kv_cache_release(dr->cache);
    clmha__bench_io_free(&dr->prefill);
    clmha__bench_io_free(&dr->step);
    clmha_layer_release(dr->layer);
    free(dr->lens);
}

int clmha__bench_decode_shape(clmha_context *ctx, const bench_config *cfg, size_t n,
                              size_t cache_len, double *times) {
    decode_run dr = {.n = n, .cache_len = cache_len};
    decode_result res = {0};
    snprintf(dr.where, sizeof dr.where, "N %zu, cache %zu", n, cache_len);
    if (!(dr.lens = calloc(n, sizeof *dr.lens))) {
        clmha__cli_report("bench", "out of host memory");
        return EXIT_REFUSED;
    }
    int rc = decode_setup(ctx, cfg, &dr);
    if (rc == EXIT_OK) rc = time_steps(ctx, cfg, &dr, times, &res);
    if (rc == EXIT_OK) rc = profile_steps(ctx, cfg, &dr, times, &res);
    if (rc == EXIT_OK) {
        res.copy = copy_gbps(ctx, cfg->repeat < COPY_REPEAT ? cfg->repeat : COPY_REPEAT, times,
                             &res.copy_bytes);
        if (res.copy <= 0) rc = EXIT_REFUSED;
    }
    if (rc == EXIT_OK) print_decode(ctx, cfg, &dr, &res);
    decode_run_free(&dr);
    return rc;
}
