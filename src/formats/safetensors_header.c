// The header of a .safetensors file: clmha__safetensors_parse() reads and checks a file held in
// memory (the header's text, its JSON, the exact integers of shapes and offsets, the tensor
// entries, the metadata, duplicate keys, size bounds and the data section's coverage), without
// OpenCL; clmha__safetensors_free() and the lookups of a parsed file.
#include "formats/safetensors.h"

#include "base/checked.h"
#include "base/message.h"
#include "formats/safetensors_private.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- dtypes, the header's text ------------------------------------------------------------

static size_t dtype_size(clmha__st_dtype dtype) {
    return dtype == CLMHA__ST_F16 || dtype == CLMHA__ST_BF16 ? 2 : dtype == CLMHA__ST_F32 ? 4 : 8;
}

static const char *dtype_name(clmha__st_dtype dtype) {
    return dtype == CLMHA__ST_F16    ? "F16"
           : dtype == CLMHA__ST_BF16 ? "BF16"
           : dtype == CLMHA__ST_F32  ? "F32"
                                     : "F64";
}

size_t clmha__st_utf8_invalid_at(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t len;
        unsigned min, cp;
        if (c < 0x80) {
            ++i;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            len = 2, min = 0x80, cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3, min = 0x800, cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            len = 4, min = 0x10000, cp = c & 0x07;
        } else {
            return i;
        }
        if (n - i < len) return i;
        for (size_t k = 1; k < len; ++k) {
            if ((s[i + k] & 0xC0) != 0x80) return i;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
        i += len;
    }
    return n;
}

// Checks the raw header text: UTF-8, no control bytes other than JSON's whitespace, and no
// \u0000 escape (cJSON would cut the string there, so two different keys could look alike).
static clmha_status header_text_check(const unsigned char *h, size_t n, const char *name,
                                      char *msg, size_t msg_size) {
    size_t bad = clmha__st_utf8_invalid_at(h, n);
    if (bad < n)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header is not valid UTF-8 (byte %zu of the header)", name,
                          bad);
    size_t backslashes = 0;
    for (size_t i = 0; i < n; ++i) {
        unsigned char c = h[i];
        if (c < 0x20 && c != '\t' && c != '\n' && c != '\r')
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the header holds the control byte 0x%02x (byte %zu of the "
                              "header); it is not valid JSON",
                              name, c, i);
        if (c == 'u' && backslashes % 2 == 1 && n - i >= 5 && memcmp(h + i + 1, "0000", 4) == 0)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the header holds the escape \\u0000 (byte %zu of the "
                              "header), which clmha does not accept in names or metadata",
                              name, i - 1);
        backslashes = c == '\\' ? backslashes + 1 : 0;
    }
    return CLMHA_SUCCESS;
}

// ---- exact integers ------------------------------------------------------------------------
//
// cJSON keeps a number only as a double, so 2^53 + 1 would read as 2^53 and 12.0 as 12. Sizes
// and offsets are read again from their text: parse() lists where each number of the header
// starts, in document order, and stores in each number's valueint (unused by this file
// otherwise) its index in that list.

#define NUMBER_CHARS "0123456789+-.eE"  // what cJSON takes into a number

typedef struct number_text {
    const char **at;  // start of each number of the header, in document order
    size_t count;
    const char *end;  // end of the header text
} number_text;

// Lists the numbers of the JSON text @p h (n bytes, valid JSON as cJSON reads it) into @p at
// (NULL to count them); returns how many there are.
static size_t scan_numbers(const char *h, size_t n, const char **at) {
    size_t count = 0;
    bool in_string = false;
    for (size_t i = 0; i < n; ++i) {
        char c = h[i];
        if (in_string) {
            if (c == '\\') ++i;  // the escaped character (\uXXXX: plain hex digits follow)
            else if (c == '"') in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            if (at) at[count] = h + i;
            ++count;
            while (i + 1 < n && h[i + 1] && strchr(NUMBER_CHARS, h[i + 1])) ++i;
        }
    }
    return count;
}

