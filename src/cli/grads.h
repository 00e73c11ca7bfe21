// The gradients of `clmha run --grad-output G.npy --grads-dir DIR`: which files a call gets
// (grads_plan), the backward pass that fills them (grads_compute). See run.c's usage text.
// `clmha sdpa` lists its own files (grads_add) and fills them itself.
#ifndef CLMHA_CLI_GRADS_H
#define CLMHA_CLI_GRADS_H

#include <stdbool.h>
#include <stddef.h>

#include <clmha.h>

#include "outputs.h"

#define CLMHA__CLI_MAX_GRADS 16

// One gradient file: DIR/<name>.npy in the shape of what it differentiates, in the layer's
// dtype as the forward's outputs are (float16 '<f2', float32 holding bfloat16 values, float32,
// float64 '<f8'), or float32 with grad_f32.
typedef struct clmha__cli_grad_file {
    const char *name;  // "query", "in_proj_weight", "out_proj.weight", "attn_mask"...
    int slot;          // which clmha_backward_args field receives it (grads.c)
    char *path;        // "DIR/<name>.npy" (malloc'd)
    size_t ndim, shape[4], count;
    float *data;       // count floats (malloc'd by grads_compute)
    double *data64;    // a float64 layer's: count doubles instead (data unused)
    bool with_key;     // query.npy when the key is the query's tensor given again (--value
                       // alone): the key's gradient is added to it
    float *key_part;   // that gradient (malloc'd by grads_compute; doubles for float64)
} clmha__cli_grad_file;

typedef struct clmha__cli_grads {
    size_t count;
    clmha__cli_grad_file file[CLMHA__CLI_MAX_GRADS];
    clmha_dtype dtype;  // the layer's (grads_plan): a 16-bit layer's files hold its values
    bool grad_f32;      // float32 gradients of a 16-bit layer (--grad-dtype f32)
} clmha__cli_grads;

// Lists the gradient files of a forward call of @p layer with @p args (the inputs as run.c
// gives them: args->key is the query's tensor when only --value was given): query.npy always;
// key.npy and value.npy for inputs given as files of their own (@p key_file, @p value_file);
// one file per parameter the layer has, by its state_dict name (sinks.npy with sinks);
// attn_mask.npy and key_padding_mask.npy for float masks. Reports and returns false when out of memory.
bool clmha__cli_grads_plan(const char *dir, clmha_layer *layer, const clmha_forward_args *args,
                           bool key_file, bool value_file, clmha__cli_grads *g);

// Adds DIR/<name>.npy of the given shape (@p ndim at most 4) for a caller that fills its data
// itself (slot unused). Returns false when out of memory or @p g is full.
bool clmha__cli_grads_add(clmha__cli_grads *g, const char *dir, const char *name, size_t ndim,
                          const size_t *shape);

// The files as outputs for clmha__cli_write_outputs() (flag "--grads-dir").
size_t clmha__cli_grads_outputs(const clmha__cli_grads *g, clmha__cli_out *out);

// Runs the backward pass of the forward call @p args (which saved into @p saved) from
// @p grad_output (and @p grad_weights, ndim 0: none) with the core @p impl, and fills the
// files' data. Reports and returns false on failure.
bool clmha__cli_grads_compute(clmha_layer *layer, const clmha_forward_args *args,
                              clmha_saved *saved, clmha_tensor grad_output,
                              clmha_tensor grad_weights, clmha_impl impl, clmha__cli_grads *g);

void clmha__cli_grads_free(clmha__cli_grads *g);

#endif
