// Loader for the golden test cases written by tools/make_golden.py (tests/golden/*.txt).
//
// Format (text, whitespace separated, '#' starts a comment that runs to the end of the line):
//
//   case <name>
//   layer embed_dim <E> num_heads <H> kdim <K> vdim <V> bias <0|1> add_bias_kv <0|1>
//         add_zero_attn <0|1> batch_first <0|1> dropout <p> [num_kv_heads <G>]
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
// G * (E/H) rows (entries) instead of E. The loader has no dependency besides the C11
// standard library; it never aborts: malformed files give an error message.
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
    // call
    bool need_weights, per_head_weights, is_causal, training;
    golden_mask_kind kpm, attn;
    bool attn_per_batch;
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
// exist and that `weights` exists exactly when need_weights.
const char *golden_load(const char *path, golden_case *gc);

// The tensor called @p name, or NULL.
const golden_tensor *golden_find(const golden_case *gc, const char *name);

// Frees the tensors and zeroes @p gc. Accepts NULL and an already freed case.
void golden_free(golden_case *gc);

// "none", "bool_ignore", ... for a kind; "?" otherwise.
const char *golden_mask_kind_name(golden_mask_kind kind);

#endif  // CLMHA_TESTS_GOLDEN_H
