// Device classes: the per-device-class defaults of clmha's own kernels, in one table.
#include "device/device_class.h"

#include <string.h>

// First matching row wins; the last rows catch every CPU, every GPU and anything else. Columns:
// clmha__device_class (device_class.h); VW 0 = the device's native float width.
//
// CPU rows: the tiled mapping was measured on PoCL (AVX-512, N=1, H=8, L=S=2048, D=64):
// work-groups of 64 with 32 keys per tile beat 16/32/128 and 16/64 keys, two rows per work-item
// gained ~20%, and vectors as wide as the native float width (16) ~1.2x over scalar loops. The
// lanes mapping (cl/cores/fused.cl) beat it ~2.5-3x there with one work-item per group, 32 rows
// (two vectors of 16) and 64 keys per tile (32/128 keys and 16/48/64 rows measured within the
// noise or slower); its private budget, 64 KiB, keeps head dims up to 256 in it. It is the
// PoCL row's only: the other CPU runtimes (Intel's, Mesa's llvmpipe with its loop limit and
// clover's missing vloadN) were not measured with it and keep the tiled mapping. Intel's oneAPI CPU
// runtime reports a preferred float width of 1 but a native one of 16, and its fused stage ran
// 5.5x faster with 16: CPUs take the native width. A CPU work-group is a loop on one core, so
// split/merge keep one work-item per tile row (PoCL vectorises its head_dim-long copy) and the
// softmax work-group stays at 16.
//
// GPU rows are not measured (no GPU was at hand): they follow from the hardware. One query row
// per work-item and scalar lanes (SIMT hardware vectorises across work-items; wider vectors
// only add registers), 64 work-items (two NVIDIA warps, one AMD wavefront), split/merge with
// adjacent work-items on adjacent floats, the softmax over 256 work-items. The private budget is
// what keeps the fused kernel's per-work-item arrays in registers: 128 floats of the 255
// registers an NVIDIA thread may hold (and of the 256 VGPRs of an AMD lane) leave room for
// indices and temporaries at a useful occupancy; an Intel GPU thread compiled SIMD16 has 128
// registers of 8 floats shared by 16 lanes, 64 floats a lane.
#define CPU CL_DEVICE_TYPE_CPU
#define GPU CL_DEVICE_TYPE_GPU
#define POCL "Portable Computing Language"
static const clmha__device_class classes[] = {
    // name        type vendor  platform BQ  BK  RPW VW private coalesced softmax_wg lanes
    {"cpu-pocl",   CPU, 0,      POCL,    1,  64, 32, 0, 16384,  false,    16,        true},
    {"cpu-intel",  CPU, 0,      "Intel", 64, 32, 2,  0, 2048,   false,    16,        false},
    {"cpu",        CPU, 0,      NULL,    64, 32, 2,  0, 2048,   false,    16,        false},
    {"gpu-nvidia", GPU, 0x10DE, NULL,    64, 32, 1,  1, 128,    true,     256,       false},
    {"gpu-amd",    GPU, 0x1002, NULL,    64, 32, 1,  1, 128,    true,     256,       false},
    {"gpu-intel",  GPU, 0x8086, NULL,    64, 32, 1,  1, 64,     true,     256,       false},
    {"gpu",        GPU, 0,      NULL,    64, 32, 1,  1, 128,    true,     256,       false},
    // Accelerators and anything else: the GPU mappings, the device's native width.
    {"other",      0,   0,      NULL,    64, 32, 1,  0, 128,    true,     256,       false},
};
#undef CPU
#undef GPU
#undef POCL

enum { CLASS_COUNT = sizeof classes / sizeof classes[0] };

// Test hook: the row every lookup returns (NULL: detect). See device_class.h.
static _Atomic(const clmha__device_class *) forced = NULL;

bool clmha__test_force_device_class(const char *name) {
    if (!name) {
        forced = NULL;
        return true;
    }
    const clmha__device_class *c = clmha__device_class_named(name);
    if (c) forced = c;
    return c != NULL;
}

const clmha__device_class *clmha__device_class_named(const char *name) {
    for (size_t i = 0; i < CLASS_COUNT; ++i)
        if (strcmp(classes[i].name, name) == 0) return &classes[i];
    return NULL;
}

const clmha__device_class *clmha__device_class_match(cl_device_type type, cl_uint vendor_id,
                                                     const char *platform_name) {
    const clmha__device_class *f = forced;
    if (f) return f;
    for (size_t i = 0; i < CLASS_COUNT; ++i) {
        const clmha__device_class *c = &classes[i];
        if (c->type && !(type & c->type)) continue;
        if (c->vendor_id && c->vendor_id != vendor_id) continue;
        if (c->platform && (!platform_name || !strstr(platform_name, c->platform))) continue;
        return c;
    }
    return &classes[CLASS_COUNT - 1];
}

const clmha__device_class *clmha__device_class_of(cl_device_id device, cl_device_type type,
                                                  const char *platform_name) {
    cl_uint vendor = 0;
    clGetDeviceInfo(device, CL_DEVICE_VENDOR_ID, sizeof vendor, &vendor, NULL);
    return clmha__device_class_match(type, vendor, platform_name);
}
