// GEMM tuning: CLBlast parameter sets for one device, their checks, storage (JSON per device),
// application through CLBlastOverrideParameters and the search (clmha_context_tune()).
//
// CLBlast keeps overridden parameters process-wide, keyed by cl_device_id (its database cache;
// CLBlastClearCache() drops compiled programs, not overrides). So the tuning in effect is a
// property of the device in this process, and tuning.c mirrors it in a small per-device
// registry: what was applied, from where, and a note on the stored file.
#ifndef CLMHA_TUNING_H
#define CLMHA_TUNING_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// Parameters of CLBlast 1.5.3's "Xgemm" (indirect GEMM) kernel, in CLBlast's database order.
#define CLMHA__XGEMM_PARAMS 16
// Parameters of "XgemmDirect".
#define CLMHA__DIRECT_PARAMS 10
// Tiles of clmha's own fused attention kernel ("FusedAttention" in a tuning file): BQ, BK, RPW,
// VW (see clmha__fused_tiles).
#define CLMHA__FUSED_PARAMS 4

// A tuning: parameter values of the three CLBlast kernels clmha's GEMMs depend on, and the tiles
// of the fused attention kernel. Kernels whose has_ flag is false are left as they are
// (CLBlast's database, or an earlier override; the fused kernel's defaults).
// Copy/Pad/Transpose/Padtranspose (the indirect path's helpers) are never touched.
typedef struct clmha__tuning {
    bool has_xgemm, has_direct, has_routine, has_fused;
    size_t xgemm[CLMHA__XGEMM_PARAMS];    // in the order of clmha__xgemm_names
    size_t direct[CLMHA__DIRECT_PARAMS];  // in the order of clmha__direct_names
    size_t min_indirect;                  // "GemmRoutine": XGEMM_MIN_INDIRECT_SIZE
    size_t fused[CLMHA__FUSED_PARAMS];    // "FusedAttention", in the order of clmha__fused_names
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
CLMHA__HIDDEN extern const char *const clmha__fused_names[CLMHA__FUSED_PARAMS];

// The fused kernel's tiles of the tuning in effect for @p device (false when it has none).
CLMHA__HIDDEN bool clmha__tuning_fused(cl_device_id device, size_t fused[CLMHA__FUSED_PARAMS]);

// CLBlast 1.5.3's generic single-precision parameters (the database's "default" device, which a
// device without an entry of its own, such as PoCL, gets).
CLMHA__HIDDEN extern const clmha__tuning clmha__tuning_clblast_generic;

// Checks every kernel present in @p t against CLBlast's constraints and the device limits
// (@p local_mem bytes of local memory, @p max_wg work-items per group). On failure writes why.
CLMHA__HIDDEN bool clmha__tuning_check(const clmha__tuning *t, size_t local_mem, size_t max_wg,
                                       char *msg, size_t msg_size);

// "Xgemm: GEMMK=0 ...; XgemmDirect: ...; GemmRoutine: XGEMM_MIN_INDIRECT_SIZE=..."
CLMHA__HIDDEN void clmha__tuning_format(const clmha__tuning *t, char *buf, size_t size);

// Overrides CLBlast's parameters of the device of @p ctx with @p t (every kernel present) and
// records it in the registry with @p source ("stored file ...", "imported", "tuned").
CLMHA__HIDDEN clmha_status clmha__tuning_apply(clmha_context *ctx, const clmha__tuning *t,
                                               const clmha__tuning_meta *meta,
                                               const char *source);

// Called once by context creation: loads the stored tuning of the device (once per device and
// process), checks it and applies it. Never fails: a missing, unreadable, corrupt or foreign
// file is ignored and a note says why (clmha_context_tuning_note()). $CLMHA_TUNING=off skips it.
CLMHA__HIDDEN void clmha__tuning_apply_stored(clmha_context *ctx);

// The folder of tuning files: $CLMHA_TUNING_DIR, else $XDG_CACHE_HOME/clmha, else
// $HOME/.cache/clmha.
CLMHA__HIDDEN clmha_status clmha__tuning_dir(char *dir, size_t size, char *msg, size_t msg_size);

// The tuning file of the device of @p ctx: <dir>/<platform>--<device>.json, sanitised.
CLMHA__HIDDEN clmha_status clmha__tuning_path(const clmha_context *ctx, char *path, size_t size,
                                              char *msg, size_t msg_size);

// JSON text of a tuning for the device of @p ctx (malloc'd; NULL when out of memory).
CLMHA__HIDDEN char *clmha__tuning_to_json(const clmha_context *ctx, const clmha__tuning *t,
                                          const clmha__tuning_meta *meta);

// Parses and checks JSON text: the format, the device (platform, device name and driver must
// be those of @p ctx: CLMHA_UNSUPPORTED otherwise), every parameter (CLMHA_INVALID_FILE).
CLMHA__HIDDEN clmha_status clmha__tuning_from_json(const clmha_context *ctx, const char *json,
                                                   clmha__tuning *t, clmha__tuning_meta *meta,
                                                   char *msg, size_t msg_size);

// Writes @p text to @p path atomically (temporary file in the same folder, then rename),
// creating the folder when needed.
CLMHA__HIDDEN clmha_status clmha__tuning_write_file(const char *path, const char *text,
                                                    char *msg, size_t msg_size);

#endif
