/// @file clmha.h
/// @brief clmha: multi-head attention on any OpenCL device.
///
/// clmha computes PyTorch's `torch.nn.MultiheadAttention` (every option: kdim/vdim, bias,
/// add_bias_kv, add_zero_attn, batch_first, key_padding_mask, 2-D/3-D attn_mask, boolean or
/// float masks, need_weights, average_attn_weights, dropout, unbatched inputs, grouped-query
/// attention) on any OpenCL 1.2 device: the forward pass, its backward pass (the gradients of
/// the inputs, parameters and float masks: clmha_layer_backward()), and incremental decoding
/// with a KV cache (::clmha_kv_cache). Projections and the batched score/value products are
/// GEMMs, run by CLBlast on the device, or by the host's BLAS on CPU drivers, where it is faster
/// (clmha_context_gemm()); head split/merge, masking, the softmax and the fused attention are
/// clmha's own OpenCL kernels.
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
///     clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = 8, .num_heads = 2};
///     clmha_status st = clmha_layer_create(&layer, ctx, &desc);
///     if (!st) st = clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * 8 * 8);
///     if (!st) st = clmha_layer_set_parameter(layer, "out_proj.weight", w_out, 8 * 8);
///     clmha_forward_args args = {.struct_size = sizeof args,
///                                .query = {.ndim = 3, .shape = {4, 1, 8}, .data = x}};
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
///   N is the batch size, L the target and S the source length, E = embed_dim, H = num_heads,
///   D = E / H the head dimension, and S' = S + add_bias_kv + add_zero_attn the number of keys
///   the softmax sees.
/// - Every function that can fail returns a ::clmha_status: ::CLMHA_SUCCESS (0) or a negative
///   code. A constructor that fails sets `*out` to NULL. A failure also records a message that
///   names the argument and shapes involved: for the calling thread and the context
///   (clmha_context_last_error()), or, when the call has no context (context creation, a NULL context or layer), in a per-thread
///   buffer (clmha_last_create_error()). clmha_device_select() and clmha_reference_forward()
///   write it to a caller's buffer instead; clmha_device_note() records none.
/// - Structs that cross the API start with `size_t struct_size` (see ::CLMHA_STRUCT_INIT and
///   docs/abi.md): the caller zero-initialises the struct and sets struct_size to its sizeof,
///   both for structs it fills (clmha_layer_desc, clmha_forward_args, clmha_reference_params,
///   clmha_tune_options) and for structs the library fills (clmha_device_info,
///   clmha_tune_report, and clmha_layer_desc for clmha_layer_get_desc()). The library reads
///   and writes only the bytes struct_size covers, so a program built against an older header
///   keeps working with a newer library.
/// - A call that fails validation (arguments, shapes, masks, buffers) has enqueued nothing and
///   written no output, and `*event` is NULL. When an OpenCL or CLBlast call fails while a
///   forward pass is being enqueued, the function returns at once with `*event` NULL, but the
///   commands enqueued before the failure stay on the queue and run: they write the layer's
///   scratch and may write the caller's output and weights buffers, whose contents are then
///   unspecified. The host-array functions write the caller's arrays only once the whole pass
///   has finished on the device, all of them or (a call that fails) none.
/// - The library never prints, aborts or exits.
///
/// ## Threading
/// A context may be shared by several threads: its reference count and program cache are
/// protected by locks, and its error messages are kept per thread (each thread reads the message
/// of its own last failure on the context, never another thread's). A layer
/// must not be used by two threads at once (its kernel arguments and scratch are per layer): give
/// each thread its own layer. Work on one context is enqueued on its single in-order queue, so
/// threads sharing a context serialise on the device, and a call that waits (layer creation and
/// loading, parameter copies, the host-array forward pass, clmha_layer_bake(),
/// clmha_layer_stage_times(), clmha_layer_save(), the last clmha_context_release()) also waits
/// for the work other threads enqueued on that queue before it. clmha_reference_forward()
/// touches no shared state. Threads may make their first calls at the same moment, on one
/// context or on several: clmha lists devices one thread at a time (drivers initialise on the
/// process's first listing) and runs CLBlast calls one at a time until one has succeeded
/// (CLBlast fills process-wide tables on its first call without a lock).
///
/// ## The one deliberate difference from PyTorch
/// A query row whose every key is masked gives zero attention weights and a zero attention result
/// (so the layer output of that row is `out_proj.bias`). PyTorch gives NaN there.
///
/// ## NaN and infinity
/// As in PyTorch, non-finite values are data, not errors: NaN or ±infinity in the inputs, the
/// parameters or a float mask flow through the arithmetic as IEEE 754 says, the output and
/// weight elements they reach become NaN or ±infinity, and the call returns ::CLMHA_SUCCESS. The
/// library never scans tensors for them (that would cost a pass over every input on every
/// call); a caller that must refuse them checks before the call. In a float mask, `-inf` is the
/// normal way to forbid a key (a row whose keys are all `-inf` is fully masked: see above);
/// `+inf` or NaN in a mask makes its whole row NaN. Values given to the library are floats:
/// converting wider data (float64 files) is the caller's job, and a finite value beyond float
/// range then becomes ±infinity, as `torch.Tensor.float()` makes it.
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

/// Marks the public functions. On Windows: `__declspec(dllexport)` while building the DLL
/// (CLMHA_BUILDING_SHARED, set by clmha's CMake for the shared library's objects),
/// `__declspec(dllimport)` for its users, nothing with CLMHA_STATIC (defined for users of the
/// static library by clmha::clmha_static and `pkg-config --static`; define it yourself
/// otherwise). Elsewhere: default visibility (the library is built with hidden visibility).
#if defined(_WIN32) || defined(__CYGWIN__)
#if defined(CLMHA_STATIC)
#define CLMHA_API
#elif defined(CLMHA_BUILDING_SHARED)
#define CLMHA_API __declspec(dllexport)
#else
#define CLMHA_API __declspec(dllimport)
#endif
#elif defined(__GNUC__) || defined(__clang__)
#define CLMHA_API __attribute__((visibility("default")))
#else
#define CLMHA_API
#endif

/// An initialiser for a sized struct: every field zero and `struct_size = sizeof(type)`.
/// @code
/// clmha_layer_desc desc = CLMHA_STRUCT_INIT(clmha_layer_desc);
/// desc.embed_dim = 8;
/// desc.num_heads = 2;
/// // In C, designated initialisers do the same: set struct_size with the other fields.
/// clmha_forward_args args = {.struct_size = sizeof args, .need_weights = true};
/// @endcode
/// Works in C (as an initialiser; `(type)CLMHA_STRUCT_INIT(type)` is a compound literal) and in
/// C++ (an expression of type @p type).
/// The rules (docs/abi.md): struct_size 0, or below the size of the struct's required fields,
/// is refused with ::CLMHA_INVALID_ARGUMENT; a smaller, older struct is read as far as it goes
/// and the newer fields count as zero; a larger struct (a caller built against a newer header)
/// is accepted when the bytes this library does not know are all zero, else refused with
/// ::CLMHA_UNSUPPORTED. For structs the library fills, it writes no byte past struct_size.
#ifdef __cplusplus
#define CLMHA_STRUCT_INIT(type) \
    ([] {                          \
        type clmha_init_ = type(); \
        clmha_init_.struct_size = sizeof(type); \
        return clmha_init_;        \
    }())
#else
#define CLMHA_STRUCT_INIT(type) {.struct_size = sizeof(type)}
#endif

/// X-macro table of every status: `X(NAME, value, "description")`, NAME without the `CLMHA_`
/// prefix. It generates ::clmha_status and the status texts.
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
    X(NOT_READY, -11, "nothing to return yet")                                                 \
    X(CALLBACK_FAILED, -12, "the user-supplied attention core failed")                         \
    X(IO_ERROR, -13, "file could not be read or written")                                      \
    X(INVALID_FILE, -14, "file is malformed or of an unsupported kind")

/// Status codes, generated from ::CLMHA_STATUS_MAP: 0 for success, negative for failures. Every
/// public function that can fail returns one; the functions list the codes they can return.
typedef enum clmha_status {
#define CLMHA__STATUS_ENUM(name, value, text) CLMHA_##name = value,
    CLMHA_STATUS_MAP(CLMHA__STATUS_ENUM)
#undef CLMHA__STATUS_ENUM
} clmha_status;

/// @var CLMHA_SUCCESS
/// 0: the call did what it was asked.
/// @var CLMHA_INVALID_ARGUMENT
/// -1: a required pointer is NULL; a value is out of range (descriptor, bake sizes); a parameter
/// name is unknown or names a parameter the layer does not have; a cl_mem, queue or wait list
/// does not fit the call (wrong context, too small, write-only output with bias, out-of-order
/// queue); or the call comes in the wrong state (stage times without a profiled call).
/// @var CLMHA_SHAPE_MISMATCH
/// -2: an input's rank, feature count, batch size or source length does not match the layer or
/// the other inputs, or a count (parameter floats, output or weights array) is not the one the
/// call needs.
/// @var CLMHA_INVALID_MASK
/// -3: a mask has an unknown kind, a tensor or `per_batch` but kind ::CLMHA_MASK_NONE, a shape
/// that fits none of its layouts, or `per_batch` where it does not apply.
/// @var CLMHA_UNSUPPORTED
/// -4: the device, queue or tuning cannot do it: clmha_layer_set_profiling() on a queue
/// without CL_QUEUE_PROFILING_ENABLE; ::CLMHA_IMPL_FUSED where the fused kernel cannot be
/// built (clmha_layer_forward(), clmha_layer_forward_host(), clmha_layer_bake());
/// clmha_context_tuning_import() of a tuning for another device, driver or CLBlast version.
/// Or a struct's struct_size is larger than this library's struct and sets a byte past it: the
/// caller was built against a newer clmha and uses a field this one does not have
/// (clmha_layer_create(), clmha_layer_output_counts(), clmha_layer_forward(),
/// clmha_layer_forward_host(), clmha_context_tune(), clmha_reference_forward()).
/// @var CLMHA_DEVICE_NOT_FOUND
/// -5: no OpenCL device is installed, or none matches the device spec.
/// @var CLMHA_OUT_OF_MEMORY
/// -6: a host allocation failed; a buffer would exceed the device's largest allocation
/// (clmha_device_info::max_alloc_bytes): parameters, or scratch that cannot be split (the
/// projected inputs, the head tiles; never the scores of the unfused core, which it works
/// through in chunks, see ::clmha_impl); or OpenCL or CLBlast reported
/// CL_MEM_OBJECT_ALLOCATION_FAILURE, CL_OUT_OF_RESOURCES, CL_OUT_OF_HOST_MEMORY or
/// CL_INVALID_BUFFER_SIZE.
/// @var CLMHA_BUILD_FAILED
/// -7: an OpenCL program did not compile: one of clmha's kernels (the message holds the build
/// log) or a GEMM kernel CLBlast compiles on first use.
/// @var CLMHA_OPENCL_ERROR
/// -8: any other failure of an OpenCL call; the message names the call and the CL error.
/// @var CLMHA_BLAS_ERROR
/// -9: any other failure of a CLBlast call; the message gives CLBlast's status.
/// @var CLMHA_SIZE_OVERFLOW
/// -10: a size product (tensor elements, parameter, scratch or file size) does not fit in size_t.
/// @var CLMHA_NOT_READY
/// -11: there is nothing to return yet: clmha_context_tuning_export() when no tuning is applied
/// on the device in this process (CLBlast's own parameters are in use). No other function returns
/// it (a new layer's parameters start at zero, so it can run at once).
/// @var CLMHA_CALLBACK_FAILED
/// -12: the user attention core (clmha_layer_set_attention()) returned a status other than
/// ::CLMHA_SUCCESS; the message names that status.
/// @var CLMHA_IO_ERROR
/// -13: a file could not be opened, read, written or renamed; the message gives the reason.
/// @var CLMHA_INVALID_FILE
/// -14: a layer file is malformed, or its tensors or metadata are unknown, missing or
/// inconsistent; the message names the file and the culprit.

/// Text of a status, for messages.
/// @param[in] status  any value
/// @return "CLMHA_<NAME>: <description>" (e.g. "CLMHA_INVALID_MASK: mask has the wrong shape,
///         kind or polarity"), or "unknown status" for a value that is not a ::clmha_status.
///         A static string: never NULL, never to be freed.
CLMHA_API const char *clmha_status_string(clmha_status status);

/// The version of the library loaded at run time (compare with ::CLMHA_VERSION_STRING, the
/// version of the headers compiled against).
/// @return "MAJOR.MINOR.PATCH", a static string
CLMHA_API const char *clmha_version(void);

/// A context: an OpenCL context, one device and one in-order command queue, with the compiled
/// kernel programs and, per thread, the last error message. Reference-counted and thread-safe. Made by
/// clmha_context_create(), clmha_context_create_from_env() or clmha_context_create_from_cl();
/// freed by the last clmha_context_release().
typedef struct clmha_context clmha_context;
/// One attention layer: its configuration, its parameters in device buffers, its kernels and
/// its scratch buffers. Made by clmha_layer_create() or clmha_layer_load(), freed by
/// clmha_layer_release(). Use it from one thread at a time.
typedef struct clmha_layer clmha_layer;
/// What one forward call keeps for its backward pass (see ::clmha_saved and the Training section).
typedef struct clmha_saved clmha_saved;
/// The projected keys and values of earlier tokens, for incremental decoding (see
/// ::clmha_kv_cache and the Incremental decoding section).
typedef struct clmha_kv_cache clmha_kv_cache;

// ---------------------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------------------

/// One OpenCL device, as clmha_device_describe() and clmha_device_select() fill it. Strings are
/// NUL-terminated and truncated to fit. The OpenCL handles are not retained (platforms and root
/// devices need no reference). The library fills it: set struct_size first, and at most
/// struct_size bytes are written (the smallest accepted struct_size covers the fields up to
/// @ref device):
/// @code
/// clmha_device_info info = CLMHA_STRUCT_INIT(clmha_device_info);
/// if (clmha_device_describe(0, &info) == CLMHA_SUCCESS) puts(info.device_name);
/// @endcode
typedef struct clmha_device_info {
    size_t struct_size;         ///< set by the caller: sizeof(clmha_device_info)
    unsigned platform_index;    ///< index of the platform in clGetPlatformIDs order
    unsigned device_index;      ///< index of the device within its platform
    cl_platform_id platform;    ///< the platform
    cl_device_id device;        ///< the device
    cl_device_type type;        ///< CL_DEVICE_TYPE_GPU, _CPU, _ACCELERATOR, ...
    char platform_name[128];    ///< CL_PLATFORM_NAME
    char device_name[128];      ///< CL_DEVICE_NAME
    char driver_version[64];    ///< CL_DRIVER_VERSION
    cl_uint compute_units;      ///< CL_DEVICE_MAX_COMPUTE_UNITS
    cl_ulong global_mem_bytes;  ///< CL_DEVICE_GLOBAL_MEM_SIZE
    cl_ulong local_mem_bytes;   ///< CL_DEVICE_LOCAL_MEM_SIZE
    cl_ulong max_alloc_bytes;   ///< CL_DEVICE_MAX_MEM_ALLOC_SIZE: the largest single buffer, which
                                ///< bounds a layer's scores scratch of N·H·L·S' floats
    bool fp16;                  ///< cl_khr_fp16
    bool fp64;                  ///< cl_khr_fp64 (or double support reported)
    char spec[32];              ///< "P:D", the spec string that selects exactly this device
} clmha_device_info;

/// Counts the devices of every platform (at most 32 platforms and 64 devices per platform; a
/// platform whose devices cannot be queried is skipped). Devices are numbered from 0 in
/// platform order, then device order, for clmha_device_describe(). On failure the message is
/// in clmha_last_create_error().
/// @param[out] count  the number of devices
/// @return ::CLMHA_SUCCESS (also when no device or no OpenCL platform exists: *count is 0),
///         ::CLMHA_INVALID_ARGUMENT (@p count NULL), ::CLMHA_OPENCL_ERROR (clGetPlatformIDs
///         failed)
CLMHA_API clmha_status clmha_device_count(size_t *count);

/// Describes device number @p index (0 to the count of clmha_device_count() - 1). On failure
/// nothing is written to @p info and the message is in clmha_last_create_error().
/// @param[in]     index  the device's number
/// @param[in,out] info   struct_size set by the caller (CLMHA_STRUCT_INIT(clmha_device_info));
///                       the description, at most struct_size bytes of it
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p info NULL, struct_size 0 or too small,
///         @p index not below the device count), ::CLMHA_OPENCL_ERROR (clGetPlatformIDs failed)
CLMHA_API clmha_status clmha_device_describe(size_t index, clmha_device_info *info);

/// What clmha does differently on this device because of a known driver bug, in one line, or ""
/// when nothing. Mesa's llvmpipe (rusticl and clover) ends every loop of a kernel once a
/// work-item has run 65535 loop iterations in total: there the fused core is used only for calls
/// whose loop count stays well under that limit, the others run the unfused core (also with
/// ::CLMHA_IMPL_FUSED). Clover's compiler aborts the process on vloadN: the fused kernel is built
/// without vectors there. PoCL gives a native kernel listing several buffers their memory at the
/// wrong places: the host-BLAS GEMMs (::clmha_gemm) take each buffer's memory in a native kernel
/// of its own there. Records no error message.
/// @param[in] info  a device description from clmha_device_describe() or clmha_device_select()
///                  (NULL, or a struct_size that clmha_device_describe() refuses, gives "")
/// @return a static string
CLMHA_API const char *clmha_device_note(const clmha_device_info *info);

/// Selects a device by @p spec:
/// - NULL or "" : the first GPU, else the first device of any type;
/// - "P:D"      : platform index P, device index D (as `clmha devices` and
///   clmha_device_info::spec give them). A spec with a colon and only digits, signs or spaces
///   before it is read as such a pair and must be exactly two unsigned decimal numbers (leading
///   zeros allowed, no sign, space or other character) of at most UINT_MAX each: anything else
///   ("-1:0", "4294967296:0", "0:", ":0", "0:0x", "0:0:0") is refused with
///   ::CLMHA_INVALID_ARGUMENT before any device is looked at;
/// - "gpu", "cpu", "accelerator" : the first device of that type (case-insensitive);
/// - anything else: the first device whose platform or device name contains @p spec
///   (case-insensitive).
/// @param[in]  spec          the device spec (may be NULL)
/// @param[in,out] out        struct_size set by the caller (CLMHA_STRUCT_INIT(clmha_device_info));
///                           the selected device, at most struct_size bytes, written only on
///                           success
/// @param[out] message       optional buffer for a human message on failure (may be NULL);
///                           untouched on success
/// @param[in]  message_size  size of @p message in bytes (ignored when @p message is NULL)
/// @return ::CLMHA_SUCCESS, ::CLMHA_DEVICE_NOT_FOUND (no device at all, with an installation
///         hint in @p message, or none matching, with the list of devices),
///         ::CLMHA_INVALID_ARGUMENT (@p out NULL, its struct_size 0 or too small, or a malformed
///         "P:D" spec: the message quotes it and says which index is wrong), ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_device_select(const char *spec, clmha_device_info *out,
                                           char *message, size_t message_size);

// ---------------------------------------------------------------------------------------------
// Contexts
// ---------------------------------------------------------------------------------------------

/// Creates a context on the device chosen by @p spec (see clmha_device_select()), with its own
/// cl_context and in-order queue (profiling enabled). The caller owns one reference.
/// @param[out] out   the new context, or NULL on failure (the message is in
///                   clmha_last_create_error())
/// @param[in]  spec  device spec as for clmha_device_select(); NULL or "" for the default device
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p out NULL, a malformed "P:D" spec),
///         ::CLMHA_DEVICE_NOT_FOUND, ::CLMHA_OPENCL_ERROR, ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_context_create(clmha_context **out, const char *spec);

/// Like clmha_context_create() with the spec taken from the environment variable CLMHA_DEVICE
/// (unset or empty: the default device).
/// @param[out] out  the new context, or NULL on failure (see clmha_last_create_error())
/// @return the statuses of clmha_context_create()
CLMHA_API clmha_status clmha_context_create_from_env(clmha_context **out);

/// Wraps the caller's OpenCL objects. @p queue must belong to @p context and @p device and be
/// in-order; it need not have CL_QUEUE_PROFILING_ENABLE (without it clmha_layer_set_profiling()
/// fails). The cl_context, the device and the queue are retained while the clmha context lives
/// and released by its last clmha_context_release() (retaining a root device is a no-op; a
/// sub-device is kept alive). The caller keeps its own references,
/// and its own work on the queue is ordered with clmha's. CLBlast's process-wide program cache
/// holds references to the cl_context too; it is cleared when the last clmha context of the
/// process is released, so the caller's reference counts return to where they were once no
/// clmha context is left (see clmha_context_release()).
/// @param[out] out      the new context, or NULL on failure (see clmha_last_create_error())
/// @param[in]  context  the caller's OpenCL context
/// @param[in]  device   a device of @p context
/// @param[in]  queue    an in-order command queue of @p context on @p device
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, invalid queue, queue of another
///         context or device, out-of-order queue), ::CLMHA_OPENCL_ERROR, ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_context_create_from_cl(clmha_context **out, cl_context context,
                                                    cl_device_id device, cl_command_queue queue);

