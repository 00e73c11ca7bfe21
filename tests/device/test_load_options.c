#define _POSIX_C_SOURCE 200809L
// clmha_layer_load_prefixed() and clmha_load_options: the seed modules' name sets (continuiti's
// MultiHeadAttention, the classic w_q/w_k/w_v/w_concat module) and one attention module picked
// out of a model's checkpoint by a prefix, checked against PyTorch's outputs
// (tests/cli/seed_*, tests/cli/model_prefix*: tools/make_cli_cases.py runs the modules
// themselves in float64); batch_first's defaults and overrides; and the refusals: no num_heads,
// num_heads that disagrees with the metadata, a prefix that matches nothing, mixed name sets,
// a seed module's biases in part, torch.save files (zip and pickle, tests/cli/torch_save), the
// limits of a file read with a prefix, bad options.
//
// Loading needs an OpenCL device (the layer lives on one): without one every test is skipped.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/npy.h"
#include "support.h"

#define BAD_LAYER ((clmha_layer *)(uintptr_t)1)
#define TOL 1e-4  // max abs error against PyTorch on unit-scale data, as the other tests

typedef test_env env;  // tests/support/support.h

static void env_open(env *e) { test_env_open(e, "clmha-lo"); }

static void env_close(env *e) { test_env_close(e); }

static void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; ++i) p[i] = (unsigned char)(v >> (8 * i));
}

// A safetensors file: the header @p header padded with spaces to a multiple of 8, then
// @p data_size bytes of small values (0.25 as F32 words).
static void write_st(const char *path, const char *header, size_t data_size) {
    size_t hl = strlen(header), hn = hl + (8 - hl % 8) % 8;
    unsigned char *buf = malloc(8 + hn + data_size + 1);
    cr_assert_not_null(buf);
    put_le64(buf, hn);
    memcpy(buf + 8, header, hl);
    memset(buf + 8 + hl, ' ', hn - hl);
    float q = 0.25f;
    for (size_t i = 0; i + 4 <= data_size; i += 4) memcpy(buf + 8 + hn + i, &q, 4);
    write_bytes(path, buf, 8 + hn + data_size);
    free(buf);
}

static clmha_status load(env *e, const char *path, const clmha_load_options *o,
                         clmha_layer **out) {
    *out = BAD_LAYER;
    clmha_status st = clmha_layer_load_prefixed(out, e->ctx, path, o);
    if (st) cr_expect_null(*out, "%s: *out not NULL after a failure", path);
    return st;
}

// Expects @p st to be CLMHA_INVALID_FILE (or @p want) with a message holding each of the
// NULL-terminated @p parts.
static void expect_refused(env *e, clmha_status st, clmha_status want, const char *what, ...) {
    const char *msg = clmha_context_last_error(e->ctx);
    cr_expect_eq(st, want, "%s: status %d, want %d (%s)", what, (int)st, (int)want, msg);
    va_list ap;
    va_start(ap, what);
    for (const char *p; (p = va_arg(ap, const char *)) != NULL;)
        cr_expect(strstr(msg, p) != NULL, "%s: message \"%s\" lacks \"%s\"", what, msg, p);
    va_end(ap);
    if (getenv("CLMHA_TEST_VERBOSE")) fprintf(stderr, "%s: %s\n", what, msg);
}

static void case_path(const char *c, const char *file, char *out, size_t size) {
    snprintf(out, size, "%s/cli/%s/%s", CLMHA_TEST_DATA_DIR, c, file);
}

static bool read_npy_if(const char *c, const char *file, clmha__npy *a) {
    char path[512], msg[512];
    case_path(c, file, path, sizeof path);
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    fclose(f);
    cr_assert_eq(clmha__npy_read(path, a, msg, sizeof msg), CLMHA_SUCCESS, "%s: %s", path, msg);
    return true;
}

static clmha_tensor tensor_of(const clmha__npy *a) {
    clmha_tensor t = {.ndim = a->ndim, .data = a->f32};
    for (size_t i = 0; i < a->ndim && i < 4; ++i) t.shape[i] = a->shape[i];
    return t;
}