// Numbers the number nodes of @p node and its siblings, depth first (document order).
static void index_numbers(cJSON *node, size_t *next) {
    for (; node; node = node->next) {
        if (cJSON_IsNumber(node)) node->valueint = (int)(*next)++;
        if (node->child) index_numbers(node->child, next);
    }
}

// The text of the number @p item (NULL when it is not a number), its length in *len.
static const char *number_of(const cJSON *item, const number_text *nums, size_t *len) {
    *len = 0;
    if (!cJSON_IsNumber(item) || item->valueint < 0 || (size_t)item->valueint >= nums->count)
        return NULL;
    const char *p = nums->at[item->valueint];
    while (p + *len < nums->end && p[*len] && strchr(NUMBER_CHARS, p[*len])) ++*len;
    return p;
}

// The precision (%.*s) that quotes at most CLMHA__ST_QUOTE_MAX of a number's @p len characters.
static int quote_len(size_t len) {
    return (int)(len < CLMHA__ST_QUOTE_MAX ? len : CLMHA__ST_QUOTE_MAX);
}

// Reads a JSON number that must be a non-negative integer, exactly, from its text: digits
// only, no sign, fraction or exponent, no leading zero (as JSON writes integers). Returns 0
// when it is one, 1 when it is not, 2 when it is larger than SIZE_MAX. *text and *len get the
// number's text (NULL when @p item is not a number).
static int json_size(const cJSON *item, const number_text *nums, size_t *out, const char **text,
                     size_t *len) {
    const char *p = *text = number_of(item, nums, len);
    if (!p || (*len > 1 && p[0] == '0')) return 1;
    return clmha__st_digits(p, *len, out);
}

int clmha__st_digits(const char *p, size_t len, size_t *out) {
    if (len == 0) return 1;
    size_t v = 0;
    bool big = false;
    for (size_t i = 0; i < len; ++i) {
        if (p[i] < '0' || p[i] > '9') return 1;
        size_t d = (size_t)(p[i] - '0');
        if (v > (SIZE_MAX - d) / 10) big = true;
        else v = v * 10 + d;
    }
    if (big) return 2;
    *out = v;
    return 0;
}

static int compare_strings(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

// A key that the object @p obj holds twice (cJSON keeps both, and lookups find the first), or
// NULL. *oom is set when the scratch list cannot be allocated.
static const char *duplicate_key(const cJSON *obj, bool *oom) {
    *oom = false;
    size_t n = 0;
    for (const cJSON *c = obj->child; c; c = c->next) ++n;
    if (n < 2) return NULL;
    const char **keys = malloc(n * sizeof *keys);
    if (!keys) {
        *oom = true;
        return NULL;
    }
    n = 0;
    for (const cJSON *c = obj->child; c; c = c->next) keys[n++] = c->string ? c->string : "";
    qsort(keys, n, sizeof *keys, compare_strings);
    const char *dup = NULL;
    for (size_t i = 1; i < n && !dup; ++i)
        if (strcmp(keys[i - 1], keys[i]) == 0) dup = keys[i];
    free(keys);
    return dup;
}

// The dtype of tensor @p t (named t->name) from its JSON object @p obj.
static clmha_status parse_dtype(const cJSON *obj, clmha__st_tensor *t, const char *name,
                                char *msg, size_t msg_size) {
    const char *tn = t->name;
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(obj, "dtype");
    if (!dtype)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s: tensor \"%.*s\" has no dtype",
                          name, CLMHA__ST_QUOTE_MAX, tn);
    if (!cJSON_IsString(dtype) || !dtype->valuestring)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the dtype of tensor \"%.*s\" is not a string", name,
                          CLMHA__ST_QUOTE_MAX, tn);
    const char *ds = dtype->valuestring;
    if (strcmp(ds, "F32") == 0) {
        t->dtype = CLMHA__ST_F32;
    } else if (strcmp(ds, "F16") == 0) {
        t->dtype = CLMHA__ST_F16;
    } else if (strcmp(ds, "F64") == 0) {
        t->dtype = CLMHA__ST_F64;
    } else if (strcmp(ds, "BF16") == 0) {
        t->dtype = CLMHA__ST_BF16;
    } else {
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" has dtype \"%.*s\", which clmha does not read "
                          "(F32, F16, BF16 or F64)",
                          name, CLMHA__ST_QUOTE_MAX, tn, CLMHA__ST_QUOTE_MAX, ds);
    }
    return CLMHA_SUCCESS;
}

