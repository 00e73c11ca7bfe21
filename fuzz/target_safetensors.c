// Fuzz target: .safetensors files, clmha__safetensors_parse() and the layer built from them (see targets.h).
#include "targets.h"

#include "formats/safetensors.h"
#include "layer/shape.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

// ---- .safetensors ----------------------------------------------------------------------------

// Independent IEEE binary16 -> float conversion (via ldexp) to check the library's.
static float clmha_fuzz_half(uint16_t h) {
    int sign = h >> 15, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    float v;
    if (exp == 0x1F) v = mant ? NAN : INFINITY;
    else if (exp == 0) v = (float)ldexp((double)mant, -24);
    else v = (float)ldexp((double)(mant | 0x400), exp - 25);
    return sign ? -v : v;
}

int clmha_fuzz_safetensors(const uint8_t *data, size_t size) {
    static const char *const name = "fuzz.safetensors";
    char msg[512] = "";
    clmha__st_file f;
    clmha_status st = clmha__safetensors_parse(data, size, name, &f, msg, sizeof msg);
    if (st != CLMHA_SUCCESS) {
        CLMHA_FUZZ_CHECK(st == CLMHA_INVALID_FILE || st == CLMHA_SIZE_OVERFLOW ||
                         st == CLMHA_OUT_OF_MEMORY);
        CLMHA_FUZZ_CHECK(msg[0] != '\0' && strncmp(msg, name, strlen(name)) == 0);
        CLMHA_FUZZ_CHECK(!f.json && !f.tensors && !f.tensor_count && !f.meta && !f.meta_count);
        clmha__safetensors_free(&f);  // harmless on an empty file
        return st;
    }
    CLMHA_FUZZ_CHECK(f.json != NULL);
    CLMHA_FUZZ_CHECK(size >= 8);

    // Every tensor: a known dtype, count = product of the shape, data inside the input and
    // exactly count * itemsize bytes before its end; names sorted and unique.
    for (size_t i = 0; i < f.tensor_count; ++i) {
        const clmha__st_tensor *t = &f.tensors[i];
        CLMHA_FUZZ_CHECK(t->name != NULL);
        CLMHA_FUZZ_CHECK(t->dtype == CLMHA__ST_F16 || t->dtype == CLMHA__ST_F32 ||
                         t->dtype == CLMHA__ST_F64);
        CLMHA_FUZZ_CHECK(t->ndim <= CLMHA__ST_MAX_DIMS);
        size_t count = 0;
        bool zero = false;
        for (size_t k = 0; k < t->ndim; ++k) zero = zero || t->shape[k] == 0;
        if (zero) count = 0;
        else CLMHA_FUZZ_CHECK(!clmha_fuzz_prod_overflows(t->shape, t->ndim, &count));
        CLMHA_FUZZ_CHECK(t->count == count);
        size_t item = t->dtype == CLMHA__ST_F16 ? 2 : t->dtype == CLMHA__ST_F32 ? 4 : 8, bytes;
        CLMHA_FUZZ_CHECK(!__builtin_mul_overflow(count, item, &bytes));
        CLMHA_FUZZ_CHECK(t->data >= data && t->data <= data + size);
        CLMHA_FUZZ_CHECK(bytes <= (size_t)(data + size - t->data));
        if (i) CLMHA_FUZZ_CHECK(strcmp(f.tensors[i - 1].name, t->name) < 0);
        CLMHA_FUZZ_CHECK(clmha__safetensors_tensor(&f, t->name) == t);
    }
    for (size_t i = 0; i < f.meta_count; ++i) {
        CLMHA_FUZZ_CHECK(f.meta[i].key && f.meta[i].value);
        if (i) CLMHA_FUZZ_CHECK(strcmp(f.meta[i - 1].key, f.meta[i].key) < 0);
        CLMHA_FUZZ_CHECK(clmha__safetensors_meta(&f, f.meta[i].key) == f.meta[i].value);
    }

    // The layer the file describes (any name set, no prefix): on success every tensor of the
    // view has its PyTorch shape and is made of tensors of the file whose values it holds.
    clmha_layer_desc desc;
    char dmsg[512] = "";
    static clmha__st_view view;
    clmha__st_load load = {.num_heads = size % 3 == 0 ? 2 : 0};
    clmha_status dst = clmha__safetensors_layer(&f, name, &load, &view, &desc, dmsg, sizeof dmsg);
    const clmha__st_file *vf = &view.file;
    if (dst != CLMHA_SUCCESS) {
        CLMHA_FUZZ_CHECK(dst == CLMHA_INVALID_FILE || dst == CLMHA_SIZE_OVERFLOW);
        CLMHA_FUZZ_CHECK(strncmp(dmsg, name, strlen(name)) == 0);
    } else {
        clmha_layer_desc checked;
        CLMHA_FUZZ_CHECK(clmha__desc_check(&desc, &checked, NULL, 0) == CLMHA_SUCCESS);
        CLMHA_FUZZ_CHECK(checked.kdim == desc.kdim && checked.vdim == desc.vdim);
        const size_t e = desc.embed_dim;
        CLMHA_FUZZ_CHECK(desc.bias == (clmha__safetensors_tensor(vf, "in_proj_bias") != NULL));
        CLMHA_FUZZ_CHECK(desc.add_bias_kv == (clmha__safetensors_tensor(vf, "bias_k") != NULL));
        // Without a prefix the view holds every tensor of the file, and every tensor of the
        // view is made of the file's tensors, as many values as it has.
        size_t parts = 0;
        for (size_t i = 0; i < vf->tensor_count; ++i) {
            size_t count = 0;
            for (size_t p = 0; p < 4 && view.parts[i][p]; ++p, ++parts) {
                CLMHA_FUZZ_CHECK(view.parts[i][p] >= f.tensors &&
                                 view.parts[i][p] < f.tensors + f.tensor_count);
                count += view.parts[i][p]->count;
            }
            CLMHA_FUZZ_CHECK(count == vf->tensors[i].count);
        }
        CLMHA_FUZZ_CHECK(parts == f.tensor_count);
        for (size_t i = 0; i < vf->tensor_count; ++i) {
            const clmha__st_tensor *t = &vf->tensors[i];
            size_t want[3] = {0, 0, 0}, nd = 0;
            if (!strcmp(t->param, "in_proj_weight"))
                nd = 2, want[0] = 3 * e, want[1] = e;
            else if (!strcmp(t->param, "q_proj_weight") || !strcmp(t->param, "out_proj.weight"))
                nd = 2, want[0] = e, want[1] = e;
            else if (!strcmp(t->param, "k_proj_weight"))
                nd = 2, want[0] = e, want[1] = desc.kdim;
            else if (!strcmp(t->param, "v_proj_weight"))
                nd = 2, want[0] = e, want[1] = desc.vdim;
            else if (!strcmp(t->param, "in_proj_bias"))
                nd = 1, want[0] = 3 * e;
            else if (!strcmp(t->param, "out_proj.bias"))
                nd = 1, want[0] = e;
            else if (!strcmp(t->param, "bias_k") || !strcmp(t->param, "bias_v"))
                nd = 3, want[0] = 1, want[1] = 1, want[2] = e;
            CLMHA_FUZZ_CHECK(nd != 0);  // only known names pass
            CLMHA_FUZZ_CHECK(t->ndim == nd);
            for (size_t k = 0; k < nd; ++k) CLMHA_FUZZ_CHECK(t->shape[k] == want[k]);
        }
        if (clmha__safetensors_tensor(vf, "in_proj_weight"))
            CLMHA_FUZZ_CHECK(desc.kdim == e && desc.vdim == e);
    }

    // Conversion of every tensor (whatever desc said) into a buffer of exactly count doubles,
    // each the tensor's value exactly.
    for (size_t i = 0; i < f.tensor_count; ++i) {
        const clmha__st_tensor *t = &f.tensors[i];
        if (t->count > ((size_t)1 << 22)) continue;
        double *out = malloc((t->count ? t->count : 1) * sizeof *out);
        if (!out) continue;
        clmha__safetensors_to_double(t, out);
        for (size_t k = 0; k < t->count; ++k) {
            const unsigned char *p = t->data;
            if (t->dtype == CLMHA__ST_F32) {
                uint32_t bits = (uint32_t)p[4 * k] | (uint32_t)p[4 * k + 1] << 8 |
                                (uint32_t)p[4 * k + 2] << 16 | (uint32_t)p[4 * k + 3] << 24;
                float want;
                memcpy(&want, &bits, sizeof want);
                CLMHA_FUZZ_CHECK(isnan(want) ? isnan(out[k]) : out[k] == want);
                CLMHA_FUZZ_CHECK(!!signbit(want) == !!signbit(out[k]));
            } else if (t->dtype == CLMHA__ST_F16) {
                float want = clmha_fuzz_half((uint16_t)(p[2 * k] | p[2 * k + 1] << 8));
                CLMHA_FUZZ_CHECK(isnan(want) ? isnan(out[k]) : out[k] == want);
                CLMHA_FUZZ_CHECK(!!signbit(want) == !!signbit(out[k]));
            } else if (t->dtype == CLMHA__ST_F64) {
                uint64_t bits = 0, got;
                for (int b = 7; b >= 0; --b) bits = bits << 8 | p[8 * k + (size_t)b];
                memcpy(&got, &out[k], sizeof got);
                CLMHA_FUZZ_CHECK(got == bits);
            }
        }
        free(out);
    }
    clmha__safetensors_free(&f);
    CLMHA_FUZZ_CHECK(!f.json && !f.tensors && !f.tensor_count && !f.meta && !f.meta_count);
    return CLMHA_SUCCESS;
}
