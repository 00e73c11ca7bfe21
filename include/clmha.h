/// @file clmha.h
/// @brief clmha: multi-head attention on any OpenCL device.
///
/// clmha computes the forward pass of PyTorch's `torch.nn.MultiheadAttention` (every option:
/// kdim/vdim, bias, add_bias_kv, add_zero_attn, batch_first, key_padding_mask, 2-D/3-D attn_mask,
/// boolean or float masks, need_weights, average_attn_weights, dropout, unbatched inputs) on any
/// OpenCL 1.2 device. Projections and the batched score/value products run as CLBlast GEMMs; head
/// split/merge, masking and the row-wise softmax are clmha's own OpenCL kernels.
///
/// A minimal, complete program (self-attention, E = 8, 2 heads, sequence-first layout):
///
/// @code
/// #include <clmha.h>
/// #include <stdio.h>
///
/// int main(void) {
///     clmha_context *ctx = NULL;
///     clmha_layer *layer = NULL;
///     float w_in[3 * 8 * 8] = {0}, w_out[8 * 8] = {0}, x[4 * 1 * 8] = {0}, y[4 * 1 * 8];
///     // ... fill the weights and the input ...
///     if (clmha_context_create(&ctx, NULL) != CLMHA_SUCCESS) return 1;   // default device
///     clmha_layer_desc desc = {.embed_dim = 8, .num_heads = 2};
///     clmha_status st = clmha_layer_create(&layer, ctx, &desc);
///     if (!st) st = clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * 8 * 8);
///     if (!st) st = clmha_layer_set_parameter(layer, "out_proj.weight", w_out, 8 * 8);
///     clmha_forward_args args = {.query = {.ndim = 3, .shape = {4, 1, 8}, .data = x}};
///     if (!st) st = clmha_layer_forward_host(layer, &args, y, 4 * 1 * 8, NULL, 0);
///     if (st) fprintf(stderr, "%s\n", clmha_context_last_error(ctx));
///     clmha_layer_release(layer);
///     clmha_context_release(ctx);
///     return st != CLMHA_SUCCESS;
/// }
/// @endcode
///
/// ## Conventions
/// - Tensors are dense, row-major (C order) float32 arrays described by `ndim` and `shape`, with
///   PyTorch's shapes: query (L, N, E), or (N, L, E) with batch_first, or (L, E) unbatched.
/// - Every function returns a ::clmha_status; ::CLMHA_SUCCESS is 0. On failure nothing was
///   enqueued, no output was written and `*event` is NULL. clmha_context_last_error() gives a
///   message that names the argument and shapes involved.
/// - The library never prints, aborts or exits.
///
/// ## Threading
/// A context may be shared by several threads; its program cache and error message are protected
/// by a lock (the error message is the last one of any thread). A layer must not be used by two
/// threads at once: give each thread its own layer. Work on one context is enqueued on its single
/// in-order queue, so threads sharing a context serialise on the device.
///
/// ## The one deliberate difference from PyTorch
/// A query row whose every key is masked gives zero attention weights and a zero attention result
/// (so the layer output of that row is `out_proj.bias`). PyTorch gives NaN there.
#ifndef CLMHA_H
#define CLMHA_H

#ifndef CL_TARGET_OPENCL_VERSION
#define CL_TARGET_OPENCL_VERSION 120
#endif

#if defined(__APPLE__)
#include <OpenCL/cl.h>
#else
#include <CL/cl.h>
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "clmha_version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define CLMHA_API
#else
#define CLMHA_API __attribute__((visibility("default")))
#endif

/// X-macro table of every status: name, value, description.
#define CLMHA_STATUS_MAP(X)                                                                    \
    X(SUCCESS, 0, "success")                                                                   \
    X(INVALID_ARGUMENT, -1, "invalid argument")                                                \
    X(SHAPE_MISMATCH, -2, "tensor shape does not match the layer or the other inputs")        \
    X(INVALID_MASK, -3, "mask has the wrong shape, kind or polarity")                          \
    X(UNSUPPORTED, -4, "operation not supported by this layer or device")                      \
    X(DEVICE_NOT_FOUND, -5, "no OpenCL device matches (install an OpenCL driver such as PoCL)") \
    X(OUT_OF_MEMORY, -6, "out of host or device memory")                                       \
    X(BUILD_FAILED, -7, "OpenCL program build failed")                                         \
    X(OPENCL_ERROR, -8, "an OpenCL call failed")                                               \
    X(BLAS_ERROR, -9, "a CLBlast call failed")                                                 \
    X(SIZE_OVERFLOW, -10, "tensor sizes overflow")                                             \
    X(NOT_READY, -11, "layer parameter missing")                                               \
    X(CALLBACK_FAILED, -12, "the user-supplied attention core failed")                         \
    X(IO_ERROR, -13, "file could not be read or written")                                      \
    X(INVALID_FILE, -14, "file is malformed or of an unsupported kind")

