// The host fused core (host_fused.c): what the tests read of it.
#ifndef CLMHA_CORES_HOST_FUSED_H
#define CLMHA_CORES_HOST_FUSED_H

#include <stddef.h>

#include "base/defs.h"

// How many calls the host fused core has enqueued in this process (for the tests).
CLMHA__HIDDEN size_t clmha__host_fused_calls(void);

#endif
