// Partial attention: clmha_layer_attend() (the attention of one range of keys, with the
// log-sum-exp rows, from a core that writes them: the layer's input projections and the middle,
// middle.c, with the head tiles and rows going to the caller), clmha_attention_merge() and
// clmha_attention_merge_f64() (the exact merge of two such results, by the core that merges:
// clmha__core_merge()) and
// clmha_layer_project_heads() (the head merge and output projection of a merged result).
#include "base/checked.h"
#include "base/half.h"
#include "context/context.h"
#include "cores/core.h"
#include "device/held.h"
#include "forward/convert.h"
#include "forward/enqueue.h"
#include "forward/forward.h"
#include "forward/middle.h"
#include "layer/layer.h"
#include "layer/shape.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

// clmha_attention_merge() of @p m's rows of @p m->rs bytes an element (floats or doubles),
// checked.
static clmha_status merge_rows(clmha_context *ctx, const clmha__merge_call *m, cl_event *event) {
    if (event) *event = NULL;
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    size_t rows = m->rows, rs = m->rs;
    if (!rows || !m->head_dim)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH, "rows %zu and head_dim %zu must be positive",
                           rows, m->head_dim);
    if (rows > SIZE_MAX / rs / m->head_dim)
        return clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "rows %zu x head_dim %zu overflows", rows,
                           m->head_dim);
    size_t elems = rows * m->head_dim;
    const char *names[4] = {"heads", "lse", "other_heads", "other_lse"};
    cl_mem bufs[4] = {m->heads, m->lse, m->other_heads, m->other_lse};
    size_t offs[4] = {m->heads_offset, m->lse_offset, m->other_heads_offset,
                      m->other_lse_offset};
    size_t counts[4] = {elems, rows, elems, rows};
    clmha__span all[4];
    clmha_status st = clmha__check_wait_list(ctx, m->num_wait, m->wait_list);
    for (size_t i = 0; i < 4 && !st; ++i) {
        st = clmha__check_buffer(ctx, names[i], bufs[i], offs[i], counts[i], rs);
        all[i] = clmha__span_of(names[i], bufs[i], offs[i], counts[i], rs);
    }
    if (st || (st = clmha__check_writable(ctx, "heads", m->heads)) ||
        (st = clmha__check_writable(ctx, "lse", m->lse)) ||
        (st = clmha__check_overlaps(ctx, all, 4, 2)) || (st = clmha__core_merge(ctx, m)))
        return st;
    return clmha__enqueue_event(ctx, event);
}

// The merge of rows of @p rs bytes an element, its arguments as the public calls take them.
static clmha_status merge_as(size_t rs, clmha_context *ctx, size_t rows, size_t head_dim,
                             cl_mem heads, size_t heads_offset, cl_mem lse, size_t lse_offset,
                             cl_mem other_heads, size_t other_heads_offset, cl_mem other_lse,
                             size_t other_lse_offset, cl_uint num_wait,
                             const cl_event *wait_list, cl_event *event) {
    clmha__merge_call m = {.rows = rows, .head_dim = head_dim, .rs = rs, .heads = heads,
                           .lse = lse, .other_heads = other_heads, .other_lse = other_lse,
                           .heads_offset = heads_offset, .lse_offset = lse_offset,
                           .other_heads_offset = other_heads_offset,
                           .other_lse_offset = other_lse_offset, .num_wait = num_wait,
                           .wait_list = wait_list};
    return merge_rows(ctx, &m, event);
}

clmha_status clmha_attention_merge(clmha_context *ctx, size_t rows, size_t head_dim,
                                   cl_mem heads, size_t heads_offset, cl_mem lse,
                                   size_t lse_offset, cl_mem other_heads,
                                   size_t other_heads_offset, cl_mem other_lse,
                                   size_t other_lse_offset, cl_uint num_wait,
                                   const cl_event *wait_list, cl_event *event) {
    return merge_as(sizeof(float), ctx, rows, head_dim, heads, heads_offset, lse, lse_offset,
                    other_heads, other_heads_offset, other_lse, other_lse_offset, num_wait,
                    wait_list, event);
}

clmha_status clmha_attention_merge_f64(clmha_context *ctx, size_t rows, size_t head_dim,
                                       cl_mem heads, size_t heads_offset, cl_mem lse,
                                       size_t lse_offset, cl_mem other_heads,
                                       size_t other_heads_offset, cl_mem other_lse,
                                       size_t other_lse_offset, cl_uint num_wait,
                                       const cl_event *wait_list, cl_event *event) {
    if (ctx && !ctx->info.fp64) {
        if (event) *event = NULL;
        return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                           "clmha_attention_merge_f64() needs a device with double precision "
                           "(cl_khr_fp64); %s has none",
                           ctx->info.device_name);
    }
    return merge_as(sizeof(double), ctx, rows, head_dim, heads, heads_offset, lse, lse_offset,
                    other_heads, other_heads_offset, other_lse, other_lse_offset, num_wait,
                    wait_list, event);
}