// The shape of tensor @p t (its dtype known) from its JSON object @p obj: t->shape, t->ndim,
// t->count, and its size in bytes (*nbytes).
static clmha_status parse_shape(const cJSON *obj, const number_text *nums, clmha__st_tensor *t,
                                size_t *nbytes, const char *name, char *msg, size_t msg_size) {
    const char *tn = t->name;
    char sbuf[256];
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(obj, "shape");
    if (!shape)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s: tensor \"%.*s\" has no shape",
                          name, CLMHA__ST_QUOTE_MAX, tn);
    if (!cJSON_IsArray(shape))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the shape of tensor \"%.*s\" is not a JSON array", name,
                          CLMHA__ST_QUOTE_MAX, tn);
    size_t ndim = 0, count = 1;
    bool overflow = false;
    for (const cJSON *dim = shape->child; dim; dim = dim->next) {
        if (ndim == CLMHA__ST_MAX_DIMS)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: tensor \"%.*s\" has more than %d dimensions", name,
                              CLMHA__ST_QUOTE_MAX, tn, CLMHA__ST_MAX_DIMS);
        size_t v = 0, len;
        const char *text;
        int r = json_size(dim, nums, &v, &text, &len);
        if (r == 1 && text)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: dimension %zu of the shape of tensor \"%.*s\" is %.*s, not a "
                              "non-negative integer",
                              name, ndim, CLMHA__ST_QUOTE_MAX, tn, quote_len(len), text);
        if (r == 1)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: dimension %zu of the shape of tensor \"%.*s\" is not a "
                              "non-negative integer",
                              name, ndim, CLMHA__ST_QUOTE_MAX, tn);
        if (r == 2)
            return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                              "%s: dimension %zu of the shape of tensor \"%.*s\" is too large "
                              "(%.*s)",
                              name, ndim, CLMHA__ST_QUOTE_MAX, tn, quote_len(len), text);
        t->shape[ndim++] = v;
        if (!clmha__mul(count, v, &count)) overflow = true;
    }
    t->ndim = ndim;
    *nbytes = 0;
    // A zero dimension makes the product 0 whatever came before it.
    for (size_t i = 0; i < ndim && overflow; ++i)
        if (t->shape[i] == 0) overflow = false, count = 0;
    if (overflow || !clmha__mul(count, dtype_size(t->dtype), nbytes))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                          "%s: the shape %s of tensor \"%.*s\" holds more bytes than size_t "
                          "can count",
                          name, clmha__st_shape_text(sbuf, sizeof sbuf, ndim, t->shape),
                          CLMHA__ST_QUOTE_MAX, tn);
    t->count = count;
    return CLMHA_SUCCESS;
}

