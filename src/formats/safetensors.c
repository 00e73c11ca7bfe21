// Layer files: .safetensors with nn.MultiheadAttention's state_dict names.
//
// clmha__safetensors_parse() and clmha__safetensors_desc() check a file held in memory and need
// no OpenCL; clmha_layer_load() reads the file, runs them, then creates the layer and sets its
// parameters. clmha_layer_save() writes F32 tensors to a temporary file and renames it.
#define _POSIX_C_SOURCE 200809L

#include "formats/safetensors.h"

#include "base/checked.h"
#include "base/file_write.h"
#include "base/message.h"
#include "errors/errors.h"
#include "layer/shape.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <float.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// Longest quoted user string (tensor name, dtype, metadata value) put in a message.
#define QUOTE_MAX 64

// ---- parsing ------------------------------------------------------------------------------

static uint64_t read_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

static size_t dtype_size(clmha__st_dtype dtype) {
    return dtype == CLMHA__ST_F16 ? 2 : dtype == CLMHA__ST_F32 ? 4 : 8;
}

static const char *dtype_name(clmha__st_dtype dtype) {
    return dtype == CLMHA__ST_F16 ? "F16" : dtype == CLMHA__ST_F32 ? "F32" : "F64";
}

// Index of the first byte of @p s (n bytes) that is not valid UTF-8, or n.
static size_t utf8_invalid_at(const unsigned char *s, size_t n) {
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
    size_t bad = utf8_invalid_at(h, n);
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

// Reads a JSON number that must be a non-negative integer, exactly, from its text: digits
// only, no sign, fraction or exponent, no leading zero (as JSON writes integers). Returns 0
// when it is one, 1 when it is not, 2 when it is larger than SIZE_MAX. *text and *len get the
// number's text (NULL when @p item is not a number).
static int json_size(const cJSON *item, const number_text *nums, size_t *out, const char **text,
                     size_t *len) {
    const char *p = *text = number_of(item, nums, len);
    if (!p || *len == 0 || (p[0] == '0' && *len > 1)) return 1;
    size_t v = 0;
    bool big = false;
    for (size_t i = 0; i < *len; ++i) {
        if (p[i] < '0' || p[i] > '9') return 1;
        size_t d = (size_t)(p[i] - '0');
        if (v > (SIZE_MAX - d) / 10) big = true;
        else v = v * 10 + d;
    }
    if (big) return 2;
    *out = v;
    return 0;
}

// "(2, 3)" for a shape of any rank up to CLMHA__ST_MAX_DIMS.
static const char *shape_text(char *buf, size_t size, size_t ndim, const size_t *shape) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (size_t i = 0; i < ndim && used < size; ++i)
        used += (size_t)snprintf(buf + used, size - used, i ? ", %zu" : "%zu", shape[i]);
    if (used < size) snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
    return buf;
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

// Fills @p t from the JSON object @p obj describing tensor @p t->name.
static clmha_status parse_tensor(const cJSON *obj, const unsigned char *data, size_t data_size,
                                 const number_text *nums, clmha__st_tensor *t, const char *name,
                                 char *msg, size_t msg_size) {
    const char *tn = t->name;
    char sbuf[256];
    if (!cJSON_IsObject(obj))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" is not a JSON object", name, QUOTE_MAX, tn);
    bool oom;
    const char *dup = duplicate_key(obj, &oom);
    if (oom) return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", name);
    if (dup)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" has the key \"%.*s\" twice", name, QUOTE_MAX, tn,
                          QUOTE_MAX, dup);

    // dtype
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(obj, "dtype");
    if (!dtype)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s: tensor \"%.*s\" has no dtype",
                          name, QUOTE_MAX, tn);
    if (!cJSON_IsString(dtype) || !dtype->valuestring)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the dtype of tensor \"%.*s\" is not a string", name, QUOTE_MAX,
                          tn);
    const char *ds = dtype->valuestring;
    if (strcmp(ds, "F32") == 0) {
        t->dtype = CLMHA__ST_F32;
    } else if (strcmp(ds, "F16") == 0) {
        t->dtype = CLMHA__ST_F16;
    } else if (strcmp(ds, "F64") == 0) {
        t->dtype = CLMHA__ST_F64;
    } else {
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" has dtype \"%.*s\", which clmha does not read "
                          "(F32, F16 or F64)",
                          name, QUOTE_MAX, tn, QUOTE_MAX, ds);
    }

    // shape
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(obj, "shape");
    if (!shape)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s: tensor \"%.*s\" has no shape",
                          name, QUOTE_MAX, tn);
    if (!cJSON_IsArray(shape))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the shape of tensor \"%.*s\" is not a JSON array", name,
                          QUOTE_MAX, tn);
    size_t ndim = 0, count = 1;
    bool overflow = false;
    for (const cJSON *dim = shape->child; dim; dim = dim->next) {
        if (ndim == CLMHA__ST_MAX_DIMS)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: tensor \"%.*s\" has more than %d dimensions", name,
                              QUOTE_MAX, tn, CLMHA__ST_MAX_DIMS);
        size_t v = 0, len;
        const char *text;
        int r = json_size(dim, nums, &v, &text, &len);
        if (r == 1 && text)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: dimension %zu of the shape of tensor \"%.*s\" is %.*s, not a "
                              "non-negative integer",
                              name, ndim, QUOTE_MAX, tn, (int)(len < QUOTE_MAX ? len : QUOTE_MAX),
                              text);
        if (r == 1)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: dimension %zu of the shape of tensor \"%.*s\" is not a "
                              "non-negative integer",
                              name, ndim, QUOTE_MAX, tn);
        if (r == 2)
            return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                              "%s: dimension %zu of the shape of tensor \"%.*s\" is too large "
                              "(%.*s)",
                              name, ndim, QUOTE_MAX, tn, (int)(len < QUOTE_MAX ? len : QUOTE_MAX),
                              text);
        t->shape[ndim++] = v;
        if (!clmha__mul(count, v, &count)) overflow = true;
    }
    t->ndim = ndim;
    size_t nbytes = 0;
    // A zero dimension makes the product 0 whatever came before it.
    for (size_t i = 0; i < ndim && overflow; ++i)
        if (t->shape[i] == 0) overflow = false, count = 0;
    if (overflow || !clmha__mul(count, dtype_size(t->dtype), &nbytes))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                          "%s: the shape %s of tensor \"%.*s\" holds more bytes than size_t "
                          "can count",
                          name, shape_text(sbuf, sizeof sbuf, ndim, t->shape), QUOTE_MAX, tn);
    t->count = count;

    // data_offsets
    const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(obj, "data_offsets");
    if (!offsets)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" has no data_offsets", name, QUOTE_MAX, tn);
    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the data_offsets of tensor \"%.*s\" are not an array [begin, end]",
                          name, QUOTE_MAX, tn);
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
                              name, QUOTE_MAX, tn);
        if (r == 2 || off[i] > data_size)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the data_offsets of tensor \"%.*s\" point past the end of "
                              "the data section (%zu bytes): %s %.*s",
                              name, QUOTE_MAX, tn, data_size, i ? "end" : "begin",
                              (int)(len < QUOTE_MAX ? len : QUOTE_MAX), text);
    }
    if (off[0] > off[1])
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the data_offsets [%zu, %zu] of tensor \"%.*s\" have begin > end",
                          name, off[0], off[1], QUOTE_MAX, tn);
    if (off[1] - off[0] != nbytes)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"%.*s\" has shape %s of %s = %zu bytes, but its "
                          "data_offsets [%zu, %zu] span %zu bytes",
                          name, QUOTE_MAX, tn, shape_text(sbuf, sizeof sbuf, ndim, t->shape),
                          dtype_name(t->dtype), nbytes, off[0], off[1], off[1] - off[0]);
    t->data = data + off[0];
    t->begin = off[0];
    t->end = off[1];
    return CLMHA_SUCCESS;
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
                              name, QUOTE_MAX, c->string);
        out->meta[out->meta_count++] = (clmha__st_meta){c->string, c->valuestring};
    }
    qsort(out->meta, out->meta_count, sizeof *out->meta, compare_meta_keys);
    for (size_t i = 1; i < out->meta_count; ++i)
        if (strcmp(out->meta[i - 1].key, out->meta[i].key) == 0)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: __metadata__ has the key \"%.*s\" twice", name, QUOTE_MAX,
                              out->meta[i].key);
    return CLMHA_SUCCESS;
}

