#define _POSIX_C_SOURCE 200809L
// Layer files: clmha_layer_save / clmha_layer_load round trips (bit for bit), F16, BF16 and F64
// files, files written by PyTorch (tests/cli/*/layer.safetensors, see tools/export_mha.py), and
// malformed files, each refused with its exact status and a message naming the file and the
// culprit. Every file is built by the test in a temporary folder.
//
// Loading needs an OpenCL device (the layer lives on one): without one every test is skipped.
// CLMHA_TEST_VERBOSE=1 prints the status and message of every malformed file.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "support.h"

#define BAD_LAYER ((clmha_layer *)(uintptr_t)1)

// ---- helpers ----------------------------------------------------------------------------------

typedef test_env env;  // tests/support/support.h

static void env_open(env *e) { test_env_open(e, "clmha-st"); }

static void env_close(env *e) { test_env_close(e); }

static void path_in(const env *e, const char *name, char *out, size_t size) {
    snprintf(out, size, "%s/%s", e->dir, name);
}

static void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; ++i) p[i] = (unsigned char)(v >> (8 * i));
}

// Writes a safetensors file: header length, @p header padded with @p pad spaces, then
// @p data_size bytes of @p data (zeros when NULL).
static void write_st(const char *path, const char *header, size_t pad, const void *data,
                     size_t data_size) {
    size_t hn = strlen(header) + pad;
    size_t total = 8 + hn + data_size;
    unsigned char *buf = calloc(total, 1);
    cr_assert_not_null(buf);
    put_le64(buf, hn);
    memcpy(buf + 8, header, strlen(header));
    memset(buf + 8 + strlen(header), ' ', pad);
    if (data) memcpy(buf + 8 + hn, data, data_size);
    write_bytes(path, buf, total);
    free(buf);
}

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

// ---- round trips ------------------------------------------------------------------------------

static const char *const param_names[] = {
    "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
    "out_proj.weight", "out_proj.bias", "bias_k", "bias_v", "alibi_slopes", "sinks"};
#define NUM_PARAMS (sizeof param_names / sizeof *param_names)

// Fills every parameter of the layer with random floats and a few special bit patterns.
static void randomise(clmha_layer *layer, uint64_t seed) {
    static const uint32_t special[] = {0x80000000u /* -0 */, 0x00000001u /* smallest subnormal */,
                                       0x7f7fffffu /* FLT_MAX */, 0xff800000u /* -inf */,
                                       0x7fc12345u /* NaN with a payload */};
    uint64_t s = seed * 2654435761u + 1;
    for (size_t p = 0; p < NUM_PARAMS; ++p) {
        if (p == 0 && clmha_layer_parameter_count(layer, "in_proj_weight")) continue;  // q/k/v
        size_t n = clmha_layer_parameter_count(layer, param_names[p]);
        if (!n) continue;
        float *v = malloc(n * sizeof *v);
        cr_assert_not_null(v);
        for (size_t i = 0; i < n; ++i)
            v[i] = (float)((double)(rng_next(&s) >> 11) / 9007199254740992.0 * 2.0 - 1.0);
        for (size_t i = 0; i < sizeof special / sizeof *special && i < n; ++i)
            v[(i * 7) % n] = bits_float(special[i]);
        cr_assert_eq(clmha_layer_set_parameter(layer, param_names[p], v, n), CLMHA_SUCCESS);
        free(v);
    }
}

// Every parameter of a and b equal bit for bit.
static void expect_same_parameters(clmha_layer *a, clmha_layer *b, const char *what) {
    for (size_t p = 0; p < NUM_PARAMS; ++p) {
        size_t n = clmha_layer_parameter_count(a, param_names[p]);
        cr_expect_eq(n, clmha_layer_parameter_count(b, param_names[p]), "%s: %s count", what,
                     param_names[p]);
        if (!n || n != clmha_layer_parameter_count(b, param_names[p])) continue;
        float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
        cr_assert(x && y);
        cr_assert_eq(clmha_layer_get_parameter(a, param_names[p], x, n), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_get_parameter(b, param_names[p], y, n), CLMHA_SUCCESS);
        cr_expect_eq(memcmp(x, y, n * sizeof *x), 0, "%s: %s differs after the round trip",
                     what, param_names[p]);
        free(x);
        free(y);
    }
}

static void expect_same_desc(const clmha_layer_desc *a, const clmha_layer_desc *b,
                             const char *what) {
    cr_expect_eq(a->embed_dim, b->embed_dim, "%s: embed_dim", what);
    cr_expect_eq(a->num_heads, b->num_heads, "%s: num_heads", what);
    cr_expect_eq(a->kdim, b->kdim, "%s: kdim", what);
    cr_expect_eq(a->vdim, b->vdim, "%s: vdim", what);
    cr_expect_eq(a->bias, b->bias, "%s: bias", what);
    cr_expect_eq(a->add_bias_kv, b->add_bias_kv, "%s: add_bias_kv", what);
    cr_expect_eq(a->add_zero_attn, b->add_zero_attn, "%s: add_zero_attn", what);
    cr_expect_eq(a->batch_first, b->batch_first, "%s: batch_first", what);
    cr_expect_eq(float_bits(a->dropout), float_bits(b->dropout), "%s: dropout %.9g vs %.9g",
                 what, (double)a->dropout, (double)b->dropout);
    cr_expect_eq(a->num_kv_heads, b->num_kv_heads, "%s: num_kv_heads", what);
    cr_expect_eq(a->window, b->window, "%s: window", what);
    cr_expect_eq(a->window_left, b->window_left, "%s: window_left", what);
    cr_expect_eq(a->window_right, b->window_right, "%s: window_right", what);
    cr_expect_eq(memcmp(&a->softcap, &b->softcap, sizeof a->softcap), 0,
                 "%s: softcap %.17g vs %.17g", what, a->softcap, b->softcap);
    cr_expect_eq(a->alibi, b->alibi, "%s: alibi", what);
    cr_expect_eq(a->sinks, b->sinks, "%s: sinks", what);
}

typedef struct rt_case {
    const char *name;
    clmha_layer_desc desc;
} rt_case;

static const rt_case rt_cases[] = {
#define DESC_SIZE .struct_size = sizeof(clmha_layer_desc)
    {"packed", {DESC_SIZE, .embed_dim = 8, .num_heads = 2, .bias = true}},
    {"kdim_vdim", {DESC_SIZE, .embed_dim = 12, .num_heads = 3, .kdim = 5, .vdim = 7, .bias = true}},
    {"kdim_eq_vdim",
     {DESC_SIZE, .embed_dim = 8, .num_heads = 4, .kdim = 6, .vdim = 6, .bias = true}},
    {"no_bias", {DESC_SIZE, .embed_dim = 8, .num_heads = 2}},
    {"add_bias_kv", {DESC_SIZE, .embed_dim = 8, .num_heads = 1, .bias = true, .add_bias_kv = true}},
    {"add_zero_attn",
     {DESC_SIZE, .embed_dim = 6, .num_heads = 3, .bias = true, .add_zero_attn = true}},
    {"batch_first", {DESC_SIZE, .embed_dim = 4, .num_heads = 2, .bias = true, .batch_first = true}},
    {"dropout_0.1", {DESC_SIZE, .embed_dim = 8, .num_heads = 2, .bias = true, .dropout = 0.1f}},
    {"dropout_third", {DESC_SIZE, .embed_dim = 8, .num_heads = 2, .dropout = 1.0f / 3.0f}},
    {"dropout_tiny", {DESC_SIZE, .embed_dim = 4, .num_heads = 1, .dropout = 1e-7f}},
    {"everything",
     {DESC_SIZE, .embed_dim = 16, .num_heads = 4, .kdim = 3, .vdim = 9, .add_bias_kv = true,
      .add_zero_attn = true, .batch_first = true, .dropout = 0.75f}},
    // Grouped-query attention: k/v_proj_weight, in_proj_bias and bias_k/bias_v per key/value
    // head, __metadata__ num_kv_heads.
    {"gqa", {DESC_SIZE, .embed_dim = 16, .num_heads = 4, .num_kv_heads = 2, .bias = true,
             .add_bias_kv = true}},
    {"mqa_kdim_vdim", {DESC_SIZE, .embed_dim = 12, .num_heads = 3, .num_kv_heads = 1, .kdim = 5,
                       .vdim = 7, .bias = true, .batch_first = true}},
    // Sliding windows: __metadata__ window "LEFT,RIGHT" (-1: unbounded); both unbounded is a
    // window all the same (the flag round-trips).
    {"window_causal_1023",
     {DESC_SIZE, .embed_dim = 8, .num_heads = 2, .bias = true, .window = true,
      .window_left = 1023, .window_right = 0}},
    {"window_left_unbounded",
     {DESC_SIZE, .embed_dim = 8, .num_heads = 4, .num_kv_heads = 2, .add_bias_kv = true,
      .window = true, .window_left = -1, .window_right = 2}},
    {"window_unbounded",
     {DESC_SIZE, .embed_dim = 4, .num_heads = 1, .window = true, .window_left = -1,
      .window_right = -1}},
    {"window_int64_max",
     {DESC_SIZE, .embed_dim = 4, .num_heads = 2, .window = true, .window_left = INT64_MAX,
      .window_right = INT64_MAX}},
    // Score variants: __metadata__ softcap (the shortest decimal that reads back as the same
    // double) and alibi, with the tensor alibi_slopes; in float32, float16 and float64 layers.
    {"softcap_50", {DESC_SIZE, .embed_dim = 8, .num_heads = 2, .bias = true, .softcap = 50.0}},
    {"softcap_third_f64",
     {DESC_SIZE, .embed_dim = 8, .num_heads = 2, .softcap = 1.0 / 3.0,
      .dtype = CLMHA_DTYPE_F64}},
    {"softcap_small", {DESC_SIZE, .embed_dim = 4, .num_heads = 1, .softcap = 1e-5}},
    // The largest a layer takes is FLT_MAX (3.4028e38): 3.4e38 has a 2-digit shortest form.
    {"softcap_large", {DESC_SIZE, .embed_dim = 4, .num_heads = 1, .softcap = 3.4e38}},
    {"alibi", {DESC_SIZE, .embed_dim = 12, .num_heads = 3, .bias = true, .alibi = true}},
    {"alibi_gqa_window_f16",
     {DESC_SIZE, .embed_dim = 16, .num_heads = 4, .num_kv_heads = 2, .add_bias_kv = true,
      .window = true, .window_left = 3, .window_right = 0, .alibi = true,
      .dtype = CLMHA_DTYPE_F16}},
    {"softcap_alibi_everything_f64",
     {DESC_SIZE, .embed_dim = 16, .num_heads = 8, .kdim = 3, .vdim = 9, .add_bias_kv = true,
      .add_zero_attn = true, .batch_first = true, .dropout = 0.25f, .softcap = 0.1,
      .alibi = true, .dtype = CLMHA_DTYPE_F64}},
    // Attention sinks: the tensor sinks (H), whose presence turns sinks on.
    {"sinks", {DESC_SIZE, .embed_dim = 8, .num_heads = 2, .bias = true, .sinks = true}},
    {"sinks_gqa_window_f16",
     {DESC_SIZE, .embed_dim = 16, .num_heads = 4, .num_kv_heads = 2, .add_bias_kv = true,
      .window = true, .window_left = 5, .window_right = 0, .sinks = true,
      .dtype = CLMHA_DTYPE_F16}},
    {"sinks_alibi_softcap_everything_f64",
     {DESC_SIZE, .embed_dim = 16, .num_heads = 8, .kdim = 3, .vdim = 9, .bias = true,
      .add_bias_kv = true, .add_zero_attn = true, .batch_first = true, .softcap = 30.0,
      .alibi = true, .sinks = true, .dtype = CLMHA_DTYPE_F64}},
#undef DESC_SIZE
};

// The file's header length and total size agree with the format.
static void expect_well_formed(const char *path) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    unsigned char len[8];
    cr_assert_eq(fread(len, 1, 8, f), 8);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
    cr_expect_eq(n % 8, 0, "header length %llu is not a multiple of 8", (unsigned long long)n);
    fclose(f);
}

