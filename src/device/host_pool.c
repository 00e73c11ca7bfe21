// The process's worker threads (device/host_pool.h says why and how).
#define _GNU_SOURCE  // sched_getcpu, pthread_setaffinity_np
#include "device/host_pool.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

// Thread t (1 <= t < CLMHA__HOST_POOL_MAX) runs member t of each region whose team has it: its
// slot's count goes up by one per such region. Slots on cache lines of their own, so that a
// thread's slot is not written with the others'.
typedef struct slot {
    alignas(64) atomic_uint go;
    unsigned go_at_start;  // go's value when the thread started (written before it starts)
#ifdef __linux__
    cpu_set_t cpus;  // the CPUs the thread may run on (its creator's when it started)
    bool steered;    // a caller narrowed the thread's CPUs for its wake-up (steer_away())
#endif
} slot;

static struct {
    pthread_mutex_t busy;   // held by the thread whose region runs
    pthread_mutex_t sleep;  // with wake: the threads waiting for a region
    pthread_cond_t wake;
    atomic_int sleepers;
    atomic_bool stop;
    size_t started;  // threads 1 .. started run (written under busy)
    pthread_t thread[CLMHA__HOST_POOL_MAX];
    slot slot[CLMHA__HOST_POOL_MAX];
    // The region: written under busy before the slots' counts go up, read by the members.
    void (*fn)(void *, size_t, size_t);
    void *arg;
    size_t team;
    atomic_size_t pending;  // members still running in the pool's threads
} pool = {
    .busy = PTHREAD_MUTEX_INITIALIZER,
    .sleep = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
};

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

// In a forked child no pool thread runs (only the forking thread is copied), and the locks may
// have been held by threads that are not there: start afresh.
static void after_fork_child(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.sleep, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.stop, false);
    pool.started = 0;
}

static void register_fork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

// ---- where a woken thread runs ------------------------------------------------------------------
//
// A region's caller runs member 0 at once, so the thread it wakes should start on another CPU.
// Linux often puts a woken thread on its waker's CPU, or on the CPU it last ran on, which with
// callers from two driver threads is as often the caller's: the thread then waited behind the
// caller (0.7 ms per region on average, `perf sched`, N 8, L 128 on 2 cores) while the other CPU
// idled, and the forward took 1.1-1.2x OpenMP's time. So the caller narrows each thread it wakes
// to its CPUs less the caller's own, and the thread, once running, takes back all of them (so
// that the scheduler may still move it when the caller moves). Where this cannot be done (not
// Linux, a single CPU, a call refused), threads are left where the system puts them.

// Narrows thread @p t's CPUs to its own less the calling thread's current one.
static void steer_away(size_t t) {
#ifdef __linux__
    slot *s = &pool.slot[t];
    int cpu = sched_getcpu();
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &s->cpus) || CPU_COUNT(&s->cpus) < 2)
        return;
    cpu_set_t away = s->cpus;
    CPU_CLR(cpu, &away);
    s->steered = pthread_setaffinity_np(pool.thread[t], sizeof away, &away) == 0;
#else
    (void)t;
#endif
}

// Gives thread @p t (the calling one) back all its CPUs.
static void steer_back(size_t t) {
#ifdef __linux__
    slot *s = &pool.slot[t];
    if (s->steered) {
        pthread_setaffinity_np(pthread_self(), sizeof s->cpus, &s->cpus);
        s->steered = false;
    }
#else
    (void)t;
#endif
}

// ---- the threads --------------------------------------------------------------------------------

// Waits, asleep, until slot @p t's count differs from @p seen (or the pool stops); returns the
// new count. The caller raises the count before it reads the sleepers, this thread counts itself
// a sleeper before it reads the count (both sequentially consistent): one of the two sees the
// other's write, and the caller's broadcast, under the lock, finds this thread waiting.
static unsigned await_region(size_t t, unsigned seen) {
    atomic_uint *go = &pool.slot[t].go;
    pthread_mutex_lock(&pool.sleep);
    atomic_fetch_add(&pool.sleepers, 1);
    unsigned g;
    while ((g = atomic_load(go)) == seen && !atomic_load(&pool.stop))
        pthread_cond_wait(&pool.wake, &pool.sleep);
    atomic_fetch_sub(&pool.sleepers, 1);
    pthread_mutex_unlock(&pool.sleep);
    return g;
}

static void *pool_thread(void *arg) {
    size_t t = (size_t)(uintptr_t)arg;
    unsigned seen = pool.slot[t].go_at_start;
    for (;;) {
        seen = await_region(t, seen);
        if (atomic_load(&pool.stop)) return NULL;
        steer_back(t);
        pool.fn(pool.arg, t, pool.team);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
}

// Starts threads up to member @p want - 1 (under busy); those the system refuses are left to the
// callers. Signals stay with the application's threads.
static void start_threads(size_t want) {
    pthread_once(&fork_once, register_fork);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (pool.started + 1 < want) {
        size_t t = pool.started + 1;
        slot *s = &pool.slot[t];
        s->go_at_start = atomic_load(&s->go);
#ifdef __linux__
        s->steered = false;
        if (sched_getaffinity(0, sizeof s->cpus, &s->cpus) != 0) CPU_ZERO(&s->cpus);
#endif
        if (pthread_create(&pool.thread[t], NULL, pool_thread, (void *)(uintptr_t)t) != 0) break;
        pool.started = t;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

void clmha__host_pool_run(size_t team, void (*fn)(void *arg, size_t t, size_t team), void *arg) {
    if (team < 1) team = 1;
    if (team == 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        for (size_t t = 0; t < team; ++t) fn(arg, t, team);
        return;
    }
    size_t want = team < CLMHA__HOST_POOL_MAX ? team : CLMHA__HOST_POOL_MAX;
    if (pool.started + 1 < want) start_threads(want);
    size_t helpers = want - 1 < pool.started ? want - 1 : pool.started;
    pool.fn = fn;
    pool.arg = arg;
    pool.team = team;
    atomic_store_explicit(&pool.pending, helpers, memory_order_relaxed);
    for (size_t t = 1; t <= helpers; ++t) {
        steer_away(t);
        atomic_fetch_add(&pool.slot[t].go, 1);
    }
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.sleep);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep);
    }
    fn(arg, 0, team);
    for (size_t t = helpers + 1; t < team; ++t) fn(arg, t, team);
    for (unsigned i = 1; atomic_load_explicit(&pool.pending, memory_order_acquire) != 0; ++i)
        if (i % 4096 == 0) sched_yield();
        else RELAX();
    pthread_mutex_unlock(&pool.busy);
}

// The threads end with the library (dlclose, or the process's exit), after the region running.
__attribute__((destructor)) static void end_pool(void) {
    pthread_mutex_lock(&pool.busy);
    if (pool.started) {
        atomic_store(&pool.stop, true);
        pthread_mutex_lock(&pool.sleep);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep);
        for (size_t t = 1; t <= pool.started; ++t) pthread_join(pool.thread[t], NULL);
        pool.started = 0;
        atomic_store(&pool.stop, false);
    }
    pthread_mutex_unlock(&pool.busy);
}