// ---- against PyTorch ----------------------------------------------------------------------

static const struct {
    const char *name, *prefix;
    size_t e, h;
    bool bias, batch_first;
} cases[] = {
    {"seed_continuiti", NULL, 8, 2, true, true},
    {"seed_continuiti_no_bias", NULL, 8, 2, false, true},
    {"seed_classic", NULL, 12, 3, true, true},
    {"model_prefix", "encoder.layers.1.self_attn", 8, 2, true, false},
    {"model_prefix_continuiti", "head.attention.", 8, 2, true, true},
};

// Each case's layer through the C API on its inputs: PyTorch's output within TOL.
Test(load_options, seed_modules_and_model_prefix_match_pytorch) {
    env e;
    env_open(&e);
    for (size_t c = 0; c < sizeof cases / sizeof *cases; ++c) {
        const char *name = cases[c].name;
        char path[512];
        case_path(name, "layer.safetensors", path, sizeof path);
        clmha_load_options o = {.struct_size = sizeof o, .prefix = cases[c].prefix,
                                .num_heads = cases[c].h};
        clmha_layer *l;
        cr_assert_eq(load(&e, path, &o, &l), CLMHA_SUCCESS, "%s: %s", name,
                     clmha_context_last_error(e.ctx));
        clmha_layer_desc d = {.struct_size = sizeof d};
        cr_assert_eq(clmha_layer_get_desc(l, &d), CLMHA_SUCCESS);
        cr_expect_eq(d.embed_dim, cases[c].e, "%s", name);
        cr_expect_eq(d.num_heads, cases[c].h, "%s", name);
        cr_expect_eq(d.bias, cases[c].bias, "%s", name);
        cr_expect_eq(d.batch_first, cases[c].batch_first, "%s", name);
        cr_expect(!d.add_bias_kv && !d.add_zero_attn && d.dropout == 0.0f, "%s", name);

        clmha__npy q = {0}, k = {0}, v = {0}, want = {0};
        cr_assert(read_npy_if(name, "query.npy", &q));
        bool has_k = read_npy_if(name, "key.npy", &k), has_v = read_npy_if(name, "value.npy", &v);
        cr_assert(read_npy_if(name, "expected_output.npy", &want));
        clmha_forward_args a = {.struct_size = sizeof a, .query = tensor_of(&q)};
        if (has_k) a.key = tensor_of(&k);
        if (has_v) a.value = tensor_of(&v);
        float *y = malloc(want.count * sizeof *y);
        cr_assert_not_null(y);
        cr_assert_eq(clmha_layer_forward_host(l, &a, y, want.count, NULL, 0), CLMHA_SUCCESS,
                     "%s: %s", name, clmha_context_last_error(e.ctx));
        double err = 0;
        for (size_t i = 0; i < want.count; ++i) err = fmax(err, fabs(y[i] - want.f32[i]));
        fprintf(stderr, "load_options %s: max abs error vs PyTorch %.3e\n", name, err);
        cr_expect_leq(err, TOL, "%s: max abs error %.3e", name, err);
        free(y);
        clmha__npy_free(&q);
        clmha__npy_free(&k);
        clmha__npy_free(&v);
        clmha__npy_free(&want);
        clmha_layer_release(l);
    }
    env_close(&e);
}

