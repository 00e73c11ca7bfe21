// `clmha sdpa`: scaled dot-product attention (PyTorch's F.scaled_dot_product_attention) on .npy
// arrays, through the public attention-as-a-function calls (clmha_attention_output_counts,
// clmha_attention_forward_host, clmha_attention_backward_host; with --sinks the backward on
// device buffers, clmha_attention_forward and clmha_attention_backward, for the sinks'
// gradient, which the host form does not give); .npy outputs. With
// --kv-cache-prefix, incremental decoding: the sequence goes through a KV cache
// (clmha_kv_cache_create_for, clmha_attention_args::kv_cache) in a prefix call and then one call
// per token, whose outputs are put together.
#define _POSIX_C_SOURCE 200809L

#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/half.h"
#include "base/message.h"
#include "grads.h"
#include "npy.h"
#include "outputs.h"

// The help text, in parts (ISO C compilers need support string literals of 4095 bytes only).
static const char *const usage_sdpa[] = {
    "usage: clmha sdpa --query Q.npy --key K.npy --value V.npy [options]\n"
    "\n"
    "Computes PyTorch's F.scaled_dot_product_attention(query, key, value, attn_mask,\n"
    "dropout_p, is_causal, scale, enable_gqa) on the arrays of .npy files, on an OpenCL\n"
    "device: softmax(query @ key^T * scale + mask) @ value for every batch item and head,\n"
    "and optionally its backward pass. The tensors are already projected and split into\n"
    "heads (no layer file: see clmha run for nn.MultiheadAttention).\n"
    "\n"
    "inputs (float32; float64 and float16 files are read and rounded to float32; with\n"
    "--dtype f64 every float file is read as float64, exactly; with --dtype f16 or bf16\n"
    "rounded to that dtype):\n"
    "  --query Q.npy             (N, H, L, D), or (H, L, D) unbatched (required)\n"
    "  --key K.npy               (N, H_kv, S, D), or (H_kv, S, D) (required)\n"
    "  --value V.npy             (N, H_kv, S, D_v), or (H_kv, S, D_v) (required; D_v may\n"
    "                            differ from D)\n"
    "  --layout nhld|nlhd        the order of query, key, value and output: nhld (default,\n"
    "                            PyTorch's SDPA) or nlhd (FlashAttention's flash_attn_func:\n"
    "                            query (N, L, H, D), key and value (N, S, H_kv, D))\n"
    "  --attn-mask A.npy         bool/uint8: true (non-zero) = may attend (SDPA's polarity,\n"
    "                            the opposite of clmha run's); float: added to the scaled\n"
    "                            scores (-inf forbids). Shapes, whatever --layout, as SDPA\n"
    "                            broadcasts them to (N, H, L, S): (a, b, c, S) with a 1 or\n"
    "                            N, b 1 or H, c 1 or L, leading ones optional: (L, S),\n"
    "                            (N, 1, L, S), (1, H, L, S), (N, H, 1, S), (S,), ...; not\n"
    "                            over the keys (a last dimension of 1: expand it to S).\n"
    "                            Unbatched inputs take at most 3-D masks\n"
    "  --is-causal               mask key j > query i (top-left aligned, as SDPA); not with\n"
    "                            --attn-mask (as SDPA)\n"
    "  --seq-lens 5,3,7          a packed batch (flash_attn_varlen_func's): query (T, H, D),\n"
    "                            key and value (T_kv, H_kv, D), the sequences one after\n"
    "                            another, each attending only within itself; output\n"
    "                            (T, H, D_v), --lse-output (H*T): each sequence's (H, L_i)\n"
    "                            block in turn. Not with --attn-mask, --weights-output or\n"
    "                            --kv-cache-prefix\n"
    "  --kv-seq-lens 4,9,2       a packed batch's key/value lengths; default: --seq-lens\n"
    "  --window LEFT,RIGHT       sliding window (FlashAttention's window_size): query i\n"
    "                            attends key j only when i-LEFT <= j <= i+RIGHT (-1: that\n"
    "                            side unbounded); combines with --attn-mask and --is-causal\n"
    "  --softcap C               soft-cap every scaled score s to C*tanh(s/C) (FlashAttention's\n"
    "                            softcap), before ALiBi and the mask; 0: off\n"
    "  --alibi                   ALiBi: the score of query head h, query i, key j gains\n"
    "                            -slope_h*|i-j| (after soft-capping, before the mask)\n"
    "  --alibi-slopes A.npy      with --alibi: the slopes, (H) float32; default: the ALiBi\n"
    "                            paper's geometric slopes (2^(-8(h+1)/H) for H a power of 2)\n"
    "  --sinks S.npy             attention sinks (gpt-oss's): (H) float32, one logit per query\n"
    "                            head added to every row's softmax denominator, with no value\n"
    "                            (a row's weights sum below 1; the log-sum-exp includes it)\n",
    "  --score-mod FILE.cl       user score and mask functions (FlexAttention's score_mod\n"
    "                            and mask_mod), OpenCL C compiled into the kernels\n"
    "                            (clmha_attention_args::mod_source): clmha_score_mod(s, b,\n"
    "                            h, q, k, p) the new score (after --softcap and --alibi,\n"
    "                            before the mask), clmha_score_mod_grad(s, b, h, q, k, p) its\n"
    "                            derivative in s (the gradients need it), clmha_mask_mod(b,\n"
    "                            h, q, k, p) non-zero where query q may attend key k; h is\n"
    "                            the query head (see clmha run --help for the signatures).\n"
    "                            A source that does not compile is refused with the build log\n"
    "  --mod-params P.npy        their p: a 1-D float32 (or float64, float16) array; default:\n"
    "                            none (p empty). Needs --score-mod\n"
    "  --scale S                 the factor of the scores (default 1/sqrt(D)): a finite,\n"
    "                            non-zero number\n"
    "  --enable-gqa              grouped-query attention: H_kv may divide H (query head h\n"
    "                            reads key/value head h / (H / H_kv)); without it H_kv = H\n"
    "  --dropout-p P             drop each attention weight with probability P in [0, 1)\n"
    "                            (default 0), drawn from clmha's Philox stream (not PyTorch's\n"
    "                            generator); the backward pass replays it\n"
    "  --seed S, --offset O      the dropout stream's key and offset (default 0); need\n"
    "                            --dropout-p\n"
    "\n",
    "outputs (float32):\n"
    "  --output O.npy            the attention output, in the query's shape and layout (D_v\n"
    "                            last)\n"
    "  --lse-output LSE.npy      the log-sum-exp of every score row (natural log of the sum\n"
    "                            of exp(score), scores scaled and masked, before dropout):\n"
    "                            (N, H, L), or (H, L) unbatched, whatever --layout; -inf for\n"
    "                            a fully masked row (both cores write it; with\n"
    "                            --weights-output the unfused core)\n"
    "  --weights-output W.npy    the attention weights (after dropout): (N, H, L, S), or\n"
    "                            (H, L, S) unbatched, whatever --layout. The unfused core\n"
    "                            returns them: not with --impl fused\n"
    "\n"
    "gradients (the backward pass, after the forward pass with the same inputs and dropout):\n"
    "  --grad-output G.npy       the gradient of the output, in the output's shape\n"
    "  --grads-dir DIR           an existing folder (it is not created) that receives the\n"
    "                            gradients, float32, each in its input's shape and layout:\n"
    "                            query.npy, key.npy, value.npy (with --enable-gqa a key/value\n"
    "                            head's gradient sums its query heads'), and attn_mask.npy\n"
    "                            for a float mask (summed over the dimensions it is broadcast\n"
    "                            along; boolean masks have no gradient), sinks.npy (H) with\n"
    "                            --sinks. Other files in DIR are left alone. --grad-output\n"
    "                            and --grads-dir go together. Fully masked query rows get\n"
    "                            zero gradients.\n"
    "\n"
    "incremental decoding (FlashAttention's flash_attn_with_kvcache):\n"
    "  --kv-cache-prefix P       run the attention as decoding through a KV cache made for\n"
    "                            the call (clmha_kv_cache_create_for, capacity S): query, key\n"
    "                            and value hold one whole sequence per batch item (L = S);\n"
    "                            tokens [0, P) go in one call, then each later token t in a\n"
    "                            call of its own (query row t, key/value token t appended to\n"
    "                            the cache). --output gets their outputs put together, in the\n"
    "                            one-shot call's shape. is_causal is bottom-right aligned\n"
    "                            there, so with --is-causal the output is the one-shot causal\n"
    "                            call's; without it the prefix's queries see the whole prefix\n"
    "                            and token t's query tokens 0..t. 1 <= P <= S, D_v = D. Every\n"
    "                            call runs the decode core: not with --attn-mask,\n"
    "                            --dropout-p, --lse-output, --weights-output, --grad-output\n"
    "                            or --impl fused|unfused. The summary on stdout (without\n"
    "                            --output) counts the calls\n"
    "  --page-size P             with --kv-cache-prefix: a paged cache of P-token pages (a\n"
    "                            power of two from 8): the same output\n"
    "  --kv-dtype K              with --kv-cache-prefix: how the cache stores keys and\n"
    "                            values: f32, f16, bf16, int8 or int4 (docs/accuracy.md)\n"
    "\n"
    "  Files are written only after the forward (and backward) pass succeeded, each whole or\n"
    "  not at all, and all of them or none: a failed run leaves every file as it was. An\n"
    "  output may be a new file or an existing regular file (not a folder, FIFO, device or\n"
    "  symbolic link), and neither an input nor another output. Inputs must be regular files.\n"
    "  A query row whose every key is masked gets zeros (PyTorch's math backend gives NaN).\n"
    "  NaN/Inf in the output gives a warning on stderr; the exit status stays 0.\n"
    "  Results not written to a file are summarised on stdout (shape, first values).\n"
    "\n",
    "device:\n"
    "  --device SPEC             \"P:D\", gpu, cpu, accelerator or part of a device name\n"
    "                            (see clmha devices); default: $CLMHA_DEVICE, else the first\n"
    "                            GPU, else the first device\n"
    "  --dtype f32|f64|f16|bf16  the element type of the call (clmha_attention_args::dtype):\n"
    "                            f32 (default); f64: the float inputs read as float64,\n"
    "                            computed in float64 on a device with double precision\n"
    "                            (clmha devices: fp64 yes), the outputs and gradients\n"
    "                            written as float64 ('<f8'), a KV cache of doubles; f16,\n"
    "                            bf16: the inputs rounded to the dtype, computed in float32,\n"
    "                            each result rounded once and written as float16 ('<f2') or\n"
    "                            as float32 files of bfloat16 values. --mod-params stays\n"
    "                            float32\n"
    "  --impl auto|fused|unfused the attention core of the forward pass: fused streams key\n"
    "                            tiles and never stores the scores; auto (default) is fused,\n"
    "                            unfused where the fused core cannot run or for\n"
    "                            --weights-output. The gradients come from the fused\n"
    "                            core's backward pass where it runs (no float mask's\n"
    "                            gradient asked), else the unfused one's\n"
    "\n"
    "  --help, -h                print this help\n"
    "\n"
    "exit status: 0 success, 1 refused input (bad file, shape mismatch, device error) or\n"
    "stdout not written, 2 usage error. Options take their value as --opt VALUE or --opt=VALUE.\n"};

