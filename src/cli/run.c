// `clmha run`: a layer file (.safetensors) on .npy inputs, .npy outputs.
#define _POSIX_C_SOURCE 200809L

#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "base/file_read.h"
#include "base/half.h"
#include "base/message.h"
#include "grads.h"
#include "heatmap.h"
#include "npy.h"
#include "outputs.h"

// The help text, in parts (ISO C compilers need support string literals of 4095 bytes only).
static const char *const usage_run[] = {
    "usage: clmha run --layer F.safetensors --query Q.npy [options]\n"
    "\n"
    "Runs torch.nn.MultiheadAttention's forward pass (eval mode unless --training) with the\n"
    "layer in F.safetensors (state_dict() names; metadata num_heads, batch_first,\n"
    "add_zero_attn, dropout, window, softcap, alibi; the tensor sinks, (H), gives the layer\n"
    "attention sinks) on the arrays of .npy files, and optionally its backward pass.\n"
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
    "  --seq-lens 5,3,7          a packed batch (PyTorch's NestedTensor): the query is 2-D\n"
    "                            (T, E), the sequences one after another, T the sum of\n"
    "                            the lengths; each sequence attends only within itself,\n"
    "                            and the output (and --grad-output) are (T, E) too. Not\n"
    "                            with masks, weights, --heatmap or --decode-chunk\n"
    "  --kv-seq-lens 4,9,2       a packed batch's key/value lengths (key (T_kv, kdim), value\n"
    "                            (T_kv, vdim)); default: --seq-lens (self-attention)\n"
    "  --is-causal               forbid key j > query i (top-left aligned)\n"
    "  --window LEFT,RIGHT       sliding window: query i attends key j only when\n"
    "                            i-LEFT <= j <= i+RIGHT (-1: that side unbounded; keys of\n"
    "                            add_bias_kv/add_zero_attn are never windowed); overrides\n"
    "                            the layer file's window (metadata window \"LEFT,RIGHT\")\n"
    "  --softcap C               soft-cap every scaled score s to C*tanh(s/C) (Gemma 2's),\n"
    "                            before ALiBi and the masks; 0: off. Overrides the layer\n"
    "                            file's softcap (metadata softcap)\n"
    "  --alibi                   ALiBi: the score of head h, query i, key j gains\n"
    "                            -slope_h*|i-j| (keys of add_bias_kv/add_zero_attn none); the\n"
    "                            layer file's alibi_slopes, else the geometric slopes\n"
    "  --training                apply the layer's dropout (PyTorch's train()), drawn from\n"
    "                            clmha's Philox stream (not PyTorch's generator)\n"
    "  --seed S, --offset O      the dropout stream's key and offset (default 0); need\n"
    "                            --training\n"
    "\n",
    "user score and mask functions (FlexAttention's score_mod and mask_mod):\n"
    "  --score-mod FILE.cl       OpenCL C source compiled into the attention kernels\n"
    "                            (clmha_layer_desc::mod_source; in place of the layer\n"
    "                            file's, if it has one), defining any of\n"
    "                              clmha_real clmha_score_mod(clmha_real s, int b, int h,\n"
    "                                                         int q, int k,\n"
    "                                                         __global const float *p)\n"
    "                              clmha_real clmha_score_mod_grad(the same arguments)\n"
    "                              int clmha_mask_mod(int b, int h, int q, int k,\n"
    "                                                 __global const float *p)\n"
    "                            for batch item b, head h, query row q and key k (the keys\n"
    "                            of add_bias_kv/add_zero_attn go through neither): the new\n"
    "                            score (after --softcap and ALiBi, before the masks), its\n"
    "                            derivative in s (the gradients need it), non-zero where q\n"
    "                            may attend k. clmha_real is float (double with --dtype\n"
    "                            f64). A source that does not compile is refused with the\n"
    "                            build log\n"
    "  --mod-params P.npy        p: a 1-D float32 (or float64, float16) array of any length;\n"
    "                            default: none (p empty). Needs --score-mod\n"
    "\n",
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
    "\n"
    "gradients (the backward pass, after the forward pass with the same inputs and dropout):\n"
    "  --grad-output G.npy       the gradient of the output, in the output's shape\n"
    "  --grad-weights GW.npy     optional: the gradient of the weights, in their shape;\n"
    "                            needs --need-weights (or --per-head-weights)\n"
    "  --grads-dir DIR           an existing folder (it is not created) that receives the\n"
    "                            gradients, in the layer's dtype as --output (f64: '<f8'), in\n"
    "                            PyTorch's shapes, as <name>.npy:\n"
    "                            query; key and value when given as files of their own (in\n"
    "                            self-attention query.npy holds the whole gradient of the\n"
    "                            query; with --key alone key.npy includes its use as value);\n"
    "                            one file per parameter the layer has, by state_dict name\n"
    "                            (in_proj_weight, or q_proj_weight, k_proj_weight and\n"
    "                            v_proj_weight; in_proj_bias, out_proj.weight, out_proj.bias,\n"
    "                            bias_k, bias_v (1, 1, E), sinks (H)); attn_mask and\n"
    "                            key_padding_mask for float masks (boolean masks have no\n"
    "                            gradient). Other files in DIR are left alone. --grad-output\n"
    "                            and --grads-dir go together. Fully masked query rows get\n"
    "                            zero gradients.\n"
    "  --grad-dtype f32          with --dtype f16 or bf16: float32 gradient files, unrounded\n"
    "                            (for float32 master weights)\n"
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
    "heatmap:\n"
    "  --heatmap H.png           also draw the attention maps of this call as a PNG: the\n"
    "                            weights of each head (one tile each, keys left to right,\n"
    "                            queries top to bottom) and their mean, on one colour scale,\n"
    "                            from one more forward call of the same inputs; written with\n"
    "                            the other outputs (renamed last)\n"
    "  --heatmap-batch B         the batch item drawn (default 0)\n"
    "\n"
    "incremental decoding:\n"
    "  --decode-chunk C          run the forward pass through a KV cache (clmha_kv_cache), C\n"
    "                            query rows a call, and write the rows together: with\n"
    "                            --is-causal (self-attention only) each call appends its own\n"
    "                            tokens' keys and values and its queries see the cache\n"
    "                            bottom-right aligned; without, the whole key and value go in\n"
    "                            with the first call and the later calls attend only. Either\n"
    "                            way the output is the one-shot forward's (every --dtype).\n"
    "                            Not with masks, weights, --heatmap, --training, gradients or\n"
    "                            --impl; with a sliding window, ALiBi or --score-mod,\n"
    "                            --is-causal only\n"
    "  --page-size P             with --decode-chunk: a paged KV cache of P-token pages (a\n"
    "                            power of two from 8; a pool of just enough pages): the\n"
    "                            same output\n"
    "  --kv-dtype K              with --decode-chunk: how the cache stores keys and values:\n"
    "                            f32 (default), f16, bf16, int8 (one scale per token and\n"
    "                            head) or int4 (one scale per 32 dimensions); the error each\n"
    "                            adds on unit-scale data: docs/accuracy.md\n"
    "\n"
    "precision:\n"
    "  --dtype T                 the layer's dtype (PyTorch's dtype=): f32 (default), f64,\n"
    "                            f16 or bf16. The layer file's values and the inputs are\n"
    "                            rounded to it (to nearest even); a 16-bit layer computes in\n"
    "                            float32 and rounds its results once. f64: the layer file's\n"
    "                            and the inputs' float64 values are kept exactly (float16\n"
    "                            and float32 widened), everything is computed in float64 and\n"
    "                            the outputs are float64 files; it needs a device with\n"
    "                            double precision (clmha devices: fp64 yes). Every dtype\n"
    "                            takes gradients: f16 and bf16 computed in float32 and\n"
    "                            rounded once, f64 in float64\n"
    "\n"
    "device:\n"
    "  --device SPEC             \"P:D\", gpu, cpu, accelerator or part of a device name\n"
    "                            (see clmha devices); default: $CLMHA_DEVICE, else the first\n"
    "                            GPU, else the first device\n"
    "  --impl auto|fused|unfused the attention core: fused streams key tiles and never\n"
    "                            stores the scores, but cannot give weights; auto (default)\n"
    "                            is fused without weights (on a CPU with the host BLAS and\n"
    "                            AVX-512 or AVX2, long calls without masks but --is-causal\n"
    "                            or a boolean --key-padding-mask in C on the CPU; fused:\n"
    "                            always the OpenCL kernel), else\n"
    "                            unfused. The backward pass uses the same core, except that\n"
    "                            a float mask's gradient needs the unfused one\n"
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
    if (clmha__cli_starts_with(msg, "query") || strstr(msg, "packed call's query")) return q;
    if (strstr(msg, "packed call's key")) return k;
    if (strstr(msg, "packed call's value")) return v;
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


// Rows t0 .. t0+c-1 of every sequence of @p x, a (T, N, F) array ((N, T, F) batch first) of
// @p es bytes an element, copied into (@p to_x false) or out of (@p to_x true) @p chunk, a
// (c, N, F) array in the same layout.
static void chunk_rows(void *x, void *chunk, size_t es, size_t n, size_t t, size_t f,
                       bool batch_first, size_t t0, size_t c, bool to_x) {
    for (size_t b = 0; b < n; ++b)
        for (size_t i = 0; i < c; ++i) {
            char *big = (char *)x + (batch_first ? b * t + t0 + i : (t0 + i) * n + b) * f * es;
            char *small = (char *)chunk + (batch_first ? b * c + i : i * n + b) * f * es;
            memcpy(to_x ? big : small, to_x ? small : big, f * es);
        }
}

// --decode-chunk: the forward call @p args through a KV cache, @p chunk query rows at a time,
// the rows of the output into @p y (as the one-shot forward writes them: floats, or doubles for
// a float64 layer, whose query is doubles too). Reports a failure.
static bool decode_in_chunks(clmha_layer *layer, const clmha_forward_args *args,
                             const clmha_layer_desc *desc, size_t chunk, size_t page_size,
                             clmha_kv_dtype kv_dtype, void *y) {
    clmha_context *ctx = clmha_layer_context(layer);
    const clmha_tensor *q = &args->query;
    bool batched = q->ndim == 3, bf = batched && desc->batch_first;
    size_t n = batched ? q->shape[bf ? 0 : 1] : 1, l = q->shape[bf ? 1 : 0], e = desc->embed_dim;
    const clmha_tensor *key = args->key.ndim ? &args->key : q;
    size_t s = key->shape[bf ? 1 : 0];
    size_t c = chunk < l ? chunk : l;
    bool f64 = desc->dtype == CLMHA_DTYPE_F64;
    size_t es = f64 ? sizeof(double) : sizeof(float);
    void *qc = malloc(c * n * e * es), *yc = malloc(c * n * e * es);
    clmha_kv_cache *cache = NULL;
    bool ok = false;
    if (!qc || !yc) {
        clmha__cli_report("run", "out of host memory");
        goto done;
    }
    // --page-size: a paged cache, a pool of just the pages the sequences fill.
    size_t cap = args->is_causal ? l : s;
    clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = page_size ? 0 : cap,
                                .page_size = page_size,
                                .num_pages = page_size ? n * ((cap + page_size - 1) / page_size)
                                                       : 0,
                                .kv_dtype = kv_dtype};
    clmha_status st = clmha_kv_cache_create_with(&cache, layer, n, &o);
    for (size_t t0 = 0; !st && t0 < l; t0 += c) {
        size_t rows = t0 + c < l ? c : l - t0;
        chunk_rows((void *)q->data, qc, es, n, l, e, bf, t0, rows, false);
        clmha_forward_args a = *args;
        a.kv_cache = cache;
        a.query.data = qc;
        a.query.shape[bf ? 1 : 0] = rows;
        if (!args->is_causal && t0 == 0 && !args->key.ndim) a.key = *q;  // the whole query
        if (!args->is_causal && t0 > 0) {
            a.key = a.value = (clmha_tensor){0};
            a.kv_attend_only = true;
        }
        st = f64 ? clmha_layer_forward_host_f64(layer, &a, yc, rows * n * e, NULL, 0)
                 : clmha_layer_forward_host(layer, &a, yc, rows * n * e, NULL, 0);
        if (!st) chunk_rows(y, yc, es, n, l, e, bf, t0, rows, true);
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

// The command line, and what follows from it before any file is read.
typedef struct run_opts {
    const char *layer_path, *output_path, *weights_path, *device, *grads_dir, *heatmap;
    const char *seed_opt, *offset_opt, *chunk_opt, *dtype_opt, *prefix, *heads_opt;
    const char *batch_first_opt, *impl_opt, *heatmap_batch_opt, *window_opt, *softcap_opt;
    const char *seq_lens_opt, *kv_seq_lens_opt, *page_opt, *kv_dtype_opt, *grad_dtype_opt;
    clmha__cli_lens seq, kv_seq;  // --seq-lens, --kv-seq-lens (a packed batch)
    input_file in[IN_COUNT];
    bool is_causal, need_weights, per_head, training;
    bool alibi;      // --alibi (adds ALiBi to the layer file's layer)
    double softcap;  // --softcap (with softcap_opt: replaces the layer file's)
    clmha_impl impl;
    clmha_dtype dtype;
    bool f64;  // a float64 layer: inputs read and results written as doubles
    clmha_load_options load;
    clmha__cli_window window;  // --window (on: replaces the layer file's)
    clmha__cli_mod mod;        // --score-mod, --mod-params (source: added to the layer)
    uint64_t chunk;          // --decode-chunk (0: one call)
    uint64_t page_size;      // --page-size (0: a contiguous cache)
    clmha_kv_dtype kv_dtype; // --kv-dtype
    uint64_t heatmap_batch;  // --heatmap-batch
    clmha_dropout_rng rng;
    clmha__cli_in named_in[IN_COUNT + 3];  // --layer, the .npy inputs, --score-mod, --mod-params
    clmha__cli_out outs[3 + CLMHA__CLI_MAX_GRADS];
    size_t num_outs;  // the output, the weights and the heatmap; the gradients join later
} run_opts;

// What a run holds once the device is open.
typedef struct run_state {
    clmha_context *ctx;
    clmha_layer *layer;
    clmha_saved *saved;
    clmha__cli_grads grads;
    clmha_layer_desc desc;
    clmha_forward_args args;
    size_t y_count, w_count;
    size_t n, l;             // batch size (1 unbatched) and query length
    size_t w_shape[4], w_ndim;
    float *y, *w;            // the results, or for a float64 layer
    double *y64, *w64;       // these
    char heatmap_tmp[4096];  // the heatmap, written and not yet renamed ("" none)
} run_state;

// Parses the command line into @p o. Returns true when the command goes on; else false with
// *rc EXIT_OK (after --help) or EXIT_USAGE (after reporting).
static bool parse_command_line(int argc, char **argv, run_opts *o, int *rc) {
    const clmha__cli_option opts[] = {
        {.name = "--layer", .value = &o->layer_path},
        {.name = "--prefix", .value = &o->prefix},
        {.name = "--num-heads", .value = &o->heads_opt},
        {.name = "--batch-first", .value = &o->batch_first_opt},
        {.name = "--query", .value = &o->in[IN_QUERY].path},
        {.name = "--key", .value = &o->in[IN_KEY].path},
        {.name = "--value", .value = &o->in[IN_VALUE].path},
        {.name = "--key-padding-mask", .value = &o->in[IN_KPM].path},
        {.name = "--attn-mask", .value = &o->in[IN_ATTN].path},
        {.name = "--seq-lens", .value = &o->seq_lens_opt},
        {.name = "--kv-seq-lens", .value = &o->kv_seq_lens_opt},
        {.name = "--is-causal", .flag = &o->is_causal},
        {.name = "--window", .value = &o->window_opt},
        {.name = "--softcap", .value = &o->softcap_opt},
        {.name = "--alibi", .flag = &o->alibi},
        {.name = "--score-mod", .value = &o->mod.source_path},
        {.name = "--mod-params", .value = &o->mod.params_path},
        {.name = "--impl", .value = &o->impl_opt},
        {.name = "--need-weights", .flag = &o->need_weights},
        {.name = "--per-head-weights", .flag = &o->per_head},
        {.name = "--output", .value = &o->output_path},
        {.name = "--weights-output", .value = &o->weights_path},
        {.name = "--heatmap", .value = &o->heatmap},
        {.name = "--heatmap-batch", .value = &o->heatmap_batch_opt},
        {.name = "--training", .flag = &o->training},
        {.name = "--seed", .value = &o->seed_opt},
        {.name = "--offset", .value = &o->offset_opt},
        {.name = "--grad-output", .value = &o->in[IN_GRAD_OUT].path},
        {.name = "--grad-weights", .value = &o->in[IN_GRAD_W].path},
        {.name = "--grads-dir", .value = &o->grads_dir},
        {.name = "--grad-dtype", .value = &o->grad_dtype_opt},
        {.name = "--device", .value = &o->device, .allow_empty = true},
        {.name = "--decode-chunk", .value = &o->chunk_opt},
        {.name = "--page-size", .value = &o->page_opt},
        {.name = "--kv-dtype", .value = &o->kv_dtype_opt},
        {.name = "--dtype", .value = &o->dtype_opt},
    };
    char usage[4 * 4096] = "";  // room for the four parts (each under 4095 bytes, 12.3 KB in all)
    for (size_t i = 0; i < sizeof usage_run / sizeof usage_run[0]; ++i)
        strncat(usage, usage_run[i], sizeof usage - strlen(usage) - 1);
    if (!clmha__cli_parse_options("run", argc, argv, opts, sizeof opts / sizeof opts[0], usage,
                                  rc))
        return false;
    *rc = EXIT_USAGE;
    if (!o->layer_path || !o->in[IN_QUERY].path) {
        clmha__cli_report("run", "%s required (try 'clmha run --help')",
                          !o->layer_path && !o->in[IN_QUERY].path ? "--layer and --query are"
                          : !o->layer_path                        ? "--layer is"
                                                                  : "--query is");
        return false;
    }
    if (o->heatmap_batch_opt && !o->heatmap) {
        clmha__cli_report("run", "--heatmap-batch needs --heatmap");
        return false;
    }
    return clmha__cli_parse_u64("run", "--heatmap-batch", o->heatmap_batch_opt,
                                &o->heatmap_batch);
}

// --num-heads and --batch-first into o->load. Reports a usage error.
static bool parse_load_options(run_opts *o) {
    uint64_t heads = 0;
    if (!clmha__cli_parse_u64("run", "--num-heads", o->heads_opt, &heads)) return false;
    if (o->heads_opt && (heads == 0 || heads > SIZE_MAX)) {
        clmha__cli_report("run", "--num-heads '%s': expected a positive integer", o->heads_opt);
        return false;
    }
    o->load = (clmha_load_options){.struct_size = sizeof o->load, .prefix = o->prefix,
                                   .dtype = o->dtype, .num_heads = (size_t)heads};
    if (o->batch_first_opt) {
        bool yes = strcmp(o->batch_first_opt, "yes") == 0;
        if (!yes && strcmp(o->batch_first_opt, "no") != 0) {
            clmha__cli_report("run", "--batch-first '%s': expected yes or no",
                              o->batch_first_opt);
            return false;
        }
        o->load.batch_first = yes ? CLMHA_BATCH_FIRST_YES : CLMHA_BATCH_FIRST_NO;
    }
    return true;
}

// --decode-chunk and what it does not go with. Reports a usage error.
static bool parse_decode_chunk(run_opts *o) {
    if ((o->page_opt || o->kv_dtype_opt) && !o->chunk_opt) {
        clmha__cli_report("run", "%s needs --decode-chunk (it is the KV cache's)",
                          o->page_opt ? "--page-size" : "--kv-dtype");
        return false;
    }
    if (!clmha__cli_parse_kv_dtype("run", o->kv_dtype_opt, &o->kv_dtype)) return false;
    if (!clmha__cli_parse_u64("run", "--page-size", o->page_opt, &o->page_size)) return false;
    if (o->page_opt && (o->page_size < 8 || (o->page_size & (o->page_size - 1)))) {
        clmha__cli_report("run", "--page-size %s: expected a power of two from 8", o->page_opt);
        return false;
    }
    if (!o->chunk_opt) return true;
    const input_file *in = o->in;
    const char *clash =
        o->need_weights || o->per_head || o->weights_path || o->heatmap ? "weights"
        : in[IN_KPM].path || in[IN_ATTN].path                          ? "masks"
        : o->training                                                  ? "--training"
        : in[IN_GRAD_OUT].path || o->grads_dir                         ? "gradients"
        : o->impl_opt                                                  ? "--impl"
        : o->is_causal && (in[IN_KEY].path || in[IN_VALUE].path)
            ? "--is-causal with --key or --value (the cache aligns causal queries "
              "bottom-right: self-attention only)"
                                                                       : NULL;
    if (!clmha__cli_parse_u64("run", "--decode-chunk", o->chunk_opt, &o->chunk)) return false;
    if (o->chunk == 0) {
        clmha__cli_report("run", "--decode-chunk %s: expected a positive number of query rows",
                          o->chunk_opt);
        return false;
    }
    if (clash) {
        clmha__cli_report("run", "--decode-chunk does not go with %s", clash);
        return false;
    }
    return true;
}

// --seq-lens and --kv-seq-lens, and what a packed batch does not go with. Reports a usage
// error.
static bool parse_seq_lens(run_opts *o) {
    if (!clmha__cli_parse_lens("run", "--seq-lens", o->seq_lens_opt, &o->seq) ||
        !clmha__cli_parse_lens("run", "--kv-seq-lens", o->kv_seq_lens_opt, &o->kv_seq))
        return false;
    const char *why = NULL;
    if (o->kv_seq_lens_opt && !o->seq_lens_opt)
        why = "--kv-seq-lens needs --seq-lens (the queries' lengths)";
    else if (o->kv_seq.lens && o->kv_seq.count != o->seq.count)
        why = "--seq-lens and --kv-seq-lens must give as many lengths (one per sequence)";
    else if (o->seq.lens && (o->chunk_opt || o->heatmap))
        why = o->chunk_opt ? "--seq-lens does not go with --decode-chunk"
                           : "--seq-lens does not go with --heatmap (a packed call has no "
                             "weights)";
    if (why) clmha__cli_report("run", "%s", why);
    return !why;
}

// Everything about the options that needs no file. Reports a usage error.
static bool check_options(run_opts *o) {
    o->named_in[0] = (clmha__cli_in){"--layer", o->layer_path};
    for (int i = 0; i < IN_COUNT; ++i)
        o->named_in[i + 1] = (clmha__cli_in){o->in[i].flag, o->in[i].path};
    o->named_in[IN_COUNT + 1] = (clmha__cli_in){"--score-mod", o->mod.source_path};
    o->named_in[IN_COUNT + 2] = (clmha__cli_in){"--mod-params", o->mod.params_path};
    if (o->output_path)
        o->outs[o->num_outs++] = (clmha__cli_out){.flag = "--output", .path = o->output_path};
    if (o->weights_path)
        o->outs[o->num_outs++] =
            (clmha__cli_out){.flag = "--weights-output", .path = o->weights_path};
    if (o->heatmap) o->outs[o->num_outs++] = (clmha__cli_out){.flag = "--heatmap", .path = o->heatmap};
    if (!clmha__cli_outputs_distinct("run", o->outs, o->num_outs, o->named_in, IN_COUNT + 3))
        return false;
    if (o->weights_path || o->per_head) o->need_weights = true;
    if (!clmha__cli_parse_impl("run", o->impl_opt, o->need_weights || o->heatmap,
                               "--need-weights, --per-head-weights, --weights-output and "
                               "--heatmap",
                               &o->impl) ||
        !clmha__cli_parse_dtype("run", o->dtype_opt, &o->dtype) ||
        !clmha__cli_parse_window("run", o->window_opt, &o->window) ||
        !clmha__cli_parse_softcap("run", o->softcap_opt, &o->softcap) ||
        !clmha__cli_mod_options_ok("run", &o->mod))
        return false;
    o->f64 = o->dtype == CLMHA_DTYPE_F64;
    if (!parse_load_options(o)) return false;
    if (o->grad_dtype_opt &&
        (strcmp(o->grad_dtype_opt, "f32") != 0 || !o->grads_dir ||
         (o->dtype != CLMHA_DTYPE_F16 && o->dtype != CLMHA_DTYPE_BF16))) {
        clmha__cli_report("run", "%s",
                          strcmp(o->grad_dtype_opt, "f32") != 0
                              ? "--grad-dtype takes f32 (the default: the layer's dtype)"
                              : "--grad-dtype f32 needs --grads-dir and --dtype f16 or bf16");
        return false;
    }
    return parse_seq_lens(o) && parse_decode_chunk(o) &&
           grad_options_ok(o->in[IN_GRAD_OUT].path, o->in[IN_GRAD_W].path, o->grads_dir,
                           o->need_weights, o->training, o->seed_opt, o->offset_opt) &&
           clmha__cli_parse_u64("run", "--seed", o->seed_opt, &o->rng.seed) &&
           clmha__cli_parse_u64("run", "--offset", o->offset_opt, &o->rng.offset);
}

// The files, before any device is touched: the outputs' paths, --grads-dir, the layer file (a
// regular file: opening a FIFO or a device must not block, base/file_read.h) and the inputs.
static bool read_files(run_opts *o) {
    if ((o->output_path && !clmha__cli_output_path_ok("run", "--output", o->output_path)) ||
        (o->weights_path &&
         !clmha__cli_output_path_ok("run", "--weights-output", o->weights_path)) ||
        (o->heatmap && !clmha__cli_output_path_ok("run", "--heatmap", o->heatmap)) ||
        (o->grads_dir && !clmha__cli_grads_dir_ok("run", o->grads_dir)))
        return false;
    FILE *f = NULL;
    size_t layer_size;
    char msg[1024];
    if (clmha__file_open_regular(o->layer_path, &f, &layer_size, NULL, msg, sizeof msg)) {
        clmha__cli_report("run", "--layer %s: %s", o->layer_path,
                          clmha__cli_without_path(msg, o->layer_path));
        return false;
    }
    fclose(f);
    for (int i = 0; i < IN_COUNT; ++i)
        if (o->in[i].path && !read_input(&o->in[i], o->f64)) return false;
    return clmha__cli_mod_read("run", &o->mod);
}

// The layer's parameters copied into @p to (a layer of the same shapes and dtype): doubles for
// a float64 layer, else floats (a 16-bit layer's values, which @p to keeps as they are).
// *no_memory: the failure is the host's memory (no message on the context).
static clmha_status copy_parameters(clmha_layer *from, clmha_layer *to, bool f64,
                                    bool *no_memory) {
    static const char *const names[] = {"in_proj_weight", "q_proj_weight", "k_proj_weight",
                                        "v_proj_weight",  "in_proj_bias",  "out_proj.weight",
                                        "out_proj.bias",  "bias_k",        "bias_v",
                                        "alibi_slopes",   "sinks"};
    clmha_status st = CLMHA_SUCCESS;
    for (size_t i = 0; !st && i < sizeof names / sizeof *names; ++i) {
        size_t n = clmha_layer_parameter_count(from, names[i]);
        // (alibi_slopes that only @p to has: --alibi added it, the geometric slopes)
        if (!n || !clmha_layer_parameter_count(to, names[i])) continue;
        void *p = calloc(n, f64 ? sizeof(double) : sizeof(float));
        if (!p) {
            *no_memory = true;
            return CLMHA_OUT_OF_MEMORY;
        }
        st = f64 ? clmha_layer_get_parameter_f64(from, names[i], p, n)
                 : clmha_layer_get_parameter(from, names[i], p, n);
        if (!st)
            st = f64 ? clmha_layer_set_parameter_f64(to, names[i], p, n)
                     : clmha_layer_set_parameter(to, names[i], p, n);
        free(p);
    }
    return st;
}

// p of the file's user functions copied into @p to, which keeps them (no --score-mod).
static clmha_status copy_mod_params(clmha_layer *from, clmha_layer *to, size_t count,
                                    bool *no_memory) {
    float *p = calloc(count ? count : 1, sizeof *p);
    if (!p) {
        *no_memory = true;
        return CLMHA_OUT_OF_MEMORY;
    }
    clmha_status st = clmha_layer_get_mod_params(from, p, count);
    if (!st) st = clmha_layer_set_mod_params(to, p, count);
    free(p);
    return st;
}

// The options that make the layer again, as given ("--window 2,0 --alibi"), into @p buf.
static const char *redesc_flags(const run_opts *o, char *buf, size_t size) {
    snprintf(buf, size, "%s%s%s%s%s%s%s%s%s", o->window_opt ? " --window " : "",
             o->window_opt ? o->window_opt : "", o->softcap_opt ? " --softcap " : "",
             o->softcap_opt ? o->softcap_opt : "", o->alibi ? " --alibi" : "",
             o->mod.source_path ? " --score-mod " : "",
             o->mod.source_path ? o->mod.source_path : "",
             o->mod.params_path ? " --mod-params " : "",
             o->mod.params_path ? o->mod.params_path : "");
    return buf + (buf[0] == ' ');
}

// --window, --softcap, --alibi, --score-mod: the layer again with that window, softcap, ALiBi
// and those user functions in place of the file's (they are part of a layer's descriptor), its
// parameters copied (alibi_slopes too when the file's layer has them).
static bool redesc_layer(const run_opts *o, run_state *s) {
    clmha_layer_desc d = s->desc;
    if (o->window.on) {
        d.window = true;
        d.window_left = o->window.left;
        d.window_right = o->window.right;
    }
    if (o->softcap_opt) d.softcap = o->softcap;
    if (o->alibi) d.alibi = true;
    if (o->mod.source) {
        d.mod_source = o->mod.source;
        d.mod_params = o->mod.params;
        d.mod_params_count = o->mod.count;
    }
    clmha_layer *layer = NULL;
    bool no_memory = false;
    clmha_status st = clmha_layer_create(&layer, s->ctx, &d);
    if (!st) st = copy_parameters(s->layer, layer, o->f64, &no_memory);
    if (!st && !o->mod.source && d.mod_source)  // the file's user functions, kept
        st = copy_mod_params(s->layer, layer, d.mod_params_count, &no_memory);
    if (st) {
        char flags[4096];
        // (A source that does not compile: the message holds the build log.)
        clmha__cli_report("run", "%s: %s%s", redesc_flags(o, flags, sizeof flags),
                          st == CLMHA_BUILD_FAILED && o->mod.source
                              ? "the source does not compile: "
                              : "",
                          no_memory ? "out of host memory" : clmha_context_last_error(s->ctx));
        clmha_layer_release(layer);
        return false;
    }
    clmha_layer_release(s->layer);
    s->layer = layer;
    s->desc = d;
    return true;
}

// The device and the layer file on it (with --window's window, --softcap and --alibi).
static bool open_layer(const run_opts *o, run_state *s) {
    if (!(s->ctx = clmha__cli_open_context("run", o->device))) return false;
    if (clmha_layer_load_prefixed(&s->layer, s->ctx, o->layer_path, &o->load) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "--layer %s: %s", o->layer_path,
                          clmha__cli_without_path(clmha_context_last_error(s->ctx),
                                                  o->layer_path));
        return false;
    }
    s->desc = (clmha_layer_desc){.struct_size = sizeof s->desc};
    if (clmha_layer_get_desc(s->layer, &s->desc) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "--layer %s: %s", o->layer_path,
                          clmha_context_last_error(s->ctx));
        return false;
    }
    if ((o->window.on || o->softcap_opt || o->alibi || o->mod.source) && !redesc_layer(o, s))
        return false;
    // The calls after the first one of a KV cache that holds the whole key put their queries
    // at the cache's end, not at their rows: with a window, ALiBi or user functions (which see
    // the queries' positions) that is not the one-shot call.
    bool windowed = s->desc.window && (s->desc.window_left >= 0 || s->desc.window_right >= 0);
    if (o->chunk && (windowed || s->desc.alibi || s->desc.mod_source) && !o->is_causal) {
        clmha__cli_report("run", "--decode-chunk without --is-causal does not go with %s (%s): "
                          "the later calls' queries would sit at the end of the cache, not at "
                          "their rows",
                          windowed          ? "a sliding window"
                          : s->desc.alibi   ? "ALiBi"
                                            : "user functions",
                          windowed ? (o->window.on ? "--window" : "the layer file's window")
                          : s->desc.alibi ? (o->alibi ? "--alibi" : "the layer file's alibi")
                          : o->mod.source ? "--score-mod"
                                          : "the layer file's mod_source");
        return false;
    }
    return true;
}

