// `clmha run`: a layer file (.safetensors) on .npy inputs, .npy outputs.
#define _POSIX_C_SOURCE 200809L

#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "base/file_read.h"
#include "base/half.h"
#include "base/message.h"
#include "grads.h"
#include "npy.h"
#include "outputs.h"

// The help text, in parts (ISO C compilers need support string literals of 4095 bytes only).
static const char *const usage_run[] = {
    "usage: clmha run --layer F.safetensors --query Q.npy [options]\n"
    "\n"
    "Runs torch.nn.MultiheadAttention's forward pass (eval mode unless --training) with the\n"
    "layer in F.safetensors (state_dict() names; metadata num_heads, batch_first,\n"
    "add_zero_attn, dropout) on the arrays of .npy files, and optionally its backward pass.\n"
    "Shapes and masks are PyTorch's: query (L, N, E), or (N, L, E) when the layer file says\n"
    "batch_first, or (L, E) unbatched.\n"
    "\n"
    "inputs:\n"
    "  --layer F.safetensors     the layer (required): nn.MultiheadAttention's state_dict()\n"
    "                            names, continuiti's MultiHeadAttention (query_project,\n"
    "                            key_project, value_project, out_project) or the classic\n"
    "                            w_q, w_k, w_v, w_concat module (.weight and .bias each);\n"
    "                            the last two are batch first unless the metadata says\n"
    "                            otherwise. A torch.save() file (.pt) is refused with how to\n"
    "                            convert it\n"
    "  --prefix P                only the tensors named P.<name> (a whole model's\n"
    "                            state_dict, e.g. encoder.layers.0.self_attn); the others\n"
    "                            are ignored. A prefix that matches nothing is refused with\n"
    "                            the prefixes the file has\n"
    "  --num-heads H             the number of heads, for files without num_heads metadata\n"
    "                            (a model's or a seed module's state_dict); must agree with\n"
    "                            the metadata if it has one\n"
    "  --batch-first yes|no      override the layer's batch_first (default: the metadata's,\n"
    "                            else yes for the seed modules' names, no for PyTorch's)\n"
    "  --query Q.npy             query, float16, float32 or float64 (required)\n"
    "  --key K.npy               key (S, N, kdim); default: the query (self-attention)\n"
    "  --value V.npy             value (S, N, vdim); default: the key\n"
    "  --key-padding-mask M.npy  (N, S), or (S) unbatched\n"
    "  --attn-mask A.npy         (L, S), or (N*num_heads, L, S); unbatched (num_heads, L, S)\n"
    "                            bool/uint8 masks: true (non-zero) = may NOT attend;\n"
    "                            float masks are added to the scores (-inf forbids)\n"
    "  --is-causal               forbid key j > query i (top-left aligned)\n"
    "  --training                apply the layer's dropout (PyTorch's train()), drawn from\n"
    "                            clmha's Philox stream (not PyTorch's generator)\n"
    "  --seed S, --offset O      the dropout stream's key and offset (default 0); need\n"
    "                            --training\n"
    "\n"
    "outputs:\n"
    "  --need-weights            also compute the attention weights\n"
    "  --per-head-weights        weights per head (N, H, L, S') instead of averaged over\n"
    "                            the heads (N, L, S') (average_attn_weights=False);\n"
    "                            implies --need-weights\n"
    "  --output O.npy            write the attention output, shaped like the query: float32,\n"
    "                            float16 with --dtype f16, float64 with --dtype f64 (bf16:\n"
    "                            float32 holding bfloat16 values, as NumPy has no bfloat16)\n"
    "  --weights-output W.npy    write the weights (dtype as --output); implies\n"
    "                            --need-weights\n"
    "                            (unbatched inputs drop N; S' = S + add_bias_kv + add_zero_attn)\n"
    "\n",
    "gradients (the backward pass, after the forward pass with the same inputs and dropout):\n"
    "  --grad-output G.npy       the gradient of the output, in the output's shape\n"
    "  --grad-weights GW.npy     optional: the gradient of the weights, in their shape;\n"
    "                            needs --need-weights (or --per-head-weights)\n"
    "  --grads-dir DIR           an existing folder (it is not created) that receives the\n"
    "                            gradients, float32, in PyTorch's shapes, as <name>.npy:\n"
    "                            query; key and value when given as files of their own (in\n"
    "                            self-attention query.npy holds the whole gradient of the\n"
    "                            query; with --key alone key.npy includes its use as value);\n"
    "                            one file per parameter the layer has, by state_dict name\n"
    "                            (in_proj_weight, or q_proj_weight, k_proj_weight and\n"
    "                            v_proj_weight; in_proj_bias, out_proj.weight, out_proj.bias,\n"
    "                            bias_k, bias_v (1, 1, E)); attn_mask and key_padding_mask\n"
    "                            for float masks (boolean masks have no gradient). Other files\n"
    "                            in DIR are left alone. --grad-output and --grads-dir go\n"
    "                            together. Fully masked query rows get zero gradients.\n"
    "\n"
    "  Files are written only after the forward (and backward) pass succeeded, each whole or\n"
    "  not at all, and all of them or none (outputs and gradients alike): a failed run\n"
    "  leaves every file as it was. An output may be a new file or an existing regular file\n"
    "  (not a folder, FIFO, device or symbolic link), and neither an input nor another\n"
    "  output. Inputs must be regular files.\n"
    "  NaN/Inf in the results (from NaN/Inf inputs or parameters, as in PyTorch) give a\n"
    "  warning on stderr naming the inputs that hold them; the exit status stays 0.\n"
    "  A query row whose every key is masked gets zero weights (PyTorch gives NaN there).\n"
    "  Results not written to a file are summarised on stdout (shape, first values).\n"
    "\n",
    "incremental decoding:\n"
    "  --decode-chunk C          run the forward pass through a KV cache (clmha_kv_cache), C\n"
    "                            query rows a call, and write the rows together: with\n"
    "                            --is-causal (self-attention only) each call appends its own\n"
    "                            tokens' keys and values and its queries see the cache\n"
    "                            bottom-right aligned; without, the whole key and value go in\n"
    "                            with the first call and the later calls attend only. Either\n"
    "                            way the output is the one-shot forward's. Not with masks,\n"
    "                            weights, --training, gradients, --impl or --dtype f64\n"
    "\n"
    "precision:\n"
    "  --dtype T                 the layer's dtype (PyTorch's dtype=): f32 (default), f64,\n"
    "                            f16 or bf16. The layer file's values and the inputs are\n"
    "                            rounded to it (to nearest even); a 16-bit layer computes in\n"
    "                            float32 and rounds its results once. f64: the layer file's\n"
    "                            and the inputs' float64 values are kept exactly (float16\n"
    "                            and float32 widened), everything is computed in float64 and\n"
    "                            the outputs are float64 files; it needs a device with\n"
    "                            double precision (clmha devices: fp64 yes). Only f32 takes\n"
    "                            gradients (the other dtypes have no backward pass yet)\n"
    "\n"
    "device:\n"
    "  --device SPEC             \"P:D\", gpu, cpu, accelerator or part of a device name\n"
    "                            (see clmha devices); default: $CLMHA_DEVICE, else the first\n"
    "                            GPU, else the first device\n"
    "  --impl auto|fused|unfused the attention core: fused streams key tiles and never\n"
    "                            stores the scores, but cannot give weights; auto (default)\n"
    "                            is fused without weights, else unfused. The backward pass\n"
    "                            uses the same core, except that a float mask's gradient\n"
    "                            needs the unfused one\n"
    "\n"
    "  --help, -h                print this help\n"
    "\n"
    "exit status: 0 success, 1 refused input (bad file, shape mismatch, device error) or\n"
    "stdout not written, 2 usage error. Options take their value as --opt VALUE or --opt=VALUE.\n"};