// The message for a header length over CLMHA__ST_MAX_HEADER.
static clmha_status header_too_long(uint64_t n, const char *name, char *msg, size_t msg_size) {
    return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                      "%s: the header length %llu exceeds the limit of %zu bytes for a layer "
                      "file (a layer's header holds at most %d tensors and a few metadata "
                      "strings); refused without reading it",
                      name, (unsigned long long)n, CLMHA__ST_MAX_HEADER, CLMHA__ST_MAX_TENSORS);
}

// "tensor "x" (data_offsets [b, e])" into @p buf.
static const char *range_text(char *buf, size_t size, const clmha__st_tensor *t) {
    snprintf(buf, size, "tensor \"%.*s\" (data_offsets [%zu, %zu])", QUOTE_MAX, t->name, t->begin,
             t->end);
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
    const clmha__st_tensor *sorted[CLMHA__ST_MAX_TENSORS];
    size_t n = f->tensor_count;
    for (size_t i = 0; i < n; ++i) sorted[i] = &f->tensors[i];
    if (n > 1) qsort(sorted, n, sizeof *sorted, compare_ranges);
    char a[160], b[160];
    size_t at = 0;  // end of the bytes covered so far
    for (size_t i = 0; i < n; ++i) {
        const clmha__st_tensor *t = sorted[i];
        if (t->begin < at)  // i > 0: at is 0 before the first
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: %s overlaps %s; the tensors' data must follow one another "
                              "without overlap",
                              name, range_text(a, sizeof a, t),
                              range_text(b, sizeof b, sorted[i - 1]));
        if (t->begin > at) {
            if (i == 0)
                return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                                  "%s: bytes [0, %zu) of the data section belong to no tensor "
                                  "(before %s)",
                                  name, t->begin, range_text(a, sizeof a, t));
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: bytes [%zu, %zu) of the data section belong to no tensor (a "
                              "hole between %s and %s)",
                              name, at, t->begin, range_text(a, sizeof a, sorted[i - 1]),
                              range_text(b, sizeof b, t));
        }
        at = t->end;
    }
    if (at < data_size) {
        if (n == 0)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: bytes [0, %zu) of the data section belong to no tensor (the "
                              "header has no tensor)",
                              name, data_size);
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: bytes [%zu, %zu) of the data section belong to no tensor (after "
                          "%s, the last)",
                          name, at, data_size, range_text(a, sizeof a, sorted[n - 1]));
    }
    return CLMHA_SUCCESS;
}

