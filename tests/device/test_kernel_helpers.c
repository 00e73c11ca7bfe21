// The kernel helpers the cores share (cl/common.cl: the VW-lane vector macros, exp_nonpos, tanh_lanes,
// lanes_sum, lanes_max_nan): each is defined there and in no other embedded kernel file, and the
// fused forward's and backward's programs compute the same exp_nonpos, bit for bit, over a
// sweep of [-104, 0] (and a little above: the backward's arguments may be), for vector widths
// 1, 4 and 16, within a few float roundings of exp in double.
//
// Links libclmha.a (the embedded sources and the context's OpenCL objects are internal).
#define _POSIX_C_SOURCE 200809L

#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context/context.h"
#include "context/programs.h"
#include "support.h"

// ---- one definition -----------------------------------------------------------------------------

static const clmha__cl_source *embedded(const char *name) {
    for (size_t i = 0; i < clmha__cl_sources_count; ++i)
        if (strcmp(clmha__cl_sources[i].name, name) == 0) return &clmha__cl_sources[i];
    cr_assert_fail("no embedded kernel file %s", name);
    return NULL;
}

// Lines of @p text that define @p name: a function ("inline <type> name(") or a macro
// ("#define name" followed by a space or a parenthesis).
static size_t definitions(const char *text, const char *name) {
    size_t count = 0, len = strlen(name);
    for (const char *line = text; *line;) {
        const char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) : strlen(line);
        if (n > 8 + len && strncmp(line, "#define ", 8) == 0) {
            const char *m = line + 8;
            if (strncmp(m, name, len) == 0 && (m[len] == ' ' || m[len] == '(')) ++count;
        } else if (strncmp(line, "inline ", 7) == 0) {
            // the name right before the line's first "(", after a space
            const char *paren = memchr(line, '(', n);
            if (paren && (size_t)(paren - line) > 7 + len &&
                strncmp(paren - len, name, len) == 0 && paren[-(ptrdiff_t)len - 1] == ' ')
                ++count;
        }
        if (!end) break;
        line = end + 1;
    }
    return count;
}

Test(kernel_helpers, defined_once_in_common_cl) {
    static const char *const helpers[] = {"VT",    "AS_VT",      "AS_VTI",    "LOADV",
                                          "STOREV", "LANE0",     "exp_nonpos", "lanes_sum",
                                          "lanes_max_nan"};
    const clmha__cl_source *common = embedded("common");
    for (size_t h = 0; h < sizeof helpers / sizeof *helpers; ++h) {
        // exp_nonpos has two definitions in common.cl, for float and for double programs;
        // the macros have one per vector width class (VW 1 and wider).
        cr_expect_geq(definitions(common->text, helpers[h]), 1, "cl/common.cl defines no %s",
                      helpers[h]);
        for (size_t i = 0; i < clmha__cl_sources_count; ++i) {
            const clmha__cl_source *s = &clmha__cl_sources[i];
            if (s == common) continue;
            cr_expect_eq(definitions(s->text, helpers[h]), 0,
                         "%s defines its own %s (the shared one is in cl/common.cl)", s->path,
                         helpers[h]);
        }
    }
}

// The check itself catches a copy: a line that defines exp_nonpos or LOADV counts.
Test(kernel_helpers, a_copy_would_be_found) {
    cr_expect_eq(definitions("inline float4 exp_nonpos(float4 x) {\n", "exp_nonpos"), 1);
    cr_expect_eq(definitions("x\ninline VT exp_nonpos(VT x) { return exp(x); }\n", "exp_nonpos"),
                 1);
    cr_expect_eq(definitions("#define LOADV(i, p) ((p)[(i)])\n", "LOADV"), 1);
    cr_expect_eq(definitions("#define VT float\n#define VT_(n) float##n\n", "VT"), 1);
    cr_expect_eq(definitions("    VT p = exp_nonpos(x);\ninline REAL lanes_sum2(VT v) {\n",
                             "exp_nonpos"),
                 0);
}

// ---- exp_nonpos, forward and backward --------------------------------------------------------

// Applies exp_nonpos to VW floats per work-item. Appended to a core's program, after its own file.
static const char probe_source[] =
    "kernel void probe_exp_nonpos(global const float *x, global float *y) {\n"
    "    size_t i = get_global_id(0) * VW;\n"
    "    STOREV(exp_nonpos(LOADV(i, x)), i, y);\n"
    "}\n"
    "kernel void probe_tanh_lanes(global const float *x, global float *y) {\n"
    "    size_t i = get_global_id(0) * VW;\n"
    "    STOREV(tanh_lanes(LOADV(i, x)), i, y);\n"
    "}\n";

