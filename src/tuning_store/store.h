// The tuning store: what tuning is in effect for each device in this process, applying a tuning
// through CLBlastOverrideParameters, the tuning folder and files, their JSON form, and loading a
// device's stored tuning when a context is created. Below the context in the layers: it knows
// the context's device description and error slot, nothing of layers, cores or forward passes.
//
// CLBlast keeps overridden parameters process-wide, keyed by cl_device_id (its database cache;
// CLBlastClearCache() drops compiled programs, not overrides). So the tuning in effect is a
// property of the device in this process, and the store mirrors it in a small per-device
// registry: what was applied, from where, and a note on the stored file.
//
// The search (src/tuning_search/) uses the store through this header only: it reads the tuning in
// effect (clmha__tuning_current), overrides CLBlast's parameters for each candidate
// (clmha__tuning_override, no registry update), applies and records the winner
// (clmha__tuning_apply), writes it (clmha__tuning_to_json, clmha__tuning_path,
// clmha__tuning_write_file) and sets the note (clmha__tuning_set_note).
#ifndef CLMHA_TUNING_STORE_STORE_H
#define CLMHA_TUNING_STORE_STORE_H

#include "clmha.h"

#include "base/defs.h"
#include "errors/errors.h"

#include "tuning_store/builtin.h"
#include "tuning_store/params.h"

// What the store needs of a context: its device, what is known of the device, and where errors
// are recorded. The context builds one (clmha__context_tuning_target()); the store never sees
// the context's struct, and never calls the context's functions.
typedef struct clmha__tuning_target {
    const clmha_context *owner;     // errors are recorded for it (clmha__fail; opaque here)
    const clmha__error_slot *errors;  // owner's slot: the store reads and restores its message
    cl_device_id device;
    const clmha_device_info *info;  // platform, device and driver names, local memory
    size_t max_work_group;          // CL_DEVICE_MAX_WORK_GROUP_SIZE
} clmha__tuning_target;

// The fused kernel's tiles of the tuning in effect for @p device (false when it has none).
CLMHA__HIDDEN bool clmha__tuning_fused(cl_device_id device, size_t fused[CLMHA__FUSED_PARAMS]);

// The decode core's split of the tuning in effect for @p device (false when it has none).
CLMHA__HIDDEN bool clmha__tuning_decode(cl_device_id device, size_t decode[CLMHA__DECODE_PARAMS]);

// The tuning in effect for @p device (false when none was applied in this process). @p meta
// may be NULL.
CLMHA__HIDDEN bool clmha__tuning_current(cl_device_id device, clmha__tuning *t,
                                         clmha__tuning_meta *meta);

// Replaces the note of @p device (clmha_context_tuning_note()).
CLMHA__HIDDEN void clmha__tuning_set_note(cl_device_id device, const char *fmt, ...)
    CLMHA__PRINTF(2, 3);

// The note of @p device, cut to @p size bytes (clmha_context_tuning_note()).
CLMHA__HIDDEN void clmha__tuning_get_note(cl_device_id device, char *text, size_t size);

// The device's local memory in bytes for the checks (16 KiB when the driver says 0).
CLMHA__HIDDEN size_t clmha__tuning_local_mem(const clmha__tuning_target *tg);

// Overrides CLBlast's parameters of the device of @p tg for every CLBlast kernel present in
// @p t, without checking them and without recording them in the registry (the search's
// candidates). CLMHA_BLAS_ERROR with the context's message when CLBlast refuses.
CLMHA__HIDDEN clmha_status clmha__tuning_override(const clmha__tuning_target *tg, const clmha__tuning *t);

// Checks @p t, overrides CLBlast's parameters of the device of @p tg with it (every kernel
// present) and records it in the registry as coming from @p kind, with the note @p source
// ("stored tuning ... applied", "imported tuning applied", "tuned ..."): kernels @p t leaves
// out keep what was in effect.
CLMHA__HIDDEN clmha_status clmha__tuning_apply(const clmha__tuning_target *tg, const clmha__tuning *t,
                                               const clmha__tuning_meta *meta,
                                               clmha_tuning_source kind, const char *source);

// Where the tuning in effect for @p device came from (clmha_context_tuning_source()).
CLMHA__HIDDEN clmha_tuning_source clmha__tuning_source_of(cl_device_id device);

// The built-in set of the device of @p tg (builtin.h: matched on its platform, type, names,
// CL_DEVICE_VERSION and native float width), or NULL.
CLMHA__HIDDEN const clmha__builtin_set *clmha__tuning_builtin_of(const clmha__tuning_target *tg);

// Test hook: the registry takes at most @p devices devices (SIZE_MAX: no limit, the default),
// as if it could not grow past them.
CLMHA__HIDDEN void clmha__test_set_tuning_registry_limit(size_t devices);

// Called once by context creation: loads the stored tuning of the device (once per device and
// process), checks it and applies it; without one, applies the device class's built-in set
// (builtin.h) if it has one. Never fails: a missing, unreadable, corrupt or foreign file
// (another device, driver or CLBlast version) is ignored and a note says why
// (clmha_context_tuning_note()). $CLMHA_TUNING=off applies neither (CLBlast's own parameters);
// $CLMHA_TUNING=builtin skips the stored file.
CLMHA__HIDDEN void clmha__tuning_apply_stored(const clmha__tuning_target *tg);

// The folder of tuning files: $CLMHA_TUNING_DIR, else $XDG_CACHE_HOME/clmha, else
// $HOME/.cache/clmha.
CLMHA__HIDDEN clmha_status clmha__tuning_dir(char *dir, size_t size, char *msg, size_t msg_size);

// The tuning file of the device of @p tg: <dir>/<platform>--<device>.json, sanitised.
CLMHA__HIDDEN clmha_status clmha__tuning_path(const clmha__tuning_target *tg, char *path, size_t size,
                                              char *msg, size_t msg_size);

// JSON text of a tuning for the device of @p tg (malloc'd; NULL when out of memory). Records
// the platform, device, driver and CLBlast version (CLMHA__CLBLAST_VERSION).
CLMHA__HIDDEN char *clmha__tuning_to_json(const clmha__tuning_target *tg, const clmha__tuning *t,
                                          const clmha__tuning_meta *meta);

// Parses and checks JSON text: the format, the device (platform, device name and driver must
// be those of @p tg: CLMHA_UNSUPPORTED otherwise), the CLBlast version when the tuning names a
// CLBlast kernel (it must be CLMHA__CLBLAST_VERSION; a tuning without one, written by an older
// clmha, counts as another version: CLMHA_UNSUPPORTED), every parameter (CLMHA_INVALID_FILE).
CLMHA__HIDDEN clmha_status clmha__tuning_from_json(const clmha__tuning_target *tg, const char *json,
                                                   clmha__tuning *t, clmha__tuning_meta *meta,
                                                   char *msg, size_t msg_size);

// Writes @p text to @p path atomically (temporary file in the same folder, then rename),
// creating the folder when needed.
CLMHA__HIDDEN clmha_status clmha__tuning_write_file(const char *path, const char *text,
                                                    char *msg, size_t msg_size);

// The current UTC time, ISO 8601 ("2026-12-01T14:00:00Z"), for a tuning's date.
CLMHA__HIDDEN void clmha__tuning_utc_now(char *buf, size_t size);

#endif
