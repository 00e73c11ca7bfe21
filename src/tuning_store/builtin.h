// Built-in tunings: CLBlast parameter sets per class of devices (PoCL on x86-64 with AVX-512 or
// AVX2, Intel's oneAPI CPU runtime), applied at context creation when the device has no stored
// tuning, so that a machine that never ran `clmha tune` does not run CLBlast's generic
// parameters (5-6x slower on these CPUs). The table and the matching are here; the store
// (store.h) applies the set it matches. Precedence: stored tuning file > built-in set > CLBlast's
// own parameters.
#ifndef CLMHA_TUNING_STORE_BUILTIN_H
#define CLMHA_TUNING_STORE_BUILTIN_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

#include "tuning_store/params.h"

// What the matching reads of a device (store.c fills it from the driver; tests write it).
typedef struct clmha__builtin_device {
    cl_device_type type;         // CL_DEVICE_TYPE
    const char *platform_name;   // CL_PLATFORM_NAME
    const char *device_name;     // CL_DEVICE_NAME
    const char *device_version;  // CL_DEVICE_VERSION (PoCL's names its LLVM target: "HSTR: ...")
    cl_uint native_float_width;  // CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT
} clmha__builtin_device;

// One row of the table: the devices it matches and its parameters.
typedef struct clmha__builtin_set {
    const char *name;          // the class, as notes print it: "PoCL x86-64 AVX-512"
    const char *platform;      // the platform name contains this
    const char *isa;           // CL_DEVICE_VERSION or the device name contains this (NULL: any)
    cl_uint float_width;       // CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT must be this (0: any)
    bool measured;             // false: derived, not measured on such a device (see builtin.c)
    clmha__tuning tuning;      // Xgemm, XgemmDirect and GemmRoutine; no fused tiles
} clmha__builtin_set;

// The table, in matching order, and its length.
CLMHA__HIDDEN extern const clmha__builtin_set clmha__builtin_sets[];
CLMHA__HIDDEN extern const size_t clmha__builtin_set_count;

// The first row that matches a CPU @p d, or NULL (GPUs and other devices: CLBlast's database
// holds their tunings; unknown CPUs: nothing measured).
CLMHA__HIDDEN const clmha__builtin_set *clmha__builtin_match(const clmha__builtin_device *d);

// Test hook (reachable only by linking libclmha.a): false makes clmha__builtin_match() match
// nothing, as before built-in sets existed (the stored-file tests); true restores it.
CLMHA__HIDDEN void clmha__test_enable_builtin(bool enable);

#endif