// The data_offsets of tensor @p t (its shape known: @p nbytes) from its JSON object @p obj,
// checked against the data section (@p data, @p data_size bytes): t->data, t->begin, t->end.
static clmha_status parse_offsets(const cJSON *obj, const unsigned char *data, size_t data_size,
                                  const number_text *nums, size_t nbytes, clmha__st_tensor *t,
                                  const char *name, char *msg, size_t msg_size) {
    const char *tn = t->name;
    char sbuf[256];
    const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(obj, "data_offsets");
    if (!offsets)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" has no data_offsets", name, CLMHA__ST_QUOTE_MAX, tn);
    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the data_offsets of tensor \"%.*s\" are not an array [begin, end]",
                          name, CLMHA__ST_QUOTE_MAX, tn);
    size_t off[2] = {0, 0};
    const cJSON *o = offsets->child;
    for (int i = 0; i < 2; ++i, o = o->next) {
        const char *text;
        size_t len;
        int r = json_size(o, nums, &off[i], &text, &len);
        if (r == 1)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the data_offsets of tensor \"%.*s\" are not non-negative "
                              "integers",
                              name, CLMHA__ST_QUOTE_MAX, tn);
        if (r == 2 || off[i] > data_size)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the data_offsets of tensor \"%.*s\" point past the end of "
                              "the data section (%zu bytes): %s %.*s",
                              name, CLMHA__ST_QUOTE_MAX, tn, data_size, i ? "end" : "begin",
                              quote_len(len), text);
    }
    if (off[0] > off[1])
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the data_offsets [%zu, %zu] of tensor \"%.*s\" have begin > end",
                          name, off[0], off[1], CLMHA__ST_QUOTE_MAX, tn);
    if (off[1] - off[0] != nbytes)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" has shape %s of %s = %zu bytes, but its "
                          "data_offsets [%zu, %zu] span %zu bytes",
                          name, CLMHA__ST_QUOTE_MAX, tn,
                          clmha__st_shape_text(sbuf, sizeof sbuf, t->ndim, t->shape),
                          dtype_name(t->dtype), nbytes, off[0], off[1], off[1] - off[0]);
    t->data = data + off[0];
    t->begin = off[0];
    t->end = off[1];
    return CLMHA_SUCCESS;
}

// Fills @p t from the JSON object @p obj describing tensor @p t->name.
static clmha_status parse_tensor(const cJSON *obj, const unsigned char *data, size_t data_size,
                                 const number_text *nums, clmha__st_tensor *t, const char *name,
                                 char *msg, size_t msg_size) {
    const char *tn = t->name;
    if (!cJSON_IsObject(obj))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" is not a JSON object", name, CLMHA__ST_QUOTE_MAX,
                          tn);
    bool oom;
    const char *dup = duplicate_key(obj, &oom);
    if (oom) return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", name);
    if (dup)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" has the key \"%.*s\" twice", name,
                          CLMHA__ST_QUOTE_MAX, tn, CLMHA__ST_QUOTE_MAX, dup);
    size_t nbytes;
    clmha_status st;
    if ((st = parse_dtype(obj, t, name, msg, msg_size)) ||
        (st = parse_shape(obj, nums, t, &nbytes, name, msg, msg_size)))
        return st;
    return parse_offsets(obj, data, data_size, nums, nbytes, t, name, msg, msg_size);
}

static int compare_tensor_names(const void *a, const void *b) {
    return strcmp(((const clmha__st_tensor *)a)->name, ((const clmha__st_tensor *)b)->name);
}

static int compare_meta_keys(const void *a, const void *b) {
    return strcmp(((const clmha__st_meta *)a)->key, ((const clmha__st_meta *)b)->key);
}

static clmha_status parse_metadata(const cJSON *obj, clmha__st_file *out, const char *name,
                                   char *msg, size_t msg_size) {
    if (!cJSON_IsObject(obj))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ is not a JSON object", name);
    size_t n = 0;
    for (const cJSON *c = obj->child; c; c = c->next) ++n;
    if (n == 0) return CLMHA_SUCCESS;
    out->meta = calloc(n, sizeof *out->meta);
    if (!out->meta)
        return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", name);
    for (const cJSON *c = obj->child; c; c = c->next) {
        if (!c->string)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: __metadata__ has an entry without a key", name);
        if (!cJSON_IsString(c) || !c->valuestring)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: __metadata__ entry \"%.*s\" is not a string (metadata maps "
                              "strings to strings)",
                              name, CLMHA__ST_QUOTE_MAX, c->string);
        out->meta[out->meta_count++] = (clmha__st_meta){c->string, c->valuestring};
    }
    qsort(out->meta, out->meta_count, sizeof *out->meta, compare_meta_keys);
    for (size_t i = 1; i < out->meta_count; ++i)
        if (strcmp(out->meta[i - 1].key, out->meta[i].key) == 0)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: __metadata__ has the key \"%.*s\" twice", name,
                              CLMHA__ST_QUOTE_MAX, out->meta[i].key);
    return CLMHA_SUCCESS;
}