clmha_status clmha__safetensors_parse(const void *bytes, size_t size, const char *name,
                                      clmha__st_file *out, char *msg, size_t msg_size) {
    if (!out) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "out is NULL");
    memset(out, 0, sizeof *out);
    if (!name) name = "(unnamed)";
    if (!bytes && size)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "%s: bytes is NULL", name);
    clmha_status st = CLMHA_SUCCESS;
    number_text nums = {0};
    const unsigned char *b = bytes;
    if (size == 0) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: the file is empty (a safetensors file starts with an 8-byte header "
                        "length)",
                        name);
        goto fail;
    }
    if (size < 8) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: the file is %zu bytes long, too short for a safetensors file (it "
                        "starts with an 8-byte header length)",
                        name, size);
        goto fail;
    }
    uint64_t n64 = read_le64(b);
    if (n64 > CLMHA__ST_MAX_HEADER) {
        st = header_too_long(n64, name, msg, msg_size);
        goto fail;
    }
    if (n64 > size - 8) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: the header length %llu is larger than the rest of the file (%zu "
                        "bytes); not a safetensors file?",
                        name, (unsigned long long)n64, size - 8);
        goto fail;
    }
    size_t n = (size_t)n64;
    const unsigned char *header = b + 8;
    const unsigned char *data = header + n;
    size_t data_size = size - 8 - n;
    if ((st = header_text_check(header, n, name, msg, msg_size))) goto fail;

    // The format pads the header with trailing spaces; other JSON whitespace is accepted too
    // (as the reference implementation does), anything else after the JSON value is not.
    size_t used = n;
    while (used > 0 && strchr(" \t\n\r", header[used - 1]) && header[used - 1]) --used;
    if (used == 0) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: the header is empty; it must be a JSON object", name);
        goto fail;
    }
    const char *end = NULL;
    out->json = cJSON_ParseWithLengthOpts((const char *)header, used, &end, false);
    if (!out->json) {
        const char *h = (const char *)header;
        size_t at = end && end >= h && end <= h + used ? (size_t)(end - h) : 0;
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: the header is not valid JSON (error near byte %zu of the %zu-byte "
                        "header)",
                        name, at, n);
        goto fail;
    }
    if (end != (const char *)header + used) {
        size_t at = end ? (size_t)(end - (const char *)header) : 0;
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: the header has bytes other than whitespace after its JSON value (from "
                        "byte %zu of the %zu-byte header)",
                        name, at, n);
        goto fail;
    }
    const cJSON *root = out->json;
    // Where each number's text starts (see json_size()).
    nums.end = (const char *)header + used;
    nums.count = scan_numbers((const char *)header, used, NULL);
    if (nums.count && !(nums.at = malloc(nums.count * sizeof *nums.at))) {
        st = clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", name);
        goto fail;
    }
    scan_numbers((const char *)header, used, nums.at);
    size_t numbered = 0;
    index_numbers(out->json, &numbered);
    if (numbered != nums.count) {  // cannot happen: both read the same valid JSON
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: the header's numbers cannot be read (%zu found, %zu parsed)", name,
                        nums.count, numbered);
        goto fail;
    }
    if (!cJSON_IsObject(root)) {
        const char *kind = cJSON_IsArray(root)    ? "a JSON array"
                           : cJSON_IsString(root) ? "a JSON string"
                           : cJSON_IsNumber(root) ? "a JSON number"
                           : cJSON_IsBool(root)   ? "a JSON boolean"
                                                  : "JSON null";
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: the header is %s, not a JSON object", name, kind);
        goto fail;
    }

    size_t count = 0;
    const cJSON *metadata = NULL;
    for (const cJSON *c = root->child; c; c = c->next) {
        if (!c->string) {
            st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                            "%s: the header has an entry without a key", name);
            goto fail;
        }
        if (strcmp(c->string, "__metadata__") == 0) {
            if (metadata) {
                st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                                "%s: the header has __metadata__ twice", name);
                goto fail;
            }
            metadata = c;
        } else {
            ++count;
        }
    }
    if (count > CLMHA__ST_MAX_TENSORS) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: the header has %zu tensor entries; a layer file has at most %d "
                        "(in_proj_weight or q_proj_weight, k_proj_weight and v_proj_weight, "
                        "in_proj_bias, out_proj.weight, out_proj.bias, bias_k, bias_v)",
                        name, count, CLMHA__ST_MAX_TENSORS);
        goto fail;
    }
    if (metadata && (st = parse_metadata(metadata, out, name, msg, msg_size))) goto fail;
    if (count) {
        out->tensors = calloc(count, sizeof *out->tensors);
        if (!out->tensors) {
            st = clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", name);
            goto fail;
        }
    }
    for (const cJSON *c = root->child; c; c = c->next) {
        if (c == metadata) continue;
        clmha__st_tensor *t = &out->tensors[out->tensor_count++];
        t->name = c->string;
        if ((st = parse_tensor(c, data, data_size, &nums, t, name, msg, msg_size))) goto fail;
    }
    if (out->tensor_count > 1)  // qsort needs a valid pointer even for no elements
        qsort(out->tensors, out->tensor_count, sizeof *out->tensors, compare_tensor_names);
    for (size_t i = 1; i < out->tensor_count; ++i)
        if (strcmp(out->tensors[i - 1].name, out->tensors[i].name) == 0) {
            st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                            "%s: the header has the tensor \"%.*s\" twice", name, QUOTE_MAX,
                            out->tensors[i].name);
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
        if (strcmp(file->tensors[i].name, name) == 0) return &file->tensors[i];
    return NULL;
}

