// Loader for the golden test cases written by tools/make_golden.py (tests/golden/*.txt).
//
// Format (text, whitespace separated, '#' starts a comment that runs to the end of the line):
//
//   case <name>
//   layer embed_dim <E> num_heads <H> kdim <K> vdim <V> bias <0|1> add_bias_kv <0|1>
//         add_zero_attn <0|1> batch_first <0|1> dropout <p> [num_kv_heads <G>]
//         [dtype <f16|bf16|f64>] [window <left> <right>] [softcap <c>] [alibi] [sinks]
//   call need_weights <0|1> per_head_weights <0|1> is_causal <0|1> training <0|1>
//        kpm <kind> attn <kind> attn_per_batch <0|1>
//   tensor <name> <f32|u8|f64> <ndim> <d0> ... <dn-1>
//   <values in C order>
//   ...
//   end
//
// kind is none, bool_ignore, bool_attend or float. The optional num_kv_heads (grouped-query
// attention: G key/value heads, G divides H) ends the layer line; only GQA cases (G < H)
// have it, and their k/v_proj_weight, the k/v parts of in_proj_bias and bias_k/bias_v have
// G * (E/H) rows (entries) instead of E.
//
// The optional dtype (after num_kv_heads when both are present; absent: a float32 layer, as in
// every case of cases.inc) marks a float16 / bfloat16 layer case (tests/golden/dtype_cases.inc):
// its parameters, inputs and outputs are 16-bit. Such a file is forward only (no grad_*
// tensors). Its f32 parameters, query/key/value and float masks hold values exactly
// representable in the dtype (the float32 draw rounded to it), output/weights are the float64
// results on exactly those values, and two more f32 tensors follow them: torch.output (and
// torch.weights with need_weights), PyTorch's own result computed in the dtype, as a baseline
// for the error (see tools/make_golden.py for how it is made). The loader checks that these
// are present, f32 and of the expected values' shapes.
//
// The optional window (last on the layer line, or on the sdpa line below; absent: no window) is a
// sliding window, clmha_layer_desc::window / clmha_attention_args::window: query i attends key j
// only when i - left <= j <= i + right, each bound -1 (unbounded) or an integer >= 0.
//
// The optional score variants follow it, in this order (absent: off): softcap <c> (logit
// soft-capping, clmha_layer_desc::softcap / clmha_attention_args::softcap: every scaled score s
// becomes c·tanh(s/c); c finite and > 0) and alibi (ALiBi, ::alibi: query head h at position i
// against key j < S gains -slope_h·|i - j|). An ALiBi case's slopes are the f32 tensor
// alibi_slopes (H), among the parameters of a layer case (set with clmha_layer_set_parameter())
// or after the inputs of an SDPA case (clmha_attention_args::alibi_slopes); without it the
// case uses the geometric slopes of clmha_alibi_slopes(), a layer's default. The loader checks
// that alibi_slopes appears only with alibi, f32, of shape (H). Last, sinks (attention sinks,
// clmha_layer_desc::sinks / clmha_attention_args::sinks: one logit per head in each row's
// softmax denominator with a zero value): the case then holds the f32 tensor sinks (H), among
// the parameters of a layer case (clmha_layer_set_parameter()) or after the inputs of an SDPA
// case, and with its gradients grad.sinks (f64, (H)); the loader checks both (and that neither
// appears without sinks).
//
// dtype f64 marks a float64 layer case (tests/golden/f64_cases.inc), forward only too: its
// parameters, query/key/value and float masks are f64 tensors (doubles that float32 cannot
// hold, kept as doubles in golden_tensor.f64), output/weights PyTorch's float64 results. The
// loader checks that no tensor of such a file is f32.
//
// An SDPA case (tests/golden/sdpa/, tools/make_sdpa_golden.py: attention as a function,
// clmha_attention_forward/_backward) has one `sdpa` line in place of the layer and call lines:
//
//   sdpa layout <nhld|nlhd> is_causal <0|1> scale <s> enable_gqa <0|1> attn <kind>
//        [window <left> <right>] [softcap <c>] [alibi] [sinks]
//
// (scale 0: 1/sqrt(D); attn none, bool_attend or float), and the tensors query, key, value
// (f32, in the layout; 3-D when unbatched), attn_mask (u8 or f32 by kind, its own shape),
// output (f64, the query's layout), lse (f64, (N, H, L)), weights (f64, (N, H, L, S)),
// grad_output (f32, the output's shape), grad.query, grad.key, grad.value (f64) and, with a
// float mask only, grad.attn_mask (f64, the mask's shape). The loader checks their presence
// and dtypes; golden_case.sdpa is true, the layer's fields are 0.
//
// The loader has no dependency besides the C11 standard library; it never aborts: malformed
// files give an error message.
#ifndef CLMHA_TESTS_GOLDEN_H
#define CLMHA_TESTS_GOLDEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GOLDEN_MAX_DIMS 4
#define GOLDEN_MAX_NAME 64

