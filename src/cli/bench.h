// The files of `clmha bench`: bench.c (options, the forward benchmark) calls bench_backward.c
// (--backward: forward with save + backward) and bench_decode.c (--decode: a step over a KV
// cache), and the three call bench_common.c (the layer and buffers of a shape, random inputs,
// timings, JSON), never the other way. Internal to the program.
#ifndef CLMHA_CLI_BENCH_H
#define CLMHA_CLI_BENCH_H

#include "cli.h"

// What every shape of one `clmha bench` call shares.
typedef struct bench_config {
    const char *layer_path;   // NULL: a random layer of desc
    const char *layer_prefix; // --prefix: one attention module of a model's file (or NULL)
    size_t layer_heads;       // --heads given with --layer: num_heads for a file without it
    clmha_layer_desc desc;    // random layer, or the file's (kdim/vdim filled in)
    const float *w_in, *b_in, *w_out, *b_out;  // random parameters
    bool need_weights, json;
    bool host;                // --host: time clmha_layer_forward_host on host arrays
    bool causal;              // --causal: is_causal (the window, --window, is in desc)
    clmha_impl impl;          // as given; the core used is in the result
    size_t repeat;
    const char *score_mod_path;  // --score-mod (its source in desc.mod_source), or NULL
    size_t page_size;            // --decode --page-size: a paged KV cache (0: contiguous)
    clmha_kv_dtype kv_dtype;     // --decode --kv-dtype
} bench_config;

// The inputs and outputs of one shape, on the device.
enum { BENCH_QUERY, BENCH_KEY, BENCH_VALUE, BENCH_OUTPUT, BENCH_WEIGHTS, BENCH_BUFS };
typedef struct bench_io {
    size_t n, l, s;
    bool self;     // self-attention: key = value = query, one packed QKV projection
    bool kv_same;  // cross-attention with key = value, one tensor
    clmha_forward_args args;     // the forward call's arguments, buffers set
    cl_mem bufs[BENCH_BUFS];     // NULL where the call has none
    size_t counts[BENCH_BUFS];   // floats of each buffer (0: none)
    char where[160];             // "N 8, L 128, S 128", for messages
} bench_io;

// ---- bench_common.c ----------------------------------------------------------------------------

// A fresh layer for one shape (so that its scratch is that shape's own). Reports a failure.
clmha_layer *clmha__bench_layer(clmha_context *ctx, const bench_config *cfg);

// Sets up @p io for shape (n, l, s) of @p layer: the forward arguments and the buffers, random
// inputs in [-1, 1), zeroed outputs, all written when it returns (clFinish). Returns EXIT_OK,
// or EXIT_REFUSED after reporting; either way clmha__bench_io_free() frees what it made.
int clmha__bench_io_make(clmha_context *ctx, const bench_config *cfg, clmha_layer *layer,
                         size_t n, size_t l, size_t s, bench_io *io);
void clmha__bench_io_free(bench_io *io);

// Writes @p count random floats in [-1, 1) to @p buf, a chunk at a time.
cl_int clmha__bench_fill_random(cl_command_queue queue, cl_mem buf, size_t count,
                                uint64_t *rng);

// The same as elements of @p dtype (F32; F64: the floats widened; F16 or BF16: rounded to
// nearest even).
cl_int clmha__bench_fill_random_as(cl_command_queue queue, cl_mem buf, size_t count,
                                   clmha_dtype dtype, uint64_t *rng);

// Prints @p s as a JSON string.
void clmha__bench_json_string(const char *s);

// Prints the start of a shape's JSON line, the fields every bench line has: `{"device": ...,
// "layer", "batch" (N), "tgt_len", "src_len", "embed_dim", "num_heads", "kdim", "vdim",
// "batch_first", "need_weights", "impl", "attention" ("self" or "cross"), "repeat": R, ` (the
// caller goes on with its own fields).
void clmha__bench_json_head(const clmha_context *ctx, const bench_config *cfg, size_t n,
                            size_t l, size_t s, clmha_impl impl, bool self);

// Sorts @p times (@p count > 0 of them) and returns their median; *min and *max get the ends.
double clmha__bench_median(double *times, size_t count, double *min, double *max);

// FLOPs of one forward pass, as `clmha bench` counts them: the projections' GEMMs in
// *projections and the attention's (Q·Kᵀ and weights·V) in *attention, over the (query, key)
// pairs that @p causal and d's window allow.
void clmha__bench_forward_flops(const clmha_layer_desc *d, bool causal, size_t n, size_t l,
                                size_t s, double *projections, double *attention);

// The core a forward pass (or a training step) of @p cfg's layers runs: --impl, else unfused
// with --need-weights, else fused.
clmha_impl clmha__bench_impl_used(const bench_config *cfg);

// Reports that @p what ("forward pass", ...) failed with @p st at shape @p where.
void clmha__bench_call_failed(clmha_context *ctx, const char *where, const char *what,
                              clmha_status st);

// Waits for the context's queue (clFinish); reports a failure at shape @p where.
bool clmha__bench_finish(clmha_context *ctx, const char *where);

// Prints the entries of a JSON line's "stages" object (@p ms: CLMHA_STAGE_COUNT times) and
// closes it and the line.
void clmha__bench_json_stages(const double *ms);

// Prints a text line per stage (@p ms: CLMHA_STAGE_COUNT times, @p total their sum): its name,
// ms and share; with @p skip_zero, not those that took no time.
void clmha__bench_print_stages(const double *ms, double total, bool skip_zero);

// ---- bench_backward.c, bench_decode.c (called by bench.c) ---------------------------------------

// --backward: times forward (with save) + backward at one shape and prints the result.
// @p times has room for cfg->repeat values. Returns EXIT_OK or EXIT_REFUSED after reporting.
int clmha__bench_backward_shape(clmha_context *ctx, const bench_config *cfg, size_t n, size_t l,
                                size_t s, double *times);

// --decode: times one decode step (one new token per sequence over a KV cache of @p cache_len
// tokens) at batch @p n, and the device's copy bandwidth, and prints both. @p times has room for
// cfg->repeat values. Returns EXIT_OK or EXIT_REFUSED after reporting.
int clmha__bench_decode_shape(clmha_context *ctx, const bench_config *cfg, size_t n,
                              size_t cache_len, double *times);

#endif