// The forward call's arguments, checked one input at a time so that a refusal names its file;
// then the output counts.
static bool build_args(const run_opts *o, run_state *s) {
    const input_file *in = o->in;
    clmha_forward_args *args = &s->args;
    *args = (clmha_forward_args){.struct_size = sizeof *args, .query = tensor_of(&in[IN_QUERY].a),
                                 .seq_lens = o->seq.lens, .kv_seq_lens = o->kv_seq.lens,
                                 .num_seqs = o->seq.count};
    if (in[IN_KEY].path) args->key = tensor_of(&in[IN_KEY].a);
    if (in[IN_VALUE].path) {
        args->value = tensor_of(&in[IN_VALUE].a);
        if (!in[IN_KEY].path) args->key = args->query;  // key defaults to the query
    }
    const char *why = NULL;
    if (clmha_layer_output_counts(s->layer, args, NULL, NULL) != CLMHA_SUCCESS) {
        why = clmha_context_last_error(s->ctx);
        const input_file *culprit = input_culprit(why, in, s->desc.batch_first);
        if (!culprit && o->seq.lens)  // the lengths against each other
            clmha__cli_report("run", "--seq-lens %s: %s", o->seq_lens_opt, why);
        else
            clmha__cli_report("run", "%s %s: %s", culprit ? culprit->flag : "--layer",
                              culprit ? culprit->path : o->layer_path, why);
        return false;
    }
    args->key_padding_mask = mask_of(&in[IN_KPM]);
    if (clmha_layer_output_counts(s->layer, args, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "--key-padding-mask %s: %s", in[IN_KPM].path,
                          clmha_context_last_error(s->ctx));
        return false;
    }
    args->attn_mask = mask_of(&in[IN_ATTN]);
    args->is_causal = o->is_causal;
    if (clmha_layer_output_counts(s->layer, args, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "%s%s: %s", in[IN_ATTN].path ? "--attn-mask " : "--is-causal",
                          in[IN_ATTN].path ? in[IN_ATTN].path : "",
                          clmha_context_last_error(s->ctx));
        return false;
    }
    args->need_weights = o->need_weights;
    args->per_head_weights = o->per_head;
    args->impl = o->impl;
    args->training = o->training;
    args->rng = o->rng;
    if (clmha_layer_output_counts(s->layer, args, &s->y_count, &s->w_count) != CLMHA_SUCCESS) {
        if (o->seq.lens)  // (what a packed call does not take)
            clmha__cli_report("run", "--seq-lens %s: %s", o->seq_lens_opt,
                              clmha_context_last_error(s->ctx));
        else
            clmha__cli_report("run", "%s", clmha_context_last_error(s->ctx));
        return false;
    }
    return true;
}