const char *clmha__safetensors_meta(const clmha__st_file *file, const char *key) {
    if (!file || !key) return NULL;
    for (size_t i = 0; i < file->meta_count; ++i)
        if (strcmp(file->meta[i].key, key) == 0) return file->meta[i].value;
    return NULL;
}

// ---- conversion ---------------------------------------------------------------------------

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);  // infinity, or NaN keeping its payload
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);  // rebias 15 -> 127
    } else {
        float f = (float)mant * 0x1p-24f;  // zero or subnormal: mant * 2^-24, exact
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float double_to_float(double d) {
    // Values from FLT_MAX + half an ulp round to infinity (a plain conversion is undefined).
    if (d >= 0x1.ffffffp127) return INFINITY;
    if (d <= -0x1.ffffffp127) return -INFINITY;
    return (float)d;
}

void clmha__safetensors_to_float(const clmha__st_tensor *t, float *out) {
    const unsigned char *p = t->data;
    for (size_t i = 0; i < t->count; ++i) {
        if (t->dtype == CLMHA__ST_F16) {
            out[i] = half_to_float((uint16_t)(p[2 * i] | (p[2 * i + 1] << 8)));
        } else if (t->dtype == CLMHA__ST_F32) {
            const unsigned char *q = p + 4 * i;
            uint32_t bits = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 |
                            (uint32_t)q[3] << 24;
            memcpy(&out[i], &bits, sizeof bits);
        } else {
            uint64_t bits = read_le64(p + 8 * i);
            double d;
            memcpy(&d, &bits, sizeof d);
            out[i] = double_to_float(d);
        }
    }
}

// ---- the layer a file describes -----------------------------------------------------------

static const char *const known_names[] = {
    "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
    "out_proj.weight", "out_proj.bias", "bias_k", "bias_v"};

// A positive decimal integer, digits only.
static bool parse_count(const char *s, size_t *out) {
    size_t v = 0;
    if (!*s) return false;
    for (; *s; ++s) {
        if (*s < '0' || *s > '9') return false;
        size_t d = (size_t)(*s - '0');
        if (v > (SIZE_MAX - d) / 10) return false;
        v = v * 10 + d;
    }
    if (v == 0) return false;
    *out = v;
    return true;
}

// A decimal number without sign: digits, optional fraction, optional exponent ("0.1", ".5",
// "1e-05", "0"). Independent of the C locale.
static bool parse_decimal(const char *s, double *out) {
    uint64_t mant = 0;
    long exp10 = 0;
    bool digits = false;
    for (; *s >= '0' && *s <= '9'; ++s) {
        digits = true;
        if (mant < 100000000000000000ull) mant = mant * 10 + (uint64_t)(*s - '0');
        else if (exp10 < 100000) ++exp10;  // digits past the 18th only scale
    }
    if (*s == '.') {
        for (++s; *s >= '0' && *s <= '9'; ++s) {
            digits = true;
            if (mant < 100000000000000000ull) {
                mant = mant * 10 + (uint64_t)(*s - '0');
                if (exp10 > -100000) --exp10;
            }
        }
    }
    if (!digits) return false;
    if (*s == 'e' || *s == 'E') {
        ++s;
        bool neg = *s == '-';
        if (*s == '-' || *s == '+') ++s;
        if (*s < '0' || *s > '9') return false;
        long e = 0;
        for (; *s >= '0' && *s <= '9'; ++s)
            if (e < 100000) e = e * 10 + (*s - '0');
        exp10 += neg ? -e : e;
    }
    if (*s) return false;
    double v = (double)mant;
    if (mant == 0 || exp10 == 0) {
        *out = v;
    } else if (exp10 > 400) {
        *out = INFINITY;
    } else if (exp10 < -400) {
        *out = 0.0;
    } else if (exp10 > 0) {
        *out = v * pow(10.0, (double)exp10);
    } else {
        *out = v / pow(10.0, (double)-exp10);
    }
    return true;
}

// Whether the decimal @p s (as parse_decimal() accepts it) is below 1, decided on its digits
// and exponent, exactly: the double parse_decimal() gives may round a value below 1 up to 1.
static bool decimal_below_one(const char *s) {
    long point = -1, first = -1, digits = 0;  // position of the point, of the first digit > 0
    for (; (*s >= '0' && *s <= '9') || *s == '.'; ++s) {
        if (*s == '.') {
            point = digits;
        } else {
            if (first < 0 && *s != '0') first = digits;
            ++digits;
        }
    }
    if (first < 0) return true;  // zero
    if (point < 0) point = digits;
    long exp10 = 0;
    if (*s == 'e' || *s == 'E') {
        ++s;
        bool neg = *s == '-';
        if (*s == '-' || *s == '+') ++s;
        for (; *s >= '0' && *s <= '9'; ++s)
            if (exp10 < 100000000) exp10 = exp10 * 10 + (*s - '0');
        if (neg) exp10 = -exp10;
    }
    // The first non-zero digit has the weight 10^(point - first - 1 + exp10).
    return point - first - 1 + exp10 < 0;
}

// "true" / "false" / absent (false).
static clmha_status meta_bool(const clmha__st_file *f, const char *key, bool *out,
                              const char *name, char *msg, size_t msg_size) {
    const char *v = clmha__safetensors_meta(f, key);
    *out = false;
    if (!v || strcmp(v, "false") == 0) return CLMHA_SUCCESS;
    if (strcmp(v, "true") == 0) {
        *out = true;
        return CLMHA_SUCCESS;
    }
    return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                      "%s: __metadata__ %s is \"%.*s\", expected \"true\" or \"false\"", name, key,
                      QUOTE_MAX, v);
}

