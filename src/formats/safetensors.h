// Reading and checking .safetensors layer files, without OpenCL (so that it can be fuzzed):
// safetensors_header.c parses and checks a file (clmha__safetensors_parse, _free, the lookups),
// safetensors_layer.c derives its layer (clmha__safetensors_select, _desc_opts, _to_double).
// clmha_layer_load() and clmha_layer_save() (include/clmha.h) are in safetensors_io.c.
//
// The format: an 8-byte little-endian header length N, then N bytes of JSON (an object, padded
// with trailing spaces), then the data section. Each key of the object other than
// "__metadata__" is a tensor: {"dtype": "F32", "shape": [3, 4], "data_offsets": [begin, end]},
// offsets in bytes relative to the first byte after the header. "__metadata__" maps strings to
// strings.
#ifndef CLMHA_FORMATS_SAFETENSORS_H
#define CLMHA_FORMATS_SAFETENSORS_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// Largest header accepted (bytes of JSON, padding included): 256 KiB. A layer's header is
// small: at most 12 tensor entries of under 100 bytes each and a few metadata strings, under
// 2 KiB as clmha_layer_save() and PyTorch write it (and a layer's user functions' source). The limit leaves over 250 KiB for
// free-form metadata, and bounds what parsing costs (cJSON takes up to about 30 times the
// text: a few MiB at worst, in milliseconds). A longer header is refused from its length
// alone, before it is read (clmha_layer_load) or parsed.
#define CLMHA__ST_MAX_HEADER ((size_t)256 << 10)
// Most tensor entries a layer file holds: one per parameter name of nn.MultiheadAttention
// (in_proj_weight, q/k/v_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias, bias_k,
// bias_v) and clmha's alibi_slopes, sinks and mod_params. More are refused before any entry is
// read.
#define CLMHA__ST_MAX_TENSORS 12
// Most dimensions a tensor may have.
#define CLMHA__ST_MAX_DIMS 8
// The limits of a file read with a prefix (clmha_layer_load_prefixed()), which may hold a whole
// model's parameters, of which the layer takes at most CLMHA__ST_MAX_TENSORS: a header of at
// most 8 MiB (a 65536-tensor checkpoint's header, at about 120 bytes an entry), at most 65536
// tensor entries, and at most 1 Mi JSON values (objects, arrays, strings, numbers), counted
// on the text before cJSON parses it: cJSON takes about 80 bytes a value, so a hostile header
// costs at most about 100 MB and tens of milliseconds, not the 40 times its text a header of
// one-digit numbers would.
#define CLMHA__ST_MODEL_MAX_HEADER ((size_t)8 << 20)
#define CLMHA__ST_MODEL_MAX_TENSORS 65536
#define CLMHA__ST_MODEL_MAX_VALUES ((size_t)1 << 20)

typedef enum clmha__st_dtype {
    CLMHA__ST_F16,  // IEEE binary16
    CLMHA__ST_F32,
    CLMHA__ST_F64,
    CLMHA__ST_BF16,  // bfloat16: the upper half of a float32
} clmha__st_dtype;

// One tensor of a parsed file. Strings belong to the file; data points into the caller's bytes.
typedef struct clmha__st_tensor {
    const char *name;   // the file's name, for messages
    const char *param;  // the nn.MultiheadAttention parameter it is, for lookups: the name
                        // in a parsed file, the mapped name in a clmha__st_view
    clmha__st_dtype dtype;
    size_t ndim;
    size_t shape[CLMHA__ST_MAX_DIMS];
    size_t count;               // product of shape (1 for a scalar)
    const unsigned char *data;  // count * itemsize bytes, little-endian, any alignment
    size_t begin, end;          // data_offsets: data is the data section's bytes [begin, end)
} clmha__st_tensor;

// One "__metadata__" entry.
typedef struct clmha__st_meta {
    const char *key;
    const char *value;
} clmha__st_meta;

// A parsed file. Zero-initialised means empty; release with clmha__safetensors_free().
typedef struct clmha__st_file {
    struct cJSON *json;  // owns every string above
    clmha__st_tensor *tensors;
    size_t tensor_count;
    clmha__st_meta *meta;
    size_t meta_count;
} clmha__st_file;

// Which limits clmha__safetensors_parse_as() applies.
typedef enum clmha__st_limits {
    CLMHA__ST_LAYER_LIMITS,  // a layer file: CLMHA__ST_MAX_HEADER, CLMHA__ST_MAX_TENSORS
    CLMHA__ST_MODEL_LIMITS,  // a model's checkpoint: the CLMHA__ST_MODEL_MAX_* limits
} clmha__st_limits;

// The largest header length a file read under @p limits may announce.
CLMHA__HIDDEN size_t clmha__st_max_header(clmha__st_limits limits);

// When the first @p n bytes of a file (of @p file_size bytes in all) are those of a file
// written by torch.save() -- a zip archive ("PK\x03\x04") or a pickle (0x80, protocol 2..5,
// and not a plausible safetensors header) -- writes a message (starting with @p name) saying
// so and how to convert it, and returns CLMHA_INVALID_FILE; else CLMHA_SUCCESS.
CLMHA__HIDDEN clmha_status clmha__st_torch_save_check(const unsigned char *b, size_t n,
                                                      size_t file_size, const char *name,
                                                      char *msg, size_t msg_size);

// clmha__safetensors_parse() under @p limits.
CLMHA__HIDDEN clmha_status clmha__safetensors_parse_as(const void *bytes, size_t size,
                                                       const char *name,
                                                       clmha__st_limits limits,
                                                       clmha__st_file *out, char *msg,
                                                       size_t msg_size);