// One .npy input.
typedef struct input_file {
    const char *flag;  // "--query"
    const char *path;  // NULL when not given
    bool is_mask;      // bool/uint8 allowed
    clmha__npy a;
} input_file;

enum { IN_QUERY, IN_KEY, IN_VALUE, IN_KPM, IN_ATTN, IN_GRAD_OUT, IN_GRAD_W, IN_COUNT };

// Reads one input, float arrays as doubles with @p f64 (a float64 layer's inputs, read
// exactly); reports and returns false when it is refused.
static bool read_input(input_file *in, bool f64) {
    char msg[1024] = "";
    clmha_status st = f64 ? clmha__npy_read_f64(in->path, &in->a, msg, sizeof msg)
                          : clmha__npy_read(in->path, &in->a, msg, sizeof msg);
    if (st != CLMHA_SUCCESS) {
        clmha__cli_report("run", "%s %s: %s", in->flag, in->path,
                          msg[0] ? clmha__cli_without_path(msg, in->path) : "cannot read the file");
        return false;
    }
    if (in->a.ndim == 0 || in->a.ndim > 4) {
        // (No shape beyond "()": clmha__shape_str shows at most 4 sizes.)
        clmha__cli_report("run", "%s %s: a %zu-D array%s; %s takes 1 to 4 dimensions", in->flag,
                          in->path, in->a.ndim, in->a.ndim == 0 ? " ()" : "", in->flag);
        return false;
    }
    if (!in->is_mask && in->a.kind != CLMHA__NPY_FLOAT) {
        clmha__cli_report("run", "%s %s: dtype '%s' is boolean; %s must be float32 or float64",
                          in->flag, in->path, in->a.dtype, in->flag);
        return false;
    }
    return true;
}