// Checks that tensor @p t (may be NULL: then nothing to check) has exactly the shape @p want.
static clmha_status expect_shape(const clmha__st_tensor *t, size_t ndim, const size_t *want,
                                 const char *formula, const char *name, char *msg,
                                 size_t msg_size) {
    if (!t) return CLMHA_SUCCESS;
    bool ok = t->ndim == ndim;
    for (size_t i = 0; ok && i < ndim; ++i) ok = t->shape[i] == want[i];
    if (ok) return CLMHA_SUCCESS;
    char got[256], exp[128];
    return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                      "%s: tensor \"%s\" has shape %s, expected %s = %s", name, t->name,
                      shape_text(got, sizeof got, t->ndim, t->shape), formula,
                      shape_text(exp, sizeof exp, ndim, want));
}

clmha_status clmha__safetensors_desc(const clmha__st_file *f, const char *name,
                                     clmha_layer_desc *desc, char *msg, size_t msg_size) {
    if (!f || !desc) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "NULL argument");
    if (!name) name = "(unnamed)";
    memset(desc, 0, sizeof *desc);
    clmha_status st;
    char sbuf[256];

    for (size_t i = 0; i < f->tensor_count; ++i) {
        bool known = false;
        for (size_t k = 0; k < sizeof known_names / sizeof *known_names && !known; ++k)
            known = strcmp(f->tensors[i].name, known_names[k]) == 0;
        if (!known)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: unknown tensor \"%.*s\" (a nn.MultiheadAttention file holds "
                              "in_proj_weight or q_proj_weight, k_proj_weight and v_proj_weight, "
                              "out_proj.weight, and optionally in_proj_bias with out_proj.bias, "
                              "bias_k with bias_v)",
                              name, QUOTE_MAX, f->tensors[i].name);
    }

    // embed_dim from out_proj.weight (E, E).
    const clmha__st_tensor *ow = clmha__safetensors_tensor(f, "out_proj.weight");
    if (!ow)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the file has no tensor \"out_proj.weight\"", name);
    if (ow->ndim != 2 || ow->shape[0] == 0 || ow->shape[0] != ow->shape[1]) {
        size_t e0 = ow->ndim ? ow->shape[0] : 0;
        char want[128] = "";
        if (e0) snprintf(want, sizeof want, " = (%zu, %zu)", e0, e0);
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: tensor \"out_proj.weight\" has shape %s, expected (E, E)%s with "
                          "E > 0",
                          name, shape_text(sbuf, sizeof sbuf, ow->ndim, ow->shape), want);
    }
    size_t e = ow->shape[0], three_e;
    if (!clmha__mul(e, 3, &three_e))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "%s: embed_dim %zu is too large",
                          name, e);

    // The input projection: packed, or one weight per input.
    const clmha__st_tensor *ipw = clmha__safetensors_tensor(f, "in_proj_weight");
    const clmha__st_tensor *qw = clmha__safetensors_tensor(f, "q_proj_weight");
    const clmha__st_tensor *kw = clmha__safetensors_tensor(f, "k_proj_weight");
    const clmha__st_tensor *vw = clmha__safetensors_tensor(f, "v_proj_weight");
    size_t kdim = e, vdim = e;
    if (ipw) {
        if (qw || kw || vw)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the file holds both in_proj_weight and %s; it must hold "
                              "either in_proj_weight or q_proj_weight, k_proj_weight and "
                              "v_proj_weight",
                              name, qw ? "q_proj_weight" : kw ? "k_proj_weight" : "v_proj_weight");
        size_t want[2] = {three_e, e};
        if ((st = expect_shape(ipw, 2, want, "(3E, E)", name, msg, msg_size))) return st;
    } else {
        if (!qw || !kw || !vw)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: the file has neither in_proj_weight nor q_proj_weight, "
                              "k_proj_weight and v_proj_weight (no \"%s\")",
                              name,
                              !qw ? "q_proj_weight" : !kw ? "k_proj_weight" : "v_proj_weight");
        size_t want[2] = {e, e};
        if ((st = expect_shape(qw, 2, want, "(E, E)", name, msg, msg_size))) return st;
        const clmha__st_tensor *kv[2] = {kw, vw};
        for (int i = 0; i < 2; ++i) {
            const clmha__st_tensor *t = kv[i];
            if (t->ndim != 2 || t->shape[0] != e || t->shape[1] == 0)
                return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                                  "%s: tensor \"%s\" has shape %s, expected (E, %s) = (%zu, %s) "
                                  "with %s > 0",
                                  name, t->name, shape_text(sbuf, sizeof sbuf, t->ndim, t->shape),
                                  i ? "vdim" : "kdim", e, i ? "vdim" : "kdim",
                                  i ? "vdim" : "kdim");
        }
        kdim = kw->shape[1];
        vdim = vw->shape[1];
    }

    // Biases come in pairs.
    const clmha__st_tensor *ib = clmha__safetensors_tensor(f, "in_proj_bias");
    const clmha__st_tensor *ob = clmha__safetensors_tensor(f, "out_proj.bias");
    if (!ib != !ob)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the file has %s but no %s; a layer has both (bias = True) or "
                          "neither",
                          name, ib ? "in_proj_bias" : "out_proj.bias",
                          ib ? "out_proj.bias" : "in_proj_bias");
    if ((st = expect_shape(ib, 1, (size_t[]){three_e}, "(3E)", name, msg, msg_size))) return st;
    if ((st = expect_shape(ob, 1, (size_t[]){e}, "(E)", name, msg, msg_size))) return st;
    const clmha__st_tensor *bk = clmha__safetensors_tensor(f, "bias_k");
    const clmha__st_tensor *bv = clmha__safetensors_tensor(f, "bias_v");
    if (!bk != !bv)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: the file has %s but no %s; a layer has both (add_bias_kv = True) "
                          "or neither",
                          name, bk ? "bias_k" : "bias_v", bk ? "bias_v" : "bias_k");
    size_t want_kv[3] = {1, 1, e};
    if ((st = expect_shape(bk, 3, want_kv, "(1, 1, E)", name, msg, msg_size))) return st;
    if ((st = expect_shape(bv, 3, want_kv, "(1, 1, E)", name, msg, msg_size))) return st;

    // Metadata.
    const char *nh = clmha__safetensors_meta(f, "num_heads");
    size_t heads = 0;
    if (!nh)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ has no num_heads (the number of attention heads, a "
                          "decimal string such as \"8\")",
                          name);
    if (!parse_count(nh, &heads))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ num_heads is \"%.*s\", expected a positive decimal "
                          "integer such as \"8\"",
                          name, QUOTE_MAX, nh);
    if (e % heads != 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: __metadata__ num_heads %zu does not divide embed_dim %zu (from "
                          "out_proj.weight)",
                          name, heads, e);
    bool batch_first, add_zero_attn;
    if ((st = meta_bool(f, "batch_first", &batch_first, name, msg, msg_size))) return st;
    if ((st = meta_bool(f, "add_zero_attn", &add_zero_attn, name, msg, msg_size))) return st;
    float dropout = 0.0f;
    const char *dp = clmha__safetensors_meta(f, "dropout");
    if (dp) {
        // The range is checked on the decimal itself; the float the layer keeps may still
        // round up to 1, which is said as such.
        double v = 0.0;
        if (!parse_decimal(dp, &v) || !decimal_below_one(dp))
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: __metadata__ dropout is \"%.*s\", expected a decimal number in "
                              "[0, 1) such as \"0.1\"",
                              name, QUOTE_MAX, dp);
        dropout = v < 1.0 ? (float)v : 1.0f;
        if (!(dropout < 1.0f))
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: __metadata__ dropout is \"%.*s\", which is below 1 but rounds "
                              "to 1 as a float (a layer keeps dropout as a float; the largest "
                              "below 1 is %.9g)",
                              name, QUOTE_MAX, dp, (double)nextafterf(1.0f, 0.0f));
    }

    clmha_layer_desc d = {.struct_size = sizeof d,
                          .embed_dim = e,
                          .num_heads = heads,
                          .kdim = kdim,
                          .vdim = vdim,
                          .bias = ib != NULL,
                          .add_bias_kv = bk != NULL,
                          .add_zero_attn = add_zero_attn,
                          .batch_first = batch_first,
                          .dropout = dropout};
    clmha_layer_desc checked;
    char why[512];
    if ((st = clmha__desc_check(&d, &checked, why, sizeof why)))
        return clmha__msg(msg, msg_size, st == CLMHA_SIZE_OVERFLOW ? st : CLMHA_INVALID_FILE,
                          "%s: %s", name, why);
    *desc = checked;
    return CLMHA_SUCCESS;
}