Test(safetensors, round_trip) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "layer.safetensors", path, sizeof path);
    cl_device_fp_config fp64 = 0;  // 0, or a refused query: no float64 layers (rusticl)
    clGetDeviceInfo(clmha_context_cl_device(e.ctx), CL_DEVICE_DOUBLE_FP_CONFIG, sizeof fp64,
                    &fp64, NULL);
    for (size_t c = 0; c < sizeof rt_cases / sizeof *rt_cases; ++c) {
        const rt_case *rc = &rt_cases[c];
        if (rc->desc.dtype == CLMHA_DTYPE_F64 && !fp64) {
            cr_log_info("%s: skipped, the device has no double precision", rc->name);
            continue;
        }
        clmha_layer *a = NULL, *b = BAD_LAYER;
        cr_assert_eq(clmha_layer_create(&a, e.ctx, &rc->desc), CLMHA_SUCCESS, "%s: %s", rc->name,
                     clmha_context_last_error(e.ctx));
        randomise(a, c + 1);
        // The second case onwards overwrites the file of the previous one.
        cr_assert_eq(clmha_layer_save(a, path), CLMHA_SUCCESS, "%s: save: %s", rc->name,
                     clmha_context_last_error(e.ctx));
        char first[256] = "";
        cr_expect_eq(tmpdir_list(e.dir, first, sizeof first), 1,
                     "%s: the folder holds more than the saved file", rc->name);
        cr_expect_str_eq(first, "layer.safetensors");
        expect_well_formed(path);
        cr_assert_eq(clmha_layer_load(&b, e.ctx, path), CLMHA_SUCCESS, "%s: load: %s", rc->name,
                     clmha_context_last_error(e.ctx));
        clmha_layer_desc da = {.struct_size = sizeof da}, db = {.struct_size = sizeof db};
        cr_assert_eq(clmha_layer_get_desc(a, &da), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_get_desc(b, &db), CLMHA_SUCCESS);
        expect_same_desc(&da, &db, rc->name);
        expect_same_parameters(a, b, rc->name);
        clmha_layer_release(a);
        clmha_layer_release(b);
    }
    env_close(&e);
}

// A saved file has the documented header, with PyTorch's names and F32 tensors.
Test(safetensors, saved_header) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "h.safetensors", path, sizeof path);
    clmha_layer *a = NULL;
    clmha_layer_desc d = {.struct_size = sizeof d,
                          .embed_dim = 4, .num_heads = 2, .kdim = 3, .vdim = 4, .bias = true,
                          .dropout = 0.1f, .batch_first = true};
    cr_assert_eq(clmha_layer_create(&a, e.ctx, &d), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_save(a, path), CLMHA_SUCCESS, "%s", clmha_context_last_error(e.ctx));
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    unsigned char len[8];
    cr_assert_eq(fread(len, 1, 8, f), 8);
    size_t n = len[0] | (size_t)len[1] << 8;
    char *h = calloc(n + 1, 1);
    cr_assert_eq(fread(h, 1, n, f), n);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    // q (4,4) k (4,3) v (4,4) in_proj_bias (12) out (4,4) out bias (4): 16+12+16+12+16+4 floats
    cr_expect_eq((size_t)size, 8 + n + 76 * 4);
    const char *want[] = {
        "\"num_heads\":\"2\"", "\"batch_first\":\"true\"", "\"add_zero_attn\":\"false\"",
        "\"dropout\":\"0.100000001\"", "\"q_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4]",
        "\"k_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,3]", "\"v_proj_weight\"",
        "\"in_proj_bias\":{\"dtype\":\"F32\",\"shape\":[12]", "\"out_proj.weight\"",
        "\"out_proj.bias\":{\"dtype\":\"F32\",\"shape\":[4]"};
    for (size_t i = 0; i < sizeof want / sizeof *want; ++i)
        cr_expect(strstr(h, want[i]) != NULL, "header lacks %s: %s", want[i], h);
    cr_expect(strstr(h, "in_proj_weight") == NULL, "kdim != E must not write in_proj_weight");
    cr_expect(strstr(h, "bias_k") == NULL);
    cr_expect(strstr(h, "window") == NULL, "a layer without a window writes no window: %s", h);
    cr_expect(strstr(h, "softcap") == NULL && strstr(h, "alibi") == NULL,
              "a layer without softcap and alibi writes neither: %s", h);
    free(h);
    clmha_layer_release(a);
    env_close(&e);
}

// A windowed layer's file says so in __metadata__ window, "LEFT,RIGHT", -1 for a side left
// unbounded.
Test(safetensors, saved_window) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "w.safetensors", path, sizeof path);
    static const struct {
        int64_t left, right;
        const char *want;
    } windows[] = {{1023, 0, "\"window\":\"1023,0\""},
                   {-1, 3, "\"window\":\"-1,3\""},
                   {0, -1, "\"window\":\"0,-1\""}};
    for (size_t i = 0; i < sizeof windows / sizeof *windows; ++i) {
        clmha_layer *a = NULL;
        clmha_layer_desc d = {.struct_size = sizeof d, .embed_dim = 4, .num_heads = 2,
                              .window = true, .window_left = windows[i].left,
                              .window_right = windows[i].right};
        cr_assert_eq(clmha_layer_create(&a, e.ctx, &d), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_save(a, path), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(e.ctx));
        size_t size = 0;
        char *bytes = read_file(path, &size);
        cr_assert(bytes && size > 8);
        size_t n = (size_t)(unsigned char)bytes[0] | (size_t)(unsigned char)bytes[1] << 8;
        cr_assert_leq(8 + n, size);
        bytes[8 + n - 1] = '\0';  // the header as a string (its last byte is '}' or padding)
        cr_expect(strstr(bytes + 8, windows[i].want) != NULL, "header lacks %s: %s",
                  windows[i].want, bytes + 8);
        free(bytes);
        clmha_layer_release(a);
    }
    env_close(&e);
}

// A soft-capped layer's file has __metadata__ softcap, the shortest decimal of the double; an
// ALiBi layer's has alibi "true" and the tensor alibi_slopes (H) after the others; a layer with
// sinks has the tensor sinks (H) last, and no metadata key for it.
Test(safetensors, saved_score_variants) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "sv.safetensors", path, sizeof path);
    static const struct {
        double softcap;
        bool alibi, sinks;
        const char *want[2];
    } cases[] = {{50.0, false, false, {"\"softcap\":\"50\"", NULL}},
                 {0.1, false, false, {"\"softcap\":\"0.1\"", NULL}},
                 {1.0 / 3.0, false, false, {"\"softcap\":\"0.3333333333333333\"", NULL}},
                 {0.0, true, false,
                  {"\"alibi\":\"true\"}",
                   "\"alibi_slopes\":{\"dtype\":\"F32\",\"shape\":[2],"
                   "\"data_offsets\":[256,264]}"}},
                 {2.5, true, false,
                  {"\"softcap\":\"2.5\",\"alibi\":\"true\"}", "\"alibi_slopes\""}},
                 {0.0, false, true,
                  {"\"dropout\":\"0\"}",
                   "\"sinks\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[256,264]}"}},
                 {0.0, true, true,
                  {"\"alibi_slopes\":{\"dtype\":\"F32\",\"shape\":[2],"
                   "\"data_offsets\":[256,264]}",
                   "\"sinks\":{\"dtype\":\"F32\",\"shape\":[2],"
                   "\"data_offsets\":[264,272]}"}}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
        clmha_layer *a = NULL;
        clmha_layer_desc d = {.struct_size = sizeof d, .embed_dim = 4, .num_heads = 2,
                              .softcap = cases[i].softcap, .alibi = cases[i].alibi,
                              .sinks = cases[i].sinks};
        cr_assert_eq(clmha_layer_create(&a, e.ctx, &d), CLMHA_SUCCESS);
        static const float sinks[2] = {0.75f, -1.5f};
        if (cases[i].sinks)
            cr_assert_eq(clmha_layer_set_parameter(a, "sinks", sinks, 2), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_save(a, path), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(e.ctx));
        size_t size = 0;
        char *bytes = read_file(path, &size);
        cr_assert(bytes && size > 8);
        size_t n = (size_t)(unsigned char)bytes[0] | (size_t)(unsigned char)bytes[1] << 8;
        cr_assert_eq(8 + n + (64 + (cases[i].alibi ? 2 : 0) + (cases[i].sinks ? 2 : 0)) * 4,
                     size);
        bytes[8 + n - 1] = '\0';
        const char *h = bytes + 8;
        for (size_t k = 0; k < 2 && cases[i].want[k]; ++k)
            cr_expect(strstr(h, cases[i].want[k]) != NULL, "header lacks %s: %s",
                      cases[i].want[k], h);
        cr_expect_eq(strstr(h, "softcap") != NULL, cases[i].softcap > 0.0, "%s", h);
        cr_expect_eq(strstr(h, "alibi") != NULL, cases[i].alibi, "%s", h);
        cr_expect_eq(strstr(h, "sinks") != NULL, cases[i].sinks, "%s", h);
        if (cases[i].sinks) {  // the last tensor
            float got[2];
            memcpy(got, bytes + size - sizeof got, sizeof got);
            cr_expect(got[0] == sinks[0] && got[1] == sinks[1], "%g %g", (double)got[0],
                      (double)got[1]);
        }
        if (cases[i].alibi) {  // the geometric slopes 2^-4, 2^-8 as F32
            float slopes[2];
            memcpy(slopes, bytes + size - sizeof slopes - (cases[i].sinks ? 8 : 0),
                   sizeof slopes);
            cr_expect(slopes[0] == 0.0625f && slopes[1] == 0.00390625f, "%g %g",
                      (double)slopes[0], (double)slopes[1]);
        }
        free(bytes);
        clmha_layer_release(a);
    }
    env_close(&e);
}

