#define _POSIX_C_SOURCE 200809L
// The sized structs of the ABI (docs/abi.md): every struct that crosses the API starts with
// struct_size, and the library reads and writes only the bytes that struct_size covers.
//   - struct_size 0, or below the struct's required fields: CLMHA_INVALID_ARGUMENT, with a message
//     that says what to set;
//   - an older, shorter struct works like the zeroed full struct, whatever lies past it;
//   - a newer, larger struct is accepted with a zero tail and refused (CLMHA_UNSUPPORTED) when
//     the tail sets a field this library does not know;
//   - structs the library fills (device info, tune report, layer desc) get no byte past
//     struct_size.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { E = 8, H = 2, L = 3, N = 2 };
#define GARBAGE 0xA5  // bytes past a short struct_size: refused or crashing if they were read
#define CANARY 0x5C   // bytes past a short struct_size that the library must not write
#define SHORT_OF(type, field) offsetof(type, field)  // a struct_size that stops before field

// A struct built against a "newer header": the library's struct, then fields it does not know.
typedef struct desc_next {
    clmha_layer_desc d;
    unsigned char future[32];
} desc_next;
typedef struct args_next {
    clmha_forward_args a;
    unsigned char future[32];
} args_next;
typedef struct params_next {
    clmha_reference_params p;
    unsigned char future[32];
} params_next;
typedef struct options_next {
    clmha_tune_options o;
    unsigned char future[32];
} options_next;

static float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E], x[L * N * E];

static void fill_data(void) {
    uint32_t s = 12345;
    float *arrays[] = {w_in, b_in, w_out, b_out, x};
    size_t counts[] = {3 * E * E, 3 * E, E * E, E, L * N * E};
    for (int a = 0; a < 5; ++a)
        for (size_t i = 0; i < counts[a]; ++i) {
            s = s * 1664525u + 1013904223u;
            arrays[a][i] = (float)(s >> 8) / (float)(1u << 23) - 1.0f;
        }
}

static clmha_layer_desc full_desc(void) {
    clmha_layer_desc d = CLMHA_STRUCT_INIT(clmha_layer_desc);
    d.embed_dim = E;
    d.num_heads = H;
    d.bias = true;
    return d;
}

static clmha_reference_params full_params(void) {
    return (clmha_reference_params){.struct_size = sizeof(clmha_reference_params),
                                    .in_proj_weight = w_in,
                                    .in_proj_bias = b_in,
                                    .out_proj_weight = w_out,
                                    .out_proj_bias = b_out};
}

static clmha_forward_args full_args(void) {
    return (clmha_forward_args){.struct_size = sizeof(clmha_forward_args),
                                .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
                                .need_weights = true};
}

// The caller's struct cut at @p size with GARBAGE past it (the library must not read that).
static void cut(void *s, const void *full, size_t full_size, size_t size) {
    memset(s, GARBAGE, full_size);
    memcpy(s, full, size);
    memcpy(s, &size, sizeof size);
}

static bool all_bytes(const void *p, size_t n, unsigned char value) {
    for (size_t i = 0; i < n; ++i)
        if (((const unsigned char *)p)[i] != value) return false;
    return true;
}

// ---- the CPU reference: desc, params and args without a device ---------------------------------

typedef struct ref_result {
    clmha_status st;
    char msg[512];
    double y[L * N * E], w[N * L * L];
} ref_result;

static void reference(const clmha_layer_desc *d, const clmha_reference_params *p,
                      const clmha_forward_args *a, ref_result *r) {
    memset(r, 0, sizeof *r);
    r->st = clmha_reference_forward(d, p, a, r->y, L * N * E, r->w, N * L * L, r->msg,
                                    sizeof r->msg);
}

static void expect_same_result(const ref_result *got, const ref_result *want, const char *what) {
    cr_assert_eq(got->st, CLMHA_SUCCESS, "%s: %s", what, got->msg);
    cr_expect(memcmp(got->y, want->y, sizeof got->y) == 0, "%s: other output", what);
    cr_expect(memcmp(got->w, want->w, sizeof got->w) == 0, "%s: other weights", what);
}

static void expect_refused(const ref_result *r, clmha_status st, const char *text,
                           const char *what) {
    cr_expect_eq(r->st, st, "%s: %s, expected %s (%s)", what, clmha_status_string(r->st),
                 clmha_status_string(st), r->msg);
    cr_expect(strstr(r->msg, text) != NULL, "%s: message \"%s\" lacks \"%s\"", what, r->msg, text);
}