// The sweep: every 2^-12 from -104 to 0; 128 floats either side of each (k + 1/2) ln 2 from
// k = -151 to 1, where round(x / ln 2) turns over (the roundings of the product differ there
// first); the edges and special values. Padded to a multiple of 16 with zeros.
static float *sweep(size_t *count) {
    size_t cap = 104 * 4096 + 1 + 153 * 257 + 64;
    float *x = alloc_floats(cap);
    size_t n = 0;
    for (size_t k = 0; k <= 104 * 4096; ++k) x[n++] = -104.0f + (float)k / 4096.0f;
    for (int k = -151; k <= 1; ++k) {
        float c = (float)((k + 0.5) * 0.69314718055994530942), lo = c, hi = c;
        x[n++] = c;
        for (int i = 0; i < 128; ++i) {
            lo = nextafterf(lo, -INFINITY);
            hi = nextafterf(hi, INFINITY);
            x[n++] = lo;
            x[n++] = hi;
        }
    }
    static const float special[] = {0.0f,  -0.0f,     -1e-30f,   -1e-7f,   1e-7f,    1e-3f,
                                    0.25f, 1.0f,      -86.999f,  -87.0f,   -87.001f, -87.3365f,
                                    -88.0f, -103.97f, -104.0f,   -1000.0f, -INFINITY, NAN};
    for (size_t i = 0; i < sizeof special / sizeof *special; ++i) x[n++] = special[i];
    while (n % 16) x[n++] = 0.0f;
    cr_assert_leq(n, cap);
    *count = n;
    return x;
}