// A layer's user functions: the source in __metadata__ mod_source (quotes, backslashes, tabs,
// newlines, a control byte and UTF-8 kept exactly), p as the tensor mod_params; the loaded
// layer computes what the saved one did. A source that is not UTF-8 is not saved; a file with
// p but no source, or p of two dimensions, is refused.
Test(safetensors, user_functions) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "mods.safetensors", path, sizeof path);
    static const char extra[] = "\n/* \"quoted\" \\ back\tslash \x01 caf\xc3\xa9 */\n";
    char source[4096];
    snprintf(source, sizeof source, "%s%s", user_test_source, extra);
    for (int f64 = 0; f64 < 2; ++f64) {
        clmha_layer_desc d = {.struct_size = sizeof d, .embed_dim = 8, .num_heads = 2,
                              .bias = true, .alibi = true, .mod_source = source,
                              .mod_params = user_test_params,
                              .mod_params_count = USER_TEST_PARAMS,
                              .dtype = f64 ? CLMHA_DTYPE_F64 : CLMHA_DTYPE_F32};
        clmha_layer *a = NULL, *b = NULL;
        clmha_status st = clmha_layer_create(&a, e.ctx, &d);
        if (f64 && st == CLMHA_UNSUPPORTED) break;  // no fp64 on this device
        cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(e.ctx));
        randomise(a, 99);
        cr_assert_eq(clmha_layer_save(a, path), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(e.ctx));
        expect_well_formed(path);
        cr_assert_eq(clmha_layer_load_as(&b, e.ctx, path, d.dtype), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(e.ctx));
        clmha_layer_desc da = {.struct_size = sizeof da}, db = {.struct_size = sizeof db};
        cr_assert_eq(clmha_layer_get_desc(a, &da), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_get_desc(b, &db), CLMHA_SUCCESS);
        expect_same_desc(&da, &db, "user functions");
        cr_assert_not_null(db.mod_source);
        cr_expect_str_eq(db.mod_source, source);
        cr_expect_eq(db.mod_params_count, (size_t)USER_TEST_PARAMS);
        float p[USER_TEST_PARAMS];
        cr_assert_eq(clmha_layer_get_mod_params(b, p, USER_TEST_PARAMS), CLMHA_SUCCESS);
        cr_expect_eq(memcmp(p, user_test_params, sizeof p), 0, "p differs after the round trip");
        expect_same_parameters(a, b, "user functions");
        // The same outputs: the functions compiled into both layers.
        float x[2 * 5 * 8], ya[2 * 5 * 8], yb[2 * 5 * 8];
        for (size_t i = 0; i < sizeof x / sizeof *x; ++i)
            x[i] = (float)((i * 37) % 17) / 8.0f - 1.0f;
        clmha_forward_args fa = {.struct_size = sizeof fa, .is_causal = true};
        fa.query = (clmha_tensor){.ndim = 3, .shape = {5, 2, 8}, .data = x};
        cr_assert_eq(clmha_layer_forward_host(a, &fa, ya, 80, NULL, 0), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_forward_host(b, &fa, yb, 80, NULL, 0), CLMHA_SUCCESS);
        cr_expect_eq(memcmp(ya, yb, sizeof ya), 0, "the loaded layer computes otherwise");
        clmha_layer_release(a);
        clmha_layer_release(b);
    }
    // Not UTF-8: refused, nothing written.
    remove(path);
    clmha_layer_desc d = {.struct_size = sizeof d, .embed_dim = 8, .num_heads = 2,
                          .mod_source = "int clmha_mask_mod(int b, int h, int q, int k, "
                                        "__global const float *p) { return 1; } /* \xff */"};
    clmha_layer *a = NULL;
    cr_assert_eq(clmha_layer_create(&a, e.ctx, &d), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(e.ctx));
    cr_expect_eq(clmha_layer_save(a, path), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(e.ctx), "not valid UTF-8"), "%s",
              clmha_context_last_error(e.ctx));
    cr_expect_eq(access(path, F_OK), -1, "a refused save left a file");
    clmha_layer_release(a);
    // p without a source, p of two dimensions.
    static const struct {
        const char *meta, *shape, *want;
    } bad[] = {{"", "[2]", "no __metadata__ mod_source"},
               {",\"mod_source\":\"int clmha_mask_mod(int b, int h, int q, int k, __global "
                "const float *p) { return 1; }\"",
                "[1,2]", "has 2 dimensions, expected 1"}};
    for (size_t i = 0; i < 2; ++i) {
        char header[1024];
        snprintf(header, sizeof header,
                 "{\"__metadata__\":{\"num_heads\":\"2\"%s},"
                 "\"in_proj_weight\":{\"dtype\":\"F32\",\"shape\":[12,4],"
                 "\"data_offsets\":[0,192]},"
                 "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],"
                 "\"data_offsets\":[192,256]},"
                 "\"mod_params\":{\"dtype\":\"F32\",\"shape\":%s,"
                 "\"data_offsets\":[256,264]}}",
                 bad[i].meta, bad[i].shape);
        float data[66] = {0};
        write_st(path, header, (8 - strlen(header) % 8) % 8, data, sizeof data);
        clmha_layer *l = NULL;
        cr_expect_eq(clmha_layer_load(&l, e.ctx, path), CLMHA_INVALID_FILE, "case %zu", i);
        cr_expect(strstr(clmha_context_last_error(e.ctx), bad[i].want), "%s",
                  clmha_context_last_error(e.ctx));
        clmha_layer_release(l);
    }
    env_close(&e);
}

Test(safetensors, save_errors) {
    env e;
    env_open(&e);
    clmha_layer *a = NULL;
    clmha_layer_desc d = {.struct_size = sizeof d, .embed_dim = 4, .num_heads = 2, .bias = true};
    cr_assert_eq(clmha_layer_create(&a, e.ctx, &d), CLMHA_SUCCESS);
    cr_expect_eq(clmha_layer_save(NULL, "/tmp/x"), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_layer_save(a, NULL), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(e.ctx), "path") != NULL);
    cr_expect_eq(clmha_layer_save(a, "/nonexistent-clmha-dir/x.safetensors"), CLMHA_IO_ERROR);
    cr_expect(strstr(clmha_context_last_error(e.ctx), "/nonexistent-clmha-dir/x.safetensors"));
    // The destination is a folder: the rename fails and the temporary file is removed.
    char sub[256];
    path_in(&e, "sub", sub, sizeof sub);
    cr_assert_eq(mkdir(sub, 0700), 0);
    char inner[300];
    snprintf(inner, sizeof inner, "%s/keep", sub);
    write_bytes(inner, "x", 1);  // a non-empty folder cannot be replaced by a file
    cr_expect_eq(clmha_layer_save(a, sub), CLMHA_IO_ERROR);
    cr_expect(strstr(clmha_context_last_error(e.ctx), sub), "%s",
              clmha_context_last_error(e.ctx));
    cr_expect_eq(tmpdir_count(e.dir), 1, "a temporary file was left behind");
    remove(inner);
    // Replacing a file keeps its mode.
    char path[256];
    path_in(&e, "mode.safetensors", path, sizeof path);
    write_bytes(path, "old", 3);
    cr_assert_eq(chmod(path, 0640), 0);
    cr_expect_eq(clmha_layer_save(a, path), CLMHA_SUCCESS);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_expect_eq(sb.st_mode & 0777, 0640);
    cr_expect_gt(sb.st_size, 3);
    clmha_layer_release(a);
    env_close(&e);
}

// clmha_layer_save through the shared writer: an existing FIFO or symbolic link at the path is
// refused and left as it is (never opened: no hang); a 255-byte file name is written.
Test(safetensors, save_special_targets_and_long_names, .timeout = 60) {
    env e;
    env_open(&e);
    clmha_layer *a = NULL;
    clmha_layer_desc d = {.struct_size = sizeof d, .embed_dim = 4, .num_heads = 2, .bias = true};
    cr_assert_eq(clmha_layer_create(&a, e.ctx, &d), CLMHA_SUCCESS);
    char fifo[256], link_path[256];
    path_in(&e, "fifo.safetensors", fifo, sizeof fifo);
    path_in(&e, "null.safetensors", link_path, sizeof link_path);
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    cr_assert_eq(symlink("/dev/null", link_path), 0);
    const char *paths[] = {fifo, link_path};
    for (int i = 0; i < 2; ++i) {
        cr_expect_eq(clmha_layer_save(a, paths[i]), CLMHA_IO_ERROR, "%s", paths[i]);
        const char *msg = clmha_context_last_error(e.ctx);
        cr_expect(strstr(msg, paths[i]) && strstr(msg, i ? "symbolic link" : "FIFO"), "%s", msg);
        struct stat sb;
        cr_assert_eq(lstat(paths[i], &sb), 0);
        cr_expect(i ? S_ISLNK(sb.st_mode) : S_ISFIFO(sb.st_mode), "%s was replaced", paths[i]);
    }
    cr_expect_eq(tmpdir_count(e.dir), 2, "a temporary file was left behind");
    char name[256], path[512];
    memset(name, 'l', 243);
    memcpy(name + 243, ".safetensors", 13);  // 255 bytes
    path_in(&e, name, path, sizeof path);
    cr_expect_eq(clmha_layer_save(a, path), CLMHA_SUCCESS, "%s", clmha_context_last_error(e.ctx));
    clmha_layer_release(a);
    env_close(&e);
}

// A layer file that is not a regular file is refused at once: a FIFO with no writer (which
// would block the open or the read), /dev/zero (which never ends), a folder.
Test(safetensors, load_special_files_refused_at_once, .timeout = 60) {
    env e;
    env_open(&e);
    char fifo[256];
    path_in(&e, "fifo.safetensors", fifo, sizeof fifo);
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    const char *paths[] = {fifo, "/dev/zero", e.dir};
    const char *kinds[] = {"FIFO", "character device", "folder"};
    for (int i = 0; i < 3; ++i) {
        clmha_layer *l = (clmha_layer *)&e;
        clmha_status st = clmha_layer_load(&l, e.ctx, paths[i]);
        const char *msg = clmha_context_last_error(e.ctx);
        cr_expect_neq(st, CLMHA_SUCCESS, "%s loaded", paths[i]);
        cr_expect_null(l, "%s: out not set to NULL", paths[i]);
        cr_expect(strstr(msg, paths[i]) != NULL, "%s: message \"%s\"", paths[i], msg);
        cr_expect(strstr(msg, kinds[i]) != NULL || strstr(msg, "directory") != NULL,
                  "%s: message \"%s\" lacks \"%s\"", paths[i], msg, kinds[i]);
    }
    env_close(&e);
}

// ---- F16, F64, and header variants ------------------------------------------------------------

// E 4, 2 heads, no bias: in_proj_weight (12, 4) and out_proj.weight (4, 4), 64 values.
#define META2 "\"__metadata__\":{\"num_heads\":\"2\"}"

static const struct {
    uint16_t half;
    uint32_t bits;  // the float it is
} halves[] = {
    {0x0000, 0x00000000u}, {0x8000, 0x80000000u},  // +-0
    {0x3c00, 0x3f800000u}, {0xc000, 0xc0000000u},  // 1, -2
    {0x3800, 0x3f000000u}, {0x3555, 0x3eaaa000u},  // 0.5, 0.333251953125
    {0x7bff, 0x477fe000u},                         // 65504, largest finite
    {0x0001, 0x33800000u},                         // 2^-24, smallest subnormal
    {0x03ff, 0x387fc000u},                         // largest subnormal 1023 * 2^-24
    {0x8200, 0xb8000000u},                         // -2^-15, a negative subnormal
    {0x0400, 0x38800000u},                         // 2^-14, smallest normal
    {0x7c00, 0x7f800000u}, {0xfc00, 0xff800000u},  // +-inf
    {0x7e00, 0x7fc00000u},                         // quiet NaN
};
#define NUM_HALVES (sizeof halves / sizeof *halves)

static void load_ok(env *e, const char *path, clmha_layer **out) {
    cr_assert_eq(clmha_layer_load(out, e->ctx, path), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(e->ctx));
}

// Writes a layer file whose in_proj_weight (12, 4) and out_proj.weight (4, 4) are the 64
// 16-bit values @p data of dtype @p dtype ("F16" or "BF16"), loads it and reads the 64 values
// back as floats into @p got.
static void load_16_bit(env *e, const char *path, const char *dtype,
                        const unsigned char data[64 * 2], float got[64]) {
    char header[512];
    snprintf(header, sizeof header,
             "{" META2 ",\"in_proj_weight\":{\"dtype\":\"%s\",\"shape\":[12,4],\"data_offsets\":"
             "[0,96]},\"out_proj.weight\":{\"dtype\":\"%s\",\"shape\":[4,4],\"data_offsets\":"
             "[96,128]}}",
             dtype, dtype);
    write_st(path, header, 3, data, 64 * 2);
    clmha_layer *l = NULL;
    load_ok(e, path, &l);
    cr_assert_eq(clmha_layer_get_parameter(l, "in_proj_weight", got, 48), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_get_parameter(l, "out_proj.weight", got + 48, 16), CLMHA_SUCCESS);
    clmha_layer_release(l);
}

Test(safetensors, f16_values) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "f16.safetensors", path, sizeof path);
    unsigned char data[64 * 2];
    for (size_t i = 0; i < 64; ++i) {
        uint16_t h = halves[i % NUM_HALVES].half;
        data[2 * i] = (unsigned char)h;
        data[2 * i + 1] = (unsigned char)(h >> 8);
    }
    float w[64];
    load_16_bit(&e, path, "F16", data, w);
    for (size_t i = 0; i < 64; ++i) {
        float got = w[i];
        uint32_t want = halves[i % NUM_HALVES].bits;
        if (isnan(bits_float(want)))
            cr_expect(isnan(got), "value %zu: half 0x%04x gave %g, expected NaN", i,
                      halves[i % NUM_HALVES].half, (double)got);
        else
            cr_expect_eq(float_bits(got), want, "value %zu: half 0x%04x gave %a, expected %a", i,
                         halves[i % NUM_HALVES].half, (double)got, (double)bits_float(want));
    }
    env_close(&e);
}