// ---- files --------------------------------------------------------------------------------

static void errno_text(int err, char *buf, size_t size) {
    if (strerror_r(err, buf, size) != 0) snprintf(buf, size, "error %d", err);
}

// Reads the whole file at @p path into a malloc'd buffer.
static clmha_status read_file(const clmha_context *ctx, const char *path, unsigned char **out,
                              size_t *out_size) {
    char why[256];
    clmha_status st = CLMHA_SUCCESS;
    unsigned char *buf = NULL;
    *out = NULL;
    *out_size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        errno_text(errno, why, sizeof why);
        return clmha__fail(ctx, CLMHA_IO_ERROR, "cannot open %s: %s", path, why);
    }
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0) {
        errno_text(errno, why, sizeof why);
        st = clmha__fail(ctx, CLMHA_IO_ERROR, "cannot read %s: %s", path, why);
        goto fail;
    }
    if (S_ISDIR(sb.st_mode)) {
        st = clmha__fail(ctx, CLMHA_IO_ERROR, "cannot read %s: it is a directory", path);
        goto fail;
    }
    // The header's length first: a header longer than a layer's can be is refused before the
    // file is read or a buffer sized for it.
    unsigned char head[8];
    size_t size = fread(head, 1, sizeof head, f);
    if (size == sizeof head && read_le64(head) > CLMHA__ST_MAX_HEADER) {
        char msg[CLMHA__ERROR_SIZE];
        st = clmha__fail(ctx, header_too_long(read_le64(head), path, msg, sizeof msg), "%s",
                         msg);
        goto fail;
    }
    // Regular files: their size, plus one byte to see the end. Others: grown as they come.
    size_t cap = 4096;
    if (S_ISREG(sb.st_mode) && sb.st_size >= 0) {
        if ((uintmax_t)sb.st_size >= SIZE_MAX) {
            st = clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "%s is too large to read (%jd bytes)",
                             path, (intmax_t)sb.st_size);
            goto fail;
        }
        cap = (size_t)sb.st_size + 1;
    }
    if (cap < sizeof head) cap = sizeof head;
    buf = malloc(cap);
    if (!buf) {
        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "%s: out of host memory (%zu bytes)", path,
                         cap);
        goto fail;
    }
    memcpy(buf, head, size);
    for (;;) {
        size += fread(buf + size, 1, cap - size, f);
        if (size < cap) break;  // end of file or error
        if (cap > SIZE_MAX / 2) {
            st = clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "%s is too large to read", path);
            goto fail;
        }
        unsigned char *grown = realloc(buf, cap * 2);
        if (!grown) {
            st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "%s: out of host memory (%zu bytes)",
                             path, cap * 2);
            goto fail;
        }
        buf = grown;
        cap *= 2;
    }
    if (ferror(f)) {
        errno_text(errno, why, sizeof why);
        st = clmha__fail(ctx, CLMHA_IO_ERROR, "cannot read %s: %s", path, why);
        goto fail;
    }
    fclose(f);
    *out = buf;
    *out_size = size;
    return CLMHA_SUCCESS;