// The output shapes: the output is shaped like the query (whose last size is E); the weights
// (N, [H,] L, S'), unbatched without N. --heatmap-batch must name a batch item.
static bool plan_shapes(const run_opts *o, run_state *s) {
    const clmha__npy *q = &o->in[IN_QUERY].a;
    bool batched = q->ndim == 3;
    s->n = batched ? q->shape[s->desc.batch_first ? 0 : 1] : 1;
    s->l = batched ? q->shape[s->desc.batch_first ? 1 : 0] : q->shape[0];
    if (o->need_weights) {
        size_t rows = s->n * s->l * (o->per_head ? s->desc.num_heads : 1);
        if (batched) s->w_shape[s->w_ndim++] = s->n;
        if (o->per_head) s->w_shape[s->w_ndim++] = s->desc.num_heads;
        s->w_shape[s->w_ndim++] = s->l;
        s->w_shape[s->w_ndim++] = rows ? s->w_count / rows : 0;
    }
    if (o->heatmap && o->heatmap_batch >= s->n) {
        clmha__cli_report("run", "--heatmap-batch %s: the query holds %zu batch item%s (0 to %zu)",
                          o->heatmap_batch_opt, s->n, s->n == 1 ? "" : "s", s->n - 1);
        return false;
    }
    return true;
}