// BF16 tensors: the upper halves of float32s, widened exactly.
Test(safetensors, bf16_values) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "bf16.safetensors", path, sizeof path);
    static const uint32_t floats[] = {0x00000000u, 0x80000000u, 0x3f800000u, 0xc0000000u,
                                      0x3eab0000u, 0x7f7f0000u, 0x00010000u, 0x80800000u,
                                      0x7f800000u, 0xff800000u, 0x7fc00000u};
    enum { F = sizeof floats / sizeof *floats };
    unsigned char data[64 * 2];
    for (size_t i = 0; i < 64; ++i) {
        uint16_t b = (uint16_t)(floats[i % F] >> 16);
        data[2 * i] = (unsigned char)b;
        data[2 * i + 1] = (unsigned char)(b >> 8);
    }
    float w[64];
    load_16_bit(&e, path, "BF16", data, w);
    for (size_t i = 0; i < 64; ++i) {
        float got = w[i];
        uint32_t want = floats[i % F];
        if (isnan(bits_float(want)))
            cr_expect(isnan(got), "value %zu gave %g, expected NaN", i, (double)got);
        else
            cr_expect_eq(float_bits(got), want, "value %zu gave %a, expected %a", i, (double)got,
                         (double)bits_float(want));
    }
    env_close(&e);
}

Test(safetensors, f64_values) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "f64.safetensors", path, sizeof path);
    static const struct {
        double d;
        uint32_t bits;
    } table[] = {
        {0.1, 0x3dcccccdu},                    // rounded to nearest
        {-1.5, 0xbfc00000u},
        {1e300, 0x7f800000u},                  // beyond float: infinity
        {-1e300, 0xff800000u},
        {1e-50, 0x00000000u},                  // below float's subnormals: zero
        {-1e-50, 0x80000000u},
        {0x1.fffffep127, 0x7f7fffffu},         // FLT_MAX
        {0x1.fffffefffffffp127, 0x7f7fffffu},  // just below FLT_MAX + half an ulp
        {0x1.ffffffp127, 0x7f800000u},         // FLT_MAX + half an ulp rounds to infinity
        {0x1p-149, 0x00000001u},               // smallest float subnormal
        {1.0 / 3.0, 0x3eaaaaabu},
    };
    enum { T = sizeof table / sizeof *table };
    unsigned char data[64 * 8];
    for (size_t i = 0; i < 64; ++i) {
        uint64_t u;
        double d = i == 63 ? NAN : table[i % T].d;
        memcpy(&u, &d, sizeof u);
        put_le64(data + 8 * i, u);
    }
    // Tensors in another order than the data, and an extra metadata key.
    write_st(path,
             "{\"out_proj.weight\":{\"dtype\":\"F64\",\"shape\":[4,4],\"data_offsets\":[384,512]},"
             "\"__metadata__\":{\"format\":\"pt\",\"num_heads\":\"4\"},"
             "\"in_proj_weight\":{\"dtype\":\"F64\",\"shape\":[12,4],\"data_offsets\":[0,384]}}",
             0, data, sizeof data);
    clmha_layer *l = NULL;
    load_ok(&e, path, &l);
    clmha_layer_desc d = {.struct_size = sizeof d};
    clmha_layer_get_desc(l, &d);
    cr_expect_eq(d.num_heads, 4);
    cr_expect(!d.bias && !d.add_bias_kv && !d.batch_first && !d.add_zero_attn);
    cr_expect_eq(d.dropout, 0.0f);
    float w[48], o[16];
    cr_assert_eq(clmha_layer_get_parameter(l, "in_proj_weight", w, 48), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_get_parameter(l, "out_proj.weight", o, 16), CLMHA_SUCCESS);
    for (size_t i = 0; i < 63; ++i) {
        float got = i < 48 ? w[i] : o[i - 48];
        cr_expect_eq(float_bits(got), table[i % T].bits, "value %zu: %a gave %a", i,
                     table[i % T].d, (double)got);
    }
    cr_expect(isnan(o[15]));
    clmha_layer_release(l);
    env_close(&e);
}

// __metadata__ window "LEFT,RIGHT" into the descriptor: bounds -1 (unbounded), 0 and large;
// a file without it has no window.
Test(safetensors, window_metadata) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "win.safetensors", path, sizeof path);
    static const struct {
        const char *meta;  // the window's text, NULL: no window key
        int64_t left, right;
    } cases[] = {{NULL, 0, 0},
                 {"1023,0", 1023, 0},
                 {"-1,0", -1, 0},
                 {"3,-1", 3, -1},
                 {"-1,-1", -1, -1},
                 {"0,0", 0, 0},
                 {"9223372036854775807,7", INT64_MAX, 7}};
    unsigned char data[256] = {0};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
        char header[512];
        snprintf(header, sizeof header,
                 "{\"__metadata__\":{\"num_heads\":\"2\"%s%s%s},"
                 "\"in_proj_weight\":{\"dtype\":\"F32\",\"shape\":[12,4],"
                 "\"data_offsets\":[0,192]},"
                 "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],"
                 "\"data_offsets\":[192,256]}}",
                 cases[i].meta ? ",\"window\":\"" : "", cases[i].meta ? cases[i].meta : "",
                 cases[i].meta ? "\"" : "");
        write_st(path, header, (8 - strlen(header) % 8) % 8, data, sizeof data);
        clmha_layer *l = NULL;
        load_ok(&e, path, &l);
        clmha_layer_desc d = {.struct_size = sizeof d};
        cr_assert_eq(clmha_layer_get_desc(l, &d), CLMHA_SUCCESS);
        const char *what = cases[i].meta ? cases[i].meta : "(none)";
        cr_expect_eq(d.window, cases[i].meta != NULL, "%s: window %d", what, (int)d.window);
        cr_expect_eq(d.window_left, cases[i].left, "%s: window_left %lld", what,
                     (long long)d.window_left);
        cr_expect_eq(d.window_right, cases[i].right, "%s: window_right %lld", what,
                     (long long)d.window_right);
        clmha_layer_release(l);
    }
    env_close(&e);
}

// __metadata__ softcap and alibi into the descriptor, and the tensor alibi_slopes (F32, F16 or
// F64) into the parameter; an ALiBi file without it keeps the geometric slopes.
Test(safetensors, score_variant_metadata) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "sv.safetensors", path, sizeof path);
    static const struct {
        const char *meta;    // metadata after num_heads
        const char *dtype;   // alibi_slopes' dtype, NULL: no such tensor
        double softcap;
        bool alibi;
    } cases[] = {{"", NULL, 0.0, false},
                 {",\"softcap\":\"0\"", NULL, 0.0, false},
                 {",\"softcap\":\"0.0\",\"alibi\":\"false\"", NULL, 0.0, false},
                 {",\"softcap\":\"50.0\"", NULL, 50.0, false},
                 {",\"softcap\":\"1.5\"", NULL, 1.5, false},
                 {",\"softcap\":\"1e-05\"", NULL, 1e-5, false},
                 {",\"softcap\":\"2E+1\"", NULL, 20.0, false},
                 {",\"softcap\":\".25\"", NULL, 0.25, false},
                 {",\"alibi\":\"true\"", NULL, 0.0, true},
                 {",\"alibi\":\"true\",\"softcap\":\"30\"", "F32", 30.0, true},
                 {",\"alibi\":\"true\"", "F16", 0.0, true},
                 {",\"alibi\":\"true\"", "F64", 0.0, true}};
    // The slopes as each dtype holds them: 0.5 and -0.25 (a negative slope is the user's).
    static const unsigned char f32[] = {0, 0, 0, 0x3f, 0, 0, 0x80, 0xbe};
    static const unsigned char f16[] = {0, 0x38, 0, 0xb4};
    static const unsigned char f64[] = {0, 0, 0, 0, 0, 0, 0xe0, 0x3f,
                                        0, 0, 0, 0, 0, 0, 0xd0, 0xbf};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
        const char *dt = cases[i].dtype;
        const unsigned char *sl = !dt ? NULL : dt[1] == '3' ? f32 : dt[1] == '1' ? f16 : f64;
        size_t sl_size = !dt ? 0 : dt[1] == '3' ? sizeof f32 : dt[1] == '1' ? sizeof f16
                                                                              : sizeof f64;
        char tensor[128] = "";
        if (dt)
            snprintf(tensor, sizeof tensor,
                     ",\"alibi_slopes\":{\"dtype\":\"%s\",\"shape\":[2],"
                     "\"data_offsets\":[256,%zu]}",
                     dt, 256 + sl_size);
        char header[768];
        snprintf(header, sizeof header,
                 "{\"__metadata__\":{\"num_heads\":\"2\"%s},"
                 "\"in_proj_weight\":{\"dtype\":\"F32\",\"shape\":[12,4],"
                 "\"data_offsets\":[0,192]},"
                 "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],"
                 "\"data_offsets\":[192,256]}%s}",
                 cases[i].meta, tensor);
        unsigned char data[256 + 16] = {0};
        if (sl) memcpy(data + 256, sl, sl_size);
        write_st(path, header, (8 - strlen(header) % 8) % 8, data, 256 + sl_size);
        clmha_layer *l = NULL;
        load_ok(&e, path, &l);
        clmha_layer_desc d = {.struct_size = sizeof d};
        cr_assert_eq(clmha_layer_get_desc(l, &d), CLMHA_SUCCESS);
        cr_expect_eq(d.softcap, cases[i].softcap, "%s: softcap %.17g", cases[i].meta,
                     d.softcap);
        cr_expect_eq(d.alibi, cases[i].alibi, "%s: alibi", cases[i].meta);
        float got[2] = {0}, want[2];
        cr_expect_eq(clmha_layer_parameter_count(l, "alibi_slopes"), cases[i].alibi ? 2u : 0u);
        if (cases[i].alibi) {
            cr_assert_eq(clmha_layer_get_parameter(l, "alibi_slopes", got, 2), CLMHA_SUCCESS);
            if (sl) want[0] = 0.5f, want[1] = -0.25f;
            else cr_assert_eq(clmha_alibi_slopes(2, want), CLMHA_SUCCESS);
            cr_expect(got[0] == want[0] && got[1] == want[1], "%s %s: slopes %g %g", cases[i].meta,
                      dt ? dt : "(none)", (double)got[0], (double)got[1]);
        }
        clmha_layer_release(l);
    }
    env_close(&e);
}

