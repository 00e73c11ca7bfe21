// What the forward pass (forward.c) offers the host-array path (forward_host.c) and the backward
// pass besides its public functions.
#ifndef CLMHA_FORWARD_FORWARD_H
#define CLMHA_FORWARD_FORWARD_H

#include <stdbool.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

// Everything a forward call checks before it enqueues anything: the shapes and masks of
// @p args (resolved into @p d), its impl, and either its device buffers (@p on_device: present,
// of this context, large enough) or its host data pointers. @p args is in this library's layout.
CLMHA__HIDDEN clmha_status clmha__forward_validate(clmha_layer *layer,
                                                   const clmha_forward_args *args,
                                                   bool on_device, clmha__dims *d);

// Reads the caller's args into @p in, this library's layout (base/struct_in.h, docs/abi.md), and
// points *args at it.
CLMHA__HIDDEN clmha_status clmha__forward_args_in(clmha_context *ctx, clmha_forward_args *in,
                                                  const clmha_forward_args **args);

// Returns @p st; when it is a failure, first drops the layer's stage times: they are those of
// the last forward call, so a failed call drops the earlier call's (clmha_layer_stage_times()
// then says that the last call failed).
CLMHA__HIDDEN clmha_status clmha__forward_times_dropped(clmha_layer *layer, clmha_status st);

#endif
