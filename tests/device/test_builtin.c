// Built-in GEMM parameter sets (src/tuning_store/builtin.c): the table is well formed (every set
// passes the checks a stored tuning file gets), class matching picks the right row for sample
// device descriptions, and on this device the precedence holds: stored tuning file > built-in
// set > CLBlast's own parameters, with the note and clmha_context_tuning_source() saying which.
//
// Links libclmha.a (the table and the matching are internal). Criterion runs each test in its
// own process: a context loads its device's tuning once per process.
#define _POSIX_C_SOURCE 200809L

#include <criterion/criterion.h>

#include <clmha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <clblast_c.h>

#include "support.h"
#include "tuning_store/builtin.h"
#include "tuning_store/params.h"

// ---- the table ---------------------------------------------------------------------------------

// The limits of the smallest CPU device a set may meet: 32 KiB of local memory (PoCL and
// Intel's runtime report 256 KiB / 64 KiB here) and 256 work-items per group.
Test(builtin, every_set_passes_the_stored_file_checks) {
    cr_assert_gt(clmha__builtin_set_count, 0);
    for (size_t i = 0; i < clmha__builtin_set_count; ++i) {
        const clmha__builtin_set *s = &clmha__builtin_sets[i];
        cr_assert_not_null(s->name);
        cr_assert_not_null(s->platform, "%s", s->name);
        char msg[512] = "";
        cr_expect(clmha__tuning_check(&s->tuning, 32768, 256, msg, sizeof msg), "%s: %s",
                  s->name, msg);
        // Complete sets: applying one replaces every GEMM kernel's parameters, whatever was
        // in effect; the fused tiles stay the device class's (device_class.c).
        cr_expect(s->tuning.has_xgemm && s->tuning.has_direct && s->tuning.has_routine, "%s",
                  s->name);
        cr_expect(!s->tuning.has_fused, "%s", s->name);
        cr_expect_neq(s->tuning.xgemm[6], 128, "%s: stored_tuning_wins tells sets by MWG 128",
                      s->name);
        for (size_t j = 0; j < i; ++j)
            cr_expect_str_neq(s->name, clmha__builtin_sets[j].name, "names are unique");
    }
}

Test(builtin, classes_match_sample_devices) {
    static const char *const pocl = "Portable Computing Language";
    static const struct {
        cl_device_type type;
        const char *platform, *device, *version;
        cl_uint width;
        const char *want;  // NULL: no built-in set
    } cases[] = {
        // Debian's PoCL 3.1 on this machine
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-skylake-avx512-Intel(R) Xeon(R) Processor",
         "OpenCL 3.0 PoCL HSTR: pthread-x86_64-pc-linux-gnu-skylake-avx512", 16,
         "PoCL x86-64 AVX-512"},
        // PoCL from PyPI: no CPU name in the device name, the target in the version
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-Intel(R) Xeon(R) Processor",
         "OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-icelake-client", 16,
         "PoCL x86-64 AVX-512"},
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-znver4-AMD Ryzen 9 7950X",
         "OpenCL 3.0 PoCL HSTR: pthread-x86_64-pc-linux-gnu-znver4", 16, "PoCL x86-64 AVX-512"},
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-haswell-Intel(R) Core(TM) i7-4770",
         "OpenCL 3.0 PoCL HSTR: pthread-x86_64-pc-linux-gnu-haswell", 8, "PoCL x86-64 AVX2"},
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-znver3-AMD EPYC 7763",
         "OpenCL 3.0 PoCL HSTR: pthread-x86_64-pc-linux-gnu-znver3", 8, "PoCL x86-64 AVX2"},
        // No version string to read: the device name's target is enough
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-x86_64-skylake-avx512", NULL, 16,
         "PoCL x86-64 AVX-512"},
        // SSE only, Arm (also with 512-bit SVE), an unknown width: nothing measured
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-nehalem",
         "OpenCL 3.0 PoCL HSTR: pthread-x86_64-pc-linux-gnu-nehalem", 4, NULL},
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-neoverse-n1",
         "OpenCL 3.0 PoCL HSTR: pthread-aarch64-unknown-linux-gnu-neoverse-n1", 4, NULL},
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-a64fx",
         "OpenCL 3.0 PoCL HSTR: pthread-aarch64-unknown-linux-gnu-a64fx", 16, NULL},
        {CL_DEVICE_TYPE_CPU, pocl, "pthread-skylake-avx512", "OpenCL 3.0 PoCL HSTR: "
         "pthread-x86_64-pc-linux-gnu-skylake-avx512", 0, NULL},
        // Intel's oneAPI CPU runtime: any width
        {CL_DEVICE_TYPE_CPU, "Intel(R) OpenCL", "Intel(R) Xeon(R) Processor",
         "OpenCL 3.0 (Build 0)", 16, "Intel CPU runtime"},
        {CL_DEVICE_TYPE_CPU, "Intel(R) OpenCL", "Intel(R) Core(TM) i7-10700", "OpenCL 3.0", 8,
         "Intel CPU runtime"},
        // GPUs (CLBlast's database), other CPU drivers, Oclgrind (every type bit)
        {CL_DEVICE_TYPE_GPU, "Intel(R) OpenCL Graphics", "Intel(R) UHD Graphics 770",
         "OpenCL 3.0 NEO", 8, NULL},
        {CL_DEVICE_TYPE_GPU, "NVIDIA CUDA", "NVIDIA GeForce RTX 4090", "OpenCL 3.0 CUDA", 1, NULL},
        {CL_DEVICE_TYPE_GPU, pocl, "NVIDIA GeForce RTX 4090", "OpenCL 3.0 PoCL HSTR: CUDA-sm_89",
         1, NULL},
        {CL_DEVICE_TYPE_CPU, "rusticl", "llvmpipe (LLVM 15.0.6, 256 bits)", "OpenCL 3.0", 8,
         NULL},
        {CL_DEVICE_TYPE_CPU | CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR, "Oclgrind",
         "Oclgrind Simulator", "OpenCL 1.2 (Oclgrind 21.10)", 16, NULL},
        {CL_DEVICE_TYPE_CPU, NULL, NULL, NULL, 16, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        clmha__builtin_device d = {cases[i].type, cases[i].platform, cases[i].device,
                                   cases[i].version, cases[i].width};
        const clmha__builtin_set *s = clmha__builtin_match(&d);
        const char *got = s ? s->name : "(none)", *want = cases[i].want ? cases[i].want : "(none)";
        cr_expect_str_eq(got, want, "case %zu: %s / %s, width %u", i,
                         cases[i].platform ? cases[i].platform : "(null)",
                         cases[i].device ? cases[i].device : "(null)", cases[i].width);
    }
    // The test hook turns matching off.
    clmha__builtin_device avx512 = {CL_DEVICE_TYPE_CPU, pocl, "pthread-skylake-avx512",
                                    "HSTR: pthread-x86_64-pc-linux-gnu-skylake-avx512", 16};
    clmha__test_enable_builtin(false);
    cr_expect_null(clmha__builtin_match(&avx512));
    clmha__test_enable_builtin(true);
    cr_expect_not_null(clmha__builtin_match(&avx512));
}

