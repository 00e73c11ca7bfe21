// Forwarding header: the tuning store moved to src/tuning/ (params.h, store.h) and the search to
// src/tuner/. Kept so that context.c's include line stays as it is until the include lines of
// the per-module headers are fixed at merge; new code includes "tuning/store.h".
#ifndef CLMHA_TUNING_H
#define CLMHA_TUNING_H

#include "tuning/store.h"

#endif