/// Status codes. Every public function that can fail returns one.
typedef enum clmha_status {
#define CLMHA__STATUS_ENUM(name, value, text) CLMHA_##name = value,
    CLMHA_STATUS_MAP(CLMHA__STATUS_ENUM)
#undef CLMHA__STATUS_ENUM
} clmha_status;

/// A short, static, human description of @p status ("unknown status" for other values).
CLMHA_API const char *clmha_status_string(clmha_status status);

/// The library version at run time, "MAJOR.MINOR.PATCH".
CLMHA_API const char *clmha_version(void);

/// Opaque handles.
typedef struct clmha_context clmha_context;
typedef struct clmha_layer clmha_layer;

// ---------------------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------------------

/// One OpenCL device as seen by clmha_devices_list().
typedef struct clmha_device_info {
    unsigned platform_index;    ///< index of the platform in clGetPlatformIDs order
    unsigned device_index;      ///< index of the device within its platform
    cl_platform_id platform;
    cl_device_id device;
    cl_device_type type;        ///< CL_DEVICE_TYPE_GPU, _CPU, _ACCELERATOR, ...
    char platform_name[128];
    char device_name[128];
    char driver_version[64];
    cl_uint compute_units;
    cl_ulong global_mem_bytes;
    cl_ulong local_mem_bytes;
    cl_ulong max_alloc_bytes;
    bool fp16;                  ///< cl_khr_fp16
    bool fp64;                  ///< cl_khr_fp64 (or double support reported)
    char spec[32];              ///< "P:D", the spec string that selects exactly this device
} clmha_device_info;

/// Lists every device of every platform.
/// @param[out] infos     array of @p capacity entries to fill (may be NULL when capacity is 0)
/// @param[in]  capacity  number of entries @p infos holds
/// @param[out] count     total number of devices found (may exceed @p capacity)
/// @return ::CLMHA_SUCCESS (also when no device exists: *count is 0), ::CLMHA_INVALID_ARGUMENT,
///         ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_devices_list(clmha_device_info *infos, size_t capacity,
                                          size_t *count);

/// Selects a device by @p spec:
/// - NULL or "" : the first GPU, else the first device of any type;
/// - "P:D"      : platform index P, device index D;
/// - "gpu", "cpu", "accelerator" : the first device of that type;
/// - anything else: the first device whose platform or device name contains @p spec
///   (case-insensitive).
/// @return ::CLMHA_SUCCESS, ::CLMHA_DEVICE_NOT_FOUND (with a hint in @p message),
///         ::CLMHA_INVALID_ARGUMENT, ::CLMHA_OPENCL_ERROR
/// @param[out] message optional buffer for a human message on failure (may be NULL)
CLMHA_API clmha_status clmha_device_select(const char *spec, clmha_device_info *out,
                                           char *message, size_t message_size);

// ---------------------------------------------------------------------------------------------
// Contexts
// ---------------------------------------------------------------------------------------------

/// Creates a context on the device chosen by @p spec (see clmha_device_select()), with its own
/// cl_context and in-order queue (profiling enabled).
/// @param[out] out  the new context, or NULL on failure (see clmha_last_create_error())
/// @return ::CLMHA_SUCCESS, ::CLMHA_DEVICE_NOT_FOUND, ::CLMHA_OPENCL_ERROR, ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_context_create(clmha_context **out, const char *spec);

/// Like clmha_context_create() with the spec taken from the environment variable CLMHA_DEVICE
/// (unset or empty: the default device).
CLMHA_API clmha_status clmha_context_create_from_env(clmha_context **out);