// Gradients: the gradient inputs' shapes, then the files, checked like the outputs, and the
// saved state the forward call fills. Sets *rc for a usage error.
static bool plan_grads(run_opts *o, run_state *s, int *rc) {
    const clmha__npy *q = &o->in[IN_QUERY].a;
    if (!grad_shape_ok(&o->in[IN_GRAD_OUT], "output is", q->ndim, q->shape) ||
        (o->in[IN_GRAD_W].path &&
         !grad_shape_ok(&o->in[IN_GRAD_W],
                        o->per_head ? "weights (per head) are" : "weights (averaged) are",
                        s->w_ndim, s->w_shape)))
        return false;
    if (!clmha__cli_grads_plan(o->grads_dir, s->layer, &s->args, o->in[IN_KEY].path != NULL,
                               o->in[IN_VALUE].path != NULL, &s->grads))
        return false;
    s->grads.grad_f32 = o->grad_dtype_opt != NULL;
    for (size_t i = 0; i < s->grads.count; ++i)
        if (!clmha__cli_output_path_ok("run", "--grads-dir", s->grads.file[i].path)) return false;
    size_t all = o->num_outs + clmha__cli_grads_outputs(&s->grads, o->outs + o->num_outs);
    if (!clmha__cli_outputs_distinct("run", o->outs, all, o->named_in, IN_COUNT + 3)) {
        *rc = EXIT_USAGE;
        return false;
    }
    if (clmha_saved_create(&s->saved, s->layer) != CLMHA_SUCCESS) {
        clmha__cli_report("run", "%s", clmha_context_last_error(s->ctx));
        return false;
    }
    s->args.save = s->saved;
    return true;
}