/// Message of the last failure in this thread that had no context to hold it: context creation,
/// and calls given a NULL context or layer.
/// @return a NUL-terminated message, "" before the first such failure. Never NULL. It points to
///         a per-thread buffer, valid for the life of the thread and overwritten by the thread's
///         next such failure.
CLMHA_API const char *clmha_last_create_error(void);

/// Adds a reference (thread-safe). Every layer also holds one on its context.
/// @param[in] ctx  the context (NULL is ignored)
CLMHA_API void clmha_context_retain(clmha_context *ctx);

/// Drops a reference (thread-safe). The last one waits for the context's queue to finish
/// (clFinish), frees the context and its programs and releases its OpenCL objects. When it was
/// the last clmha context alive in the process, it also clears CLBlast's process-wide program
/// cache (CLBlastClearCache(): the compiled GEMM programs, which hold references to their
/// cl_context); while other clmha contexts live, the cache is left alone, so they keep their
/// compiled GEMM kernels. A failed context creation clears nothing process-wide. A context
/// therefore lives until its last layer is released.
/// @param[in] ctx  the context (NULL is ignored)
CLMHA_API void clmha_context_release(clmha_context *ctx);

/// Human message describing the calling thread's last failure of a call on this context (or a
/// layer of it). Failures in other threads neither show nor change it. A thread keeps the
/// messages of the last eight contexts on which it had a failure; the message of a context
/// beyond those reads as "".
/// @param[in] ctx  the context (may be NULL)
/// @return a NUL-terminated message, "" before the calling thread's first failure on @p ctx,
///         or a static "ctx is NULL". Never NULL. It is copied into a buffer of the calling
///         thread, valid until this thread's next call of clmha_context_last_error().
CLMHA_API const char *clmha_context_last_error(const clmha_context *ctx);

/// The context's OpenCL context.
/// @param[in] ctx  the context (may be NULL)
/// @return the cl_context, or NULL when @p ctx is NULL. Not retained for the caller: retain it
///         to keep it beyond the life of @p ctx.
CLMHA_API cl_context clmha_context_cl_context(const clmha_context *ctx);
/// The context's device.
/// @param[in] ctx  the context (may be NULL)
/// @return the cl_device_id, or NULL when @p ctx is NULL. Not retained for the caller.
CLMHA_API cl_device_id clmha_context_cl_device(const clmha_context *ctx);
/// The context's in-order command queue, on which clmha enqueues all its work. A caller may
/// enqueue on it too, e.g. to order its own commands with clmha's without events.
/// @param[in] ctx  the context (may be NULL)
/// @return the cl_command_queue, or NULL when @p ctx is NULL. Not retained for the caller:
///         retain it to keep it beyond the life of @p ctx.
CLMHA_API cl_command_queue clmha_context_cl_queue(const clmha_context *ctx);

/// Device description of the context.
/// @param[in] ctx  the context (may be NULL)
/// @return "platform name / device name", owned by the context and valid while it lives, or ""
///         when @p ctx is NULL. Never NULL.
CLMHA_API const char *clmha_context_device_name(const clmha_context *ctx);

// ---------------------------------------------------------------------------------------------
// GEMM tuning
// ---------------------------------------------------------------------------------------------

/// Progress of clmha_context_tune(): @p fraction of the budget used (0 to 1) and a one-line
/// message such as "12/40 candidates, best 85.3 GFLOP/s (Xgemm)". Called on the calling thread.
/// When clmha_tune_options::trace is set it also receives trace lines, with @p fraction -1 (the
/// bar does not move): each candidate's parameters and GFLOP/s or why it was rejected, the
/// timings in turns, the leaders timed again, the chosen XGEMM_MIN_INDIRECT_SIZE and the final
/// check, such as "[tune   42.0s] Xgemm Xgemm: GEMMK=0 ...: 61.2 80.4 GFLOP/s (6.1 s)". Their
/// wording is for people and may change. Without trace, @p fraction is always 0 to 1.
typedef void (*clmha_tune_progress_fn)(double fraction, const char *message, void *user_data);

/// A layer shape to tune for: the GEMMs of one self-attention forward pass with batch N,
/// length L, embed_dim E and H heads: the packed QKV projection (N·L, 3E, E), the output
/// projection (N·L, E, E), Q·Kᵀ (N·H × (L, L, E/H)) and A·V (N·H × (L, E/H, L)).
/// It has no struct_size: it is read as an array (clmha_tune_options::shapes), whose element
/// stride is the caller's sizeof, so its layout is frozen (a new layout would be a new type,
/// clmha_tune_shape_v2, with a new field of clmha_tune_options pointing to it).
typedef struct clmha_tune_shape {
    size_t batch;      ///< N
    size_t tgt_len;    ///< L
    size_t embed_dim;  ///< E
    size_t num_heads;  ///< H (E must be a multiple of H)
} clmha_tune_shape;

/// Options of clmha_context_tune(). Zero-initialise with struct_size set, then set what you
/// need (every field is optional):
/// @code
/// clmha_tune_options opts = CLMHA_STRUCT_INIT(clmha_tune_options);
/// opts.budget_seconds = 60;
/// @endcode
typedef struct clmha_tune_options {
    size_t struct_size;              ///< sizeof(clmha_tune_options) (see ::CLMHA_STRUCT_INIT)
    double budget_seconds;           ///< wall-clock budget; 0 = 300. Each candidate parameter
                                     ///< set costs a kernel build (about 6 s on PoCL); the final
                                     ///< check may run up to two builds past the budget.
    const clmha_tune_shape *shapes;  ///< layer shapes to tune for (at most 4); NULL: (8,128,512,8)
    size_t num_shapes;               ///< number of @ref shapes
    clmha_tune_progress_fn progress; ///< optional progress callback
    void *user_data;                 ///< passed to @ref progress
    bool no_store;                   ///< apply the result but do not write the tuning file
    bool trace;                      ///< also send trace lines to @ref progress (fraction -1);
                                     ///< the library itself never prints. Added after 0.1.0:
                                     ///< zero-initialise the whole struct.
    size_t max_candidates;           ///< each search (CLBlast's indirect kernel, its direct
                                     ///< kernel, the fused tiles, the decode split) stops after
                                     ///< this many candidates; 0: as many as the budget allows.
                                     ///< With a budget that is not reached, a run tries the same
                                     ///< candidates every time: a quick, bounded tuning.
                                     ///< Added after 0.1.0.
} clmha_tune_options;

/// What clmha_context_tune() found. GFLOP/s are medians of 5 timed calls, host clock around
/// each call (so the indirect path's pad and transpose kernels count). The library fills it:
/// the caller sets struct_size (at least up to @ref default_gflops) and at most struct_size
/// bytes are written:
/// @code
/// clmha_tune_report rep = CLMHA_STRUCT_INIT(clmha_tune_report);
/// clmha_status st = clmha_context_tune(ctx, NULL, &rep);
/// @endcode
typedef struct clmha_tune_report {
    size_t struct_size;                 ///< set by the caller: sizeof(clmha_tune_report)
    double default_gflops;              ///< sgemm 1024³ (row-major, B transposed), before tuning
    double tuned_gflops;                ///< the same with the chosen parameters
    double default_layer_gflops;        ///< first layer shape's QKV projection, before
    double tuned_layer_gflops;          ///< the same, tuned
    double default_forward_gemm_gflops; ///< all GEMMs of the layer shapes together, before
    double tuned_forward_gemm_gflops;   ///< the same, tuned
    double default_fused_gflops;        ///< fused attention stage on the first layer shape
                                        ///< (4·N·L²·E FLOPs), default tiles (0: not timed)
    double tuned_fused_gflops;          ///< the same with the chosen tiles
    size_t candidates;                  ///< parameter sets built and timed
    size_t rejected;                    ///< of those, failed to build or run, or gave wrong results
    double seconds;                     ///< length of the run
    bool improved;                      ///< faster parameters were found and applied
    bool stored;                        ///< and written to @ref path
    char layer[64];                     ///< first layer shape, "N,L,E,H"
    char parameters[640];               ///< the parameters in effect after the run, as
                                        ///< "Xgemm: GEMMK=0 ...; XgemmDirect: ...; GemmRoutine: ..."
    char path[1024];                    ///< the device's tuning file ("" when none can be named)
    char message[512];                  ///< why nothing was applied or stored ("" otherwise)
    double default_decode_ms;           ///< decode stage (one query row, N 1, the first layer
                                        ///< shape's E and H) at caches of 512 and 8192 keys,
                                        ///< the two medians summed, default split (0: not
                                        ///< timed, also where the driver's profiled times
                                        ///< are zero). Added after 0.1.0.
    double tuned_decode_ms;             ///< the same with the chosen split
} clmha_tune_report;

/// Tunes CLBlast's GEMM kernels for the device of @p ctx and the shapes clmha runs: searches the
/// parameters of the indirect kernel (`Xgemm`), of the direct kernel (`XgemmDirect`) and the
/// size where CLBlast switches between them (`GemmRoutine`'s XGEMM_MIN_INDIRECT_SIZE), timing
/// sgemm 1024³ and the GEMMs of the layer shapes. Every candidate must match a double-precision
/// CPU GEMM on the same random data (max |C - ref| / max |ref| <= 1e-4). The fastest set is
/// applied (to every context on the device in this process: CLBlast keeps parameters per
/// device) and, unless @p options says no_store, written to the device's tuning file, which
/// later contexts load when they are created:
/// `$CLMHA_TUNING_DIR/`, else `$XDG_CACHE_HOME/clmha/`, else `~/.cache/clmha/`, file
/// `<platform>--<device>.json` where every run of characters other than A-Z a-z 0-9 . _ - in
/// the platform and device names becomes one `_`. The file is written whole or not at all
/// (temporary file, then rename) and names the platform, device and driver version and the
/// CLBlast version clmha was built with: a context loads it only for that device and driver,
/// and its CLBlast parameters only with that CLBlast version (a file without the CLBlast
/// version, written by an older clmha, counts as another version: tune again). Context creation loads the stored
/// tuning of a device once per process (a missing, unreadable, corrupt or foreign file, or one
/// for another CLBlast version, is ignored: see clmha_context_tuning_note()), and a device
/// without one gets the built-in set of its class if it has one (clmha_tuning_source);
/// `CLMHA_TUNING=off` in the environment skips both.
///
/// "Before" is what was in effect when the call started: a stored tuning if one was loaded
/// (set `CLMHA_TUNING=off` before creating the context to compare with CLBlast's own
/// parameters). When nothing faster is found nothing is stored and what was in effect is put
/// back; for a device with no tuning of its own in CLBlast's database (such as PoCL) that is
/// exact, for one with an entry CLBlast's generic parameters are put back instead.
/// Last (with at least min(60 s, a fifth of the budget) kept for it), it tunes the tiles of the
/// fused attention kernel on the first layer shape (work-group size, keys per tile, query rows
/// per work-item, vector width; every candidate's forward output must match
/// clmha_reference_forward() within 1e-4 (1 + max |y|)); tiles faster than the defaults by 3%
/// or more are stored with the GEMM parameters ("FusedAttention" in the file) and used by the
/// layers whose fused kernel is built afterwards.
/// Then (with at least min(30 s, a tenth of the budget) kept for it) it tunes how the decode
/// core (calls with a KV cache) splits a cached sequence's keys into ranges: the work-items per
/// compute unit the split aims at and the fewest keys per range ("DecodeSplit" in the file,
/// ITEMS_PER_CU and MIN_KEYS; defaults 8 and 64 on CPUs, 256 and 64 on GPUs), timing one decode
/// step (N 1, one query row, E and H of the first layer shape) over caches of 512 and 8192
/// keys; every candidate's output must match clmha_reference_forward() within
/// 1e-4 (1 + max |y|), and a split 3% faster than the default over both lengths is stored.
/// `CLMHA_DECODE_PARTS` in the environment still fixes the number of ranges.
/// A context whose products run in the host BLAS (clmha_context_gemm() is ::CLMHA_GEMM_HOST)
/// never uses CLBlast's GEMM parameters: the GEMM search is skipped (the report's GEMM figures
/// are 0 and, when no faster tiles are found, its message says why) and the whole budget goes
/// to the fused tiles.
/// Do not run forward passes on the same device (from any context) while tuning: they would
/// run with the candidates' parameters.
/// @param[in]  ctx      the context whose device is tuned
/// @param[in]     options  may be NULL (300 s, shape (8, 128, 512, 8)); else its struct_size
///                         must be set
/// @param[in,out] report   may be NULL; else its struct_size must be set, and it receives at
///                         most struct_size bytes of the report
/// @return ::CLMHA_SUCCESS (also when nothing faster was found: see report->improved),
///         ::CLMHA_INVALID_ARGUMENT (also a struct_size of 0 or too small),
///         ::CLMHA_UNSUPPORTED (@p options from a newer header, using a newer field),
///         ::CLMHA_OUT_OF_MEMORY, ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_BLAS_ERROR (the GEMMs fail with the current parameters)
CLMHA_API clmha_status clmha_context_tune(clmha_context *ctx, const clmha_tune_options *options,
                                          clmha_tune_report *report);

/// Writes the tuning in effect for the device of @p ctx as JSON (the tuning file's format):
/// format, version, platform, device, driver, CLBlast version ("clblast", e.g. "1.5.3"), the
/// parameters of each tuned kernel and what was measured. With @p json NULL and @p size 0 it
/// only sets *needed (bytes, with the final NUL).
/// @param[in]  ctx     the context whose device's tuning is written
/// @param[out] json    buffer of @p size bytes (may be NULL when @p size is 0)
/// @param[in]  size    bytes @p json holds
/// @param[out] needed  bytes the JSON needs, with the final NUL (may be NULL)
/// @return ::CLMHA_SUCCESS, ::CLMHA_NOT_READY (no tuning applied on this device in this
///         process), ::CLMHA_INVALID_ARGUMENT (NULL context; buffer smaller than *needed: nothing
///         written), ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_context_tuning_export(const clmha_context *ctx, char *json,
                                                   size_t size, size_t *needed);

