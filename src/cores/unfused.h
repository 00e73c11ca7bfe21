// The unfused attention core (src/cores/unfused.c, kernel cl/cores/unfused.cl): what the tests
// read of it besides the core interface (core.h). Its backward pass is
// src/cores/unfused_backward.c (unfused_backward.h), and the steps both run (scores, masked
// softmax) are in src/cores/unfused_shared.c (unfused_shared.h): unfused.c calls
// unfused_backward.c, and both call unfused_shared.c, never the other way.
#ifndef CLMHA_CORES_UNFUSED_H
#define CLMHA_CORES_UNFUSED_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

#include "cores/unfused_backward.h"
#include "cores/unfused_shared.h"

// The work-group of @p layer's masked_softmax kernel (its -DWG), within the kernel's limit.
CLMHA__HIDDEN size_t clmha__unfused_softmax_wg(const clmha_layer *layer);

#endif