size_t clmha__st_max_header(clmha__st_limits limits) {
    return limits == CLMHA__ST_MODEL_LIMITS ? CLMHA__ST_MODEL_MAX_HEADER : CLMHA__ST_MAX_HEADER;
}

clmha_status clmha__st_header_too_long(uint64_t n, clmha__st_limits limits, const char *name,
                                       char *msg, size_t msg_size) {
    if (limits == CLMHA__ST_MODEL_LIMITS)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header length %llu exceeds the limit of %zu bytes for a "
                          "model's file read with a prefix (at most %d tensor entries); refused "
                          "without reading it",
                          name, (unsigned long long)n, CLMHA__ST_MODEL_MAX_HEADER,
                          CLMHA__ST_MODEL_MAX_TENSORS);
    return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                      "%s: the header length %llu exceeds the limit of %zu bytes for a layer "
                      "file (a layer's header holds at most %d tensors and a few metadata "
                      "strings; a whole model's file needs a prefix); refused without reading it",
                      name, (unsigned long long)n, CLMHA__ST_MAX_HEADER, CLMHA__ST_MAX_TENSORS);
}

clmha_status clmha__st_torch_save_check(const unsigned char *b, size_t n, size_t file_size,
                                        const char *name, char *msg, size_t msg_size) {
    const char *kind = NULL;
    if (n >= 4 && memcmp(b, "PK\x03\x04", 4) == 0) {
        kind = "a zip archive, torch.save()'s format";
    } else if (n >= 2 && b[0] == 0x80 && b[1] >= 2 && b[1] <= 5) {
        // As a safetensors file, 0x80 0x0N would be a header length of 0x0N80 bytes: such a
        // file has zeros up to byte 8 and its header starts with '{'.
        bool header = n >= 9 && clmha__st_le64(b) <= file_size - 8 && b[8] == '{';
        if (!header) kind = "a pickle, torch.save()'s legacy format";
    }
    if (!kind) return CLMHA_SUCCESS;
    return clmha__msg(
        msg, msg_size, CLMHA_INVALID_FILE,
        "%s: this is a PyTorch checkpoint written by torch.save (%s), not a .safetensors "
        "file; clmha reads .safetensors layer files. Convert a saved module with: python3 -c "
        "\"import clmha.torch, torch; clmha.torch.export(torch.load('%s'), '%s.safetensors')\"; "
        "or save a state_dict with safetensors.torch.save_file(state_dict, path) and pick the "
        "attention module out of it with --prefix and --num-heads (clmha_load_options)",
        name, kind, name, name);
}

// "tensor "x" (data_offsets [b, e])" into @p buf.
static const char *range_text(char *buf, size_t size, const clmha__st_tensor *t) {
    snprintf(buf, size, "tensor \"%.*s\" (data_offsets [%zu, %zu])", CLMHA__ST_QUOTE_MAX, t->name,
             t->begin, t->end);
    return buf;
}

