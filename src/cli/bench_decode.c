// `clmha bench --decode`: times one decode step (one new token per sequence, attending over a
// KV cache of S tokens) and reports it as ms per token and as the bandwidth at which the step
// reads the cached keys and values, next to the device's copy bandwidth measured in the same
// run (clEnqueueCopyBuffer of a large buffer).
#include "cli/bench.h"

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

int clmha__bench_decode_shape(clmha_context *ctx, const bench_config *cfg, size_t n,
                              size_t cache_len, double *times) {
    const clmha_layer_desc *d = &cfg->desc;
    size_t e = d->embed_dim, h = d->num_heads, hd = e / h;
    size_t kvh = d->num_kv_heads ? d->num_kv_heads : h;  // key/value heads
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    clmha_layer *layer = NULL;
    clmha_kv_cache *cache = NULL;
    bench_io prefill = {0}, step = {0};
    int rc = EXIT_REFUSED;
    char where[96];
    snprintf(where, sizeof where, "N %zu, cache %zu", n, cache_len);
    size_t *lens = calloc(n, sizeof *lens);
    if (!lens) {
        clmha__cli_report("bench", "out of host memory");
        return EXIT_REFUSED;
    }
    if (d->kdim != e || d->vdim != e) {
        clmha__cli_report("bench", "--decode needs a self-attention layer (kdim = vdim = "
                                   "embed_dim)");
        goto done;
    }
    if (!(layer = clmha__bench_layer(ctx, cfg))) goto done;
    // The prefill: one query row with the whole cache as its key (= value) tensor; the step:
    // one new token per sequence, self-attention, is_causal.
    if (clmha__bench_io_make(ctx, cfg, layer, n, 1, cache_len, &prefill) != EXIT_OK ||
        clmha__bench_io_make(ctx, cfg, layer, n, 1, 1, &step) != EXIT_OK)
        goto done;
    clmha_status st = clmha_kv_cache_create(&cache, layer, n, cache_len + 1);
    if (st) goto call_fail;
    clmha_forward_args pa = prefill.args, sa = step.args;
    pa.kv_cache = sa.kv_cache = cache;
    sa.is_causal = true;
    for (size_t i = 0; i < n; ++i) lens[i] = cache_len;
    cl_mem pout = prefill.bufs[BENCH_OUTPUT], sout = step.bufs[BENCH_OUTPUT];
    if ((st = clmha_layer_forward(layer, &pa, pout, 0, NULL, 0, 0, NULL, NULL))) goto call_fail;
    // Warm-up steps (kernels built, scratch sized), then the timed ones; each step appends a
    // token, rolled back after it so that every step attends over cache_len + 1 tokens.
    for (size_t r = 0; r < 2 + cfg->repeat; ++r) {
        double t0 = clmha__cli_now_ms();
        if ((st = clmha_layer_forward(layer, &sa, sout, 0, NULL, 0, 0, NULL, NULL)))
            goto call_fail;
        if (clFinish(queue) != CL_SUCCESS) {
            clmha__cli_report("bench", "%s: clFinish failed", where);
            goto done;
        }
        if (r >= 2) times[r - 2] = clmha__cli_now_ms() - t0;
        if ((st = clmha_kv_cache_truncate(cache, lens, n))) goto call_fail;
    }
    double lo, hi, ms = clmha__bench_median(times, cfg->repeat, &lo, &hi);
    // Where the time goes: each stage's median over profiled steps (markers after every
    // stage; not part of the times above).
    double stages[CLMHA_STAGE_COUNT] = {0}, stage_total = 0;
    size_t profiled = cfg->repeat < 9 ? cfg->repeat : 9;
    double *per = calloc(profiled * CLMHA_STAGE_COUNT, sizeof *per);
    if (!per) {
        clmha__cli_report("bench", "out of host memory");
        goto done;
    }
    if ((st = clmha_layer_set_profiling(layer, true))) goto stages_fail;
    for (size_t r = 0; r < profiled; ++r)
        if ((st = clmha_layer_forward(layer, &sa, sout, 0, NULL, 0, 0, NULL, NULL)) ||
            (st = clmha_layer_stage_times(layer, per + r * CLMHA_STAGE_COUNT)) ||
            (st = clmha_kv_cache_truncate(cache, lens, n)))
            goto stages_fail;
    if ((st = clmha_layer_set_profiling(layer, false))) goto stages_fail;
    for (int i = 0; i < CLMHA_STAGE_COUNT; ++i) {
        for (size_t r = 0; r < profiled; ++r) times[r] = per[r * CLMHA_STAGE_COUNT + i];
        double slo, shi;
        stages[i] = clmha__bench_median(times, profiled, &slo, &shi);
        stage_total += stages[i];
    }
stages_fail:
    free(per);
    if (st) goto call_fail;
    size_t copy_bytes;
    double copy = copy_gbps(ctx, cfg->repeat < COPY_REPEAT ? cfg->repeat : COPY_REPEAT, times,
                            &copy_bytes);
    if (copy <= 0) goto done;
    // What the step reads of the cache: every key and value of every key/value head,
    // cache_len + 1 tokens.
    double kv_bytes = 2.0 * (double)n * (double)kvh * (double)(cache_len + 1) * (double)hd * 4.0;
    double gbps = kv_bytes / ms / 1e6;
    if (cfg->json) {
        clmha__bench_json_head(ctx, cfg, n, 1, cache_len + 1, CLMHA_IMPL_AUTO, true);
        printf("\"decode\": true, \"cache_len\": %zu, \"kv_heads\": %zu, \"ms\": %.6g, "
               "\"ms_min\": %.6g, \"ms_max\": %.6g, \"kv_bytes\": %.0f, \"kv_gbps\": %.6g, "
               "\"copy_bytes\": %zu, \"copy_gbps\": %.6g, \"fraction_of_copy\": %.4g, "
               "\"stages\": {",
               cache_len, kvh, ms, lo, hi, kv_bytes, gbps, copy_bytes, copy, gbps / copy);
        for (int i = 0; i < CLMHA_STAGE_COUNT; ++i)
            printf("%s\"%s\": %.6g", i ? ", " : "", clmha_stage_name((clmha_stage)i),
                   stages[i]);
        printf("}}\n");
    } else {
        printf("shape:   N %zu, one new token per sequence over a cache of %zu (+1) tokens, "
               "%zu heads of %zu, %zu key/value heads (decode core)\n",
               n, cache_len, h, hd, kvh);
        printf("time:    %.4f ms per token (median of %zu; min %.4f, max %.4f)\n", ms,
               cfg->repeat, lo, hi);
        printf("kv read: %.1f MiB per step, %.2f GB/s\n", kv_bytes / 1048576.0, gbps);
        printf("copy:    %.2f GB/s (clEnqueueCopyBuffer of %zu MiB, bytes read + written)\n",
               copy, copy_bytes >> 20);
        printf("ratio:   %.2f of the copy bandwidth\n", gbps / copy);
        printf("stages:  (medians of %zu profiled steps, %.3f ms together)\n", profiled,
               stage_total);
        for (int i = 0; i < CLMHA_STAGE_COUNT; ++i)
            if (stages[i] > 0)
                printf("  %-9s %10.3f ms %5.1f%%\n", clmha_stage_name((clmha_stage)i),
                       stages[i], stage_total > 0 ? 100.0 * stages[i] / stage_total : 0.0);
    }
    fflush(stdout);
    rc = EXIT_OK;
    goto done;
call_fail:
    clmha__cli_report("bench", "decode step failed on %s at %s: %s: %s",
                      clmha_context_device_name(ctx), where, clmha_status_string(st),
                      clmha_context_last_error(ctx));
done:
    clmha_kv_cache_release(cache);
    clmha__bench_io_free(&prefill);
    clmha__bench_io_free(&step);
    clmha_layer_release(layer);
    free(lens);
    return rc;
}