// layer->no_sinks: H floats of -inf, made on first use (filled from the host: nothing
// enqueued).
static clmha_status no_sinks(clmha_layer *layer) {
    if (layer->no_sinks) return CLMHA_SUCCESS;
    clmha_context *ctx = layer->ctx;
    float *v = malloc(layer->h * sizeof *v);
    if (!v) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    for (size_t h = 0; h < layer->h; ++h) v[h] = -INFINITY;
    cl_int err;
    clmha__count(ctx, 0, 1);
    layer->no_sinks = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                                     layer->h * sizeof *v, v, &err);
    clmha__held_new(CLMHA__HELD_MEM, layer->no_sinks);
    free(v);
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clCreateBuffer(sinks of -inf)");
    return CLMHA_SUCCESS;
}

// The buffers of a clmha_layer_attend() call of sizes @p d (inputs of @p io bytes an element):
// the heads and lse rows (the layer's rs bytes an element: float32 but in a float64 layer)
// writable and large enough, nothing overlapping an output.
static clmha_status attend_buffers(clmha_layer *layer, const clmha_forward_args *args,
                                   const clmha__dims *dp, cl_mem heads, size_t heads_offset,
                                   cl_mem lse, size_t lse_offset, size_t io) {
    clmha_context *ctx = layer->ctx;
    const clmha__dims d = *dp;
    clmha_status st;
    size_t rows = d.n * layer->h * d.l, rs = layer->rs;
    if ((st = clmha__check_buffer(ctx, "heads", heads, heads_offset, rows * layer->d, rs)) ||
        (st = clmha__check_buffer(ctx, "lse", lse, lse_offset, rows, rs)) ||
        (st = clmha__check_writable(ctx, "heads", heads)) ||
        (st = clmha__check_writable(ctx, "lse", lse)))
        return st;
    clmha__span all[6];
    size_t k = 0;
    all[k++] = clmha__span_of("heads", heads, heads_offset, rows * layer->d, rs);
    all[k++] = clmha__span_of("lse", lse, lse_offset, rows, rs);
    all[k++] = clmha__span_of("query", args->query.buffer, args->query.offset, d.query_count, io);
    if (!d.key_is_query)
        all[k++] = clmha__span_of("key", args->key.buffer, args->key.offset, d.key_count, io);
    if (!d.value_is_key)
        all[k++] =
            clmha__span_of("value", args->value.buffer, args->value.offset, d.value_count, io);
    return clmha__check_overlaps(ctx, all, k, 2);
}

static clmha_status attend(clmha_layer *layer, const clmha_forward_args *args,
                           bool appended_keys, cl_mem heads, size_t heads_offset, cl_mem lse,
                           size_t lse_offset, cl_uint num_wait, const cl_event *wait_list,
                           cl_event *event) {
    if (event) *event = NULL;
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    clmha_forward_args in;
    clmha_status st = clmha__forward_args_in(ctx, &in, &args);
    if (st) return st;
    if ((st = clmha__check_wait_list(ctx, num_wait, wait_list))) return st;
    const char *no = args->need_weights ? "need_weights"
                     : args->save       ? "save"
                     : args->kv_cache   ? "kv_cache"
                     : args->seq_lens   ? "a packed batch (seq_lens)"
                     : args->impl == CLMHA_IMPL_UNFUSED ? "CLMHA_IMPL_UNFUSED"
                     : layer->core      ? "a user attention core"
                                        : NULL;
    if (no)
        return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                           "clmha_layer_attend() returns the log-sum-exp rows, which only a core "
                           "that writes them gives; it does not take %s",
                           no);
    // The positions of the call's rows and keys (query_position, key_position): checked and
    // resolved on a copy without them (the other calls refuse them), then given to the core.
    clmha_forward_args unplaced = in;
    unplaced.query_position = unplaced.key_position = 0;
    // A 16-bit layer's query, key and value are 16-bit (read as its forward reads them); the
    // head tiles and rows it writes are float32, as a float32 layer's (merged in float32); a
    // float64 layer's are doubles.
    size_t io = clmha__dtype_size(layer->desc.dtype);
    clmha__dims d;
    if ((st = clmha__forward_check_call(layer, &unplaced, &d)) ||
        (st = clmha__forward_check_inputs(layer, &unplaced, &d, io)))
        return st;
    if (in.query_position > (size_t)1 << 24 || in.key_position > (size_t)1 << 24)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "query_position (%zu) and key_position (%zu) must be at most 2^24 "
                           "(the kernels' positions)",
                           in.query_position, in.key_position);
    d.q_pos = in.query_position, d.k_pos = in.key_position;
    args = &unplaced;
    if ((st = attend_buffers(layer, args, &d, heads, heads_offset, lse, lse_offset, io)))
        return st;
    clmha_forward_args wide = unplaced;  // a 16-bit layer's inputs widened (convert.c)
    if (io != layer->rs) {
        if ((st = clmha__enqueue_wait(ctx, num_wait, wait_list)) ||
            (st = clmha__convert_inputs(layer, &d, &wide)))
            return st;
        args = &wide;
        num_wait = 0, wait_list = NULL;
    }
    // Without the appended keys the core sees the call's S keys alone. The core is one that
    // writes the log-sum-exp rows (clmha__core_call::need_lse, set with @p partial).
    if (!appended_keys) d.s_padded = d.s;
    clmha__core_call call = {.args = args, .dims = &d};
    clmha__partial_out partial = {heads, lse, heads_offset, lse_offset, appended_keys};
    // Sinks: the range that holds the appended keys holds them too; the others get sinks of
    // -inf (no term), so that the merge counts each row's sink once.
    if (layer->desc.sinks && !appended_keys) {
        if ((st = no_sinks(layer))) return st;
        layer->sinks_call = layer->no_sinks, layer->sinks_call_off = 0;
    }
    st = clmha__forward_planned(layer, args, &d, &call, &partial, NULL, 0, NULL, 0, num_wait,
                                wait_list, event);
    layer->sinks_call = NULL;
    return st;
}