// The forward call (in chunks through a KV cache with --decode-chunk), then the backward pass.
static bool compute(const run_opts *o, run_state *s) {
    // (calloc checks the products of counts and sizes.)
    size_t y_alloc = s->y_count ? s->y_count : 1, w_alloc = s->w_count ? s->w_count : 1;
    bool no_memory = o->f64 ? !(s->y64 = calloc(y_alloc, sizeof *s->y64)) ||
                                  (o->need_weights && !(s->w64 = calloc(w_alloc, sizeof *s->w64)))
                            : !(s->y = calloc(y_alloc, sizeof *s->y)) ||
                                  (o->need_weights && !(s->w = calloc(w_alloc, sizeof *s->w)));
    if (no_memory) {
        clmha__cli_report("run", "out of host memory for the outputs (%zu + %zu %s)", s->y_count,
                          s->w_count, o->f64 ? "doubles" : "floats");
        return false;
    }
    if (o->chunk)
        return decode_in_chunks(s->layer, &s->args, &s->desc, (size_t)o->chunk,
                                (size_t)o->page_size, o->kv_dtype,
                                o->f64 ? (void *)s->y64 : (void *)s->y);
    clmha_status st =
        o->f64 ? clmha_layer_forward_host_f64(s->layer, &s->args, s->y64, s->y_count, s->w64,
                                              s->w_count)
               : clmha_layer_forward_host(s->layer, &s->args, s->y, s->y_count, s->w, s->w_count);
    if (st != CLMHA_SUCCESS) {
        clmha__cli_report("run", "forward pass failed on %s: %s: %s",
                          clmha_context_device_name(s->ctx), clmha_status_string(st),
                          clmha_context_last_error(s->ctx));
        return false;
    }
    if (!o->grads_dir) return true;
    // The fused backward gives no mask gradients: with a float mask it runs unfused.
    bool float_mask = s->args.attn_mask.kind == CLMHA_MASK_FLOAT ||
                      s->args.key_padding_mask.kind == CLMHA_MASK_FLOAT;
    clmha_tensor gw = {0};
    if (o->in[IN_GRAD_W].path) gw = tensor_of(&o->in[IN_GRAD_W].a);
    return clmha__cli_grads_compute(
        s->layer, &s->args, s->saved, tensor_of(&o->in[IN_GRAD_OUT].a), gw,
        o->impl == CLMHA_IMPL_FUSED && float_mask ? CLMHA_IMPL_AUTO : o->impl, &s->grads);
}