// batch_first: the seed names default to true, PyTorch's names to false (without metadata);
// CLMHA_BATCH_FIRST_NO / _YES override both; metadata wins over the default.
Test(load_options, batch_first_defaults_and_overrides) {
    env e;
    env_open(&e);
    char seed[512], model[512], meta[512];
    case_path("seed_classic", "layer.safetensors", seed, sizeof seed);
    case_path("model_prefix", "layer.safetensors", model, sizeof model);
    case_path("batch_first", "layer.safetensors", meta, sizeof meta);  // metadata: true
    struct {
        const char *path, *prefix;
        size_t h;
        clmha_batch_first opt;
        bool want;
    } rows[] = {
        {seed, NULL, 3, CLMHA_BATCH_FIRST_AUTO, true},
        {seed, NULL, 3, CLMHA_BATCH_FIRST_NO, false},
        {seed, NULL, 3, CLMHA_BATCH_FIRST_YES, true},
        {model, "encoder.layers.0.self_attn", 2, CLMHA_BATCH_FIRST_AUTO, false},
        {model, "encoder.layers.0.self_attn", 2, CLMHA_BATCH_FIRST_YES, true},
        {meta, NULL, 0, CLMHA_BATCH_FIRST_AUTO, true},
        {meta, NULL, 2, CLMHA_BATCH_FIRST_NO, false},  // num_heads agrees with the metadata
    };
    for (size_t i = 0; i < sizeof rows / sizeof *rows; ++i) {
        clmha_load_options o = {.struct_size = sizeof o, .prefix = rows[i].prefix,
                                .num_heads = rows[i].h, .batch_first = rows[i].opt};
        clmha_layer *l;
        cr_assert_eq(load(&e, rows[i].path, &o, &l), CLMHA_SUCCESS, "row %zu: %s", i,
                     clmha_context_last_error(e.ctx));
        clmha_layer_desc d = {.struct_size = sizeof d};
        clmha_layer_get_desc(l, &d);
        cr_expect_eq(d.batch_first, rows[i].want, "row %zu", i);
        clmha_layer_release(l);
    }
    // NULL options and a zeroed struct are clmha_layer_load(): the metadata's num_heads.
    clmha_layer *l;
    cr_expect_eq(load(&e, meta, NULL, &l), CLMHA_SUCCESS, "%s", clmha_context_last_error(e.ctx));
    clmha_layer_release(l);
    clmha_load_options zero = CLMHA_STRUCT_INIT(clmha_load_options);
    cr_expect_eq(load(&e, meta, &zero, &l), CLMHA_SUCCESS, "%s", clmha_context_last_error(e.ctx));
    clmha_layer_release(l);
    // The dtype option.
    clmha_load_options f16 = {.struct_size = sizeof f16, .num_heads = 3,
                              .dtype = CLMHA_DTYPE_F16};
    cr_expect_eq(load(&e, seed, &f16, &l), CLMHA_SUCCESS, "%s", clmha_context_last_error(e.ctx));
    clmha_layer_desc d = {.struct_size = sizeof d};
    clmha_layer_get_desc(l, &d);
    cr_expect_eq(d.dtype, CLMHA_DTYPE_F16);
    clmha_layer_release(l);
    env_close(&e);
}

// ---- refusals -----------------------------------------------------------------------------

Test(load_options, num_heads_missing_or_disagreeing) {
    env e;
    env_open(&e);
    char seed[512], meta[512];
    case_path("seed_continuiti", "layer.safetensors", seed, sizeof seed);
    case_path("self_attention", "layer.safetensors", meta, sizeof meta);  // num_heads "2"
    clmha_layer *l;
    expect_refused(&e, load(&e, seed, NULL, &l), CLMHA_INVALID_FILE, "no num_heads", seed,
                   "has no num_heads", "pass num_heads", "--num-heads", NULL);
    clmha_load_options o = {.struct_size = sizeof o, .num_heads = 4};
    expect_refused(&e, load(&e, meta, &o, &l), CLMHA_INVALID_FILE, "disagreeing", meta,
                   "num_heads 4 was asked for", "says num_heads 2", NULL);
    o.num_heads = 3;  // does not divide E 8
    expect_refused(&e, load(&e, seed, &o, &l), CLMHA_INVALID_FILE, "not a divisor",
                   "num_heads 3 does not divide embed_dim 8", NULL);
    env_close(&e);
}

