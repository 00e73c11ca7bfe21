// The guard of CLBlast's first calls (device/blas.h explains why).
#include "device/blas.h"

#include <pthread.h>
#include <stdatomic.h>

static pthread_mutex_t first_calls = PTHREAD_MUTEX_INITIALIZER;
static atomic_bool initialised;  // a guarded call has returned CLBlastSuccess

bool clmha__blas_enter(void) {
    if (atomic_load_explicit(&initialised, memory_order_acquire)) return false;
    pthread_mutex_lock(&first_calls);
    if (atomic_load_explicit(&initialised, memory_order_acquire)) {
        pthread_mutex_unlock(&first_calls);
        return false;
    }
    return true;
}

void clmha__blas_leave(bool locked, int status) {
    if (!locked) return;
    if (status == 0) atomic_store_explicit(&initialised, true, memory_order_release);
    pthread_mutex_unlock(&first_calls);
}