// The tensor sinks (F32, F16 or F64) turns clmha_layer_desc::sinks on and sets the parameter;
// a file without it makes a layer without sinks. It goes with alibi and its slopes.
Test(safetensors, sinks_tensor) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "sinks.safetensors", path, sizeof path);
    static const struct {
        const char *dtype;  // NULL: no sinks tensor
        bool alibi;         // with alibi and alibi_slopes (F32, 1 and 2) before sinks
    } cases[] = {{NULL, false}, {"F32", false}, {"F16", false}, {"F64", false}, {"F32", true}};
    // 0.5 and -0.25 as each dtype holds them.
    static const unsigned char f32[] = {0, 0, 0, 0x3f, 0, 0, 0x80, 0xbe};
    static const unsigned char f16[] = {0, 0x38, 0, 0xb4};
    static const unsigned char f64[] = {0, 0, 0, 0, 0, 0, 0xe0, 0x3f,
                                        0, 0, 0, 0, 0, 0, 0xd0, 0xbf};
    static const unsigned char slopes[] = {0, 0, 0x80, 0x3f, 0, 0, 0, 0x40};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
        const char *dt = cases[i].dtype;
        const unsigned char *sk = !dt ? NULL : dt[1] == '3' ? f32 : dt[1] == '1' ? f16 : f64;
        size_t sk_size = !dt ? 0 : dt[1] == '3' ? sizeof f32 : dt[1] == '1' ? sizeof f16
                                                                              : sizeof f64;
        size_t at = 256 + (cases[i].alibi ? sizeof slopes : 0);
        char tensors[256] = "";
        if (cases[i].alibi)
            snprintf(tensors, sizeof tensors,
                     ",\"alibi_slopes\":{\"dtype\":\"F32\",\"shape\":[2],"
                     "\"data_offsets\":[256,264]}");
        if (dt)
            snprintf(tensors + strlen(tensors), sizeof tensors - strlen(tensors),
                     ",\"sinks\":{\"dtype\":\"%s\",\"shape\":[2],\"data_offsets\":[%zu,%zu]}",
                     dt, at, at + sk_size);
        char header[768];
        snprintf(header, sizeof header,
                 "{\"__metadata__\":{\"num_heads\":\"2\"%s},"
                 "\"in_proj_weight\":{\"dtype\":\"F32\",\"shape\":[12,4],"
                 "\"data_offsets\":[0,192]},"
                 "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],"
                 "\"data_offsets\":[192,256]}%s}",
                 cases[i].alibi ? ",\"alibi\":\"true\"" : "", tensors);
        unsigned char data[256 + 8 + 16] = {0};
        if (cases[i].alibi) memcpy(data + 256, slopes, sizeof slopes);
        if (sk) memcpy(data + at, sk, sk_size);
        write_st(path, header, (8 - strlen(header) % 8) % 8, data, at + sk_size);
        clmha_layer *l = NULL;
        load_ok(&e, path, &l);
        clmha_layer_desc d = {.struct_size = sizeof d};
        cr_assert_eq(clmha_layer_get_desc(l, &d), CLMHA_SUCCESS);
        cr_expect_eq(d.sinks, dt != NULL, "%s: sinks", dt ? dt : "(none)");
        cr_expect_eq(d.alibi, cases[i].alibi);
        cr_expect_eq(clmha_layer_parameter_count(l, "sinks"), dt ? 2u : 0u);
        if (dt) {
            float got[2] = {0};
            cr_assert_eq(clmha_layer_get_parameter(l, "sinks", got, 2), CLMHA_SUCCESS);
            cr_expect(got[0] == 0.5f && got[1] == -0.25f, "%s: sinks %g %g", dt,
                      (double)got[0], (double)got[1]);
        }
        if (cases[i].alibi) {
            float got[2] = {0};
            cr_assert_eq(clmha_layer_get_parameter(l, "alibi_slopes", got, 2), CLMHA_SUCCESS);
            cr_expect(got[0] == 1.0f && got[1] == 2.0f, "slopes %g %g", (double)got[0],
                      (double)got[1]);
        }
        clmha_layer_release(l);
    }
    env_close(&e);
}

// q/k/v_proj_weight with kdim == vdim == E, metadata booleans, spaces, and mixed dtypes.
Test(safetensors, separate_weights_and_options) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "qkv.safetensors", path, sizeof path);
    float data[4 * 16 + 12 + 4 + 8];
    for (size_t i = 0; i < sizeof data / sizeof *data; ++i) data[i] = (float)i * 0.25f - 3.0f;
    write_st(path,
             "  {\"__metadata__\" : {\"num_heads\":\"1\", \"batch_first\":\"true\", "
             "\"add_zero_attn\":\"true\", \"dropout\":\"2.5e-1\"},\n"
             "\"q_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]},"
             "\"k_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[64,128]},"
             "\"v_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[128,192]},"
             "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[192,256]},"
             "\"in_proj_bias\":{\"dtype\":\"F32\",\"shape\":[12],\"data_offsets\":[256,304]},"
             "\"out_proj.bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[304,320]},"
             "\"bias_k\":{\"dtype\":\"F32\",\"shape\":[1,1,4],\"data_offsets\":[320,336]},"
             "\"bias_v\":{\"dtype\":\"F32\",\"shape\":[1,1,4],\"data_offsets\":[336,352]}}\r\n",
             21, data, sizeof data);
    clmha_layer *l = NULL;
    load_ok(&e, path, &l);
    clmha_layer_desc d = {.struct_size = sizeof d};
    clmha_layer_get_desc(l, &d);
    cr_expect_eq(d.embed_dim, 4);
    cr_expect_eq(d.kdim, 4);
    cr_expect_eq(d.vdim, 4);
    cr_expect(d.bias && d.add_bias_kv && d.batch_first && d.add_zero_attn);
    cr_expect_eq(d.dropout, 0.25f);
    float w[48];
    cr_assert_eq(clmha_layer_get_parameter(l, "in_proj_weight", w, 48), CLMHA_SUCCESS);
    cr_expect_eq(memcmp(w, data, sizeof w), 0, "q, k, v stacked = in_proj_weight");
    float bv[4];
    cr_assert_eq(clmha_layer_get_parameter(l, "bias_v", bv, 4), CLMHA_SUCCESS);
    cr_expect_eq(memcmp(bv, data + 84, sizeof bv), 0);
    clmha_layer_release(l);
    env_close(&e);
}

// A grouped-query layer file: shapes from __metadata__ num_kv_heads; wrong ones are refused
// with the expected shape.
Test(safetensors, grouped_query_shapes) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "gqa.safetensors", path, sizeof path);
    // E 4, H 2 (D 2), num_kv_heads 1: q (4,4), k (2,3), v (2,3), in_proj_bias 4 + 2*2 = 8.
    float data[16 + 6 + 6 + 16 + 8 + 4];
    for (size_t i = 0; i < sizeof data / sizeof *data; ++i) data[i] = (float)i * 0.5f - 7.0f;
    const char *fmt =
        "{\"__metadata__\":{\"num_heads\":\"2\",\"num_kv_heads\":\"%d\"},"
        "\"q_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]},"
        "\"k_proj_weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[64,88]},"
        "\"v_proj_weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[88,112]},"
        "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[112,176]},"
        "\"in_proj_bias\":{\"dtype\":\"F32\",\"shape\":[8],\"data_offsets\":[176,208]},"
        "\"out_proj.bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[208,224]}}";
    char header[1024];
    snprintf(header, sizeof header, fmt, 1);
    write_st(path, header, 0, data, sizeof data);
    clmha_layer *l = NULL;
    load_ok(&e, path, &l);
    clmha_layer_desc d = {.struct_size = sizeof d};
    clmha_layer_get_desc(l, &d);
    cr_expect(d.embed_dim == 4 && d.num_heads == 2 && d.num_kv_heads == 1 && d.kdim == 3 &&
              d.vdim == 3 && d.bias);
    cr_expect_eq(clmha_layer_parameter_count(l, "k_proj_weight"), 6);
    cr_expect_eq(clmha_layer_parameter_count(l, "in_proj_bias"), 8);
    float kw[6];
    cr_assert_eq(clmha_layer_get_parameter(l, "k_proj_weight", kw, 6), CLMHA_SUCCESS);
    cr_expect_eq(memcmp(kw, data + 16, sizeof kw), 0);
    clmha_layer_release(l);
    // The same tensors under num_kv_heads 2 (k_proj_weight would be (4, 3)): refused, naming
    // the expected shape.
    snprintf(header, sizeof header, fmt, 2);
    write_st(path, header, 0, data, sizeof data);
    l = BAD_LAYER;
    cr_expect_eq(clmha_layer_load(&l, e.ctx, path), CLMHA_INVALID_FILE);
    const char *msg = clmha_context_last_error(e.ctx);
    cr_expect(strstr(msg, "k_proj_weight") && strstr(msg, "(4, 3)"), "%s", msg);
    env_close(&e);
}

// Layer files written by PyTorch (tools/make_cli_cases.py via tools/export_mha.py).
Test(safetensors, pytorch_files) {
    env e;
    env_open(&e);
    static const struct {
        const char *dir;
        size_t e, h, kdim, vdim;
        bool bias, add_bias_kv, add_zero_attn, batch_first;
        float dropout;
    } files[] = {
        {"self_attention", 8, 2, 8, 8, true, false, false, false, 0.0f},
        {"kdim_vdim", 12, 3, 5, 7, true, false, false, false, 0.0f},
        {"no_bias", 8, 2, 8, 8, false, false, false, false, 0.0f},
        {"add_bias_kv", 8, 2, 8, 8, true, true, false, false, 0.0f},
        {"add_zero_attn", 8, 2, 8, 8, true, false, true, false, 0.0f},
        {"batch_first", 8, 2, 8, 8, true, false, false, true, 0.0f},
        {"dropout_eval", 8, 2, 8, 8, true, false, false, false, 0.5f},
        {"layer_f16", 8, 2, 8, 8, true, false, false, false, 0.0f},
        {"layer_f64", 8, 4, 6, 8, true, true, false, false, 0.0f},
    };
    for (size_t i = 0; i < sizeof files / sizeof *files; ++i) {
        char path[512];
        snprintf(path, sizeof path, "%s/cli/%s/layer.safetensors", CLMHA_TEST_DATA_DIR,
                 files[i].dir);
        clmha_layer *l = NULL;
        clmha_status st = clmha_layer_load(&l, e.ctx, path);
        cr_expect_eq(st, CLMHA_SUCCESS, "%s: %s", files[i].dir, clmha_context_last_error(e.ctx));
        if (st) continue;
        clmha_layer_desc d = {.struct_size = sizeof d};
        clmha_layer_get_desc(l, &d);
        cr_expect_eq(d.embed_dim, files[i].e, "%s", files[i].dir);
        cr_expect_eq(d.num_heads, files[i].h, "%s", files[i].dir);
        cr_expect_eq(d.kdim, files[i].kdim, "%s", files[i].dir);
        cr_expect_eq(d.vdim, files[i].vdim, "%s", files[i].dir);
        cr_expect_eq(d.bias, files[i].bias, "%s", files[i].dir);
        cr_expect_eq(d.add_bias_kv, files[i].add_bias_kv, "%s", files[i].dir);
        cr_expect_eq(d.add_zero_attn, files[i].add_zero_attn, "%s", files[i].dir);
        cr_expect_eq(d.batch_first, files[i].batch_first, "%s", files[i].dir);
        cr_expect_eq(d.dropout, files[i].dropout, "%s", files[i].dir);
        clmha_layer_release(l);
    }
    env_close(&e);
}

// ---- malformed files --------------------------------------------------------------------------

// Pieces of headers. The base layer: E 4, 2 heads, no bias; data 256 bytes.
#define IPW(body) "\"in_proj_weight\":{" body "}"
#define IPW_OK IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[0,192]")
#define OPW_AT(range) \
    "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":" range "}"
#define OPW_OK OPW_AT("[192,256]")
#define META(body) "\"__metadata__\":{" body "}"
#define NH2 META("\"num_heads\":\"2\"")
#define BASE(meta) "{" meta "," IPW_OK "," OPW_OK "}"
#define IPB_OK "\"in_proj_bias\":{\"dtype\":\"F32\",\"shape\":[12],\"data_offsets\":[256,304]}"
#define OPB_OK "\"out_proj.bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[256,272]}"
#define BK_OK "\"bias_k\":{\"dtype\":\"F32\",\"shape\":[1,1,4],\"data_offsets\":[256,272]}"

#define NO_DATA SIZE_MAX

typedef enum raw_kind { HEADER, EMPTY, SHORT, LONG_LENGTH, NO_FILE, DIRECTORY } raw_kind;

typedef struct bad_case {
    const char *name;
    raw_kind kind;
    const char *header;  // HEADER: the JSON
    size_t data_size;    // HEADER: bytes after the header (256 when 0, none when NO_DATA)
    clmha_status status;
    const char *substring;  // the message must contain it (and the path)
} bad_case;