/// Wraps the caller's OpenCL objects. @p queue must belong to @p context and @p device and be
/// in-order. All three are retained while the clmha context lives and released by
/// clmha_context_release(); the caller keeps its own references. Releasing the last reference
/// also clears CLBlast's process-wide program cache (whose programs hold references to the
/// cl_context), so the caller's reference counts return to where they were.
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, queue of another context or device,
///         out-of-order queue), ::CLMHA_OPENCL_ERROR, ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_context_create_from_cl(clmha_context **out, cl_context context,
                                                    cl_device_id device, cl_command_queue queue);

/// Message of the last failure in this thread that had no context to hold it: context creation,
/// and calls given a NULL context or layer. Never NULL.
CLMHA_API const char *clmha_last_create_error(void);

/// Adds a reference. Layers hold one on their context.
CLMHA_API void clmha_context_retain(clmha_context *ctx);

/// Drops a reference; the last one frees the context. Accepts NULL.
CLMHA_API void clmha_context_release(clmha_context *ctx);

/// Human message describing the last failure of a call on this context (or a layer of it).
/// The returned pointer stays valid until the next failing call. Never NULL.
CLMHA_API const char *clmha_context_last_error(const clmha_context *ctx);

/// The underlying OpenCL objects (not retained for the caller).
CLMHA_API cl_context clmha_context_cl_context(const clmha_context *ctx);
CLMHA_API cl_device_id clmha_context_cl_device(const clmha_context *ctx);
CLMHA_API cl_command_queue clmha_context_cl_queue(const clmha_context *ctx);

/// Device description of the context ("platform / device").
CLMHA_API const char *clmha_context_device_name(const clmha_context *ctx);

// ---------------------------------------------------------------------------------------------
// Layers
// ---------------------------------------------------------------------------------------------

/// Configuration of a layer; the fields and their meaning are those of
/// `torch.nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn,
/// kdim, vdim, batch_first)`. Zero-initialise it, then set what you need.
typedef struct clmha_layer_desc {
    size_t embed_dim;    ///< E, must be a multiple of num_heads
    size_t num_heads;    ///< H
    size_t kdim;         ///< features of key; 0 means embed_dim
    size_t vdim;         ///< features of value; 0 means embed_dim
    bool bias;           ///< in_proj_bias and out_proj.bias exist (PyTorch's default is true)
    bool add_bias_kv;    ///< bias_k and bias_v exist and are appended to key and value
    bool add_zero_attn;  ///< a zero key and value are appended
    bool batch_first;    ///< batched inputs are (N, L, E) instead of (L, N, E)
    float dropout;       ///< probability in [0, 1) of zeroing an attention weight in training
} clmha_layer_desc;

/// Creates a layer on @p ctx: validates the descriptor, builds the kernel programs and allocates
/// the parameter buffers (zero-filled). The layer retains the context.
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT, ::CLMHA_BUILD_FAILED, ::CLMHA_OUT_OF_MEMORY,
///         ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_layer_create(clmha_layer **out, clmha_context *ctx,
                                          const clmha_layer_desc *desc);

/// Frees the layer and drops its context reference. Accepts NULL.
CLMHA_API void clmha_layer_release(clmha_layer *layer);

/// The descriptor the layer was created with (kdim/vdim filled in).
CLMHA_API clmha_status clmha_layer_get_desc(const clmha_layer *layer, clmha_layer_desc *desc);

/// The context the layer lives on (not retained for the caller).
CLMHA_API clmha_context *clmha_layer_context(const clmha_layer *layer);

/// Copies one parameter from host memory, by its PyTorch name and with its PyTorch shape:
/// | name              | shape        | when                                  |
/// |-------------------|--------------|---------------------------------------|
/// | `in_proj_weight`  | (3E, E)      | kdim == vdim == E                     |
/// | `q_proj_weight`   | (E, E)       | always                                |
/// | `k_proj_weight`   | (E, kdim)    | always                                |
/// | `v_proj_weight`   | (E, vdim)    | always                                |
/// | `in_proj_bias`    | (3E)         | bias                                  |
/// | `out_proj.weight` | (E, E)       | always                                |
/// | `out_proj.bias`   | (E)          | bias                                  |
/// | `bias_k`, `bias_v`| (1, 1, E)    | add_bias_kv                           |
/// Parameters start at zero. The copy is finished when the call returns.
/// @param[in] count number of floats in @p data; must equal the product of the shape
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (unknown name, parameter the layer does not
///         have, NULL), ::CLMHA_SHAPE_MISMATCH (wrong count), ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_layer_set_parameter(clmha_layer *layer, const char *name,
                                                 const float *data, size_t count);