Test(load_options, prefix_that_matches_nothing_lists_the_prefixes) {
    env e;
    env_open(&e);
    char model[512];
    case_path("model_prefix", "layer.safetensors", model, sizeof model);
    clmha_load_options o = {.struct_size = sizeof o, .prefix = "encoder.layers.7.self_attn",
                            .num_heads = 2};
    clmha_layer *l;
    expect_refused(&e, load(&e, model, &o, &l), CLMHA_INVALID_FILE, "wrong prefix", model,
                   "no tensor's name starts with the prefix \"encoder.layers.7.self_attn.\"",
                   "\"encoder.layers.0.self_attn.\"", "\"encoder.layers.1.self_attn.\"",
                   "\"head.attention.\"", NULL);
    // A prefix over more than one module: a tensor under it that is no attention parameter.
    o.prefix = "encoder.layers.0";
    expect_refused(&e, load(&e, model, &o, &l), CLMHA_INVALID_FILE, "too short a prefix",
                   "encoder.layers.0.linear1.bias", "\"encoder.layers.0.self_attn.\"", NULL);
    // Without a prefix a model's file (24 tensors) is refused, pointing at a prefix.
    o.prefix = NULL;
    expect_refused(&e, load(&e, model, &o, &l), CLMHA_INVALID_FILE, "no prefix",
                   "24 tensor entries", "needs a prefix", NULL);
    env_close(&e);
}

#define W4(n, b) "\"" n "\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[" b "]}"
#define B4(n, b) "\"" n "\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[" b "]}"

Test(load_options, mixed_name_sets_and_partial_biases) {
    env e;
    env_open(&e);
    char path[256];
    snprintf(path, sizeof path, "%s/mixed.safetensors", e.dir);
    write_st(path,
             "{\"in_proj_weight\":{\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[0,192]},"
             W4("out_proj.weight", "192,256") "," W4("query_project.weight", "256,320") "}",
             320);
    clmha_load_options o = {.struct_size = sizeof o, .num_heads = 2};
    clmha_layer *l;
    expect_refused(&e, load(&e, path, &o, &l), CLMHA_INVALID_FILE, "mixed", "mixes",
                   "\"in_proj_weight\" (nn.MultiheadAttention)",
                   "\"query_project.weight\" (continuiti)", NULL);
    write_st(path,
             "{" W4("w_q.weight", "0,64") "," W4("query_project.weight", "64,128") "}", 128);
    expect_refused(&e, load(&e, path, &o, &l), CLMHA_INVALID_FILE, "two seed sets", "mixes",
                   "w_q/w_k/w_v/w_concat", "continuiti", NULL);
    write_st(path,
             "{" W4("w_q.weight", "0,64") "," W4("w_k.weight", "64,128") ","
             W4("w_v.weight", "128,192") "," W4("w_concat.weight", "192,256") ","
             B4("w_q.bias", "256,272") "," B4("w_v.bias", "272,288") ","
             B4("w_concat.bias", "288,304") "}",
             304);
    expect_refused(&e, load(&e, path, &o, &l), CLMHA_INVALID_FILE, "partial biases",
                   "no w_k.bias", "all four projections", NULL);
    // The same without biases loads (bias = false).
    write_st(path,
             "{" W4("w_q.weight", "0,64") "," W4("w_k.weight", "64,128") ","
             W4("w_v.weight", "128,192") "," W4("w_concat.weight", "192,256") "}",
             256);
    cr_expect_eq(load(&e, path, &o, &l), CLMHA_SUCCESS, "%s", clmha_context_last_error(e.ctx));
    clmha_layer_desc d = {.struct_size = sizeof d};
    clmha_layer_get_desc(l, &d);
    cr_expect(!d.bias && d.batch_first && d.embed_dim == 4);
    clmha_layer_release(l);
    // A missing weight.
    write_st(path,
             "{" W4("w_q.weight", "0,64") "," W4("w_k.weight", "64,128") ","
             W4("w_concat.weight", "128,192") "}",
             192);
    expect_refused(&e, load(&e, path, &o, &l), CLMHA_INVALID_FILE, "missing weight",
                   "no w_v.weight", NULL);
    env_close(&e);
}