// Parses and fully checks the file held in @p bytes (@p size bytes; read-only, must outlive
// @p out). @p name (the path) starts every message. On failure writes a message to @p msg and
// leaves @p out empty; returns CLMHA_SUCCESS, CLMHA_INVALID_ARGUMENT (NULL pointers),
// CLMHA_INVALID_FILE, CLMHA_SIZE_OVERFLOW (shape products or dimensions too large) or
// CLMHA_OUT_OF_MEMORY. Checks what the format requires (as the reference implementation does):
// a header of at most CLMHA__ST_MAX_HEADER bytes, at most CLMHA__ST_MAX_TENSORS tensors, no key
// twice in any object (tensor names, metadata keys, the keys of a tensor entry), sizes and
// offsets that are JSON integers (read exactly from the text, not through a double), and
// tensors whose byte ranges, sorted, cover the data section exactly: from 0, without overlap or
// hole, up to its last byte. Data has exactly count * itemsize bytes.
CLMHA__HIDDEN clmha_status clmha__safetensors_parse(const void *bytes, size_t size,
                                                    const char *name, clmha__st_file *out,
                                                    char *msg, size_t msg_size);

// Frees what a successful parse allocated and empties @p file. Accepts NULL and empty files.
CLMHA__HIDDEN void clmha__safetensors_free(clmha__st_file *file);

// The tensor whose param is @p name (in a parsed file: whose name is), or NULL.
CLMHA__HIDDEN const clmha__st_tensor *clmha__safetensors_tensor(const clmha__st_file *file,
                                                               const char *name);

// The metadata value of @p key, or NULL.
CLMHA__HIDDEN const char *clmha__safetensors_meta(const clmha__st_file *file, const char *key);

// Converts the tensor's data to @p out (t->count doubles), exactly for every dtype (F16
// subnormals, infinities and NaN included); clmha_layer_set_parameter_f64() then rounds them
// to the layer's dtype.
CLMHA__HIDDEN void clmha__safetensors_to_double(const clmha__st_tensor *t, double *out);

// What clmha_load_options asks of a file, as the formats module reads it.
typedef struct clmha__st_load {
    const char *prefix;     // NULL or "": none
    size_t num_heads;       // 0: the metadata's
    clmha_batch_first batch_first;
} clmha__st_load;

// The tensors of a file under nn.MultiheadAttention's names: the prefix stripped and the name
// set mapped. Points into the file it was made from, which must outlive it.
typedef struct clmha__st_view {
    clmha__st_file file;  // tensors: the layer's, each param a PyTorch name; meta: the file's;
                          // json NULL (owns nothing)
    clmha__st_tensor tensors[CLMHA__ST_MAX_TENSORS];
    // The file's tensors each view tensor is made of, concatenated along dimension 0: one for
    // most, three (q, k, v) for a seed module's in_proj_bias; NULL after the last.
    const clmha__st_tensor *parts[CLMHA__ST_MAX_TENSORS][4];
    const char *name_set;   // "nn.MultiheadAttention", "continuiti", "w_q/w_k/w_v/w_concat"
    bool batch_first_set;   // a batch-first module's name set (the seeds)
    char joined[3][256];    // the names of concatenated tensors, for messages
} clmha__st_view;

// Picks the layer's tensors out of @p file (@p prefix: NULL or "" for all) into @p view and
// recognises their name set. Returns CLMHA_SUCCESS or CLMHA_INVALID_FILE (no tensor under the
// prefix: the message lists prefixes the file has; an unknown tensor; tensors of two name
// sets; a seed module's biases not all present or absent or not of its weights' widths).
CLMHA__HIDDEN clmha_status clmha__safetensors_select(const clmha__st_file *file,
                                                     const char *name, const char *prefix,
                                                     clmha__st_view *view, char *msg,
                                                     size_t msg_size);

// clmha__safetensors_select() then clmha__safetensors_desc_opts() on the view with the options of
// @p load (NULL: none).
CLMHA__HIDDEN clmha_status clmha__safetensors_layer(const clmha__st_file *file,
                                                    const char *name,
                                                    const clmha__st_load *load,
                                                    clmha__st_view *view,
                                                    clmha_layer_desc *desc, char *msg,
                                                    size_t msg_size);

// Derives the layer of a parsed file (embed_dim from out_proj.weight, kdim/vdim, bias and
// add_bias_kv from the tensors present, num_heads, batch_first, add_zero_attn, dropout, the
// sliding window ("window": "LEFT,RIGHT"), softcap and alibi from the metadata) and checks
// that every tensor is a parameter of that layer with its PyTorch shape (alibi_slopes: (H),
// with alibi only; sinks: (H), which turns desc->sinks on). On success every tensor of @p file can be given to
// clmha_layer_set_parameter() of a layer created from @p desc. Options: num_heads (0: the metadata's; else the metadata's, if
// any, must agree) and batch_first (CLMHA_BATCH_FIRST_AUTO: the metadata's, else
// @p default_batch_first). Returns CLMHA_SUCCESS, CLMHA_INVALID_FILE or CLMHA_SIZE_OVERFLOW,
// with a message that starts with @p name and names the tensor or metadata key.
CLMHA__HIDDEN clmha_status clmha__safetensors_desc_opts(const clmha__st_file *file,
                                                        const char *name, size_t num_heads,
                                                        clmha_batch_first batch_first,
                                                        bool default_batch_first,
                                                        clmha_layer_desc *desc, char *msg,
                                                        size_t msg_size);

// The values of view tensor @p i as doubles (its parts one after the other), exactly.
CLMHA__HIDDEN void clmha__st_view_to_double(const clmha__st_view *view, size_t i, double *out);

#endif
