// The tuning parameter model: which parameters of which kernels a tuning holds (CLBlast 1.5.3's
// Xgemm, XgemmDirect and GemmRoutine, clmha's fused attention tiles), their names, CLBlast's
// constraints on them, their text form and CLBlast's generic values. No device state here: the
// per-device registry, the files and applying a tuning are in store.h.
#ifndef CLMHA_TUNING_STORE_PARAMS_H
#define CLMHA_TUNING_STORE_PARAMS_H

#include <stdbool.h>
#include <stddef.h>

#include <clblast_c.h>

#include "base/defs.h"

// Parameters of CLBlast 1.5.3's "Xgemm" (indirect GEMM) kernel, in CLBlast's database order.
#define CLMHA__XGEMM_PARAMS 16
// Parameters of "XgemmDirect".
#define CLMHA__DIRECT_PARAMS 10
// Tiles of clmha's own fused attention kernel ("FusedAttention" in a tuning file): BQ, BK, RPW,
// VW (see clmha__fused_tiles).
#define CLMHA__FUSED_PARAMS 4
// How the decode core splits a cached sequence's keys ("DecodeSplit" in a tuning file):
// ITEMS_PER_CU, MIN_KEYS (see clmha__decode_parts() in cores/decode.h).
#define CLMHA__DECODE_PARAMS 2

// Largest accepted parameter value (XGEMM_MIN_INDIRECT_SIZE); a file's values are checked
// against it before anything else.
#define CLMHA__TUNING_PARAM_MAX 1048576.0

// The CLBlast version clmha was compiled against, "1.5.3", from CLBlast's headers (CLBlast has
// no run-time version query, and Debian's CLBlast CMake package sets no CLBlast_VERSION). A
// tuning file records it; one from another version is not used for CLBlast's kernels.
#define CLMHA__STR2(x) #x
#define CLMHA__STR(x) CLMHA__STR2(x)
#define CLMHA__CLBLAST_VERSION                                                                  \
    CLMHA__STR(CLBLAST_VERSION_MAJOR) "." CLMHA__STR(CLBLAST_VERSION_MINOR) "." CLMHA__STR(    \
        CLBLAST_VERSION_PATCH)

// A tuning: parameter values of the three CLBlast kernels clmha's GEMMs depend on, and the tiles
// of the fused attention kernel and the decode core's split of the keys. Kernels whose has_ flag
// is false are left as they are (CLBlast's database, or an earlier override; the fused kernel's
// and the decode core's defaults).
// Copy/Pad/Transpose/Padtranspose (the indirect path's helpers) are never touched.
typedef struct clmha__tuning {
    bool has_xgemm, has_direct, has_routine, has_fused, has_decode;
    size_t xgemm[CLMHA__XGEMM_PARAMS];    // in the order of clmha__xgemm_names
    size_t direct[CLMHA__DIRECT_PARAMS];  // in the order of clmha__direct_names
    size_t min_indirect;                  // "GemmRoutine": XGEMM_MIN_INDIRECT_SIZE
    size_t fused[CLMHA__FUSED_PARAMS];    // "FusedAttention", in the order of clmha__fused_names
    size_t decode[CLMHA__DECODE_PARAMS];  // "DecodeSplit", in the order of clmha__decode_names
} clmha__tuning;

// What a tuning run measured (0 where unknown), kept with a tuning and written to its file.
typedef struct clmha__tuning_meta {
    double default_gflops;        // sgemm 1024³ NT before tuning
    double tuned_gflops;          // sgemm 1024³ NT with the tuning
    double default_layer_gflops;  // first layer shape's QKV projection, before
    double tuned_layer_gflops;    // the same, with the tuning
    double seconds;               // length of the tuning run
    size_t candidates;            // parameter sets tried
    char layer[64];               // "N,L,E,H" of the first layer shape
    char date[32];                // UTC, ISO 8601
} clmha__tuning_meta;

CLMHA__HIDDEN extern const char *const clmha__xgemm_names[CLMHA__XGEMM_PARAMS];
CLMHA__HIDDEN extern const char *const clmha__direct_names[CLMHA__DIRECT_PARAMS];
CLMHA__HIDDEN extern const char *const clmha__routine_names[1];  // XGEMM_MIN_INDIRECT_SIZE
CLMHA__HIDDEN extern const char *const clmha__fused_names[CLMHA__FUSED_PARAMS];
CLMHA__HIDDEN extern const char *const clmha__decode_names[CLMHA__DECODE_PARAMS];

// Largest accepted DecodeSplit values.
#define CLMHA__DECODE_ITEMS_MAX 4096
#define CLMHA__DECODE_KEYS_MAX 65536

// CLBlast 1.5.3's generic single-precision parameters (the database's "default" device, which a
// device without an entry of its own, such as PoCL, gets).
CLMHA__HIDDEN extern const clmha__tuning clmha__tuning_clblast_generic;

// Checks every kernel present in @p t against CLBlast's constraints and the device limits
// (@p local_mem bytes of local memory, @p max_wg work-items per group). On failure writes why.
// The fused tiles and the decode split get a range check only (powers of two, limits); whether they fit a layer
// (local memory, head_dim) is decided where the tiles are used (clmha__fused_tiles_for()).
CLMHA__HIDDEN bool clmha__tuning_check(const clmha__tuning *t, size_t local_mem, size_t max_wg,
                                       char *msg, size_t msg_size);

// The checks of one kernel's parameters (in the order of its names), as clmha__tuning_check()
// runs them; @p msg may be NULL.
CLMHA__HIDDEN bool clmha__tuning_check_xgemm(const size_t *p, size_t local_mem, size_t max_wg,
                                             char *msg, size_t msg_size);
CLMHA__HIDDEN bool clmha__tuning_check_direct(const size_t *p, size_t local_mem, size_t max_wg,
                                              char *msg, size_t msg_size);

// "Xgemm: GEMMK=0 ...; XgemmDirect: ...; GemmRoutine: XGEMM_MIN_INDIRECT_SIZE=..."
CLMHA__HIDDEN void clmha__tuning_format(const clmha__tuning *t, char *buf, size_t size);

// Appends printf-style text to @p buf (of @p size bytes, @p used of them in use); returns the
// new length, which may exceed @p size when the text was cut.
CLMHA__HIDDEN size_t clmha__tuning_append(char *buf, size_t size, size_t used, const char *fmt,
                                          ...) CLMHA__PRINTF(4, 5);

#endif