// alibi_slopes is clmha's own tensor: it goes with a seed module's names and with a prefix.
Test(load_options, alibi_slopes_with_seed_names_and_prefix) {
    env e;
    env_open(&e);
    char path[256];
    snprintf(path, sizeof path, "%s/alibi.safetensors", e.dir);
    write_st(path,
             "{\"__metadata__\":{\"num_heads\":\"2\",\"alibi\":\"true\",\"softcap\":\"30\"},"
             W4("m.w_q.weight", "0,64") "," W4("m.w_k.weight", "64,128") ","
             W4("m.w_v.weight", "128,192") "," W4("m.w_concat.weight", "192,256") ","
             "\"m.alibi_slopes\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[256,264]},"
             W4("other.w_q.weight", "264,328") "}",
             328);
    clmha_load_options o = {.struct_size = sizeof o, .prefix = "m"};
    clmha_layer *l;
    cr_assert_eq(load(&e, path, &o, &l), CLMHA_SUCCESS, "%s", clmha_context_last_error(e.ctx));
    clmha_layer_desc d = {.struct_size = sizeof d};
    clmha_layer_get_desc(l, &d);
    cr_expect(d.alibi && d.softcap == 30.0 && d.batch_first && d.embed_dim == 4);
    float slopes[2] = {0};
    cr_expect_eq(clmha_layer_get_parameter(l, "alibi_slopes", slopes, 2), CLMHA_SUCCESS);
    cr_expect(slopes[0] == 0.25f && slopes[1] == 0.25f, "%g %g", (double)slopes[0],
              (double)slopes[1]);
    clmha_layer_release(l);
    env_close(&e);
}

// sinks is clmha's own tensor too: with a seed module's names under a prefix, and with
// PyTorch's names under another.
Test(load_options, sinks_with_seed_names_and_prefix) {
    env e;
    env_open(&e);
    char path[256];
    snprintf(path, sizeof path, "%s/sinks.safetensors", e.dir);
    write_st(path,
             "{\"__metadata__\":{\"num_heads\":\"2\",\"alibi\":\"true\"},"
             W4("m.w_q.weight", "0,64") "," W4("m.w_k.weight", "64,128") ","
             W4("m.w_v.weight", "128,192") "," W4("m.w_concat.weight", "192,256") ","
             "\"m.alibi_slopes\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[256,264]},"
             "\"m.sinks\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[264,272]},"
             "\"t.in_proj_weight\":{\"dtype\":\"F32\",\"shape\":[12,4],"
             "\"data_offsets\":[272,464]},"
             W4("t.out_proj.weight", "464,528") ","
             "\"t.alibi_slopes\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[528,536]},"
             "\"t.sinks\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[536,544]}}",
             544);
    for (int k = 0; k < 2; ++k) {
        clmha_load_options o = {.struct_size = sizeof o, .prefix = k ? "t." : "m"};
        clmha_layer *l;
        cr_assert_eq(load(&e, path, &o, &l), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(e.ctx));
        clmha_layer_desc d = {.struct_size = sizeof d};
        clmha_layer_get_desc(l, &d);
        cr_expect(d.sinks && d.alibi && d.embed_dim == 4, "%s", o.prefix);
        float sinks[2] = {0}, slopes[2] = {0};
        cr_expect_eq(clmha_layer_get_parameter(l, "sinks", sinks, 2), CLMHA_SUCCESS);
        cr_expect_eq(clmha_layer_get_parameter(l, "alibi_slopes", slopes, 2), CLMHA_SUCCESS);
        cr_expect(sinks[0] == 0.25f && sinks[1] == 0.25f && slopes[0] == 0.25f, "%s: %g %g %g",
                  o.prefix, (double)sinks[0], (double)sinks[1], (double)slopes[0]);
        clmha_layer_release(l);
    }
    env_close(&e);
}

