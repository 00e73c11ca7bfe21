// GEMM tuning: tuning JSON import/export, refusals (another device, corrupt or invalid JSON),
// the tuning folder ($CLMHA_TUNING_DIR), a stored tuning applied when a context is created
// (with forward passes that still match the CPU reference), and unusable stored files that
// must not break context creation. No real search runs here: clmha_context_tune() is only
// given wrong arguments and a budget too small for any candidate.
//
// Criterion runs each test in its own process, which matters: CLBlast keeps overridden
// parameters per device for the whole process, and a context loads the stored tuning of its
// device once per process.
//
// The built-in parameter sets (src/tuning_store/builtin.c), which a device without a stored tuning
// gets, are switched off here (test hook: this file links libclmha.a), so that "nothing
// applied" stays what it was; test_builtin.c checks them and their precedence.
#define _POSIX_C_SOURCE 200809L

#include <criterion/criterion.h>

#include <clmha.h>

#include "support.h"
#include "tuning_store/builtin.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <clblast_c.h>  // the CLBlast version clmha is built with: a tuning file records it

#define STR2(x) #x
#define STR(x) STR2(x)
#define CLBLAST_VERSION_TEXT \
    STR(CLBLAST_VERSION_MAJOR) "." STR(CLBLAST_VERSION_MINOR) "." STR(CLBLAST_VERSION_PATCH)

// The hand-picked CPU Xgemm set and a direct set, both valid for CLBlast, with work-groups of
// 16 and 64 work-items.
#define XGEMM_JSON                                                                         \
    "\"Xgemm\": {\"GEMMK\": 0, \"KREG\": 1, \"KWG\": 16, \"KWI\": 2, \"MDIMA\": 4, "       \
    "\"MDIMC\": 4, \"MWG\": 64, \"NDIMB\": 4, \"NDIMC\": 4, \"NWG\": 64, \"SA\": 0, "       \
    "\"SB\": 0, \"STRM\": 0, \"STRN\": 0, \"VWM\": 8, \"VWN\": 8}"
// (Direct kernels with larger tiles per work-item take minutes to build on PoCL.)
#define DIRECT_JSON                                                                        \
    "\"XgemmDirect\": {\"KWID\": 2, \"MDIMAD\": 8, \"MDIMCD\": 8, \"NDIMBD\": 8, "         \
    "\"NDIMCD\": 8, \"PADA\": 1, \"PADB\": 1, \"VWMD\": 2, \"VWND\": 2, \"WGD\": 16}"

typedef struct fixture {
    char dir[64];              // a fresh tuning folder, $CLMHA_TUNING_DIR
    clmha_device_info info;    // the device $CLMHA_DEVICE selects
    char path[1024];           // its tuning file in dir
} fixture;

// "Portable Computing Language" -> "Portable_Computing_Language": every run of characters other
// than A-Z a-z 0-9 . _ - becomes one '_' (the file name rule documented in clmha.h).
static void sanitise(char *out, size_t size, const char *s) {
    size_t n = 0;
    bool sub = false;
    for (; *s && n + 1 < size; ++s) {
        char c = *s;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == '-';
        if (ok) out[n++] = c, sub = false;
        else if (!sub) out[n++] = '_', sub = true;
    }
    out[n] = '\0';
}

// Sets up a tuning folder and finds the device; skips the test when there is none.
static void setup(fixture *f) {
    memset(f, 0, sizeof *f);
    f->info.struct_size = sizeof f->info;
    char msg[1024];
    if (clmha_device_select(getenv("CLMHA_DEVICE"), &f->info, msg, sizeof msg) != CLMHA_SUCCESS)
        cr_skip_test("no OpenCL device: %s", msg);
    tmpdir_make(f->dir, sizeof f->dir, "clmha-tuning");
    clmha__test_enable_builtin(false);
    setenv("CLMHA_TUNING_DIR", f->dir, 1);
    unsetenv("CLMHA_TUNING");
    char platform[256], device[256];
    sanitise(platform, sizeof platform, f->info.platform_name);
    sanitise(device, sizeof device, f->info.device_name);
    snprintf(f->path, sizeof f->path, "%s/%s--%s.json", f->dir, platform, device);
}

static void teardown(fixture *f) {
    if (f->dir[0]) tmpdir_remove(f->dir);
}

// A tuning JSON for (platform, device, driver, CLBlast version) with @p kernels
// ("\"Xgemm\": {...}, ..."); @p clblast NULL leaves the "clblast" field out (as clmha wrote
// files before it recorded the version).
static char *tuning_json_for(const char *platform, const char *device, const char *driver,
                             const char *clblast, const char *kernels) {
    size_t size = strlen(platform) + strlen(device) + strlen(driver) + strlen(kernels) + 320;
    char *s = malloc(size);
    cr_assert_not_null(s);
    char clblast_field[96] = "";
    if (clblast) snprintf(clblast_field, sizeof clblast_field, "\"clblast\": \"%s\", ", clblast);
    snprintf(s, size,
             "{\"format\": \"clmha-gemm-tuning\", \"version\": 1, \"platform\": \"%s\", "
             "\"device\": \"%s\", \"driver\": \"%s\", %s\"precision\": \"float32\", "
             "\"kernels\": {%s}}",
             platform, device, driver, clblast_field, kernels);
    return s;
}

// The same for the CLBlast version clmha is built with.
static char *tuning_json(const char *platform, const char *device, const char *driver,
                         const char *kernels) {
    return tuning_json_for(platform, device, driver, CLBLAST_VERSION_TEXT, kernels);
}

static char *own_json(const fixture *f, const char *kernels) {
    return tuning_json(f->info.platform_name, f->info.device_name, f->info.driver_version,
                       kernels);
}

static clmha_context *make_context(void) {
    clmha_context *ctx = NULL;
    clmha_status st = clmha_context_create_from_env(&ctx);
    cr_assert_eq(st, CLMHA_SUCCESS, "context creation failed: %s", clmha_last_create_error());
    return ctx;
}

