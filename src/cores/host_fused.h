// The host fused core (host_fused.c): what the tests read of it.
#ifndef CLMHA_CORES_HOST_FUSED_H
#define CLMHA_CORES_HOST_FUSED_H

#include <stddef.h>

#include "base/defs.h"

// The fewest query rows a sequence and keys a call may have for the core on this CPU (128
// with the AVX-512 kernel, 32 with the AVX2 one; host_fused.c has the measurements).
CLMHA__HIDDEN size_t clmha__host_fused_floor(void);

// How many calls the host fused core has enqueued in this process (for the tests).
CLMHA__HIDDEN size_t clmha__host_fused_calls(void);

#endif