static const bad_case bad_cases[] = {
    // the container
    {"empty file", EMPTY, NULL, 0, CLMHA_INVALID_FILE, "empty"},
    {"shorter than 8 bytes", SHORT, NULL, 0, CLMHA_INVALID_FILE, "too short"},
    {"header length past the end", LONG_LENGTH, NULL, 0, CLMHA_INVALID_FILE,
     "header length 4096 is larger than the rest of the file"},
    {"header not JSON", HEADER, "{\"__metadata__\":{\"num_heads\":\"2\"", 0, CLMHA_INVALID_FILE,
     "not valid JSON"},
    {"header garbage", HEADER, "hello world", 0, CLMHA_INVALID_FILE, "not valid JSON"},
    {"header only spaces", HEADER, "        ", 0, CLMHA_INVALID_FILE, "header is empty"},
    {"header JSON array", HEADER, "[1, 2, 3]", 0, CLMHA_INVALID_FILE,
     "a JSON array, not a JSON object"},
    {"header JSON string", HEADER, "\"F32\"", 0, CLMHA_INVALID_FILE, "a JSON string, not"},
    {"bytes after the JSON", HEADER, BASE(NH2) " x", 0, CLMHA_INVALID_FILE,
     "other than whitespace after"},
    {"control byte after the JSON", HEADER, BASE(NH2) "\t\n\x01", 0, CLMHA_INVALID_FILE,
     "control byte 0x01"},
    {"invalid UTF-8", HEADER, "{" NH2 ",\"x\xff\":{}}", 0, CLMHA_INVALID_FILE, "UTF-8"},
    {"\\u0000 in a name", HEADER, "{" NH2 "," IPW_OK "," OPW_OK ",\"in_proj_weight\\u0000x\":{}}",
     0, CLMHA_INVALID_FILE, "\\u0000"},
    {"tensor not an object", HEADER, "{" NH2 "," IPW_OK ",\"out_proj.weight\":[4,4]}", 0,
     CLMHA_INVALID_FILE, "tensor \"out_proj.weight\" is not a JSON object"},
    {"no dtype", HEADER,
     "{" NH2 "," IPW("\"shape\":[12,4],\"data_offsets\":[0,192]") "," OPW_OK "}", 0,
     CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" has no dtype"},
    {"no shape", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"data_offsets\":[0,192]") "," OPW_OK "}", 0,
     CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" has no shape"},
    {"no data_offsets", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" has no data_offsets"},
    {"dtype not a string", HEADER,
     "{" NH2 "," IPW("\"dtype\":32,\"shape\":[12,4],\"data_offsets\":[0,192]") "," OPW_OK "}", 0,
     CLMHA_INVALID_FILE, "dtype of tensor \"in_proj_weight\" is not a string"},
    {"dtype I32", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"I32\",\"shape\":[12,4],\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" has dtype \"I32\""},
    {"dtype U8", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"U8\",\"shape\":[12,4],\"data_offsets\":[0,96]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "has dtype \"U8\""},
    {"dtype lower case", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"f32\",\"shape\":[12,4],\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "has dtype \"f32\""},
    {"shape not an array", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":48,\"data_offsets\":[0,192]") "," OPW_OK "}", 0,
     CLMHA_INVALID_FILE, "shape of tensor \"in_proj_weight\" is not a JSON array"},
    {"negative dimension", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[-12,4],\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "dimension 0 of the shape of tensor \"in_proj_weight\""},
    {"fractional dimension", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4.5],\"data_offsets\":[0,192]") "," OPW_OK
     "}",
     0, CLMHA_INVALID_FILE, "dimension 1 of the shape"},
    {"string dimension", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[\"12\",4],\"data_offsets\":[0,192]") "," OPW_OK
     "}",
     0, CLMHA_INVALID_FILE, "not a non-negative integer"},
    {"dimensions overflow", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],"
                     "\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_SIZE_OVERFLOW, "shape (4294967296, 4294967296, 16) of tensor \"in_proj_weight\""},
    {"bytes overflow", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F64\",\"shape\":[4294967296,536870912],"
                     "\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_SIZE_OVERFLOW, "more bytes than size_t"},
    {"dimension 1e300", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "is 1e300, not a non-negative integer"},
    {"data_offsets past the end", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[100,292]") "," OPW_OK
     "}",
     0, CLMHA_INVALID_FILE,
     "data_offsets of tensor \"in_proj_weight\" point past the end of the data section (256 "
     "bytes): end 292"},
    {"data_offsets huge", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],"
                     "\"data_offsets\":[18446744073709551615,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "point past the end"},
    {"data_offsets begin > end", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[192,0]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "[192, 0] of tensor \"in_proj_weight\" have begin > end"},
    {"data_offsets of 3", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[0,96,192]") "," OPW_OK
     "}",
     0, CLMHA_INVALID_FILE, "not an array [begin, end]"},
    {"data_offsets negative", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[-1,192]") "," OPW_OK
     "}",
     0, CLMHA_INVALID_FILE, "not non-negative integers"},
    {"shape disagrees with bytes", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,3],\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE,
     "tensor \"in_proj_weight\" has shape (12, 3) of F32 = 144 bytes, but its data_offsets "
     "[0, 192] span 192 bytes"},
    {"duplicate tensor", HEADER, "{" NH2 "," IPW_OK "," OPW_OK "," IPW_OK "}", 0,
     CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" twice"},
    {"metadata twice", HEADER, "{" NH2 "," NH2 "," IPW_OK "," OPW_OK "}", 0, CLMHA_INVALID_FILE,
     "__metadata__ twice"},
    {"metadata not an object", HEADER, BASE("\"__metadata__\":[\"num_heads\",\"2\"]"), 0,
     CLMHA_INVALID_FILE, "__metadata__ is not a JSON object"},
    {"metadata value not a string", HEADER, BASE(META("\"num_heads\":2")), 0, CLMHA_INVALID_FILE,
     "__metadata__ entry \"num_heads\" is not a string"},
    // the layer
    {"missing num_heads", HEADER, BASE(META("\"format\":\"pt\"")), 0, CLMHA_INVALID_FILE,
     "no num_heads"},
    {"no metadata", HEADER, "{" IPW_OK "," OPW_OK "}", 0, CLMHA_INVALID_FILE, "no num_heads"},
    {"num_heads eight", HEADER, BASE(META("\"num_heads\":\"eight\"")), 0, CLMHA_INVALID_FILE,
     "num_heads is \"eight\""},
    {"num_heads 8x", HEADER, BASE(META("\"num_heads\":\"8x\"")), 0, CLMHA_INVALID_FILE,
     "num_heads is \"8x\""},
    {"num_heads -8", HEADER, BASE(META("\"num_heads\":\"-8\"")), 0, CLMHA_INVALID_FILE,
     "num_heads is \"-8\""},
    {"num_heads empty", HEADER, BASE(META("\"num_heads\":\"\"")), 0, CLMHA_INVALID_FILE,
     "num_heads is \"\""},
    {"num_heads 0", HEADER, BASE(META("\"num_heads\":\"0\"")), 0, CLMHA_INVALID_FILE,
     "num_heads is \"0\""},
    {"num_heads space", HEADER, BASE(META("\"num_heads\":\" 2\"")), 0, CLMHA_INVALID_FILE,
     "num_heads is \" 2\""},
    {"num_heads huge", HEADER, BASE(META("\"num_heads\":\"99999999999999999999999\"")), 0,
     CLMHA_INVALID_FILE, "num_heads"},
    {"num_heads not dividing", HEADER, BASE(META("\"num_heads\":\"3\"")), 0, CLMHA_INVALID_FILE,
     "num_heads 3 does not divide embed_dim 4"},
    {"batch_first yes", HEADER, BASE(META("\"num_heads\":\"2\",\"batch_first\":\"yes\"")), 0,
     CLMHA_INVALID_FILE, "batch_first is \"yes\""},
    {"batch_first True", HEADER, BASE(META("\"num_heads\":\"2\",\"batch_first\":\"True\"")), 0,
     CLMHA_INVALID_FILE, "batch_first is \"True\""},
    {"add_zero_attn 1", HEADER, BASE(META("\"num_heads\":\"2\",\"add_zero_attn\":\"1\"")), 0,
     CLMHA_INVALID_FILE, "add_zero_attn is \"1\""},
    {"dropout 1.5", HEADER, BASE(META("\"num_heads\":\"2\",\"dropout\":\"1.5\"")), 0,
     CLMHA_INVALID_FILE, "dropout is \"1.5\""},
    {"dropout 1", HEADER, BASE(META("\"num_heads\":\"2\",\"dropout\":\"1.0\"")), 0,
     CLMHA_INVALID_FILE, "dropout is \"1.0\""},
    {"dropout 0.99999999999", HEADER,
     BASE(META("\"num_heads\":\"2\",\"dropout\":\"0.99999999999\"")), 0, CLMHA_INVALID_FILE,
     "dropout"},
    {"dropout -0.1", HEADER, BASE(META("\"num_heads\":\"2\",\"dropout\":\"-0.1\"")), 0,
     CLMHA_INVALID_FILE, "dropout is \"-0.1\""},
    {"dropout nan", HEADER, BASE(META("\"num_heads\":\"2\",\"dropout\":\"nan\"")), 0,
     CLMHA_INVALID_FILE, "dropout is \"nan\""},
    {"dropout 0.1x", HEADER, BASE(META("\"num_heads\":\"2\",\"dropout\":\"0.1x\"")), 0,
     CLMHA_INVALID_FILE, "dropout is \"0.1x\""},
    {"unknown tensor", HEADER,
     "{" NH2 "," IPW_OK "," OPW_OK
     ",\"encoder.weight\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[256,272]}}",
     272, CLMHA_INVALID_FILE, "unknown tensor \"encoder.weight\""},
    {"no out_proj.weight", HEADER, "{" NH2 "," IPW_OK "}", 192, CLMHA_INVALID_FILE,
     "no tensor \"out_proj.weight\""},
    {"out_proj.weight not square", HEADER,
     "{" NH2 "," IPW_OK
     ",\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,3],\"data_offsets\":[192,240]}}",
     240, CLMHA_INVALID_FILE,
     "tensor \"out_proj.weight\" has shape (4, 3), expected (E, E) = (4, 4)"},
    {"out_proj.weight 1-D", HEADER,
     "{" NH2 "," IPW_OK
     ",\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[16],\"data_offsets\":[192,256]}}",
     0, CLMHA_INVALID_FILE, "tensor \"out_proj.weight\" has shape (16,)"},
    {"out_proj.weight empty", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[0,0],\"data_offsets\":[0,0]")
     ",\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[0,0],\"data_offsets\":[0,0]}}",
     NO_DATA, CLMHA_INVALID_FILE, "E > 0"},
    {"in_proj_weight wrong shape", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[4,12],\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE,
     "tensor \"in_proj_weight\" has shape (4, 12), expected (3E, E) = (12, 4)"},
    {"no input projection", HEADER, "{" NH2 "," OPW_AT("[0,64]") "}", 64, CLMHA_INVALID_FILE,
     "neither in_proj_weight nor"},
    {"in_proj_weight and q_proj_weight", HEADER,
     "{" NH2 "," IPW_OK "," OPW_OK
     ",\"q_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[256,320]}}",
     320, CLMHA_INVALID_FILE, "both in_proj_weight and q_proj_weight"},
    {"k_proj_weight missing", HEADER,
     "{" NH2 "," OPW_AT("[128,192]")
     ",\"q_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]},"
     "\"v_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[64,128]}}",
     192, CLMHA_INVALID_FILE, "(no \"k_proj_weight\")"},
    {"v_proj_weight wrong rows", HEADER,
     "{" NH2 "," OPW_AT("[128,192]")
     ",\"q_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]},"
     "\"k_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,2],\"data_offsets\":[64,96]},"
     "\"v_proj_weight\":{\"dtype\":\"F32\",\"shape\":[2,4],\"data_offsets\":[96,128]}}",
     192, CLMHA_INVALID_FILE, "tensor \"v_proj_weight\" has shape (2, 4), expected (E, vdim)"},
    {"k_proj_weight kdim 0", HEADER,
     "{" NH2 "," OPW_AT("[128,192]")
     ",\"q_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]},"
     "\"k_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,0],\"data_offsets\":[64,64]},"
     "\"v_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[64,128]}}",
     192, CLMHA_INVALID_FILE, "kdim > 0"},
    {"in_proj_bias alone", HEADER, "{" NH2 "," IPW_OK "," OPW_OK "," IPB_OK "}", 304,
     CLMHA_INVALID_FILE, "has in_proj_bias but no out_proj.bias"},
    {"out_proj.bias alone", HEADER, "{" NH2 "," IPW_OK "," OPW_OK "," OPB_OK "}", 272,
     CLMHA_INVALID_FILE, "has out_proj.bias but no in_proj_bias"},
    {"in_proj_bias wrong shape", HEADER,
     "{" NH2 "," IPW_OK "," OPW_OK "," OPB_OK
     ",\"in_proj_bias\":{\"dtype\":\"F32\",\"shape\":[4,3],\"data_offsets\":[272,320]}}",
     320, CLMHA_INVALID_FILE, "tensor \"in_proj_bias\" has shape (4, 3), expected (3E) = (12,)"},
    {"bias_k alone", HEADER, "{" NH2 "," IPW_OK "," OPW_OK "," BK_OK "}", 272, CLMHA_INVALID_FILE,
     "has bias_k but no bias_v"},
    {"bias_v wrong shape", HEADER,
     "{" NH2 "," IPW_OK "," OPW_OK "," BK_OK
     ",\"bias_v\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[272,288]}}",
     288, CLMHA_INVALID_FILE, "tensor \"bias_v\" has shape (4,), expected (1, 1, E) = (1, 1, 4)"},
    // the data section: the tensors' byte ranges, sorted, must cover it exactly (the format's
    // rule, as the reference implementation checks it)
    {"overlapping data_offsets", HEADER,
     "{" NH2 "," IPW_OK
     ",\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[128,192]}}",
     192, CLMHA_INVALID_FILE,
     "tensor \"out_proj.weight\" (data_offsets [128, 192]) overlaps tensor \"in_proj_weight\" "
     "(data_offsets [0, 192])"},
    {"same data_offsets twice", HEADER,
     "{" NH2 "," IPW_OK
     ",\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]}}",
     192, CLMHA_INVALID_FILE, "overlaps tensor"},
    {"hole between tensors", HEADER,
     "{" NH2 "," IPW_OK
     ",\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[200,264]}}",
     264, CLMHA_INVALID_FILE,
     "bytes [192, 200) of the data section belong to no tensor (a hole between tensor "
     "\"in_proj_weight\" (data_offsets [0, 192]) and tensor \"out_proj.weight\" (data_offsets "
     "[200, 264]))"},
    {"hole at the start", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[8,200]")
     ",\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[200,264]}}",
     264, CLMHA_INVALID_FILE,
     "bytes [0, 8) of the data section belong to no tensor (before tensor \"in_proj_weight\" "
     "(data_offsets [8, 200]))"},
    {"trailing bytes", HEADER, BASE(NH2), 264, CLMHA_INVALID_FILE,
     "bytes [256, 264) of the data section belong to no tensor (after tensor "
     "\"out_proj.weight\" (data_offsets [192, 256]), the last)"},
    {"data but no tensor", HEADER, "{" NH2 "}", 16, CLMHA_INVALID_FILE,
     "bytes [0, 16) of the data section belong to no tensor (the header has no tensor)"},
    {"zero-size tensor inside another", HEADER,
     "{" NH2 "," IPW_OK "," OPW_OK
     ",\"bias_k\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[100,100]}}",
     0, CLMHA_INVALID_FILE,
     "tensor \"bias_k\" (data_offsets [100, 100]) overlaps tensor \"in_proj_weight\""},
    // duplicate keys (cJSON keeps them all; the first would win silently)
    {"dtype twice", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"dtype\":\"F16\","
                     "\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" has the key \"dtype\" twice"},
    {"shape twice", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"shape\":[4,12],"
                     "\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" has the key \"shape\" twice"},
    {"data_offsets twice", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[0,192],"
                     "\"data_offsets\":[64,256]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" has the key \"data_offsets\" twice"},
    {"dtype twice, once escaped", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"dt\\u0079pe\":\"F16\","
                     "\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" has the key \"dtype\" twice"},
    {"tensor twice, once escaped", HEADER,
     "{" NH2 "," IPW_OK "," OPW_OK
     ",\"in_proj\\u005fweight\":{\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[0,192]}}",
     0, CLMHA_INVALID_FILE, "tensor \"in_proj_weight\" twice"},
    {"metadata key twice", HEADER, BASE(META("\"num_heads\":\"2\",\"num_heads\":\"4\"")), 0,
     CLMHA_INVALID_FILE, "__metadata__ has the key \"num_heads\" twice"},
    {"metadata key twice, once escaped", HEADER,
     BASE(META("\"num_heads\":\"2\",\"num\\u005fheads\":\"4\"")), 0, CLMHA_INVALID_FILE,
     "__metadata__ has the key \"num_heads\" twice"},
    // sizes read exactly from the JSON text, not through a double
    {"dimension 2^53 + 1", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[9007199254740993],"
                     "\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE,
     "tensor \"in_proj_weight\" has shape (9007199254740993,) of F32 = 36028797018963972 bytes"},
    {"dimension 2^64", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[18446744073709551616],"
                     "\"data_offsets\":[0,192]") "," OPW_OK "}",
     0, CLMHA_SIZE_OVERFLOW,
     "dimension 0 of the shape of tensor \"in_proj_weight\" is too large (18446744073709551616)"},
    {"dimension 12.0", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12.0,4],\"data_offsets\":[0,192]") ","
     OPW_OK "}",
     0, CLMHA_INVALID_FILE,
     "dimension 0 of the shape of tensor \"in_proj_weight\" is 12.0, not a non-negative integer"},
    {"dimension 1.2e1", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[1.2e1,4],\"data_offsets\":[0,192]") ","
     OPW_OK "}",
     0, CLMHA_INVALID_FILE, "is 1.2e1, not a non-negative integer"},
    {"dimension 012", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[012,4],\"data_offsets\":[0,192]") ","
     OPW_OK "}",
     0, CLMHA_INVALID_FILE, "is 012, not a non-negative integer"},
    {"data_offsets end 2^53 + 1", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],"
                     "\"data_offsets\":[0,9007199254740993]") "," OPW_OK "}",
     0, CLMHA_INVALID_FILE, "point past the end of the data section (256 bytes): end "
                            "9007199254740993"},
    {"data_offsets 192.0", HEADER,
     "{" NH2 "," IPW("\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[0,192.0]") ","
     OPW_OK "}",
     0, CLMHA_INVALID_FILE, "are not non-negative integers"},
    // dropout: checked on its exact decimal value, then on the float the layer keeps
    {"dropout 0.99999999999 rounds to 1", HEADER,
     BASE(META("\"num_heads\":\"2\",\"dropout\":\"0.99999999999\"")), 0, CLMHA_INVALID_FILE,
     "dropout is \"0.99999999999\", which is below 1 but rounds to 1 as a float"},
    {"dropout twenty nines rounds to 1", HEADER,
     BASE(META("\"num_heads\":\"2\",\"dropout\":\"0.99999999999999999999\"")), 0,
     CLMHA_INVALID_FILE, "which is below 1 but rounds to 1 as a float"},
    {"dropout 9.9999999999e-1 rounds to 1", HEADER,
     BASE(META("\"num_heads\":\"2\",\"dropout\":\"9.9999999999e-1\"")), 0,
     CLMHA_INVALID_FILE, "which is below 1 but rounds to 1 as a float"},
    {"dropout 1.0000000000000000001", HEADER,
     BASE(META("\"num_heads\":\"2\",\"dropout\":\"1.0000000000000000001\"")), 0,
     CLMHA_INVALID_FILE,
     "dropout is \"1.0000000000000000001\", expected a decimal number in [0, 1)"},
    {"dropout 0.1e1", HEADER, BASE(META("\"num_heads\":\"2\",\"dropout\":\"0.1e1\"")), 0,
     CLMHA_INVALID_FILE, "dropout is \"0.1e1\", expected a decimal number in [0, 1)"},
    // window: "LEFT,RIGHT", each -1 or an integer from 0 to 2^63-1
