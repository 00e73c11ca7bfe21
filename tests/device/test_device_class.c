// The device class table (src/device/) and what it selects: the row each kind of device
// gets, the fused tiles fitted within every class's private budget and a GPU-like local memory,
// the native vector width on CPUs, and both kernel mappings run on PoCL: the CPU one (detected)
// and the GPU ones (forced through the test hook clmha__test_force_device_class), each against
// the double-precision reference, through the fused and the unfused core.
//
// Links libclmha.a (not libclmha.so): the table, the fit and the hook are internal.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cores/fused.h"
#include "device/device_class.h"
#include "layer/layer.h"
#include "support.h"

#define TOLERANCE 1e-4

// ---- the table ---------------------------------------------------------------------------------

Test(device_class, rows_by_type_vendor_and_platform) {
    static const struct {
        cl_device_type type;
        cl_uint vendor;
        const char *platform, *want;
    } cases[] = {
        {CL_DEVICE_TYPE_GPU, 0x10DE, "NVIDIA CUDA", "gpu-nvidia"},
        {CL_DEVICE_TYPE_GPU, 0x1002, "AMD Accelerated Parallel Processing", "gpu-amd"},
        {CL_DEVICE_TYPE_GPU, 0x8086, "Intel(R) OpenCL Graphics", "gpu-intel"},
        {CL_DEVICE_TYPE_GPU, 0x13B5, "ARM Platform", "gpu"},
        {CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_DEFAULT, 0x10DE, "NVIDIA CUDA", "gpu-nvidia"},
        {CL_DEVICE_TYPE_CPU, 0x8086, "Portable Computing Language", "cpu-pocl"},
        {CL_DEVICE_TYPE_CPU, 0x8086, "Intel(R) OpenCL", "cpu-intel"},
        {CL_DEVICE_TYPE_CPU, 0x1022, "AMD Accelerated Parallel Processing", "cpu"},
        // Oclgrind reports every type bit: it is taken for a CPU.
        {CL_DEVICE_TYPE_CPU | CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR, 0x42, "Oclgrind",
         "cpu"},
        {CL_DEVICE_TYPE_ACCELERATOR, 0x1234, "Some FPGA", "other"},
        {CL_DEVICE_TYPE_GPU, 0x10DE, NULL, "gpu-nvidia"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        const clmha__device_class *c =
            clmha__device_class_match(cases[i].type, cases[i].vendor, cases[i].platform);
        cr_assert_not_null(c);
        cr_expect_str_eq(c->name, cases[i].want, "type %#llx vendor %#x platform %s",
                         (unsigned long long)cases[i].type, cases[i].vendor,
                         cases[i].platform ? cases[i].platform : "(null)");
    }
}

Test(device_class, cpus_keep_row_mapping_gpus_coalesce) {
    static const char *const cpus[] = {"cpu-pocl", "cpu-intel", "cpu"};
    static const char *const gpus[] = {"gpu-nvidia", "gpu-amd", "gpu-intel", "gpu"};
    for (size_t i = 0; i < 3; ++i) {
        const clmha__device_class *c = clmha__device_class_named(cpus[i]);
        cr_assert_not_null(c, "%s", cpus[i]);
        cr_expect(!c->coalesced, "%s", cpus[i]);
        cr_expect_eq(c->vw, 0, "%s: CPUs take the native vector width", cpus[i]);
    }
    for (size_t i = 0; i < 4; ++i) {
        const clmha__device_class *c = clmha__device_class_named(gpus[i]);
        cr_assert_not_null(c, "%s", gpus[i]);
        cr_expect(c->coalesced, "%s", gpus[i]);
        cr_expect(c->vw >= 1 && c->vw <= 4, "%s: vw %zu", gpus[i], c->vw);
        cr_expect(c->private_floats >= 64 && c->private_floats <= 128, "%s", gpus[i]);
    }
    cr_expect_null(clmha__device_class_named("no-such-class"));
}

Test(device_class, forced_row_overrides_detection) {
    cr_assert(clmha__test_force_device_class("gpu-amd"));
    const clmha__device_class *c = clmha__device_class_match(CL_DEVICE_TYPE_CPU, 0x8086,
                                                             "Portable Computing Language");
    cr_expect_str_eq(c->name, "gpu-amd");
    cr_expect(!clmha__test_force_device_class("no-such-class"));
    c = clmha__device_class_match(CL_DEVICE_TYPE_CPU, 0x8086, "Portable Computing Language");
    cr_expect_str_eq(c->name, "gpu-amd", "an unknown name changes nothing");
    cr_assert(clmha__test_force_device_class(NULL));
    c = clmha__device_class_match(CL_DEVICE_TYPE_CPU, 0x8086, "Portable Computing Language");
    cr_expect_str_eq(c->name, "cpu-pocl");
}

// ---- fitted tiles ------------------------------------------------------------------------------

static clmha__fused_tiles fitted(const clmha__device_class *c, cl_ulong local, size_t max_wg,
                                 size_t hd) {
    clmha__fused_tiles t = {.bq = c->bq, .bk = c->bk, .rpw = c->rpw, .vw = c->vw ? c->vw : 16};
    clmha__fused_tiles_fit_limits(c, local, max_wg, hd, &t);
    return t;
}

Test(device_class, fit_within_private_budget_and_local_memory) {
    static const char *const names[] = {"cpu-pocl", "cpu-intel", "cpu",  "gpu-nvidia",
                                        "gpu-amd",  "gpu-intel", "gpu", "other"};
    static const size_t hds[] = {1, 2, 3, 8, 16, 31, 32, 48, 64, 80, 96, 100, 112, 128, 256, 512};
    static const cl_ulong locals[] = {32768, 49152, 65536, 2u << 20};
    static const size_t wgs[] = {256, 1024};
    for (size_t a = 0; a < sizeof names / sizeof names[0]; ++a) {
        const clmha__device_class *c = clmha__device_class_named(names[a]);
        cr_assert_not_null(c, "%s", names[a]);
        for (size_t b = 0; b < sizeof hds / sizeof hds[0]; ++b)
            for (size_t l = 0; l < sizeof locals / sizeof locals[0]; ++l)
                for (size_t w = 0; w < 2; ++w) {
                    size_t hd = hds[b];
                    clmha__fused_tiles t = fitted(c, locals[l], wgs[w], hd);
                    char what[128];
                    snprintf(what, sizeof what, "%s hd %zu local %llu wg %zu: %zu/%zu/%zu/%zu",
                             names[a], hd, (unsigned long long)locals[l], wgs[w], t.bq, t.bk,
                             t.rpw, t.vw);
                    cr_assert_gt(t.bk, 0, "%s: nothing fits", what);
                    cr_expect_leq(clmha__fused_private_floats(&t, hd), c->private_floats,
                                  "%s: private floats over the budget", what);
                    cr_expect_leq(clmha__fused_local_floats(&t, hd) * sizeof(float),
                                  locals[l] - 1024, "%s: local memory", what);
                    cr_expect_leq(t.bq, wgs[w], "%s", what);
                    cr_expect_eq(t.bq & (t.bq - 1), 0, "%s: bq a power of two", what);
                    cr_expect(hd % t.vw == 0 && t.bk % t.vw == 0, "%s: vw", what);
                    cr_expect(t.q_local || !c->coalesced, "%s: GPUs stage the query rows", what);
                    cr_expect(!t.acc_local || t.q_local, "%s: acc local only after q", what);
                    cr_expect(!t.lanes || (c->lanes && !t.q_local && t.bq == c->bq),
                              "%s: lanes only where the class has them", what);
                }
    }
    // What the budget decides at the common head dims, 48 KiB of local memory.
    const clmha__device_class *gpu = clmha__device_class_named("gpu");
    const clmha__device_class *intel = clmha__device_class_named("gpu-intel");
    const clmha__device_class *pocl = clmha__device_class_named("cpu-pocl");
    clmha__fused_tiles t = fitted(gpu, 49152, 256, 64);
    cr_expect(t.q_local && !t.acc_local && t.bk == 32 && t.rpw == 1 && t.bq == 64,
              "gpu hd 64: %zu/%zu/%zu acc_local %d", t.bq, t.bk, t.rpw, (int)t.acc_local);
    t = fitted(gpu, 49152, 256, 128);
    cr_expect(t.q_local && t.acc_local, "gpu hd 128: the accumulators go to local memory");
    t = fitted(intel, 65536, 256, 64);
    cr_expect(t.acc_local, "gpu-intel hd 64 (64 private floats): accumulators local");
    t = fitted(intel, 65536, 256, 32);
    cr_expect(!t.acc_local && t.bk == 32, "gpu-intel hd 32: private (32 + 32 floats)");
    t = fitted(pocl, 2u << 20, 4096, 64);
    cr_expect(t.lanes && !t.q_local && !t.acc_local && t.bq == 1 && t.bk == 64 && t.rpw == 32,
              "cpu-pocl hd 64: the measured lanes 1/64/32");
    t = fitted(pocl, 2u << 20, 4096, 256);
    cr_expect(t.lanes && t.rpw == 16 && t.bk == 64, "cpu-pocl hd 256: lanes, 16 rows");
    t = fitted(pocl, 2u << 20, 4096, 512);
    cr_expect(!t.lanes && t.rpw == 1 && t.bq == 64, "cpu-pocl hd 512: the tiled mapping");
    t = fitted(clmha__device_class_named("cpu"), 2u << 20, 4096, 64);
    cr_expect(!t.lanes && t.bq == 64 && t.bk == 32 && t.rpw == 2, "cpu: the tiled 64/32/2");
}

// ---- vector width ------------------------------------------------------------------------------

Test(device_class, cpu_vector_width_is_native) {
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS, "%s",
                 clmha_last_create_error());
    cl_device_type type = 0;
    clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_TYPE, sizeof type, &type, NULL);
    if (!(type & CL_DEVICE_TYPE_CPU)) {
        clmha_context_release(ctx);
        cr_skip_test("not a CPU device");
    }
    cl_uint native = 0;
    clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT,
                    sizeof native, &native, NULL);
    cr_expect_eq(clmha__fused_default_vw(ctx), native ? native : 1);
    clmha__fused_tiles t = clmha__fused_tiles_for(ctx, 64);
    size_t want = native > 16 ? 16 : native ? native : 1;
    while (want > 1 && (64 % want || t.bk % want)) want /= 2;
    cr_expect_eq(t.vw, want, "head_dim 64: vw %zu, native %u", t.vw, native);
    clmha_context_release(ctx);
}

