// Reference counts of the caller's OpenCL objects, checked in a way that means something on every
// driver. Header-only (static functions); needs Criterion and libclmha.a (the held-object hook in
// src/device/held.h).
//
// Drivers differ in what CL_*_REFERENCE_COUNT reports (tools/driver-probes/refcounts.c shows it):
// - PoCL: exact, and every cl_mem, command queue, cl_program and cl_kernel holds its context, so
//   the context's count shows any object left behind.
// - Mesa's rusticl: the same, but its queue's worker thread drops references to the context up
//   to ~0.5 s after the release call returned. refs_settled() waits (up to 5 s) for a count.
// - Intel's CPU runtime (2026.2): clRetain/clRelease move the count, but a cl_mem or queue does
//   not hold its context, so the context's count never shows an object left behind
//   (context_refs_show_objects() finds this out).
// - A driver whose count does not move on clRetain (none of the four lanes' drivers) is found
//   by refs_move().
// Checks therefore (a) always compare clmha's own counts of the OpenCL objects it holds
// (clmha__test_held) with what they must be, and (b) compare the driver's count after waiting
// for it to settle where it means something, and say on stderr where it does not, so that no
// check passes vacuously in silence.
#ifndef CLMHA_TESTS_CL_REFS_H
#define CLMHA_TESTS_CL_REFS_H

#include <criterion/criterion.h>

#include <clmha.h>
#include <stdbool.h>
#include <stdio.h>
#include <time.h>

#include "device/held.h"

typedef enum ref_kind { REF_CONTEXT, REF_QUEUE, REF_EVENT } ref_kind;

static const char *const ref_kind_name[] = {"cl_context", "cl_command_queue", "cl_event"};

static cl_uint refs_of(ref_kind kind, const void *object) {
    cl_uint n = 0;
    cl_int err = CL_INVALID_VALUE;
    switch (kind) {
    case REF_CONTEXT:
        err = clGetContextInfo((cl_context)object, CL_CONTEXT_REFERENCE_COUNT, sizeof n, &n, NULL);
        break;
    case REF_QUEUE:
        err = clGetCommandQueueInfo((cl_command_queue)object, CL_QUEUE_REFERENCE_COUNT, sizeof n,
                                    &n, NULL);
        break;
    case REF_EVENT:
        err = clGetEventInfo((cl_event)object, CL_EVENT_REFERENCE_COUNT, sizeof n, &n, NULL);
        break;
    }
    cr_assert_eq(err, CL_SUCCESS, "reading the %s reference count: error %d",
                 ref_kind_name[kind], err);
    return n;
}

static void refs_retain(ref_kind kind, const void *object, bool retain) {
    cl_int err = CL_INVALID_VALUE;
    switch (kind) {
    case REF_CONTEXT:
        err = retain ? clRetainContext((cl_context)object) : clReleaseContext((cl_context)object);
        break;
    case REF_QUEUE:
        err = retain ? clRetainCommandQueue((cl_command_queue)object)
                     : clReleaseCommandQueue((cl_command_queue)object);
        break;
    case REF_EVENT:
        err = retain ? clRetainEvent((cl_event)object) : clReleaseEvent((cl_event)object);
        break;
    }
    cr_assert_eq(err, CL_SUCCESS, "%s %s: error %d", retain ? "retaining" : "releasing",
                 ref_kind_name[kind], err);
}

static void refs_sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// Polls the reference count of @p object every 10 ms until it equals @p want, for up to 5 s;
// returns the last count read.
static cl_uint refs_settled(ref_kind kind, const void *object, cl_uint want) {
    cl_uint n = refs_of(kind, object);
    for (int i = 0; i < 500 && n != want; ++i) {
        refs_sleep_ms(10);
        n = refs_of(kind, object);
    }
    return n;
}

// true when retaining @p object once raises its reported reference count by one (checked up to
// three times, in case a late release of the driver's own lands in between); the object is left
// as it was. On false, says on stderr that the driver's counts of this kind cannot be checked.
static bool refs_move(ref_kind kind, const void *object) {
    cl_uint before = 0, retained = 0;
    for (int attempt = 0; attempt < 3; ++attempt) {
        before = refs_of(kind, object);
        refs_retain(kind, object, true);
        retained = refs_of(kind, object);
        refs_retain(kind, object, false);
        if (retained == before + 1) return true;
        refs_sleep_ms(20);
    }
    fprintf(stderr,
            "note: this driver reports %s reference count %u -> %u across clRetain: its counts "
            "are not checked; clmha's own counts of the OpenCL objects it holds are\n",
            ref_kind_name[kind], before, retained);
    return false;
}

// true when a cl_mem created on @p context raises the context's reference count (PoCL, rusticl),
// so that the count shows objects left behind; the buffer is released again. On false, says on
// stderr that the context's count cannot show a leaked object.
static bool context_refs_show_objects(cl_context context) {
    cl_uint before = refs_of(REF_CONTEXT, context);
    cl_int err;
    cl_mem probe = clCreateBuffer(context, CL_MEM_READ_WRITE, 16, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer(16 bytes): error %d", err);
    cl_uint with = refs_of(REF_CONTEXT, context);
    clReleaseMemObject(probe);
    refs_settled(REF_CONTEXT, context, before);
    if (with == before + 1) return true;
    fprintf(stderr,
            "note: a cl_mem does not hold its cl_context on this driver (references %u -> %u): "
            "the context's count cannot show a leaked OpenCL object; clmha's own counts of the "
            "objects it holds are checked\n",
            before, with);
    return false;
}

// clmha's counts of the OpenCL objects it holds (libclmha.a test hook).
static void held_counts(long held[CLMHA__HELD_KINDS]) { clmha__test_held(held); }

static const char *const held_kind_name[CLMHA__HELD_KINDS] = {
    "cl_context", "cl_command_queue", "cl_device_id", "cl_mem", "cl_program", "cl_kernel"};

// Asserts that clmha holds no OpenCL object at all (@p when: "after releasing everything").
static void assert_nothing_held(const char *when) {
    long held[CLMHA__HELD_KINDS];
    held_counts(held);
    for (int k = 0; k < CLMHA__HELD_KINDS; ++k)
        cr_assert_eq(held[k], 0, "clmha still holds %ld %s references %s", held[k],
                     held_kind_name[k], when);
}

// Asserts that the reference count of @p object comes back to @p want (waiting for it to
// settle) when @p counts_move, the result of refs_move() on the same object.
static void assert_refs_back(ref_kind kind, const void *object, bool counts_move, cl_uint want,
                             const char *when) {
    if (!counts_move) return;  // refs_move() said so on stderr
    cl_uint n = refs_settled(kind, object, want);
    cr_assert_eq(n, want, "%s references %u %s (waited 5 s), expected %u", ref_kind_name[kind],
                 n, when, want);
}

#endif  // CLMHA_TESTS_CL_REFS_H
