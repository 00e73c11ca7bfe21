// Devices: enumeration and selection by spec string (clmha_device_count, clmha_device_describe,
// clmha_device_select), their description and the driver bugs clmha works around.
#ifndef CLMHA_DEVICE_DEVICE_H
#define CLMHA_DEVICE_DEVICE_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// Known driver bugs clmha works around (docs/design.md, "Driver quirks").
typedef struct clmha__quirks {
    // Mesa llvmpipe (gallivm): every loop of a kernel ends once a work-item has run this many
    // loop iterations in total, over all its loops (0: no such limit). See
    // tools/driver-bugs/llvmpipe-loop-limit.
    size_t loop_limit;
    // Clover: its compiler aborts the process on vloadN, so the fused kernel is built with VW 1.
    bool no_vload;
    // PoCL: a native kernel listing several buffers gets their memory at the wrong places, and a
    // sub-buffer's parent's memory. See tools/driver-bugs/pocl-native-kernel-buffers; the host
    // GEMMs avoid it on every driver (context/gemm.c), this only names it.
    bool native_buffers;
} clmha__quirks;

// The quirks of the device @p info describes.
CLMHA__HIDDEN clmha__quirks clmha__device_quirks(const clmha_device_info *info);

// Fills a device info record for one device.
CLMHA__HIDDEN void clmha__device_describe(cl_platform_id platform, cl_device_id device,
                                          unsigned platform_index, unsigned device_index,
                                          clmha_device_info *info);

#endif
