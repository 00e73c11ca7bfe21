// The backward pass (backward.c) as the host-array form (backward_host.c) uses it.
#ifndef CLMHA_BACKWARD_BACKWARD_H
#define CLMHA_BACKWARD_BACKWARD_H

#include <stdbool.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

// The gradients of clmha_backward_args as a table: their number, the field of gradient @p g
// (0 to the count - 1, in the struct's order: query, key, value, in_proj_weight, q/k/v_proj_weight,
// in_proj_bias, out_proj.weight, out_proj.bias, bias_k, bias_v, attn_mask, key_padding_mask).
CLMHA__HIDDEN int clmha__backward_grad_count(void);
CLMHA__HIDDEN const clmha_grad *clmha__backward_grad(const clmha_backward_args *a, int g);

// The sinks' gradient (cl/backward.cl's sinks_grad): @p out at @p out_off (H floats, added
// to with @p accumulate) from the head tiles @p o and @p d_o (N*H, L, D), the log-sum-exp rows
// @p lse at @p lse_off (and each row's D = sum_j P dP in @p drow, or NULL: dO.O) and the
// sinks at @p sinks_off, for @p n batch items and @p l rows. *@p kernel: the caller's copy of
// the kernel, made on first use (the caller releases it with its state).
CLMHA__HIDDEN clmha_status clmha__sinks_grad(clmha_layer *layer, cl_kernel *kernel, cl_mem o,
                                             cl_mem d_o,
                                             cl_mem lse, size_t lse_off, cl_mem drow,
                                             cl_mem sinks,
                                             size_t sinks_off, cl_mem out, size_t out_off,
                                             bool accumulate, size_t n, size_t l);

// Checks @p a (in this library's layout) for a call on device buffers (@p on_device) or host
// arrays: its forward arguments (copied into @p fwd, resolved into @p d), the saved state, the
// shapes of grad_output and grad_weights, and which gradients the layer and call can give.
// Buffers are checked by clmha_layer_backward() itself.
CLMHA__HIDDEN clmha_status clmha__backward_resolve(clmha_layer *layer,
                                                   const clmha_backward_args *a,
                                                   clmha_forward_args *fwd, clmha__dims *d,
                                                   bool on_device);

// The floats of gradient @p g of a call of sizes @p d on @p layer (0: it has none).
CLMHA__HIDDEN size_t clmha__backward_grad_floats(const clmha_layer *layer, const clmha__dims *d,
                                                 int g);

#endif