// A context whose products run in CLBlast, so that a tuning run searches its GEMM parameters
// (on a CPU device with a host BLAS they run there by default, and the search is skipped).
static clmha_context *make_clblast_context(void) {
    clmha_context *ctx = make_context();
    cr_assert_eq(clmha_context_set_gemm(ctx, CLMHA_GEMM_CLBLAST), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    return ctx;
}

static void write_file(const char *path, const char *text) {
    FILE *fp = fopen(path, "wb");
    cr_assert_not_null(fp, "cannot write %s", path);
    fputs(text, fp);
    fclose(fp);
}

static void note_of(clmha_context *ctx, char *note, size_t size) {
    cr_assert_eq(clmha_context_tuning_note(ctx, note, size), CLMHA_SUCCESS);
}

// The whole export as a malloc'd string (NULL when none is applied).
static char *export_text(clmha_context *ctx) {
    size_t needed = 0;
    clmha_status st = clmha_context_tuning_export(ctx, NULL, 0, &needed);
    if (st == CLMHA_NOT_READY) return NULL;
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_assert_gt(needed, 1);
    char *s = malloc(needed);
    cr_assert_not_null(s);
    cr_assert_eq(clmha_context_tuning_export(ctx, s, needed, NULL), CLMHA_SUCCESS);
    cr_assert_eq(strlen(s) + 1, needed);
    return s;
}

// The value of "name": N in @p json, after the first occurrence of @p kernel (-1 if absent).
static long param(const char *json, const char *kernel, const char *name) {
    const char *k = strstr(json, kernel);
    if (!k) return -1;
    char key[64];
    snprintf(key, sizeof key, "\"%s\":", name);
    const char *p = strstr(k, key);
    return p ? strtol(p + strlen(key), NULL, 10) : -1;
}

// ---- import and export ---------------------------------------------------------------------

Test(tuning, export_import_round_trip, .timeout = 300) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_context();
    cr_expect_null(export_text(ctx), "nothing is applied in a fresh process without a file");
    cr_expect(strstr(clmha_context_last_error(ctx), "no tuning is applied") != NULL, "%s",
              clmha_context_last_error(ctx));

    char *json = own_json(&f, XGEMM_JSON ", " DIRECT_JSON
                               ", \"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": 448}");
    cr_assert_eq(clmha_context_tuning_import(ctx, json), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    char *out = export_text(ctx);
    cr_assert_not_null(out);
    cr_expect_eq(param(out, "\"Xgemm\"", "MWG"), 64);
    cr_expect_eq(param(out, "\"Xgemm\"", "VWN"), 8);
    cr_expect_eq(param(out, "\"XgemmDirect\"", "WGD"), 16);
    cr_expect_eq(param(out, "\"GemmRoutine\"", "XGEMM_MIN_INDIRECT_SIZE"), 448);
    cr_expect(strstr(out, f.info.device_name) != NULL);

    // The export imports again (here and in another context) and exports the same text.
    clmha_context *other = make_context();
    cr_assert_eq(clmha_context_tuning_import(other, out), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(other));
    char *again = export_text(other);
    cr_expect_str_eq(again, out);

    // A buffer one byte short is refused and left alone.
    size_t needed = 0;
    cr_assert_eq(clmha_context_tuning_export(ctx, NULL, 0, &needed), CLMHA_SUCCESS);
    char *small = malloc(needed);
    memset(small, 'x', needed);
    cr_expect_eq(clmha_context_tuning_export(ctx, small, needed - 1, &needed),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(small[0], 'x');
    cr_expect(strstr(clmha_context_last_error(ctx), "needs") != NULL);

    // Importing only GemmRoutine keeps the other kernels.
    char *partial = own_json(&f, "\"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": 0}");
    cr_assert_eq(clmha_context_tuning_import(ctx, partial), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    char *merged = export_text(ctx);
    cr_expect_eq(param(merged, "\"Xgemm\"", "MWG"), 64);
    cr_expect_eq(param(merged, "\"GemmRoutine\"", "XGEMM_MIN_INDIRECT_SIZE"), 0);

    char note[2048];
    note_of(ctx, note, sizeof note);
    cr_expect(strstr(note, "imported") != NULL, "%s", note);
    free(json), free(out), free(again), free(small), free(partial), free(merged);
    clmha_context_release(other);
    clmha_context_release(ctx);
    teardown(&f);
}

Test(tuning, another_device_is_refused, .timeout = 300) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_context();
    char *other_device = tuning_json(f.info.platform_name, "Some Other Device 9000",
                                     f.info.driver_version, XGEMM_JSON);
    cr_expect_eq(clmha_context_tuning_import(ctx, other_device), CLMHA_UNSUPPORTED);
    cr_expect(strstr(clmha_context_last_error(ctx), "Some Other Device 9000") != NULL, "%s",
              clmha_context_last_error(ctx));
    char *other_platform = tuning_json("Another Platform", f.info.device_name,
                                       f.info.driver_version, XGEMM_JSON);
    cr_expect_eq(clmha_context_tuning_import(ctx, other_platform), CLMHA_UNSUPPORTED);
    char *other_driver = tuning_json(f.info.platform_name, f.info.device_name, "0.0-old",
                                     XGEMM_JSON);
    cr_expect_eq(clmha_context_tuning_import(ctx, other_driver), CLMHA_UNSUPPORTED);
    cr_expect(strstr(clmha_context_last_error(ctx), "driver") != NULL, "%s",
              clmha_context_last_error(ctx));
    cr_expect_null(export_text(ctx), "a refused tuning is not applied");
    free(other_device), free(other_platform), free(other_driver);
    clmha_context_release(ctx);
    teardown(&f);
}

// CLBlast's parameters belong to a CLBlast version: a tuning with CLBlast kernels from another
// version, or without the version (written by an older clmha), is refused; clmha's own fused
// tiles do not depend on it.
Test(tuning, another_clblast_version_is_refused, .timeout = 300) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_context();
    const clmha_device_info *i = &f.info;
    char *other = tuning_json_for(i->platform_name, i->device_name, i->driver_version, "1.4.0",
                                  XGEMM_JSON);
    cr_expect_eq(clmha_context_tuning_import(ctx, other), CLMHA_UNSUPPORTED);
    cr_expect(strstr(clmha_context_last_error(ctx), "CLBlast 1.4.0") &&
                  strstr(clmha_context_last_error(ctx), "CLBlast " CLBLAST_VERSION_TEXT) &&
                  strstr(clmha_context_last_error(ctx), "clmha tune"),
              "%s", clmha_context_last_error(ctx));
    char *unversioned = tuning_json_for(i->platform_name, i->device_name, i->driver_version, NULL,
                                        "\"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": 64}");
    cr_expect_eq(clmha_context_tuning_import(ctx, unversioned), CLMHA_UNSUPPORTED);
    cr_expect(strstr(clmha_context_last_error(ctx), "does not say which CLBlast version") &&
                  strstr(clmha_context_last_error(ctx), "clmha tune"),
              "%s", clmha_context_last_error(ctx));
    cr_expect_null(export_text(ctx), "a refused tuning is not applied");
    char *fused_only = tuning_json_for(i->platform_name, i->device_name, i->driver_version, NULL,
                                       "\"FusedAttention\": {\"BQ\": 32, \"BK\": 32, "
                                       "\"RPW\": 1, \"VW\": 1}");
    cr_expect_eq(clmha_context_tuning_import(ctx, fused_only), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    char *out = export_text(ctx);
    cr_assert_not_null(out);
    const char *field = strstr(out, "\"clblast\":"), *want = "\"" CLBLAST_VERSION_TEXT "\"";
    const char *value = field ? field + 10 + strspn(field + 10, " \t") : "";
    cr_expect(strncmp(value, want, strlen(want)) == 0,
              "the export records the CLBlast version: %s", out);
    free(other), free(unversioned), free(fused_only), free(out);
    clmha_context_release(ctx);
    teardown(&f);
}

Test(tuning, corrupt_or_invalid_json_is_refused, .timeout = 300) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_context();
    struct {
        const char *kernels;  // NULL: use `text` as the whole document
        const char *text;
        const char *says;     // part of the message
    } cases[] = {
        {NULL, "{\"format\": \"clmha-gemm-tuning\", \"version\": 1,", "not valid JSON"},
        {NULL, "", "not valid JSON"},
        {NULL, "[1, 2, 3]", "not a clmha tuning"},
        {NULL, "{\"format\": \"something-else\"}", "not a clmha tuning"},
        {NULL, "{\"format\": \"clmha-gemm-tuning\", \"version\": 2}", "version"},
        {"\"Xgemm\": {\"GEMMK\": 0}", NULL, "lacks parameter"},
        {"\"Xgemmm\": {}", NULL, "unknown kernel"},
        {"\"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": -5}", NULL, "integer"},
        {"\"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": 2.5}", NULL, "integer"},
        {"\"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": \"64\"}", NULL, "integer"},
        {"\"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": 64, \"EXTRA\": 1}", NULL, "unknown"},
        {"", NULL, "names no kernel"},
        {"\"FusedAttention\": {\"BQ\": 48, \"BK\": 32, \"RPW\": 1, \"VW\": 1}", NULL, "BQ"},
        {"\"FusedAttention\": {\"BQ\": 64, \"BK\": 32, \"RPW\": 1, \"VW\": 64}", NULL, "VW"},
        {"\"FusedAttention\": {\"BQ\": 64, \"BK\": 8, \"RPW\": 1, \"VW\": 16}", NULL, "VW"},
        {"\"FusedAttention\": {\"BQ\": 64, \"BK\": 32, \"RPW\": 9, \"VW\": 1}", NULL, "RPW"},
        {"\"FusedAttention\": {\"BQ\": 64, \"BK\": 32, \"RPW\": 1}", NULL, "lacks parameter"},
        // MWG 48 is not a multiple of MDIMC*VWM = 32.
        {"\"Xgemm\": {\"GEMMK\": 0, \"KREG\": 1, \"KWG\": 16, \"KWI\": 2, \"MDIMA\": 4, "
         "\"MDIMC\": 4, \"MWG\": 48, \"NDIMB\": 4, \"NDIMC\": 4, \"NWG\": 64, \"SA\": 0, "
         "\"SB\": 0, \"STRM\": 0, \"STRN\": 0, \"VWM\": 8, \"VWN\": 8}",
         NULL, "MWG"},
        // VWMD 3 is not a vector width.
        {"\"XgemmDirect\": {\"KWID\": 8, \"MDIMAD\": 4, \"MDIMCD\": 4, \"NDIMBD\": 4, "
         "\"NDIMCD\": 4, \"PADA\": 0, \"PADB\": 0, \"VWMD\": 3, \"VWND\": 8, \"WGD\": 32}",
         NULL, "VWMD"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        char *json = cases[i].kernels ? own_json(&f, cases[i].kernels) : NULL;
        clmha_status st = clmha_context_tuning_import(ctx, json ? json : cases[i].text);
        cr_expect_eq(st, CLMHA_INVALID_FILE, "case %zu: status %s", i, clmha_status_string(st));
        cr_expect(strstr(clmha_context_last_error(ctx), cases[i].says) != NULL,
                  "case %zu: message '%s' lacks '%s'", i, clmha_context_last_error(ctx),
                  cases[i].says);
        free(json);
    }
    cr_expect_eq(clmha_context_tuning_import(ctx, NULL), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_context_tuning_import(NULL, "{}"), CLMHA_INVALID_ARGUMENT);
    cr_expect_null(export_text(ctx), "nothing refused was applied");
    clmha_context_release(ctx);
    teardown(&f);
}

// ---- stored tunings ----------------------------------------------------------------------------

// A layer (E 64, 4 heads, bias), random parameters and input; forward on the device against the
// double-precision reference: max abs error <= 1e-4 for output and weights.
static void forward_matches_reference(clmha_context *ctx) {
    enum { E = 64, H = 4, N = 3, L = 37 };
    static float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E], x[L * N * E];
    static float y[L * N * E], w[N * L * L];
    static double y_ref[L * N * E], w_ref[N * L * L];
    uint64_t s = 7;
    float *arrays[] = {w_in, b_in, w_out, b_out, x};
    size_t counts[] = {3 * E * E, 3 * E, E * E, E, L * N * E};
    for (size_t a = 0; a < 5; ++a)
        for (size_t i = 0; i < counts[a]; ++i) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            arrays[a][i] = (float)((double)(s >> 40) / 16777216.0 - 0.5) * (a == 4 ? 2.0f : 0.25f);
        }
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", b_out, E), 0);
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
                               .need_weights = true};
    cr_assert_eq(clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * L),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    clmha_reference_params params = {.struct_size = sizeof params,
                                     .in_proj_weight = w_in, .in_proj_bias = b_in,
                                     .out_proj_weight = w_out, .out_proj_bias = b_out};
    char msg[512];
    cr_assert_eq(clmha_reference_forward(&desc, &params, &args, y_ref, L * N * E, w_ref,
                                         N * L * L, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    double err_y = max_abs_err(y, y_ref, L * N * E), err_w = max_abs_err(w, w_ref, N * L * L);
    cr_expect_leq(err_y, 1e-4, "output error %g", err_y);
    cr_expect_leq(err_w, 1e-4, "weights error %g", err_w);
    clmha_layer_release(layer);
}

// A stored tuning in $CLMHA_TUNING_DIR is applied when the context is created, and forward
// passes stay exact with it on both GEMM paths: XGEMM_MIN_INDIRECT_SIZE 50 sends the layer's
// projections (m·n·k = 111·192·64 and 111·64·64, above 50³) through the tuned Xgemm with
// padding, and the attention products (37·37·16 per head) through the tuned XgemmDirect.
Test(tuning, stored_tuning_applied_at_context_creation, .timeout = 1200) {
    fixture f;
    setup(&f);
    char *json = own_json(&f, XGEMM_JSON ", " DIRECT_JSON
                               ", \"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": 50}");
    write_file(f.path, json);
    clmha_context *ctx = make_context();
    char note[2048];
    note_of(ctx, note, sizeof note);
    cr_expect(strstr(note, "stored tuning") && strstr(note, "applied") &&
                  strstr(note, f.dir),
              "%s", note);
    char *out = export_text(ctx);
    cr_assert_not_null(out, "the stored tuning was not applied");
    cr_expect_eq(param(out, "\"Xgemm\"", "MWG"), 64);
    cr_expect_eq(param(out, "\"XgemmDirect\"", "WGD"), 16);
    cr_expect_eq(param(out, "\"GemmRoutine\"", "XGEMM_MIN_INDIRECT_SIZE"), 50);
    forward_matches_reference(ctx);
    free(json), free(out);
    clmha_context_release(ctx);
    teardown(&f);
}

// The set the tuner tries first on a CPU (its first seed: 2×8 work-items of 16×16 floats, KWG 32,
// STRM 1, VWM 8, VWN 4) keeps forward passes exact with every GEMM on the indirect path
// (XGEMM_MIN_INDIRECT_SIZE 0): the projections and the batched attention products, all padded
// to its 32×128 tiles.
Test(tuning, first_cpu_seed_keeps_forward_exact, .timeout = 1200) {
    fixture f;
    setup(&f);
    char *json = own_json(&f, "\"Xgemm\": {\"GEMMK\": 0, \"KREG\": 1, \"KWG\": 32, \"KWI\": 2, "
                              "\"MDIMA\": 2, \"MDIMC\": 2, \"MWG\": 32, \"NDIMB\": 8, "
                              "\"NDIMC\": 8, \"NWG\": 128, \"SA\": 0, \"SB\": 0, \"STRM\": 1, "
                              "\"STRN\": 0, \"VWM\": 8, \"VWN\": 4}, "
                              "\"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": 0}");
    write_file(f.path, json);
    clmha_context *ctx = make_context();
    char *out = export_text(ctx);
    cr_assert_not_null(out, "the stored tuning was not applied");
    cr_expect_eq(param(out, "\"Xgemm\"", "STRM"), 1);
    cr_expect_eq(param(out, "\"GemmRoutine\"", "XGEMM_MIN_INDIRECT_SIZE"), 0);
    forward_matches_reference(ctx);
    free(json), free(out);
    clmha_context_release(ctx);
    teardown(&f);
}

Test(tuning, unusable_stored_files_do_not_break_context_creation, .timeout = 300) {
    fixture f;
    setup(&f);
    char note[2048];
    // A folder that does not exist.
    setenv("CLMHA_TUNING_DIR", "/nonexistent/clmha/tuning/dir", 1);
    clmha_context *ctx = make_context();
    note_of(ctx, note, sizeof note);
    cr_expect(strstr(note, "/nonexistent/clmha/tuning/dir/") && strstr(note, "not found"), "%s",
              note);
    cr_expect_null(export_text(ctx));
    forward_matches_reference(ctx);
    clmha_context_release(ctx);
    teardown(&f);
}

// The stored file is read once per device and process: each case runs in a child process.
// The child is this program started again (posix_spawn of /proc/self/exe), not a fork: NVIDIA's
// OpenCL driver, like CUDA, cannot be used in a child forked after the parent initialised it
// (every context creation failed so on an H200), and setup() has asked the driver already.
// child_main() below, run before Criterion's main, does the child's part when
// CLMHA_TEST_TUNING_CHILD is set: "note" checks the note and that nothing was applied, "fifo"
// that a FIFO at the stored path is ignored without blocking (an alarm fails a hang).
extern char **environ;

static int child_case(bool fifo, const char *expect_note) {
    if (fifo) alarm(60);
    clmha__test_enable_builtin(false);
    clmha_context *ctx = NULL;
    int rc = clmha_context_create_from_env(&ctx) == CLMHA_SUCCESS ? 0 : 1;
    char note[2048] = "";
    if (!rc) clmha_context_tuning_note(ctx, note, sizeof note);
    bool note_ok = fifo ? strstr(note, "ignored") && strstr(note, "FIFO")
                        : strstr(note, expect_note) != NULL;
    if (!rc && !note_ok) {
        fprintf(stderr, "note '%s' lacks '%s'\n", note, fifo ? "ignored ... FIFO" : expect_note);
        rc = 2;
    }
    size_t needed;
    if (!rc && !fifo && clmha_context_tuning_export(ctx, NULL, 0, &needed) != CLMHA_NOT_READY)
        rc = 3;
    clmha_context_release(ctx);
    return rc;
}

__attribute__((constructor)) static void child_main(void) {
    const char *mode = getenv("CLMHA_TEST_TUNING_CHILD");
    if (!mode) return;
    const char *expect = getenv("CLMHA_TEST_TUNING_EXPECT");
    _exit(child_case(strcmp(mode, "fifo") == 0, expect ? expect : ""));
}

// Starts this program as a child in @p mode with CLMHA_TUNING=@p tuning_env (NULL: unset) and
// returns its wait status.
static int spawn_child(const char *mode, const char *tuning_env, const char *expect_note) {
    size_t n = 0;
    while (environ[n]) ++n;
    char **envp = calloc(n + 4, sizeof *envp);
    cr_assert_not_null(envp);
    size_t k = 0;
    for (size_t i = 0; i < n; ++i)
        if (strncmp(environ[i], "CLMHA_TUNING=", 13) != 0) envp[k++] = environ[i];
    char mode_var[64], expect_var[512], tuning_var[128];
    snprintf(mode_var, sizeof mode_var, "CLMHA_TEST_TUNING_CHILD=%s", mode);
    snprintf(expect_var, sizeof expect_var, "CLMHA_TEST_TUNING_EXPECT=%s", expect_note);
    envp[k++] = mode_var;
    envp[k++] = expect_var;
    if (tuning_env) {
        snprintf(tuning_var, sizeof tuning_var, "CLMHA_TUNING=%s", tuning_env);
        envp[k++] = tuning_var;
    }
    char *argv[] = {"test_tuning", NULL};
    fflush(NULL);
    pid_t pid;
    int err = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, envp);
    free(envp);
    cr_assert_eq(err, 0, "posix_spawn: %s", strerror(err));
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    return status;
}

