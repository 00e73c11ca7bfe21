// clmha_attention_merge(): the exact merge of two partial attention results (clmha_layer_attend()
// over two ranges of keys), kernel merge_partials of cl/cores/decode.cl.
#include "context/context.h"
#include "cores/kernel_args.h"
#include "device/held.h"
#include "forward/enqueue.h"

#include <stdint.h>
#include <stdio.h>

typedef clmha__arg arg;
#define ARG CLMHA__ARG

clmha_status clmha_attention_merge(clmha_context *ctx, size_t rows, size_t head_dim,
                                   cl_mem heads, size_t heads_offset, cl_mem lse,
                                   size_t lse_offset, cl_mem other_heads,
                                   size_t other_heads_offset, cl_mem other_lse,
                                   size_t other_lse_offset, cl_uint num_wait,
                                   const cl_event *wait_list, cl_event *event) {
    if (event) *event = NULL;
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    if (!rows || !head_dim)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH, "rows %zu and head_dim %zu must be positive",
                           rows, head_dim);
    if (rows > SIZE_MAX / sizeof(float) / head_dim)
        return clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "rows %zu x head_dim %zu overflows", rows,
                           head_dim);
    size_t floats = rows * head_dim;
    clmha_status st;
    if ((st = clmha__check_wait_list(ctx, num_wait, wait_list)) ||
        (st = clmha__check_buffer(ctx, "heads", heads, heads_offset, floats, 4)) ||
        (st = clmha__check_buffer(ctx, "lse", lse, lse_offset, rows, 4)) ||
        (st = clmha__check_buffer(ctx, "other_heads", other_heads, other_heads_offset, floats,
                                  4)) ||
        (st = clmha__check_buffer(ctx, "other_lse", other_lse, other_lse_offset, rows, 4)) ||
        (st = clmha__check_writable(ctx, "heads", heads)) ||
        (st = clmha__check_writable(ctx, "lse", lse)))
        return st;
    clmha__span all[4] = {clmha__span_of("heads", heads, heads_offset, floats, 4),
                          clmha__span_of("lse", lse, lse_offset, rows, 4),
                          clmha__span_of("other_heads", other_heads, other_heads_offset, floats,
                                         4),
                          clmha__span_of("other_lse", other_lse, other_lse_offset, rows, 4)};
    if ((st = clmha__check_overlaps(ctx, all, 4, 2))) return st;
    cl_program prog;
    cl_kernel k = NULL;
    if ((st = clmha__program_get(ctx, "decode", "-DHD=1 -DG=1 -DVW=1", &prog)) ||
        (st = clmha__kernel_make(ctx, prog, "merge_partials", &k)))
        return st;
    cl_ulong a_off = heads_offset, la_off = lse_offset, b_off = other_heads_offset,
             lb_off = other_lse_offset, hd = head_dim, n = rows;
    arg args[] = {ARG(heads),     ARG(a_off),  ARG(lse),       ARG(la_off), ARG(other_heads),
                  ARG(b_off),     ARG(other_lse), ARG(lb_off), ARG(hd),    ARG(n)};
    if (!(st = clmha__enqueue_wait(ctx, num_wait, wait_list)))
        st = clmha__launch(ctx, k, "merge_partials", rows,
                           ctx->max_work_group < 64 ? ctx->max_work_group : 64, args,
                           sizeof args / sizeof args[0]);
    if (!st) st = clmha__enqueue_event(ctx, event);
    clmha__release_kernel(k);
    return st;
}