/// Checks a tuning in the format clmha_context_tuning_export() writes and applies it to the
/// device of @p ctx (every context on that device in this process). Kernels the JSON does not
/// name keep their parameters. Nothing is written to disk.
/// @param[in] ctx   the context whose device receives the tuning
/// @param[in] json  a NUL-terminated tuning in the export format
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL), ::CLMHA_INVALID_FILE (not JSON, not
///         a clmha tuning, unknown version or kernel, missing or invalid parameter, parameters
///         that break CLBlast's constraints or the device's limits), ::CLMHA_UNSUPPORTED (a
///         tuning for another platform, device or driver version; or one with CLBlast kernels
///         whose "clblast" version is not the one clmha was built with, or is missing),
///         ::CLMHA_BLAS_ERROR, ::CLMHA_OUT_OF_MEMORY (the tuning could not be recorded: nothing
///         applied)
CLMHA_API clmha_status clmha_context_tuning_import(clmha_context *ctx, const char *json);

/// One line saying which GEMM tuning is in effect for the device of @p ctx and why: "stored
/// tuning <path> applied", "built-in parameters for <class> applied; no stored tuning (<path>
/// not found; ...)", "no stored tuning (<path> not found; ...)", "stored tuning <path>
/// ignored: <reason>", "imported tuning applied", "tuned in this process, stored in <path>".
/// A stored file that cannot be used never makes context creation fail; this says why it was
/// ignored. Truncated to @p size bytes. clmha_context_tuning_source() says the same as a value.
/// @param[in]  ctx   the context to ask
/// @param[out] text  buffer of @p size bytes for the line (NUL-terminated)
/// @param[in]  size  bytes @p text holds
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT
CLMHA_API clmha_status clmha_context_tuning_note(const clmha_context *ctx, char *text,
                                                 size_t size);

/// Where a context's matrix products (the projections, the unfused core's batched products and
/// the backward's products) run.
///
/// On CPU devices an optimised CPU BLAS is several times faster than GEMM kernels compiled by
/// the OpenCL driver (PoCL on a 2-core AVX-512 Xeon, sgemm 1024³: oneDNN ~270 GFLOP/s, CLBlast
/// ~16 with its own parameters, ~63 tuned). The host path enqueues each product as a native
/// kernel (clEnqueueNativeKernel) that calls the host BLAS on the buffers' memory: it keeps the
/// queue order, the wait lists and events, and the device-buffer API; nothing waits on the
/// host. The host BLAS is loaded at run time (no link dependency): oneDNN (libdnnl.so.3 or .2),
/// else OpenBLAS (libopenblas.so.0), BLIS (libblis.so.4 or .3) or MKL (libmkl_rt), the first
/// found; the environment variable CLMHA_HOST_BLAS names another file, or "none".
/// Results agree with CLBlast's to float rounding (the summation order differs).
typedef enum clmha_gemm {
    /// The host path on a CPU device whose driver runs native kernels when a host BLAS loads,
    /// else CLBlast. The default; the environment variable CLMHA_GEMM (auto, clblast or host)
    /// sets a context's choice at creation.
    CLMHA_GEMM_AUTO = 0,
    CLMHA_GEMM_CLBLAST = 1,  ///< CLBlast's OpenCL kernels (every device)
    CLMHA_GEMM_HOST = 2,     ///< the host BLAS through native kernels (CPU devices only)
} clmha_gemm;

/// Chooses where the GEMMs of @p ctx run from now on. Call it before enqueuing work on the
/// context (not while another thread enqueues on it); work already enqueued is not affected.
/// @param[in] ctx   the context
/// @param[in] gemm  the path (::clmha_gemm)
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p ctx NULL, @p gemm not a
///         ::clmha_gemm), ::CLMHA_UNSUPPORTED (::CLMHA_GEMM_HOST on a device that is not a
///         CPU, whose driver runs no native kernels, or with no host BLAS: the context then
///         uses CLBlast; the message says why)
CLMHA_API clmha_status clmha_context_set_gemm(clmha_context *ctx, clmha_gemm gemm);

/// The path the GEMMs of @p ctx take now: ::CLMHA_GEMM_HOST or ::CLMHA_GEMM_CLBLAST
/// (::CLMHA_GEMM_CLBLAST for NULL).
/// @param[in] ctx  the context
/// @return the path
CLMHA_API clmha_gemm clmha_context_gemm(const clmha_context *ctx);

/// One line saying where the GEMMs of @p ctx run and why: "host BLAS oneDNN 2.6.3
/// (libdnnl.so.2) through native kernels", "CLBlast (no host BLAS: not a CPU device)",
/// "CLBlast (asked for)". A host BLAS that runs slower than it could (OpenBLAS that took the
/// CPU for an older one) adds what to do. Truncated to @p size bytes.
/// @param[in]  ctx   the context to ask
/// @param[out] text  buffer of @p size bytes for the line (NUL-terminated)
/// @param[in]  size  bytes @p text holds
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT
CLMHA_API clmha_status clmha_context_gemm_note(const clmha_context *ctx, char *text,
                                               size_t size);
/// Where the GEMM parameters in effect for a device come from (clmha_context_tuning_source()).
/// Precedence at context creation: the stored tuning file, else the built-in set of the
/// device's class, else CLBlast's own parameters.
typedef enum clmha_tuning_source {
    CLMHA_TUNING_SOURCE_CLBLAST = 0,   ///< nothing applied: CLBlast's database (its generic set
                                       ///< for a device it has no entry for, such as PoCL)
    CLMHA_TUNING_SOURCE_BUILTIN = 1,   ///< clmha's built-in set for the device's class (PoCL on
                                       ///< x86-64 with AVX-512 or AVX2, Intel's CPU runtime),
                                       ///< applied when the device has no stored tuning
    CLMHA_TUNING_SOURCE_STORED = 2,    ///< the device's tuning file, loaded at context creation
    CLMHA_TUNING_SOURCE_IMPORTED = 3,  ///< clmha_context_tuning_import()
    CLMHA_TUNING_SOURCE_TUNED = 4,     ///< clmha_context_tune() in this process
} clmha_tuning_source;

/// Where the GEMM tuning in effect for the device of @p ctx comes from (the last one applied;
/// clmha_context_tuning_note() says it in words). A built-in set is exported by
/// clmha_context_tuning_export() like any tuning in effect. `CLMHA_TUNING=off` in the
/// environment applies neither the stored tuning nor a built-in set;
/// `CLMHA_TUNING=builtin` skips the stored file (to compare the two).
/// @param[in] ctx  the context to ask
/// @return the source; ::CLMHA_TUNING_SOURCE_CLBLAST also for a NULL @p ctx
CLMHA_API clmha_tuning_source clmha_context_tuning_source(const clmha_context *ctx);

// ---------------------------------------------------------------------------------------------
// Layers
// ---------------------------------------------------------------------------------------------

/// Element type of a layer (PyTorch's `dtype=`): of its parameters, and of the query, key,
/// value, float masks, output and weights of its device forward calls. A 16-bit layer
/// (::CLMHA_DTYPE_F16, ::CLMHA_DTYPE_BF16) computes in float32 on every device: its inputs are
/// read as 16-bit values and widened, projections, scores, softmax and sums run in float32, and
/// the output and weights are rounded to the dtype once, to nearest even. Its parameters are
/// values of the dtype: clmha_layer_set_parameter() rounds the float32 values it is given to the
/// dtype (as PyTorch's `.half()` / `.bfloat16()` do) and clmha_layer_get_parameter() returns
/// those values; on the device they are held as float32 (the memory of a float32 layer).
///
/// Accuracy contract, asserted by the tests against clmha_reference_forward() in float64 on
/// the same (dtype-exact) parameters and inputs of unit scale (normal or uniform in [-1, 1],
/// weights of PyTorch's initialisation), for the output and the weights, through both cores
/// and on every driver lane: F32: max |error| <= 1e-4 (tests/device/test_golden.c,
/// test_random.c; measured errors are near 1e-6). F16 and BF16: every value y within
/// r (|y| + t) + t of the exact one, with t = 1e-5 (1 + max |y|) (the float32 computation)
/// and r = 2^-11 for F16, 2^-8 for BF16 (the final rounding: half an ulp of the dtype); and
/// the max error at most twice that of PyTorch's own computation in the dtype on PyTorch's
/// golden cases (tests/device/test_dtype.c, tests/golden/dtype_*.txt; measured on PoCL: at
/// most 0.95 of the bound, and 0.39 to 1.0 times PyTorch's error).
///
/// A 16-bit layer's KV cache holds the projected keys and values in float32 (the decode core
/// reads them as a float32 layer's); the calls' new tokens and outputs are 16-bit tensors.
/// Its backward pass (clmha_layer_backward()) reads 16-bit inputs, masks, grad_output and
/// grad_weights, widens them, runs the float32 backward (arithmetic and sums in float32, as
/// FlashAttention's 16-bit backward does) and rounds each gradient to the dtype once, to nearest
/// even (or writes it as float32 with clmha_backward_args::grad_dtype ::CLMHA_GRAD_F32, for a
/// caller who keeps float32 master weights); the state a forward call saves for it
/// (::clmha_saved) is float32. Gradient accuracy contract, asserted by tests/device/test_dtype.c
/// against clmha_reference_backward() in float64 on the same 16-bit values, both cores: every
/// gradient value g within r (|g| + t) + t of the exact one, with t = 1e-4 (1 + max |g|) of its
/// gradient (the float32 computation) and r as for the forward (the final rounding; r = 0 with
/// ::CLMHA_GRAD_F32); and, in python/tests/test_dtype_backward.py, at most twice the error of
/// PyTorch's own bfloat16 autograd on the same values against float64 autograd.
/// clmha_layer_attend() reads a 16-bit layer's 16-bit query, key, value and float masks and
/// writes float32 head tiles and log-sum-exp rows (partial results stay float32 through
/// clmha_attention_merge(), as FlashAttention's split-KV accumulators); clmha_layer_project_heads()
/// takes those float32 tiles and writes the 16-bit output, rounded once. A user attention core
/// (clmha_layer_set_attention()) of a 16-bit layer sees its float32 pass: float32 tiles, as a
/// float32 layer's.
///
/// A float64 layer (::CLMHA_DTYPE_F64, PyTorch's `.double()`) stores and computes everything in
/// float64: its parameters, tensors and scratch are doubles on the device, its matrix products
/// run in double precision (on the host path of clmha_context_set_gemm(), a host BLAS's
/// cblas_dgemm where one loads: OpenBLAS, BLIS or MKL, as oneDNN has none; else CLBlast's
/// DGEMM) and its kernels in double arithmetic. It needs a device with double precision
/// (`CL_DEVICE_DOUBLE_FP_CONFIG` not 0, i.e. `cl_khr_fp64`): elsewhere clmha_layer_create()
/// returns ::CLMHA_UNSUPPORTED. Its parameters keep doubles exactly through
/// clmha_layer_set_parameter_f64() (clmha_layer_set_parameter() widens floats); give its host
/// calls double arrays with clmha_layer_forward_host_f64(). Accuracy contract: max |error|
/// <= 1e-12 against PyTorch's float64 module on unit-scale inputs of its golden cases and
/// against clmha_reference_forward() on random ones, through both cores (tests/device/test_f64.c).
/// Its backward pass runs in float64 too (the unfused backward core, whatever core the forward
/// call ran; its saved state is doubles), device buffers of doubles or, on the host,
/// clmha_layer_backward_host_f64(): every gradient within 1e-12 relative (to 1 + its largest
/// value) of clmha_reference_backward(), and within 1e-7 of central finite differences of the
/// forward pass. A user attention core of a float64 layer gets doubles (clmha_core_args::dtype).
/// Its KV cache (::CLMHA_KV_FLOAT32, the default) holds doubles and the decode core runs in
/// float64 (the narrower kinds store as for any layer and are read into doubles); its
/// clmha_layer_attend() writes doubles, merged with clmha_attention_merge_f64(), and its
/// clmha_layer_project_heads() reads them.
///
/// clmha_reference_forward() and clmha_reference_backward() take any dtype and compute in
/// float64 on the float32 arrays they are given: to compare with a 16-bit layer, give them
/// the values rounded to its dtype (which is what the layer holds and reads).
typedef enum clmha_dtype {
    CLMHA_DTYPE_F32 = 0,  ///< float32 (the default)
    CLMHA_DTYPE_F64 = 1,  ///< float64 (`torch.float64`), float64 arithmetic, on fp64 devices
    CLMHA_DTYPE_F16 = 2,  ///< IEEE 754 binary16 (`torch.float16`), float32 arithmetic
    CLMHA_DTYPE_BF16 = 3, ///< bfloat16 (`torch.bfloat16`): the upper half of a float32
} clmha_dtype;

/// Configuration of a layer; the fields and their meaning are those of
/// `torch.nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn,
/// kdim, vdim, batch_first)`. Zero-initialise it with struct_size set, then set what you need
/// (note that zero means bias = false, where PyTorch's default is true). embed_dim and
/// num_heads are required: struct_size must cover them.
/// @code
/// clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = 512, .num_heads = 8,
///                          .bias = true};
/// @endcode
typedef struct clmha_layer_desc {
    size_t struct_size;  ///< sizeof(clmha_layer_desc) (see ::CLMHA_STRUCT_INIT)
    size_t embed_dim;    ///< E, positive and a multiple of num_heads
    size_t num_heads;    ///< H, positive; the head dimension is D = E / H
    size_t kdim;         ///< features of key; 0 means embed_dim
    size_t vdim;         ///< features of value; 0 means embed_dim
    bool bias;           ///< in_proj_bias and out_proj.bias exist (PyTorch's default is true)
    bool add_bias_kv;    ///< bias_k and bias_v exist and are appended to key and value
    bool add_zero_attn;  ///< a zero key and value are appended
    bool batch_first;    ///< batched inputs are (N, L, E) instead of (L, N, E)
    float dropout;       ///< probability in [0, 1) of zeroing an attention weight in training
    /// Grouped-query attention (PyTorch's scaled_dot_product_attention(enable_gqa=True)): the
    /// heads of the keys and values, each shared by num_heads / num_kv_heads query heads (query
    /// head h reads key/value head h / (num_heads / num_kv_heads)); 0 means num_heads (plain
    /// multi-head attention), 1 is multi-query attention; must divide num_heads. With fewer
    /// key/value heads than heads, k_proj_weight is (num_kv_heads*D, kdim), v_proj_weight
    /// (num_kv_heads*D, vdim), in_proj_bias holds E + 2*num_kv_heads*D entries (q, k, v),
    /// bias_k and bias_v num_kv_heads*D each, and there is no packed in_proj_weight.
    /// Added after 0.1.0: zero-initialise the whole struct.
    size_t num_kv_heads;
    /// Element type of the parameters, inputs and outputs (see ::clmha_dtype); 0 is float32.
    /// Added after 0.1.0, like @ref num_kv_heads.
    clmha_dtype dtype;
    /// Sliding-window attention (Mistral's and Gemma's; FlashAttention's window_size): with
    /// @ref window set, query row i, at position p_i, attends key j only when
    /// p_i − window_left ≤ j ≤ p_i + window_right; a bound of −1 leaves its side unbounded.
    /// p_i is i (top-left, as is_causal) without a KV cache and the sequence's cached length + i
    /// (bottom-right) with one. The keys appended by add_bias_kv and add_zero_attn are never
    /// windowed. The window combines with the masks and is_causal: a key must pass them all.
    /// Added after 0.1.0: a shorter or zero-initialised struct has no window. (docs/design.md,
    /// "Attention variants".)
    bool window;
    int64_t window_left;   ///< keys before the query's position it sees; −1: all of them
    int64_t window_right;  ///< keys after the query's position it sees; −1: all; 0: none
    /// Logit soft-capping (Gemma 2's; FlashAttention's softcap): with softcap = c > 0 every
    /// scaled score s, the appended keys' too, becomes c·tanh(s/c), before ALiBi and the masks.
    /// 0: off; else from FLT_MIN to FLT_MAX (the kernels take c as a float). Added after
    /// 0.1.0, like @ref window.
    double softcap;
    /// ALiBi (BLOOM's, MPT's): the score of query head h at position p_i against key j < S
    /// gains −slope_h·|p_i − j| (after soft-capping, before the masks); the appended keys get no
    /// term. slope_h is the layer's parameter "alibi_slopes" (H values), which starts as the
    /// ALiBi paper's geometric slopes (clmha_alibi_slopes()). Added after 0.1.0.
    bool alibi;
    /// Attention sinks (gpt-oss's): the layer parameter "sinks" (H values, zero at creation)
    /// adds one logit per head to each row's softmax denominator, with a zero value:
    /// P_ij = exp(s_ij − m) / (exp(sinks_h − m) + Σ_j exp(s_ij − m)), so a row's weights sum
    /// below 1 and its log-sum-exp includes the sink; a fully masked row still gives a zero
    /// result. sinks has a gradient (clmha_backward_args::sinks). Added after 0.1.0.
    bool sinks;
    /// User score and mask functions (FlexAttention's score_mod and mask_mod): OpenCL C source,
    /// NUL-terminated, compiled into the layer's attention kernels (the layer keeps a copy; NULL
    /// or "": none). It defines any of
    /// @code
    /// clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k, __global const float *p);
    /// clmha_real clmha_score_mod_grad(clmha_real s, int b, int h, int q, int k, __global const float *p);
    /// int clmha_mask_mod(int b, int h, int q, int k, __global const float *p);
    /// @endcode
    /// (clmha_real is float, double in a float64 layer). For batch item b, query head h, query
    /// position q (p_i of @ref window) and key j = k < S: clmha_score_mod gives the new score
    /// (after soft-capping and ALiBi, before the masks), clmha_score_mod_grad its derivative in
    /// s (the backward pass needs it when clmha_score_mod is defined: without it the backward is
    /// refused, ::CLMHA_UNSUPPORTED), and clmha_mask_mod non-zero where the query may attend the
    /// key. The keys appended by add_bias_kv and add_zero_attn go through neither. p is the
    /// layer's @ref mod_params_count floats (clmha_layer_set_mod_params()). Which functions the
    /// source defines is read from its text (the names outside comments); a source that does
    /// not compile makes clmha_layer_create() return ::CLMHA_BUILD_FAILED with the build log in
    /// the message. The fused cores skip the key tiles clmha_mask_mod forbids for a whole tile,
    /// from a block mask evaluated on the first call of a shape and kept until the parameters
    /// change. Added after 0.1.0.
    const char *mod_source;
    /// Initial values of the user functions' parameters p (mod_params_count floats; NULL:
    /// zeros). Read only during clmha_layer_create().
    const float *mod_params;
    size_t mod_params_count;  ///< floats in p; 0: none (p is then a valid, empty pointer)
} clmha_layer_desc;

/// The ALiBi paper's slopes for @p heads heads (what a layer with clmha_layer_desc::alibi starts
/// with): 2^(−8(h+1)/H) for H a power of two; otherwise those of the largest power of two
/// P < H, followed by every other slope of 2P (the paper's extension), H in all.
/// @param[in]  heads  H, at least 1
/// @param[out] out    room for @p heads floats
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p out NULL or @p heads 0)
CLMHA_API clmha_status clmha_alibi_slopes(size_t heads, float *out);

/// Creates a layer on @p ctx: validates the descriptor, builds the kernel programs (cached per
/// context, so only the first layer of a kind compiles) and allocates the parameter buffers
/// (zero-filled; the call waits for the fill). The layer retains the context.
/// @param[out] out   the new layer, or NULL on failure
/// @param[in]  ctx   the context to create it on
/// @param[in]  desc  the configuration; copied, with kdim and vdim of 0 replaced by embed_dim
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, struct_size 0 or too small, E or H
///         zero, E not divisible by H, dropout outside [0, 1)), ::CLMHA_UNSUPPORTED (a struct
///         from a newer header using a newer field), ::CLMHA_SIZE_OVERFLOW (parameter sizes),
///         ::CLMHA_BUILD_FAILED, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_layer_create(clmha_layer **out, clmha_context *ctx,
                                          const clmha_layer_desc *desc);

/// Frees the layer and drops its context reference. Forward passes still running keep their
/// buffers until they finish; the call does not wait for them unless it drops the context's
/// last reference (see clmha_context_release()).
/// @param[in] layer  the layer (NULL is ignored)
CLMHA_API void clmha_layer_release(clmha_layer *layer);

/// The descriptor the layer was created with.
/// @param[in]     layer  the layer
/// @param[in,out] desc   struct_size set by the caller; receives the descriptor (at most
///                       struct_size bytes; struct_size keeps its value), with kdim and vdim
///                       filled in
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p layer or @p desc NULL, struct_size 0
///         or too small; the message is in the layer's context when @p layer is not NULL)
CLMHA_API clmha_status clmha_layer_get_desc(const clmha_layer *layer, clmha_layer_desc *desc);

/// The context the layer lives on.
/// @param[in] layer  the layer (may be NULL)
/// @return the context, or NULL when @p layer is NULL. Not retained for the caller.
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
/// `out_proj_weight` and `out_proj_bias` are accepted as aliases. `q_proj_weight`,
/// `k_proj_weight` and `v_proj_weight` are the row blocks of `in_proj_weight` when that exists
/// (setting one changes it). Parameters start at zero.
/// The copy is a blocking write on the context's queue: it runs after the work already queued
/// (forward passes queued before it use the old values) and is finished when the call returns.
/// On a CPU device whose products run in the host BLAS (x86-64 with AVX-512), a float32 or 16-bit
/// layer also keeps its projection weights packed for those products in host memory (as much
/// again as the weights), updated by this call (docs/design.md, "Packed weights").
/// @param[in] layer  the layer
/// @param[in] name   the parameter's PyTorch name
/// @param[in] data   @p count floats, row-major; read only during the call
/// @param[in] count  number of floats in @p data; must equal the product of the shape
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (unknown name, parameter the layer does not
///         have, NULL), ::CLMHA_SHAPE_MISMATCH (wrong count), ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_layer_set_parameter(clmha_layer *layer, const char *name,
                                                 const float *data, size_t count);

/// Copies one parameter back to host memory (same names and shapes as
/// clmha_layer_set_parameter()). A blocking read: it waits for the work already queued.
/// @param[in]  layer  the layer
/// @param[in]  name   the parameter's PyTorch name
/// @param[out] data   room for @p count floats
/// @param[in]  count  must equal the parameter's number of floats
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (unknown name, parameter the layer does not
///         have, NULL), ::CLMHA_SHAPE_MISMATCH (wrong count), ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_layer_get_parameter(clmha_layer *layer, const char *name,
                                                 float *data, size_t count);

/// clmha_layer_set_parameter() from doubles: a float64 layer keeps them exactly; another
/// layer rounds them to its dtype (to nearest even, through float32 for the 16-bit dtypes).
/// @param[in] layer  the layer
/// @param[in] name   the parameter's PyTorch name
/// @param[in] data   @p count doubles, row-major; read only during the call
/// @param[in] count  number of doubles in @p data; must equal the product of the shape
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (unknown name, parameter the layer does not
///         have, NULL), ::CLMHA_SHAPE_MISMATCH (wrong count), ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_layer_set_parameter_f64(clmha_layer *layer, const char *name,
                                                     const double *data, size_t count);

/// clmha_layer_get_parameter() into doubles (the layer's values, widened exactly).
/// @param[in]  layer  the layer
/// @param[in]  name   the parameter's PyTorch name
/// @param[out] data   room for @p count doubles
/// @param[in]  count  must equal the parameter's number of elements
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (unknown name, parameter the layer does not
///         have, NULL), ::CLMHA_SHAPE_MISMATCH (wrong count), ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_layer_get_parameter_f64(clmha_layer *layer, const char *name,
                                                     double *data, size_t count);

/// Size of a parameter of this layer (see clmha_layer_set_parameter() for the names).
/// @param[in] layer  the layer (may be NULL)
/// @param[in] name   the parameter's PyTorch name (may be NULL)
/// @return the number of floats of parameter @p name, or 0 when the layer has no such parameter
///         or an argument is NULL
CLMHA_API size_t clmha_layer_parameter_count(const clmha_layer *layer, const char *name);

/// Replaces the parameters p of the layer's user functions (clmha_layer_desc::mod_source), a
/// blocking write after the work already queued, like clmha_layer_set_parameter(). The block
/// masks of clmha_mask_mod are evaluated again on the next call.
/// @param[in] layer   the layer
/// @param[in] params  @p count floats; read only during the call
/// @param[in] count   must equal clmha_layer_desc::mod_params_count
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, a layer without user functions),
///         ::CLMHA_SHAPE_MISMATCH (wrong count), ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_layer_set_mod_params(clmha_layer *layer, const float *params,
                                                  size_t count);

/// Reads the parameters p of the layer's user functions (clmha_layer_desc::mod_source), a
/// blocking read after the work already queued, like clmha_layer_get_parameter().
/// Added after 0.1.0.
/// @param[in]  layer   the layer
/// @param[out] params  room for @p count floats
/// @param[in]  count   must equal clmha_layer_desc::mod_params_count
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, a layer without user functions),
///         ::CLMHA_SHAPE_MISMATCH (wrong count), ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_layer_get_mod_params(clmha_layer *layer, float *params,
                                                  size_t count);

/// Sizes the layer's scratch buffers for inputs up to @p batch x @p tgt_len x @p src_len and
/// warms up the GEMMs, so that later forward calls at or below these sizes allocate nothing and
/// compile nothing: with @p need_weights, calls with and without weights; without, calls
/// without weights (through the fused core, unless the layer chose another with
/// clmha_layer_set_impl(); the scores scratch of the unfused core is then not allocated).
/// Optional: a forward call on larger inputs grows the scratch itself.
/// It runs one forward pass on zeros (self-attention when @p tgt_len == @p src_len and
/// kdim == vdim == E, else cross-attention; through the user core when one is set) and waits
/// for it to finish. Scratch that one buffer cannot hold (CL_DEVICE_MAX_MEM_ALLOC_SIZE; the
/// scores come in chunks instead) or that would bring the layer's scratch past the device's
/// global memory (CL_DEVICE_GLOBAL_MEM_SIZE) is refused with ::CLMHA_OUT_OF_MEMORY, its
/// message naming the buffer and the bytes, before it is allocated; so is a forward call's.
/// @param[in] layer         the layer
/// @param[in] batch         N, positive
/// @param[in] tgt_len       L, positive
/// @param[in] src_len       S, positive
/// @param[in] need_weights  whether later calls may ask for weights (the warm-up pass then
///                          produces averaged weights through the unfused core)
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, a zero size, @p need_weights on
///         a layer set to ::CLMHA_IMPL_FUSED), ::CLMHA_UNSUPPORTED (a layer set to
///         ::CLMHA_IMPL_FUSED where the fused core cannot be built, see ::clmha_impl),
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED,
///         ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR, ::CLMHA_CALLBACK_FAILED
CLMHA_API clmha_status clmha_layer_bake(clmha_layer *layer, size_t batch, size_t tgt_len,
                                        size_t src_len, bool need_weights);

/// Device scratch the layer currently holds (it grows on demand and never shrinks): that of its
/// forward calls and of its backward calls (which work in the same buffers, plus the backward
/// core's own: the fused core's row sums, the unfused core's score gradients), and the device
/// copies of the tensors of its host-array calls (clmha_layer_forward_host(),
/// clmha_layer_backward_host(): kept between calls, let go when such a call fails). The saved
/// state of forward calls is not the layer's: see clmha_saved_bytes().
/// @param[in] layer  the layer (may be NULL)
/// @return the size in bytes, 0 for NULL
CLMHA_API size_t clmha_layer_scratch_bytes(const clmha_layer *layer);

// ---------------------------------------------------------------------------------------------
// Layer files (.safetensors with PyTorch's names)
// ---------------------------------------------------------------------------------------------