static void child_with_file(const fixture *f, const char *content, const char *tuning_env,
                            const char *expect_note) {
    if (content) write_file(f->path, content);
    int status = spawn_child("note", tuning_env, expect_note);
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "child for '%s' failed (exit %d: 1 creation failed, 2 wrong note, 3 applied)",
              expect_note, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

Test(tuning, corrupt_or_foreign_stored_files_are_ignored, .timeout = 300) {
    fixture f;
    setup(&f);
    child_with_file(&f, NULL, NULL, "not found");
    child_with_file(&f, "{\"format\": \"clmha-gemm-tuning\", \"vers", NULL, "not valid JSON");
    child_with_file(&f, "\x01\x02garbage", NULL, "ignored");
    char *foreign = tuning_json(f.info.platform_name, "Some Other Device 9000",
                                f.info.driver_version, XGEMM_JSON);
    child_with_file(&f, foreign, NULL, "Some Other Device 9000");
    char *bad = own_json(&f, "\"Xgemm\": {\"GEMMK\": 0}");
    child_with_file(&f, bad, NULL, "lacks parameter");
    char *good = own_json(&f, XGEMM_JSON);
    child_with_file(&f, good, "off", "CLMHA_TUNING=off");  // not loaded at all
    const clmha_device_info *i = &f.info;
    char *old_clblast = tuning_json_for(i->platform_name, i->device_name, i->driver_version,
                                        "1.4.0", XGEMM_JSON);
    child_with_file(&f, old_clblast, NULL, "the tuning is for CLBlast 1.4.0");
    char *unversioned = tuning_json_for(i->platform_name, i->device_name, i->driver_version,
                                        NULL, XGEMM_JSON);
    child_with_file(&f, unversioned, NULL, "does not say which CLBlast version");
    free(foreign), free(bad), free(good), free(old_clblast), free(unversioned);
    teardown(&f);
}

// A FIFO (no writer) at the stored tuning's path is ignored as unusable at once: creating a
// context must not block on it. (In a child with an alarm, so that a hang fails the test.)
Test(tuning, fifo_at_the_stored_path_is_ignored, .timeout = 120) {
    fixture f;
    setup(&f);
    cr_assert_eq(mkfifo(f.path, 0600), 0);
    int status = spawn_child("fifo", NULL, "");
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "child: %s %d (1 creation failed, 2 wrong note; SIGALRM: it hung)",
              WIFEXITED(status) ? "exit" : "signal",
              WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    teardown(&f);
}

// ---- clmha_context_tune without a search -----------------------------------------------------------

Test(tuning, tune_refuses_wrong_arguments, .timeout = 300) {
    fixture f;
    setup(&f);
    clmha_tune_report rep = {.struct_size = sizeof rep};
    cr_expect_eq(clmha_context_tune(NULL, NULL, &rep), CLMHA_INVALID_ARGUMENT);
    clmha_context *ctx = make_context();
    clmha_tune_options o = {.struct_size = sizeof o, .budget_seconds = -1};
    cr_expect_eq(clmha_context_tune(ctx, &o, &rep), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "budget_seconds") != NULL);
    clmha_tune_shape shapes[5] = {{8, 128, 512, 8}};
    o = (clmha_tune_options){.struct_size = sizeof(clmha_tune_options),
                             .shapes = shapes, .num_shapes = 5};
    cr_expect_eq(clmha_context_tune(ctx, &o, &rep), CLMHA_INVALID_ARGUMENT);
    shapes[0] = (clmha_tune_shape){8, 128, 500, 8};  // E not a multiple of H
    o.num_shapes = 1;
    cr_expect_eq(clmha_context_tune(ctx, &o, &rep), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "multiple of H") != NULL);
    o = (clmha_tune_options){.struct_size = sizeof(clmha_tune_options),
                             .num_shapes = 1};  // shapes NULL
    cr_expect_eq(clmha_context_tune(ctx, &o, &rep), CLMHA_INVALID_ARGUMENT);
    cr_expect_null(export_text(ctx));
    clmha_context_release(ctx);
    teardown(&f);
}