#define WINDOW(text) BASE(META("\"num_heads\":\"2\",\"window\":\"" text "\""))
#define WINDOW_BAD(text) "__metadata__ window is \"" text "\", expected \"LEFT,RIGHT\""
    {"window abc", HEADER, WINDOW("abc"), 0, CLMHA_INVALID_FILE, WINDOW_BAD("abc")},
    {"window -2,0", HEADER, WINDOW("-2,0"), 0, CLMHA_INVALID_FILE, WINDOW_BAD("-2,0")},
    {"window 0,-2", HEADER, WINDOW("0,-2"), 0, CLMHA_INVALID_FILE, WINDOW_BAD("0,-2")},
    {"window one number", HEADER, WINDOW("5"), 0, CLMHA_INVALID_FILE, WINDOW_BAD("5")},
    {"window three numbers", HEADER, WINDOW("1,2,3"), 0, CLMHA_INVALID_FILE,
     WINDOW_BAD("1,2,3")},
    {"window empty", HEADER, WINDOW(""), 0, CLMHA_INVALID_FILE, WINDOW_BAD("")},
    {"window no left", HEADER, WINDOW(",3"), 0, CLMHA_INVALID_FILE, WINDOW_BAD(",3")},
    {"window no right", HEADER, WINDOW("3,"), 0, CLMHA_INVALID_FILE, WINDOW_BAD("3,")},
    {"window spaces", HEADER, WINDOW("1, 0"), 0, CLMHA_INVALID_FILE, WINDOW_BAD("1, 0")},
    {"window +1", HEADER, WINDOW("+1,0"), 0, CLMHA_INVALID_FILE, WINDOW_BAD("+1,0")},
    {"window -0", HEADER, WINDOW("-0,0"), 0, CLMHA_INVALID_FILE, WINDOW_BAD("-0,0")},
    {"window 1.5", HEADER, WINDOW("1.5,0"), 0, CLMHA_INVALID_FILE, WINDOW_BAD("1.5,0")},
    {"window 2^63", HEADER, WINDOW("9223372036854775808,0"), 0, CLMHA_INVALID_FILE,
     WINDOW_BAD("9223372036854775808,0")},
    {"window 2^64", HEADER, WINDOW("0,18446744073709551616"), 0, CLMHA_INVALID_FILE,
     WINDOW_BAD("0,18446744073709551616")},
#undef WINDOW
#undef WINDOW_BAD
    // softcap: a decimal number, 0 (off) or positive and finite