/// Creates a layer from a `.safetensors` file whose tensors are named and shaped as
/// `nn.MultiheadAttention.state_dict()` gives them (`in_proj_weight` or
/// `q_proj_weight`/`k_proj_weight`/`v_proj_weight`, `in_proj_bias`, `out_proj.weight`,
/// `out_proj.bias`, `bias_k`, `bias_v`, and clmha's `alibi_slopes` (H) of an ALiBi layer and
/// `sinks` (H), whose presence makes a layer with attention sinks (clmha_layer_desc::sinks; no
/// metadata key); any other tensor is refused), F32, F16, BF16 or F64
/// (converted to float). The layer is float32; clmha_layer_load_as() chooses its dtype. The file's `__metadata__` gives `num_heads` (required), `batch_first`,
/// `add_zero_attn` ("true"/"false", default false), `dropout` (default 0), `window`
/// ("LEFT,RIGHT", e.g. "1023,0": a sliding window, clmha_layer_desc::window_left and
/// window_right, each -1 or at least 0; absent: no window), `softcap` (a decimal number, 0 or
/// from FLT_MIN to FLT_MAX: clmha_layer_desc::softcap; absent or "0": off) and `alibi`
/// ("true"/"false", default false: clmha_layer_desc::alibi; the tensor `alibi_slopes`, only
/// with alibi, sets the slopes, else they stay geometric); embed_dim, kdim, vdim, bias and
/// add_bias_kv follow from the tensors present and their shapes. The parameters are copied
/// before the call returns.
///
/// The file must be well formed as the safetensors format requires: the tensors' data_offsets,
/// sorted, cover the data section exactly (from byte 0, without overlap or hole, up to the end
/// of the file), no JSON object of the header has a key twice (tensor names, `__metadata__`
/// keys, the keys of a tensor entry), and shapes and offsets are JSON integers (read exactly,
/// also above 2^53). `dropout` is checked on its decimal value, then on the float the layer
/// keeps (a value below 1 that rounds to 1.0f is refused as such).
/// Limits, so that a hostile file costs little: the header (the JSON text, padding included)
/// is at most 256 KiB, refused from its length before it is read (a layer's header is under
/// 2 KiB: at most 11 tensor entries and a few metadata strings; the rest is room for free-form
/// metadata), and it has at most 11 tensor entries (one per parameter name above).
/// @param[out] out   the new layer, or NULL on failure
/// @param[in]  ctx   the context to create it on
/// @param[in]  path  the file's path
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT, ::CLMHA_IO_ERROR (cannot open or read),
///         ::CLMHA_INVALID_FILE (malformed file, missing or inconsistent tensors or metadata; the
///         message names the file and the culprit), ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY,
///         and the statuses of clmha_layer_create() and clmha_layer_set_parameter()
CLMHA_API clmha_status clmha_layer_load(clmha_layer **out, clmha_context *ctx, const char *path);

/// clmha_layer_load() into a layer of dtype @p dtype (see ::clmha_dtype): the file's values,
/// whatever its tensors' dtype, are rounded to @p dtype, as PyTorch's `load_state_dict()` into
/// a module of that dtype does. Added after 0.1.0.
/// @param[out] out    the new layer, or NULL on failure
/// @param[in]  ctx    the context to create it on
/// @param[in]  path   the file's path
/// @param[in]  dtype  the layer's dtype
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also an unknown @p dtype),
///         ::CLMHA_IO_ERROR, ::CLMHA_INVALID_FILE, ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY,
///         ::CLMHA_UNSUPPORTED (::CLMHA_DTYPE_F64 on a device without double precision), and the statuses of
///         clmha_layer_create() and clmha_layer_set_parameter()
CLMHA_API clmha_status clmha_layer_load_as(clmha_layer **out, clmha_context *ctx,
                                           const char *path, clmha_dtype dtype);

/// What clmha_layer_load_prefixed() does with ::clmha_load_options::batch_first. Added after
/// 0.1.0.
typedef enum clmha_batch_first {
    CLMHA_BATCH_FIRST_AUTO = 0,  ///< the file's `__metadata__` batch_first; without one, true for
                                 ///< the name sets of batch-first modules (continuiti's, the
                                 ///< w_q/w_k/w_v/w_concat module), false for PyTorch's names
    CLMHA_BATCH_FIRST_NO = 1,    ///< false, whatever the file says
    CLMHA_BATCH_FIRST_YES = 2,   ///< true, whatever the file says
} clmha_batch_first;

/// Options of clmha_layer_load_prefixed(). Zero-initialise with struct_size set
/// (CLMHA_STRUCT_INIT(clmha_load_options)): every field's zero is clmha_layer_load()'s
/// behaviour. Added after 0.1.0.
typedef struct clmha_load_options {
    size_t struct_size;  ///< sizeof(clmha_load_options) (see ::CLMHA_STRUCT_INIT)
    /// NULL or "": every tensor of the file belongs to the layer. Else only the tensors whose
    /// names start with it, the prefix stripped (a prefix that does not end in '.' gets one:
    /// "encoder.layers.0.self_attn" picks `encoder.layers.0.self_attn.in_proj_weight`, ...);
    /// the file's other tensors are ignored, so one attention module is picked out of a whole
    /// model's checkpoint (`safetensors.torch.save_file(model.state_dict(), path)`).
    const char *prefix;
    /// 0: the file's `__metadata__` num_heads (required there). Else the number of heads: a
    /// file whose metadata has num_heads must agree with it.
    size_t num_heads;
    clmha_dtype dtype;            ///< the layer's dtype, as in clmha_layer_load_as() (0: float32)
    clmha_batch_first batch_first;  ///< see ::clmha_batch_first (0: from the file)
} clmha_load_options;

/// clmha_layer_load() with options: a prefix that picks one attention module out of a file
/// holding a whole model, the number of heads for files without `num_heads` metadata, the
/// layer's dtype and batch_first. Added after 0.1.0.
///
/// Three name sets are recognised from the tensors present (after the prefix is stripped):
/// - `nn.MultiheadAttention`'s (see clmha_layer_load());
/// - continuiti's `MultiHeadAttention`: `query_project.weight`, `key_project.weight`,
///   `value_project.weight`, `out_project.weight`, (E, E), and with bias `query_project.bias`,
///   `key_project.bias`, `value_project.bias`, `out_project.bias`, (E), all four or none;
/// - the classic split-heads module: `w_q.weight`, `w_k.weight`, `w_v.weight`,
///   `w_concat.weight` and their `.bias`, named and shaped likewise.
///
/// The last two load as q_proj_weight, k_proj_weight, v_proj_weight, out_proj.weight and, with
/// bias, in_proj_bias (the three input biases, concatenated) and out_proj.bias; both modules
/// compute what `nn.MultiheadAttention` with those parameters computes, batch first. A file
/// that mixes two name sets, or holds (under the prefix, or at all without one) a tensor that
/// none of them has, is refused naming the tensors; `alibi_slopes` and `sinks` go with any of
/// them.
/// Metadata (num_heads, batch_first, add_zero_attn, dropout, window, softcap, alibi) is read as
/// clmha_layer_load() reads it, from the file's `__metadata__`, whatever the prefix.
///
/// Limits: without a prefix those of clmha_layer_load(). With a prefix a file may hold a whole
/// model: a header of at most 8 MiB with at most 65536 tensor entries and at most 1048576
/// JSON values in all (counted on the text before it is parsed, so that parsing a hostile
/// header costs at most about 100 MB and a fraction of a second), of which the layer takes at
/// most 9; the whole file is read.
///
/// A file written by `torch.save` (a zip archive, or a pickle) is refused with
/// ::CLMHA_INVALID_FILE and a message that says how to convert it.
/// @param[out] out      the new layer, or NULL on failure
/// @param[in]  ctx      the context to create it on
/// @param[in]  path     the file's path
/// @param[in]  options  NULL: as clmha_layer_load(); else its struct_size must be set
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also an unknown dtype or batch_first, a
///         struct_size that is 0 or too large), ::CLMHA_UNSUPPORTED (a newer struct that sets a
///         field this library does not have, or ::CLMHA_DTYPE_F64 on a device without double
///         precision), ::CLMHA_IO_ERROR, ::CLMHA_INVALID_FILE (also: no num_heads in the
///         options or the metadata, num_heads that disagrees with the metadata, a prefix that
///         matches no tensor: the message lists prefixes the file has), ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_OUT_OF_MEMORY, and the statuses of clmha_layer_create() and
///         clmha_layer_set_parameter()
CLMHA_API clmha_status clmha_layer_load_prefixed(clmha_layer **out, clmha_context *ctx,
                                                 const char *path,
                                                 const clmha_load_options *options);

/// Writes the layer to @p path in the format clmha_layer_load() reads (F32 tensors, F64 for a
/// float64 layer; metadata with num_heads, batch_first, add_zero_attn and dropout;
/// num_kv_heads, window, softcap, alibi and mod_source (the user functions' source) for a
/// layer that has them, and then the tensors alibi_slopes, sinks and mod_params (p) of a layer
/// that has them). The file appears whole or not at all (written to a temporary file in the
/// same folder, then renamed; a file it replaces keeps its permissions). Reading the parameters
/// waits for the work already queued.
/// @param[in] layer  the layer
/// @param[in] path   the file's path (not empty)
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also a mod_source that is not UTF-8 or
///         too long for a layer file's 256 KiB header), ::CLMHA_IO_ERROR, ::CLMHA_OUT_OF_MEMORY,
///         ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_layer_save(clmha_layer *layer, const char *path);

// ---------------------------------------------------------------------------------------------
// Forward pass
// ---------------------------------------------------------------------------------------------

/// How a mask's values are read. Boolean masks are one byte per element (0 or non-zero). Each
/// mask becomes an additive term (0 or -inf for boolean masks); key_padding_mask, attn_mask and
/// is_causal may be combined, and their terms add up.
typedef enum clmha_mask_kind {
    CLMHA_MASK_NONE = 0,      ///< no mask
    CLMHA_MASK_BOOL_IGNORE,   ///< non-zero = may NOT attend (nn.MultiheadAttention's bool masks)
    CLMHA_MASK_BOOL_ATTEND,   ///< non-zero = MAY attend (scaled_dot_product_attention, continuiti)
    CLMHA_MASK_FLOAT,         ///< float32, added to the scaled scores (-INFINITY forbids)
} clmha_mask_kind;

/// A dense row-major tensor. The device forward reads @ref buffer at element offset
/// @ref offset; the host forward and the CPU reference read @ref data.
typedef struct clmha_tensor {
    size_t ndim;          ///< number of dimensions: 2 or 3 for inputs, 1 to 3 for masks, 0 for
                          ///< an absent key, value or mask
    size_t shape[4];      ///< sizes, outermost first, as PyTorch prints them (the first ndim)
    cl_mem buffer;        ///< device forward: the buffer holding the tensor, of the layer's
                          ///< cl_context
    size_t offset;        ///< device forward: offset in elements (floats or bytes for bool masks)
    const void *data;     ///< host forward: pointer to the first element, read during the call
} clmha_tensor;

/// A mask: a kind and a tensor.
///
/// key_padding_mask: (N, S), or (S) for unbatched inputs.
/// attn_mask: (L, S) shared by every batch and head; (N*H, L, S) per batch and head; or, with
/// @ref per_batch set, (N, L, S) shared by the heads of each batch item (continuiti's layout).
/// Unbatched inputs take (L, S) or (H, L, S).
/// Masks cover the first S keys; the keys appended by add_bias_kv and add_zero_attn are never
/// masked.
typedef struct clmha_mask {
    clmha_mask_kind kind; ///< how the values are read; ::CLMHA_MASK_NONE: no mask (tensor.ndim
                          ///< must be 0 and per_batch false)
    bool per_batch;       ///< attn_mask only: 3-D mask is (N, L, S), repeated for every head
    clmha_tensor tensor;  ///< the values: bytes for boolean kinds, floats for ::CLMHA_MASK_FLOAT
} clmha_mask;

/// Dropout randomness: weight (n, h, i, j) is dropped when the first word of
/// Philox4x32-10(counter = {j, i, n*H + h, offset low 32 bits},
///               key = {seed low 32 bits, seed high 32 bits XOR offset high 32 bits})
/// divided by 2^32 is below p; kept weights are scaled by 1/(1 - p). Same seed and offset:
/// same result on every device and in clmha_reference_forward() (not the same as PyTorch's
/// generator).
typedef struct clmha_dropout_rng {
    uint64_t seed;    ///< the Philox key
    uint64_t offset;  ///< part of the counter: change it (e.g. add 1 per call) for a new pattern
} clmha_dropout_rng;

struct clmha_core_args;

/// A user-supplied attention core (continuiti's `attention` argument), set with
/// clmha_layer_set_attention(). It replaces the scores, masks/softmax/dropout and weights·V
/// stages: it receives the projected, head-split device buffers and must enqueue work on
/// `args->queue` that fills `out` (and `weights` when not NULL), applying the masks, is_causal
/// and dropout itself if it wants them. It is called synchronously, once per forward call
/// (including the one of clmha_layer_bake()), on the calling thread; it may block. It may
/// store an event for its work in `*args->event` (clmha releases it; the in-order queue orders
/// what follows anyway) or leave it NULL. @p args and the masks it points to are valid only
/// during the call; its buffers belong to the layer (do not release them).
/// @param[in] args       the buffers and sizes of this call
/// @param[in] user_data  the pointer given to clmha_layer_set_attention()
/// @return ::CLMHA_SUCCESS, or any other status to abort the forward pass, which then returns
///         ::CLMHA_CALLBACK_FAILED (work the core already enqueued stays queued)
typedef clmha_status (*clmha_attention_fn)(const struct clmha_core_args *args, void *user_data);

/// Which attention core computes softmax(QKᵀ/√D + masks)·V.
///
/// clmha has three built-in cores, and the caller may add one. A forward call with a KV cache
/// (clmha_forward_args::kv_cache) always runs the decode core, whatever its impl (it must be
/// ::CLMHA_IMPL_AUTO; see ::clmha_kv_cache for what such a call may not take). A layer with a
/// user core (clmha_layer_set_attention()) runs it on every other call, whatever the impl. The
/// other calls run the fused or the unfused core, as chosen here; the backward pass
/// (clmha_layer_backward()) has its own fused and unfused cores, chosen by
/// clmha_backward_args::impl.
///
/// The unfused core writes the scores of every (batch, head) to device memory (N·H·L·S' floats)
/// and runs a GEMM, a softmax kernel and a second GEMM over them; it is the one that can return
/// attention weights. When the scores exceed half the device's largest allocation
/// (clmha_device_info::max_alloc_bytes; the other half leaves room for CLBlast's padded
/// copies), it works through them in chunks that fit: groups of whole (batch, head) planes, or
/// groups of query rows of one plane when a plane alone is too large. The results are the same
/// (weights included, written chunk by chunk; averaged weights may differ in the last bits, as
/// the head sum is then done in parts); its scores scratch is one chunk; it runs more, smaller
/// GEMMs; and with profiling its three stages and the weights output are timed together as
/// ::CLMHA_STAGE_SCORES. The fused core streams tiles of keys through local memory with an online
/// softmax and never stores the scores: its scratch is linear in the sequence lengths, it skips
/// the key tiles that is_causal masks entirely, and it is faster on long sequences; it cannot
/// return weights. Both apply every mask kind, is_causal and dropout the same way (dropout
/// drops exactly the same weights in both for the same ::clmha_dropout_rng) and give zeros for
/// a fully masked query row. A user core (clmha_layer_set_attention()) replaces both; the
/// decode core replaces both on the calls with a KV cache (split-K: each sequence's cached keys
/// cut into ranges scored in parallel and merged).
///
/// The fused kernel is built with the largest tiles that the built kernel allows
/// (CL_KERNEL_WORK_GROUP_SIZE, CL_KERNEL_LOCAL_MEM_SIZE). Where it cannot be built at all
/// (local memory too small for one key), ::CLMHA_IMPL_AUTO runs the unfused core and
/// ::CLMHA_IMPL_FUSED returns ::CLMHA_UNSUPPORTED. On a driver with a known bug that would make
/// the fused core wrong on a call (clmha_device_note(): Mesa's llvmpipe ends loops after 65535
/// iterations), that call runs the unfused core, also with ::CLMHA_IMPL_FUSED.
typedef enum clmha_impl {
    CLMHA_IMPL_AUTO = 0,  ///< fused when the call does not ask for weights and the device can
                          ///< run it, else unfused; on a CPU device with the host BLAS path
                          ///< and AVX-512 or AVX2, a call without masks but is_causal or
                          ///< a boolean key_padding_mask (not both), without variants or
                          ///< dropout, of head dimension 64, with at least 128
                          ///< query rows and 128 keys (32 and 32 without AVX-512), runs the
                          ///< fused computation in C on the CPU (::CLMHA_IMPL_FUSED: the
                          ///< OpenCL kernel)
    CLMHA_IMPL_FUSED,     ///< the fused core (a call with need_weights is refused)
    CLMHA_IMPL_UNFUSED,   ///< the unfused core
} clmha_impl;

/// Sets the attention core that forward calls of @p layer use when their
/// clmha_forward_args::impl is ::CLMHA_IMPL_AUTO (the default: ::CLMHA_IMPL_AUTO).
/// @param[in] layer  the layer
/// @param[in] impl   ::CLMHA_IMPL_AUTO, ::CLMHA_IMPL_FUSED or ::CLMHA_IMPL_UNFUSED
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p layer NULL, @p impl not one of these)
CLMHA_API clmha_status clmha_layer_set_impl(clmha_layer *layer, clmha_impl impl);

/// The name of @p impl: "auto", "fused", "unfused"; "?" for other values. A static string.
/// @param[in] impl  the value
/// @return the name
CLMHA_API const char *clmha_impl_name(clmha_impl impl);

/// Arguments of one forward call. Zero-initialise with struct_size set, then set what you
/// need; query is required (struct_size must cover it). Read only during the call.
/// @code
/// clmha_forward_args args = {.struct_size = sizeof args,
///                            .query = {.ndim = 3, .shape = {L, N, E}, .data = x}};
/// @endcode
/// The embedded structs (::clmha_tensor, ::clmha_mask, ::clmha_dropout_rng) have no size of
/// their own: their layout is frozen.
typedef struct clmha_forward_args {
    size_t struct_size;            ///< sizeof(clmha_forward_args) (see ::CLMHA_STRUCT_INIT)
    clmha_tensor query;            ///< (L, N, E), (N, L, E) with batch_first, or (L, E)
    clmha_tensor key;              ///< (S, N, kdim) likewise; ndim 0 = same as query
                                   ///< (self-attention; needs kdim == vdim == E)
    clmha_tensor value;            ///< (S, N, vdim) likewise; ndim 0 = same as key (needs
                                   ///< kdim == vdim); must be 0 when key is
    clmha_mask key_padding_mask;   ///< optional: (N, S), or (S) unbatched
    clmha_mask attn_mask;          ///< optional: (L, S), (N*H, L, S), per_batch (N, L, S); see
                                   ///< ::clmha_mask
    bool is_causal;                ///< forbid key j > query i (top-left aligned), built on device;
                                   ///< adds to attn_mask when both are given
    bool need_weights;             ///< also return attention weights (PyTorch's default is true)
    bool per_head_weights;         ///< weights per head (N, H, L, S'); else averaged (N, L, S')
                                   ///< (PyTorch's average_attn_weights = not per_head_weights)
    bool training;                 ///< apply the layer's dropout (PyTorch's train())
    clmha_dropout_rng rng;         ///< used when training and dropout > 0
    clmha_impl impl;               ///< attention core for this call; ::CLMHA_IMPL_AUTO (0):
                                   ///< the layer's choice (clmha_layer_set_impl())
    struct clmha_saved *save;      ///< optional: keep what clmha_layer_backward() needs in this
                                   ///< object (see ::clmha_saved); NULL: nothing is kept. Added
                                   ///< after 0.1.0: zero-initialise the whole struct.
    struct clmha_kv_cache *kv_cache;  ///< optional: incremental decoding through this cache
                                      ///< (see ::clmha_kv_cache): the new key/value tokens are
                                      ///< appended to it and the queries attend over all it
                                      ///< holds. Added after 0.1.0, like @ref save.
    const size_t *kv_append;       ///< with kv_cache set: N counts (1 unbatched), how many of
                                   ///< each sequence's S new key/value tokens (the first ones)
                                   ///< to append; NULL: all S of every sequence
    bool kv_attend_only;           ///< with kv_cache set: append nothing, attend over the cache
                                   ///< as it is (cross-attention decoding once the keys are in);
                                   ///< key and value must then be absent (ndim 0)
    /// Partial attention (clmha_layer_attend()) only, 0 elsewhere: the sequence positions of
    /// this call's first query row and first key, so that a range of keys (and a block of
    /// queries) sees the positions it has in the whole sequence: query row i is at
    /// query_position + i and key j at key_position + j for is_causal, the sliding window,
    /// ALiBi and the user functions. Added after 0.1.0: zero-initialised, both 0.
    size_t query_position;
    size_t key_position;    ///< the first key's position; see @ref query_position
    /// A packed variable-length batch (PyTorch's NestedTensor, FlashAttention's varlen):
    /// @ref num_seqs sequences one after another, query (T, E) with T the sum of seq_lens and
    /// key/value (T_kv, kdim) / (T_kv, vdim) with T_kv the sum of kv_seq_lens (both 2-D; the
    /// output is (T, E) likewise). Each sequence attends only within itself, as one unbatched
    /// call of its own would: is_causal, the layer's attention variants, dropout, grouped-query
    /// attention, every dtype and the backward pass (the call's clmha_saved keeps every
    /// sequence's state) work as there, and the projections run over the T real tokens only.
    /// Refused (masks have no per-sequence shape, the weights none either, as in PyTorch's fast
    /// path): key_padding_mask, attn_mask, need_weights, kv_append. A sequence without queries
    /// is skipped (nothing to compute); one with queries but no keys is refused (S = 0). With
    /// dropout, sequence i draws its weights as an unbatched call with rng.offset + i * 2^32.
    /// With kv_cache (num_seqs = the cache's batch), sequence i appends its kv_seq_lens[i]
    /// keys and values (as kv_append would) and its queries attend over its cached tokens.
    /// NULL: not packed. Added after 0.1.0: zero-initialised, not packed.
    const size_t *seq_lens;
    const size_t *kv_seq_lens;  ///< num_seqs key/value lengths; NULL: seq_lens
    size_t num_seqs;            ///< the sequences of a packed call (at least 1)
} clmha_forward_args;