Test(load_options, torch_save_files_say_how_to_convert) {
    env e;
    env_open(&e);
    static const char *const files[][2] = {{"module.pt", "zip"}, {"legacy.pt", "pickle"}};
    for (size_t i = 0; i < 2; ++i) {
        char path[512];
        case_path("torch_save", files[i][0], path, sizeof path);
        clmha_layer *l;
        for (int opts = 0; opts < 2; ++opts) {  // as a layer file and as a model's file
            clmha_load_options o = {.struct_size = sizeof o, .prefix = opts ? "a.b" : NULL,
                                    .num_heads = 2};
            expect_refused(&e, load(&e, path, &o, &l), CLMHA_INVALID_FILE, files[i][0], path,
                           "PyTorch checkpoint written by torch.save", files[i][1],
                           "clmha reads .safetensors",
                           "clmha.torch.export(torch.load('", "save_file(state_dict, path)",
                           "--prefix", NULL);
        }
        expect_refused(&e, clmha_layer_load(&l, e.ctx, path), CLMHA_INVALID_FILE, "plain load",
                       "torch.save", NULL);
    }
    // A safetensors file whose header length starts with the bytes of a pickle (0x80 0x02:
    // 640 bytes of header) is a safetensors file.
    char path[256], h[1024];
    snprintf(path, sizeof path, "%s/x80.safetensors", e.dir);
    int n = snprintf(h, sizeof h,
                     "{\"__metadata__\":{\"num_heads\":\"2\"},"
                     "\"in_proj_weight\":{\"dtype\":\"F32\",\"shape\":[12,4],"
                     "\"data_offsets\":[0,192]}," W4("out_proj.weight", "192,256") "}");
    memset(h + n, ' ', 640 - (size_t)n);
    h[640] = '\0';
    write_st(path, h, 256);
    unsigned char *raw = (unsigned char *)read_file(path, NULL);
    cr_assert(raw && raw[0] == 0x80 && raw[1] == 0x02);
    free(raw);
    clmha_layer *l;
    cr_expect_eq(load(&e, path, NULL, &l), CLMHA_SUCCESS, "%s", clmha_context_last_error(e.ctx));
    clmha_layer_release(l);
    env_close(&e);
}

// A model's file: @p entries filler tensors "model.t<i>" (shape [1]) and an E 4 attention
// module under "enc.attn.". Returns the header's length.
static size_t write_model(const char *path, size_t entries) {
    size_t cap = 1024 + entries * 80, used = 0;
    char *h = malloc(cap);
    cr_assert_not_null(h);
    used += (size_t)snprintf(h, cap,
                             "{\"enc.attn.in_proj_weight\":{\"dtype\":\"F32\",\"shape\":[12,4],"
                             "\"data_offsets\":[0,192]},"
                             "\"enc.attn.out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],"
                             "\"data_offsets\":[192,256]}");
    for (size_t i = 0; i < entries; ++i)
        used += (size_t)snprintf(h + used, cap - used,
                                 ",\"model.t%zu\":{\"dtype\":\"F32\",\"shape\":[1],"
                                 "\"data_offsets\":[%zu,%zu]}",
                                 i, 256 + 4 * i, 260 + 4 * i);
    used += (size_t)snprintf(h + used, cap - used, "}");
    cr_assert_lt(used, cap);
    write_st(path, h, 256 + 4 * entries);
    free(h);
    return used;
}

