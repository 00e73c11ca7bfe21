// What the files of `clmha bench` share (bench.h): the layer and the buffers of a shape, random
// inputs, the median of the timings, the FLOP count, the core used, the reports of a failed
// call, the start of a JSON line and the stages' times.
#define _POSIX_C_SOURCE 200809L

#include "bench.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/checked.h"
#include "base/half.h"

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
    printf("\"is_causal\": %s, ", cfg->causal ? "true" : "false");
    if (d->window)
        printf("\"window_left\": %lld, \"window_right\": %lld, ", (long long)d->window_left,
               (long long)d->window_right);
    else
        printf("\"window_left\": null, \"window_right\": null, ");
    printf("\"softcap\": %.17g, \"alibi\": %s, \"sinks\": %s, \"score_mod\": ", d->softcap,
           d->alibi ? "true" : "false", d->sinks ? "true" : "false");
    if (cfg->score_mod_path)
        clmha__bench_json_string(cfg->score_mod_path);
    else
        printf("null");
    printf(", ");
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

// The (query, key) pairs of one plane that is_causal (@p causal) and d's window allow, query i
// at position i, the appended keys all: L * S' without either.
static double allowed_pairs(const clmha_layer_desc *d, bool causal, size_t l, size_t s) {
    double appended = (double)d->add_bias_kv + (double)d->add_zero_attn;
    if (!causal && !d->window) return (double)l * ((double)s + appended);
    double pairs = 0;
    for (size_t i = 0; i < l; ++i) {
        double lo = 0, hi = (double)s - 1, di = (double)i;
        if (d->window && d->window_left >= 0) lo = fmax(lo, di - (double)d->window_left);
        if (d->window && d->window_right >= 0) hi = fmin(hi, di + (double)d->window_right);
        if (causal) hi = fmin(hi, di);
        if (hi >= lo) pairs += hi - lo + 1;
    }
    return pairs + (double)l * appended;
}

void clmha__bench_forward_flops(const clmha_layer_desc *d, bool causal, size_t n, size_t l,
                                size_t s, double *projections, double *attention) {
    double dn = (double)n, dl = (double)l, ds = (double)s, de = (double)d->embed_dim;
    *projections =
        2.0 * dn * de * (dl * de + ds * (double)d->kdim + ds * (double)d->vdim + dl * de);
    *attention = 4.0 * dn * allowed_pairs(d, causal, l, s) * de;
}

clmha_impl clmha__bench_impl_used(const bench_config *cfg) {
    return cfg->impl != CLMHA_IMPL_AUTO ? cfg->impl
           : cfg->need_weights         ? CLMHA_IMPL_UNFUSED
                                       : CLMHA_IMPL_FUSED;
}

void clmha__bench_call_failed(clmha_context *ctx, const char *where, const char *what,
                              clmha_status st) {
    clmha__cli_report("bench", "%s failed on %s at %s: %s: %s", what,
                      clmha_context_device_name(ctx), where, clmha_status_string(st),
                      clmha_context_last_error(ctx));
}

bool clmha__bench_finish(clmha_context *ctx, const char *where) {
    cl_int err = clFinish(clmha_context_cl_queue(ctx));
    if (err == CL_SUCCESS) return true;
    clmha__cli_report("bench", "%s: clFinish failed on %s: OpenCL error %d", where,
                      clmha_context_device_name(ctx), (int)err);
    return false;
}

void clmha__bench_json_stages(const double *ms) {
    for (int i = 0; i < CLMHA_STAGE_COUNT; ++i)
        printf("%s\"%s\": %.6g", i ? ", " : "", clmha_stage_name((clmha_stage)i), ms[i]);
    printf("}}\n");
}

void clmha__bench_print_stages(const double *ms, double total, bool skip_zero) {
    for (int i = 0; i < CLMHA_STAGE_COUNT; ++i)
        if (!skip_zero || ms[i] > 0)
            printf("  %-9s %10.3f ms %5.1f%%\n", clmha_stage_name((clmha_stage)i), ms[i],
                   total > 0 ? 100.0 * ms[i] / total : 0.0);
}

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
        if (st == CLMHA_BUILD_FAILED && cfg->score_mod_path)
            clmha__cli_report("bench", "--score-mod %s: the source does not compile: %s",
                              cfg->score_mod_path, clmha_context_last_error(ctx));
        else
            clmha__cli_report("bench", "random layer (embed_dim %zu, num_heads %zu): %s: %s", e,
                              cfg->desc.num_heads, clmha_status_string(st),
                              clmha_context_last_error(ctx));
        clmha_layer_release(layer);
        return NULL;
    }
    return layer;
}

// The forward arguments of @p io for shape (n, l, s) of @p layer, buffers not yet set, and the
// floats of each buffer (0: the call has none). EXIT_OK, or EXIT_REFUSED after reporting.
static int io_shapes(clmha_context *ctx, const bench_config *cfg, clmha_layer *layer, size_t n,
                     size_t l, size_t s, bench_io *io) {
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
    *args = (clmha_forward_args){.struct_size = sizeof *args, .need_weights = cfg->need_weights,
                                 .is_causal = cfg->causal};
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
    return EXIT_OK;
}

int clmha__bench_io_make(clmha_context *ctx, const bench_config *cfg, clmha_layer *layer,
                         size_t n, size_t l, size_t s, bench_io *io) {
    if (io_shapes(ctx, cfg, layer, n, l, s, io) != EXIT_OK) return EXIT_REFUSED;
    const clmha_layer_desc *d = &cfg->desc;
    const char *where = io->where;
    const size_t *counts = io->counts;
    clmha_forward_args *args = &io->args;

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