/// What a user attention core receives. Layouts: q (N*H, L, D), k and v (N*H, S', D) (with
/// grouped-query attention every query head gets its own copy of its key/value head), out
/// (N*H, L, D), weights (N*H, L, S'), row-major, element offset 0; S' = S + add_bias_kv +
/// add_zero_attn. q, k, v and out are the layer's scratch buffers (they may be larger than the
/// tiles); weights is the layer's scores buffer. The masks are the caller's, unchanged
/// (they cover the first S keys; the appended keys are never masked). `scale` = 1/sqrt(D).
/// The library sets struct_size to its sizeof(clmha_core_args); fields are only ever appended,
/// so a core built against a newer header checks struct_size before it reads a field that
/// this header does not have, e.g.
/// `args->struct_size >= offsetof(clmha_core_args, event) + sizeof args->event`.
typedef struct clmha_core_args {
    size_t struct_size;      ///< set by the library: sizeof(clmha_core_args) in its build
    cl_command_queue queue;  ///< the context's in-order queue: enqueue the work here
    /// @var batch
    /// N, the batch size (1 for unbatched inputs).
    /// @var num_heads
    /// H, the number of heads.
    /// @var tgt_len
    /// L, the target (query) length.
    /// @var src_len
    /// S, the source length of the caller's key and value (the masks' last dimension).
    /// @var src_len_padded
    /// S' = S + add_bias_kv + add_zero_attn, the keys in k and v.
    /// @var head_dim
    /// D = E / H.
    size_t batch, num_heads, tgt_len, src_len, src_len_padded, head_dim;
    float scale;             ///< 1/sqrt(D), the factor of the scores q·kᵀ
    /// @var q
    /// Queries (N*H, L, D), in_proj_bias added.
    /// @var k
    /// Keys (N*H, S', D), in_proj_bias added, then bias_k and a zero row when the layer has them.
    /// @var v
    /// Values (N*H, S', D), like @ref k with bias_v.
    /// @var out
    /// Where the core writes the attention result (N*H, L, D), weights·V.
    /// @var weights
    /// Where the core writes the attention weights (N*H, L, S'), after masks, softmax and
    /// dropout, when the call wants weights (clmha then copies or averages them); else NULL.
    cl_mem q, k, v, out, weights;
    const clmha_mask *key_padding_mask;  ///< the caller's key_padding_mask; its tensor.buffer
                                         ///< is on the device also for the host-array forward
    const clmha_mask *attn_mask;         ///< the caller's attn_mask, likewise
    bool is_causal;                      ///< the caller's is_causal
    bool training;                       ///< the caller's training flag
    float dropout;                       ///< the layer's dropout probability p
    clmha_dropout_rng rng;               ///< the caller's dropout randomness
    cl_uint num_wait;                    ///< number of events in wait_list (0 at present)
    const cl_event *wait_list;           ///< events the work must wait for (NULL at present)
    cl_event *event;                     ///< where the core may store an event for its work,
                                         ///< which clmha releases; never NULL
    /// The elements of q, k, v, out and weights (and of float masks' tensors):
    /// ::CLMHA_DTYPE_F32, floats (float32 and 16-bit layers: theirs is the float32 pass), or
    /// ::CLMHA_DTYPE_F64, doubles (a float64 layer). Added after 0.1.0: a core that reads
    /// floats must refuse the other (return ::CLMHA_UNSUPPORTED).
    clmha_dtype dtype;
    double scale_f64;  ///< @ref scale in double precision (a float64 layer's core uses it)
} clmha_core_args;

/// Replaces the attention core of @p layer (see ::clmha_attention_fn). Applies to later
/// forward calls.
/// @param[in] layer      the layer
/// @param[in] fn         the core, or NULL to restore the built-in one
/// @param[in] user_data  passed to @p fn on every call (ignored when @p fn is NULL); must stay
///                       valid while @p fn is set
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p layer NULL)
CLMHA_API clmha_status clmha_layer_set_attention(clmha_layer *layer, clmha_attention_fn fn,
                                                 void *user_data);

/// Output sizes in floats for @p args. Validates the shapes and masks of @p args like a forward
/// call, but neither buffers nor data pointers.
/// @param[in]  layer          the layer
/// @param[in]  args           the call's arguments
/// @param[out] output_count   N·L·E (L·E unbatched): the attention output (may be NULL)
/// @param[out] weights_count  0 without need_weights, else N·L·S' averaged or N·H·L·S' per head
///                            (may be NULL)
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also args->struct_size 0 or too small),
///         ::CLMHA_UNSUPPORTED (@p args from a newer header, using a newer field),
///         ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK, ::CLMHA_SIZE_OVERFLOW
CLMHA_API clmha_status clmha_layer_output_counts(clmha_layer *layer,
                                                 const clmha_forward_args *args,
                                                 size_t *output_count, size_t *weights_count);

/// Enqueues the forward pass on device buffers. Inputs are read from the `buffer` fields of
/// @p args; the result goes to @p output (element offset @p output_offset), shaped like the
/// query with E features; the weights (when need_weights) to @p weights: (N, L, S') averaged,
/// (N, H, L, S') per head, or (L, S') / (H, L, S') unbatched.
/// Every tensor argument must be a buffer (CL_MEM_OBJECT_BUFFER, not an image). With a bias,
/// @p output must not be CL_MEM_WRITE_ONLY (the output projection accumulates onto the bias
/// rows); @p output and @p weights must not be CL_MEM_READ_ONLY. As in PyTorch (an `out=`
/// tensor must not alias an input), the bytes of @p output and @p weights must not overlap each
/// other or those of any input or mask (sub-buffers count as parts of their parent buffer);
/// inputs may share bytes.
/// The call never waits on the host: it waits for @p wait_list on the device and returns an
/// event for the completion in @p event (may be NULL; the caller releases it). The buffers must
/// stay unchanged (inputs) and unread (outputs) until that event completes. It may allocate
/// scratch (see clmha_layer_bake()).
/// Elements are those of the layer's dtype (::clmha_dtype): for a 16-bit layer, query, key,
/// value, float masks, @p output and @p weights hold 16-bit values (`half` or bfloat16), and
/// every offset and count here counts those elements; boolean masks stay bytes. Such a call
/// also keeps float32 copies of its tensors in the layer's scratch.
/// @param[in]  layer           the layer
/// @param[in]  args            the inputs and options; the struct is read only during the call
/// @param[out] output          buffer of the layer's cl_context holding at least
///                             @p output_offset + output_count elements
///                             (clmha_layer_output_counts())
/// @param[in]  output_offset   element offset of the result in @p output
/// @param[out] weights         buffer for the weights, like @p output; ignored (may be NULL)
///                             without need_weights
/// @param[in]  weights_offset  element offset of the weights in @p weights
/// @param[in]  num_wait        number of events in @p wait_list
/// @param[in]  wait_list       events of the layer's cl_context that the pass waits for on the
///                             device (NULL when @p num_wait is 0). An event that has already
///                             failed (negative CL_EVENT_COMMAND_EXECUTION_STATUS) is refused:
///                             the call returns ::CLMHA_OPENCL_ERROR and enqueues nothing (a
///                             command waiting for a failed event never runs, and would hold up
///                             every later command on the in-order queue). An event that fails
///                             after the call: the pass does not run and its @p event reports a
///                             negative status; PoCL 3.1 also fails every command enqueued on
///                             the queue after it (and aborted the process in
///                             pocl_update_event_failed() when the failing event was a user
///                             event that a clmha pass waited for). Check your events before
///                             passing them.
/// @param[out] event           optional: a new event that completes with the pass; NULL on
///                             failure
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also for a buffer that is NULL, of
///         another context, too small, an image, write-only or read-only or overlapping as
///         above, for @p num_wait and @p wait_list disagreeing, for an invalid event or one of
///         another context in @p wait_list, and for args->struct_size 0 or too small),
///         ::CLMHA_UNSUPPORTED (@p args from a newer header, using a newer field;
///         ::CLMHA_IMPL_FUSED where the fused core cannot be built, see ::clmha_impl),
///         ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED,
///         ::CLMHA_OPENCL_ERROR (also for a failed event in @p wait_list), ::CLMHA_BLAS_ERROR,
///         ::CLMHA_CALLBACK_FAILED
CLMHA_API clmha_status clmha_layer_forward(clmha_layer *layer, const clmha_forward_args *args,
                                           cl_mem output, size_t output_offset, cl_mem weights,
                                           size_t weights_offset, cl_uint num_wait,
                                           const cl_event *wait_list, cl_event *event);

/// The host-array path: uploads the tensors given by the `data` fields of @p args, runs the
/// forward pass, waits for the context's queue to finish (clFinish) and downloads the results.
/// The arrays are written only once the whole pass has finished, the output and the weights
/// both or (a call that fails) neither. Shapes as for clmha_layer_forward(). The uploads go into device buffers the layer keeps between calls
/// (grown to the largest call, counted in clmha_layer_scratch_bytes()), so a repeated call
/// allocates nothing and costs its copies in and out only.
/// The arrays are float32 whatever the layer's dtype: a 16-bit layer's call rounds the inputs
/// and float masks to its dtype (to nearest even) before it uploads them as 16-bit tensors,
/// and its results are the dtype's values, widened exactly (the device call's, bit for bit).
/// @param[in]  layer          the layer
/// @param[in]  args           the inputs and options (the `buffer` fields are ignored)
/// @param[out] output         room for @p output_count floats
/// @param[in]  output_count   must equal the output count of clmha_layer_output_counts()
/// @param[out] weights        room for @p weights_count floats with need_weights, else ignored
///                            (may be NULL)
/// @param[in]  weights_count  must equal the weights count of clmha_layer_output_counts()
///                            (0 without need_weights)
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also for a missing `data` pointer or
///         array, and for args->struct_size 0 or too small), ::CLMHA_UNSUPPORTED (@p args from
///         a newer header, using a newer field; ::CLMHA_IMPL_FUSED where the fused core cannot
///         be built), ::CLMHA_SHAPE_MISMATCH (also for a wrong count), ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED,
///         ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR, ::CLMHA_CALLBACK_FAILED
CLMHA_API clmha_status clmha_layer_forward_host(clmha_layer *layer,
                                                const clmha_forward_args *args, float *output,
                                                size_t output_count, float *weights,
                                                size_t weights_count);

/// clmha_layer_forward_host() on double arrays: the `data` of the query, key, value and float
/// masks are doubles (boolean masks bytes, as always), and the results are written as
/// doubles. A float64 layer reads and writes them exactly; another layer rounds the inputs to
/// its dtype and widens its results exactly.
/// @param[in]  layer          the layer
/// @param[in]  args           the inputs and options (the `buffer` fields are ignored)
/// @param[out] output         room for @p output_count doubles
/// @param[in]  output_count   must equal the output count of clmha_layer_output_counts()
/// @param[out] weights        room for @p weights_count doubles with need_weights, else ignored
///                            (may be NULL)
/// @param[in]  weights_count  must equal the weights count of clmha_layer_output_counts()
///                            (0 without need_weights)
/// @return ::CLMHA_SUCCESS and the failures of clmha_layer_forward_host():
///         ::CLMHA_INVALID_ARGUMENT, ::CLMHA_UNSUPPORTED, ::CLMHA_SHAPE_MISMATCH,
///         ::CLMHA_INVALID_MASK, ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY,
///         ::CLMHA_BUILD_FAILED, ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR,
///         ::CLMHA_CALLBACK_FAILED
CLMHA_API clmha_status clmha_layer_forward_host_f64(clmha_layer *layer,
                                                    const clmha_forward_args *args,
                                                    double *output, size_t output_count,
                                                    double *weights, size_t weights_count);

// ---------------------------------------------------------------------------------------------
// Incremental decoding: the KV cache
// ---------------------------------------------------------------------------------------------

/// @struct clmha_kv_cache
/// The keys and values of the tokens seen so far, for each of `batch` sequences, as the attention
/// core sees them: projected, in_proj_bias added, split into heads ((G, batch, C, D) floats each,
/// on the device, for G key/value heads and the capacity rounded up to C, a multiple of 16; a
/// paged cache (G, pages, P, D); float16, bfloat16, int8 or int4 elements as its kv_dtype says,
/// with float scales for the quantised ones; the keys stored in transposed blocks of 16 tokens, which the decode core scores
/// as vectors). A forward call with clmha_forward_args::kv_cache projects only its new
/// key/value tokens, appends them after each sequence's cached ones (clmha_forward_args::kv_append
/// says how many per sequence: ragged batches), and attends its queries over everything the cache
/// then holds for their sequence. Feeding a sequence through the cache in chunks (or token by
/// token) gives the one-shot forward's output, chunk by chunk.
///
/// - is_causal with a cache is **bottom-right aligned**: new query i of a sequence that held
///   `len` tokens before the call sees cache positions 0 … len + i (so with as many new queries
///   as new tokens, query i sees itself and everything before it, as in the one-shot causal
///   forward). Without is_causal every query sees all of its sequence's cached tokens.
/// - A sliding window (clmha_layer_desc::window, clmha_attention_args::window) is bottom-right
///   aligned too: new query i is at position p = len + i and sees cache positions
///   p − window_left … p + window_right of those the sequence holds after the call (and at most
///   p with is_causal), so fed in chunks a windowed sequence gives the one-shot windowed
///   forward's rows, where token t is at position t. The decode core scores only those keys: a
///   step over a long cache with a window of W tokens costs about what a step over W tokens
///   costs.
/// - bias_k/bias_v (add_bias_kv) and the zero key of add_zero_attn are not stored: every call
///   appends them after the cached keys, as the one-shot forward appends them after all S keys,
///   visible to every query.
/// - Calls with a cache run the decode core: keys are split across work-groups (split-K), each
///   part gives a partial result and its log-sum-exp, and a second kernel combines them, so a
///   step with one query row still fills the device. It takes is_causal and a sliding window;
///   it does not return weights, apply attn_mask, key_padding_mask or dropout, save for a
///   backward pass, or run a user core: such calls return ::CLMHA_UNSUPPORTED.
/// - Capacity: a call that would make a sequence longer than the capacity is refused
///   (::CLMHA_SHAPE_MISMATCH) before anything is enqueued, and the cache is unchanged.
///
/// The lengths are host-side bookkeeping, updated when a call is enqueued; a call that fails
/// leaves them unchanged. A cache belongs to the layer it was made for (or, made by
/// clmha_kv_cache_create_for(), to attention as a function on its context) and must not be
/// used by two threads at once.
///
/// **Paged caches** (clmha_kv_cache_create_with(), ::clmha_kv_cache_options::page_size; vLLM's
/// PagedAttention): the keys and values live in pages of P tokens drawn from a pool that the
/// cache's sequences share. A sequence takes pages as it grows (an append takes them before
/// anything is enqueued; a pool without enough free pages refuses the call with
/// ::CLMHA_OUT_OF_MEMORY and changes nothing) and gives them back on clmha_kv_cache_truncate()
/// and clmha_kv_cache_reset(): the capacity is the pool's, not a per-sequence maximum.
/// clmha_kv_cache_fork() makes one sequence share another's pages (a common prompt for
/// parallel sampling or beam search); a shared page is copied only when a sequence appends into
/// it while it is partly filled and still shared (copy on write). The decode core reads the
/// pages where they are, through a page table: a paged cache gives bit-identical results to a
/// contiguous one.

/// Makes an empty cache for forward calls of @p layer.
/// @param[out] out       the new cache, or NULL on failure
/// @param[in]  layer     the layer whose calls will use it
/// @param[in]  batch     N, the sequences (1 for unbatched calls)
/// @param[in]  capacity  the most tokens each sequence may hold
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, @p batch or @p capacity 0, a
///         capacity of 2^32 tokens or more), ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY (also
///         a key or value buffer larger than the device's largest allocation, or the two
///         larger than its global memory: refused before anything is allocated),
///         ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_kv_cache_create(clmha_kv_cache **out, clmha_layer *layer,
                                             size_t batch, size_t capacity);

/// Makes an empty cache for attention as a function (clmha_attention_args::kv_cache): the keys
/// and values of @p kv_heads heads of @p head_dim floats, @p capacity tokens for each of
/// @p batch sequences, on @p ctx's device, as clmha_kv_cache_create() makes one for a layer.
/// It serves every clmha_attention_forward() call on @p ctx whose key and value have those
/// heads (any number of query heads that @p kv_heads divides, with enable_gqa); a layer's call
/// refuses it.
/// @param[out] out        the new cache, or NULL on failure
/// @param[in]  ctx        the context
/// @param[in]  batch      N, the sequences (1 for unbatched calls)
/// @param[in]  kv_heads   H_kv
/// @param[in]  head_dim   D
/// @param[in]  capacity   the most tokens each sequence may hold
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, a size 0, a capacity of 2^32 tokens
///         or more), ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_kv_cache_create_for(clmha_kv_cache **out, clmha_context *ctx,
                                                 size_t batch, size_t kv_heads, size_t head_dim,
                                                 size_t capacity);

/// Frees a cache. Work already enqueued that uses it keeps its buffers until it finishes.
/// @param[in] cache  the cache (NULL is ignored)
CLMHA_API void clmha_kv_cache_release(clmha_kv_cache *cache);

/// Empties every sequence of the cache (lengths 0). Nothing is enqueued.
/// @param[in] cache  the cache
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL)
CLMHA_API clmha_status clmha_kv_cache_reset(clmha_kv_cache *cache);

/// Shortens sequences (speculative decoding rolls back rejected tokens): sequence n keeps its
/// first @p lengths[n] tokens. Nothing is enqueued; later calls overwrite the dropped tokens.
/// @param[in] cache    the cache
/// @param[in] lengths  the batch's new lengths, each at most the sequence's current length
/// @param[in] count    entries in @p lengths: the cache's batch
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, a length longer than the sequence
///         holds), ::CLMHA_SHAPE_MISMATCH (@p count is not the batch); on failure nothing changes
CLMHA_API clmha_status clmha_kv_cache_truncate(clmha_kv_cache *cache, const size_t *lengths,
                                               size_t count);