static clmha_tensor tensor_of(const clmha__npy *a) {
    clmha_tensor t = {.ndim = a->ndim};
    for (size_t i = 0; i < a->ndim && i < 4; ++i) t.shape[i] = a->shape[i];
    t.data = a->kind == CLMHA__NPY_BOOL ? (const void *)a->u8
             : a->f64                   ? (const void *)a->f64
                                        : (const void *)a->f32;
    return t;
}

static clmha_mask mask_of(const input_file *in) {
    clmha_mask m = {.kind = CLMHA_MASK_NONE};
    if (!in->path) return m;
    m.kind = in->a.kind == CLMHA__NPY_BOOL ? CLMHA_MASK_BOOL_IGNORE : CLMHA_MASK_FLOAT;
    m.tensor = tensor_of(&in->a);
    return m;
}

// The input a library message about query/key/value refers to (NULL: the layer as a whole).
// Key defaults to the query and value to the key, so a message about an input that was not
// given names the input it defaulted to.
static const input_file *input_culprit(const char *msg, const input_file *in, bool batch_first) {
    const input_file *q = &in[IN_QUERY];
    const input_file *k = in[IN_KEY].path ? &in[IN_KEY] : q;
    const input_file *v = in[IN_VALUE].path ? &in[IN_VALUE] : k;
    if (clmha__cli_starts_with(msg, "query")) return q;
    if (clmha__cli_starts_with(msg, "key ") && strstr(msg, " and value ")) return v;
    if (clmha__cli_starts_with(msg, "key ")) return k;
    if (clmha__cli_starts_with(msg, "value ")) return v;
    if (clmha__cli_starts_with(msg, "batch sizes differ")) {
        size_t b = batch_first ? 0 : 1;
        if (q->a.ndim == 3 && k->a.ndim == 3 && k->a.shape[b] != q->a.shape[b]) return k;
        return v;
    }
    return NULL;
}

// Results or inputs: floats, or doubles (a float64 layer's).
typedef struct values {
    const float *f32;
    const double *f64;  // used when set
} values;

static double value_at(values x, size_t i) { return x.f64 ? x.f64[i] : (double)x.f32[i]; }

// "0.123457 -1.5 ... (48 values)".
static void print_values(const char *label, values x, size_t count, size_t ndim,
                         const size_t *shape, const char *note) {
    char s[160];
    printf("%-8s %s%s:", label, clmha__shape_str(s, sizeof s, ndim, shape), note);
    size_t shown = count < 6 ? count : 6;
    for (size_t i = 0; i < shown; ++i) printf(" %.6g", value_at(x, i));
    if (shown < count) printf(" ...");
    printf(" (%zu value%s)\n", count, count == 1 ? "" : "s");
}

static size_t count_nonfinite(values x, size_t count, bool skip_minus_inf) {
    size_t n = 0;
    for (size_t i = 0; i < count; ++i) {
        double v = value_at(x, i);
        n += !isfinite(v) && !(skip_minus_inf && isinf(v) && v < 0);
    }
    return n;
}

// NaN in, NaN out (as in PyTorch, and no scan on the device): when the results hold NaN or Inf,
// one warning line on stderr says so and names the inputs that explain it (NaN/Inf values,
// float64 values beyond float32's range that became inf; -inf in a float mask only forbids).
// The exit status stays 0. @p w has no values without weights.
static void warn_nonfinite(values y, size_t y_count, values w, size_t w_count,
                           const input_file *in, clmha_dtype dtype) {
    bool weights = w.f32 || w.f64;
    size_t bad =
        count_nonfinite(y, y_count, false) + (weights ? count_nonfinite(w, w_count, false) : 0);
    if (!bad) return;
    char why[2048] = "";
    size_t used = 0;
    for (int i = 0; i < IN_COUNT; ++i) {
        const clmha__npy *a = &in[i].a;
        if (!in[i].path || a->kind != CLMHA__NPY_FLOAT) continue;
        size_t n = count_nonfinite((values){a->f32, a->f64}, a->count, in[i].is_mask);
        if (!n || used >= sizeof why) continue;
        int k = snprintf(why + used, sizeof why - used, "%s%s %s holds %zu NaN/Inf value%s",
                         used ? "; " : "", in[i].flag, in[i].path, n, n == 1 ? "" : "s");
        if (k > 0) used += (size_t)k;
        if (a->overflowed && used < sizeof why) {
            k = snprintf(why + used, sizeof why - used,
                         " (%zu float64 value%s beyond float32's range, read as inf)",
                         a->overflowed, a->overflowed == 1 ? "" : "s");
            if (k > 0) used += (size_t)k;
        }
    }
    clmha__cli_report("run",
                      "warning: the results hold %zu NaN/Inf value%s of %zu (%s); NaN/Inf in "
                      "gives NaN/Inf out, as in PyTorch",
                      bad, bad == 1 ? "" : "s", y_count + (weights ? w_count : 0),
                      used ? why
                      : dtype == CLMHA_DTYPE_F64
                          ? "no input holds NaN/Inf: the layer's parameters may, or values "
                            "overflowed float64"
                          : "no input holds NaN/Inf: the layer's parameters may, or values "
                            "overflowed float32");
}