Test(abi, struct_init_sets_the_size_and_zeroes_the_rest) {
    clmha_forward_args a = CLMHA_STRUCT_INIT(clmha_forward_args);
    cr_expect_eq(a.struct_size, sizeof a);
    cr_expect(a.query.ndim == 0 && !a.need_weights && a.impl == CLMHA_IMPL_AUTO);
    clmha_tune_report r = (clmha_tune_report)CLMHA_STRUCT_INIT(clmha_tune_report);
    cr_expect_eq(r.struct_size, sizeof r);
}

Test(abi, reference_desc_sizes) {
    fill_data();
    clmha_layer_desc d = full_desc();
    clmha_reference_params p = full_params();
    clmha_forward_args a = full_args();
    static ref_result want, r;
    reference(&d, &p, &a, &want);
    cr_assert_eq(want.st, CLMHA_SUCCESS, "%s", want.msg);

    d.struct_size = 0;
    reference(&d, &p, &a, &r);
    expect_refused(&r, CLMHA_INVALID_ARGUMENT,
                   "desc->struct_size is 0: set it to sizeof(clmha_layer_desc)", "desc size 0");
    d.struct_size = SHORT_OF(clmha_layer_desc, num_heads);  // without a required field
    reference(&d, &p, &a, &r);
    expect_refused(&r, CLMHA_INVALID_ARGUMENT, "desc->struct_size", "desc too small");
    d.struct_size = 1u << 30;  // not a size
    reference(&d, &p, &a, &r);
    expect_refused(&r, CLMHA_INVALID_ARGUMENT, "desc->struct_size", "desc size 2^30");

    // Older: up to the bools; dropout (past struct_size) holds garbage, an invalid probability.
    clmha_layer_desc full = full_desc(), old;
    cut(&old, &full, sizeof full, SHORT_OF(clmha_layer_desc, dropout));
    cr_assert(!(old.dropout >= 0.0f && old.dropout < 1.0f), "the garbage must be refused if read");
    reference(&old, &p, &a, &r);
    expect_same_result(&r, &want, "older desc");
    // The same older struct without bias: bias (past struct_size) is garbage, read as false.
    cut(&old, &full, sizeof full, SHORT_OF(clmha_layer_desc, bias));
    reference(&old, &p, &a, &r);
    ref_result *no_bias = malloc(sizeof *no_bias);
    clmha_layer_desc nb = full_desc();
    nb.bias = false;
    reference(&nb, &p, &a, no_bias);
    expect_same_result(&r, no_bias, "older desc without bias");
    free(no_bias);

    // Newer: a zero tail is accepted, a set byte refused.
    desc_next big;
    memset(&big, 0, sizeof big);
    big.d = full_desc();
    big.d.struct_size = sizeof big;
    reference(&big.d, &p, &a, &r);
    expect_same_result(&r, &want, "newer desc, zero tail");
    big.future[7] = 1;
    reference(&big.d, &p, &a, &r);
    expect_refused(&r, CLMHA_UNSUPPORTED, "built against a newer clmha", "newer desc, set tail");
    cr_expect(strstr(r.msg, "clmha_layer_desc") != NULL, "%s", r.msg);
}