static int progress_calls;
static void count_progress(double fraction, const char *message, void *user_data) {
    (void)user_data;
    cr_expect(fraction >= 0 && fraction <= 1, "fraction %g", fraction);
    cr_expect_not_null(message);
    ++progress_calls;
}

// A budget too small for any candidate: the current parameters are timed and checked, nothing
// changes, nothing is stored.
Test(tuning, tune_with_no_time_for_a_candidate, .timeout = 600) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_clblast_context();
    clmha_tune_shape shape = {2, 16, 32, 4};
    clmha_tune_options o = {.struct_size = sizeof o,
                            .budget_seconds = 0.01, .shapes = &shape, .num_shapes = 1,
                            .progress = count_progress};
    clmha_tune_report rep = {.struct_size = sizeof rep};
    cr_assert_eq(clmha_context_tune(ctx, &o, &rep), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_expect(!rep.improved && !rep.stored);
    cr_expect_eq(rep.candidates, 0);
    cr_expect_gt(rep.default_gflops, 0);
    cr_expect_eq(rep.tuned_gflops, rep.default_gflops);
    cr_expect_str_eq(rep.layer, "2,16,32,4");
    cr_expect(strstr(rep.message, "budget") != NULL, "%s", rep.message);
    cr_expect_gt(progress_calls, 0);
    cr_expect_neq(access(f.path, F_OK), 0, "nothing may be stored");
    cr_expect_null(export_text(ctx));
    clmha_context_release(ctx);
    teardown(&f);
}