// --heatmap: the per-head weights of batch item o->heatmap_batch, from one more forward call
// of the same inputs (no saved state), drawn into a temporary file next to the target
// (s->heatmap_tmp), renamed once the other outputs are written.
static bool draw_heatmap(const run_opts *o, run_state *s) {
    clmha_forward_args a = s->args;
    a.need_weights = a.per_head_weights = true;
    a.save = NULL;
    size_t h = s->desc.num_heads;
    size_t wc = 0, yc = 0;
    clmha_status st = clmha_layer_output_counts(s->layer, &a, &yc, &wc);
    size_t per_item = wc / s->n, src = per_item / (h * s->l);
    float *wf = st ? NULL : calloc(wc ? wc : 1, sizeof *wf);
    float *yf = wf && !o->f64 ? calloc(yc ? yc : 1, sizeof *yf) : NULL;
    double *w64 = wf && o->f64 ? calloc(wc ? wc : 1, sizeof *w64) : NULL;
    double *y64 = w64 ? calloc(yc ? yc : 1, sizeof *y64) : NULL;
    bool ok = false;
    if (!st && !(o->f64 ? y64 && w64 : yf && wf)) {
        clmha__cli_report("run", "--heatmap: out of host memory for the weights");
        goto done;
    }
    if (!st) {
        st = o->f64 ? clmha_layer_forward_host_f64(s->layer, &a, y64, yc, w64, wc)
                    : clmha_layer_forward_host(s->layer, &a, yf, yc, wf, wc);
        for (size_t i = 0; !st && w64 && i < wc; ++i) wf[i] = (float)w64[i];
    }
    if (st) {
        clmha__cli_report("run", "--heatmap: forward pass failed on %s: %s: %s",
                          clmha_context_device_name(s->ctx), clmha_status_string(st),
                          clmha_context_last_error(s->ctx));
        goto done;
    }
    char msg[1024];
    if (clmha__heatmap_temp_path(o->heatmap, s->heatmap_tmp, sizeof s->heatmap_tmp, msg,
                                 sizeof msg) ||
        clmha__heatmap_write(s->heatmap_tmp, wf + (size_t)o->heatmap_batch * per_item, h, s->l,
                             src, msg, sizeof msg)) {
        clmha__cli_report("run", "--heatmap %s: %s", o->heatmap, msg);
        if (s->heatmap_tmp[0]) unlink(s->heatmap_tmp);
        s->heatmap_tmp[0] = '\0';
        goto done;
    }
    ok = true;
done:
    free(wf);
    free(yf);
    free(w64);
    free(y64);
    return ok;
}