// ---- both mappings against the reference ------------------------------------------------------

typedef struct mcase {
    const char *name;
    size_t e, h, n, l, s;
    bool self_attn, batch_first, unbatched, bias_kv, zero_attn, causal, train;
    clmha_mask_kind kpm, am;
    bool am_per_head;
} mcase;

static const mcase mcases[] = {
    {"hd 64, cross, batch_first, kpm ignore, 2 query tiles", .e = 64, .h = 1, .n = 2, .l = 70,
     .s = 45, .batch_first = true, .kpm = CLMHA_MASK_BOOL_IGNORE},
    {"hd 128, cross, am float, bias_kv + zero_attn", .e = 256, .h = 2, .n = 1, .l = 33, .s = 20,
     .bias_kv = true, .zero_attn = true, .am = CLMHA_MASK_FLOAT},
    {"hd 3, self, causal, dropout", .e = 12, .h = 4, .n = 3, .l = 17, .self_attn = true,
     .causal = true, .train = true},
    {"hd 8, unbatched, am attend per head, zero_attn", .e = 32, .h = 4, .l = 5, .s = 9,
     .unbatched = true, .zero_attn = true, .am = CLMHA_MASK_BOOL_ATTEND, .am_per_head = true},
    {"hd 48, self, seq-first, kpm float", .e = 96, .h = 2, .n = 2, .l = 40, .self_attn = true,
     .kpm = CLMHA_MASK_FLOAT},
};

