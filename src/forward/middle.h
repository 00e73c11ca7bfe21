// The middle of every attention call (middle.c): the layer's forward pass between its input and
// output projections, partial attention, and attention as a function all run it.
#ifndef CLMHA_FORWARD_MIDDLE_H
#define CLMHA_FORWARD_MIDDLE_H

#include <stdbool.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

struct clmha__core;
struct clmha__core_call;

// Where one of a core's inputs comes from: head tiles (N*heads, seq, D) already, or rows that
// split_heads cuts into tiles. Offsets, pitches and columns in floats.
typedef struct clmha__heads_in {
    cl_mem buffer;
    size_t offset;
    bool tiles;           // (N*heads, seq, D) tiles from @p offset; else rows
    size_t ld, col;       // rows: their pitch, and the tensor's first column in a row
    bool batch_first;     // rows (N*seq) in batch order, else (seq*N)
    size_t n, seq;        // batch items, tokens read per item
    size_t seq_out;       // tile rows per plane (more than seq: bias_k/v and zero rows appended)
    size_t heads, group;  // tile planes per item; @p group consecutive planes share a source head
    cl_mem bias;          // in_proj_bias (its columns from @p bias_col added), or NULL
    size_t bias_col;
    cl_mem extra;         // the bias_k or bias_v row (from @p extra_off) appended, or NULL
    size_t extra_off;
} clmha__heads_in;

// Where a core's result head tiles (N*heads, seq, D) go: as tiles, or merged into rows (batch
// first or not) of heads*D floats.
typedef struct clmha__heads_out {
    cl_mem buffer;
    size_t offset;
    bool tiles, batch_first;
} clmha__heads_out;

// One call of the middle: the query, key and value (key.buffer NULL: no key and value tiles,
// a call with kv_attend_only), the result, and where the log-sum-exp rows go (NULL: nowhere;
// the core writes them to call->lse).
typedef struct clmha__middle {
    clmha__heads_in query, key, value;
    clmha__heads_out out;
    cl_mem lse;
    size_t lse_offset;
} clmha__middle;

// Head tiles of @p in for a core: *use is in->buffer itself (tiles at offset 0: the cores use
// tiles at offset 0 only, as CLBlast's batched GEMM ignores offsets on one of its paths), else
// @p scratch, filled by a copy (tiles) or by split_heads (rows).
CLMHA__HIDDEN clmha_status clmha__heads_place(clmha_layer *l, const clmha__heads_in *in,
                                              cl_mem scratch, cl_mem *use);

// Result tiles (N*@p heads, @p seq, D) at @p tile_offset floats of @p tile to @p out: nothing
// when they are out's (written in place), a copy (tiles), or merge_heads (rows; through
// layer->proj when out's offset is not 0, as merge_heads writes from element 0).
CLMHA__HIDDEN clmha_status clmha__heads_put(clmha_layer *l, cl_mem tile, size_t tile_offset,
                                            size_t n, size_t heads, size_t seq,
                                            const clmha__heads_out *out);

// Enqueues the middle of a call on layer @p l, whose core @p core the dispatch chose and whose
// scratch is reserved: the query, key and value into the layer's tiles (the caller's own tiles
// used in place where they can be; a core that takes the projected rows,
// clmha__core::takes_rows, is pointed at them instead), the core, its result to @p m->out (a
// takes_rows core's merged rows stay in its result tile), the log-sum-exp rows to @p m->lse.
// The layer's tiles are its own again on return.
CLMHA__HIDDEN clmha_status clmha__middle_run(clmha_layer *l, const struct clmha__core *core,
                                             struct clmha__core_call *call,
                                             const clmha__middle *m);

// The attention weights of a call of sizes @p d that the core left in layer->scores (when it
// did not write them itself, clmha__core_call::weights_written): per head as they are
// (d->scores_count elements), or their mean over heads (a layer's default), to @p w at @p w_off
// elements. The layer writes them after its output projection, the function after the middle.
CLMHA__HIDDEN clmha_status clmha__weights_out(clmha_layer *l, const clmha__dims *d,
                                              bool per_head, cl_mem w, size_t w_off);

#endif