// --seed / --offset: a decimal integer in [0, 2^64).
// Rows t0 .. t0+c-1 of every sequence of @p x, a (T, N, F) array ((N, T, F) batch first),
// copied into (@p to_x false) or out of (@p to_x true) @p chunk, a (c, N, F) array in the same
// layout.
static void chunk_rows(float *x, float *chunk, size_t n, size_t t, size_t f, bool batch_first,
                       size_t t0, size_t c, bool to_x) {
    for (size_t b = 0; b < n; ++b)
        for (size_t i = 0; i < c; ++i) {
            float *big = x + (batch_first ? b * t + t0 + i : (t0 + i) * n + b) * f;
            float *small = chunk + (batch_first ? b * c + i : i * n + b) * f;
            memcpy(to_x ? big : small, to_x ? small : big, f * sizeof *big);
        }
}

// --decode-chunk: the forward call @p args through a KV cache, @p chunk query rows at a time,
// the rows of the output into @p y (as the one-shot forward writes them). Reports a failure.
static bool decode_in_chunks(clmha_layer *layer, const clmha_forward_args *args,
                             const clmha_layer_desc *desc, size_t chunk, float *y) {
    clmha_context *ctx = clmha_layer_context(layer);
    const clmha_tensor *q = &args->query;
    bool batched = q->ndim == 3, bf = batched && desc->batch_first;
    size_t n = batched ? q->shape[bf ? 0 : 1] : 1, l = q->shape[bf ? 1 : 0], e = desc->embed_dim;
    const clmha_tensor *key = args->key.ndim ? &args->key : q;
    size_t s = key->shape[bf ? 1 : 0];
    size_t c = chunk < l ? chunk : l;
    float *qc = malloc(c * n * e * sizeof *qc), *yc = malloc(c * n * e * sizeof *yc);
    clmha_kv_cache *cache = NULL;
    bool ok = false;
    if (!qc || !yc) {
        clmha__cli_report("run", "out of host memory");
        goto done;
    }
    clmha_status st = clmha_kv_cache_create(&cache, layer, n, args->is_causal ? l : s);
    for (size_t t0 = 0; !st && t0 < l; t0 += c) {
        size_t rows = t0 + c < l ? c : l - t0;
        chunk_rows((float *)q->data, qc, n, l, e, bf, t0, rows, false);
        clmha_forward_args a = *args;
        a.kv_cache = cache;
        a.query.data = qc;
        a.query.shape[bf ? 1 : 0] = rows;
        if (!args->is_causal && t0 == 0 && !args->key.ndim) a.key = *q;  // the whole query
        if (!args->is_causal && t0 > 0) {
            a.key = a.value = (clmha_tensor){0};
            a.kv_attend_only = true;
        }
        st = clmha_layer_forward_host(layer, &a, yc, rows * n * e, NULL, 0);
        if (!st) chunk_rows(y, yc, n, l, e, bf, t0, rows, true);
    }
    if (st)
        clmha__cli_report("run", "--decode-chunk %zu: forward pass failed on %s: %s: %s", chunk,
                          clmha_context_device_name(ctx), clmha_status_string(st),
                          clmha_context_last_error(ctx));
    ok = !st;
done:
    clmha_kv_cache_release(cache);
    free(qc);
    free(yc);
    return ok;
}

static bool parse_u64(const char *flag, const char *text, uint64_t *v) {
    *v = 0;
    if (!text) return true;
    char *end = NULL;
    errno = 0;
    unsigned long long x = isdigit((unsigned char)text[0]) ? strtoull(text, &end, 10) : 0;
    if (!end || *end || errno) {
        clmha__cli_report("run", "%s '%s': expected an integer in [0, 2^64)", flag, text);
        return false;
    }
    *v = (uint64_t)x;
    return true;
}

// The gradient options together: --grad-output and --grads-dir go together, --grad-weights
// needs them and weights, --seed and --offset need --training. Reports a usage error.
static bool grad_options_ok(const char *grad_out, const char *grad_w, const char *dir,
                            bool need_weights, bool training, const char *seed,
                            const char *offset) {
    const char *why = NULL;
    if (grad_out && !dir) why = "--grad-output needs --grads-dir (where the gradients go)";
    else if (dir && !grad_out) why = "--grads-dir needs --grad-output (the output's gradient)";
    else if (grad_w && !grad_out) why = "--grad-weights needs --grad-output and --grads-dir";
    else if (grad_w && !need_weights)
        why = "--grad-weights needs --need-weights (or --per-head-weights, --weights-output): "
              "the weights it is the gradient of";
    else if ((seed || offset) && !training) why = "--seed and --offset need --training";
    if (why) clmha__cli_report("run", "%s", why);
    return !why;
}

