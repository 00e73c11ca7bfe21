// Device classes: the defaults of clmha's own kernels per class of devices, in one table
// (src/device/device_class.c).
#ifndef CLMHA_DEVICE_DEVICE_CLASS_H
#define CLMHA_DEVICE_DEVICE_CLASS_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// The defaults of clmha's own kernels for one class of devices: one row of the table in
// src/device/device_class.c.
typedef struct clmha__device_class {
    const char *name;        // "cpu-pocl", "gpu-nvidia", ...
    cl_device_type type;     // the row matches devices of this type (0: any)
    cl_uint vendor_id;       // ... with this CL_DEVICE_VENDOR_ID (0: any)
    const char *platform;    // ... on a platform whose name contains this (NULL: any)
    size_t bq, bk, rpw;      // fused tiles: work-group size, keys per tile, rows per work-item
    size_t vw;               // fused vector width; 0: CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT
    size_t private_floats;   // cap on the fused kernel's per-work-item arrays, in floats
    bool coalesced;          // GPU mapping: split/merge one work-item per float, the fused
                             // kernel's query rows in (padded) local memory, loaded and stored
                             // by adjacent work-items on adjacent floats
    size_t softmax_wg;       // cap on masked_softmax's work-group size
    bool lanes;              // the fused kernel's lanes mapping (cl/cores/fused.cl): each
                             // work-item holds rpw query rows as the lanes of vw-wide vectors,
                             // no local memory, no barrier; private_floats then caps arrays
                             // that live in the L1 cache, not in registers
} clmha__device_class;

// The table row of a device: the first that matches its type, vendor id and platform name (or
// the row forced by clmha__test_force_device_class()).
CLMHA__HIDDEN const clmha__device_class *clmha__device_class_match(cl_device_type type,
                                                                   cl_uint vendor_id,
                                                                   const char *platform_name);

// clmha__device_class_match() for @p device (reads its CL_DEVICE_VENDOR_ID).
CLMHA__HIDDEN const clmha__device_class *clmha__device_class_of(cl_device_id device,
                                                                cl_device_type type,
                                                                const char *platform_name);

// The table row called @p name, or NULL.
CLMHA__HIDDEN const clmha__device_class *clmha__device_class_named(const char *name);

// Test hook (reachable only by linking libclmha.a): contexts created afterwards take table row
// @p name whatever their device ("gpu" runs the GPU mapping on PoCL); NULL restores detection.
// False (and no change) for an unknown name. Not thread-safe against context creation.
CLMHA__HIDDEN bool clmha__test_force_device_class(const char *name);

#endif
