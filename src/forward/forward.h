// What the forward pass (forward.c) offers the backward pass besides its public functions.
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

#endif