// One .npy input.
typedef struct sdpa_input {
    const char *flag;  // "--query"
    const char *path;  // NULL when not given
    bool is_mask;      // bool/uint8 allowed, 1 to 4 dimensions
    bool is_vector;    // one dimension (--alibi-slopes, --sinks)
    clmha__npy a;
} sdpa_input;

enum { IN_QUERY, IN_KEY, IN_VALUE, IN_ATTN, IN_GRAD_OUT, IN_SLOPES, IN_SINKS, IN_COUNT };

// The command line, and what follows from it before any file is read.
typedef struct sdpa_opts {
    sdpa_input in[IN_COUNT];
    const char *output_path, *lse_path, *weights_path, *grads_dir, *device;
    const char *scale_opt, *layout_opt, *impl_opt, *dropout_opt, *seed_opt, *offset_opt;
    const char *kv_prefix_opt;  // --kv-cache-prefix
    const char *dtype_opt;      // --dtype
    clmha_dtype dtype;          // the call's (clmha_attention_args::dtype)
    bool f64;                   // --dtype f64: the call, its files and results in float64
    const char *page_opt, *kv_dtype_opt;  // --page-size, --kv-dtype (the cache's)
    uint64_t page_size;         // 0: a contiguous cache
    clmha_kv_dtype kv_dtype;
    const char *window_opt, *softcap_opt, *seq_lens_opt, *kv_seq_lens_opt;
    clmha__cli_lens seq, kv_seq;  // --seq-lens, --kv-seq-lens (a packed batch)
    clmha__cli_window window;   // --window
    clmha__cli_mod mod;         // --score-mod, --mod-params
    double softcap;             // --softcap (0: off)
    bool is_causal, enable_gqa, alibi;
    uint64_t kv_prefix;         // P; 0: one call
    double scale;  // 0: 1/sqrt(D)
    float dropout_p;
    clmha_attention_layout layout;
    clmha_impl impl;
    clmha_dropout_rng rng;
    clmha__cli_in named_in[IN_COUNT + 2];  // the .npy inputs, --score-mod, --mod-params
    clmha__cli_out outs[3 + CLMHA__CLI_MAX_GRADS];
    size_t num_outs;  // the output, the log-sum-exp and the weights; the gradients join later
} sdpa_opts;

// What a run holds once the device is open.
typedef struct sdpa_state {
    clmha_context *ctx;
    clmha_attention_args args;
    size_t y_count, lse_count, w_count;
    size_t y_ndim, y_shape[4], lse_ndim, lse_shape[4], w_ndim, w_shape[4];
    void *y, *lse, *w;  // floats, or doubles with --dtype f64 (o.f64)
    clmha__cli_grads grads;  // query, key, value, attn_mask (float masks), sinks
    size_t calls;            // forward calls that ran
    const char *mod_path;    // --score-mod (NULL: none), for a build failure's report
} sdpa_state;

// ---- the command line --------------------------------------------------------------------------