/// The tokens each sequence holds (cache_seqlens).
/// @param[in]  cache    the cache
/// @param[out] lengths  room for @p count lengths
/// @param[in]  count    the cache's batch
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL), ::CLMHA_SHAPE_MISMATCH (@p count
///         is not the batch)
CLMHA_API clmha_status clmha_kv_cache_lengths(const clmha_kv_cache *cache, size_t *lengths,
                                              size_t count);

/// How a KV cache stores its keys and values (clmha_kv_cache_options::kv_dtype).
typedef enum clmha_kv_dtype {
    /// The decode core's own precision (the default, whatever the layer's dtype): float32, and
    /// float64 (8 bytes a value) in a float64 layer's cache, whose decode core computes in
    /// float64.
    CLMHA_KV_FLOAT32 = 0,
    /// int8, symmetric, one float32 scale per token and key/value head: each row of D values x
    /// is kept as round(x / s) with s = max |x| / 127 (round to nearest even), quantised when
    /// appended and dequantised on the fly by the decode core: 1 + 4/D bytes a value instead of
    /// 4 (3.8x fewer bytes at D 64). The accuracy against the float32 cache is stated in
    /// docs/accuracy.md ("Narrower KV caches").
    CLMHA_KV_INT8 = 1,
    /// float16 (IEEE half), rounded to nearest even when appended (values beyond ±65504 become
    /// infinities, as PyTorch's float16 does): 2 bytes a value.
    CLMHA_KV_FLOAT16 = 2,
    /// bfloat16 (a float32's upper 16 bits), rounded to nearest even when appended: 2 bytes a
    /// value, float32's range.
    CLMHA_KV_BFLOAT16 = 3,
    /// int4, symmetric, in groups of 32 dimensions of a row (of the largest power of two that
    /// divides D where 32 does not; D must be even), one float32 scale per group: q =
    /// round(x / s) in [-7, 7], s = max |x| of the group / 7. 0.5 + 4/32 bytes a value (6.4x
    /// fewer than float32). Its accuracy is stated in docs/accuracy.md ("Narrower KV caches").
    CLMHA_KV_INT4 = 4,
} clmha_kv_dtype;

/// How a cache is made (clmha_kv_cache_create_with(), clmha_kv_cache_create_for_with()).
/// Zero-initialise with struct_size set (see ::CLMHA_STRUCT_INIT).
typedef struct clmha_kv_cache_options {
    size_t struct_size;  ///< sizeof(clmha_kv_cache_options)
    /// Contiguous (page_size 0): the most tokens each sequence may hold, as
    /// clmha_kv_cache_create()'s capacity. Paged: 0 (the capacity is the pool).
    size_t capacity;
    /// Paged: tokens per page, a power of two from 8 (the decode core's key blocks are 16
    /// tokens: pages of 8 read each block from two pages, docs/performance.md says what that
    /// costs); 0: a contiguous cache.
    size_t page_size;
    /// Paged: the pages of the pool, shared by the sequences (at least 1; a sequence holds at
    /// most num_pages * page_size tokens, fewer than 2^32).
    size_t num_pages;
    clmha_kv_dtype kv_dtype;  ///< how the keys and values are stored (default float32)
    /// Attention as a function (clmha_kv_cache_create_for_with()): the dtype of the calls
    /// that will use the cache (clmha_attention_args::dtype; ::CLMHA_DTYPE_F64: its
    /// ::CLMHA_KV_FLOAT32 elements are doubles). A layer's cache takes its layer's dtype: 0 or
    /// that. Added after 0.1.0 (a shorter struct_size leaves it 0, float32).
    clmha_dtype dtype;
} clmha_kv_cache_options;

/// Makes an empty cache for forward calls of @p layer, contiguous or paged as @p options says.
/// @param[out] out      the new cache, or NULL on failure
/// @param[in]  layer    the layer whose calls will use it
/// @param[in]  batch    N, the sequences
/// @param[in]  options  struct_size set; capacity, or page_size and num_pages
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, @p batch 0, a contiguous cache's
///         capacity 0 or of 2^32 tokens or more, a page_size that is not a power of two from 8,
///         a capacity given with it, num_pages 0 or too many tokens, an unknown kv_dtype,
///         an options.dtype other than 0 and the layer's, @p options' struct_size 0 or too
///         small), ::CLMHA_UNSUPPORTED (@p options from a newer header using a newer field;
///         int4 with an odd head_dim),
///         ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_OUT_OF_MEMORY (also a key or value buffer larger than the device's largest
///         allocation, at the bytes of its kv_dtype, or the two larger than its global memory),
///         ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_kv_cache_create_with(clmha_kv_cache **out, clmha_layer *layer,
                                                  size_t batch,
                                                  const clmha_kv_cache_options *options);

/// clmha_kv_cache_create_for() with @p options (a paged cache for attention as a function).
/// @param[out] out       the new cache, or NULL on failure
/// @param[in]  ctx       the context
/// @param[in]  batch     N, the sequences
/// @param[in]  kv_heads  H_kv
/// @param[in]  head_dim  D
/// @param[in]  options   as clmha_kv_cache_create_with()'s
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (as clmha_kv_cache_create_with(), and
///         @p kv_heads or @p head_dim 0, an unknown options.dtype), ::CLMHA_UNSUPPORTED
///         (@p options from a newer header using a newer field; int4 with an odd head_dim;
///         options.dtype float64 on a device without double precision), ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_OUT_OF_MEMORY, ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_kv_cache_create_for_with(clmha_kv_cache **out, clmha_context *ctx,
                                                      size_t batch, size_t kv_heads,
                                                      size_t head_dim,
                                                      const clmha_kv_cache_options *options);

/// Makes sequence @p dst of a paged cache hold what sequence @p src holds, sharing its pages
/// (dst's own pages are given back first): a common prompt decoded once, then continued
/// differently (parallel sampling, beam search). A page stays shared until a sequence appends
/// into it while it is partly filled: that sequence's call copies it first (copy on write).
/// Nothing is enqueued. @p src == @p dst changes nothing.
/// @param[in] cache  a paged cache
/// @param[in] src    the sequence whose tokens are shared
/// @param[in] dst    the sequence that takes them
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, a sequence past the batch),
///         ::CLMHA_UNSUPPORTED (a contiguous cache)
CLMHA_API clmha_status clmha_kv_cache_fork(clmha_kv_cache *cache, size_t src, size_t dst);

/// A paged cache's pages.
/// @param[in]  cache       the cache
/// @param[out] page_size   tokens per page (0 for a contiguous cache) (may be NULL)
/// @param[out] num_pages   the pool's pages (the batch for a contiguous cache) (may be NULL)
/// @param[out] free_pages  pages no sequence holds (0 for a contiguous cache) (may be NULL)
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p cache NULL)
CLMHA_API clmha_status clmha_kv_cache_pages(const clmha_kv_cache *cache, size_t *page_size,
                                            size_t *num_pages, size_t *free_pages);

/// The capacity and batch the cache was made with.
/// @param[in]  cache     the cache
/// @param[out] batch     its batch (may be NULL)
/// @param[out] capacity  its capacity in tokens per sequence (may be NULL); a paged cache's is
///                       the pool's, num_pages * page_size
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p cache NULL)
CLMHA_API clmha_status clmha_kv_cache_size(const clmha_kv_cache *cache, size_t *batch,
                                           size_t *capacity);

// ---------------------------------------------------------------------------------------------
// Partial attention: attention over a range of keys, merged exactly (attention across devices)
// ---------------------------------------------------------------------------------------------

/// Attention of the queries over this call's keys only, before the head merge and the output
/// projection: what ring attention (keys and values split across devices, examples/
/// ring_attention_mpi.c) computes on each device and merges with clmha_attention_merge(). Takes
/// the arguments of clmha_layer_forward() and runs the same projections, masks and fused core;
/// writes, instead of the output, the attention result of every head, (N*H, L, D) floats
/// (normalised over this call's keys, and the keys of add_bias_kv and add_zero_attn when
/// @p appended_keys: set it on exactly one of the ranges that are merged; that range also counts
/// a layer's attention sinks, clmha_layer_desc::sinks, so that the merge counts them once), and
/// the natural log of each row's sum of exp(score) (the scaled, masked scores), N*H*L floats:
/// -INFINITY for a row with no key (its result is zeros). A key range's masks are the caller's
/// slice of the whole masks; clmha_forward_args::key_position (and query_position, for a block
/// of queries) place the range in the sequence for is_causal, the sliding window, ALiBi and the
/// user functions (0, 0: top-left on this call's own keys). The dropout pattern is this call's
/// own.
/// clmha_layer_project_heads() then applies the head merge and the output projection.
/// @param[in]  layer         the layer
/// @param[in]  args          as for clmha_layer_forward(); need_weights, save, kv_cache and
///                           ::CLMHA_IMPL_UNFUSED are refused
/// @param[in]  appended_keys whether this range holds the keys that add_bias_kv and
///                           add_zero_attn append (ignored by layers without them)
/// @param[out] heads         (N*H, L, D) floats at element @p heads_offset (float32 for
///                           every dtype but float64, whose are doubles)
/// @param[in]  heads_offset  element offset
/// @param[out] lse           N*H*L floats (a float64 layer's: doubles) at element
///                           @p lse_offset
/// @param[in]  lse_offset    element offset
/// @param[in]  num_wait      events in @p wait_list
/// @param[in]  wait_list     as for clmha_layer_forward()
/// @param[out] event         optional: completes with the call
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (as clmha_layer_forward(), for @p heads and
///         @p lse; positions above 2^24), ::CLMHA_UNSUPPORTED (the options above; a device
///         where the fused core cannot run the call), ::CLMHA_SHAPE_MISMATCH,
///         ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED,
///         ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_layer_attend(clmha_layer *layer, const clmha_forward_args *args,
                                          bool appended_keys, cl_mem heads, size_t heads_offset,
                                          cl_mem lse, size_t lse_offset, cl_uint num_wait,
                                          const cl_event *wait_list, cl_event *event);

/// Merges partial result b (@p other_heads, @p other_lse) into a (@p heads, @p lse), row by row:
/// a becomes the attention over the keys of both, its log-sum-exp updated, exactly up to float
/// rounding, in any order of merges. Rows are those of clmha_layer_attend(): N*H*L rows of
/// @p head_dim floats. A row whose log-sum-exp is -inf in both (no keys) stays zeros and -inf;
/// a row with a NaN log-sum-exp in either (a NaN score in that part) becomes NaN, its results
/// and its log-sum-exp. a's buffers must not overlap b's.
/// @param[in]     ctx        the context whose queue runs the merge
/// @param[in]     rows       N*H*L
/// @param[in]     head_dim   D
/// @param[in,out] heads      a's results, rows*D floats at @p heads_offset
/// @param[in]     heads_offset  element offset
/// @param[in,out] lse        a's log-sum-exp rows at @p lse_offset
/// @param[in]     lse_offset    element offset
/// @param[in]     other_heads   b's results
/// @param[in]     other_heads_offset  element offset
/// @param[in]     other_lse     b's log-sum-exp rows
/// @param[in]     other_lse_offset    element offset
/// @param[in]     num_wait      events in @p wait_list
/// @param[in]     wait_list     events the merge waits for on the device
/// @param[out]    event         optional: completes with the merge
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, buffers as for clmha_layer_forward()),
///         ::CLMHA_SHAPE_MISMATCH (@p rows or @p head_dim 0), ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_BUILD_FAILED, ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_attention_merge(clmha_context *ctx, size_t rows, size_t head_dim,
                                             cl_mem heads, size_t heads_offset, cl_mem lse,
                                             size_t lse_offset, cl_mem other_heads,
                                             size_t other_heads_offset, cl_mem other_lse,
                                             size_t other_lse_offset, cl_uint num_wait,
                                             const cl_event *wait_list, cl_event *event);

/// clmha_attention_merge() of a float64 layer's partial results (clmha_layer_attend()): the
/// same merge, arguments and rules, on doubles (@p heads, @p lse, @p other_heads, @p other_lse
/// and the offsets are in doubles), computed in float64.
/// @param[in]     ctx                 the context whose queue runs the merge
/// @param[in]     rows                N*H*L
/// @param[in]     head_dim            D
/// @param[in,out] heads               a's results, rows*D doubles at @p heads_offset
/// @param[in]     heads_offset        element offset
/// @param[in,out] lse                 a's log-sum-exp rows (doubles) at @p lse_offset
/// @param[in]     lse_offset          element offset
/// @param[in]     other_heads         b's results (doubles)
/// @param[in]     other_heads_offset  element offset
/// @param[in]     other_lse           b's log-sum-exp rows (doubles)
/// @param[in]     other_lse_offset    element offset
/// @param[in]     num_wait            events in @p wait_list
/// @param[in]     wait_list           events the merge waits for on the device
/// @param[out]    event               optional: completes with the merge
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, buffers as for
///         clmha_layer_forward(), in doubles), ::CLMHA_SHAPE_MISMATCH (@p rows or @p head_dim
///         0), ::CLMHA_SIZE_OVERFLOW, ::CLMHA_UNSUPPORTED (a device without double precision),
///         ::CLMHA_BUILD_FAILED, ::CLMHA_OPENCL_ERROR
CLMHA_API clmha_status clmha_attention_merge_f64(clmha_context *ctx, size_t rows,
                                                 size_t head_dim, cl_mem heads,
                                                 size_t heads_offset, cl_mem lse,
                                                 size_t lse_offset, cl_mem other_heads,
                                                 size_t other_heads_offset, cl_mem other_lse,
                                                 size_t other_lse_offset, cl_uint num_wait,
                                                 const cl_event *wait_list, cl_event *event);

/// The end of a forward pass for attention results from clmha_layer_attend() (merged): the head
/// merge and the output projection (out_proj.weight, out_proj.bias) into @p output, shaped as
/// the query with E features ((L, N, E), (N, L, E) with batch_first; batch 1 for unbatched).
/// @param[in]  layer          the layer
/// @param[in]  batch          N (1 unbatched)
/// @param[in]  tgt_len        L
/// @param[in]  heads          (N*H, L, D) floats (a float64 layer's: doubles) at
///                            @p heads_offset
/// @param[in]  heads_offset   element offset
/// @param[out] output         N*L*E elements of the layer's dtype (a 16-bit layer's: 16-bit)
///                            at @p output_offset (not CL_MEM_WRITE_ONLY with a bias); must not
///                            overlap @p heads
/// @param[in]  output_offset  element offset
/// @param[in]  num_wait       events in @p wait_list
/// @param[in]  wait_list      events the call waits for on the device
/// @param[out] event          optional: completes with the call
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, buffers as for
///         clmha_layer_forward()), ::CLMHA_SHAPE_MISMATCH (@p batch or @p tgt_len 0),
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_layer_project_heads(clmha_layer *layer, size_t batch,
                                                 size_t tgt_len, cl_mem heads,
                                                 size_t heads_offset, cl_mem output,
                                                 size_t output_offset, cl_uint num_wait,
                                                 const cl_event *wait_list, cl_event *event);

// ---------------------------------------------------------------------------------------------
// Attention as a function: scaled dot-product attention without a layer
// ---------------------------------------------------------------------------------------------

/// The memory order of the query, key, value and output of clmha_attention_forward(): each
/// tensor is dense and row-major in it.
typedef enum clmha_attention_layout {
    /// (N, H, L, D): PyTorch's scaled_dot_product_attention (query (N, H, L, D), key
    /// (N, H_kv, S, D), value (N, H_kv, S, D_v), output (N, H, L, D_v)).
    CLMHA_LAYOUT_NHLD = 0,
    /// (N, L, H, D): FlashAttention's flash_attn_func (query (N, L, H, D), key (N, S, H_kv, D),
    /// value (N, S, H_kv, D_v), output (N, L, H, D_v)).
    CLMHA_LAYOUT_NLHD = 1,
} clmha_attention_layout;

/// A host (C) form of a user score function, for the CPU reference (clmha_reference_forward(),
/// clmha_reference_attention() and their backward passes, which run no OpenCL C): the same
/// arguments as mod_source's clmha_score_mod or clmha_score_mod_grad (clmha_layer_desc::
/// mod_source), s in double precision. Added after 0.1.0.
typedef double (*clmha_host_score_fn)(double s, int b, int h, int q, int k, const float *p);
/// A host (C) form of mod_source's clmha_mask_mod, for the CPU reference. Added after 0.1.0.
typedef int (*clmha_host_mask_fn)(int b, int h, int q, int k, const float *p);

/// Arguments of clmha_attention_forward() and its host and reference forms: PyTorch's
/// `F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
/// enable_gqa)` on projected, head-split tensors. Zero-initialise with struct_size set;
/// struct_size must cover value. Read only during the call.
/// @code
/// clmha_attention_args args = {.struct_size = sizeof args,
///     .query = {.ndim = 4, .shape = {N, H, L, D}, .buffer = q},
///     .key = {.ndim = 4, .shape = {N, H, S, D}, .buffer = k},
///     .value = {.ndim = 4, .shape = {N, H, S, D}, .buffer = v}, .is_causal = true};
/// @endcode
/// Shapes in ::CLMHA_LAYOUT_NHLD (the default); ::CLMHA_LAYOUT_NLHD swaps the head and sequence
/// dimensions of query, key, value and output. Unbatched: 3-D, without N (N = 1).
///
/// attn_mask, broadcast over (N, H, L, S) as scaled_dot_product_attention broadcasts it: any
/// contiguous (a, b, c, S) with a 1 or N, b 1 or H and c 1 or L, leading dimensions of 1 left
/// out or not (unbatched: at most 3-D, (b, c, S)). So (L, S) or (1, 1, L, S) shared by every
/// batch item and head; (N, 1, L, S) per batch item; (H, L, S) or (1, H, L, S) per head, shared
/// by the batch items; (N, H, L, S) per head and batch item; and with a size-1 L one row of
/// keys for every query row: (N, 1, 1, S) per batch item, (N, H, 1, S) per head and item,
/// (H, 1, S) per head, (S,) or (1, 1, 1, S) for all. Refused (::CLMHA_INVALID_MASK): a size that
/// is neither 1 nor the call's, more dimensions than the query, and a mask broadcast over the
/// keys (a last dimension of 1 when S > 1: expand it to S). Kinds: ::CLMHA_MASK_BOOL_ATTEND
/// (SDPA's boolean mask, true = may attend), ::CLMHA_MASK_FLOAT (added to the scaled scores),
/// ::CLMHA_MASK_BOOL_IGNORE; its per_batch must be false. A query row whose every key is masked
/// gives zeros (and a log-sum-exp of -INFINITY).
typedef struct clmha_attention_args {
    size_t struct_size;              ///< sizeof(clmha_attention_args) (see ::CLMHA_STRUCT_INIT)
    clmha_tensor query;              ///< (N, H, L, D), or (H, L, D) unbatched
    clmha_tensor key;                ///< (N, H_kv, S, D), or (H_kv, S, D)
    clmha_tensor value;              ///< (N, H_kv, S, D_v), or (H_kv, S, D_v); D_v may differ
                                     ///< from D (run on copies padded to max(D, D_v))
    clmha_attention_layout layout;   ///< the order of query, key, value and output
    clmha_mask attn_mask;            ///< optional; shapes and kinds above
    bool is_causal;                  ///< mask key j > query i (top-left aligned, as SDPA);
                                     ///< refused together with attn_mask, as SDPA refuses it
    double scale;                    ///< factor of the scores q·kᵀ; 0 means 1/sqrt(D)
    float dropout_p;                 ///< probability in [0, 1) of dropping a weight; 0: none
    clmha_dropout_rng rng;           ///< the dropout's Philox stream (as ::clmha_dropout_rng
                                     ///< documents for a layer, with H the query heads)
    bool enable_gqa;                 ///< allow H_kv < H: H_kv must divide H, query head h
                                     ///< reads key/value head h / (H / H_kv); without it
                                     ///< H_kv must equal H
    clmha_impl impl;                 ///< the core (::clmha_impl); ::CLMHA_IMPL_AUTO: fused where
                                     ///< it runs, unfused for weights
    /// Optional: the KV-cache form (incremental decoding on already projected keys and values,
    /// FlashAttention's flash_attn_with_kvcache): a cache made by clmha_kv_cache_create_for()
    /// for (N, H_kv, D). key and value are then the new tokens, (N, H_kv, S_new, D) (or
    /// (N, S_new, H_kv, D)), appended after each sequence's cached ones (kv_append: how many of
    /// the S_new are real per sequence), and the queries attend over everything the cache then
    /// holds for their sequence, through the decode core. is_causal is bottom-right aligned
    /// there (new query i of a sequence that held `len` tokens sees positions 0 … len + i), as
    /// flash_attn_with_kvcache aligns it, and so is a sliding window (window: query i at
    /// position len + i). Such a call takes no attn_mask, dropout, D_v ≠ D, lse or weights
    /// (::CLMHA_UNSUPPORTED) and has no backward; a cache is used by one thread at a time.
    clmha_kv_cache *kv_cache;
    /// Optional with kv_cache (NULL: all S_new of every sequence): N counts of new tokens that
    /// are real, each at most S_new (ragged batches, as clmha_forward_args::kv_append).
    const size_t *kv_append;
    /// Sliding window, as clmha_layer_desc::window: query row i, at position p_i (i, or the
    /// cached length + i with kv_cache), attends key j only when
    /// p_i − window_left ≤ j ≤ p_i + window_right; −1 leaves a side unbounded. Added after
    /// 0.1.0: zero-initialised, off.
    bool window;
    int64_t window_left;   ///< as clmha_layer_desc::window_left; −1: all keys before
    int64_t window_right;  ///< as clmha_layer_desc::window_right; −1: all keys after
    double softcap;        ///< soft-capping, as clmha_layer_desc::softcap; 0: off
    bool alibi;            ///< ALiBi, as clmha_layer_desc::alibi, slopes from alibi_slopes
    /// With alibi: the slopes, (H) elements on the device (buffer, offset; doubles with
    /// @ref dtype float64); ndim 0: the geometric slopes of clmha_alibi_slopes().
    clmha_tensor alibi_slopes;
    /// Optional (ndim 0: none): attention sinks, as clmha_layer_desc::sinks, (H) elements
    /// (doubles with @ref dtype float64) on the device (buffer, offset). The log-sum-exp rows
    /// include them.
    clmha_tensor sinks;
    /// Optional (NULL or ""): user score and mask functions, as clmha_layer_desc::mod_source
    /// (compiled once per context and source), their p from @ref mod_params.
    const char *mod_source;
    /// With mod_source: p, floats on the device (buffer, offset; shape (count)); ndim 0: none.
    clmha_tensor mod_params;
    /// @var host_score_mod
    /// Read by clmha_reference_attention() and clmha_reference_attention_backward() only (the
    /// device calls ignore them): the host forms of mod_source's functions, one for each it
    /// defines (clmha_score_mod_grad only for the backward). They get p from mod_params.data.
    /// @var host_score_mod_grad
    /// See @ref host_score_mod.
    /// @var host_mask_mod
    /// See @ref host_score_mod.
    clmha_host_score_fn host_score_mod, host_score_mod_grad;
    clmha_host_mask_fn host_mask_mod;
    /// A packed variable-length batch (FlashAttention's flash_attn_varlen_func): @ref num_seqs
    /// sequences one after another, query (T, H, D), key (T_kv, H_kv, D) and value
    /// (T_kv, H_kv, D_v), the output (T, H, D_v), whatever @ref layout says; T the sum of
    /// seq_lens, T_kv of kv_seq_lens (NULL: seq_lens). Each sequence attends only within
    /// itself, as a one-sequence call of its own would (is_causal, windows, ALiBi, sinks, user
    /// functions, dropout: sequence i draws as such a call with rng.offset + i * 2^32). The
    /// log-sum-exp rows (H·T floats) come as each sequence's (H, L_i) block from H·t_i, t_i its
    /// first token. Refused: attn_mask, weights, kv_cache. A sequence without queries is
    /// skipped (its keys' gradients are zero); one with queries but no keys is refused. The
    /// backward sums the sinks' gradient over the sequences. NULL: not packed. Added after
    /// 0.1.0: zero-initialised.
    const size_t *seq_lens;
    const size_t *kv_seq_lens;  ///< num_seqs key/value lengths; NULL: seq_lens
    size_t num_seqs;            ///< the sequences of a packed call (at least 1)
    /// The element type of the call's tensors (::clmha_dtype; 0: float32). ::CLMHA_DTYPE_F64:
    /// query, key, value, a float attn_mask, alibi_slopes, sinks, the output, the log-sum-exp
    /// rows, the weights and every gradient hold doubles (offsets in doubles), computed in
    /// float64, as a float64 layer computes (refused with ::CLMHA_UNSUPPORTED on a device
    /// without double precision); a kv_cache must be made for float64 calls
    /// (clmha_kv_cache_options::dtype: it holds doubles); mod_params stays floats. The
    /// host forms take it through clmha_attention_forward_host_f64() and
    /// clmha_attention_backward_host_f64(). ::CLMHA_DTYPE_F16, ::CLMHA_DTYPE_BF16: query, key,
    /// value, a float mask, alibi_slopes, sinks, the output, log-sum-exp rows, weights and
    /// gradients hold 16-bit elements on the device (offsets in them), widened to float32
    /// copies, computed in float32 and the results rounded once, as a 16-bit layer computes
    /// (the backward runs the float32 forward again on the widened inputs: it reads neither the
    /// 16-bit output nor lse); the float host forms take float arrays, rounded to the dtype on
    /// the way in and the results on the way out; a kv_cache holds floats (one made with
    /// clmha_kv_cache_options::dtype 0 or the call's).
    /// The CPU reference ignores it (it reads floats and computes in double). Added after
    /// 0.1.0: zero-initialised, float32.
    clmha_dtype dtype;
} clmha_attention_args;