// ---- on this device: precedence and what the library says ---------------------------------------

typedef struct fixture {
    char dir[64];
    clmha_device_info info;
    const clmha__builtin_set *set;  // this device's built-in set, or NULL
} fixture;

// A fresh, empty tuning folder; the device and its built-in set. Skips without a device.
static void setup(fixture *f, const char *tuning_env) {
    memset(f, 0, sizeof *f);
    f->info.struct_size = sizeof f->info;
    char msg[1024];
    if (clmha_device_select(getenv("CLMHA_DEVICE"), &f->info, msg, sizeof msg) != CLMHA_SUCCESS)
        cr_skip_test("no OpenCL device: %s", msg);
    tmpdir_make(f->dir, sizeof f->dir, "clmha-builtin");
    setenv("CLMHA_TUNING_DIR", f->dir, 1);
    if (tuning_env)
        setenv("CLMHA_TUNING", tuning_env, 1);
    else
        unsetenv("CLMHA_TUNING");
    char version[256] = "";
    cl_uint width = 0;
    clGetDeviceInfo(f->info.device, CL_DEVICE_VERSION, sizeof version - 1, version, NULL);
    clGetDeviceInfo(f->info.device, CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT, sizeof width, &width,
                    NULL);
    clmha__builtin_device d = {f->info.type, f->info.platform_name, f->info.device_name, version,
                               width};
    f->set = clmha__builtin_match(&d);
}

static clmha_context *make_context(void) {
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS, "%s",
                 clmha_last_create_error());
    return ctx;
}

// The exported tuning's Xgemm MWG (-1: none exported), which tells the sets below apart.
static long exported_mwg(clmha_context *ctx) {
    char json[8192];
    size_t needed = 0;
    if (clmha_context_tuning_export(ctx, json, sizeof json, &needed) != CLMHA_SUCCESS) return -1;
    const char *x = strstr(json, "\"Xgemm\"");
    const char *m = x ? strstr(x, "\"MWG\":") : NULL;
    return m ? strtol(m + strlen("\"MWG\":"), NULL, 10) : -1;
}

Test(builtin, applied_without_a_stored_tuning, .timeout = 300) {
    fixture f;
    setup(&f, NULL);
    clmha_context *ctx = make_context();
    char note[2048];
    cr_assert_eq(clmha_context_tuning_note(ctx, note, sizeof note), CLMHA_SUCCESS);
    // Before exported_mwg(): an export with nothing applied records CLMHA_NOT_READY's message.
    cr_expect_str_eq(clmha_context_last_error(ctx), "", "applying it left no error");
    if (f.set) {
        cr_expect_eq(clmha_context_tuning_source(ctx), CLMHA_TUNING_SOURCE_BUILTIN);
        char want[128];
        snprintf(want, sizeof want, "built-in parameters for %s", f.set->name);
        cr_expect(strstr(note, want) && strstr(note, "not found"), "%s", note);
        cr_expect_eq(exported_mwg(ctx), (long)f.set->tuning.xgemm[6]);  // MWG
    } else {  // a device without a set: CLBlast's own parameters, as before
        cr_expect_eq(clmha_context_tuning_source(ctx), CLMHA_TUNING_SOURCE_CLBLAST);
        cr_expect(strstr(note, "not found") && !strstr(note, "built-in"), "%s", note);
        cr_expect_eq(exported_mwg(ctx), -1);
    }
    clmha_context_release(ctx);
    tmpdir_remove(f.dir);
}