/// Copies one parameter back to host memory (same names and shapes as above).
CLMHA_API clmha_status clmha_layer_get_parameter(clmha_layer *layer, const char *name,
                                                 float *data, size_t count);

/// Number of floats of parameter @p name for this layer (0 when the layer has no such parameter).
CLMHA_API size_t clmha_layer_parameter_count(const clmha_layer *layer, const char *name);

/// Sizes the layer's scratch buffers for inputs up to @p batch x @p tgt_len x @p src_len and
/// warms up the GEMMs, so that later forward calls at or below these sizes allocate nothing and
/// compile nothing. Optional: a forward call on larger inputs grows the scratch itself.
CLMHA_API clmha_status clmha_layer_bake(clmha_layer *layer, size_t batch, size_t tgt_len,
                                        size_t src_len, bool need_weights);

/// Bytes of device scratch the layer currently holds.
CLMHA_API size_t clmha_layer_scratch_bytes(const clmha_layer *layer);

// ---------------------------------------------------------------------------------------------
// Layer files (.safetensors with PyTorch's names)
// ---------------------------------------------------------------------------------------------

/// Creates a layer from a `.safetensors` file whose tensors are named and shaped as
/// `nn.MultiheadAttention.state_dict()` gives them (`in_proj_weight` or
/// `q_proj_weight`/`k_proj_weight`/`v_proj_weight`, `in_proj_bias`, `out_proj.weight`,
/// `out_proj.bias`, `bias_k`, `bias_v`), F32, F16 or F64 (converted to float). The file's
/// `__metadata__` gives `num_heads` (required), `batch_first`, `add_zero_attn` ("true"/"false",
/// default false) and `dropout` (default 0); embed_dim, kdim, vdim, bias and add_bias_kv follow
/// from the tensors present and their shapes.
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT, ::CLMHA_IO_ERROR (cannot open or read),
///         ::CLMHA_INVALID_FILE (malformed file, missing or inconsistent tensors or metadata; the
///         message names the file and the culprit), ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY,
///         and the statuses of clmha_layer_create()
CLMHA_API clmha_status clmha_layer_load(clmha_layer **out, clmha_context *ctx, const char *path);

/// Writes the layer to @p path in the format clmha_layer_load() reads (F32 tensors, metadata
/// with num_heads, batch_first, add_zero_attn and dropout). The file appears whole or not at all
/// (written to a temporary file in the same folder, then renamed).
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT, ::CLMHA_IO_ERROR, ::CLMHA_OUT_OF_MEMORY,
///         ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_layer_save(clmha_layer *layer, const char *path);

// ---------------------------------------------------------------------------------------------
// Forward pass
// ---------------------------------------------------------------------------------------------

/// How a mask's values are read. Boolean masks are one byte per element (0 or non-zero).
typedef enum clmha_mask_kind {
    CLMHA_MASK_NONE = 0,      ///< no mask
    CLMHA_MASK_BOOL_IGNORE,   ///< non-zero = may NOT attend (nn.MultiheadAttention's bool masks)
    CLMHA_MASK_BOOL_ATTEND,   ///< non-zero = MAY attend (scaled_dot_product_attention, continuiti)
    CLMHA_MASK_FLOAT,         ///< float32, added to the scaled scores (-INFINITY forbids)
} clmha_mask_kind;

/// A dense row-major tensor. The device forward reads @ref buffer at element offset
/// @ref offset; the host forward reads @ref data.
typedef struct clmha_tensor {
    size_t ndim;          ///< number of dimensions (1 to 4)
    size_t shape[4];      ///< sizes, outermost first, as PyTorch prints them
    cl_mem buffer;        ///< device forward: the buffer holding the tensor
    size_t offset;        ///< device forward: offset in elements (floats or bytes for bool masks)
    const void *data;     ///< host forward: pointer to the first element
} clmha_tensor;