/// Element counts of the results of a clmha_attention_forward() call of @p args. Validates the
/// shapes, masks and options of @p args like the call, but neither buffers nor data pointers.
/// @param[in]  ctx            the context (for its last error message)
/// @param[in]  args           the call's arguments
/// @param[out] output_count   N·H·L·D_v (may be NULL)
/// @param[out] lse_count      N·H·L, the log-sum-exp rows (may be NULL)
/// @param[out] weights_count  N·H·L·S, the attention weights (may be NULL)
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, args->struct_size 0 or too small,
///         an option out of range, an unknown dtype), ::CLMHA_UNSUPPORTED (@p args from a newer
///         header, using a newer field; a dtype the device or the call's options do not take
///         yet: see clmha_attention_args::dtype), ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW
CLMHA_API clmha_status clmha_attention_output_counts(clmha_context *ctx,
                                                     const clmha_attention_args *args,
                                                     size_t *output_count, size_t *lse_count,
                                                     size_t *weights_count);

/// Scaled dot-product attention on device buffers, without a layer:
/// output = softmax(query·keyᵀ·scale + masks)·value per (batch item, head), with dropout on the
/// weights, through the same attention cores as clmha_layer_forward() (see ::clmha_impl). Reads
/// the `buffer` and `offset` fields of @p args (offsets in elements: floats, or doubles with
/// dtype float64; a boolean mask's in bytes).
/// Optionally writes the log-sum-exp of each score row (natural log of the sum of
/// exp(score), scores scaled and masked, before dropout; (N, H, L) in either layout; both
/// cores write them) and the attention weights (after dropout, (N, H, L, S) in either layout;
/// only the unfused core returns them, so asking for them runs it, with the log-sum-exp rows
/// too when asked).
/// The first call for a (H, H_kv, D) on a context builds what the cores need (kernels, as
/// clmha_layer_create() does; the context keeps them, with scratch grown to the largest call,
/// until it is released); later calls neither compile nor wait on the host. Calls on one
/// context run their enqueueing one at a time.
/// Float32, or float64 with args->dtype ::CLMHA_DTYPE_F64 (every tensor then holds doubles),
/// or float16 / bfloat16 (16-bit tensors, computed in float32: see clmha_attention_args::dtype).
/// Buffer rules as for clmha_layer_forward(): buffers of the context's
/// cl_context, large enough, outputs not CL_MEM_READ_ONLY, the bytes of the outputs not
/// overlapping each other or any input. On failure nothing was enqueued or written and
/// *event is NULL.
/// @param[in]  ctx             the context whose queue runs the call
/// @param[in]  args            the tensors and options
/// @param[out] output          (N, H, L, D_v) or (N, L, H, D_v) floats at @p output_offset
/// @param[in]  output_offset   element offset
/// @param[out] lse             optional (NULL: not asked): N·H·L floats at @p lse_offset
/// @param[in]  lse_offset      element offset
/// @param[out] weights         optional (NULL: not asked): N·H·L·S floats at @p weights_offset
/// @param[in]  weights_offset  element offset
/// @param[in]  num_wait        number of events in @p wait_list
/// @param[in]  wait_list       events of the context that the call waits for on the device
///                             (as for clmha_layer_forward())
/// @param[out] event           optional: a new event that completes with the call; NULL on
///                             failure
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL ctx or args, args->struct_size 0 or
///         too small, a buffer missing, of another context, too small, read-only or
///         overlapping, a bad wait list, is_causal with attn_mask, scale or dropout_p out of
///         range, an unknown dtype), ::CLMHA_UNSUPPORTED (@p args from a newer header, using
///         a newer field; a core asked for by impl that cannot run the call; what a 16-bit
///         call does not take yet; float64 on a device without it, or with kv_cache),
///         ::CLMHA_SHAPE_MISMATCH,
///         ::CLMHA_INVALID_MASK, ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED, ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_attention_forward(clmha_context *ctx,
                                               const clmha_attention_args *args, cl_mem output,
                                               size_t output_offset, cl_mem lse,
                                               size_t lse_offset, cl_mem weights,
                                               size_t weights_offset, cl_uint num_wait,
                                               const cl_event *wait_list, cl_event *event);

/// clmha_attention_forward() on host arrays: reads the `data` fields of @p args (float32
/// tensors and float masks, bytes for boolean masks), uploads them into device buffers the
/// context keeps, runs the call, waits for it (clFinish) and writes the results. With a 16-bit
/// args->dtype the arrays stay floats: the inputs are rounded to the dtype, the call computed
/// in float32 and the results rounded to the dtype, once.
/// @param[in]  ctx            the context
/// @param[in]  args           the tensors and options (the `buffer` fields are ignored)
/// @param[out] output         room for @p output_count floats
/// @param[in]  output_count   must equal clmha_attention_output_counts()'s output count
/// @param[out] lse            optional (NULL: not asked): room for @p lse_count floats
/// @param[in]  lse_count      the lse count with @p lse, else 0
/// @param[out] weights        optional (NULL: not asked): room for @p weights_count floats
/// @param[in]  weights_count  the weights count with @p weights, else 0
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (as clmha_attention_forward(); also a
///         missing `data` pointer or output array; args->dtype float64: see
///         clmha_attention_forward_host_f64()), ::CLMHA_UNSUPPORTED, ::CLMHA_SHAPE_MISMATCH
///         (also a wrong count), ::CLMHA_INVALID_MASK, ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED, ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_attention_forward_host(clmha_context *ctx,
                                                    const clmha_attention_args *args,
                                                    float *output, size_t output_count,
                                                    float *lse, size_t lse_count,
                                                    float *weights, size_t weights_count);

/// clmha_attention_forward_host() in float64: args->dtype must be ::CLMHA_DTYPE_F64; the
/// `data` of the tensors, a float mask, alibi_slopes and sinks are doubles (boolean masks
/// bytes, mod_params floats), the call is computed in float64 and the results are doubles.
/// @param[in]  ctx            the context
/// @param[in]  args           the tensors and options (the `buffer` fields are ignored)
/// @param[out] output         room for @p output_count doubles
/// @param[in]  output_count   must equal clmha_attention_output_counts()'s output count
/// @param[out] lse            optional (NULL: not asked): room for @p lse_count doubles
/// @param[in]  lse_count      the lse count with @p lse, else 0
/// @param[out] weights        optional (NULL: not asked): room for @p weights_count doubles
/// @param[in]  weights_count  the weights count with @p weights, else 0
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (as clmha_attention_forward_host();
///         args->dtype not ::CLMHA_DTYPE_F64), ::CLMHA_UNSUPPORTED (also a device without
///         double precision), ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED,
///         ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_attention_forward_host_f64(clmha_context *ctx,
                                                        const clmha_attention_args *args,
                                                        double *output, size_t output_count,
                                                        double *lse, size_t lse_count,
                                                        double *weights, size_t weights_count);

/// Arguments of clmha_attention_backward(): the forward call, its results, the output's
/// gradient and where the gradients go (buffers of the context; offsets in elements: floats,
/// or doubles when the forward call's dtype is ::CLMHA_DTYPE_F64, as every tensor here). Zero-
/// initialise with struct_size set; struct_size must cover grad_value_offset.
typedef struct clmha_attention_backward_args {
    size_t struct_size;                   ///< sizeof(clmha_attention_backward_args)
    const clmha_attention_args *forward;  ///< the forward call's tensors (buffers) and options,
                                          ///< unchanged since it ran
    /// @var output
    /// The forward call's output (its shape and layout), from @ref output_offset.
    cl_mem output;
    size_t output_offset;  ///< element offset
    /// @var lse
    /// Optional (NULL): the forward call's log-sum-exp rows (N, H, L), from @ref lse_offset.
    /// With them the fused core's backward runs (::CLMHA_IMPL_AUTO); without them the unfused
    /// core's, which recomputes the probabilities. Limit of the fused one: it takes P =
    /// exp(score − lse), each P off by up to half a float step of lse (relative), so a query
    /// row whose every key carries a large finite float mask value gets wrong gradients: some
    /// % at −1e6; at −1e30 or −FLT_MAX (all its scores one float, lse rounded to it) P = 1 for
    /// each key instead of 1/S. For such masks pass no lse or ::CLMHA_IMPL_UNFUSED, or mask
    /// with −INFINITY (exact). The layer's backward (clmha_layer_backward()) has no such limit:
    /// its saved state keeps each row's maximum and log(sum) apart (::clmha_saved).
    cl_mem lse;
    size_t lse_offset;  ///< element offset
    cl_mem grad_output;         ///< the output's gradient, the output's shape and layout
    size_t grad_output_offset;  ///< element offset
    /// @var grad_query
    /// Written: the query's gradient, the query's shape and layout.
    /// @var grad_key
    /// Written: the key's gradient, the key's shape and layout.
    /// @var grad_value
    /// Written: the value's gradient, the value's shape and layout.
    cl_mem grad_query, grad_key, grad_value;
    /// @var grad_query_offset
    /// Element offset of @ref grad_query.
    /// @var grad_key_offset
    /// Element offset of @ref grad_key.
    /// @var grad_value_offset
    /// Element offset of @ref grad_value.
    size_t grad_query_offset, grad_key_offset, grad_value_offset;
    clmha_impl impl;  ///< the backward core; ::CLMHA_IMPL_AUTO: fused with @ref lse, else
                      ///< unfused
    /// @var grad_attn_mask
    /// Optional (NULL): where a float attn_mask's gradient is written, in the mask's own shape:
    /// the scores' gradient summed over the dimensions the mask is broadcast along. Only the
    /// unfused core computes it (::CLMHA_IMPL_AUTO takes it; ::CLMHA_IMPL_FUSED is refused).
    cl_mem grad_attn_mask;
    size_t grad_attn_mask_offset;  ///< element offset of @ref grad_attn_mask
    /// Optional (NULL): where the gradient of the forward's sinks, (H) elements, is written. Needs
    /// @ref lse (the sinks' probabilities are exp(sinks_h − lse)).
    cl_mem grad_sinks;
    size_t grad_sinks_offset;  ///< element offset of @ref grad_sinks
} clmha_attention_backward_args;

/// The backward pass of clmha_attention_forward() on device buffers: the gradients of the query,
/// key and value given the output's gradient, through the attention cores' backward passes
/// (the same as clmha_layer_backward()'s), dropout replayed from the forward's rng; fully
/// masked rows give zero gradients; with enable_gqa a key/value head's gradient sums its query
/// heads' (in a fixed order); a float attn_mask's gradient when asked for. Buffer rules as for clmha_attention_forward(): the gradients must not overlap
/// each other or any input. On failure nothing was enqueued or written and *event is NULL.
/// @param[in]  ctx        the context
/// @param[in]  args       the forward call and the gradients' buffers
/// @param[in]  num_wait   number of events in @p wait_list
/// @param[in]  wait_list  events the call waits for on the device
/// @param[out] event      optional: completes with the call; NULL on failure
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, struct sizes, buffers as for
///         clmha_attention_forward(), a bad wait list, grad_attn_mask without a float mask),
///         ::CLMHA_UNSUPPORTED (a mask gradient asked of the fused core; a dtype as
///         clmha_attention_forward(); a newer header's field), ::CLMHA_SHAPE_MISMATCH,
///         ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED,
///         ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_attention_backward(clmha_context *ctx,
                                                const clmha_attention_backward_args *args,
                                                cl_uint num_wait, const cl_event *wait_list,
                                                cl_event *event);

/// clmha_attention_backward() on host arrays: uploads the `data` of @p args' tensors, runs the
/// forward call again (its output, and the log-sum-exp rows where the fused core runs it, so
/// that the fused backward runs; with a mask gradient asked for, args->impl
/// ::CLMHA_IMPL_UNFUSED, or where the fused core cannot run the call, the unfused backward,
/// which recomputes the probabilities), the backward, waits (clFinish) and writes the gradients
/// asked for. The fused backward here has clmha_attention_backward_args::lse's limit (a row
/// whose every key has a large finite mask value; a 16-bit call's too, device or host): such a
/// call needs args->impl ::CLMHA_IMPL_UNFUSED, or −INFINITY in the mask.
/// @param[in]  ctx                the context
/// @param[in]  args               the forward call's tensors (`data`) and options
/// @param[in]  grad_output        the output's gradient, the output's shape and layout
/// @param[in]  grad_output_count  its element count (clmha_attention_output_counts())
/// @param[out] grad_query         optional (NULL): room for the query's element count
/// @param[out] grad_key           optional (NULL): room for the key's
/// @param[out] grad_value         optional (NULL): room for the value's
/// @param[out] grad_attn_mask     optional (NULL): a float attn_mask's gradient, its shape
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL ctx, args or grad_output, a missing
///         `data` pointer, grad_attn_mask without a float mask; args->dtype float64: see
///         clmha_attention_backward_host_f64()), ::CLMHA_UNSUPPORTED,
///         ::CLMHA_SHAPE_MISMATCH (also a wrong count), ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED,
///         ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_attention_backward_host(clmha_context *ctx,
                                                     const clmha_attention_args *args,
                                                     const float *grad_output,
                                                     size_t grad_output_count,
                                                     float *grad_query, float *grad_key,
                                                     float *grad_value, float *grad_attn_mask);

/// clmha_attention_backward_host() in float64: args->dtype must be ::CLMHA_DTYPE_F64; the
/// `data` of the forward's tensors (as clmha_attention_forward_host_f64() reads them), the
/// output's gradient and the gradients written are doubles, computed in float64.
/// @param[in]  ctx                the context
/// @param[in]  args               the forward call's tensors (`data`) and options
/// @param[in]  grad_output        the output's gradient, the output's shape and layout
/// @param[in]  grad_output_count  its element count (clmha_attention_output_counts())
/// @param[out] grad_query         optional (NULL): room for the query's element count
/// @param[out] grad_key           optional (NULL): room for the key's
/// @param[out] grad_value         optional (NULL): room for the value's
/// @param[out] grad_attn_mask     optional (NULL): a float attn_mask's gradient, its shape
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (as clmha_attention_backward_host();
///         args->dtype not ::CLMHA_DTYPE_F64), ::CLMHA_UNSUPPORTED (also a device without
///         double precision), ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED,
///         ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_attention_backward_host_f64(clmha_context *ctx,
                                                         const clmha_attention_args *args,
                                                         const double *grad_output,
                                                         size_t grad_output_count,
                                                         double *grad_query, double *grad_key,
                                                         double *grad_value,
                                                         double *grad_attn_mask);

// ---------------------------------------------------------------------------------------------
// Training: the backward pass
// ---------------------------------------------------------------------------------------------

/// @struct clmha_saved
/// What one forward call keeps for its backward pass, owned by the caller. A forward call with
/// clmha_forward_args::save set fills it (growing its device buffers when needed): the projected
/// head tiles Q (N·H, L, D), K and V (N·H, S', D), the attention result before the head merge
/// (N·H, L, D) and, when the fused core ran, the log-sum-exp of every score row and, apart,
/// each row's maximum and the log of its sum of exponentials (3·N·H·L values: the fused backward
/// takes P = exp((score − max) − log(sum)), exact on a row whose every key carries a huge finite
/// mask value such as −FLT_MAX, where the log-sum-exp rounds to the maximum). Its elements are
/// the layer's computing precision: floats (a 16-bit layer's too) or, in a float64 layer,
/// doubles.
/// Its memory is linear in the sequence lengths (clmha_saved_bytes()); the attention weights
/// are never kept: the backward pass recomputes them. Each forward call that is to be
/// differentiated needs its own object (gradient accumulation, several layers, pipelined
/// micro-batches: several forwards may be in flight before their backwards); a later forward
/// call with the same object replaces what it held. An object belongs to the layer it was made
/// for and must not be used by two threads at once.
/// Dropout masks are never stored: the backward pass replays them from the forward call's
/// ::clmha_dropout_rng.

/// Makes an empty saved-state object for forward calls of @p layer.
/// @param[out] out    the new object, or NULL on failure
/// @param[in]  layer  the layer whose forward calls will fill it
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL), ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_saved_create(clmha_saved **out, clmha_layer *layer);

/// Frees a saved-state object. Work already enqueued that uses it keeps its buffers until it
/// finishes. Release it before its layer.
/// @param[in] saved  the object (NULL is ignored)
CLMHA_API void clmha_saved_release(clmha_saved *saved);

/// Device memory a saved-state object holds.
/// @param[in] saved  the object (may be NULL)
/// @return bytes, 0 for NULL or an object no forward call has filled
CLMHA_API size_t clmha_saved_bytes(const clmha_saved *saved);

/// Where one gradient goes. A gradient is produced when its destination is given: @ref buffer
/// for clmha_layer_backward(), @ref data for clmha_layer_backward_host() (the other field is
/// ignored). Gradients are in the shape of what they differentiate; a device call's are elements
/// of the layer's dtype (float32 with clmha_backward_args::grad_dtype ::CLMHA_GRAD_F32), a host
/// call's are float arrays (holding values of the layer's dtype unless ::CLMHA_GRAD_F32).
/// The layout is frozen (no struct_size of its own).
typedef struct clmha_grad {
    cl_mem buffer;    ///< device call: the buffer, of the layer's cl_context
    size_t offset;    ///< device call: element offset in @ref buffer
    float *data;      ///< host call: the array
    bool accumulate;  ///< add the gradient to what the destination holds (PyTorch's
                      ///< `.grad +=`) instead of overwriting it
} clmha_grad;

/// The element type of a backward call's gradients (clmha_backward_args::grad_dtype).
typedef enum clmha_grad_dtype {
    CLMHA_GRAD_LAYER = 0,  ///< the layer's dtype (the default): 16-bit gradients of a 16-bit layer
    CLMHA_GRAD_F32 = 1,    ///< float32, for a 16-bit layer's caller with float32 master weights
                           ///< (the same gradients before their final rounding); for a float32
                           ///< layer the same as ::CLMHA_GRAD_LAYER
} clmha_grad_dtype;

