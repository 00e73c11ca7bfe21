// The process-wide guard around clmha's CLBlast calls until CLBlast has finished initialising.
//
// CLBlast 1.5.3 fills a process-wide table on first use, without a lock: the first
// clblast::Database constructed in the process assigns the static vector Database::database
// (src/database/database.cpp: "if (database.size() == 0) database = ..."), and every later
// construction reads it. A Database is constructed by every routine call (the routine's
// constructor looks up its kernels' parameters) and by CLBlastOverrideParameters, whatever the
// device or context. Two threads making their first CLBlast call at the same moment therefore
// race on that vector (heap-use-after-free, SEGV), even on different devices and contexts.
// CLBlast's other caches (programs, binaries, databases: src/cache.cpp) take a lock; two
// contexts compiling the same kernel at once both compile it and store it twice, which is
// harmless in a C++11 build (the cache is a vector; Get returns the first entry).
//
// So the table is process-wide and written once: clmha runs CLBlast calls one at a time, under
// one process-wide mutex, until one of them has returned CLBlastSuccess (a success means a
// Database was constructed, so the table is full, or a cached one was found, which an earlier
// construction stored). After that calls go straight through, without a lock.
// CLBlastClearCache() (context release) touches only the locked caches: it needs no guard.
#ifndef CLMHA_DEVICE_BLAS_H
#define CLMHA_DEVICE_BLAS_H

#include "base/defs.h"

#include <stdbool.h>

// Before a CLBlast call: takes the process-wide lock while CLBlast is not yet initialised.
// Returns whether it took it (pass that to clmha__blas_leave()).
CLMHA__HIDDEN bool clmha__blas_enter(void);

// After the call: when @p locked, marks CLBlast initialised if @p status is CLBlastSuccess (0)
// and releases the lock.
CLMHA__HIDDEN void clmha__blas_leave(bool locked, int status);

// Runs CLBlast call @p call (an expression returning a CLBlastStatusCode) under the guard and
// stores its status in the int @p status.
#define CLMHA__BLAS(status, call)                                                              \
    do {                                                                                       \
        bool clmha__blas_locked_ = clmha__blas_enter();                                        \
        (status) = (int)(call);                                                                \
        clmha__blas_leave(clmha__blas_locked_, (status));                                      \
    } while (0)

#endif