typedef enum golden_dtype {
    GOLDEN_F32,  // float, written with %.9g (exact)
    GOLDEN_U8,   // 0 or 1
    GOLDEN_F64,  // double, written with %.17g (exact)
} golden_dtype;

// Same order as clmha_mask_kind (but independent of clmha.h).
typedef enum golden_mask_kind {
    GOLDEN_MASK_NONE = 0,
    GOLDEN_MASK_BOOL_IGNORE,  // 1 = may not attend
    GOLDEN_MASK_BOOL_ATTEND,  // 1 = may attend
    GOLDEN_MASK_FLOAT,        // added to the scaled scores
} golden_mask_kind;

// The layer's dtype (the layer line's optional `dtype`), stored in golden_case.dtype.
typedef enum golden_layer_dtype {
    GOLDEN_LAYER_F32 = 0,  // no dtype on the layer line
    GOLDEN_LAYER_F16,      // dtype f16
    GOLDEN_LAYER_BF16,     // dtype bf16
    GOLDEN_LAYER_F64,      // dtype f64
} golden_layer_dtype;

typedef struct golden_tensor {
    char name[GOLDEN_MAX_NAME];
    golden_dtype dtype;
    size_t ndim;                     // 1 to GOLDEN_MAX_DIMS
    size_t shape[GOLDEN_MAX_DIMS];   // unused dimensions are 0
    size_t count;                    // product of the shape
    float *f32;                      // exactly one of these is non-NULL, by dtype
    uint8_t *u8;
    double *f64;
} golden_tensor;

typedef struct golden_case {
    char name[GOLDEN_MAX_NAME];
    // layer
    size_t embed_dim, num_heads, kdim, vdim;
    bool bias, add_bias_kv, add_zero_attn, batch_first;
    double dropout;
    size_t num_kv_heads;  // 0 when the layer line has no num_kv_heads (num_heads)
    int dtype;            // a golden_layer_dtype; GOLDEN_LAYER_F32 (0) when the line has none
    // The sliding window (layer or sdpa line): window false when the line has none.
    bool window;
    int64_t window_left, window_right;
    // The score variants (layer or sdpa line): softcap 0 and alibi false when the line has
    // none; the slopes are the tensor alibi_slopes when present, else the geometric ones.
    double softcap;
    bool alibi;
    bool sinks;  // attention sinks: the tensor sinks (H) holds them
    // call
    bool need_weights, per_head_weights, is_causal, training;
    golden_mask_kind kpm, attn;
    bool attn_per_batch;
    // An SDPA case (the `sdpa` line): sdpa true, the layout (sdpa_nlhd: nlhd, else nhld), the
    // scale (0: 1/sqrt(D)) and enable_gqa; is_causal and attn above hold its is_causal and attn.
    bool sdpa, sdpa_nlhd, enable_gqa;
    double scale;
    // tensors, in file order
    size_t num_tensors;
    golden_tensor *tensors;
    // message of the last golden_load() failure
    char error[512];
} golden_case;

// Loads @p path into @p gc (which need not be initialised). Returns NULL on success, or an
// error message (stored in gc->error) on failure; in both cases golden_free() may be called and
// frees everything (on failure nothing else is held). Besides the syntax it checks that the
// masks named in the call line are present with a matching dtype, that `query` and `output`
// exist and that `weights` exists exactly when need_weights (and, for a 16-bit case,
// `torch.output` and `torch.weights` likewise, f32, of output's and weights' shapes; for a
// float64 case, that no tensor is f32; for an SDPA case, the mask of its attn kind and the
// tensors listed above instead).
const char *golden_load(const char *path, golden_case *gc);

// The tensor called @p name, or NULL.
const golden_tensor *golden_find(const golden_case *gc, const char *name);

// Frees the tensors and zeroes @p gc. Accepts NULL and an already freed case.
void golden_free(golden_case *gc);

// "none", "bool_ignore", ... for a kind; "?" otherwise.
const char *golden_mask_kind_name(golden_mask_kind kind);

// "f32", "f16", "bf16" or "f64" for a golden_layer_dtype; "?" otherwise.
const char *golden_layer_dtype_name(int dtype);

#endif  // CLMHA_TESTS_GOLDEN_H
