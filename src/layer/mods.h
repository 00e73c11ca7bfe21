// A layer's user functions (clmha_layer_desc::mod_source): which ones its OpenCL C source
// defines, its copy of the source and of their parameters p, and the build options of its
// score variants (mods.c). The cores compile the source into their programs
// (clmha__program_get_mod()) and pass p as the kernels' mod_p (src/cores/kernel_args.c).
#ifndef CLMHA_LAYER_MODS_H
#define CLMHA_LAYER_MODS_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// The functions a source defines (bits of clmha_layer::mods).
enum {
    CLMHA__MOD_SCORE = 1,  // clmha_score_mod
    CLMHA__MOD_GRAD = 2,   // clmha_score_mod_grad
    CLMHA__MOD_MASK = 4,   // clmha_mask_mod
};

// The CLMHA__MOD_* bits of the names that @p source holds as identifiers outside comments and
// string literals (0 for NULL).
CLMHA__HIDDEN unsigned clmha__mods_scan(const char *source);

// Gives @p layer (its desc set, no user functions yet) its variant build options
// (clmha__layer_variant_options()) and, with a non-empty @p source, a copy of it (desc.mod_source
// points to the copy), the functions it defines, and p: @p count floats on the device, from
// @p params (NULL: zeros). A source without any of the three functions is refused
// (CLMHA_INVALID_ARGUMENT: most likely a misspelt name).
CLMHA__HIDDEN clmha_status clmha__layer_mods_init(clmha_layer *layer, const char *source,
                                                  const float *params, size_t count);

// Frees what clmha__layer_mods_init() made.
CLMHA__HIDDEN void clmha__layer_mods_free(clmha_layer *layer);

// CLMHA_UNSUPPORTED, naming @p what, for a layer with a user score function but no
// clmha_score_mod_grad (the backward pass needs it); else CLMHA_SUCCESS.
CLMHA__HIDDEN clmha_status clmha__layer_mods_grad_check(clmha_layer *layer, const char *what);

#endif