// Every .npy file at once, all or none; then the heatmap's rename.
static bool write_files(run_opts *o, run_state *s) {
    const clmha__npy *q = &o->in[IN_QUERY].a;
    bool half = o->dtype == CLMHA_DTYPE_F16;
    size_t n = 0;
    if (o->output_path) {
        o->outs[n] = (clmha__cli_out){.flag = "--output", .path = o->output_path, .data = s->y,
                                      .f64 = s->y64, .ndim = q->ndim, .half = half};
        memcpy(o->outs[n++].shape, q->shape, q->ndim * sizeof *q->shape);
    }
    if (o->weights_path) {
        o->outs[n] = (clmha__cli_out){.flag = "--weights-output", .path = o->weights_path,
                                      .data = s->w, .f64 = s->w64, .ndim = s->w_ndim,
                                      .half = half};
        memcpy(o->outs[n++].shape, s->w_shape, s->w_ndim * sizeof *s->w_shape);
    }
    n += clmha__cli_grads_outputs(&s->grads, o->outs + n);
    if (!clmha__cli_write_outputs("run", o->outs, n)) return false;
    if (s->heatmap_tmp[0]) {
        if (rename(s->heatmap_tmp, o->heatmap) != 0) {
            clmha__cli_report("run", "--heatmap %s: %s (the other outputs were written)",
                              o->heatmap, strerror(errno));
            return false;
        }
        s->heatmap_tmp[0] = '\0';
    }
    return true;
}