// exp_nonpos of @p x (@p n floats) in the program of kernel family @p family built as the
// library assembles it (cl/real.cl, cl/common.cl, the family's file: src/context/programs.c)
// with the probe kernel after it, at vector width @p vw.
static float *run_kernel(clmha_context *ctx, const char *family, const char *kernel, int vw,
                         const float *x, size_t n) {
    const clmha__cl_source *real = embedded("real"), *common = embedded("common"),
                           *own = embedded(family);
    const char *src[4] = {real->text, common->text, own->text, probe_source};
    size_t size[4] = {real->size, common->size, own->size, strlen(probe_source)};
    cl_int err;
    cl_program prog = clCreateProgramWithSource(ctx->cl_ctx, 4, src, size, &err);
    cr_assert_eq(err, CL_SUCCESS);
    char options[32];
    snprintf(options, sizeof options, "-DVW=%d", vw);
    err = clBuildProgram(prog, 1, &ctx->device, options, NULL, NULL);
    if (err != CL_SUCCESS) {
        static char log[16384];
        clGetProgramBuildInfo(prog, ctx->device, CL_PROGRAM_BUILD_LOG, sizeof log - 1, log, NULL);
        cr_assert_fail("building %s %s failed (%d):\n%s", own->path, options, err, log);
    }
    cl_kernel k = clCreateKernel(prog, kernel, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem in = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                               n * sizeof(float), (void *)x, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem out = clCreateBuffer(ctx->cl_ctx, CL_MEM_WRITE_ONLY, n * sizeof(float), NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cr_assert_eq(clSetKernelArg(k, 0, sizeof in, &in), CL_SUCCESS);
    cr_assert_eq(clSetKernelArg(k, 1, sizeof out, &out), CL_SUCCESS);
    size_t global = n / (size_t)vw;
    cr_assert_eq(clEnqueueNDRangeKernel(ctx->queue, k, 1, NULL, &global, NULL, 0, NULL, NULL),
                 CL_SUCCESS);
    float *y = alloc_floats(n);
    cr_assert_eq(clEnqueueReadBuffer(ctx->queue, out, CL_TRUE, 0, n * sizeof(float), y, 0, NULL,
                                     NULL),
                 CL_SUCCESS);
    clReleaseMemObject(in);
    clReleaseMemObject(out);
    clReleaseKernel(k);
    clReleaseProgram(prog);
    return y;
}

static float *run_probe(clmha_context *ctx, const char *family, int vw, const float *x,
                        size_t n) {
    return run_kernel(ctx, family, "probe_exp_nonpos", vw, x, n);
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

// The largest relative error of exp_nonpos against exp in double where exp(x) is a normal
// float (x >= -87), in units of 2^-24 (half a float ulp at 1).
#define MAX_REL_ERR_UNITS 2.0

Test(kernel_helpers, exp_nonpos_forward_and_backward_agree_bit_for_bit) {
    clmha_context *ctx = context_or_skip();
    size_t n;
    float *x = sweep(&n);
    static const int widths[] = {1, 4, 16};
    float *first = NULL;
    for (size_t w = 0; w < sizeof widths / sizeof *widths; ++w) {
        float *fwd = run_probe(ctx, "fused", widths[w], x, n);
        float *bwd = run_probe(ctx, "fused_backward", widths[w], x, n);
        size_t differ = 0, differ_width = 0, first_bad = n;
        for (size_t i = 0; i < n; ++i) {
            if (bits(fwd[i]) != bits(bwd[i]) && differ++ == 0) first_bad = i;
            if (first && bits(fwd[i]) != bits(first[i])) ++differ_width;
        }
        cr_log_info("VW %d: %zu inputs, %zu where the forward's and the backward's exp_nonpos "
                    "differ, %zu where VW %d and VW 1 differ",
                    widths[w], n, differ, differ_width, widths[w]);
        cr_expect_eq(differ, 0,
                     "VW %d: %zu of %zu inputs differ, first x = %.9g (%a): forward %a, "
                     "backward %a",
                     widths[w], differ, n, first_bad < n ? x[first_bad] : 0.0,
                     first_bad < n ? x[first_bad] : 0.0, first_bad < n ? fwd[first_bad] : 0.0,
                     first_bad < n ? bwd[first_bad] : 0.0);
        cr_expect_eq(differ_width, 0, "VW %d gives other bits than VW 1", widths[w]);

        // Against exp in double.
        double worst = 0.0;
        size_t worst_at = 0;
        for (size_t i = 0; i < n; ++i) {
            float xi = x[i], yi = fwd[i];
            if (isnan(xi)) {
                cr_expect(isnan(yi), "exp_nonpos(NaN) = %a", yi);
            } else if (xi < -87.0f) {
                cr_expect(bits(yi) == 0, "exp_nonpos(%a) = %a, not 0", xi, yi);
            } else {
                double want = exp((double)xi);
                double err = fabs((double)yi - want) / want * 0x1p24;
                if (!(err <= worst)) worst = err, worst_at = i;
            }
        }
        cr_log_info("VW %d: largest relative error %.3f units of 2^-24 at x = %.9g", widths[w],
                    worst, x[worst_at]);
        cr_expect_leq(worst, MAX_REL_ERR_UNITS,
                      "VW %d: exp_nonpos(%.9g) = %.9g is %.3f units of 2^-24 from exp", widths[w],
                      x[worst_at], fwd[worst_at], worst);
        free(bwd);
        if (first) free(fwd);
        else first = fwd;
    }
    free(first);
    free(x);
    clmha_context_release(ctx);
}

// ---- tanh_lanes (soft-capping on the CPU mappings) ----------------------------------------------

// tanh_lanes against tanh in double, relative, in units of 2^-24: every 2^-10 in [-40, 40], the
// small values where tanh(x) ~ x, and the special values (+-0, +-inf keep +-1, NaN stays NaN),
// at vector widths 1 and 16.
#define TANH_MAX_REL_ERR_UNITS 8.0

Test(kernel_helpers, tanh_lanes_is_accurate) {
    clmha_context *ctx = context_or_skip();
    size_t cap = 80 * 1024 + 1 + 64, n = 0;
    float *x = alloc_floats(cap);
    for (size_t k = 0; k <= 80 * 1024; ++k) x[n++] = -40.0f + (float)k / 1024.0f;
    static const float special[] = {0.0f,   -0.0f,  1e-30f, -1e-20f, 1e-7f,     -3e-4f,
                                    0.299f, -0.31f, 9.0f,   -30.5f,  100.0f,    INFINITY,
                                    -INFINITY, NAN};
    for (size_t i = 0; i < sizeof special / sizeof *special; ++i) x[n++] = special[i];
    while (n % 16) x[n++] = 0.5f;
    // One program family: the function is common.cl's, the same text in every core's program.
    static const char *const families[] = {"fused"};
    static const int widths[] = {1, 16};
    for (size_t f = 0; f < sizeof families / sizeof *families; ++f)
        for (size_t w = 0; w < sizeof widths / sizeof *widths; ++w) {
            float *y = run_kernel(ctx, families[f], "probe_tanh_lanes", widths[w], x, n);
            double worst = 0.0;
            size_t at = 0;
            for (size_t i = 0; i < n; ++i) {
                if (isnan(x[i])) {
                    cr_expect(isnan(y[i]), "tanh_lanes(NaN) = %a", y[i]);
                    continue;
                }
                double want = tanh((double)x[i]);
                double err = want == 0.0 ? fabs((double)y[i]) * 0x1p24
                                         : fabs((double)y[i] - want) / fabs(want) * 0x1p24;
                if (!(err <= worst)) worst = err, at = i;
            }
            cr_log_info("%s VW %d: tanh_lanes' largest relative error %.3f units of 2^-24 at "
                        "x = %.9g",
                        families[f], widths[w], worst, x[at]);
            cr_expect_leq(worst, TANH_MAX_REL_ERR_UNITS,
                          "%s VW %d: tanh_lanes(%.9g) = %.9g is %.3f units of 2^-24 from tanh",
                          families[f], widths[w], x[at], y[at], worst);
            free(y);
        }
    free(x);
    clmha_context_release(ctx);
}