#define SOFTCAP(text) BASE(META("\"num_heads\":\"2\",\"softcap\":\"" text "\""))
#define SOFTCAP_BAD(text) "__metadata__ softcap is \"" text "\", expected a decimal number"
    {"softcap -1", HEADER, SOFTCAP("-1"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("-1")},
    {"softcap nan", HEADER, SOFTCAP("nan"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("nan")},
    {"softcap inf", HEADER, SOFTCAP("inf"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("inf")},
    {"softcap 1e400", HEADER, SOFTCAP("1e400"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("1e400")},
    {"softcap 1e-400", HEADER, SOFTCAP("1e-400"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("1e-400")},
    {"softcap empty", HEADER, SOFTCAP(""), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("")},
    {"softcap abc", HEADER, SOFTCAP("abc"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("abc")},
    {"softcap 1,5", HEADER, SOFTCAP("1,5"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("1,5")},
    {"softcap space", HEADER, SOFTCAP(" 2"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD(" 2")},
    {"softcap +2", HEADER, SOFTCAP("+2"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("+2")},
    {"softcap 2e", HEADER, SOFTCAP("2e"), 0, CLMHA_INVALID_FILE, SOFTCAP_BAD("2e")},
#undef SOFTCAP
#undef SOFTCAP_BAD
    // alibi: "true" or "false"; alibi_slopes only with alibi, (num_heads)
#define ALIBI(text) BASE(META("\"num_heads\":\"2\",\"alibi\":\"" text "\""))
    {"alibi yes", HEADER, ALIBI("yes"), 0, CLMHA_INVALID_FILE,
     "__metadata__ alibi is \"yes\", expected \"true\" or \"false\""},
    {"alibi 1", HEADER, ALIBI("1"), 0, CLMHA_INVALID_FILE, "__metadata__ alibi is \"1\""},
    {"alibi True", HEADER, ALIBI("True"), 0, CLMHA_INVALID_FILE, "__metadata__ alibi is \"True\""},
    {"alibi empty", HEADER, ALIBI(""), 0, CLMHA_INVALID_FILE, "__metadata__ alibi is \"\""},
    {"alibi on", HEADER, ALIBI("on"), 0, CLMHA_INVALID_FILE, "__metadata__ alibi is \"on\""},
#undef ALIBI
#define SLOPES(shape, end) \
    ",\"alibi_slopes\":{\"dtype\":\"F32\",\"shape\":" shape ",\"data_offsets\":[256," end "]}}"
    {"alibi_slopes without alibi", HEADER, "{" NH2 "," IPW_OK "," OPW_OK SLOPES("[2]", "264"),
     264, CLMHA_INVALID_FILE,
     "the file has tensor \"alibi_slopes\" but __metadata__ alibi is not \"true\""},
    {"alibi_slopes with alibi false", HEADER,
     "{" META("\"num_heads\":\"2\",\"alibi\":\"false\"") "," IPW_OK "," OPW_OK
         SLOPES("[2]", "264"),
     264, CLMHA_INVALID_FILE, "but __metadata__ alibi is not \"true\""},
    {"alibi_slopes (3) for 2 heads", HEADER,
     "{" META("\"num_heads\":\"2\",\"alibi\":\"true\"") "," IPW_OK "," OPW_OK
         SLOPES("[3]", "268"),
     268, CLMHA_INVALID_FILE,
     "tensor \"alibi_slopes\" has shape (3,), expected (num_heads) = (2,)"},
    {"alibi_slopes (1, 2)", HEADER,
     "{" META("\"num_heads\":\"2\",\"alibi\":\"true\"") "," IPW_OK "," OPW_OK
         SLOPES("[1,2]", "264"),
     264, CLMHA_INVALID_FILE,
     "tensor \"alibi_slopes\" has shape (1, 2), expected (num_heads) = (2,)"},
    {"alibi_slopes scalar", HEADER,
     "{" META("\"num_heads\":\"2\",\"alibi\":\"true\"") "," IPW_OK "," OPW_OK
         SLOPES("[]", "260"),
     260, CLMHA_INVALID_FILE, "tensor \"alibi_slopes\" has shape"},
#undef SLOPES
    // sinks: (num_heads)
#define SINKS(shape, end) \
    ",\"sinks\":{\"dtype\":\"F32\",\"shape\":" shape ",\"data_offsets\":[256," end "]}}"
    {"sinks (3) for 2 heads", HEADER, "{" NH2 "," IPW_OK "," OPW_OK SINKS("[3]", "268"), 268,
     CLMHA_INVALID_FILE, "tensor \"sinks\" has shape (3,), expected (num_heads) = (2,)"},
    {"sinks (1) for 2 heads", HEADER, "{" NH2 "," IPW_OK "," OPW_OK SINKS("[1]", "260"), 260,
     CLMHA_INVALID_FILE, "tensor \"sinks\" has shape (1,), expected (num_heads) = (2,)"},
    {"sinks (1, 2)", HEADER, "{" NH2 "," IPW_OK "," OPW_OK SINKS("[1,2]", "264"), 264,
     CLMHA_INVALID_FILE, "tensor \"sinks\" has shape (1, 2), expected (num_heads) = (2,)"},
    {"sinks scalar", HEADER, "{" NH2 "," IPW_OK "," OPW_OK SINKS("[]", "260"), 260,
     CLMHA_INVALID_FILE, "tensor \"sinks\" has shape"},
    {"sinks (2, 1)", HEADER, "{" NH2 "," IPW_OK "," OPW_OK SINKS("[2,1]", "264"), 264,
     CLMHA_INVALID_FILE, "tensor \"sinks\" has shape (2, 1)"},
#undef SINKS
    // the file system
    {"nonexistent path", NO_FILE, NULL, 0, CLMHA_IO_ERROR, "cannot open"},
    {"a folder", DIRECTORY, NULL, 0, CLMHA_IO_ERROR, "directory"},
};

Test(safetensors, malformed) {
    env e;
    env_open(&e);
    char path[256];
    for (size_t i = 0; i < sizeof bad_cases / sizeof *bad_cases; ++i) {
        const bad_case *c = &bad_cases[i];
        snprintf(path, sizeof path, "%s/bad%zu.safetensors", e.dir, i);
        unsigned char raw[4096] = {0};
        switch (c->kind) {
        case HEADER:
            write_st(path, c->header, (8 - strlen(c->header) % 8) % 8, NULL,
                     c->data_size == NO_DATA ? 0 : c->data_size ? c->data_size : 256);
            break;
        case EMPTY:
            write_bytes(path, raw, 0);
            break;
        case SHORT:
            write_bytes(path, "\x10\0\0\0\0", 5);
            break;
        case LONG_LENGTH:
            put_le64(raw, 4096);
            memcpy(raw + 8, "{}", 2);
            write_bytes(path, raw, 100);
            break;
        case NO_FILE:
            break;
        case DIRECTORY:
            cr_assert_eq(mkdir(path, 0700), 0);
            break;
        }
        clmha_layer *l = BAD_LAYER;
        clmha_status st = clmha_layer_load(&l, e.ctx, path);
        const char *msg = clmha_context_last_error(e.ctx);
        if (getenv("CLMHA_TEST_VERBOSE"))
            fprintf(stderr, "%-34s %s\n  %s\n", c->name, clmha_status_string(st), msg);
        cr_expect_eq(st, c->status, "%s: status %d (%s), expected %d", c->name, (int)st, msg,
                     (int)c->status);
        cr_expect_null(l, "%s: *out not NULL after a failure", c->name);
        cr_expect(strstr(msg, c->substring) != NULL, "%s: message \"%s\" lacks \"%s\"", c->name,
                  msg, c->substring);
        cr_expect(strstr(msg, path) != NULL, "%s: message \"%s\" does not name the file",
                  c->name, msg);
        if (st == CLMHA_SUCCESS) clmha_layer_release(l);
        remove(path);
        rmdir(path);
    }
    env_close(&e);
}

// A header length above the 100 MiB limit, in a (sparse) file long enough to hold it.
Test(safetensors, header_too_large) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "huge.safetensors", path, sizeof path);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    unsigned char len[8];
    put_le64(len, ((uint64_t)100 << 20) + 8);
    cr_assert_eq(fwrite(len, 1, 8, f), 8);
    cr_assert_eq(fseek(f, (100L << 20) + 64, SEEK_SET), 0);
    cr_assert_eq(fwrite("x", 1, 1, f), 1);
    fclose(f);
    clmha_layer *l = BAD_LAYER;
    cr_expect_eq(clmha_layer_load(&l, e.ctx, path), CLMHA_INVALID_FILE);
    cr_expect_null(l);
    cr_expect(strstr(clmha_context_last_error(e.ctx), "exceeds the limit"), "%s",
              clmha_context_last_error(e.ctx));
    env_close(&e);
}

// Writes a file whose header holds @p entries tensor entries of 4 bytes each (names t0, t1, ...,
// laid end to end, so that the file is well formed as far as the format goes) and the base
// layer's metadata; returns the header's length.
static size_t write_many_tensors(const char *path, size_t entries) {
    size_t cap = 64 + entries * 80, used = 0;
    char *h = malloc(cap);
    cr_assert_not_null(h);
    used += (size_t)snprintf(h, cap, "{\"__metadata__\":{\"num_heads\":\"2\"}");
    for (size_t i = 0; i < entries; ++i)
        used += (size_t)snprintf(h + used, cap - used,
                                 ",\"t%zu\":{\"dtype\":\"F32\",\"shape\":[1],"
                                 "\"data_offsets\":[%zu,%zu]}",
                                 i, 4 * i, 4 * i + 4);
    used += (size_t)snprintf(h + used, cap - used, "}");
    cr_assert_lt(used, cap);
    write_st(path, h, (8 - used % 8) % 8, NULL, 4 * entries);
    free(h);
    return used + (8 - used % 8) % 8;
}

// A layer's header is small (at most 12 tensors and a few metadata strings): a huge header is
// refused from its length alone, before it is read or parsed, so quickly and whatever its
// size; a header under the limit with more tensor entries than a layer has is refused before
// the entries are looked at one by one.
Test(safetensors, huge_headers_refused_quickly) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "many.safetensors", path, sizeof path);
    struct {
        size_t entries;
        const char *substring;
    } cases[] = {
        {700000, "exceeds the limit of 262144 bytes"},  // 41 MB of header
        {5000, "exceeds the limit of 262144 bytes"},    // just over the limit
        {13, "the header has 13 tensor entries; a layer file has at most 12"},
        {1000, "the header has 1000 tensor entries; a layer file has at most 12"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
        size_t header = write_many_tensors(path, cases[i].entries);
        clmha_layer *l = BAD_LAYER;
        double t0 = now_seconds();
        clmha_status st = clmha_layer_load(&l, e.ctx, path);
        double dt = now_seconds() - t0;
        const char *msg = clmha_context_last_error(e.ctx);
        cr_log_info("%zu entries, %zu-byte header: %.3f s, %s", cases[i].entries, header, dt,
                    msg);
        cr_expect_eq(st, CLMHA_INVALID_FILE, "%zu entries: %d (%s)", cases[i].entries, (int)st,
                     msg);
        cr_expect_null(l);
        cr_expect(strstr(msg, cases[i].substring) != NULL, "%zu entries: \"%s\" lacks \"%s\"",
                  cases[i].entries, msg, cases[i].substring);
        cr_expect(strstr(msg, path) != NULL, "%s", msg);
        cr_expect_lt(dt, 0.5, "%zu entries: refused after %.3f s", cases[i].entries, dt);
        if (st == CLMHA_SUCCESS) clmha_layer_release(l);
    }
    env_close(&e);
}

// The limit leaves room for free-form metadata: 200 KiB of it still loads.
Test(safetensors, large_metadata_under_the_limit_loads) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "meta.safetensors", path, sizeof path);
    size_t big = 200 << 10;
    char *h = malloc(big + 1024);
    cr_assert_not_null(h);
    int n = snprintf(h, 1024, "{\"__metadata__\":{\"num_heads\":\"2\",\"note\":\"");
    memset(h + n, 'x', big);
    snprintf(h + n + big, 1024 - (size_t)n, "\"}," IPW_OK "," OPW_OK "}");
    write_st(path, h, (8 - strlen(h) % 8) % 8, NULL, 256);
    free(h);
    clmha_layer *l = NULL;
    cr_expect_eq(clmha_layer_load(&l, e.ctx, path), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(e.ctx));
    clmha_layer_release(l);
    env_close(&e);
}

// A dropout just below 1 that a float still holds loads with that float.
Test(safetensors, dropout_just_below_one) {
    env e;
    env_open(&e);
    char path[256];
    path_in(&e, "dropout.safetensors", path, sizeof path);
    write_st(path, BASE(META("\"num_heads\":\"2\",\"dropout\":\"0.99999994\"")), 0, NULL, 256);
    clmha_layer *l = NULL;
    cr_assert_eq(clmha_layer_load(&l, e.ctx, path), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(e.ctx));
    clmha_layer_desc d = {.struct_size = sizeof d};
    cr_assert_eq(clmha_layer_get_desc(l, &d), CLMHA_SUCCESS);
    cr_expect_eq(float_bits(d.dropout), float_bits(0.99999994f), "%.9g", (double)d.dropout);
    clmha_layer_release(l);
    env_close(&e);
}

Test(safetensors, load_arguments) {
    env e;
    env_open(&e);
    clmha_layer *l = BAD_LAYER;
    cr_expect_eq(clmha_layer_load(NULL, e.ctx, "/tmp/x"), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_layer_load(&l, NULL, "/tmp/x"), CLMHA_INVALID_ARGUMENT);
    cr_expect_null(l);
    cr_expect(strstr(clmha_last_create_error(), "ctx") != NULL);
    l = BAD_LAYER;
    cr_expect_eq(clmha_layer_load(&l, e.ctx, NULL), CLMHA_INVALID_ARGUMENT);
    cr_expect_null(l);
    cr_expect(strstr(clmha_context_last_error(e.ctx), "path") != NULL);
    env_close(&e);
}