static int trace_lines, progress_lines;
static void count_trace(double fraction, const char *message, void *user_data) {
    (void)user_data;
    cr_expect_not_null(message);
    if (fraction == -1) {
        cr_expect(strncmp(message, "[tune ", 6) == 0, "trace line '%s'", message);
        ++trace_lines;
    } else {
        cr_expect(fraction >= 0 && fraction <= 1, "fraction %g", fraction);
        ++progress_lines;
    }
}

// A context whose products run in the host BLAS; the test is skipped (@p f torn down) on a
// device that runs none there.
static clmha_context *host_gemm_context(fixture *f) {
    clmha_context *ctx = make_context();
    if (clmha_context_set_gemm(ctx, CLMHA_GEMM_HOST) != CLMHA_SUCCESS) {
        clmha_context_release(ctx);
        teardown(f);
        cr_skip_test("this device runs no host-BLAS GEMMs");
    }
    return ctx;
}

// On a context whose products run in the host BLAS, CLBlast's GEMM parameters are never used:
// nothing of them is timed or searched, and the report says why.
Test(tuning, tune_skips_the_gemm_search_on_host_gemms, .timeout = 600) {
    fixture f;
    setup(&f);
    clmha_context *ctx = host_gemm_context(&f);
    clmha_tune_shape shape = {2, 16, 32, 4};
    clmha_tune_options o = {.struct_size = sizeof o, .budget_seconds = 0.01, .shapes = &shape,
                            .num_shapes = 1, .progress = count_progress};
    clmha_tune_report rep = {.struct_size = sizeof rep};
    cr_assert_eq(clmha_context_tune(ctx, &o, &rep), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_expect_eq(rep.default_gflops, 0.0);
    cr_expect_eq(rep.tuned_gflops, 0.0);
    cr_expect_eq(rep.default_layer_gflops, 0.0);
    cr_expect_eq(rep.default_forward_gemm_gflops, 0.0);
    cr_expect(!rep.improved && !rep.stored);
    cr_expect(strstr(rep.message, "host BLAS") != NULL, "%s", rep.message);
    cr_expect_neq(access(f.path, F_OK), 0, "nothing may be stored");
    clmha_context_release(ctx);
    teardown(&f);
}

// max_candidates bounds each search where the budget does not: on host-BLAS GEMMs one fused
// tile candidate and one decode split under an hour's budget, a run of seconds.
Test(tuning, tune_max_candidates_bounds_each_search, .timeout = 600) {
    fixture f;
    setup(&f);
    clmha_context *ctx = host_gemm_context(&f);
    clmha_tune_shape shape = {2, 16, 32, 4};
    clmha_tune_options o = {.struct_size = sizeof o, .budget_seconds = 3600, .shapes = &shape,
                            .num_shapes = 1, .no_store = true, .max_candidates = 1};
    clmha_tune_report rep = {.struct_size = sizeof rep};
    cr_assert_eq(clmha_context_tune(ctx, &o, &rep), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_expect(rep.candidates >= 1 && rep.candidates <= 2, "%zu candidates", rep.candidates);
    cr_expect_lt(rep.seconds, 600, "the budget decided, not the candidate count");
    cr_expect(!rep.stored);
    cr_expect_neq(access(f.path, F_OK), 0, "nothing may be stored");
    clmha_context_release(ctx);
    teardown(&f);
}

// With trace set the callback also gets trace lines (fraction -1): the timings before, the
// split, the final check; the library prints nothing itself.
Test(tuning, tune_trace_lines_go_to_the_callback, .timeout = 600) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_clblast_context();
    clmha_tune_shape shape = {2, 16, 32, 4};
    clmha_tune_options o = {.struct_size = sizeof o, .budget_seconds = 0.01, .shapes = &shape, .num_shapes = 1,
                            .progress = count_trace, .trace = true};
    clmha_tune_report rep = {.struct_size = sizeof rep};
    cr_assert_eq(clmha_context_tune(ctx, &o, &rep), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_expect_gt(trace_lines, 0);
    cr_expect_gt(progress_lines, 0);
    cr_expect(!rep.improved && !rep.stored);
    clmha_context_release(ctx);
    teardown(&f);
}


// ---- fused attention tiles -------------------------------------------------------------------

// The next value of the LCG @p r, uniform in [-0.5, 0.5).
static float lcg_unit(uint64_t *r) {
    *r = *r * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*r >> 40) / (double)(1ull << 24) - 0.5);
}