/// Arguments of one backward call. Zero-initialise with struct_size set; forward, saved and
/// grad_output are required. The gradients asked for are those whose ::clmha_grad has a
/// destination.
/// @code
/// clmha_backward_args b = {.struct_size = sizeof b, .forward = &fwd_args, .saved = saved,
///                          .grad_output = {.ndim = 3, .shape = {L, N, E}, .data = dy},
///                          .query = {.data = dx},
///                          .out_proj_weight = {.data = dw_out, .accumulate = true}};
/// @endcode
///
/// Inputs. @ref forward must be the arguments of the forward call that filled @ref saved (the same
/// shapes, options, masks and ::clmha_dropout_rng), with the same input and mask contents (the
/// weight gradients need the inputs; the masks and dropout are applied again); the layer's
/// parameters must not have changed in between. @ref grad_output has the output's shape;
/// @ref grad_weights, optional, the shape of the weights that forward call returned (it needs
/// need_weights there) and counts as their gradient.
///
/// Outputs.
/// - query, key, value: the inputs' gradients, in their shapes. When key was not given
///   (key.ndim 0: self-attention) the gradient of query is the whole gradient of that one tensor
///   (its uses as query, key and value summed) and key and value must have no destination; when
///   only value was not given, the gradient of key includes its use as value. Tensors given
///   separately get separate gradients even when they share memory.
/// - The parameters, by PyTorch name (clmha_layer_set_parameter()): in_proj_weight (3E, E) when
///   the layer has it, and/or its row blocks q_proj_weight, k_proj_weight, v_proj_weight (not a
///   block and in_proj_weight together); in_proj_bias, out_proj_weight (`out_proj.weight`),
///   out_proj_bias, bias_k, bias_v (1, 1, E) where the layer has them.
/// - attn_mask, key_padding_mask: the gradient of a float mask, in its own shape (the sum over
///   the dimensions it is broadcast along). Only for ::CLMHA_MASK_FLOAT masks. It is 0 where the
///   mask is -inf and on fully masked rows.
///
/// Gradients on fully masked query rows are zero (their output is out_proj.bias), never NaN.
typedef struct clmha_backward_args {
    size_t struct_size;                   ///< sizeof(clmha_backward_args)
    const clmha_forward_args *forward;    ///< the forward call's arguments (see above)
    clmha_saved *saved;                   ///< what that forward call saved
    clmha_tensor grad_output;             ///< gradient of the output, in the output's shape
    clmha_tensor grad_weights;            ///< optional (ndim 0: none): gradient of the weights
    clmha_grad query;                     ///< the query's gradient, the query's shape
    clmha_grad key;                       ///< the key's gradient (see above)
    clmha_grad value;                     ///< the value's gradient
    clmha_grad in_proj_weight;            ///< (3E, E)
    clmha_grad q_proj_weight;             ///< (E, E)
    clmha_grad k_proj_weight;             ///< (E, kdim)
    clmha_grad v_proj_weight;             ///< (E, vdim)
    clmha_grad in_proj_bias;              ///< (3E)
    clmha_grad out_proj_weight;           ///< `out_proj.weight` (E, E)
    clmha_grad out_proj_bias;             ///< `out_proj.bias` (E)
    clmha_grad bias_k;                    ///< (1, 1, E)
    clmha_grad bias_v;                    ///< (1, 1, E)
    clmha_grad attn_mask;                 ///< float attn_mask's gradient, its shape
    clmha_grad key_padding_mask;          ///< float key_padding_mask's gradient, its shape
    clmha_impl impl;                      ///< backward core; ::CLMHA_IMPL_AUTO: see below
    /// The sinks' gradient, (H), with clmha_layer_desc::sinks. Added after 0.1.0.
    clmha_grad sinks;
    /// The gradients' element type (see ::clmha_grad_dtype; a 16-bit layer's device gradients
    /// are 16-bit by default). Added after 0.1.0.
    clmha_grad_dtype grad_dtype;
} clmha_backward_args;

/// Enqueues the backward pass of one forward call on device buffers: computes the gradients
/// that @p args asks for from the gradient of the output.
///
/// Cores, like the forward pass. The fused backward (FlashAttention-2's algorithm) recomputes
/// the attention probabilities tile by tile from Q, K and the saved log-sum-exp, never storing
/// the L·S' scores: its scratch is linear in the sequence lengths, and it skips the key tiles
/// that is_causal masks. Where the GEMMs run in the host BLAS (clmha_context_gemm() is
/// ::CLMHA_GEMM_HOST) it runs its products as GEMMs instead, over blocks of query rows (two
/// buffers of 4 MiB, whatever the lengths) with one elementwise kernel per block; the
/// environment variable CLMHA_FUSED_BACKWARD=kernels|gemms overrides that choice (read when a
/// layer first runs it). It needs a forward call that ran the fused core, and it returns
/// neither mask gradients nor takes a weights gradient. The unfused backward recomputes the
/// probabilities into N·H·L·S' scratch (twice that: probabilities and their gradients; three
/// times with soft-capping, whose factor needs the scores before it) and runs
/// batched GEMMs over them; it does everything, and refuses calls whose scores exceed half the
/// device's largest allocation (::CLMHA_OUT_OF_MEMORY). ::CLMHA_IMPL_AUTO: fused when the forward
/// call ran the fused core and the call asks for no mask gradient and gives no weights
/// gradient, else unfused.
///
/// Deterministic: the same call on the same device gives bit-identical gradients every run
/// (every sum is done in a fixed order; no atomics; a host BLAS gives the same bits for the
/// same product on the same threads).
///
/// Destinations must not overlap each other, the inputs, the masks or grad_output (sub-buffers
/// count as parts of their parent); they must not be CL_MEM_READ_ONLY, and not
/// CL_MEM_WRITE_ONLY when they accumulate. The call never waits on the host: it waits for
/// @p wait_list on the device (failed events are refused as in clmha_layer_forward()) and
/// returns an event for its completion. It uses the layer's scratch (the layer must not run
/// another call meanwhile from another thread) and reads @p args->saved, which must not be
/// refilled before the event completes.
/// @param[in]  layer      the layer of the forward call
/// @param[in]  args       the arguments; read only during the call
/// @param[in]  num_wait   number of events in @p wait_list
/// @param[in]  wait_list  events the pass waits for on the device (NULL when @p num_wait is 0)
/// @param[out] event      optional: a new event that completes with the pass; NULL on failure
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL or missing arguments, saved state
///         of another layer or never filled, a gradient the layer or call does not have, a
///         mask gradient of a boolean mask, grad_weights without need_weights in the forward
///         call, buffers and wait lists as for clmha_layer_forward(), struct_size 0 or too
///         small), ::CLMHA_SHAPE_MISMATCH (grad_output or grad_weights shapes; forward
///         arguments of another shape than the saved call), ::CLMHA_INVALID_MASK,
///         ::CLMHA_UNSUPPORTED (::CLMHA_IMPL_FUSED for a call it cannot do; a user attention
///         core; @p args from a newer header using a newer field),
///         ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED, ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_layer_backward(clmha_layer *layer, const clmha_backward_args *args,
                                            cl_uint num_wait, const cl_event *wait_list,
                                            cl_event *event);

/// The host-array backward pass: uploads args->forward's `data` tensors and grad_output (and
/// grad_weights), runs clmha_layer_backward(), waits for it and writes every gradient asked for
/// into its ::clmha_grad::data array (adding to it with accumulate). The arrays are written only
/// once the whole pass has finished, every one or (a call that fails) none. The forward call
/// must have been a
/// clmha_layer_forward_host() (or clmha_layer_forward()) call with the same arguments.
/// @param[in] layer  the layer
/// @param[in] args   the arguments (the `buffer` fields are ignored)
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also a missing `data` pointer),
///         ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK, ::CLMHA_UNSUPPORTED,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED,
///         ::CLMHA_OPENCL_ERROR, ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_layer_backward_host(clmha_layer *layer,
                                                 const clmha_backward_args *args);

/// clmha_layer_backward_host() on double arrays: the `data` of args->forward's query, key,
/// value and float masks, of grad_output and grad_weights are doubles, and every
/// ::clmha_grad::data points to a double array (cast to `float *`: the struct's layout is
/// frozen). A float64 layer (::CLMHA_DTYPE_F64) computes and returns its gradients in float64
/// exactly, which is how a finite-difference check (`torch.autograd.gradcheck`) reaches it;
/// other layers take the doubles rounded to their dtype and return their gradients widened.
/// @param[in] layer  the layer
/// @param[in] args   the arguments (the `buffer` fields are ignored)
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (as clmha_layer_backward_host();
///         grad_dtype ::CLMHA_GRAD_F32 for a float64 layer), ::CLMHA_SHAPE_MISMATCH,
///         ::CLMHA_INVALID_MASK, ::CLMHA_UNSUPPORTED, ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_OUT_OF_MEMORY, ::CLMHA_BUILD_FAILED, ::CLMHA_OPENCL_ERROR,
///         ::CLMHA_BLAS_ERROR
CLMHA_API clmha_status clmha_layer_backward_host_f64(clmha_layer *layer,
                                                     const clmha_backward_args *args);

// ---------------------------------------------------------------------------------------------
// Profiling
// ---------------------------------------------------------------------------------------------

/// The stages of a forward pass, in the order they run.
typedef enum clmha_stage {
    CLMHA_STAGE_PROJECT = 0,  ///< input projections (GEMMs)
    CLMHA_STAGE_SPLIT,        ///< head split, in_proj_bias, bias_k/bias_v, zero key
    CLMHA_STAGE_SCORES,       ///< Q·Kᵀ (strided batched GEMM); a user core's whole time; the
                              ///< whole unfused core, weights output included, when it works
                              ///< in chunks (::clmha_impl)
    CLMHA_STAGE_SOFTMAX,      ///< masks, softmax, dropout
    CLMHA_STAGE_AV,           ///< weights · V (strided batched GEMM)
    CLMHA_STAGE_FUSED,        ///< the fused attention core (instead of the three above)
    CLMHA_STAGE_MERGE,        ///< head merge
    CLMHA_STAGE_OUT_PROJ,     ///< output projection (bias rows + GEMM)
    CLMHA_STAGE_WEIGHTS,      ///< attention weights output (copy or head average)
    CLMHA_STAGE_COUNT         ///< number of stages (not a stage)
} clmha_stage;

/// Turns per-stage timing on or off for later forward calls of @p layer. With it on, each
/// forward call enqueues a marker after every stage (a few OpenCL events per call). The
/// context's queue must have CL_QUEUE_PROFILING_ENABLE (contexts made by clmha do). Either way,
/// the timings of earlier calls are dropped.
/// @param[in] layer  the layer
/// @param[in] on     true to turn timing on, false to turn it off
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (@p layer NULL), ::CLMHA_UNSUPPORTED
///         (turning it on for a queue without profiling)
CLMHA_API clmha_status clmha_layer_set_profiling(clmha_layer *layer, bool on);

/// Waits for the last forward call of @p layer made with profiling on (including the one of
/// clmha_layer_bake()), when it succeeded, and returns the device time of each stage in milliseconds (0 for stages
/// that did not run: weights without need_weights, softmax and weights·V with a user core).
/// The stage time is the time between the end of the previous stage and the end of this one on
/// the in-order queue.
/// @param[in]  layer  the layer
/// @param[out] ms     ::CLMHA_STAGE_COUNT times, indexed by ::clmha_stage
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (NULL, profiling off, no profiled call
///         yet, or the last forward call failed: a failed call drops the times of the calls
///         before it), ::CLMHA_OPENCL_ERROR, ::CLMHA_OUT_OF_MEMORY (waiting for or querying a marker
///         failed)
CLMHA_API clmha_status clmha_layer_stage_times(clmha_layer *layer,
                                               double ms[CLMHA_STAGE_COUNT]);

/// A short name of a stage.
/// @param[in] stage  any value
/// @return "project", "split", "scores", "softmax", "av", "fused", "merge", "out_proj" or
///         "weights" (in ::clmha_stage order), or
///         "?" for a value that is not a stage (including ::CLMHA_STAGE_COUNT). A static string.
CLMHA_API const char *clmha_stage_name(clmha_stage stage);

// ---------------------------------------------------------------------------------------------
// CPU reference
// ---------------------------------------------------------------------------------------------

/// Plain double-precision CPU implementation of the same forward pass, for checking results.
/// Parameters are host arrays by PyTorch name, row-major float32 (NULL where the layer has none;
/// arrays for parameters the layer does not have are ignored). Zero-initialise with
/// struct_size set; struct_size must cover out_proj_weight.
/// @code
/// clmha_reference_params params = {.struct_size = sizeof params, .in_proj_weight = w_in,
///                                  .out_proj_weight = w_out};
/// @endcode
typedef struct clmha_reference_params {
    size_t struct_size;            ///< sizeof(clmha_reference_params) (see ::CLMHA_STRUCT_INIT)
    const float *in_proj_weight;   ///< (3E, E); used when not NULL and kdim == vdim == E, else
                                   ///< the three weights below are
    /// @var q_proj_weight
    /// (E, E), used when in_proj_weight is not.
    /// @var k_proj_weight
    /// (E, kdim), likewise.
    /// @var v_proj_weight
    /// (E, vdim), likewise.
    const float *q_proj_weight, *k_proj_weight, *v_proj_weight;
    const float *in_proj_bias;     ///< (3E), required with bias
    const float *out_proj_weight;  ///< (E, E), required
    const float *out_proj_bias;    ///< (E), required with bias
    /// @var bias_k
    /// (1, 1, E), required with add_bias_kv.
    /// @var bias_v
    /// (1, 1, E), required with add_bias_kv.
    const float *bias_k, *bias_v;
    /// (H), with clmha_layer_desc::alibi; NULL: clmha_alibi_slopes(). Added after 0.1.0.
    const float *alibi_slopes;
    /// (H), required with clmha_layer_desc::sinks. Added after 0.1.0.
    const float *sinks;
    /// @var score_mod
    /// With clmha_layer_desc::mod_source: the host forms (C, double precision) of the functions
    /// it defines, called with the layer's p (clmha_layer_desc::mod_params; NULL: zeros). The
    /// reference needs one for each function the source defines (clmha_score_mod_grad only for
    /// clmha_reference_backward()): it runs no OpenCL C. Added after 0.1.0.
    /// @var score_mod_grad
    /// See @ref score_mod.
    /// @var mask_mod
    /// See @ref score_mod.
    clmha_host_score_fn score_mod, score_mod_grad;
    clmha_host_mask_fn mask_mod;
} clmha_reference_params;

/// Computes the forward pass on the CPU in double precision, with the same semantics (the same
/// validation, the same Philox dropout, zeros for fully masked rows) as
/// clmha_layer_forward_host(). Reads the `data` fields of @p args. Outputs are doubles, in the
/// same shapes as clmha_layer_forward(). Needs no OpenCL device and no context; safe to call
/// from any thread.
/// @param[in]  desc           the layer configuration (checked as by clmha_layer_create())
/// @param[in]  params         the parameters
/// @param[in]  args           the inputs and options (the `buffer` fields are ignored)
/// @param[out] output         room for @p output_count doubles
/// @param[in]  output_count   N·L·E (L·E unbatched)
/// @param[out] weights        room for @p weights_count doubles with need_weights, else ignored
///                            (may be NULL)
/// @param[in]  weights_count  0 without need_weights, else N·L·S' averaged or N·H·L·S' per head
/// @param[out] message        optional buffer (may be NULL): "" on success, the reason on
///                            failure
/// @param[in]  message_size   size of @p message in bytes
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also a struct_size of 0 or too small in
///         @p desc, @p params or @p args; a host form of a function mod_source does not
///         define), ::CLMHA_UNSUPPORTED (one of them from a newer header, using a newer field;
///         a mod_source function without its host form), ::CLMHA_SHAPE_MISMATCH,
///         ::CLMHA_INVALID_MASK, ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_reference_forward(const clmha_layer_desc *desc,
                                               const clmha_reference_params *params,
                                               const clmha_forward_args *args, double *output,
                                               size_t output_count, double *weights,
                                               size_t weights_count, char *message,
                                               size_t message_size);

/// clmha_attention_forward() on the CPU in double precision: the same checks (shapes, masks,
/// options, `data` pointers), the same Philox dropout, zeros for fully masked rows. Reads the
/// `data` fields of @p args. Needs no OpenCL device and no context; safe from any thread.
/// @param[in]  args           the tensors and options
/// @param[out] output         room for @p output_count doubles, in the query's layout
/// @param[in]  output_count   N·H·L·D_v
/// @param[out] lse            optional (NULL): room for @p lse_count doubles, (N, H, L)
/// @param[in]  lse_count      N·H·L with @p lse, else 0
/// @param[out] weights        optional (NULL): room for @p weights_count doubles,
///                            (N, H, L, S), after dropout
/// @param[in]  weights_count  N·H·L·S with @p weights, else 0
/// @param[out] message        optional buffer (may be NULL): "" on success, the reason on
///                            failure
/// @param[in]  message_size   size of @p message in bytes
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also a host form of a function
///         mod_source does not define), ::CLMHA_UNSUPPORTED (@p args from a newer header, using
///         a newer field; a mod_source function without its host form),
///         ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK, ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_reference_attention(const clmha_attention_args *args,
                                                 double *output, size_t output_count,
                                                 double *lse, size_t lse_count,
                                                 double *weights, size_t weights_count,
                                                 char *message, size_t message_size);

/// Gradients computed by clmha_reference_backward(), in double precision, by PyTorch name and
/// in the same shapes as ::clmha_backward_args (NULL: not wanted). Always written, never
/// accumulated. Zero-initialise with struct_size set.
typedef struct clmha_reference_grads {
    size_t struct_size;         ///< sizeof(clmha_reference_grads)
    double *query;              ///< the query's gradient (self-attention: the whole input's)
    double *key;                ///< the key's (with value's use when value was not given)
    double *value;              ///< the value's
    double *in_proj_weight;     ///< (3E, E)
    double *q_proj_weight;      ///< (E, E)
    double *k_proj_weight;      ///< (E, kdim)
    double *v_proj_weight;      ///< (E, vdim)
    double *in_proj_bias;       ///< (3E)
    double *out_proj_weight;    ///< (E, E)
    double *out_proj_bias;      ///< (E)
    double *bias_k;             ///< (1, 1, E)
    double *bias_v;             ///< (1, 1, E)
    double *attn_mask;          ///< a float attn_mask's gradient, its shape
    double *key_padding_mask;   ///< a float key_padding_mask's gradient, its shape
    double *sinks;              ///< (H): the sinks' gradient (a layer's, or the function's)
} clmha_reference_grads;

/// The backward pass of clmha_reference_forward() on the CPU in double precision: the gradients
/// of every input and parameter given the gradient of the output (and optionally of the
/// weights, for a call with need_weights), with the semantics of clmha_layer_backward()
/// (dropout replayed from args->rng, zero gradients on fully masked rows). Needs no device.
/// @param[in]  desc          the layer configuration
/// @param[in]  params        the parameters
/// @param[in]  args          the forward call's inputs and options (`data` fields)
/// @param[in]  grad_output   the output's gradient, the output's shape
/// @param[in]  grad_weights  the weights' gradient, the weights' shape, or NULL
/// @param[in,out] grads      struct_size set; the destinations (NULL: not wanted)
/// @param[out] message       optional buffer: "" on success, the reason on failure
/// @param[in]  message_size  size of @p message
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT, ::CLMHA_UNSUPPORTED,
///         ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK, ::CLMHA_SIZE_OVERFLOW,
///         ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_reference_backward(const clmha_layer_desc *desc,
                                                const clmha_reference_params *params,
                                                const clmha_forward_args *args,
                                                const float *grad_output,
                                                const float *grad_weights,
                                                const clmha_reference_grads *grads,
                                                char *message, size_t message_size);

/// The backward pass of clmha_reference_attention() on the CPU in double precision: the
/// gradients of the query, key, value and (for a float mask) attn_mask given the output's
/// gradient, with the same semantics (dropout replayed from args->rng; fully masked rows give
/// zero gradients; with enable_gqa a key/value head's gradient sums its query heads'; a
/// broadcast mask's gradient sums over the dimensions it is broadcast along, in its own shape).
/// Needs no device.
/// @param[in]  args          the forward call's tensors and options (`data` fields)
/// @param[in]  grad_output   the output's gradient, the output's shape and layout
/// @param[in,out] grads      struct_size set; its query, key, value and attn_mask
///                           destinations (NULL: not wanted; in the shapes of the tensors);
///                           the other fields are ignored
/// @param[out] message       optional buffer: "" on success, the reason on failure
/// @param[in]  message_size  size of @p message
/// @return ::CLMHA_SUCCESS, ::CLMHA_INVALID_ARGUMENT (also grads->attn_mask without a float
///         mask), ::CLMHA_UNSUPPORTED, ::CLMHA_SHAPE_MISMATCH, ::CLMHA_INVALID_MASK,
///         ::CLMHA_SIZE_OVERFLOW, ::CLMHA_OUT_OF_MEMORY
CLMHA_API clmha_status clmha_reference_attention_backward(const clmha_attention_args *args,
                                                          const float *grad_output,
                                                          const clmha_reference_grads *grads,
                                                          char *message, size_t message_size);

#ifdef __cplusplus
}
#endif

#endif  // CLMHA_H