// With a prefix a file may hold up to 65536 tensor entries (the layer takes its own); one
// more is refused before the entries are read, and quickly. Without a prefix the same file
// is refused at 9 entries.
Test(load_options, model_file_limits, .timeout = 120) {
    env e;
    env_open(&e);
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", e.dir);
    clmha_load_options o = {.struct_size = sizeof o, .prefix = "enc.attn", .num_heads = 2};
    clmha_layer *l;
    struct {
        size_t entries;
        clmha_status want;
        const char *substring;
    } rows[] = {
        {20000, CLMHA_SUCCESS, NULL},
        {65534, CLMHA_SUCCESS, NULL},  // 65536 entries in all
        {65535, CLMHA_INVALID_FILE, "65537 tensor entries; a model's file read with a prefix "
                                    "has at most 65536"},
        {120000, CLMHA_INVALID_FILE, "exceeds the limit of 8388608 bytes"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof *rows; ++i) {
        size_t header = write_model(path, rows[i].entries);
        double t0 = now_seconds();
        clmha_status st = load(&e, path, &o, &l);
        double dt = now_seconds() - t0;
        const char *msg = clmha_context_last_error(e.ctx);
        cr_log_info("%zu entries, %zu-byte header: %.3f s, %s", rows[i].entries + 2, header, dt,
                    st ? msg : "loaded");
        fprintf(stderr, "load_options limits: %zu entries, %zu-byte header: %.3f s, %s\n",
                rows[i].entries + 2, header, dt, st ? msg : "loaded");
        cr_expect_eq(st, rows[i].want, "%zu entries: %d (%s)", rows[i].entries, (int)st, msg);
        if (rows[i].substring)
            cr_expect(strstr(msg, rows[i].substring) != NULL, "%zu: \"%s\" lacks \"%s\"",
                      rows[i].entries, msg, rows[i].substring);
        cr_expect_lt(dt, 2.0, "%zu entries: %.3f s", rows[i].entries, dt);
        if (!st) clmha_layer_release(l);
    }
    // The same 20002-entry file without a prefix: a layer file's limits.
    write_model(path, 20000);
    expect_refused(&e, load(&e, path, NULL, &l), CLMHA_INVALID_FILE, "no prefix",
                   "exceeds the limit of 262144 bytes", "needs a prefix", NULL);
    write_model(path, 20);
    expect_refused(&e, load(&e, path, NULL, &l), CLMHA_INVALID_FILE, "no prefix, 22 entries",
                   "22 tensor entries", "needs a prefix", NULL);
    // A header under 8 MiB with too many JSON values (a shape of 2 Mi zeros) is refused
    // before cJSON parses it.
    size_t zeros = (size_t)2 << 20;
    char *h = malloc(2 * zeros + 256);
    cr_assert_not_null(h);
    size_t n = (size_t)sprintf(h, "{\"x\":{\"dtype\":\"F32\",\"data_offsets\":[0,0],\"shape\":[");
    for (size_t i = 0; i < zeros; ++i) h[n++] = '0', h[n++] = ',';
    n += (size_t)sprintf(h + n - 1, "]}}") - 1;
    write_st(path, h, 0);
    free(h);
    double t0 = now_seconds();
    clmha_status st = load(&e, path, &o, &l);
    double dt = now_seconds() - t0;
    expect_refused(&e, st, CLMHA_INVALID_FILE, "JSON values", "JSON values", "at most 1048576",
                   NULL);
    fprintf(stderr, "load_options limits: 2 Mi values refused in %.3f s\n", dt);
    cr_expect_lt(dt, 1.0, "%.3f s", dt);
    env_close(&e);
}

Test(load_options, bad_options) {
    env e;
    env_open(&e);
    char seed[512];
    case_path("seed_classic", "layer.safetensors", seed, sizeof seed);
    clmha_layer *l;
    clmha_load_options o = {.struct_size = 0, .num_heads = 3};
    expect_refused(&e, load(&e, seed, &o, &l), CLMHA_INVALID_ARGUMENT, "struct_size 0",
                   "struct_size", NULL);
    o.struct_size = sizeof o;
    o.batch_first = (clmha_batch_first)7;
    expect_refused(&e, load(&e, seed, &o, &l), CLMHA_INVALID_ARGUMENT, "batch_first 7",
                   "batch_first is 7", NULL);
    o.batch_first = CLMHA_BATCH_FIRST_AUTO;
    o.dtype = (clmha_dtype)9;
    cr_expect_eq(load(&e, seed, &o, &l), CLMHA_INVALID_ARGUMENT, "%s",
                 clmha_context_last_error(e.ctx));
    cr_expect_eq(clmha_layer_load_prefixed(NULL, e.ctx, seed, NULL), CLMHA_INVALID_ARGUMENT);
    l = BAD_LAYER;
    cr_expect_eq(clmha_layer_load_prefixed(&l, e.ctx, NULL, NULL), CLMHA_INVALID_ARGUMENT);
    cr_expect_null(l);
    env_close(&e);
}