/// A mask: a kind and a tensor.
///
/// key_padding_mask: (N, S), or (S) for unbatched inputs.
/// attn_mask: (L, S) shared by every batch and head; (N*H, L, S) per batch and head; or, with
/// @ref per_batch set, (N, L, S) shared by the heads of each batch item (continuiti's layout).
/// Unbatched inputs take (L, S) or (H, L, S).
typedef struct clmha_mask {
    clmha_mask_kind kind;
    bool per_batch;       ///< attn_mask only: 3-D mask is (N, L, S), repeated for every head
    clmha_tensor tensor;
} clmha_mask;

/// Dropout randomness: weight (n, h, i, j) is dropped when the first word of
/// Philox4x32-10(counter = {j, i, n*H + h, offset low 32 bits},
///               key = {seed low 32 bits, seed high 32 bits XOR offset high 32 bits})
/// divided by 2^32 is below p. Same seed and offset: same result on every device.
typedef struct clmha_dropout_rng {
    uint64_t seed;
    uint64_t offset;
} clmha_dropout_rng;

struct clmha_core_args;

/// A user-supplied attention core (continuiti's `attention` argument). It receives the projected,
/// head-split device buffers and must enqueue work that fills `out` (and `weights` when not NULL)
/// on `queue`, waiting for `wait_list` and returning an event in `*event` (or enqueue nothing
/// and return a marker). Return ::CLMHA_SUCCESS or another status to abort the forward pass.
typedef clmha_status (*clmha_attention_fn)(const struct clmha_core_args *args, void *user_data);

/// Arguments of one forward call. Zero-initialise, then set what you need.
typedef struct clmha_forward_args {
    clmha_tensor query;            ///< (L, N, E), (N, L, E) with batch_first, or (L, E)
    clmha_tensor key;              ///< (S, N, kdim) likewise; ndim 0 = same as query
    clmha_tensor value;            ///< (S, N, vdim) likewise; ndim 0 = same as key
    clmha_mask key_padding_mask;   ///< optional
    clmha_mask attn_mask;          ///< optional
    bool is_causal;                ///< forbid key j > query i (top-left aligned), built on device
    bool need_weights;             ///< also return attention weights
    bool per_head_weights;         ///< weights per head (N, H, L, S); else averaged (N, L, S)
    bool training;                 ///< apply the layer's dropout (PyTorch's train())
    clmha_dropout_rng rng;         ///< used when training and dropout > 0
} clmha_forward_args;

/// What a user attention core receives. Layouts: q (N*H, L, D), k and v (N*H, S', D), out
/// (N*H, L, D), weights (N*H, L, S'), row-major, element offset 0; S' = S + add_bias_kv +
/// add_zero_attn. The masks are the caller's, unchanged (they cover the first S keys; the
/// appended keys are never masked). `scale` = 1/sqrt(D).
typedef struct clmha_core_args {
    cl_command_queue queue;
    size_t batch, num_heads, tgt_len, src_len, src_len_padded, head_dim;
    float scale;
    cl_mem q, k, v, out, weights;
    const clmha_mask *key_padding_mask;
    const clmha_mask *attn_mask;
    bool is_causal;
    bool training;
    float dropout;
    clmha_dropout_rng rng;
    cl_uint num_wait;
    const cl_event *wait_list;
    cl_event *event;
} clmha_core_args;

/// Replaces the attention core of @p layer (NULL restores the built-in one).
CLMHA_API clmha_status clmha_layer_set_attention(clmha_layer *layer, clmha_attention_fn fn,
                                                 void *user_data);

/// Output sizes in floats for @p args: the attention output and the weights (0 without
/// need_weights). Validates @p args like a forward call.
CLMHA_API clmha_status clmha_layer_output_counts(clmha_layer *layer,
                                                 const clmha_forward_args *args,
                                                 size_t *output_count, size_t *weights_count);

/// Enqueues the forward pass on device buffers. Inputs are read from the `buffer` fields of
/// @p args; the result goes to @p output (element offset @p output_offset), shaped like the
/// query with E features; the weights (when need_weights) to @p weights: (N, L, S') averaged,
/// (N, H, L, S') per head, or (L, S') / (H, L, S') unbatched.
/// With a bias, @p output must not be CL_MEM_WRITE_ONLY (the output projection accumulates onto
/// the bias rows).
/// The call never waits on the host: it waits for @p wait_list on the device and returns an
/// event for the completion in @p event (may be NULL; the caller releases it).
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT, ::CLMHA_SHAPE_MISMATCH,
///         ::CLMHA_INVALID_MASK, ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY,
///         ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR, ::CLMHA_CALLBACK_FAILED
CLMHA_API clmha_status clmha_layer_forward(clmha_layer *layer, const clmha_forward_args *args,
                                           cl_mem output, size_t output_offset, cl_mem weights,
                                           size_t weights_offset, cl_uint num_wait,
                                           const cl_event *wait_list, cl_event *event);

