// Attributes every clmha source file uses. The lowest layer: includes nothing of clmha's.
#ifndef CLMHA_BASE_DEFS_H
#define CLMHA_BASE_DEFS_H

#if defined(__GNUC__) && !defined(_WIN32)
#define CLMHA__HIDDEN __attribute__((visibility("hidden")))
#define CLMHA__PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define CLMHA__HIDDEN
#define CLMHA__PRINTF(f, a)
#endif

#endif
