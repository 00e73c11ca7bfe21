// The process's worker threads for the host path's parallel regions: the column and item
// shares of the host BLAS's products (device/host_blas.c), the packed weight's products and the
// host attention core's blocks.
//
// Why not OpenMP's team: these regions start from a driver's worker thread (PoCL runs native
// kernels on any of its threads), and OpenMP gives each starting thread a team of its own: a
// process of PoCL's 2 threads on 2 cores held two teams, 4 threads, and which thread started
// which region varied from process to process, and so did the products' speed (N 1, L 128: a
// third of the processes 1.5-1.8x slower). One pool serves every starting thread; its idle
// threads sleep at once (no spinning that would take a core from the driver's OpenCL kernels),
// and each is woken on a CPU other than its caller's (host_pool.c says why).
//
// A region runs fn(arg, t, team) for t = 0 .. team - 1: t 0 in the calling thread, the others
// in the pool's threads. One region at a time: a caller that finds the pool busy (another
// thread's region), or a thread short because the system refused to start it, runs those
// members itself, in turn — the same members with the same t and team, so a region's results do
// not depend on where its members ran. Fork-safe (a child starts its own threads on its first
// region); the threads end when the library is unloaded.
#ifndef CLMHA_DEVICE_HOST_POOL_H
#define CLMHA_DEVICE_HOST_POOL_H

#include <stddef.h>

#include "base/defs.h"

// One more than the pool's most threads: a region's members from this one on run in the
// calling thread.
#define CLMHA__HOST_POOL_MAX 64

// Runs @p fn(@p arg, t, @p team) for every t < @p team and returns when all have; @p team 1 (or
// 0) runs fn(arg, 0, 1) in the calling thread alone. What fn calls runs
// in whichever thread runs the member: a library with threads of its own (oneDNN's OpenMP team)
// is told by the caller's fn to keep to that thread.
CLMHA__HIDDEN void clmha__host_pool_run(size_t team, void (*fn)(void *arg, size_t t, size_t team),
                                        void *arg);

#endif