// A summary of the results not written to a file.
static void print_summary(const run_opts *o, const run_state *s) {
    bool show_y = !o->output_path, show_w = o->need_weights && !o->weights_path;
    if (!show_y && !show_w) return;
    const clmha__npy *q = &o->in[IN_QUERY].a;
    const clmha_layer_desc *d = &s->desc;
    char sh[160];
    printf("device:  %s\n", clmha_context_device_name(s->ctx));
    char window[64] = "", softcap[48] = "";
    if (d->window)
        snprintf(window, sizeof window, ", window %lld,%lld", (long long)d->window_left,
                 (long long)d->window_right);
    if (d->softcap > 0.0) snprintf(softcap, sizeof softcap, ", softcap %.9g", d->softcap);
    printf("layer:   embed_dim %zu, num_heads %zu, kdim %zu, vdim %zu%s%s%s%s%s%s%s%s%s%s\n",
           d->embed_dim, d->num_heads, d->kdim, d->vdim, d->bias ? ", bias" : "",
           d->add_bias_kv ? ", add_bias_kv" : "", d->add_zero_attn ? ", add_zero_attn" : "",
           d->batch_first ? ", batch_first" : "", window, softcap, d->alibi ? ", alibi" : "",
           d->sinks ? ", sinks" : "", o->mod.source_path ? ", score-mod " : "",
           o->mod.source_path ? o->mod.source_path : "");
    if (o->seq.lens)
        printf("query:   %s (T, E) packed, %zu sequences\n",
               clmha__shape_str(sh, sizeof sh, q->ndim, q->shape), o->seq.count);
    else
        printf("query:   %s%s\n", clmha__shape_str(sh, sizeof sh, q->ndim, q->shape),
               q->ndim == 3 ? (d->batch_first ? " (N, L, E)" : " (L, N, E)")
                            : " (L, E) unbatched");
    if (show_y) print_values("output:", (values){s->y, s->y64}, s->y_count, q->ndim, q->shape, "");
    if (show_w)
        print_values("weights:", (values){s->w, s->w64}, s->w_count, s->w_ndim, s->w_shape,
                     o->per_head ? " per head" : " averaged over the heads");
}

int clmha__cli_run(int argc, char **argv) {
    run_opts o = {.in = {
                      [IN_QUERY] = {.flag = "--query"},
                      [IN_KEY] = {.flag = "--key"},
                      [IN_VALUE] = {.flag = "--value"},
                      [IN_KPM] = {.flag = "--key-padding-mask", .is_mask = true},
                      [IN_ATTN] = {.flag = "--attn-mask", .is_mask = true},
                      [IN_GRAD_OUT] = {.flag = "--grad-output"},
                      [IN_GRAD_W] = {.flag = "--grad-weights"},
                  }};
    int rc;
    if (!parse_command_line(argc, argv, &o, &rc)) return rc;
    if (!check_options(&o)) {
        free(o.seq.lens);
        free(o.kv_seq.lens);
        return EXIT_USAGE;
    }
    run_state s = {0};
    rc = EXIT_REFUSED;
    if (!read_files(&o) || !open_layer(&o, &s) || !build_args(&o, &s) || !plan_shapes(&o, &s) ||
        (o.grads_dir && !plan_grads(&o, &s, &rc)) || !compute(&o, &s) ||
        (o.heatmap && !draw_heatmap(&o, &s)) || !write_files(&o, &s))
        goto done;
    warn_nonfinite((values){s.y, s.y64}, s.y_count, (values){s.w, s.w64}, s.w_count, o.in,
                   o.dtype);
    print_summary(&o, &s);
    rc = EXIT_OK;
done:
    if (s.heatmap_tmp[0]) unlink(s.heatmap_tmp);
    free(s.y);
    free(s.w);
    free(s.y64);
    free(s.w64);
    clmha__cli_grads_free(&s.grads);
    clmha_saved_release(s.saved);
    clmha_layer_release(s.layer);
    clmha_context_release(s.ctx);
    for (int i = 0; i < IN_COUNT; ++i) clmha__npy_free(&o.in[i].a);
    clmha__cli_mod_free(&o.mod);
    free(o.seq.lens);
    free(o.kv_seq.lens);
    return rc;
}