fail:
    free(buf);
    fclose(f);
    return st;
}

// Re-records the context's last message prefixed with the path.
static clmha_status fail_with_path(clmha_context *ctx, clmha_status st, const char *path) {
    char prev[CLMHA__ERROR_SIZE];
    snprintf(prev, sizeof prev, "%s", clmha_context_last_error(ctx));
    return clmha__fail(ctx, st, "%s: %s", path, prev);
}

clmha_status clmha_layer_load(clmha_layer **out, clmha_context *ctx, const char *path) {
    if (!out) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    if (!path) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "path is NULL");

    unsigned char *bytes = NULL;
    size_t size = 0;
    clmha__st_file file = {0};
    clmha_layer *layer = NULL;
    float *values = NULL;
    clmha_layer_desc desc;
    char msg[CLMHA__ERROR_SIZE];
    clmha_status st = read_file(ctx, path, &bytes, &size);
    if (st) goto fail;
    if ((st = clmha__safetensors_parse(bytes, size, path, &file, msg, sizeof msg)) ||
        (st = clmha__safetensors_desc(&file, path, &desc, msg, sizeof msg))) {
        st = clmha__fail(ctx, st, "%s", msg);
        goto fail;
    }

    size_t most = 1;
    for (size_t i = 0; i < file.tensor_count; ++i)
        if (file.tensors[i].count > most) most = file.tensors[i].count;
    size_t bytes_needed = 0;  // fits: the desc check bounds every parameter's size
    if (!clmha__mul(most, sizeof *values, &bytes_needed)) {
        st = clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "%s: a tensor is too large", path);
        goto fail;
    }
    values = malloc(bytes_needed);
    if (!values) {
        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", path);
        goto fail;
    }
    if ((st = clmha_layer_create(&layer, ctx, &desc))) {
        st = fail_with_path(ctx, st, path);
        goto fail;
    }
    for (size_t i = 0; i < file.tensor_count; ++i) {
        const clmha__st_tensor *t = &file.tensors[i];
        clmha__safetensors_to_float(t, values);
        if ((st = clmha_layer_set_parameter(layer, t->name, values, t->count))) {
            st = fail_with_path(ctx, st, path);
            goto fail;
        }
    }
    *out = layer;
    layer = NULL;
fail:
    clmha_layer_release(layer);
    free(values);
    clmha__safetensors_free(&file);
    free(bytes);
    return st;
}

// ---- saving -------------------------------------------------------------------------------

// Appends to a fixed buffer; false when it does not fit.
static bool append(char *buf, size_t size, size_t *used, const char *fmt, ...)
    CLMHA__PRINTF(4, 5);
static bool append(char *buf, size_t size, size_t *used, const char *fmt, ...) {
    if (*used >= size) return false;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *used, size - *used, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= size - *used) return false;
    *used += (size_t)n;
    return true;
}

// %.9g of a float with '.' as the decimal point whatever the C locale.
static void float_text(float v, char *buf, size_t size) {
    char raw[64];
    snprintf(raw, sizeof raw, "%.9g", (double)v);
    size_t o = 0;
    bool in_point = false;
    for (const char *p = raw; *p && o + 1 < size; ++p) {
        bool plain = (*p >= '0' && *p <= '9') || *p == 'e' || *p == '-' || *p == '+';
        if (plain) buf[o++] = *p;
        else if (!in_point) buf[o++] = '.';
        in_point = !plain;
    }
    buf[o] = '\0';
}

