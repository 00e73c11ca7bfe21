// Sized structs across the ABI (docs/abi.md): every struct a caller fills, or the library fills
// for a caller, starts with `size_t struct_size`, the size of that struct in the caller's build.
// These helpers turn a caller's struct of any size into the library's own layout and back.
#ifndef CLMHA_BASE_STRUCT_IN_H
#define CLMHA_BASE_STRUCT_IN_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// The offset just past @p field: the smallest struct_size that covers it.
#define CLMHA__SIZE_THROUGH(type, field) (offsetof(type, field) + sizeof(((type *)0)->field))

// struct_size above this is refused as not a size at all (an uninitialised field, most likely)
// rather than read from: the tail check would otherwise scan that far into the caller's memory.
#define CLMHA__STRUCT_SIZE_MAX 65536

// The smallest struct_size each sized struct accepts: the offset just past its last required
// field in the first released layout (0.1). Fields appended later never raise it.
#define CLMHA__MIN_clmha_layer_desc CLMHA__SIZE_THROUGH(clmha_layer_desc, num_heads)
#define CLMHA__MIN_clmha_forward_args CLMHA__SIZE_THROUGH(clmha_forward_args, query)
#define CLMHA__MIN_clmha_attention_args CLMHA__SIZE_THROUGH(clmha_attention_args, value)
#define CLMHA__MIN_clmha_attention_backward_args \
    CLMHA__SIZE_THROUGH(clmha_attention_backward_args, grad_value_offset)
#define CLMHA__MIN_clmha_reference_params \
    CLMHA__SIZE_THROUGH(clmha_reference_params, out_proj_weight)
#define CLMHA__MIN_clmha_tune_options sizeof(size_t)  // every option is optional
#define CLMHA__MIN_clmha_load_options sizeof(size_t)  // every option is optional
#define CLMHA__MIN_clmha_kv_cache_options CLMHA__SIZE_THROUGH(clmha_kv_cache_options, num_pages)
#define CLMHA__MIN_clmha_backward_args CLMHA__SIZE_THROUGH(clmha_backward_args, grad_output)
#define CLMHA__MIN_clmha_reference_grads sizeof(size_t)  // every gradient is optional
// Structs the library fills: the first field past struct_size, at least.
#define CLMHA__MIN_clmha_tune_report CLMHA__SIZE_THROUGH(clmha_tune_report, default_gflops)
#define CLMHA__MIN_clmha_device_info CLMHA__SIZE_THROUGH(clmha_device_info, device)

// clmha__struct_in() for public struct @p type: CLMHA__STRUCT_IN(clmha_layer_desc, &copy, desc,
// "desc", msg, sizeof msg).
#define CLMHA__STRUCT_IN(type, dst, src, arg, msg, msg_size)                                   \
    clmha__struct_in((dst), sizeof(type), (src), CLMHA__MIN_##type, (arg), #type, (msg),        \
                     (msg_size))
// clmha__struct_out_check() for public struct @p type.
#define CLMHA__STRUCT_OUT_CHECK(type, dst, arg, msg, msg_size)                                  \
    clmha__struct_out_check((dst), CLMHA__MIN_##type, (arg), #type, (msg), (msg_size))

// Reads a struct the caller filled. @p src (named @p arg in messages, of type @p type) starts
// with its struct_size:
//   NULL, 0, below @p min_size or above CLMHA__STRUCT_SIZE_MAX: CLMHA_INVALID_ARGUMENT;
//   up to @p size: those bytes are copied into @p dst and the rest of @p dst is zeroed (fields
//     the caller's header does not have read as 0: "off");
//   above @p size: accepted when every byte past @p size is zero (a caller built against a newer
//     header that uses none of the newer fields), else CLMHA_UNSUPPORTED.
// On success @p dst (the library's struct, @p size bytes) holds the caller's values with its
// struct_size set to @p size, so that it may be passed on to other entry points. On failure
// @p dst is zeroed and the reason is written to @p msg.
CLMHA__HIDDEN clmha_status clmha__struct_in(void *dst, size_t size, const void *src,
                                            size_t min_size, const char *arg, const char *type,
                                            char *msg, size_t msg_size);

// Checks the struct_size the caller set in a struct the library will fill (@p dst, named @p arg,
// of type @p type): NULL, 0, below @p min_size or above CLMHA__STRUCT_SIZE_MAX are
// CLMHA_INVALID_ARGUMENT. Call it before doing any work, then clmha__struct_out().
CLMHA__HIDDEN clmha_status clmha__struct_out_check(const void *dst, size_t min_size,
                                                   const char *arg, const char *type, char *msg,
                                                   size_t msg_size);

// Writes the library's struct @p src (@p size bytes) into the caller's @p dst, whose struct_size
// passed clmha__struct_out_check(): the bytes after struct_size up to min(struct_size, size) are
// copied, bytes from @p size up to a larger struct_size are zeroed, nothing past struct_size is
// written, and struct_size keeps the caller's value.
CLMHA__HIDDEN void clmha__struct_out(void *dst, const void *src, size_t size);

#endif