// Parses the command line into @p o. Returns true when the command goes on; else false with
// *rc EXIT_OK (after --help) or EXIT_USAGE (after reporting).
static bool parse_command_line(int argc, char **argv, sdpa_opts *o, int *rc) {
    const clmha__cli_option opts[] = {
        {.name = "--query", .value = &o->in[IN_QUERY].path},
        {.name = "--key", .value = &o->in[IN_KEY].path},
        {.name = "--value", .value = &o->in[IN_VALUE].path},
        {.name = "--attn-mask", .value = &o->in[IN_ATTN].path},
        {.name = "--is-causal", .flag = &o->is_causal},
        {.name = "--seq-lens", .value = &o->seq_lens_opt},
        {.name = "--kv-seq-lens", .value = &o->kv_seq_lens_opt},
        {.name = "--window", .value = &o->window_opt},
        {.name = "--softcap", .value = &o->softcap_opt},
        {.name = "--alibi", .flag = &o->alibi},
        {.name = "--alibi-slopes", .value = &o->in[IN_SLOPES].path},
        {.name = "--sinks", .value = &o->in[IN_SINKS].path},
        {.name = "--score-mod", .value = &o->mod.source_path},
        {.name = "--mod-params", .value = &o->mod.params_path},
        {.name = "--scale", .value = &o->scale_opt},
        {.name = "--enable-gqa", .flag = &o->enable_gqa},
        {.name = "--layout", .value = &o->layout_opt},
        {.name = "--dropout-p", .value = &o->dropout_opt},
        {.name = "--seed", .value = &o->seed_opt},
        {.name = "--offset", .value = &o->offset_opt},
        {.name = "--output", .value = &o->output_path},
        {.name = "--lse-output", .value = &o->lse_path},
        {.name = "--weights-output", .value = &o->weights_path},
        {.name = "--grad-output", .value = &o->in[IN_GRAD_OUT].path},
        {.name = "--grads-dir", .value = &o->grads_dir},
        {.name = "--impl", .value = &o->impl_opt},
        {.name = "--dtype", .value = &o->dtype_opt},
        {.name = "--kv-cache-prefix", .value = &o->kv_prefix_opt},
        {.name = "--page-size", .value = &o->page_opt},
        {.name = "--kv-dtype", .value = &o->kv_dtype_opt},
        {.name = "--device", .value = &o->device, .allow_empty = true},
    };
    char usage[4 * 4096] = "";  // room for the four parts (each under 4095 bytes)
    for (size_t i = 0; i < sizeof usage_sdpa / sizeof usage_sdpa[0]; ++i)
        strncat(usage, usage_sdpa[i], sizeof usage - strlen(usage) - 1);
    if (!clmha__cli_parse_options("sdpa", argc, argv, opts, sizeof opts / sizeof opts[0], usage,
                                  rc))
        return false;
    *rc = EXIT_USAGE;
    const char *missing[3];
    size_t n = 0;
    for (int i = IN_QUERY; i <= IN_VALUE; ++i)
        if (!o->in[i].path) missing[n++] = o->in[i].flag;
    if (n == 0) return true;
    // "--key is", "--key and --value are", "--query, --key and --value are"
    clmha__cli_report("sdpa", "%s%s%s%s%s %s required (try 'clmha sdpa --help')", missing[0],
                      n == 3 ? ", " : n == 2 ? " and " : "", n > 1 ? missing[1] : "",
                      n == 3 ? " and " : "", n == 3 ? missing[2] : "", n > 1 ? "are" : "is");
    return false;
}

// --scale (a finite non-zero number) and --dropout-p (in [0, 1)). Reports a usage error.
static bool parse_numbers(sdpa_opts *o) {
    char *end = NULL;
    if (o->scale_opt) {
        errno = 0;
        o->scale = strtod(o->scale_opt, &end);
        if (*end || errno || !isfinite(o->scale) || o->scale == 0) {
            clmha__cli_report("sdpa", "--scale '%s': expected a finite, non-zero number%s",
                              o->scale_opt,
                              !*end && o->scale == 0 ? " (leave --scale out for 1/sqrt(D))"
                                                     : "");
            return false;
        }
    }
    if (o->dropout_opt) {
        errno = 0;
        double p = strtod(o->dropout_opt, &end);
        if (*end || errno || !(p >= 0 && p < 1)) {
            clmha__cli_report("sdpa", "--dropout-p '%s': expected a number in [0, 1)",
                              o->dropout_opt);
            return false;
        }
        o->dropout_p = (float)p;
        if (o->dropout_p >= 1.0f) o->dropout_p = nextafterf(1.0f, 0.0f);  // 0.99999999 rounds up
    }
    if ((o->seed_opt || o->offset_opt) && !o->dropout_opt) {
        clmha__cli_report("sdpa", "--seed and --offset need --dropout-p");
        return false;
    }
    return clmha__cli_parse_u64("sdpa", "--seed", o->seed_opt, &o->rng.seed) &&
           clmha__cli_parse_u64("sdpa", "--offset", o->offset_opt, &o->rng.offset);
}

// The options that go together or not: the cores' outputs, --is-causal with a mask, the
// gradient pair. Reports a usage error.
static bool options_agree(const sdpa_opts *o) {
    const char *why = NULL;
    bool grad_out = o->in[IN_GRAD_OUT].path != NULL;
    if (o->is_causal && o->in[IN_ATTN].path)
        why = "--is-causal and --attn-mask do not go together (as in "
              "scaled_dot_product_attention): give one (a causal mask can be part of the "
              "attn_mask)";
    else if (grad_out && !o->grads_dir)
        why = "--grad-output needs --grads-dir (where the gradients go)";
    else if (o->grads_dir && !grad_out)
        why = "--grads-dir needs --grad-output (the output's gradient)";
    else if (o->in[IN_SLOPES].path && !o->alibi)
        why = "--alibi-slopes needs --alibi (the slopes are ALiBi's)";
    else if (o->kv_seq_lens_opt && !o->seq_lens_opt)
        why = "--kv-seq-lens needs --seq-lens (the queries' lengths)";
    else if (o->kv_seq.lens && o->kv_seq.count != o->seq.count)
        why = "--seq-lens and --kv-seq-lens must give as many lengths (one per sequence)";
    else if (o->seq.lens && (o->weights_path || o->kv_prefix_opt || o->in[IN_ATTN].path))
        why = o->weights_path   ? "--seq-lens does not go with --weights-output (a packed call "
                                  "returns no weights)"
              : o->kv_prefix_opt ? "--seq-lens does not go with --kv-cache-prefix"
                                 : "--seq-lens does not go with --attn-mask (it has no "
                                   "per-sequence shape)";
    if (why) clmha__cli_report("sdpa", "%s", why);
    return !why;
}

// --dtype (f32, f64, f16, bf16, as run's). Reports a usage error.
static bool parse_dtype(sdpa_opts *o) {
    if (!clmha__cli_parse_dtype("sdpa", o->dtype_opt, &o->dtype)) return false;
    o->f64 = o->dtype == CLMHA_DTYPE_F64;
    return true;
}