typedef struct save_entry {
    const char *name;
    size_t ndim;
    size_t shape[3];
    size_t count;
} save_entry;

// What clmha_layer_save writes: the header's length (8 bytes, little-endian), the header and
// the tensors' floats (already little-endian).
typedef struct safetensors_out {
    const char *header;
    size_t header_len;
    const float *data;
    size_t count;
} safetensors_out;

static bool write_safetensors(FILE *f, void *user, char *why, size_t why_size) {
    (void)why, (void)why_size;  // errno says why
    const safetensors_out *o = user;
    unsigned char len_bytes[8];
    for (int i = 0; i < 8; ++i)
        len_bytes[i] = (unsigned char)((uint64_t)o->header_len >> (8 * i));
    return fwrite(len_bytes, 1, 8, f) == 8 &&
           fwrite(o->header, 1, o->header_len, f) == o->header_len &&
           fwrite(o->data, sizeof *o->data, o->count, f) == o->count;
}

clmha_status clmha_layer_save(clmha_layer *layer, const char *path) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = clmha_layer_context(layer);
    if (!path) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "path is NULL");
    if (!*path) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "path is empty");

    clmha_status st = CLMHA_SUCCESS;
    float *data = NULL;

    clmha_layer_desc d = {.struct_size = sizeof d};
    clmha_layer_get_desc(layer, &d);
    size_t e = d.embed_dim;
    save_entry list[8];
    size_t n = 0;
    if (d.kdim == e && d.vdim == e) {
        list[n++] = (save_entry){"in_proj_weight", 2, {3 * e, e}, 0};
    } else {
        list[n++] = (save_entry){"q_proj_weight", 2, {e, e}, 0};
        list[n++] = (save_entry){"k_proj_weight", 2, {e, d.kdim}, 0};
        list[n++] = (save_entry){"v_proj_weight", 2, {e, d.vdim}, 0};
    }
    if (d.bias) list[n++] = (save_entry){"in_proj_bias", 1, {3 * e}, 0};
    list[n++] = (save_entry){"out_proj.weight", 2, {e, e}, 0};
    if (d.bias) list[n++] = (save_entry){"out_proj.bias", 1, {e}, 0};
    if (d.add_bias_kv) {
        list[n++] = (save_entry){"bias_k", 3, {1, 1, e}, 0};
        list[n++] = (save_entry){"bias_v", 3, {1, 1, e}, 0};
    }
    // The layer exists, so its parameters fit in memory: these sums do not overflow.
    size_t total = 0;
    for (size_t i = 0; i < n; ++i) {
        list[i].count = clmha_layer_parameter_count(layer, list[i].name);
        total += list[i].count;
    }

    // Header.
    char header[2048], dropout[64];
    size_t used = 0, offset = 0;
    float_text(d.dropout, dropout, sizeof dropout);
    bool ok = append(header, sizeof header, &used,
                     "{\"__metadata__\":{\"format\":\"pt\",\"num_heads\":\"%zu\","
                     "\"batch_first\":\"%s\",\"add_zero_attn\":\"%s\",\"dropout\":\"%s\"}",
                     d.num_heads, d.batch_first ? "true" : "false",
                     d.add_zero_attn ? "true" : "false", dropout);
    for (size_t i = 0; i < n && ok; ++i) {
        const save_entry *s = &list[i];
        ok = append(header, sizeof header, &used, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[",
                    s->name);
        for (size_t k = 0; k < s->ndim && ok; ++k)
            ok = append(header, sizeof header, &used, k ? ",%zu" : "%zu", s->shape[k]);
        ok = ok && append(header, sizeof header, &used, "],\"data_offsets\":[%zu,%zu]}", offset,
                          offset + s->count * sizeof(float));
        offset += s->count * sizeof(float);
    }
    ok = ok && append(header, sizeof header, &used, "}");
    while (ok && used % 8 != 0) ok = append(header, sizeof header, &used, " ");
    if (!ok) {  // cannot happen: the names are fixed and the numbers short
        st = clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s: header too long", path);
        goto fail;
    }

    // Data, as little-endian float32.
    data = malloc((total ? total : 1) * sizeof *data);
    if (!data) {
        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", path);
        goto fail;
    }
    for (size_t i = 0, at = 0; i < n; at += list[i].count, ++i)
        if ((st = clmha_layer_get_parameter(layer, list[i].name, data + at, list[i].count))) {
            st = fail_with_path(ctx, st, path);
            goto fail;
        }
    const uint32_t one = 1;
    if (*(const unsigned char *)&one != 1) {  // big-endian host: swap every float
        unsigned char *p = (unsigned char *)data;
        for (size_t i = 0; i < total; ++i, p += 4) {
            unsigned char t0 = p[0], t1 = p[1];
            p[0] = p[3], p[1] = p[2], p[2] = t1, p[3] = t0;
        }
    }

    // All or nothing: a temporary file next to the destination, renamed over it.
    safetensors_out o = {.header = header, .header_len = used, .data = data, .count = total};
    char msg[CLMHA__ERROR_SIZE - 64];
    if ((st = clmha__file_write_whole(path, write_safetensors, &o, msg, sizeof msg)))
        st = clmha__fail(ctx, st, "%s", msg);
fail:
    free(data);
    return st;
}