static int compare_ranges(const void *a, const void *b) {
    const clmha__st_tensor *x = *(const clmha__st_tensor *const *)a;
    const clmha__st_tensor *y = *(const clmha__st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

// The format's rule on the data section (the reference implementation's validate()): the
// tensors' byte ranges, sorted by (begin, end), follow one another from byte 0 without overlap
// or hole, and the last ends at the end of the data section.
static clmha_status check_coverage(const clmha__st_file *f, size_t data_size, const char *name,
                                   char *msg, size_t msg_size) {
    size_t n = f->tensor_count;
    const clmha__st_tensor *small[CLMHA__ST_MAX_TENSORS];
    const clmha__st_tensor **sorted = small;
    if (n > CLMHA__ST_MAX_TENSORS && !(sorted = malloc(n * sizeof *sorted)))
        return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", name);
    clmha_status st = CLMHA_SUCCESS;
    for (size_t i = 0; i < n; ++i) sorted[i] = &f->tensors[i];
    if (n > 1) qsort(sorted, n, sizeof *sorted, compare_ranges);
    char a[160], b[160];
    size_t at = 0;  // end of the bytes covered so far
    for (size_t i = 0; i < n && !st; ++i) {
        const clmha__st_tensor *t = sorted[i];
        if (t->begin < at) {  // i > 0: at is 0 before the first
            st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                            "%s: %s overlaps %s; the tensors' data must follow one another "
                            "without overlap",
                            name, range_text(a, sizeof a, t),
                            range_text(b, sizeof b, sorted[i - 1]));
        } else if (t->begin > at && i == 0) {
            st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                            "%s: bytes [0, %zu) of the data section belong to no tensor "
                            "(before %s)",
                            name, t->begin, range_text(a, sizeof a, t));
        } else if (t->begin > at) {
            st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                            "%s: bytes [%zu, %zu) of the data section belong to no tensor (a "
                            "hole between %s and %s)",
                            name, at, t->begin, range_text(a, sizeof a, sorted[i - 1]),
                            range_text(b, sizeof b, t));
        }
        at = t->end;
    }
    if (!st && at < data_size && n == 0) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: bytes [0, %zu) of the data section belong to no tensor (the "
                        "header has no tensor)",
                        name, data_size);
    } else if (!st && at < data_size) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: bytes [%zu, %zu) of the data section belong to no tensor (after "
                        "%s, the last)",
                        name, at, data_size, range_text(a, sizeof a, sorted[n - 1]));
    }
    if (sorted != small) free(sorted);
    return st;
}

clmha_status clmha__safetensors_parse(const void *bytes, size_t size, const char *name,
                                      clmha__st_file *out, char *msg, size_t msg_size) {
    return clmha__safetensors_parse_as(bytes, size, name, CLMHA__ST_LAYER_LIMITS, out, msg,
                                       msg_size);
}

// An upper bound on the JSON values of the text @p h (n bytes): its commas and opening brackets
// outside strings, plus one (each value but the first of a container follows a comma, the
// first follows its bracket). Keys are not values (cJSON keeps them in their value's node).
static size_t count_values(const unsigned char *h, size_t n) {
    size_t count = 1;
    bool in_string = false;
    for (size_t i = 0; i < n; ++i) {
        unsigned char c = h[i];
        if (in_string) {
            if (c == '\\') ++i;
            else if (c == '"') in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == ',' || c == '[' || c == '{') {
            ++count;
        }
    }
    return count;
}

// Checks the file's first bytes (@p b, @p size of them): long enough, not a torch.save() file,
// a header length (*header_size) that fits the file and @p limits, header text of the format.
static clmha_status check_header_bytes(const unsigned char *b, size_t size,
                                       clmha__st_limits limits, size_t *header_size,
                                       const char *name, char *msg, size_t msg_size) {
    clmha_status st;
    if (size == 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the file is empty (a safetensors file starts with an 8-byte "
                          "header length)",
                          name);
    if (size < 8)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the file is %zu bytes long, too short for a safetensors file (it "
                          "starts with an 8-byte header length)",
                          name, size);
    if ((st = clmha__st_torch_save_check(b, size, size, name, msg, msg_size))) return st;
    uint64_t n64 = clmha__st_le64(b);
    if (n64 > clmha__st_max_header(limits))
        return clmha__st_header_too_long(n64, limits, name, msg, msg_size);
    if (n64 > size - 8)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header length %llu is larger than the rest of the file (%zu "
                          "bytes); not a safetensors file?",
                          name, (unsigned long long)n64, size - 8);
    size_t n = (size_t)n64;
    const unsigned char *header = b + 8;
    if ((st = header_text_check(header, n, name, msg, msg_size))) return st;
    if (limits == CLMHA__ST_MODEL_LIMITS) {
        size_t values = count_values(header, n);
        if (values > CLMHA__ST_MODEL_MAX_VALUES)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the header holds about %zu JSON values; a model's file read "
                              "with a prefix holds at most %zu (refused before parsing)",
                              name, values, CLMHA__ST_MODEL_MAX_VALUES);
    }
    *header_size = n;
    return CLMHA_SUCCESS;
}