Test(abi, reference_args_sizes) {
    fill_data();
    clmha_layer_desc d = full_desc();
    clmha_reference_params p = full_params();
    clmha_forward_args a = full_args();
    static ref_result want, r;
    reference(&d, &p, &a, &want);
    cr_assert_eq(want.st, CLMHA_SUCCESS, "%s", want.msg);

    a.struct_size = 0;
    reference(&d, &p, &a, &r);
    expect_refused(&r, CLMHA_INVALID_ARGUMENT,
                   "args->struct_size is 0: set it to sizeof(clmha_forward_args)", "args size 0");
    a.struct_size = SHORT_OF(clmha_forward_args, query) + 8;  // half a query
    reference(&d, &p, &a, &r);
    expect_refused(&r, CLMHA_INVALID_ARGUMENT, "args->struct_size", "args too small");

    // Older: everything but impl; impl (past struct_size) is garbage, an invalid core.
    clmha_forward_args full = full_args(), old;
    cut(&old, &full, sizeof full, SHORT_OF(clmha_forward_args, impl));
    reference(&d, &p, &old, &r);
    expect_same_result(&r, &want, "older args");
    // Older still: up to the masks; is_causal and need_weights are garbage (non-zero bytes).
    cut(&old, &full, sizeof full, SHORT_OF(clmha_forward_args, is_causal));
    double y[L * N * E];
    char msg[256];
    cr_assert_eq(clmha_reference_forward(&d, &p, &old, y, L * N * E, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "args up to the masks: need_weights must read as false: %s",
                 msg);
    cr_expect(memcmp(y, want.y, sizeof y) == 0, "is_causal must read as false");

    args_next big;
    memset(&big, 0, sizeof big);
    big.a = full_args();
    big.a.struct_size = sizeof big;
    reference(&d, &p, &big.a, &r);
    expect_same_result(&r, &want, "newer args, zero tail");
    big.future[31] = 0x80;
    reference(&d, &p, &big.a, &r);
    expect_refused(&r, CLMHA_UNSUPPORTED, "built against a newer clmha", "newer args, set tail");
}

Test(abi, reference_params_sizes) {
    fill_data();
    clmha_layer_desc d = full_desc();
    clmha_reference_params p = full_params();
    clmha_forward_args a = full_args();
    static ref_result want, r;
    reference(&d, &p, &a, &want);
    cr_assert_eq(want.st, CLMHA_SUCCESS, "%s", want.msg);

    p.struct_size = 0;
    reference(&d, &p, &a, &r);
    expect_refused(&r, CLMHA_INVALID_ARGUMENT,
                   "params->struct_size is 0: set it to sizeof(clmha_reference_params)",
                   "params size 0");
    p.struct_size = SHORT_OF(clmha_reference_params, out_proj_weight);
    reference(&d, &p, &a, &r);
    expect_refused(&r, CLMHA_INVALID_ARGUMENT, "params->struct_size", "params too small");

    // Older: up to out_proj_bias; bias_k and bias_v (past struct_size) are garbage pointers,
    // which this layer (no add_bias_kv) would not read anyway. Same result.
    clmha_reference_params full = full_params(), old;
    cut(&old, &full, sizeof full, SHORT_OF(clmha_reference_params, bias_k));
    reference(&d, &old, &a, &r);
    expect_same_result(&r, &want, "older params");
    // A struct_size that stops before out_proj_bias: the valid pointer past it is not read, so
    // the layer's bias lacks it.
    old = full_params();
    old.struct_size = SHORT_OF(clmha_reference_params, out_proj_bias);
    reference(&d, &old, &a, &r);
    expect_refused(&r, CLMHA_INVALID_ARGUMENT, "out_proj_bias", "params without out_proj_bias");

    params_next big;
    memset(&big, 0, sizeof big);
    big.p = full_params();
    big.p.struct_size = sizeof big;
    reference(&d, &big.p, &a, &r);
    expect_same_result(&r, &want, "newer params, zero tail");
    big.future[0] = 1;
    reference(&d, &big.p, &a, &r);
    expect_refused(&r, CLMHA_UNSUPPORTED, "built against a newer clmha", "newer params, set tail");
}

// ---- a device: layers, forward calls, device queries -------------------------------------------

static clmha_context *open_context(void) {
    clmha_context *ctx = NULL;
    clmha_status st = clmha_context_create_from_env(&ctx);
    if (st == CLMHA_DEVICE_NOT_FOUND)
        cr_skip_test("no OpenCL device: %s", clmha_last_create_error());
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_last_create_error());
    return ctx;
}

static clmha_layer *make_layer(clmha_context *ctx, const clmha_layer_desc *d) {
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, d), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", b_out, E), 0);
    return layer;
}

static void expect_ctx_error(clmha_context *ctx, clmha_status got, clmha_status want,
                             const char *text, const char *what) {
    const char *msg = clmha_context_last_error(ctx);
    cr_expect_eq(got, want, "%s: %s, expected %s (%s)", what, clmha_status_string(got),
                 clmha_status_string(want), msg);
    cr_expect(strstr(msg, text) != NULL, "%s: message \"%s\" lacks \"%s\"", what, msg, text);
}

