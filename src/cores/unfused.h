// The unfused attention core (src/cores/unfused.c, kernel cl/cores/unfused.cl): what the tests
// read of it besides the core interface (core.h).
#ifndef CLMHA_CORES_UNFUSED_H
#define CLMHA_CORES_UNFUSED_H

#include <stddef.h>

#include "base/defs.h"
#include "layer/layer.h"

// The work-group of @p layer's masked_softmax kernel (its -DWG), within the kernel's limit.
CLMHA__HIDDEN size_t clmha__unfused_softmax_wg(const clmha_layer *layer);

#endif