// Parses the @p n bytes of @p header as one JSON value (into out->json) followed by whitespace
// only; *used: the bytes before that whitespace.
static clmha_status parse_json(const unsigned char *header, size_t n, clmha__st_file *out,
                               size_t *used_out, const char *name, char *msg, size_t msg_size) {
    // The format pads the header with trailing spaces; other JSON whitespace is accepted too
    // (as the reference implementation does), anything else after the JSON value is not.
    size_t used = n;
    while (used > 0 && strchr(" \t\n\r", header[used - 1]) && header[used - 1]) --used;
    if (used == 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header is empty; it must be a JSON object", name);
    const char *end = NULL;
    out->json = cJSON_ParseWithLengthOpts((const char *)header, used, &end, false);
    if (!out->json) {
        const char *h = (const char *)header;
        size_t at = end && end >= h && end <= h + used ? (size_t)(end - h) : 0;
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header is not valid JSON (error near byte %zu of the %zu-byte "
                          "header)",
                          name, at, n);
    }
    if (end != (const char *)header + used) {
        size_t at = end ? (size_t)(end - (const char *)header) : 0;
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header has bytes other than whitespace after its JSON value "
                          "(from byte %zu of the %zu-byte header)",
                          name, at, n);
    }
    *used_out = used;
    return CLMHA_SUCCESS;
}

// Where the text of each number of @p json (parsed from the @p used bytes of @p header) starts,
// into @p nums (see json_size()); nums->at is the caller's to free.
static clmha_status find_numbers(const unsigned char *header, size_t used, cJSON *json,
                                 number_text *nums, const char *name, char *msg,
                                 size_t msg_size) {
    nums->end = (const char *)header + used;
    nums->count = scan_numbers((const char *)header, used, NULL);
    if (nums->count && !(nums->at = malloc(nums->count * sizeof *nums->at)))
        return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", name);
    scan_numbers((const char *)header, used, nums->at);
    size_t numbered = 0;
    index_numbers(json, &numbered);
    if (numbered != nums->count)  // cannot happen: both read the same valid JSON
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header's numbers cannot be read (%zu found, %zu parsed)", name,
                          nums->count, numbered);
    return CLMHA_SUCCESS;
}

// Checks that the header @p root is an object of keyed entries with at most one __metadata__
// (*metadata, NULL when none) and at most @p limits' tensors (*count).
static clmha_status count_entries(const cJSON *root, clmha__st_limits limits, size_t *count_out,
                                  const cJSON **metadata, const char *name, char *msg,
                                  size_t msg_size) {
    if (!cJSON_IsObject(root)) {
        const char *kind = cJSON_IsArray(root)    ? "a JSON array"
                           : cJSON_IsString(root) ? "a JSON string"
                           : cJSON_IsNumber(root) ? "a JSON number"
                           : cJSON_IsBool(root)   ? "a JSON boolean"
                                                  : "JSON null";
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header is %s, not a JSON object", name, kind);
    }
    size_t count = 0;
    *metadata = NULL;
    for (const cJSON *c = root->child; c; c = c->next) {
        if (!c->string)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the header has an entry without a key", name);
        if (strcmp(c->string, "__metadata__") == 0) {
            if (*metadata)
                return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                                  "%s: the header has __metadata__ twice", name);
            *metadata = c;
        } else {
            ++count;
        }
    }
    if (limits == CLMHA__ST_MODEL_LIMITS && count > CLMHA__ST_MODEL_MAX_TENSORS)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header has %zu tensor entries; a model's file read with a "
                          "prefix has at most %d",
                          name, count, CLMHA__ST_MODEL_MAX_TENSORS);
    if (limits == CLMHA__ST_LAYER_LIMITS && count > CLMHA__ST_MAX_TENSORS)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the header has %zu tensor entries; a layer file has at most %d "
                          "(in_proj_weight or q_proj_weight, k_proj_weight and v_proj_weight, "
                          "in_proj_bias, out_proj.weight, out_proj.bias, bias_k, bias_v, "
                          "alibi_slopes, sinks); a "
                          "whole model's file needs a prefix",
                          name, count, CLMHA__ST_MAX_TENSORS);
    *count_out = count;
    return CLMHA_SUCCESS;
}