Test(abi, layer_create_and_get_desc_sizes, .timeout = 300) {
    fill_data();
    clmha_context *ctx = open_context();
    clmha_layer *layer = (clmha_layer *)0x1;
    clmha_layer_desc d = full_desc();
    d.struct_size = 0;
    expect_ctx_error(ctx, clmha_layer_create(&layer, ctx, &d), CLMHA_INVALID_ARGUMENT,
                     "desc->struct_size is 0: set it to sizeof(clmha_layer_desc)", "size 0");
    cr_expect_null(layer);
    d.struct_size = SHORT_OF(clmha_layer_desc, num_heads);
    expect_ctx_error(ctx, clmha_layer_create(&layer, ctx, &d), CLMHA_INVALID_ARGUMENT,
                     "desc->struct_size", "too small");
    desc_next big;
    memset(&big, 0, sizeof big);
    big.d = full_desc();
    big.d.struct_size = sizeof big;
    big.future[3] = 9;
    expect_ctx_error(ctx, clmha_layer_create(&layer, ctx, &big.d), CLMHA_UNSUPPORTED,
                     "built against a newer clmha", "newer, set tail");
    big.future[3] = 0;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &big.d), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clmha_layer_release(layer);

    // Older: dropout past struct_size is garbage; the layer gets dropout 0.
    clmha_layer_desc full = full_desc(), old;
    cut(&old, &full, sizeof full, SHORT_OF(clmha_layer_desc, dropout));
    layer = make_layer(ctx, &old);

    // get_desc writes struct_size bytes, not one more.
    unsigned char buf[sizeof(clmha_layer_desc) + 16];
    memset(buf, CANARY, sizeof buf);
    size_t short_size = SHORT_OF(clmha_layer_desc, bias);
    memcpy(buf, &short_size, sizeof short_size);
    cr_assert_eq(clmha_layer_get_desc(layer, (clmha_layer_desc *)buf), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clmha_layer_desc got;
    memcpy(&got, buf, short_size);
    cr_expect_eq(got.struct_size, short_size, "struct_size keeps the caller's value");
    cr_expect(got.embed_dim == E && got.num_heads == H && got.kdim == E && got.vdim == E);
    cr_expect(all_bytes(buf + short_size, sizeof buf - short_size, CANARY),
              "clmha_layer_get_desc wrote past struct_size");
    // The full struct: dropout 0 (it was past the creating struct's size).
    clmha_layer_desc all = CLMHA_STRUCT_INIT(clmha_layer_desc);
    cr_assert_eq(clmha_layer_get_desc(layer, &all), CLMHA_SUCCESS);
    cr_expect(all.bias && all.dropout == 0.0f && !all.add_bias_kv && !all.batch_first);
    // A newer caller's struct: the tail up to its struct_size is zeroed, nothing past it.
    memset(buf, CANARY, sizeof buf);
    size_t next_size = sizeof(clmha_layer_desc) + 8;
    memcpy(buf, &next_size, sizeof next_size);
    cr_assert_eq(clmha_layer_get_desc(layer, (clmha_layer_desc *)buf), CLMHA_SUCCESS);
    cr_expect(all_bytes(buf + sizeof(clmha_layer_desc), 8, 0), "the unknown tail is zeroed");
    cr_expect(all_bytes(buf + next_size, sizeof buf - next_size, CANARY),
              "clmha_layer_get_desc wrote past struct_size");
    all.struct_size = 0;
    expect_ctx_error(ctx, clmha_layer_get_desc(layer, &all), CLMHA_INVALID_ARGUMENT,
                     "desc->struct_size is 0", "get_desc size 0");
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

Test(abi, forward_args_sizes, .timeout = 300) {
    fill_data();
    clmha_context *ctx = open_context();
    clmha_layer_desc d = full_desc();
    clmha_layer *layer = make_layer(ctx, &d);
    static float y_want[L * N * E], w_want[N * L * L], y[L * N * E], w[N * L * L];
    clmha_forward_args full = full_args();
    cr_assert_eq(clmha_layer_forward_host(layer, &full, y_want, L * N * E, w_want, N * L * L),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));

    // Size 0 and too small, in each entry point that reads clmha_forward_args.
    clmha_forward_args a = full_args();
    a.struct_size = 0;
    const char *zero = "args->struct_size is 0: set it to sizeof(clmha_forward_args)";
    expect_ctx_error(ctx, clmha_layer_forward_host(layer, &a, y, L * N * E, w, N * L * L),
                     CLMHA_INVALID_ARGUMENT, zero, "forward_host size 0");
    expect_ctx_error(ctx, clmha_layer_output_counts(layer, &a, NULL, NULL),
                     CLMHA_INVALID_ARGUMENT, zero, "output_counts size 0");
    cl_event ev = (cl_event)0x1;
    expect_ctx_error(ctx, clmha_layer_forward(layer, &a, NULL, 0, NULL, 0, 0, NULL, &ev),
                     CLMHA_INVALID_ARGUMENT, zero, "forward size 0");
    cr_expect_null(ev);
    a.struct_size = sizeof(size_t);
    expect_ctx_error(ctx, clmha_layer_output_counts(layer, &a, NULL, NULL),
                     CLMHA_INVALID_ARGUMENT, "args->struct_size", "output_counts too small");
    expect_ctx_error(ctx, clmha_layer_forward(layer, &a, NULL, 0, NULL, 0, 0, NULL, NULL),
                     CLMHA_INVALID_ARGUMENT, "args->struct_size", "forward too small");

    // Older (no impl; garbage there): the same output as the zeroed full struct.
    clmha_forward_args old;
    cut(&old, &full, sizeof full, SHORT_OF(clmha_forward_args, impl));
    size_t out_count = 0, w_count = 0;
    cr_assert_eq(clmha_layer_output_counts(layer, &old, &out_count, &w_count), CLMHA_SUCCESS,
                 "%s", clmha_context_last_error(ctx));
    cr_expect(out_count == L * N * E && w_count == N * L * L);
    cr_assert_eq(clmha_layer_forward_host(layer, &old, y, L * N * E, w, N * L * L),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect(memcmp(y, y_want, sizeof y) == 0 && memcmp(w, w_want, sizeof w) == 0,
              "older args: another result");
    // Up to the masks: need_weights (garbage past it) reads as false, so no weights.
    cut(&old, &full, sizeof full, SHORT_OF(clmha_forward_args, is_causal));
    cr_assert_eq(clmha_layer_output_counts(layer, &old, NULL, &w_count), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_expect_eq(w_count, 0);

    // Newer: zero tail accepted, set tail refused.
    args_next big;
    memset(&big, 0, sizeof big);
    big.a = full_args();
    big.a.struct_size = sizeof big;
    cr_assert_eq(clmha_layer_forward_host(layer, &big.a, y, L * N * E, w, N * L * L),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect(memcmp(y, y_want, sizeof y) == 0, "newer args: another result");
    big.future[16] = 2;
    expect_ctx_error(ctx, clmha_layer_forward_host(layer, &big.a, y, L * N * E, w, N * L * L),
                     CLMHA_UNSUPPORTED, "built against a newer clmha", "newer, set tail");
    expect_ctx_error(ctx, clmha_layer_output_counts(layer, &big.a, NULL, NULL), CLMHA_UNSUPPORTED,
                     "clmha_forward_args", "output_counts newer, set tail");
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// The user core is told the size of the clmha_core_args it gets.
static size_t core_saw_size;
static clmha_status size_core(const clmha_core_args *args, void *user_data) {
    (void)user_data;
    core_saw_size = args->struct_size;
    return CLMHA_SUCCESS;
}

Test(abi, core_args_carry_their_size, .timeout = 300) {
    fill_data();
    clmha_context *ctx = open_context();
    clmha_layer_desc d = full_desc();
    clmha_layer *layer = make_layer(ctx, &d);
    cr_assert_eq(clmha_layer_set_attention(layer, size_core, NULL), CLMHA_SUCCESS);
    clmha_forward_args a = full_args();
    a.need_weights = false;
    static float y[L * N * E];
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, L * N * E, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_expect_eq(core_saw_size, sizeof(clmha_core_args));
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

Test(abi, device_info_sizes) {
    size_t count = 0;
    cr_assert_eq(clmha_device_count(&count), CLMHA_SUCCESS);
    if (count == 0) cr_skip_test("no OpenCL device");
    clmha_device_info full = CLMHA_STRUCT_INIT(clmha_device_info);
    cr_assert_eq(clmha_device_describe(0, &full), CLMHA_SUCCESS, "%s", clmha_last_create_error());
    cr_assert_not_null(full.device);
    cr_expect_str_eq(full.spec, "0:0");

    clmha_device_info info = {.struct_size = 0};
    cr_expect_eq(clmha_device_describe(0, &info), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_last_create_error(),
                     "info->struct_size is 0: set it to sizeof(clmha_device_info)") != NULL,
              "%s", clmha_last_create_error());
    char msg[256] = "";
    cr_expect_eq(clmha_device_select(NULL, &info, msg, sizeof msg), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(msg, "out->struct_size is 0") != NULL, "%s", msg);
    info.struct_size = SHORT_OF(clmha_device_info, device);  // without the device handle
    cr_expect_eq(clmha_device_describe(0, &info), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_device_select(NULL, &info, NULL, 0), CLMHA_INVALID_ARGUMENT);
    info.struct_size = sizeof info;
    cr_expect_eq(clmha_device_describe(count, &info), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_last_create_error(), "devices") != NULL, "%s",
              clmha_last_create_error());

    // Short (an older header without the names and what follows): nothing past struct_size.
    unsigned char buf[sizeof(clmha_device_info) + 64];
    size_t short_size = SHORT_OF(clmha_device_info, type);
    memset(buf, CANARY, sizeof buf);
    memcpy(buf, &short_size, sizeof short_size);
    cr_assert_eq(clmha_device_describe(0, (clmha_device_info *)buf), CLMHA_SUCCESS);
    clmha_device_info got;
    memcpy(&got, buf, short_size);
    cr_expect_eq(got.struct_size, short_size);
    cr_expect(got.device == full.device && got.platform == full.platform);
    cr_expect(all_bytes(buf + short_size, sizeof buf - short_size, CANARY),
              "clmha_device_describe wrote past struct_size");
    memset(buf, CANARY, sizeof buf);
    memcpy(buf, &short_size, sizeof short_size);
    cr_assert_eq(clmha_device_select(full.spec, (clmha_device_info *)buf, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    cr_expect(all_bytes(buf + short_size, sizeof buf - short_size, CANARY),
              "clmha_device_select wrote past struct_size");
    cr_expect_str_eq(clmha_device_note((const clmha_device_info *)buf), "",
                     "a short info has no names, so no note");

    // Larger (a newer header): the unknown tail up to struct_size is zeroed, nothing after it.
    size_t next_size = sizeof(clmha_device_info) + 24;
    memset(buf, CANARY, sizeof buf);
    memcpy(buf, &next_size, sizeof next_size);
    cr_assert_eq(clmha_device_describe(0, (clmha_device_info *)buf), CLMHA_SUCCESS);
    memcpy(&got, buf, sizeof got);
    cr_expect_eq(got.struct_size, next_size);
    cr_expect_str_eq(got.device_name, full.device_name);
    cr_expect(all_bytes(buf + sizeof got, 24, 0), "the unknown tail is zeroed");
    cr_expect(all_bytes(buf + next_size, sizeof buf - next_size, CANARY),
              "clmha_device_describe wrote past struct_size");
    // ... and clmha_device_note() reads it (zero tail) but not one with a set tail.
    cr_expect_str_eq(clmha_device_note((const clmha_device_info *)buf),
                     clmha_device_note(&full));
}

// ---- tuning: options in, report out ------------------------------------------------------------

Test(abi, tune_sizes_refused_before_any_work, .timeout = 120) {
    clmha_context *ctx = open_context();
    clmha_tune_options o = CLMHA_STRUCT_INIT(clmha_tune_options);
    clmha_tune_report rep = CLMHA_STRUCT_INIT(clmha_tune_report);
    o.struct_size = 0;
    expect_ctx_error(ctx, clmha_context_tune(ctx, &o, &rep), CLMHA_INVALID_ARGUMENT,
                     "options->struct_size is 0: set it to sizeof(clmha_tune_options)",
                     "options size 0");
    o.struct_size = 4;
    expect_ctx_error(ctx, clmha_context_tune(ctx, &o, &rep), CLMHA_INVALID_ARGUMENT,
                     "options->struct_size", "options too small");
    options_next big;
    memset(&big, 0, sizeof big);
    big.o.struct_size = sizeof big;
    big.future[1] = 1;
    expect_ctx_error(ctx, clmha_context_tune(ctx, &big.o, &rep), CLMHA_UNSUPPORTED,
                     "built against a newer clmha", "options newer, set tail");
    cr_expect(strstr(clmha_context_last_error(ctx), "clmha_tune_options") != NULL);
    rep.struct_size = 0;
    expect_ctx_error(ctx, clmha_context_tune(ctx, NULL, &rep), CLMHA_INVALID_ARGUMENT,
                     "report->struct_size is 0: set it to sizeof(clmha_tune_report)",
                     "report size 0");
    rep.struct_size = SHORT_OF(clmha_tune_report, default_gflops);
    expect_ctx_error(ctx, clmha_context_tune(ctx, NULL, &rep), CLMHA_INVALID_ARGUMENT,
                     "report->struct_size", "report too small");
    clmha_context_release(ctx);
}

static void no_progress(double fraction, const char *message, void *user_data) {
    (void)fraction, (void)message, (void)user_data;
    cr_assert_fail("the progress callback lies past options->struct_size: never called");
}

// One short run: older options (the callback and no_store past struct_size hold garbage that
// must not be used) and a short report (nothing written past it).
Test(abi, tune_older_options_and_short_report, .timeout = 900) {
    char dir[] = "/tmp/clmha-abi-tuning-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    setenv("CLMHA_TUNING_DIR", dir, 1);
    clmha_context *ctx = open_context();
    // CLBlast's GEMMs, so that the GEMM figures at the report's start are timed (a host-BLAS
    // context skips them).
    cr_assert_eq(clmha_context_set_gemm(ctx, CLMHA_GEMM_CLBLAST), CLMHA_SUCCESS);
    clmha_tune_shape shape = {2, 16, 32, 4};
    clmha_tune_options full = {.struct_size = sizeof full, .budget_seconds = 0.01,
                               .shapes = &shape, .num_shapes = 1, .progress = no_progress};
    clmha_tune_options old;
    cut(&old, &full, sizeof full, SHORT_OF(clmha_tune_options, progress));
    old.progress = no_progress;  // garbage of the worst kind: a callable that must not be called
    unsigned char buf[sizeof(clmha_tune_report) + 16];
    size_t short_size = SHORT_OF(clmha_tune_report, default_fused_gflops);
    memset(buf, CANARY, sizeof buf);
    memcpy(buf, &short_size, sizeof short_size);
    cr_assert_eq(clmha_context_tune(ctx, &old, (clmha_tune_report *)buf), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clmha_tune_report got;
    memcpy(&got, buf, short_size);
    cr_expect_eq(got.struct_size, short_size);
    cr_expect_gt(got.default_gflops, 0, "the fields within struct_size are written");
    cr_expect(all_bytes(buf + short_size, sizeof buf - short_size, CANARY),
              "clmha_context_tune wrote past report->struct_size");
    clmha_context_release(ctx);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_expect_eq(system(cmd), 0);
}

// ---- attention as a function: clmha_attention_args and clmha_attention_backward_args ----------

enum { AH = 2, AL = 3, AS = 4, AD = 4 };  // one batch item: q (AH, AL, AD), k and v (AH, AS, AD)
static float aq[AH * AL * AD], ak[AH * AS * AD], av[AH * AS * AD], ag[AH * AL * AD];

static clmha_attention_args full_attention_args(void) {
    uint32_t s = 777;
    float *arrays[] = {aq, ak, av, ag};
    size_t counts[] = {AH * AL * AD, AH * AS * AD, AH * AS * AD, AH * AL * AD};
    for (int a = 0; a < 4; ++a)
        for (size_t i = 0; i < counts[a]; ++i) {
            s = s * 1664525u + 1013904223u;
            arrays[a][i] = (float)(s >> 8) / (float)(1u << 23) - 1.0f;
        }
    return (clmha_attention_args){.struct_size = sizeof(clmha_attention_args),
                                  .query = {.ndim = 3, .shape = {AH, AL, AD}, .data = aq},
                                  .key = {.ndim = 3, .shape = {AH, AS, AD}, .data = ak},
                                  .value = {.ndim = 3, .shape = {AH, AS, AD}, .data = av}};
}

typedef struct attention_args_next {
    clmha_attention_args a;
    unsigned char future[32];
} attention_args_next;

typedef struct attention_result {
    clmha_status st;
    char msg[512];
    double y[AH * AL * AD];
} attention_result;

static void reference_attention(const clmha_attention_args *a, attention_result *r) {
    memset(r, 0, sizeof *r);
    r->st = clmha_reference_attention(a, r->y, AH * AL * AD, NULL, 0, NULL, 0, r->msg,
                                      sizeof r->msg);
}

Test(abi, attention_args_sizes) {
    clmha_attention_args a = full_attention_args();
    static attention_result want, r;
    reference_attention(&a, &want);
    cr_assert_eq(want.st, CLMHA_SUCCESS, "%s", want.msg);

    a.struct_size = 0;
    reference_attention(&a, &r);
    cr_expect_eq(r.st, CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(r.msg, "args->struct_size is 0: set it to sizeof(clmha_attention_args)"),
              "%s", r.msg);
    a.struct_size = SHORT_OF(clmha_attention_args, value) + 8;  // part of the value
    reference_attention(&a, &r);
    cr_expect_eq(r.st, CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(r.msg, "args->struct_size"), "%s", r.msg);

    // Older: only the tensors; the layout, mask, is_causal, scale, dropout, GQA and impl past
    // struct_size are garbage bytes, read as zeros (NHLD, no mask, scale 1/sqrt(D)).
    clmha_attention_args full = full_attention_args(), old;
    cut(&old, &full, sizeof full, SHORT_OF(clmha_attention_args, layout));
    reference_attention(&old, &r);
    cr_assert_eq(r.st, CLMHA_SUCCESS, "older args: %s", r.msg);
    cr_expect(memcmp(r.y, want.y, sizeof r.y) == 0, "older args: other output");

    attention_args_next big;
    memset(&big, 0, sizeof big);
    big.a = full_attention_args();
    big.a.struct_size = sizeof big;
    reference_attention(&big.a, &r);
    cr_assert_eq(r.st, CLMHA_SUCCESS, "newer args, zero tail: %s", r.msg);
    cr_expect(memcmp(r.y, want.y, sizeof r.y) == 0, "newer args, zero tail: other output");
    big.future[5] = 1;
    reference_attention(&big.a, &r);
    cr_expect_eq(r.st, CLMHA_UNSUPPORTED);
    cr_expect(strstr(r.msg, "built against a newer clmha"), "%s", r.msg);
}

// The device call reads the same sizes; the backward's struct: an older one (through the
// gradients' offsets, without impl and the mask gradient) gives the full struct's gradients.
Test(abi, attention_backward_args_sizes, .timeout = 300) {
    clmha_context *ctx = open_context();
    cl_context cl = clmha_context_cl_context(ctx);
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    clmha_attention_args a = full_attention_args();
    size_t nq = AH * AL * AD, nk = AH * AS * AD;
    cl_int err;
    cl_mem q = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, nq * 4, aq, &err);
    cl_mem k = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, nk * 4, ak, &err);
    cl_mem v = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, nk * 4, av, &err);
    cl_mem g = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, nq * 4, ag, &err);
    cl_mem out = clCreateBuffer(cl, CL_MEM_READ_WRITE, nq * 4, NULL, &err);
    cl_mem grads[2][3];
    for (int t = 0; t < 2; ++t)
        for (int i = 0; i < 3; ++i)
            grads[t][i] = clCreateBuffer(cl, CL_MEM_READ_WRITE, (i ? nk : nq) * 4, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    a.query.buffer = q, a.key.buffer = k, a.value.buffer = v;
    a.impl = CLMHA_IMPL_UNFUSED;

    attention_args_next big;
    memset(&big, 0, sizeof big);
    big.a = a;
    big.a.struct_size = sizeof big;
    big.future[0] = 3;
    expect_ctx_error(ctx, clmha_attention_forward(ctx, &big.a, out, 0, NULL, 0, NULL, 0, 0, NULL,
                                                  NULL),
                     CLMHA_UNSUPPORTED, "built against a newer clmha", "forward, newer tail");
    a.struct_size = 0;
    expect_ctx_error(ctx, clmha_attention_forward(ctx, &a, out, 0, NULL, 0, NULL, 0, 0, NULL,
                                                  NULL),
                     CLMHA_INVALID_ARGUMENT, "args->struct_size is 0", "forward, size 0");
    a.struct_size = sizeof a;
    cr_assert_eq(clmha_attention_forward(ctx, &a, out, 0, NULL, 0, NULL, 0, 0, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));

    clmha_attention_backward_args full = {.struct_size = sizeof full, .forward = &a,
                                          .output = out, .grad_output = g,
                                          .grad_query = grads[0][0], .grad_key = grads[0][1],
                                          .grad_value = grads[0][2]};
    clmha_attention_backward_args b = full;
    b.struct_size = 0;
    expect_ctx_error(ctx, clmha_attention_backward(ctx, &b, 0, NULL, NULL),
                     CLMHA_INVALID_ARGUMENT,
                     "args->struct_size is 0: set it to sizeof(clmha_attention_backward_args)",
                     "backward, size 0");
    b.struct_size = SHORT_OF(clmha_attention_backward_args, grad_value_offset);
    expect_ctx_error(ctx, clmha_attention_backward(ctx, &b, 0, NULL, NULL),
                     CLMHA_INVALID_ARGUMENT, "args->struct_size", "backward, too small");
    cr_assert_eq(clmha_attention_backward(ctx, &full, 0, NULL, NULL), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    full.grad_query = grads[1][0], full.grad_key = grads[1][1], full.grad_value = grads[1][2];
    cut(&b, &full, sizeof full, SHORT_OF(clmha_attention_backward_args, impl));
    cr_assert_eq(clmha_attention_backward(ctx, &b, 0, NULL, NULL), CLMHA_SUCCESS,
                 "older backward args: %s", clmha_context_last_error(ctx));
    clFinish(queue);
    for (int i = 0; i < 3; ++i) {
        size_t n = i ? nk : nq;
        float got[2][AH * AS * AD];
        for (int t = 0; t < 2; ++t)
            clEnqueueReadBuffer(queue, grads[t][i], CL_TRUE, 0, n * 4, got[t], 0, NULL, NULL);
        cr_expect(memcmp(got[0], got[1], n * 4) == 0, "gradient %d differs with older args", i);
        double sum = 0;
        for (size_t j = 0; j < n; ++j) sum += fabs(got[0][j]);
        cr_expect_gt(sum, 0.0, "gradient %d is all zeros", i);
    }
    for (int t = 0; t < 2; ++t)
        for (int i = 0; i < 3; ++i) clReleaseMemObject(grads[t][i]);
    clReleaseMemObject(q), clReleaseMemObject(k), clReleaseMemObject(v);
    clReleaseMemObject(g), clReleaseMemObject(out);
    clmha_context_release(ctx);
}