// --grads-dir must be an existing, writable folder (it is not created).
static bool grads_dir_ok(const char *dir) {
    struct stat st;
    if (stat(dir, &st) != 0)
        clmha__cli_report("run", "--grads-dir %s: %s (the folder is not created: make it first)",
                          dir, strerror(errno));
    else if (!S_ISDIR(st.st_mode))
        clmha__cli_report("run", "--grads-dir %s: not a folder", dir);
    else if (access(dir, W_OK | X_OK) != 0)
        clmha__cli_report("run", "--grads-dir %s: the folder is not writable", dir);
    else
        return true;
    return false;
}

// A gradient input (--grad-output, --grad-weights) must have the shape of what it is the
// gradient of. Reports and returns false.
static bool grad_shape_ok(const input_file *in, const char *what, size_t ndim,
                          const size_t *shape) {
    bool same = in->a.ndim == ndim;
    for (size_t i = 0; same && i < ndim; ++i) same = in->a.shape[i] == shape[i];
    if (same) return true;
    char got[160], want[160];
    clmha__cli_report("run", "%s %s: shape %s, but the %s %s", in->flag, in->path,
                      clmha__shape_str(got, sizeof got, in->a.ndim, in->a.shape), what,
                      clmha__shape_str(want, sizeof want, ndim, shape));
    return false;
}

