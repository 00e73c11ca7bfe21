// Errors: status strings, OpenCL error names, and the recording of detailed messages.
//
// A message is recorded per thread and per owner: clmha__fail(ctx, ...) keeps it for the
// calling thread and that context (clmha_context_last_error()), clmha__fail(NULL, ...) for the
// calling thread alone (clmha_last_create_error()). Recording needs no lock and no knowledge of
// the context's struct: a context starts with a clmha__error_slot, which is all this module
// reads of it (src/context/context.h checks that the slot comes first).
#ifndef CLMHA_ERRORS_ERRORS_H
#define CLMHA_ERRORS_ERRORS_H

#include <stdint.h>

#include "clmha.h"

#include "base/defs.h"

// Longest detailed message, with its NUL.
#define CLMHA__ERROR_SIZE 4096

// What an owner of messages (a context) holds: an id unique in the process, so that a message
// recorded for a context never shows for a later one at the same address.
typedef struct clmha__error_slot {
    uint64_t id;
} clmha__error_slot;

// Gives @p slot a new id (a context calls this when it is created).
CLMHA__HIDDEN void clmha__error_slot_init(clmha__error_slot *slot);

// Forgets the calling thread's message for @p slot (a context calls this when it is freed).
CLMHA__HIDDEN void clmha__error_slot_forget(const clmha__error_slot *slot);

// The calling thread's last message for @p slot ("" when none), copied into a buffer of the
// thread that stays valid until the thread's next call of this function.
CLMHA__HIDDEN const char *clmha__error_last(const clmha__error_slot *slot);

// Sets the calling thread's message for @p slot back to @p message, one it read earlier
// ("": none), so that a failure that did not fail the caller's call leaves no message behind.
CLMHA__HIDDEN void clmha__error_restore(const clmha__error_slot *slot, const char *message);

// Records the message for the calling thread and @p ctx (NULL: the thread's creation error,
// clmha_last_create_error()) and returns @p status. @p ctx must start with its
// clmha__error_slot.
CLMHA__HIDDEN clmha_status clmha__fail(const clmha_context *ctx, clmha_status status,
                                       const char *fmt, ...) CLMHA__PRINTF(3, 4);

// Maps an OpenCL error code of @p call to a status and records the message.
CLMHA__HIDDEN clmha_status clmha__cl_fail(const clmha_context *ctx, cl_int err,
                                          const char *call);

// clmha__cl_fail() for OpenCL function @p fn called on @p what (a buffer's or a kernel's name):
// the message names both, "fn(what) failed: ...".
CLMHA__HIDDEN clmha_status clmha__cl_fail_on(const clmha_context *ctx, cl_int err,
                                             const char *fn, const char *what);

// The name of CLBlast's own status @p err (-2046: "CLBlastInvalidLocalMemUsage"), and in
// *@p text (may be NULL) what it means; "CLBlast status ?" for a code CLBlast does not define
// below -1000 (codes above -1000 are OpenCL's: clmha__cl_error_name()).
CLMHA__HIDDEN const char *clmha__blas_status_name(int err, const char **text);

// Maps a CLBlast status of @p call to a status and records the message.
CLMHA__HIDDEN clmha_status clmha__blas_fail(const clmha_context *ctx, int err, const char *call);

// Name of an OpenCL error code ("CL_OUT_OF_RESOURCES").
CLMHA__HIDDEN const char *clmha__cl_error_name(cl_int err);

#endif