// The device's tuning file, named as the store names it (runs of other characters than
// A-Z a-z 0-9 . _ - become one '_').
static void stored_path(const fixture *f, char *path, size_t size) {
    char parts[2][256];
    const char *names[2] = {f->info.platform_name, f->info.device_name};
    for (int k = 0; k < 2; ++k) {
        size_t n = 0;
        bool sub = false;
        for (const char *s = names[k]; *s && n + 1 < sizeof parts[k]; ++s) {
            char c = *s;
            bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                      (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
            if (ok) parts[k][n++] = c, sub = false;
            else if (!sub) parts[k][n++] = '_', sub = true;
        }
        parts[k][n] = '\0';
    }
    snprintf(path, size, "%s/%s--%s.json", f->dir, parts[0], parts[1]);
}

Test(builtin, stored_tuning_wins, .timeout = 300) {
    fixture f;
    setup(&f, NULL);
    // CLBlast's generic Xgemm with MWG 128 and no local memory (no built-in set has MWG 128).
    char path[600], json[4096];
    snprintf(json, sizeof json,
             "{\"format\": \"clmha-gemm-tuning\", \"version\": 1, \"platform\": \"%s\", "
             "\"device\": \"%s\", \"driver\": \"%s\", \"clblast\": \"%d.%d.%d\", "
             "\"precision\": \"float32\", \"kernels\": {\"Xgemm\": {\"GEMMK\": 0, \"KREG\": 1, "
             "\"KWG\": 32, \"KWI\": 2, \"MDIMA\": 8, \"MDIMC\": 8, \"MWG\": 128, \"NDIMB\": 16, "
             "\"NDIMC\": 16, \"NWG\": 64, \"SA\": 0, \"SB\": 0, \"STRM\": 0, \"STRN\": 0, "
             "\"VWM\": 4, \"VWN\": 2}}}",
             f.info.platform_name, f.info.device_name, f.info.driver_version,
             CLBLAST_VERSION_MAJOR, CLBLAST_VERSION_MINOR, CLBLAST_VERSION_PATCH);
    stored_path(&f, path, sizeof path);
    write_bytes(path, json, strlen(json));
    clmha_context *ctx = make_context();
    char note[2048];
    clmha_context_tuning_note(ctx, note, sizeof note);
    cr_expect_eq(clmha_context_tuning_source(ctx), CLMHA_TUNING_SOURCE_STORED, "%s", note);
    cr_expect(strstr(note, "stored tuning") && !strstr(note, "built-in"), "%s", note);
    cr_expect_eq(exported_mwg(ctx), 128);
    clmha_context_release(ctx);
    tmpdir_remove(f.dir);
}

// CLMHA_TUNING=builtin: the stored file is not read (an unreadable one would be noted).
Test(builtin, builtin_env_skips_the_stored_file, .timeout = 300) {
    fixture f;
    setup(&f, "builtin");
    char path[600];
    stored_path(&f, path, sizeof path);
    write_bytes(path, "not a tuning", strlen("not a tuning"));
    clmha_context *ctx = make_context();
    char note[2048];
    clmha_context_tuning_note(ctx, note, sizeof note);
    cr_expect(strstr(note, "CLMHA_TUNING=builtin") && !strstr(note, "ignored"), "%s", note);
    cr_expect_eq(clmha_context_tuning_source(ctx),
                 f.set ? CLMHA_TUNING_SOURCE_BUILTIN : CLMHA_TUNING_SOURCE_CLBLAST, "%s", note);
    clmha_context_release(ctx);
    tmpdir_remove(f.dir);
}

// CLMHA_TUNING=off: CLBlast's own parameters, whatever the device.
Test(builtin, off_applies_nothing, .timeout = 300) {
    fixture f;
    setup(&f, "off");
    clmha_context *ctx = make_context();
    char note[2048];
    clmha_context_tuning_note(ctx, note, sizeof note);
    cr_expect_eq(clmha_context_tuning_source(ctx), CLMHA_TUNING_SOURCE_CLBLAST, "%s", note);
    cr_expect(strstr(note, "CLMHA_TUNING=off") != NULL, "%s", note);
    cr_expect_eq(exported_mwg(ctx), -1);
    cr_expect_eq(clmha_context_tuning_source(NULL), CLMHA_TUNING_SOURCE_CLBLAST);
    clmha_context_release(ctx);
    tmpdir_remove(f.dir);
}
