// `clmha devices`: every OpenCL platform and device, with the spec string that selects it.
#define _POSIX_C_SOURCE 200809L

#include "cli.h"

#include <stdio.h>
#include <stdlib.h>

static const char *usage_devices =
    "usage: clmha devices\n"
    "\n"
    "Lists every OpenCL device of every platform: type, compute units, global and local\n"
    "memory, largest allocation, fp16/fp64 support, driver version, and the spec string\n"
    "(\"P:D\", in brackets) that selects it with --device or $CLMHA_DEVICE.\n"
    "\n"
    "options:\n"
    "  --help, -h   print this help\n";

static const char *type_name(cl_device_type t) {
    if (t & CL_DEVICE_TYPE_GPU) return "GPU";
    if (t & CL_DEVICE_TYPE_CPU) return "CPU";
    if (t & CL_DEVICE_TYPE_ACCELERATOR) return "accelerator";
    return "other";
}

int clmha__cli_devices(int argc, char **argv) {
    int rc;
    if (!clmha__cli_parse_options("devices", argc, argv, NULL, 0, usage_devices, &rc)) return rc;
    size_t count = 0;
    if (clmha_device_count(&count) != CLMHA_SUCCESS) {
        clmha__cli_report("devices", "could not list the OpenCL platforms: %s",
                          clmha_last_create_error());
        return EXIT_REFUSED;
    }
    if (count == 0) {
        printf("no OpenCL device found (install a driver, e.g. pocl-opencl-icd)\n");
        return EXIT_OK;
    }
    printf("%zu OpenCL device%s; select one with --device SPEC or $CLMHA_DEVICE=SPEC:\n", count,
           count == 1 ? "" : "s");
    for (size_t i = 0; i < count; ++i) {
        clmha_device_info info = {.struct_size = sizeof info};
        if (clmha_device_describe(i, &info) != CLMHA_SUCCESS) {
            clmha__cli_report("devices", "could not describe device %zu: %s", i,
                              clmha_last_create_error());
            return EXIT_REFUSED;
        }
        const clmha_device_info *d = &info;
        printf("[%s] %s / %s\n", d->spec, d->platform_name, d->device_name);
        printf("      type %s, %u compute units, global %llu MiB, local %llu KiB, max alloc %llu "
               "MiB, fp16 %s, fp64 %s, driver %s\n",
               type_name(d->type), d->compute_units,
               (unsigned long long)(d->global_mem_bytes >> 20),
               (unsigned long long)(d->local_mem_bytes >> 10),
               (unsigned long long)(d->max_alloc_bytes >> 20), d->fp16 ? "yes" : "no",
               d->fp64 ? "yes" : "no", d->driver_version);
        const char *note = clmha_device_note(d);
        if (*note) printf("      note: %s\n", note);
    }
    return EXIT_OK;
}