clmha_status clmha__safetensors_parse_as(const void *bytes, size_t size, const char *name,
                                         clmha__st_limits limits, clmha__st_file *out, char *msg,
                                         size_t msg_size) {
    if (!out) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "out is NULL");
    memset(out, 0, sizeof *out);
    if (!name) name = "(unnamed)";
    if (!bytes && size)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "%s: bytes is NULL", name);
    clmha_status st = CLMHA_SUCCESS;
    number_text nums = {0};
    const unsigned char *b = bytes;
    size_t n = 0, used = 0, count = 0;
    const cJSON *metadata = NULL;
    if ((st = check_header_bytes(b, size, limits, &n, name, msg, msg_size))) goto fail;
    const unsigned char *header = b + 8;
    const unsigned char *data = header + n;
    size_t data_size = size - 8 - n;
    if ((st = parse_json(header, n, out, &used, name, msg, msg_size)) ||
        (st = find_numbers(header, used, out->json, &nums, name, msg, msg_size)) ||
        (st = count_entries(out->json, limits, &count, &metadata, name, msg, msg_size)))
        goto fail;
    if (metadata && (st = parse_metadata(metadata, out, name, msg, msg_size))) goto fail;
    if (count) {
        out->tensors = calloc(count, sizeof *out->tensors);
        if (!out->tensors) {
            st = clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", name);
            goto fail;
        }
    }
    for (const cJSON *c = out->json->child; c; c = c->next) {
        if (c == metadata) continue;
        clmha__st_tensor *t = &out->tensors[out->tensor_count++];
        t->name = t->param = c->string;
        if ((st = parse_tensor(c, data, data_size, &nums, t, name, msg, msg_size))) goto fail;
    }
    if (out->tensor_count > 1)  // qsort needs a valid pointer even for no elements
        qsort(out->tensors, out->tensor_count, sizeof *out->tensors, compare_tensor_names);
    for (size_t i = 1; i < out->tensor_count; ++i)
        if (strcmp(out->tensors[i - 1].name, out->tensors[i].name) == 0) {
            st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                            "%s: the header has the tensor \"%.*s\" twice", name,
                            CLMHA__ST_QUOTE_MAX, out->tensors[i].name);
            goto fail;
        }
    if ((st = check_coverage(out, data_size, name, msg, msg_size))) goto fail;
    free(nums.at);
    return CLMHA_SUCCESS;
fail:
    free(nums.at);
    clmha__safetensors_free(out);
    return st;
}

void clmha__safetensors_free(clmha__st_file *file) {
    if (!file) return;
    cJSON_Delete(file->json);
    free(file->tensors);
    free(file->meta);
    memset(file, 0, sizeof *file);
}

const clmha__st_tensor *clmha__safetensors_tensor(const clmha__st_file *file, const char *name) {
    if (!file || !name) return NULL;
    for (size_t i = 0; i < file->tensor_count; ++i)
        if (strcmp(file->tensors[i].param, name) == 0) return &file->tensors[i];
    return NULL;
}

const char *clmha__safetensors_meta(const clmha__st_file *file, const char *key) {
    if (!file || !key) return NULL;
    for (size_t i = 0; i < file->meta_count; ++i)
        if (strcmp(file->meta[i].key, key) == 0) return file->meta[i].value;
    return NULL;
}