clmha_status clmha_layer_attend(clmha_layer *layer, const clmha_forward_args *args,
                                bool appended_keys, cl_mem heads, size_t heads_offset,
                                cl_mem lse, size_t lse_offset, cl_uint num_wait,
                                const cl_event *wait_list, cl_event *event) {
    return clmha__forward_times_dropped(layer, attend(layer, args, appended_keys, heads,
                                                  heads_offset, lse, lse_offset, num_wait,
                                                  wait_list, event));
}

clmha_status clmha_layer_project_heads(clmha_layer *layer, size_t batch, size_t tgt_len,
                                       cl_mem heads, size_t heads_offset, cl_mem output,
                                       size_t output_offset, cl_uint num_wait,
                                       const cl_event *wait_list, cl_event *event) {
    if (event) *event = NULL;
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    clmha_status st;
    // A 16-bit layer's output is 16-bit (projected in float32, rounded once); heads are float32.
    // A float64 layer's heads and output are doubles.
    size_t io = clmha__dtype_size(layer->desc.dtype), rs = layer->rs;
    size_t e = layer->e, rows;
    if (!batch || !tgt_len)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH, "batch %zu and tgt_len %zu must be positive",
                           batch, tgt_len);
    if (!clmha__mul(batch, tgt_len, &rows) || rows > SIZE_MAX / layer->h / e)
        return clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "batch %zu x tgt_len %zu overflows", batch,
                           tgt_len);
    if ((st = clmha__check_wait_list(ctx, num_wait, wait_list)) ||
        (st = clmha__check_buffer(ctx, "heads", heads, heads_offset, rows * e, rs)) ||
        (st = clmha__check_buffer(ctx, "output", output, output_offset, rows * e, io)) ||
        (st = clmha__check_writable(ctx, "output", output)))
        return st;
    if (io == layer->rs && (st = clmha__forward_output_readable(layer, output))) return st;
    clmha__span all[2] = {clmha__span_of("output", output, output_offset, rows * e, io),
                          clmha__span_of("heads", heads, heads_offset, rows * e, rs)};
    if ((st = clmha__check_overlaps(ctx, all, 2, 1))) return st;
    cl_mem out32 = output;  // a 16-bit layer's: the float32 copy, narrowed after
    size_t out32_off = output_offset;
    if ((st = clmha__layer_grow(layer, &layer->proj, &layer->proj_cap, rows * e,
                                "projected rows")) ||
        (io != layer->rs && (st = clmha__convert_result(layer, CLMHA__STAGED_OUTPUT,
                                                        "float32 output", rows * e, &out32))))
        return st;
    if (io != layer->rs) out32_off = 0;
    clmha__dims d = {.n = batch, .l = tgt_len, .e = e, .h = layer->h, .d = layer->d,
                     .batch_first = layer->desc.batch_first};
    clmha__heads_out merged = {.buffer = layer->proj, .batch_first = layer->desc.batch_first};
    clmha__layer_marks_release(layer);
    if ((st = clmha__enqueue_wait(ctx, num_wait, wait_list)) ||
        (st = clmha__heads_put(layer, heads, heads_offset, batch, layer->h, tgt_len, &merged)) ||
        (st = clmha__forward_out_project(layer, &d, layer->proj, out32, out32_off, true)) ||
        (io != layer->rs &&
         (st = clmha__convert_out(layer, CLMHA__STAGED_OUTPUT, output, output_offset,
                                  rows * e))))
        return st;
    return clmha__enqueue_event(ctx, event);
}