/// The host-array path: uploads the tensors given by the `data` fields of @p args, runs the
/// forward pass, downloads and waits. @p output must hold @p output_count floats (see
/// clmha_layer_output_counts()); @p weights likewise when need_weights, else may be NULL.
CLMHA_API clmha_status clmha_layer_forward_host(clmha_layer *layer,
                                                const clmha_forward_args *args, float *output,
                                                size_t output_count, float *weights,
                                                size_t weights_count);

// ---------------------------------------------------------------------------------------------
// Profiling
// ---------------------------------------------------------------------------------------------

/// The stages of a forward pass, in the order they run.
typedef enum clmha_stage {
    CLMHA_STAGE_PROJECT = 0,  ///< input projections (GEMMs)
    CLMHA_STAGE_SPLIT,        ///< head split, in_proj_bias, bias_k/bias_v, zero key
    CLMHA_STAGE_SCORES,       ///< Q·Kᵀ (strided batched GEMM); a user core's whole time
    CLMHA_STAGE_SOFTMAX,      ///< masks, softmax, dropout
    CLMHA_STAGE_AV,           ///< weights · V (strided batched GEMM)
    CLMHA_STAGE_MERGE,        ///< head merge
    CLMHA_STAGE_OUT_PROJ,     ///< output projection (bias rows + GEMM)
    CLMHA_STAGE_WEIGHTS,      ///< attention weights output (copy or head average)
    CLMHA_STAGE_COUNT
} clmha_stage;

/// Turns per-stage timing on or off for later forward calls of @p layer. With it on, each
/// forward call enqueues a marker after every stage (a few OpenCL events per call). The
/// context's queue must have CL_QUEUE_PROFILING_ENABLE (contexts made by clmha do).
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT, ::CLMHA_UNSUPPORTED (queue without
///         profiling)
CLMHA_API clmha_status clmha_layer_set_profiling(clmha_layer *layer, bool on);

/// Waits for the last profiled forward call of @p layer and returns the device time of each
/// stage in milliseconds (0 for stages that did not run). The stage time is the time between
/// the end of the previous stage and the end of this one on the in-order queue.
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (profiling off, or no profiled call yet),
///         ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_layer_stage_times(clmha_layer *layer,
                                               double ms[CLMHA_STAGE_COUNT]);

/// A short name of @p stage ("project", "split", "scores", ...), or "?" .
CLMHA_API const char *clmha_stage_name(clmha_stage stage);

// ---------------------------------------------------------------------------------------------
// CPU reference
// ---------------------------------------------------------------------------------------------

/// Plain double-precision CPU implementation of the same forward pass, for checking results.
/// Parameters are host arrays by PyTorch name (NULL where the layer has none): in_proj_weight
/// (3E, E) or q/k/v_proj_weight; in_proj_bias; out_proj_weight; out_proj_bias; bias_k; bias_v.
typedef struct clmha_reference_params {
    const float *in_proj_weight;
    const float *q_proj_weight, *k_proj_weight, *v_proj_weight;
    const float *in_proj_bias;
    const float *out_proj_weight;
    const float *out_proj_bias;
    const float *bias_k, *bias_v;
} clmha_reference_params;

/// Computes the forward pass on the CPU in double precision, with the same semantics (the same
/// Philox dropout, zeros for fully masked rows) as clmha_layer_forward_host(). Reads the `data`
/// fields of @p args. Outputs are doubles.
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT, ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_reference_forward(const clmha_layer_desc *desc,
                                               const clmha_reference_params *params,
                                               const clmha_forward_args *args, double *output,
                                               size_t output_count, double *weights,
                                               size_t weights_count, char *message,
                                               size_t message_size);

#ifdef __cplusplus
}
#endif

#endif  // CLMHA_H