// --kv-cache-prefix P (at least 1), refused with the options that calls through a KV cache do
// not take. Reports a usage error.
static bool kv_options_agree(sdpa_opts *o) {
    if ((o->page_opt || o->kv_dtype_opt) && !o->kv_prefix_opt) {
        clmha__cli_report("sdpa", "%s needs --kv-cache-prefix (it is the KV cache's)",
                          o->page_opt ? "--page-size" : "--kv-dtype");
        return false;
    }
    if (!clmha__cli_parse_u64("sdpa", "--page-size", o->page_opt, &o->page_size) ||
        !clmha__cli_parse_kv_dtype("sdpa", o->kv_dtype_opt, &o->kv_dtype))
        return false;
    if (o->page_opt && (o->page_size < 8 || (o->page_size & (o->page_size - 1)))) {
        clmha__cli_report("sdpa", "--page-size %s: expected a power of two from 8", o->page_opt);
        return false;
    }
    if (!o->kv_prefix_opt) return true;
    if (!clmha__cli_parse_u64("sdpa", "--kv-cache-prefix", o->kv_prefix_opt, &o->kv_prefix))
        return false;
    if (o->kv_prefix == 0) {
        clmha__cli_report("sdpa", "--kv-cache-prefix '%s': expected at least 1 (the tokens of "
                          "the first call)", o->kv_prefix_opt);
        return false;
    }
    const struct {
        bool given;
        const char *flag, *why;
    } refused[] = {
        {o->in[IN_ATTN].path != NULL, "--attn-mask",
         "calls through a KV cache take no mask (only --is-causal)"},
        {o->dropout_opt != NULL, "--dropout-p", "calls through a KV cache take no dropout"},
        {o->lse_path != NULL, "--lse-output", "the decode core writes no log-sum-exp rows"},
        {o->weights_path != NULL, "--weights-output", "the decode core returns no weights"},
        {o->in[IN_GRAD_OUT].path != NULL, "--grad-output",
         "calls through a KV cache have no backward pass"},
        {o->impl != CLMHA_IMPL_AUTO,
         o->impl == CLMHA_IMPL_FUSED ? "--impl fused" : "--impl unfused",
         "the decode core runs every call through a KV cache (leave --impl out)"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; ++i)
        if (refused[i].given) {
            clmha__cli_report("sdpa", "--kv-cache-prefix and %s do not go together: %s",
                              refused[i].flag, refused[i].why);
            return false;
        }
    return true;
}

// Everything about the options that needs no file. Reports a usage error.
static bool check_options(sdpa_opts *o) {
    for (int i = 0; i < IN_COUNT; ++i)
        o->named_in[i] = (clmha__cli_in){o->in[i].flag, o->in[i].path};
    o->named_in[IN_COUNT] = (clmha__cli_in){"--score-mod", o->mod.source_path};
    o->named_in[IN_COUNT + 1] = (clmha__cli_in){"--mod-params", o->mod.params_path};
    const char *flags[3] = {"--output", "--lse-output", "--weights-output"};
    const char *paths[3] = {o->output_path, o->lse_path, o->weights_path};
    for (int i = 0; i < 3; ++i)
        if (paths[i])
            o->outs[o->num_outs++] = (clmha__cli_out){.flag = flags[i], .path = paths[i]};
    if (!clmha__cli_outputs_distinct("sdpa", o->outs, o->num_outs, o->named_in, IN_COUNT + 2))
        return false;
    o->layout = CLMHA_LAYOUT_NHLD;
    if (o->layout_opt && strcmp(o->layout_opt, "nlhd") == 0) {
        o->layout = CLMHA_LAYOUT_NLHD;
    } else if (o->layout_opt && strcmp(o->layout_opt, "nhld") != 0) {
        clmha__cli_report("sdpa", "--layout '%s': expected nhld or nlhd", o->layout_opt);
        return false;
    }
    return clmha__cli_parse_impl("sdpa", o->impl_opt, o->weights_path != NULL,
                                 "--weights-output", &o->impl) &&
           clmha__cli_parse_window("sdpa", o->window_opt, &o->window) &&
           clmha__cli_parse_softcap("sdpa", o->softcap_opt, &o->softcap) && parse_numbers(o) &&
           clmha__cli_parse_lens("sdpa", "--seq-lens", o->seq_lens_opt, &o->seq) &&
           clmha__cli_parse_lens("sdpa", "--kv-seq-lens", o->kv_seq_lens_opt, &o->kv_seq) &&
           options_agree(o) && kv_options_agree(o) && parse_dtype(o) &&
           clmha__cli_mod_options_ok("sdpa", &o->mod);
}

// ---- the files ---------------------------------------------------------------------------------

// Reads one input, float arrays as doubles with @p f64 (--dtype f64: exactly); reports and
// returns false when it is refused. float64 values beyond float32's range (read as +-inf
// without @p f64) give a warning.
static bool read_input(sdpa_input *in, bool f64) {
    char msg[1024] = "";
    clmha_status st = f64 ? clmha__npy_read_f64(in->path, &in->a, msg, sizeof msg)
                          : clmha__npy_read(in->path, &in->a, msg, sizeof msg);
    if (st != CLMHA_SUCCESS) {
        clmha__cli_report("sdpa", "%s %s: %s", in->flag, in->path,
                          msg[0] ? clmha__cli_without_path(msg, in->path) : "cannot read the file");
        return false;
    }
    size_t lo = in->is_mask || in->is_vector ? 1 : 3, hi = in->is_vector ? 1 : 4,
           nd = in->a.ndim;
    if (nd < lo || nd > hi) {
        char shape[160];
        clmha__cli_report("sdpa", "%s %s: a %zu-D array %s; %s takes %s dimensions", in->flag,
                          in->path, nd, clmha__shape_str_most(shape, sizeof shape, nd, in->a.shape,
                                                          CLMHA__NPY_MAX_DIMS),
                          in->flag,
                          in->is_vector ? "1 (H)" : in->is_mask ? "1 to 4" : "3 (unbatched) or 4");
        return false;
    }
    if (!in->is_mask && in->a.kind != CLMHA__NPY_FLOAT) {  // (--alibi-slopes too)
        clmha__cli_report("sdpa", "%s %s: dtype '%s' is not a float type; %s must be float32 "
                          "(or float64, float16)", in->flag, in->path, in->a.dtype, in->flag);
        return false;
    }
    if (in->a.overflowed)
        clmha__cli_report("sdpa", "warning: %s %s: %zu float64 value%s beyond float32's range, "
                          "read as inf", in->flag, in->path, in->a.overflowed,
                          in->a.overflowed == 1 ? "" : "s");
    return true;
}

// The files, before any device is touched: the outputs' paths, --grads-dir and the inputs.
static bool read_files(sdpa_opts *o) {
    for (size_t i = 0; i < o->num_outs; ++i)
        if (!clmha__cli_output_path_ok("sdpa", o->outs[i].flag, o->outs[i].path)) return false;
    if (o->grads_dir && !clmha__cli_grads_dir_ok("sdpa", o->grads_dir)) return false;
    for (int i = 0; i < IN_COUNT; ++i) {
        if (o->in[i].path && !read_input(&o->in[i], o->f64)) return false;
        // A 16-bit call's float inputs hold its dtype's values (float16 files exactly;
        // float32 files rounded, to nearest even, as PyTorch's .to() rounds).
        float *x = o->in[i].a.f32;
        for (size_t k = 0; x && o->dtype != CLMHA_DTYPE_F32 && k < o->in[i].a.count; ++k)
            x[k] = clmha__dtype_round(o->dtype, x[k]);
    }
    return clmha__cli_mod_read("sdpa", &o->mod);
}

// The axis of the tokens of a 3-D or 4-D query, key, value or output in @p layout.
static size_t seq_axis(size_t ndim, clmha_attention_layout layout) {
    return ndim - (layout == CLMHA_LAYOUT_NLHD ? 3 : 2);
}

// --kv-cache-prefix P on the files: one whole sequence per batch item (L = S), and P <= S.
// Reports a usage error.
static bool kv_shapes_fit(const sdpa_opts *o) {
    const sdpa_input *q = &o->in[IN_QUERY], *k = &o->in[IN_KEY];
    size_t l = q->a.shape[seq_axis(q->a.ndim, o->layout)];
    size_t s = k->a.shape[seq_axis(k->a.ndim, o->layout)];
    if (l != s) {
        clmha__cli_report("sdpa", "--kv-cache-prefix decodes one whole sequence per batch item, "
                          "but --query %s holds L = %zu tokens and --key %s S = %zu (L must "
                          "equal S)", q->path, l, k->path, s);
        return false;
    }
    if (o->kv_prefix > s) {
        clmha__cli_report("sdpa", "--kv-cache-prefix %s: more than the S = %zu tokens of --key "
                          "%s (1 <= P <= S)", o->kv_prefix_opt, s, k->path);
        return false;
    }
    return true;
}

// ---- the call ----------------------------------------------------------------------------------

static clmha_tensor tensor_of(const clmha__npy *a) {
    clmha_tensor t = {.ndim = a->ndim};
    for (size_t i = 0; i < a->ndim && i < 4; ++i) t.shape[i] = a->shape[i];
    t.data = a->kind == CLMHA__NPY_BOOL ? (const void *)a->u8
             : a->f64                   ? (const void *)a->f64
                                        : (const void *)a->f32;
    return t;
}

// The input a library message about the tensors refers to: the query, key or value it starts
// with ("the key and value have 2 heads", "enable_gqa: the key and value's ..." name the key).
static const sdpa_input *input_culprit(const char *msg, const sdpa_opts *o) {
    if (clmha__cli_starts_with(msg, "value") || strstr(msg, "packed call's value"))
        return &o->in[IN_VALUE];
    if (clmha__cli_starts_with(msg, "key") || strstr(msg, "the key and value") ||
        strstr(msg, "packed call's key"))
        return &o->in[IN_KEY];
    return &o->in[IN_QUERY];
}

// The score variants of the call's arguments, each checked so that a refusal names its option:
// the window, soft-capping, ALiBi, the sinks, the user functions.
static bool variant_args(const sdpa_opts *o, sdpa_state *s) {
    const sdpa_input *in = o->in;
    clmha_attention_args *a = &s->args;
    a->window = o->window.on;
    a->window_left = o->window.left;
    a->window_right = o->window.right;
    if (clmha_attention_output_counts(s->ctx, a, NULL, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("sdpa", "--window %s: %s", o->window_opt,
                          clmha_context_last_error(s->ctx));
        return false;
    }
    a->softcap = o->softcap;
    if (clmha_attention_output_counts(s->ctx, a, NULL, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("sdpa", "--softcap %s: %s", o->softcap_opt,
                          clmha_context_last_error(s->ctx));
        return false;
    }
    a->alibi = o->alibi;
    if (in[IN_SLOPES].path) a->alibi_slopes = tensor_of(&in[IN_SLOPES].a);
    if (clmha_attention_output_counts(s->ctx, a, NULL, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("sdpa", "%s%s: %s", in[IN_SLOPES].path ? "--alibi-slopes " : "--alibi",
                          in[IN_SLOPES].path ? in[IN_SLOPES].path : "",
                          clmha_context_last_error(s->ctx));
        return false;
    }
    if (in[IN_SINKS].path) a->sinks = tensor_of(&in[IN_SINKS].a);
    if (clmha_attention_output_counts(s->ctx, a, NULL, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("sdpa", "--sinks %s: %s", in[IN_SINKS].path,
                          clmha_context_last_error(s->ctx));
        return false;
    }
    a->mod_source = o->mod.source;
    s->mod_path = o->mod.source_path;
    if (o->mod.params)
        a->mod_params = (clmha_tensor){.ndim = 1, .shape = {o->mod.count}, .data = o->mod.params};
    if (clmha_attention_output_counts(s->ctx, a, NULL, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("sdpa", "%s%s: %s", o->mod.params_path ? "--mod-params " : "--score-mod ",
                          o->mod.params_path ? o->mod.params_path : o->mod.source_path,
                          clmha_context_last_error(s->ctx));
        return false;
    }
    return true;
}

// The call's arguments, checked in steps so that a refusal names its file or option: the
// tensors, then the mask and is_causal, then the score variants (variant_args()), then the
// other options; then the result counts.
static bool build_args(const sdpa_opts *o, sdpa_state *s) {
    const sdpa_input *in = o->in;
    clmha_attention_args *a = &s->args;
    *a = (clmha_attention_args){.struct_size = sizeof *a, .query = tensor_of(&in[IN_QUERY].a),
                                .key = tensor_of(&in[IN_KEY].a),
                                .value = tensor_of(&in[IN_VALUE].a), .layout = o->layout,
                                .enable_gqa = o->enable_gqa, .seq_lens = o->seq.lens,
                                .kv_seq_lens = o->kv_seq.lens, .num_seqs = o->seq.count,
                                .dtype = o->dtype};
    if (clmha_attention_output_counts(s->ctx, a, NULL, NULL, NULL) != CLMHA_SUCCESS) {
        const char *why = clmha_context_last_error(s->ctx);
        const sdpa_input *culprit = input_culprit(why, o);
        if (o->seq.lens && !strstr(why, "packed call's"))  // the lengths against each other
            clmha__cli_report("sdpa", "--seq-lens %s: %s", o->seq_lens_opt, why);
        else
            clmha__cli_report("sdpa", "%s %s: %s%s", culprit->flag, culprit->path, why,
                              strstr(why, "set enable_gqa") ? " (--enable-gqa)" : "");
        return false;
    }
    size_t d = a->key.shape[a->key.ndim - 1], dv = a->value.shape[a->value.ndim - 1];
    if (o->kv_prefix && dv != d) {
        clmha__cli_report("sdpa", "--value %s: D_v = %zu, the key's D = %zu; calls through a KV "
                          "cache (--kv-cache-prefix) take D_v = D", in[IN_VALUE].path, dv, d);
        return false;
    }
    if (in[IN_ATTN].path) {
        a->attn_mask = (clmha_mask){.kind = in[IN_ATTN].a.kind == CLMHA__NPY_BOOL
                                                ? CLMHA_MASK_BOOL_ATTEND
                                                : CLMHA_MASK_FLOAT,
                                    .tensor = tensor_of(&in[IN_ATTN].a)};
    }
    a->is_causal = o->is_causal;
    if (clmha_attention_output_counts(s->ctx, a, NULL, NULL, NULL) != CLMHA_SUCCESS) {
        clmha__cli_report("sdpa", "%s%s: %s", in[IN_ATTN].path ? "--attn-mask " : "--is-causal",
                          in[IN_ATTN].path ? in[IN_ATTN].path : "",
                          clmha_context_last_error(s->ctx));
        return false;
    }
    if (!variant_args(o, s)) return false;
    a->scale = o->scale;
    a->dropout_p = o->dropout_p;
    a->rng = o->rng;
    a->impl = o->impl;
    if (clmha_attention_output_counts(s->ctx, a, &s->y_count, &s->lse_count, &s->w_count) !=
        CLMHA_SUCCESS) {
        clmha__cli_report("sdpa", "%s", clmha_context_last_error(s->ctx));
        return false;
    }
    return true;
}

// The result shapes: the output is the query's with the value's last size; the log-sum-exp
// (N, H, L) and the weights (N, H, L, S) whatever the layout, unbatched without N.
static void plan_shapes(const sdpa_opts *o, sdpa_state *s) {
    const clmha__npy *q = &o->in[IN_QUERY].a, *k = &o->in[IN_KEY].a, *v = &o->in[IN_VALUE].a;
    size_t nd = q->ndim;
    bool nlhd = o->layout == CLMHA_LAYOUT_NLHD;
    size_t h = q->shape[nd - (nlhd ? 2 : 3)], l = q->shape[nd - (nlhd ? 3 : 2)];
    size_t src = k->shape[nd - (nlhd ? 3 : 2)];
    s->y_ndim = nd;
    memcpy(s->y_shape, q->shape, nd * sizeof *q->shape);
    s->y_shape[nd - 1] = v->shape[nd - 1];
    size_t sizes[4] = {q->shape[0], h, l, src};
    size_t first = nd == 4 ? 0 : 1;  // unbatched: no N
    s->lse_ndim = 3 - first;
    s->w_ndim = 4 - first;
    memcpy(s->lse_shape, sizes + first, s->lse_ndim * sizeof *sizes);
    memcpy(s->w_shape, sizes + first, s->w_ndim * sizeof *sizes);
    if (o->seq.lens) {  // packed: (T, H, D_v), the log-sum-exp blocks as one row of H*T
        s->lse_ndim = 1;
        s->lse_shape[0] = s->lse_count;
    }
}

// Gradients: --grad-output's shape, the files (query, key, value, and attn_mask for a float
// mask), checked like the outputs. Sets *rc for a usage error.
static bool plan_grads(sdpa_opts *o, sdpa_state *s, int *rc) {
    const sdpa_input *g = &o->in[IN_GRAD_OUT];
    bool same = g->a.ndim == s->y_ndim;
    for (size_t i = 0; same && i < s->y_ndim; ++i) same = g->a.shape[i] == s->y_shape[i];
    if (!same) {
        char got[160], want[160];
        clmha__cli_report("sdpa", "--grad-output %s: shape %s, but the output is %s", g->path,
                          clmha__shape_str(got, sizeof got, g->a.ndim, g->a.shape),
                          clmha__shape_str(want, sizeof want, s->y_ndim, s->y_shape));
        return false;
    }
    const clmha_attention_args *a = &s->args;
    s->grads.dtype = o->dtype;  // a float16 call's gradient files are '<f2'
    bool ok = clmha__cli_grads_add(&s->grads, o->grads_dir, "query", a->query.ndim,
                                   a->query.shape) &&
              clmha__cli_grads_add(&s->grads, o->grads_dir, "key", a->key.ndim, a->key.shape) &&
              clmha__cli_grads_add(&s->grads, o->grads_dir, "value", a->value.ndim,
                                   a->value.shape) &&
              (a->attn_mask.kind != CLMHA_MASK_FLOAT ||
               clmha__cli_grads_add(&s->grads, o->grads_dir, "attn_mask",
                                    a->attn_mask.tensor.ndim, a->attn_mask.tensor.shape)) &&
              (!a->sinks.ndim || clmha__cli_grads_add(&s->grads, o->grads_dir, "sinks", 1,
                                                      a->sinks.shape));
    if (!ok) {
        clmha__cli_report("sdpa", "out of memory");
        return false;
    }
    for (size_t i = 0; i < s->grads.count; ++i)
        if (!clmha__cli_output_path_ok("sdpa", "--grads-dir", s->grads.file[i].path))
            return false;
    size_t all = o->num_outs + clmha__cli_grads_outputs(&s->grads, o->outs + o->num_outs);
    if (!clmha__cli_outputs_distinct("sdpa", o->outs, all, o->named_in, IN_COUNT + 2)) {
        *rc = EXIT_USAGE;
        return false;
    }
    return true;
}

// Reports a failed call; a user source that does not compile (the kernels are built on the
// first call) is named, with the build log the message holds.
static bool call_failed(const sdpa_state *s, const char *what, clmha_status st) {
    if (st == CLMHA_BUILD_FAILED && s->mod_path)
        clmha__cli_report("sdpa", "--score-mod %s: the source does not compile (%s on %s): %s",
                          s->mod_path, what, clmha_context_device_name(s->ctx),
                          clmha_context_last_error(s->ctx));
    else
        clmha__cli_report("sdpa", "%s failed on %s: %s: %s", what,
                          clmha_context_device_name(s->ctx), clmha_status_string(st),
                          clmha_context_last_error(s->ctx));
    return false;
}

// ---- incremental decoding (--kv-cache-prefix) ---------------------------------------------------

// A query, key, value or output as (outer, seq, inner) floats: (N·H, L, D) in nhld, (N, L, H·D)
// in nlhd.
typedef struct token_rows {
    size_t outer, seq, inner;
} token_rows;

static token_rows rows_of(const clmha_tensor *t, clmha_attention_layout layout) {
    size_t axis = seq_axis(t->ndim, layout);
    token_rows r = {1, t->shape[axis], 1};
    for (size_t i = 0; i < axis; ++i) r.outer *= t->shape[i];
    for (size_t i = axis + 1; i < t->ndim; ++i) r.inner *= t->shape[i];
    return r;
}

// Tokens [t0, t0 + len) of a whole tensor (rows @p r, elements of @p es bytes) to a part
// (outer, len, inner); with @p scatter, from the part into the whole tensor.
static void copy_tokens(const void *from, void *to, size_t es, token_rows r, size_t t0,
                        size_t len, bool scatter) {
    size_t n = len * r.inner;
    for (size_t i = 0; i < r.outer; ++i) {
        size_t whole = (i * r.seq + t0) * r.inner, part = i * n;
        memcpy((char *)to + (scatter ? whole : part) * es,
               (const char *)from + (scatter ? part : whole) * es, n * es);
    }
}

// One call through @p cache: tokens [t0, t0 + len) of the query, key and value (copied to
// @p part[0..2], rows @p r[0..2]), its output (@p part[3], rows @p r[3]) into s->y.
static bool decode_call(const sdpa_opts *o, sdpa_state *s, clmha_kv_cache *cache,
                        const token_rows *r, void *const *part, size_t t0, size_t len) {
    clmha_attention_args call = s->args;
    clmha_tensor *t[3] = {&call.query, &call.key, &call.value};
    size_t es = o->f64 ? sizeof(double) : sizeof(float);  // the host arrays' elements
    for (int i = 0; i < 3; ++i) {
        copy_tokens(t[i]->data, part[i], es, r[i], t0, len, false);
        t[i]->shape[seq_axis(t[i]->ndim, o->layout)] = len;
        t[i]->data = part[i];
    }
    call.kv_cache = cache;
    size_t count = r[3].outer * len * r[3].inner;
    clmha_status st =
        o->f64 ? clmha_attention_forward_host_f64(s->ctx, &call, part[3], count, NULL, 0, NULL, 0)
               : clmha_attention_forward_host(s->ctx, &call, part[3], count, NULL, 0, NULL, 0);
    if (st != CLMHA_SUCCESS) {
        char what[128];
        snprintf(what, sizeof what, "forward call %zu through the KV cache (tokens %zu to %zu)",
                 s->calls + 1, t0, t0 + len - 1);
        return call_failed(s, what, st);
    }
    copy_tokens(part[3], s->y, es, r[3], t0, len, true);
    ++s->calls;
    return true;
}

// --kv-cache-prefix P: a cache for the call's batch items, key/value heads and D, of capacity
// S; tokens [0, P) in one call, then one call per token; their outputs' rows into s->y.
static bool decode(const sdpa_opts *o, sdpa_state *s) {
    const clmha_attention_args *a = &s->args;
    size_t nd = a->key.ndim, batch = nd == 4 ? a->key.shape[0] : 1;
    size_t kv_heads = a->key.shape[nd - (o->layout == CLMHA_LAYOUT_NLHD ? 2 : 3)];
    // The output's rows are the query's (D_v = D).
    token_rows r[4] = {rows_of(&a->query, o->layout), rows_of(&a->key, o->layout),
                       rows_of(&a->value, o->layout), rows_of(&a->query, o->layout)};
    size_t p = (size_t)o->kv_prefix, total = r[0].seq;
    void *part[4] = {NULL};
    bool ok = true;
    for (int i = 0; ok && i < 4; ++i) {  // (at most the whole tensor's count: no overflow)
        size_t count = r[i].outer * p * r[i].inner;
        ok = (part[i] = calloc(count ? count : 1, o->f64 ? sizeof(double) : sizeof(float))) !=
             NULL;
    }
    if (!ok) clmha__cli_report("sdpa", "out of host memory for the KV cache's calls");
    clmha_kv_cache *cache = NULL;
    size_t ps = (size_t)o->page_size;  // --page-size: a pool of just the pages needed
    clmha_kv_cache_options co = {.struct_size = sizeof co, .capacity = ps ? 0 : total,
                                 .page_size = ps,
                                 .num_pages = ps ? batch * ((total + ps - 1) / ps) : 0,
                                 .kv_dtype = o->kv_dtype, .dtype = o->dtype};
    clmha_status st = ok ? clmha_kv_cache_create_for_with(&cache, s->ctx, batch, kv_heads,
                                                          a->key.shape[nd - 1], &co)
                         : CLMHA_SUCCESS;
    if (st != CLMHA_SUCCESS) ok = call_failed(s, "making the KV cache", st);
    for (size_t t0 = 0, len = p; ok && t0 < total; t0 += len, len = 1)
        ok = decode_call(o, s, cache, r, part, t0, len);
    clmha_kv_cache_release(cache);
    for (int i = 0; i < 4; ++i) free(part[i]);
    return ok;
}

// ---- the forward and backward calls ------------------------------------------------------------

// The data of gradient file @p name ("attn_mask", "sinks"), NULL when the call has none:
// floats, or doubles with --dtype f64.
static void *grad_data(const sdpa_state *s, const char *name) {
    for (size_t i = 0; i < s->grads.count; ++i) {
        const clmha__cli_grad_file *f = &s->grads.file[i];
        if (strcmp(f->name, name) == 0) return f->data64 ? (void *)f->data64 : (void *)f->data;
    }
    return NULL;
}

// The device buffers of backward_on_device(): the inputs, then the results and gradients.
enum { DEV_Q, DEV_K, DEV_V, DEV_MASK, DEV_SINKS, DEV_MOD, DEV_GRAD_OUT, DEV_OUT, DEV_LSE, DEV_GQ,
       DEV_GK, DEV_GV, DEV_GMASK, DEV_GSINKS, DEV_COUNT };

// The backward pass with --sinks, on device buffers: clmha_attention_backward_host() gives no
// sinks gradient, and clmha_attention_backward() needs the forward's log-sum-exp rows for it,
// so the forward runs again here (clmha_attention_forward(), with its rows and the same
// dropout), then the backward (the fused core's where it runs, the unfused one's with
// --impl unfused or a float mask's gradient), and the gradients are read back. A 16-bit
// call's inputs already hold its dtype's values: it runs as float32 here (what the 16-bit
// call computes) and its gradients are rounded once after.
static bool backward_on_device(const sdpa_opts *o, sdpa_state *s) {
    clmha_attention_args a = s->args;
    if (!o->f64) a.dtype = CLMHA_DTYPE_F32;
    size_t es = o->f64 ? sizeof(double) : sizeof(float);  // the call's element
    cl_context cl = clmha_context_cl_context(s->ctx);
    cl_command_queue queue = clmha_context_cl_queue(s->ctx);
    size_t mask_count = 1;
    for (size_t i = 0; i < a.attn_mask.tensor.ndim; ++i) mask_count *= a.attn_mask.tensor.shape[i];
    bool float_mask = a.attn_mask.kind == CLMHA_MASK_FLOAT;
    size_t mask_bytes = a.attn_mask.kind ? mask_count * (float_mask ? es : 1) : 0;
    size_t h = a.sinks.shape[0];
    const void *host[DEV_COUNT] = {
        [DEV_Q] = a.query.data, [DEV_K] = a.key.data, [DEV_V] = a.value.data,
        [DEV_MASK] = a.attn_mask.tensor.data, [DEV_SINKS] = a.sinks.data,
        [DEV_MOD] = a.mod_params.data,
        [DEV_GRAD_OUT] = o->f64 ? (const void *)o->in[IN_GRAD_OUT].a.f64
                                : (const void *)o->in[IN_GRAD_OUT].a.f32};
    void *dst[DEV_COUNT] = {[DEV_GQ] = grad_data(s, "query"), [DEV_GK] = grad_data(s, "key"),
                             [DEV_GV] = grad_data(s, "value"),
                             [DEV_GMASK] = grad_data(s, "attn_mask"),
                             [DEV_GSINKS] = grad_data(s, "sinks")};
    size_t bytes[DEV_COUNT] = {
        [DEV_Q] = o->in[IN_QUERY].a.count * es, [DEV_K] = o->in[IN_KEY].a.count * es,
        [DEV_V] = o->in[IN_VALUE].a.count * es, [DEV_MASK] = mask_bytes, [DEV_SINKS] = h * es,
        [DEV_MOD] = a.mod_params.ndim ? o->mod.count * sizeof(float) : 0,  // p: floats
        [DEV_GRAD_OUT] = s->y_count * es, [DEV_OUT] = s->y_count * es,
        [DEV_LSE] = s->lse_count * es};
    bytes[DEV_GQ] = bytes[DEV_Q], bytes[DEV_GK] = bytes[DEV_K], bytes[DEV_GV] = bytes[DEV_V];
    bytes[DEV_GMASK] = float_mask ? mask_bytes : 0, bytes[DEV_GSINKS] = bytes[DEV_SINKS];
    cl_mem buf[DEV_COUNT] = {NULL};
    cl_int err = CL_SUCCESS;
    for (int i = 0; i < DEV_COUNT && err == CL_SUCCESS; ++i) {
        if (!bytes[i]) continue;
        cl_mem_flags flags = host[i] ? CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR : CL_MEM_READ_WRITE;
        buf[i] = clCreateBuffer(cl, flags, bytes[i], (void *)host[i], &err);
    }
    bool ok = err == CL_SUCCESS;
    if (!ok)
        clmha__cli_report("sdpa", "backward pass failed on %s: clCreateBuffer: OpenCL error %d",
                          clmha_context_device_name(s->ctx), (int)err);
    clmha_tensor *t[6] = {&a.query, &a.key,   &a.value,
                          &a.attn_mask.tensor, &a.sinks, &a.mod_params};
    for (int i = 0; i < 6; ++i) t[i]->buffer = buf[i], t[i]->offset = 0;
    clmha_attention_backward_args b = {
        .struct_size = sizeof b, .forward = &a, .output = buf[DEV_OUT], .lse = buf[DEV_LSE],
        .grad_output = buf[DEV_GRAD_OUT], .grad_query = buf[DEV_GQ], .grad_key = buf[DEV_GK],
        .grad_value = buf[DEV_GV], .grad_attn_mask = buf[DEV_GMASK],
        .grad_sinks = buf[DEV_GSINKS],
        .impl = a.impl == CLMHA_IMPL_UNFUSED ? CLMHA_IMPL_UNFUSED : CLMHA_IMPL_AUTO};
    clmha_status st = CLMHA_SUCCESS;
    if (ok && (st = clmha_attention_forward(s->ctx, &a, buf[DEV_OUT], 0, buf[DEV_LSE], 0, NULL, 0,
                                            0, NULL, NULL)))
        ok = call_failed(s, "forward pass (again, for the backward pass)", st);
    if (ok && (st = clmha_attention_backward(s->ctx, &b, 0, NULL, NULL)))
        ok = call_failed(s, "backward pass", st);
    for (int i = DEV_GQ; ok && i < DEV_COUNT; ++i)
        if (dst[i] && (err = clEnqueueReadBuffer(queue, buf[i], CL_TRUE, 0, bytes[i], dst[i], 0,
                                                 NULL, NULL)) != CL_SUCCESS) {
            clmha__cli_report("sdpa", "reading the gradients failed on %s: OpenCL error %d",
                              clmha_context_device_name(s->ctx), (int)err);
            ok = false;
        }
    if (!ok) clFinish(queue);  // nothing may still use the buffers
    for (int i = 0; i < DEV_COUNT; ++i)
        if (buf[i]) clReleaseMemObject(buf[i]);
    for (int i = DEV_GQ; ok && o->dtype != CLMHA_DTYPE_F32 && !o->f64 && i < DEV_COUNT; ++i)
        for (size_t k = 0; dst[i] && k < bytes[i] / sizeof(float); ++k)
            ((float *)dst[i])[k] = clmha__dtype_round(o->dtype, ((float *)dst[i])[k]);
    return ok;
}

// The forward call (or the calls through a KV cache), then the backward pass.
static bool compute(const sdpa_opts *o, sdpa_state *s) {
    // (calloc checks the products of counts and sizes.)
    size_t lse_count = o->lse_path ? s->lse_count : 0, w_count = o->weights_path ? s->w_count : 0;
    size_t es = o->f64 ? sizeof(double) : sizeof(float);
    bool no_memory = !(s->y = calloc(s->y_count ? s->y_count : 1, es)) ||
                     (lse_count && !(s->lse = calloc(lse_count, es))) ||
                     (w_count && !(s->w = calloc(w_count, es)));
    for (size_t i = 0; !no_memory && i < s->grads.count; ++i) {
        clmha__cli_grad_file *f = &s->grads.file[i];
        size_t n = f->count ? f->count : 1;
        no_memory = o->f64 ? !(f->data64 = calloc(n, sizeof *f->data64))
                           : !(f->data = calloc(n, sizeof *f->data));
    }
    if (no_memory) {
        clmha__cli_report("sdpa", "out of host memory for the results");
        return false;
    }
    if (o->kv_prefix) return decode(o, s);
    clmha_status st =
        o->f64 ? clmha_attention_forward_host_f64(s->ctx, &s->args, s->y, s->y_count, s->lse,
                                                  lse_count, s->w, w_count)
               : clmha_attention_forward_host(s->ctx, &s->args, s->y, s->y_count, s->lse,
                                              lse_count, s->w, w_count);
    if (st != CLMHA_SUCCESS) return call_failed(s, "forward pass", st);
    s->calls = 1;
    if (!o->grads_dir) return true;
    if (s->args.sinks.ndim) return backward_on_device(o, s);
    const clmha__npy *g = &o->in[IN_GRAD_OUT].a;
    void *dq = grad_data(s, "query"), *dk = grad_data(s, "key"), *dv = grad_data(s, "value"),
         *dm = grad_data(s, "attn_mask");
    st = o->f64 ? clmha_attention_backward_host_f64(s->ctx, &s->args, g->f64, s->y_count, dq, dk,
                                                    dv, dm)
                : clmha_attention_backward_host(s->ctx, &s->args, g->f32, s->y_count, dq, dk, dv,
                                                dm);
    return st == CLMHA_SUCCESS || call_failed(s, "backward pass", st);
}

// Every file at once, all or none.
static bool write_files(sdpa_opts *o, const sdpa_state *s) {
    size_t n = 0;
    const char *flags[3] = {"--output", "--lse-output", "--weights-output"};
    const char *paths[3] = {o->output_path, o->lse_path, o->weights_path};
    const void *data[3] = {s->y, s->lse, s->w};
    const size_t ndim[3] = {s->y_ndim, s->lse_ndim, s->w_ndim};
    const size_t *shape[3] = {s->y_shape, s->lse_shape, s->w_shape};
    for (int i = 0; i < 3; ++i) {
        if (!paths[i]) continue;
        o->outs[n] = (clmha__cli_out){.flag = flags[i], .path = paths[i],
                                      .data = o->f64 ? NULL : data[i],
                                      .f64 = o->f64 ? data[i] : NULL, .ndim = ndim[i],
                                      .half = o->dtype == CLMHA_DTYPE_F16};
        memcpy(o->outs[n++].shape, shape[i], ndim[i] * sizeof *shape[i]);
    }
    n += clmha__cli_grads_outputs(&s->grads, o->outs + n);
    return clmha__cli_write_outputs("sdpa", o->outs, n);
}

// Output value @p i as a double (floats, or doubles with --dtype f64).
static double output_at(const sdpa_opts *o, const sdpa_state *s, size_t i) {
    return o->f64 ? ((const double *)s->y)[i] : ((const float *)s->y)[i];
}

// A warning when the output holds NaN/Inf; a summary of the output when it was not written.
static void report_results(const sdpa_opts *o, const sdpa_state *s) {
    size_t bad = 0;
    for (size_t i = 0; i < s->y_count; ++i) bad += !isfinite(output_at(o, s, i));
    if (bad)
        clmha__cli_report("sdpa", "warning: the output holds %zu NaN/Inf value%s of %zu; NaN/Inf "
                          "in gives NaN/Inf out, as in PyTorch", bad, bad == 1 ? "" : "s",
                          s->y_count);
    if (o->output_path) return;
    char sh[160];
    printf("device:  %s\n", clmha_context_device_name(s->ctx));
    printf("output:  %s:", clmha__shape_str(sh, sizeof sh, s->y_ndim, s->y_shape));
    size_t shown = s->y_count < 6 ? s->y_count : 6;
    for (size_t i = 0; i < shown; ++i) printf(" %.6g", output_at(o, s, i));
    printf("%s (%zu value%s)\n", shown < s->y_count ? " ..." : "", s->y_count,
           s->y_count == 1 ? "" : "s");
    size_t steps = s->calls - 1;
    if (o->kv_prefix)
        printf("calls:   %zu through a KV cache (a prefix of %zu token%s, then %zu single-token "
               "step%s)\n", s->calls, (size_t)o->kv_prefix, o->kv_prefix == 1 ? "" : "s", steps,
               steps == 1 ? "" : "s");
    else
        printf("calls:   1\n");
}

int clmha__cli_sdpa(int argc, char **argv) {
    sdpa_opts o = {.in = {
                       [IN_QUERY] = {.flag = "--query"},
                       [IN_KEY] = {.flag = "--key"},
                       [IN_VALUE] = {.flag = "--value"},
                       [IN_ATTN] = {.flag = "--attn-mask", .is_mask = true},
                       [IN_GRAD_OUT] = {.flag = "--grad-output"},
                       [IN_SLOPES] = {.flag = "--alibi-slopes", .is_vector = true},
                       [IN_SINKS] = {.flag = "--sinks", .is_vector = true},
                   }};
    int rc;
    if (!parse_command_line(argc, argv, &o, &rc)) return rc;
    if (!check_options(&o)) {
        free(o.seq.lens);
        free(o.kv_seq.lens);
        return EXIT_USAGE;
    }
    sdpa_state s = {0};
    rc = EXIT_REFUSED;
    if (!read_files(&o)) goto done;
    if (o.kv_prefix && !kv_shapes_fit(&o)) {
        rc = EXIT_USAGE;
        goto done;
    }
    if (!(s.ctx = clmha__cli_open_context("sdpa", o.device)) || !build_args(&o, &s)) goto done;
    plan_shapes(&o, &s);
    if ((o.grads_dir && !plan_grads(&o, &s, &rc)) || !compute(&o, &s) || !write_files(&o, &s))
        goto done;
    report_results(&o, &s);
    rc = EXIT_OK;
done:
    free(s.y);
    free(s.lse);
    free(s.w);
    clmha__cli_grads_free(&s.grads);
    clmha_context_release(s.ctx);
    for (int i = 0; i < IN_COUNT; ++i) clmha__npy_free(&o.in[i].a);
    clmha__cli_mod_free(&o.mod);
    free(o.seq.lens);
    free(o.kv_seq.lens);
    return rc;
}
