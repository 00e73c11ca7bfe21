// Built-in tunings (see builtin.h): the table of CLBlast 1.5.3 parameter sets per device class
// and the matching.
//
// How a class is recognised. Both CPU runtimes compile for the host's vector ISA and report its
// float width as CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT: 16 with AVX-512 (PoCL 3.1's
// skylake-avx512 target and Intel's runtime here report 16), 8 with AVX/AVX2, 4 with SSE or
// NEON. The width is what the parameter sets depend on (VWM, the rows a work-item keeps in
// registers), and it needs no list of CPU names: PoCL 3.1 puts its LLVM CPU name in the device
// name ("pthread-skylake-avx512-..."), PoCL 3.0 from PyPI does not ("pthread-Intel(R) Xeon(R)
// Processor"), and both name their target in CL_DEVICE_VERSION ("HSTR: pthread-x86_64-..."),
// where the PoCL rows look for "x86_64" (an Arm CPU with SVE-512 also reports 16).
//
// How the sets were chosen (docs/design.md, "Built-in parameter sets", has the numbers and the
// commands; all measured on a shared 2-core Intel Xeon, Sapphire Rapids class, AVX-512):
// - PoCL x86-64 AVX-512: the Xgemm set and split of a 300 s `clmha tune` there (4×4 work-items
//   of 16×16 floats in float8 × float4 steps, no local memory; indirect from 71³); XgemmDirect
//   stays CLBlast's generic set (the search kept it). sgemm 1024³ in turns (bench/gemm_ratio):
//   3.6x CLBlast's generic set; the set a search found on a Zen 4 (the tuner's first seed)
//   reaches 0.82x of it here, so sets carry over between AVX-512 CPUs with a loss of that order.
// - Intel CPU runtime: the runtime vectorises across work-items (its implicit vectoriser), so
//   what PoCL likes (few work-items with float8 vectors) runs 3-5x slower than CLBlast's generic
//   set there, and a 420 s `clmha tune` seeded with PoCL's sets found nothing faster than the
//   generic set. A hand search with bench/gemm_ratio (14 sets, row-major A·Bᵀ 1024³, in turns)
//   chose 16×16 work-items of 4×4 floats, scalar (VWM = VWN = 1), strided (STRM = STRN = 1) so
//   that neighbouring work-items read neighbouring floats, tiles in local memory (16 KiB):
//   6x the generic set. The split is lowered to 256³ so that the layer's output projection
//   (1024×512×512 at N 8, L 128) takes this kernel instead of the generic direct one. Its set is
//   used whatever the width (measured with AVX-512 only).
//
// The AVX2 row is NOT MEASURED: no AVX2-only CPU was at hand, and neither PoCL 3.1 (Debian; it
// ignores POCL_LLVM_CPU_NAME and always targets the host, skylake-avx512 here) nor PoCL from
// PyPI (icelake-client) could be made to compile for an AVX2 target on this AVX-512 machine. It
// is the AVX-512 set with the work-item's register tile halved in both directions: the AVX-512
// set keeps 16×16 accumulators per work-item (16 of the 32 zmm registers, in float8 × float4
// steps); 8×8 keeps the same half of AVX2's 16 ymm registers (8), with the same vector widths
// (VWM 8 is one ymm register) and K loop. It passes the same checks and gives exact results
// (test_builtin, bench/gemm_ratio --xgemm on this machine), but its speed on an AVX2 CPU is
// unknown: measure it there (bench/gemm_ratio, `clmha tune`) before trusting it.
#include "tuning_store/builtin.h"

#include <stdatomic.h>
#include <string.h>

#define POCL "Portable Computing Language"

// Rows in matching order. Xgemm values in CLBlast's order (GEMMK KREG KWG KWI MDIMA MDIMC MWG
// NDIMB NDIMC NWG SA SB STRM STRN VWM VWN), XgemmDirect's (KWID MDIMAD MDIMCD NDIMBD NDIMCD
// PADA PADB VWMD VWND WGD), then XGEMM_MIN_INDIRECT_SIZE.
const clmha__builtin_set clmha__builtin_sets[] = {
    {.name = "PoCL x86-64 AVX-512",
     .platform = POCL,
     .isa = "x86_64",
     .float_width = 16,
     .measured = true,
     .tuning = {.has_xgemm = true,
                .has_direct = true,
                .has_routine = true,
                .xgemm = {0, 1, 32, 4, 4, 4, 64, 4, 4, 64, 0, 0, 0, 0, 8, 4},
                .direct = {2, 8, 8, 8, 8, 1, 1, 1, 1, 16},
                .min_indirect = 71}},
    {.name = "PoCL x86-64 AVX2",
     .platform = POCL,
     .isa = "x86_64",
     .float_width = 8,
     .measured = false,  // derived from the AVX-512 row (see above)
     .tuning = {.has_xgemm = true,
                .has_direct = true,
                .has_routine = true,
                .xgemm = {0, 1, 32, 4, 4, 4, 32, 4, 4, 32, 0, 0, 0, 0, 8, 4},
                .direct = {2, 8, 8, 8, 8, 1, 1, 1, 1, 16},
                .min_indirect = 71}},
    {.name = "Intel CPU runtime",
     .platform = "Intel(R) OpenCL",
     .isa = NULL,
     .float_width = 0,
     .measured = true,
     .tuning = {.has_xgemm = true,
                .has_direct = true,
                .has_routine = true,
                .xgemm = {0, 1, 32, 2, 16, 16, 64, 16, 16, 64, 1, 1, 1, 1, 1, 1},
                .direct = {2, 8, 8, 8, 8, 1, 1, 1, 1, 16},
                .min_indirect = 256}},
};
const size_t clmha__builtin_set_count = sizeof clmha__builtin_sets / sizeof clmha__builtin_sets[0];

static atomic_bool disabled;  // clmha__test_enable_builtin()

void clmha__test_enable_builtin(bool enable) { disabled = !enable; }

static bool contains(const char *text, const char *part) {
    return text && strstr(text, part) != NULL;
}

const clmha__builtin_set *clmha__builtin_match(const clmha__builtin_device *d) {
    if (disabled || !(d->type & CL_DEVICE_TYPE_CPU)) return NULL;
    for (size_t i = 0; i < clmha__builtin_set_count; ++i) {
        const clmha__builtin_set *s = &clmha__builtin_sets[i];
        if (!contains(d->platform_name, s->platform)) continue;
        if (s->isa && !contains(d->device_version, s->isa) && !contains(d->device_name, s->isa))
            continue;
        if (s->float_width && d->native_float_width != s->float_width) continue;
        return s;
    }
    return NULL;
}