// A layer (E @p e, H @p h, bias) on @p ctx whose parameters are @p w (4 E² + 4 E floats: filled
// here from the LCG @p r, times @p amp), and the same parameters for the reference in *rp.
static clmha_layer *lcg_layer(clmha_context *ctx, size_t e, size_t h, uint64_t *r, float amp,
                              float *w, clmha_reference_params *rp) {
    for (size_t i = 0; i < 4 * e * e + 4 * e; ++i) w[i] = lcg_unit(r) * amp;
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = e, .num_heads = h,
                             .bias = true};
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    *rp = (clmha_reference_params){.struct_size = sizeof *rp, .in_proj_weight = w,
                                   .in_proj_bias = w + 4 * e * e, .out_proj_weight = w + 3 * e * e,
                                   .out_proj_bias = w + 4 * e * e + 3 * e};
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", rp->in_proj_weight,
                                           3 * e * e), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", rp->out_proj_weight, e * e),
                 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", rp->in_proj_bias, 3 * e), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", rp->out_proj_bias, e), 0);
    return layer;
}

// Max |fused - reference| of a self-attention layer (E 24, H 3, N 2, L 45) on @p ctx.
static double fused_error(clmha_context *ctx) {
    enum { E = 24, H = 3, N = 2, L = 45, COUNT = N * L * E };
    static float w[4 * E * E + 4 * E], x[COUNT], y[COUNT];
    static double ref[COUNT];
    uint64_t r = 99;
    clmha_reference_params rp;
    clmha_layer *layer = lcg_layer(ctx, E, H, &r, 0.4f, w, &rp);
    for (size_t i = 0; i < COUNT; ++i) x[i] = lcg_unit(&r);
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    clmha_forward_args a = {.struct_size = sizeof a,
                            .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
                            .is_causal = true, .impl = CLMHA_IMPL_FUSED};
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, COUNT, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    char msg[256];
    cr_assert_eq(clmha_reference_forward(&desc, &rp, &a, ref, COUNT, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    double err = max_abs_err(y, ref, COUNT);
    clmha_layer_release(layer);
    return err;
}

// Imported fused tiles reach the export, and layers built afterwards use them and stay exact
// (work-groups of 16, 8 keys per tile, one row per work-item, scalar; then 32/16/2 with
// 8-wide vectors, which head_dim 8 allows). A class of the lanes mapping (cpu-pocl) takes
// these tiled-mapping tiles (BQ > 1) for stale and keeps its defaults: exact all the same.
Test(tuning, imported_fused_tiles_are_used, .timeout = 300) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_context();
    double err0 = fused_error(ctx);
    static const char *const tiles[] = {
        "\"FusedAttention\": {\"BQ\": 16, \"BK\": 8, \"RPW\": 1, \"VW\": 1}",
        "\"FusedAttention\": {\"BQ\": 32, \"BK\": 16, \"RPW\": 2, \"VW\": 8}",
    };
    for (size_t i = 0; i < 2; ++i) {
        char *json = own_json(&f, tiles[i]);
        cr_assert_eq(clmha_context_tuning_import(ctx, json), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        free(json);
        char *out = export_text(ctx);
        cr_assert_not_null(out);
        cr_expect_eq(param(out, "FusedAttention", "BQ"), i ? 32 : 16, "%s", out);
        cr_expect_eq(param(out, "FusedAttention", "RPW"), i ? 2 : 1, "%s", out);
        free(out);
        double err = fused_error(ctx);
        fprintf(stderr, "tuning: fused tiles %zu: max error %.2e (default tiles %.2e)\n", i, err,
                err0);
        cr_expect_leq(err, 1e-5, "fused tiles %zu: error %g", i, err);
    }
    clmha_context_release(ctx);
    teardown(&f);
}

static double decode_error(clmha_context *ctx);  // below, with the decode split's tests

// Whether the device's profiled times are positive: a profiled forward's fused stage. rusticl
// on llvmpipe gives zeros, and then nothing the tuner times by profiling can be ranked.
static bool profiled_times_positive(clmha_context *ctx) {
    enum { E = 16, H = 2, L = 8, COUNT = L * E };
    static float w[4 * E * E + 4 * E], x[COUNT], y[COUNT];
    uint64_t r = 5;
    clmha_reference_params rp;
    clmha_layer *layer = lcg_layer(ctx, E, H, &r, 0.4f, w, &rp);
    for (size_t i = 0; i < COUNT; ++i) x[i] = lcg_unit(&r);
    clmha_forward_args a = {.struct_size = sizeof a,
                            .query = {.ndim = 3, .shape = {L, 1, E}, .data = x},
                            .impl = CLMHA_IMPL_FUSED};
    double stages[CLMHA_STAGE_COUNT] = {0};
    cr_assert_eq(clmha_layer_set_profiling(layer, true), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, COUNT, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_assert_eq(clmha_layer_stage_times(layer, stages), CLMHA_SUCCESS);
    clmha_layer_release(layer);
    return stages[CLMHA_STAGE_FUSED] > 0;
}

// A tuning run times the fused kernel's default tiles and the decode split, and reports them.
Test(tuning, tune_reports_the_fused_stage, .timeout = 900) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_context();
    clmha_tune_shape shape = {.batch = 1, .tgt_len = 64, .embed_dim = 32, .num_heads = 2};
    clmha_tune_options o = {.struct_size = sizeof o,
                            .budget_seconds = 20, .shapes = &shape, .num_shapes = 1,
                            .no_store = true};
    clmha_tune_report rep = {.struct_size = sizeof rep};
    cr_assert_eq(clmha_context_tune(ctx, &o, &rep), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    fprintf(stderr, "tuning: fused stage default %.2f GFLOP/s, tuned %.2f, %zu candidates\n",
            rep.default_fused_gflops, rep.tuned_fused_gflops, rep.candidates);
    cr_expect(fused_error(ctx) <= 1e-5);
    // The decode split (phase E) was timed too; decode calls after it stay exact.
    fprintf(stderr, "tuning: decode step default %.3f ms, tuned %.3f ms\n", rep.default_decode_ms,
            rep.tuned_decode_ms);
    // A driver whose profiled times are zero (rusticl on llvmpipe) has neither figure: 0, "not
    // timed" (clmha.h), never an infinite rate.
    if (profiled_times_positive(ctx)) {
        cr_expect(rep.default_fused_gflops > 0 && isfinite(rep.default_fused_gflops), "%g",
                  rep.default_fused_gflops);
        cr_expect_geq(rep.tuned_fused_gflops, rep.default_fused_gflops);
        cr_expect_gt(rep.default_decode_ms, 0.0);
        cr_expect_gt(rep.tuned_decode_ms, 0.0);
    } else {
        cr_expect_eq(rep.default_fused_gflops, 0.0, "%g", rep.default_fused_gflops);
        cr_expect_eq(rep.tuned_fused_gflops, 0.0, "%g", rep.tuned_fused_gflops);
        cr_expect_eq(rep.default_decode_ms, 0.0);
    }
    cr_expect_leq(rep.tuned_decode_ms, rep.default_decode_ms);
    char *out = export_text(ctx);
    bool split_tuned = out && strstr(out, "DecodeSplit") != NULL;
    cr_expect_eq(split_tuned, rep.tuned_decode_ms < rep.default_decode_ms,
                 "a faster split is in effect exactly when one was found: %s", out ? out : "none");
    free(out);
    cr_expect(decode_error(ctx) <= 2e-5);
    clmha_context_release(ctx);
    teardown(&f);
}

// ---- the decode split ----------------------------------------------------------------------

// Max |decode - reference| of one query row over a KV cache of 300 keys (cross-attention, E 16,
// H 2, N 1, kv_attend_only after the call that fills the cache) on @p ctx.
static double decode_error(clmha_context *ctx) {
    enum { E = 16, H = 2, S = 300 };
    static float w[4 * E * E + 4 * E], q[E], kv[S * E], y[E];
    static double ref[E];
    uint64_t r = 7;
    clmha_reference_params rp;
    clmha_layer *layer = lcg_layer(ctx, E, H, &r, 0.5f, w, &rp);
    for (size_t i = 0; i < E; ++i) q[i] = 2.0f * lcg_unit(&r);
    for (size_t i = 0; i < S * E; ++i) kv[i] = 2.0f * lcg_unit(&r);
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create(&cache, layer, 1, S), CLMHA_SUCCESS);
    clmha_forward_args a = {.struct_size = sizeof a,
                            .query = {.ndim = 3, .shape = {1, 1, E}, .data = q},
                            .key = {.ndim = 3, .shape = {S, 1, E}, .data = kv},
                            .value = {.ndim = 3, .shape = {S, 1, E}, .data = kv}};
    char msg[256];
    cr_assert_eq(clmha_reference_forward(&desc, &rp, &a, ref, E, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    a.kv_cache = cache;
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, E, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    double err = max_abs_err(y, ref, E);
    clmha_forward_args again = {.struct_size = sizeof again, .kv_cache = cache,
                                .kv_attend_only = true, .query = a.query};
    cr_assert_eq(clmha_layer_forward_host(layer, &again, y, E, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    double err2 = max_abs_err(y, ref, E);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    return err > err2 ? err : err2;
}

// An imported decode split reaches the export, and decode calls use it and stay exact: one
// range per sequence (1 item per compute unit, ranges of at least 512 keys) and as many ranges
// as 16-key ranges allow (1024 items per compute unit).
Test(tuning, imported_decode_split_is_used, .timeout = 300) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_context();
    double err0 = decode_error(ctx);
    static const size_t splits[][2] = {{1, 512}, {1024, 16}};
    for (size_t i = 0; i < 2; ++i) {
        char text[128];
        snprintf(text, sizeof text, "\"DecodeSplit\": {\"ITEMS_PER_CU\": %zu, \"MIN_KEYS\": %zu}",
                 splits[i][0], splits[i][1]);
        char *json = own_json(&f, text);
        cr_assert_eq(clmha_context_tuning_import(ctx, json), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        free(json);
        char *out = export_text(ctx);
        cr_assert_not_null(out);
        cr_expect_eq(param(out, "DecodeSplit", "ITEMS_PER_CU"), (long)splits[i][0], "%s", out);
        cr_expect_eq(param(out, "DecodeSplit", "MIN_KEYS"), (long)splits[i][1], "%s", out);
        free(out);
        double err = decode_error(ctx);
        fprintf(stderr, "tuning: decode split %zu/%zu: max error %.2e (default split %.2e)\n",
                splits[i][0], splits[i][1], err, err0);
        cr_expect_leq(err, 2e-5, "decode split %zu: error %g", i, err);
    }
    cr_expect_leq(err0, 2e-5, "default split: error %g", err0);
    clmha_context_release(ctx);
    teardown(&f);
}

// Decode splits outside the checked ranges, or incomplete, are refused and not applied.
Test(tuning, invalid_decode_split_is_refused, .timeout = 300) {
    fixture f;
    setup(&f);
    clmha_context *ctx = make_context();
    static const char *const bad[][2] = {
        {"\"DecodeSplit\": {\"ITEMS_PER_CU\": 0, \"MIN_KEYS\": 64}", "ITEMS_PER_CU"},
        {"\"DecodeSplit\": {\"ITEMS_PER_CU\": 4097, \"MIN_KEYS\": 64}", "ITEMS_PER_CU"},
        {"\"DecodeSplit\": {\"ITEMS_PER_CU\": 8, \"MIN_KEYS\": 0}", "MIN_KEYS"},
        {"\"DecodeSplit\": {\"ITEMS_PER_CU\": 8, \"MIN_KEYS\": 65537}", "MIN_KEYS"},
        {"\"DecodeSplit\": {\"ITEMS_PER_CU\": 8}", "lacks parameter"},
        {"\"DecodeSplit\": {\"ITEMS_PER_CU\": 8.5, \"MIN_KEYS\": 64}", "ITEMS_PER_CU"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
        char *json = own_json(&f, bad[i][0]);
        cr_expect_eq(clmha_context_tuning_import(ctx, json), CLMHA_INVALID_FILE, "%s",
                     bad[i][0]);
        const char *why = clmha_context_last_error(ctx);
        cr_expect(strstr(why, bad[i][1]) != NULL, "%s: '%s'", bad[i][0], why);
        free(json);
    }
    cr_expect_null(export_text(ctx), "nothing refused was applied");
    clmha_context_release(ctx);
    teardown(&f);
}