static void *mask_data(prng *r, clmha_mask_kind kind, size_t count) {
    if (kind == CLMHA_MASK_FLOAT) {
        float *m = normal_floats(r, count);
        for (size_t i = 0; i < count; ++i)
            if (prng_uniform(r) < 0.2) m[i] = -INFINITY;
        return m;
    }
    unsigned char *m = malloc(count);
    cr_assert_not_null(m);
    for (size_t i = 0; i < count; ++i) m[i] = prng_uniform(r) < 0.2;
    if (kind == CLMHA_MASK_BOOL_ATTEND)
        for (size_t i = 0; i < count; ++i) m[i] = !m[i];
    return m;
}

static clmha_tensor seq_tensor(const mcase *c, const float *data, size_t n, size_t t, size_t f) {
    if (c->unbatched) return (clmha_tensor){.ndim = 2, .shape = {t, f}, .data = data};
    if (c->batch_first) return (clmha_tensor){.ndim = 3, .shape = {n, t, f}, .data = data};
    return (clmha_tensor){.ndim = 3, .shape = {t, n, f}, .data = data};
}

// Runs every case on a context created under class @p cls (NULL: detected) through both cores
// and compares with the reference; @p want_coalesced: the mapping the class must select.
static void run_mapping(const char *cls, bool want_coalesced) {
    cr_assert(clmha__test_force_device_class(cls));
    clmha_context *ctx = NULL;
    clmha_status st = clmha_context_create_from_env(&ctx);
    clmha__test_force_device_class(NULL);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_last_create_error());
    if (cls) cr_expect_str_eq(ctx->cls->name, cls);
    if (cls || (ctx->info.type & CL_DEVICE_TYPE_CPU))
        cr_expect_eq(ctx->cls->coalesced, want_coalesced, "class %s", ctx->cls->name);
    for (size_t ci = 0; ci < sizeof mcases / sizeof mcases[0]; ++ci) {
        const mcase *c = &mcases[ci];
        prng r = {0xC1A55ull + ci};
        size_t e = c->e, n = c->unbatched ? 1 : c->n, l = c->l, s = c->self_attn ? l : c->s;
        size_t sp = s + c->bias_kv + c->zero_attn;
        clmha_layer_desc desc = {.struct_size = sizeof desc,
                                 .embed_dim = e, .num_heads = c->h, .bias = true,
                                 .add_bias_kv = c->bias_kv, .add_zero_attn = c->zero_attn,
                                 .batch_first = c->batch_first, .dropout = c->train ? 0.2f : 0};
        double bound = 1.0 / sqrt((double)e);
        float *w_in = uniform_floats(&r, 3 * e * e, bound);
        float *b_in = uniform_floats(&r, 3 * e, bound);
        float *w_out = uniform_floats(&r, e * e, bound), *b_out = uniform_floats(&r, e, bound);
        float *bk = normal_floats(&r, e), *bv = normal_floats(&r, e);
        float *q = normal_floats(&r, l * n * e);
        float *kv = c->self_attn ? NULL : normal_floats(&r, s * n * e);
        clmha_forward_args args = {.struct_size = sizeof args,
                                   .query = seq_tensor(c, q, n, l, e), .is_causal = c->causal,
                                   .training = c->train, .rng = {0xABCDEF + ci, 3}};
        if (!c->self_attn) args.key = seq_tensor(c, kv, n, s, e);  // value = key
        void *kpm = NULL, *am = NULL;
        if (c->kpm) {
            kpm = mask_data(&r, c->kpm, n * s);
            args.key_padding_mask.kind = c->kpm;
            args.key_padding_mask.tensor =
                c->unbatched ? (clmha_tensor){.ndim = 1, .shape = {s}, .data = kpm}
                             : (clmha_tensor){.ndim = 2, .shape = {n, s}, .data = kpm};
        }
        if (c->am) {
            size_t planes = c->am_per_head ? n * c->h : 1;
            am = mask_data(&r, c->am, planes * l * s);
            args.attn_mask.kind = c->am;
            args.attn_mask.tensor =
                c->am_per_head ? (clmha_tensor){.ndim = 3, .shape = {planes, l, s}, .data = am}
                               : (clmha_tensor){.ndim = 2, .shape = {l, s}, .data = am};
        }
        clmha_reference_params p = {.struct_size = sizeof p,
                                    .in_proj_weight = w_in, .in_proj_bias = b_in,
                                    .out_proj_weight = w_out, .out_proj_bias = b_out,
                                    .bias_k = c->bias_kv ? bk : NULL,
                                    .bias_v = c->bias_kv ? bv : NULL};
        size_t oc = n * l * e, wc = n * l * sp;
        double *ref = malloc(oc * sizeof *ref), *ref_w = malloc(wc * sizeof *ref_w);
        float *out = alloc_floats(oc), *w = alloc_floats(wc);
        cr_assert(ref && ref_w);
        char msg[256];
        args.need_weights = true;
        cr_assert_eq(clmha_reference_forward(&desc, &p, &args, ref, oc, ref_w, wc, msg,
                                             sizeof msg),
                     CLMHA_SUCCESS, "%s", msg);

        clmha_layer *layer = NULL;
        cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        st = clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * e * e);
        if (!st) st = clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * e);
        if (!st) st = clmha_layer_set_parameter(layer, "out_proj.weight", w_out, e * e);
        if (!st) st = clmha_layer_set_parameter(layer, "out_proj.bias", b_out, e);
        if (!st && c->bias_kv) st = clmha_layer_set_parameter(layer, "bias_k", bk, e);
        if (!st && c->bias_kv) st = clmha_layer_set_parameter(layer, "bias_v", bv, e);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));

        // Unfused, with weights: split, masked_softmax, merge.
        args.impl = CLMHA_IMPL_UNFUSED;
        for (size_t i = 0; i < oc; ++i) out[i] = NAN;
        cr_assert_eq(clmha_layer_forward_host(layer, &args, out, oc, w, wc), CLMHA_SUCCESS,
                     "%s", clmha_context_last_error(ctx));
        double eo = max_abs_err(out, ref, oc), ew = max_abs_err(w, ref_w, wc);
        cr_expect_leq(eo, TOLERANCE, "%s, %s, unfused: output error %g", ctx->cls->name,
                      c->name, eo);
        cr_expect_leq(ew, TOLERANCE, "%s, %s, unfused: weights error %g", ctx->cls->name,
                      c->name, ew);
        // Fused, without weights.
        args.need_weights = false;
        args.impl = CLMHA_IMPL_FUSED;
        for (size_t i = 0; i < oc; ++i) out[i] = NAN;
        cr_assert_eq(clmha_layer_forward_host(layer, &args, out, oc, NULL, 0), CLMHA_SUCCESS,
                     "%s", clmha_context_last_error(ctx));
        eo = max_abs_err(out, ref, oc);
        cr_expect_leq(eo, TOLERANCE, "%s, %s, fused: output error %g", ctx->cls->name, c->name,
                      eo);
        clmha__fused_tiles tiles = clmha__fused_tiles_of(layer);
        const clmha__fused_tiles *t = &tiles;
        cr_expect_leq(clmha__fused_private_floats(t, layer->d), ctx->cls->private_floats,
                      "%s, %s", ctx->cls->name, c->name);
        cr_expect(t->q_local || !want_coalesced, "%s, %s: query rows local", ctx->cls->name,
                  c->name);
        if (cls && strcmp(cls, "gpu") == 0)  // 128 private floats: hd 128 needs local accumulators
            cr_expect_eq(t->acc_local, layer->d == 128, "%s, hd %zu", c->name, layer->d);

        clmha_layer_release(layer);
        free(w_in), free(b_in), free(w_out), free(b_out), free(bk), free(bv), free(q), free(kv);
        free(kpm), free(am), free(ref), free(ref_w), free(out), free(w);
    }
    clmha_context_release(ctx);
}

Test(device_class, cpu_mapping_matches_reference) { run_mapping(NULL, false); }
Test(device_class, gpu_mapping_on_pocl_matches_reference) { run_mapping("gpu", true); }
Test(device_class, gpu_intel_mapping_on_pocl_matches_reference) {
    run_mapping("gpu-intel", true);
}