int clmha__cli_run(int argc, char **argv) {
    const char *layer_path = NULL, *output_path = NULL, *weights_path = NULL, *device = NULL;
    const char *grads_dir = NULL, *seed_opt = NULL, *offset_opt = NULL, *chunk_opt = NULL;
    const char *dtype_opt = NULL, *prefix = NULL, *heads_opt = NULL, *batch_first_opt = NULL;
    input_file in[IN_COUNT] = {
        [IN_QUERY] = {.flag = "--query"},
        [IN_KEY] = {.flag = "--key"},
        [IN_VALUE] = {.flag = "--value"},
        [IN_KPM] = {.flag = "--key-padding-mask", .is_mask = true},
        [IN_ATTN] = {.flag = "--attn-mask", .is_mask = true},
        [IN_GRAD_OUT] = {.flag = "--grad-output"},
        [IN_GRAD_W] = {.flag = "--grad-weights"},
    };
    bool is_causal = false, need_weights = false, per_head = false, training = false;
    const char *impl_opt = NULL;
    const clmha__cli_option opts[] = {
        {.name = "--layer", .value = &layer_path},
        {.name = "--prefix", .value = &prefix},
        {.name = "--num-heads", .value = &heads_opt},
        {.name = "--batch-first", .value = &batch_first_opt},
        {.name = "--query", .value = &in[IN_QUERY].path},
        {.name = "--key", .value = &in[IN_KEY].path},
        {.name = "--value", .value = &in[IN_VALUE].path},
        {.name = "--key-padding-mask", .value = &in[IN_KPM].path},
        {.name = "--attn-mask", .value = &in[IN_ATTN].path},
        {.name = "--is-causal", .flag = &is_causal},
        {.name = "--impl", .value = &impl_opt},
        {.name = "--need-weights", .flag = &need_weights},
        {.name = "--per-head-weights", .flag = &per_head},
        {.name = "--output", .value = &output_path},
        {.name = "--weights-output", .value = &weights_path},
        {.name = "--training", .flag = &training},
        {.name = "--seed", .value = &seed_opt},
        {.name = "--offset", .value = &offset_opt},
        {.name = "--grad-output", .value = &in[IN_GRAD_OUT].path},
        {.name = "--grad-weights", .value = &in[IN_GRAD_W].path},
        {.name = "--grads-dir", .value = &grads_dir},
        {.name = "--device", .value = &device, .allow_empty = true},
        {.name = "--decode-chunk", .value = &chunk_opt},
        {.name = "--dtype", .value = &dtype_opt},
    };
    char usage[8192] = "";
    for (size_t i = 0; i < sizeof usage_run / sizeof usage_run[0]; ++i)
        strncat(usage, usage_run[i], sizeof usage - strlen(usage) - 1);
    int rc;
    if (!clmha__cli_parse_options("run", argc, argv, opts, sizeof opts / sizeof opts[0], usage,
                                  &rc))
        return rc;
    if (!layer_path || !in[IN_QUERY].path) {
        clmha__cli_report("run", "%s required (try 'clmha run --help')",
                          !layer_path && !in[IN_QUERY].path ? "--layer and --query are"
                          : !layer_path                     ? "--layer is"
                                                            : "--query is");
        return EXIT_USAGE;
    }
    // The outputs and inputs named so far (the gradient files join once the layer is known).
    clmha__cli_in named_in[IN_COUNT + 1] = {{"--layer", layer_path}};
    for (int i = 0; i < IN_COUNT; ++i) named_in[i + 1] = (clmha__cli_in){in[i].flag, in[i].path};
    clmha__cli_out outs[2 + CLMHA__CLI_MAX_GRADS];
    size_t num_outs = 0;
    if (output_path) outs[num_outs++] = (clmha__cli_out){.flag = "--output", .path = output_path};
    if (weights_path)
        outs[num_outs++] = (clmha__cli_out){.flag = "--weights-output", .path = weights_path};
    if (!clmha__cli_outputs_distinct("run", outs, num_outs, named_in, IN_COUNT + 1))
        return EXIT_USAGE;
    if (weights_path || per_head) need_weights = true;
    clmha_impl impl;
    if (!clmha__cli_parse_impl("run", impl_opt, need_weights,
                               "--need-weights, --per-head-weights and --weights-output", &impl))
        return EXIT_USAGE;
    clmha_dtype dtype;
    if (!clmha__cli_parse_dtype("run", dtype_opt, &dtype)) return EXIT_USAGE;
    bool f64 = dtype == CLMHA_DTYPE_F64;
    clmha_load_options load = {.struct_size = sizeof load, .prefix = prefix, .dtype = dtype};
    uint64_t heads = 0;
    if (!parse_u64("--num-heads", heads_opt, &heads)) return EXIT_USAGE;
    if (heads_opt && (heads == 0 || heads > SIZE_MAX)) {
        clmha__cli_report("run", "--num-heads '%s': expected a positive integer", heads_opt);
        return EXIT_USAGE;
    }
    load.num_heads = (size_t)heads;
    if (batch_first_opt) {
        bool yes = strcmp(batch_first_opt, "yes") == 0, no = strcmp(batch_first_opt, "no") == 0;
        if (!yes && !no) {
            clmha__cli_report("run", "--batch-first '%s': expected yes or no", batch_first_opt);
            return EXIT_USAGE;
        }
        load.batch_first = yes ? CLMHA_BATCH_FIRST_YES : CLMHA_BATCH_FIRST_NO;
    }
    // Only float32 layers have a backward pass (include/clmha.h, clmha_dtype): refused here,
    // before any file is read, rather than by the library after the forward pass.
    if (dtype != CLMHA_DTYPE_F32 && (in[IN_GRAD_OUT].path || in[IN_GRAD_W].path || grads_dir)) {
        clmha__cli_report("run",
                          "--dtype %s: gradients (--grad-output, --grad-weights, --grads-dir) "
                          "need --dtype f32: %s layers have no backward pass yet",
                          dtype_opt, clmha__dtype_name(dtype));
        return EXIT_USAGE;
    }
    uint64_t chunk = 0;
    if (chunk_opt) {
        const char *clash = need_weights || per_head || weights_path ? "weights"
                            : in[IN_KPM].path || in[IN_ATTN].path    ? "masks"
                            : training                               ? "--training"
                            : in[IN_GRAD_OUT].path || grads_dir      ? "gradients"
                            : impl_opt                               ? "--impl"
                            : is_causal && (in[IN_KEY].path || in[IN_VALUE].path)
                                ? "--is-causal with --key or --value (the cache aligns causal "
                                  "queries bottom-right: self-attention only)"
                            : f64 ? "--dtype f64 (float64 layers have no KV cache yet)"
                                  : NULL;
        if (!parse_u64("--decode-chunk", chunk_opt, &chunk)) return EXIT_USAGE;
        if (chunk == 0) {
            clmha__cli_report("run", "--decode-chunk %s: expected a positive number of query "
                                     "rows", chunk_opt);
            return EXIT_USAGE;
        }
        if (clash) {
            clmha__cli_report("run", "--decode-chunk does not go with %s", clash);
            return EXIT_USAGE;
        }
    }
    clmha_dropout_rng rng = {0};
    if (!grad_options_ok(in[IN_GRAD_OUT].path, in[IN_GRAD_W].path, grads_dir, need_weights,
                         training, seed_opt, offset_opt) ||
        !parse_u64("--seed", seed_opt, &rng.seed) ||
        !parse_u64("--offset", offset_opt, &rng.offset))
        return EXIT_USAGE;

    clmha_context *ctx = NULL;
    clmha_layer *layer = NULL;
    clmha_saved *saved = NULL;
    clmha__cli_grads grads = {0};
    // The results: floats, or doubles for a float64 layer (y64, w64).
    float *y = NULL, *w = NULL;
    double *y64 = NULL, *w64 = NULL;
    rc = EXIT_REFUSED;

    // Files first: they are refused without touching a device.
    if ((output_path && !clmha__cli_output_path_ok("run", "--output", output_path)) ||
        (weights_path && !clmha__cli_output_path_ok("run", "--weights-output", weights_path)) ||
        (grads_dir && !grads_dir_ok(grads_dir)))
        goto fail;
    // A regular file only: opening a FIFO or a device must not block (base/file_read.h).
    FILE *f = NULL;
    size_t layer_size;
    char msg[1024];
    if (clmha__file_open_regular(layer_path, &f, &layer_size, NULL, msg, sizeof msg)) {
        clmha__cli_report("run", "--layer %s: %s", layer_path,
                          clmha__cli_without_path(msg, layer_path));
        goto fail;
    }
    fclose(f);
    for (int i = 0; i < IN_COUNT; ++i)
        if (in[i].path && !read_input(&in[i], f64)) goto fail;

    if (!(ctx = clmha__cli_open_context("run", device))) goto fail;
    if (clmha_layer_load_prefixed(&layer, ctx, layer_path, &load) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "--layer %s: %s", layer_path,
                          clmha__cli_without_path(clmha_context_last_error(ctx), layer_path));
        goto fail;
    }
    clmha_layer_desc desc = {.struct_size = sizeof desc};
    if (clmha_layer_get_desc(layer, &desc) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "--layer %s: %s", layer_path, clmha_context_last_error(ctx));
        goto fail;
    }

    // The arguments, checked one input at a time so that a refusal names its file.
    clmha_forward_args args = {.struct_size = sizeof args, .query = tensor_of(&in[IN_QUERY].a)};
    if (in[IN_KEY].path) args.key = tensor_of(&in[IN_KEY].a);
    if (in[IN_VALUE].path) {
        args.value = tensor_of(&in[IN_VALUE].a);
        if (!in[IN_KEY].path) args.key = args.query;  // key defaults to the query
    }
    size_t y_count = 0, w_count = 0;
    if (clmha_layer_output_counts(layer, &args, NULL, NULL) != CLMHA_SUCCESS) {
        const char *why = clmha_context_last_error(ctx);
        const input_file *culprit = input_culprit(why, in, desc.batch_first);
        if (culprit)
            clmha__cli_report("run", "%s %s: %s", culprit->flag, culprit->path, why);
        else
            clmha__cli_report("run", "--layer %s: %s", layer_path, why);
        goto fail;
    }
    args.key_padding_mask = mask_of(&in[IN_KPM]);
    if (clmha_layer_output_counts(layer, &args, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "--key-padding-mask %s: %s", in[IN_KPM].path,
                          clmha_context_last_error(ctx));
        goto fail;
    }
    args.attn_mask = mask_of(&in[IN_ATTN]);
    args.is_causal = is_causal;
    if (clmha_layer_output_counts(layer, &args, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "%s%s: %s", in[IN_ATTN].path ? "--attn-mask " : "--is-causal",
                          in[IN_ATTN].path ? in[IN_ATTN].path : "", clmha_context_last_error(ctx));
        goto fail;
    }
    args.need_weights = need_weights;
    args.per_head_weights = per_head;
    args.impl = impl;
    args.training = training;
    args.rng = rng;
    if (clmha_layer_output_counts(layer, &args, &y_count, &w_count) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "%s", clmha_context_last_error(ctx));
        goto fail;
    }

    // Output shapes: the output is shaped like the query (whose last size is E); the weights
    // (N, [H,] L, S'), unbatched without N.
    const clmha__npy *q = &in[IN_QUERY].a;
    bool batched = q->ndim == 3;
    size_t n = batched ? q->shape[desc.batch_first ? 0 : 1] : 1;
    size_t l = batched ? q->shape[desc.batch_first ? 1 : 0] : q->shape[0];
    size_t w_shape[4], w_ndim = 0;
    if (need_weights) {
        size_t rows = n * l * (per_head ? desc.num_heads : 1);
        size_t s_padded = rows ? w_count / rows : 0;
        if (batched) w_shape[w_ndim++] = n;
        if (per_head) w_shape[w_ndim++] = desc.num_heads;
        w_shape[w_ndim++] = l;
        w_shape[w_ndim++] = s_padded;
    }

    // Gradients: the gradient inputs' shapes, then the files, checked like the outputs.
    if (grads_dir) {
        if (!grad_shape_ok(&in[IN_GRAD_OUT], "output is", q->ndim, q->shape) ||
            (in[IN_GRAD_W].path &&
             !grad_shape_ok(&in[IN_GRAD_W],
                            per_head ? "weights (per head) are" : "weights (averaged) are",
                            w_ndim, w_shape)))
            goto fail;
        if (!clmha__cli_grads_plan(grads_dir, layer, &args, in[IN_KEY].path != NULL,
                                   in[IN_VALUE].path != NULL, &grads))
            goto fail;
        for (size_t i = 0; i < grads.count; ++i)
            if (!clmha__cli_output_path_ok("run", "--grads-dir", grads.file[i].path)) goto fail;
        size_t all = num_outs + clmha__cli_grads_outputs(&grads, outs + num_outs);
        if (!clmha__cli_outputs_distinct("run", outs, all, named_in, IN_COUNT + 1)) {
            rc = EXIT_USAGE;
            goto fail;
        }
        if (clmha_saved_create(&saved, layer) != CLMHA_SUCCESS) {
            clmha__cli_report("run", "%s", clmha_context_last_error(ctx));
            goto fail;
        }
        args.save = saved;
    }

    // (calloc checks the products of counts and sizes.)
    size_t y_alloc = y_count ? y_count : 1, w_alloc = w_count ? w_count : 1;
    bool no_memory = f64 ? !(y64 = calloc(y_alloc, sizeof *y64)) ||
                               (need_weights && !(w64 = calloc(w_alloc, sizeof *w64)))
                         : !(y = calloc(y_alloc, sizeof *y)) ||
                               (need_weights && !(w = calloc(w_alloc, sizeof *w)));
    if (no_memory) {
        clmha__cli_report("run", "out of host memory for the outputs (%zu + %zu %s)", y_count,
                          w_count, f64 ? "doubles" : "floats");
        goto fail;
    }
    if (chunk && !decode_in_chunks(layer, &args, &desc, (size_t)chunk, y)) goto fail;
    clmha_status st =
        chunk ? CLMHA_SUCCESS
        : f64 ? clmha_layer_forward_host_f64(layer, &args, y64, y_count, w64, w_count)
              : clmha_layer_forward_host(layer, &args, y, y_count, w, w_count);
    if (st != CLMHA_SUCCESS) {
        clmha__cli_report("run", "forward pass failed on %s: %s: %s",
                          clmha_context_device_name(ctx), clmha_status_string(st),
                          clmha_context_last_error(ctx));
        goto fail;
    }
    if (grads_dir) {
        // The fused backward gives no mask gradients: with a float mask it runs unfused.
        bool float_mask = args.attn_mask.kind == CLMHA_MASK_FLOAT ||
                          args.key_padding_mask.kind == CLMHA_MASK_FLOAT;
        clmha_tensor gw = {0};
        if (in[IN_GRAD_W].path) gw = tensor_of(&in[IN_GRAD_W].a);
        if (!clmha__cli_grads_compute(layer, &args, saved, tensor_of(&in[IN_GRAD_OUT].a), gw,
                                      impl == CLMHA_IMPL_FUSED && float_mask ? CLMHA_IMPL_AUTO
                                                                             : impl,
                                      &grads))
            goto fail;
    }

    // Every file at once, all or none.
    num_outs = 0;
    if (output_path)
        outs[num_outs++] = (clmha__cli_out){.flag = "--output", .path = output_path, .data = y,
                                            .f64 = y64, .ndim = q->ndim,
                                            .half = dtype == CLMHA_DTYPE_F16};
    if (output_path) memcpy(outs[0].shape, q->shape, q->ndim * sizeof *q->shape);
    if (weights_path) {
        outs[num_outs] = (clmha__cli_out){.flag = "--weights-output", .path = weights_path,
                                          .data = w, .f64 = w64, .ndim = w_ndim,
                                          .half = dtype == CLMHA_DTYPE_F16};
        memcpy(outs[num_outs++].shape, w_shape, w_ndim * sizeof *w_shape);
    }
    num_outs += clmha__cli_grads_outputs(&grads, outs + num_outs);
    if (!clmha__cli_write_outputs("run", outs, num_outs)) goto fail;
    values yv = {y, y64}, wv = {w, w64};
    warn_nonfinite(yv, y_count, wv, w_count, in, dtype);

    // A summary of what was not written to a file.
    bool show_y = !output_path, show_w = need_weights && !weights_path;
    if (show_y || show_w) {
        char s[160];
        printf("device:  %s\n", clmha_context_device_name(ctx));
        printf("layer:   embed_dim %zu, num_heads %zu, kdim %zu, vdim %zu%s%s%s%s\n",
               desc.embed_dim, desc.num_heads, desc.kdim, desc.vdim, desc.bias ? ", bias" : "",
               desc.add_bias_kv ? ", add_bias_kv" : "",
               desc.add_zero_attn ? ", add_zero_attn" : "",
               desc.batch_first ? ", batch_first" : "");
        printf("query:   %s%s\n", clmha__shape_str(s, sizeof s, q->ndim, q->shape),
               batched ? (desc.batch_first ? " (N, L, E)" : " (L, N, E)") : " (L, E) unbatched");
        if (show_y) print_values("output:", yv, y_count, q->ndim, q->shape, "");
        if (show_w)
            print_values("weights:", wv, w_count, w_ndim, w_shape,
                         per_head ? " per head" : " averaged over the heads");
    }
    rc = EXIT_OK;
fail:
    free(y);
    free(w);
    free(y64);
    free(w64);
    clmha__cli_grads_free(&grads);
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    for (int i = 0; i < IN_COUNT; ++i) clmha__npy_free(&in[i].a);
    return rc;
}
