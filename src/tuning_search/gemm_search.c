// The phases of the GEMM search (see gemm_search.h): a candidate tried, candidates timed in
// turns, one kernel's search (seeds, walk, random draws, leaders timed again), the phases'
// deadlines, the choice of XGEMM_MIN_INDIRECT_SIZE, and the phases in order
// (clmha__gemm_search()).
#define _POSIX_C_SOURCE 200809L

#include "tuning_search/gemm_search.h"

#include "tuning_search/gemm_candidates.h"
#include "tuning_search/gemm_timing.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- one candidate, one kernel's search -------------------------------------------------------

typedef struct result {
    bool ok;
    double cost;                  // seconds the candidate took (build included)
    double total;                 // summed fastest seconds over the phase's shapes
    double times[MAX_SHAPES];
} result;

// Trace line of a candidate: its parameters (of the kernel searched), then why it failed or
// the GFLOP/s of each shape timed, and the seconds it took.
static void trace_candidate(const tuner *T, const clmha__tuning *t, bool batched,
                            const char *phase, const result *r, double seconds) {
    char params[640], gflops[256] = "";
    clmha__tuning shown = *t;
    shown.has_routine = false;
    (batched ? &shown.has_xgemm : &shown.has_direct)[0] = false;
    clmha__tuning_format(&shown, params, sizeof params);
    size_t used = 0;
    if (r->ok)
        for (size_t i = 0; i < T->nshapes; ++i)
            if (r->times[i] > 0)
                used = clmha__tuning_append(gflops, sizeof gflops, used, " %.1f",
                                            flops(&T->shapes[i]) / r->times[i] / 1e9);
    clmha__tuner_trace(T, "%s %s: %s%s GFLOP/s (%.1f s)", phase, params, r->ok ? "" : T->msg,
                       gflops, seconds);
}

// Applies @p t, checks and times one candidate. *r gets its result (ok false when it failed to
// build, run or check).
static void try_candidate(tuner *T, const clmha__tuning *t, bool batched, double reference,
                          const char *phase, result *r) {
    double t0 = now_s();
    r->ok = false;
    r->total = INFINITY;
    T->msg[0] = '\0';
    T->overridden = true;
    // Phase A checks samples of its timed products only: the odd-sized plain GEMMs would build
    // the pad kernels too (seconds per candidate on PoCL); the final check runs them.
    if (clmha__tuning_override(&T->tg, t) == CLMHA_SUCCESS &&
        clmha__tuner_run_checks(T, false, batched) &&
        clmha__tuner_time_kind(T, batched, 5, reference, r->times, &r->total))
        r->ok = true;
    if (!r->ok) ++T->rejected;
    ++T->tried;
    r->cost = now_s() - t0;
    T->cost_sum += r->cost;
    if (clmha__tuner_tracing(T)) trace_candidate(T, t, batched, phase, r, now_s() - t0);
    clmha__tuner_progress(T, phase);
}

// Seconds a candidate of a phase is expected to take (a build of the Sgemm program for Xgemm,
// of the larger strided batched one for XgemmDirect).
static double expected_cost(const tuner *T, bool direct) {
    if (T->phase_tried[direct]) return T->phase_cost[direct] / (double)T->phase_tried[direct];
    double xgemm = T->phase_tried[0] ? T->phase_cost[0] / (double)T->phase_tried[0] : 10.0;
    // A direct candidate builds the larger batched program, and on PoCL its kernel takes ~10×
    // longer to build than Xgemm's.
    bool cpu = (T->ctx->info.type & CL_DEVICE_TYPE_CPU) != 0;
    return direct ? (cpu ? 8 : 3) * xgemm : xgemm;
}

static void trace_turns(const tuner *T, const char *phase, const double *tbest,
                        const double *tx) {
    if (!clmha__tuner_tracing(T)) return;
    char line[512] = "";
    size_t used = 0;
    for (size_t i = 0; i < T->nshapes; ++i)
        if (tbest[i] > 0 && tx[i] > 0)
            used = clmha__tuning_append(line, sizeof line, used, " %.1f | %.1f",
                                        flops(&T->shapes[i]) / tbest[i] / 1e9,
                                        flops(&T->shapes[i]) / tx[i] / 1e9);
    clmha__tuner_trace(T, "%s in turns, best | candidate:%s GFLOP/s", phase, line);
}

// Times @p a and @p b in turns (ROUNDS_IN_TURNS rounds of 2 runs each, their programs already
// built) on the shapes of one kind; ta[i] and tb[i] get each shape's fastest time (0 for shapes
// of the other kind). On a machine shared with other work, timings taken a minute apart are not
// comparable; timings taken in turns are. False on a failure (T->msg says why).
#define ROUNDS_IN_TURNS 3
enum { TOP = 3 };  // leaders a phase times again before it picks its winner
static bool time_in_turns(tuner *T, const clmha__tuning *a, const clmha__tuning *b,
                          bool batched, double *ta, double *tb) {
    for (size_t i = 0; i < T->nshapes; ++i) ta[i] = tb[i] = 0;
    for (int round = 0; round < ROUNDS_IN_TURNS; ++round)
        for (int which = 0; which < 2; ++which) {
            double times[MAX_SHAPES], total, *keep = which ? tb : ta;
            if (clmha__tuning_override(&T->tg, which ? b : a) != CLMHA_SUCCESS ||
                !clmha__tuner_time_kind(T, batched, 2, 0, times, &total))
                return false;
            for (size_t i = 0; i < T->nshapes; ++i)
                if (times[i] > 0 && (keep[i] <= 0 || times[i] < keep[i])) keep[i] = times[i];
        }
    return true;
}

// The leaders of a phase (@p ntop of them, their programs built) timed again in @p rounds
// rounds of turns; each is judged on these turns alone (fastest of each shape): top_r gets the
// fresh times, INFINITY for one that failed every time. Returns the index of the fastest.
static size_t retime_leaders(tuner *T, bool direct, const clmha__tuning *base, const cand *top,
                             result *top_r, size_t ntop, int rounds, const char *phase) {
    double fresh[TOP][MAX_SHAPES];
    bool timed[TOP] = {false};
    for (int round = 0; round < rounds; ++round)
        for (size_t i = 0; i < ntop; ++i) {
            clmha__tuning t = *base;
            if (direct)
                clmha__cand_direct_params(&top[i], t.direct);
            else
                clmha__cand_xgemm_params(&top[i], t.xgemm);
            double times[MAX_SHAPES], total;
            if (clmha__tuning_override(&T->tg, &t) != CLMHA_SUCCESS ||
                !clmha__tuner_time_kind(T, direct, 3, 0, times, &total))
                continue;
            for (size_t k = 0; k < T->nshapes; ++k)
                if (!timed[i] || (times[k] > 0 && times[k] < fresh[i][k]))
                    fresh[i][k] = times[k];
            timed[i] = true;
        }
    for (size_t i = 0; i < ntop; ++i) {
        if (!timed[i]) {
            top_r[i].total = INFINITY;
            continue;
        }
        top_r[i].total = 0;
        for (size_t k = 0; k < T->nshapes; ++k) {
            top_r[i].times[k] = fresh[i][k];
            top_r[i].total += fresh[i][k];
        }
    }
    size_t win = 0;
    for (size_t i = 1; i < ntop; ++i)
        if (top_r[i].total < top_r[win].total) win = i;
    for (size_t i = 0; i < ntop; ++i)
        clmha__tuner_trace(T, "%s leader %zu timed again: %.4f s%s", phase, i,
                           top_r[i].total, i == win ? " (chosen)" : "");
    return win;
}

// One kernel's search under way (search()).
enum { MAX_SEEN = 256 };  // candidates one search draws at most
typedef enum walk_mode { SEEDS, WALK_START, WALK, RANDOM } walk_mode;
typedef struct walk {
    bool direct;          // XgemmDirect, else Xgemm
    const char *phase;    // "XgemmDirect" or "Xgemm"
    clmha__tuning base;   // the other kernels' values and the split
    const cand *seeds;
    size_t nseeds, seed_at;
    walk_mode mode;
    cand *seen;           // the candidates drawn so far (MAX_SEEN)
    size_t nseen;
    cand_list *nb;        // the neighbours of the walk's centre
    size_t nb_at;
    cand top[TOP];        // the TOP fastest, fastest first
    result top_r[TOP];
    size_t ntop;
    bool have;            // *best holds a candidate that ran
    cand *best_cand;
    result *best;
} walk;

enum { NEXT_TRY, NEXT_SKIP, NEXT_STOP };

// The next candidate of @p W into *@p x: the seeds, then the neighbours of the best, then
// random draws. NEXT_TRY with *x, NEXT_SKIP (nothing to try this turn: the mode changed or the
// candidate was seen or invalid) or NEXT_STOP (no random candidate is left).
static int next_candidate(tuner *T, walk *W, cand *x) {
    if (W->mode == SEEDS) {
        if (W->seed_at >= W->nseeds) {
            W->mode = W->have ? WALK_START : RANDOM;
            return NEXT_SKIP;
        }
        *x = W->seeds[W->seed_at++];
        if (clmha__cand_list_has(W->seen, W->nseen, x) || !clmha__cand_valid(T, W->direct, x))
            return NEXT_SKIP;
    } else if (W->mode == WALK_START) {
        clmha__cand_neighbours(T, W->direct, W->best_cand, W->seen, W->nseen, W->nb);
        W->nb_at = 0;
        W->mode = WALK;
        return NEXT_SKIP;
    } else if (W->mode == WALK) {
        if (W->nb_at >= W->nb->count) {
            W->mode = RANDOM;
            return NEXT_SKIP;
        }
        *x = W->nb->items[W->nb_at++];
        if (clmha__cand_list_has(W->seen, W->nseen, x)) return NEXT_SKIP;
    } else if (!clmha__cand_random(T, W->direct, W->seen, W->nseen, x)) {
        return NEXT_STOP;
    }
    return NEXT_TRY;
}

// The tuning @p W's base with candidate @p x in its kernel's place.
static clmha__tuning with_candidate(const walk *W, const cand *x) {
    clmha__tuning t = W->base;
    if (W->direct)
        clmha__cand_direct_params(x, t.direct);
    else
        clmha__cand_xgemm_params(x, t.xgemm);
    return t;
}

// A candidate that ran (tuning @p t, result *@p r) is timed again in turns with the best so far
// and judged on those turns: its times become the best's times scaled by the ratios seen in
// turns. One cut short as more than 2.5× slower gets its turns too (other work on the machine
// may have slowed it), unless its first shape alone took more than 10× the best's.
static void judge_in_turns(tuner *T, const walk *W, const clmha__tuning *t, result *r) {
    bool close = false;
    for (size_t i = 0; i < T->nshapes && W->have && r->ok; ++i)
        if (r->times[i] > 0) {
            close = isfinite(r->total) || r->times[i] <= 10 * W->best->times[i];
            break;
        }
    if (!close) return;
    double t0 = now_s(), tbest[MAX_SHAPES], tx[MAX_SHAPES];
    clmha__tuning tb = with_candidate(W, W->best_cand);
    if (time_in_turns(T, &tb, t, W->direct, tbest, tx)) {
        r->total = 0;
        for (size_t i = 0; i < T->nshapes; ++i) {
            if (tx[i] > 0 && tbest[i] > 0) r->times[i] = W->best->times[i] * tx[i] / tbest[i];
            r->total += r->times[i];
        }
        trace_turns(T, W->phase, tbest, tx);
    } else {
        r->ok = false;
        ++T->rejected;
    }
    r->cost += now_s() - t0;
    T->cost_sum += now_s() - t0;
}

// Keeps candidate @p x among the TOP fastest of @p W (fastest first) when it ran.
static void keep_top(walk *W, const cand *x, const result *r) {
    if (!r->ok || !isfinite(r->total)) return;
    size_t at = W->ntop < TOP ? W->ntop++ : TOP;
    if (at == TOP && r->total < W->top_r[TOP - 1].total) at = TOP - 1;
    if (at >= TOP) return;
    for (; at > 0 && W->top_r[at - 1].total > r->total; --at) {
        W->top[at] = W->top[at - 1];
        W->top_r[at] = W->top_r[at - 1];
    }
    W->top[at] = *x;
    W->top_r[at] = *r;
}

// Makes candidate @p x the best of @p W when it beats it; an improvement of 2 % or more (or the
// first that ran) moves the walk's centre there, outside the seeds.
static void take_if_best(tuner *T, walk *W, const cand *x, const result *r) {
    if (!(r->ok && r->total < W->best->total)) return;
    bool moved = !W->have || r->total < 0.98 * W->best->total;
    *W->best = *r;
    *W->best_cand = *x;
    W->have = true;
    if (!W->direct && r->times[0] > 0)
        T->best_gflops = flops(&T->shapes[0]) / r->times[0] / 1e9;
    if (moved && W->mode != SEEDS) W->mode = WALK_START;
}

// Timings on a busy machine are noisy: the leaders of @p W are timed again, in turns (their
// programs are in CLBlast's cache: no build), and are judged on these turns alone (fastest of
// each). Three rounds when they fit before @p deadline (plus a little), else two.
static void pick_leader(tuner *T, walk *W, double deadline) {
    double again = 0;
    for (size_t i = 0; i < W->ntop; ++i) again += 3 * W->top_r[i].total;
    int rounds = elapsed(T) + 3 * again <= deadline + 10 ? 3 : 2;
    if (W->ntop < 2) return;
    size_t win = retime_leaders(T, W->direct, &W->base, W->top, W->top_r, W->ntop, rounds,
                                W->phase);
    *W->best_cand = W->top[win];
    *W->best = W->top_r[win];
    if (!W->direct && W->best->times[0] > 0)
        T->best_gflops = flops(&T->shapes[0]) / W->best->times[0] / 1e9;
}

// Search over one kernel (Xgemm or XgemmDirect) until @p deadline (seconds since start):
// the seeds, then a walk from the best (single steps, in prior order; an improvement of 2 %
// or more moves the centre), then prior-weighted random samples (an improvement starts a new
// walk). @p base holds the other kernels' values. *best_cand and *best get the winner. Each
// candidate is timed against the best so far, and until one has run against @p before (the
// parameters in effect on the shapes the phase times; 0: none): one over 2.5 times slower
// stops after two runs (shape_time), so that a slow device's first candidates do not take
// minutes (llvmpipe: 150 s for one at 0.1 GFLOP/s on sgemm 1024^3).
static bool search(tuner *T, bool direct, clmha__tuning base, size_t min_indirect,
                   const cand *seeds, size_t nseeds, double (*deadline)(const tuner *),
                   double before, cand *best_cand, result *best) {
    walk W = {.direct = direct, .phase = direct ? "XgemmDirect" : "Xgemm", .base = base,
              .seeds = seeds, .nseeds = nseeds, .mode = SEEDS, .best_cand = best_cand,
              .best = best};
    W.base.has_routine = true;
    W.base.min_indirect = min_indirect;
    if (direct)
        W.base.has_direct = true;
    else
        W.base.has_xgemm = true;
    best->ok = false;
    best->total = INFINITY;
    W.seen = malloc(MAX_SEEN * sizeof *W.seen);
    W.nb = malloc(sizeof *W.nb);
    if (!W.seen || !W.nb) {
        free(W.seen);
        free(W.nb);
        return false;
    }
    W.nb->count = 0;
    size_t max_tried = T->opts ? T->opts->max_candidates : 0;
    while (W.nseen < MAX_SEEN && (!max_tried || W.nseen < max_tried) &&
           elapsed(T) + expected_cost(T, direct) <= deadline(T)) {
        cand x;
        int next = next_candidate(T, &W, &x);
        if (next == NEXT_STOP) break;
        if (next == NEXT_SKIP) continue;
        W.seen[W.nseen++] = x;
        clmha__tuning t = with_candidate(&W, &x);
        result r;
        try_candidate(T, &t, direct, W.have ? best->total : before, W.phase, &r);
        judge_in_turns(T, &W, &t, &r);
        T->phase_cost[direct] += r.cost;
        ++T->phase_tried[direct];
        keep_top(&W, &x, &r);
        take_if_best(T, &W, &x, &r);
    }
    free(W.seen);
    free(W.nb);
    pick_leader(T, &W, deadline(T));
    return W.have;
}

// The phases' deadlines, from the costs seen so far. The final check builds both programs; the
// indirect timing of the attention products builds the batched one; the leaders of a phase are
// timed again (no build). XgemmDirect is searched only when two candidates fit in 20 % of the
// budget: on PoCL a direct kernel takes one to several minutes to build (and was not faster
// than the tuned indirect path on the attention products).
static bool any_batched_shape(const tuner *T) {
    for (size_t i = 0; i < T->nshapes; ++i)
        if (T->shapes[i].batch) return true;
    return false;
}

static bool direct_planned(const tuner *T) {
    return any_batched_shape(T) && 2 * expected_cost(T, true) <= 0.2 * T->budget;
}

static double deadline_xgemm(const tuner *T) {
    double xc = expected_cost(T, false);
    double reserve = xc;  // the final check's Sgemm build (small budgets overrun by the rest)
    if (T->budget >= 120) reserve += xc + 15 + (any_batched_shape(T) ? 1.5 * xc : 0);
    if (direct_planned(T)) reserve += 2 * expected_cost(T, true);
    return T->budget - reserve;
}

static double deadline_direct(const tuner *T) {
    return T->budget - 2 * expected_cost(T, false) - 15;
}

// Cube root of m·n·k (per batch item): CLBlast takes the direct path when it is below
// XGEMM_MIN_INDIRECT_SIZE.
static double side_of(const gshape *s) {
    return cbrt((double)s->m * (double)s->n * (double)s->k);
}

// True when both values send every shape the same way.
static bool same_paths(const tuner *T, size_t a, size_t b) {
    for (size_t i = 0; i < T->nshapes; ++i)
        if (goes_direct(&T->shapes[i], a) != goes_direct(&T->shapes[i], b)) return false;
    return true;
}

// A XGEMM_MIN_INDIRECT_SIZE that sends every batched shape direct and every plain one
// indirect, in the (geometric) middle of the gap; 0 when the sizes overlap.
static size_t split_guess(const tuner *T) {
    double lo = 0, hi = INFINITY;
    for (size_t i = 0; i < T->nshapes; ++i) {
        double side = side_of(&T->shapes[i]);
        if (T->shapes[i].batch) lo = fmax(lo, side);
        else hi = fmin(hi, side);
    }
    if (!(lo < hi) || !isfinite(hi)) return 0;
    for (size_t cut = (size_t)floor(sqrt(fmax(lo, 1) * hi)), tries = 0; tries < 4; ++cut, ++tries) {
        bool ok = cut > 0;
        for (size_t i = 0; i < T->nshapes && ok; ++i)
            ok = goes_direct(&T->shapes[i], cut) == (T->shapes[i].batch != 0);
        if (ok) return cut;
    }
    return 0;
}

// The XGEMM_MIN_INDIRECT_SIZE that minimises the summed time of the shapes, from their
// fastest direct and indirect times.
static size_t choose_min_indirect(const tuner *T, size_t fallback) {
    size_t cuts[2 * MAX_SHAPES + 2], ncuts = 0;
    cuts[ncuts++] = 0;
    cuts[ncuts++] = FORCE_DIRECT;
    for (size_t i = 0; i < T->nshapes; ++i) {
        const gshape *s = &T->shapes[i];
        double mnk = (double)s->m * (double)s->n * (double)s->k;
        size_t r = (size_t)floor(cbrt(mnk));
        while ((double)r * r * r > mnk) --r;
        while ((double)(r + 1) * (r + 1) * (r + 1) <= mnk) ++r;
        cuts[ncuts++] = r;      // r³ <= mnk: this shape indirect
        cuts[ncuts++] = r + 1;  // (r+1)³ > mnk: this shape direct
    }
    double best_total = INFINITY;
    size_t best_cut = fallback;
    for (size_t c = 0; c < ncuts; ++c) {
        double total = 0;
        for (size_t i = 0; i < T->nshapes && isfinite(total); ++i) {
            const gshape *s = &T->shapes[i];
            double mnk = (double)s->m * (double)s->n * (double)s->k;
            double cube = (double)cuts[c] * cuts[c] * cuts[c];
            double t = mnk < cube ? s->t_dir : s->t_ind;
            total += t > 0 ? t : INFINITY;
        }
        if (total < best_total * (1 - 1e-9)) best_total = total, best_cut = cuts[c];
    }
    if (!isfinite(best_total)) return fallback;
    // Put the cut in the middle (geometric) of the gap between the shapes it separates, so
    // that other shapes of similar size go the same way.
    double below = 0, above = (double)FORCE_DIRECT;
    for (size_t i = 0; i < T->nshapes; ++i) {
        const gshape *s = &T->shapes[i];
        double side = cbrt((double)s->m * (double)s->n * (double)s->k);
        if (side < (double)best_cut) below = fmax(below, side);
        else above = fmin(above, side);
    }
    // With every shape on one side, the cut is kept near them rather than at 0 or "never":
    // GEMMs far smaller than any timed one keep the direct path (below side 64, where the
    // indirect path's pad and transpose kernels cost more than the product), and GEMMs far
    // larger keep the indirect one.
    if (below == 0 && above < (double)FORCE_DIRECT) below = fmin(64.0, above / 2);
    if (above == (double)FORCE_DIRECT && below > 0) above = 4 * below;
    if (below > 0 && above < (double)FORCE_DIRECT) {
        size_t mid = (size_t)floor(sqrt(below * above));
        if ((double)mid > below && (double)mid <= above && same_paths(T, mid, best_cut))
            best_cut = mid;
    }
    return best_cut;
}


// ---- the phases in order -----------------------------------------------------------------------

// What the phases share.
typedef struct phases {
    const clmha__tuning *fallback;  // in effect where nothing is searched
    const clmha__tuning *before;    // the tuning in effect (NULL: none known)
    size_t split;                   // split_guess(), 0 when the sizes overlap
    bool any_batched;
    double plain_before, batched_before;
    cand best_x, best_d;
    result res_x, res_d;
} phases;

// 0. The shapes timed with the parameters in effect; the split the search starts from.
static clmha_status phase_before(tuner *T, phases *P) {
    const clmha_tune_options *o = T->opts;
    if (o && o->progress) o->progress(0, "timing the current parameters", o->user_data);
    if (!clmha__tuner_time_all(T, false, &P->plain_before, &P->batched_before))
        return clmha__fail(T->ctx, CLMHA_BLAS_ERROR,
                           "clmha_context_tune: the GEMMs fail with the current parameters: %s",
                           T->msg);
    T->best_gflops = flops(&T->shapes[0]) / T->shapes[0].before / 1e9;
    double medians[MAX_SHAPES];
    for (size_t i = 0; i < T->nshapes; ++i) medians[i] = T->shapes[i].before;
    clmha__tuner_trace_shapes(T, "before (medians)", medians);

    // The split the search starts from: the batched (attention) products direct, the plain
    // (projection) ones indirect, cut between their sizes. Phase A times plain shapes only and
    // B batched ones only, so with this split they time the paths they tune, and the winner of
    // B is already built for the final set. When the sizes overlap each phase forces its path.
    P->split = split_guess(T);
    // The shapes that took the direct path before: their time is the direct path's with the
    // parameters in effect (what XgemmDirect keeps unless phase B finds better).
    for (size_t i = 0; i < T->nshapes; ++i)
        if (goes_direct(&T->shapes[i], P->fallback->min_indirect))
            T->shapes[i].t_dir = T->shapes[i].before_best;
    P->any_batched = any_batched_shape(T);
    return CLMHA_SUCCESS;
}

// A. Xgemm, leaving time for what follows (deadline_xgemm). The set in effect (a stored
// tuning) first, then the device class's built-in set (when it is not the one in effect: on
// Intel's CPU runtime the CPU seeds below run 3-5x slower than CLBlast's generic set, its
// built-in set 6x faster), then the CPU seeds.
static void phase_xgemm(tuner *T, phases *P, gemm_outcome *out) {
    cand seeds[8];
    size_t nseeds = 0;
    if (P->before && P->before->has_xgemm &&
        clmha__cand_from_xgemm(P->before->xgemm, &seeds[nseeds]))
        ++nseeds;
    const clmha__builtin_set *b = clmha__tuning_builtin_of(&T->tg);
    if (b && !(P->before && P->before->has_xgemm &&
               memcmp(P->before->xgemm, b->tuning.xgemm, sizeof b->tuning.xgemm) == 0) &&
        clmha__cand_from_xgemm(b->tuning.xgemm, &seeds[nseeds]))
        ++nseeds;
    for (size_t i = 0; i < clmha__xgemm_seed_count && nseeds < 8; ++i)
        if (clmha__cand_from_xgemm(clmha__xgemm_seeds[i], &seeds[nseeds])) ++nseeds;
    out->have_x = search(T, false, out->final, P->split, seeds, nseeds, deadline_xgemm,
                         P->plain_before, &P->best_x, &P->res_x);
    if (out->have_x) {
        clmha__cand_xgemm_params(&P->best_x, out->final.xgemm);
        for (size_t i = 0; i < T->nshapes; ++i)
            if (!T->shapes[i].batch) T->shapes[i].t_ind = P->res_x.times[i];
    }
}

// C1. The tuned indirect path on the attention products (one build of the batched program;
// on PoCL far cheaper than a direct candidate, whose kernel takes minutes to build).
static void phase_indirect_batched(tuner *T, const phases *P, gemm_outcome *out) {
    const clmha_tune_options *o = T->opts;
    if (o && o->progress)
        o->progress(fmin(1.0, elapsed(T) / T->budget),
                    "timing the indirect path on the attention products", o->user_data);
    if (!(out->have_x && P->any_batched && elapsed(T) + 2 * expected_cost(T, false) <= T->budget))
        return;
    clmha__tuning t = out->final;
    double times[MAX_SHAPES] = {0}, total;
    t.min_indirect = 0;
    T->overridden = true;
    if (clmha__tuning_override(&T->tg, &t) == CLMHA_SUCCESS &&
        clmha__tuner_run_checks(T, false, true) &&
        clmha__tuner_time_kind(T, true, 5, 0, times, &total))
        for (size_t i = 0; i < T->nshapes; ++i)
            if (T->shapes[i].batch) T->shapes[i].t_ind = times[i];
    clmha__tuner_trace_shapes(T, "indirect on the batched shapes", times);
}

// B. XgemmDirect, with what is left but the final check's builds. Its winner is kept only
// where it beats the direct path as it was.
static void phase_direct(tuner *T, phases *P, gemm_outcome *out) {
    static const cand seeds[] = {
        {{16, 8, 8, 2, 2, 2, 0, 0}},  // WGD, MDIMCD, NDIMCD, KWID, VWMD, VWND, PADA, PADB
        {{32, 8, 8, 2, 4, 4, 0, 0}},
        {{16, 4, 4, 2, 4, 4, 0, 0}},
    };
    out->have_d = false;
    if (!(P->any_batched && elapsed(T) + expected_cost(T, true) <= deadline_direct(T))) return;
    size_t split_b = P->split ? P->split : FORCE_DIRECT;
    out->have_d = search(T, true, out->final, split_b, seeds, sizeof seeds / sizeof seeds[0],
                         deadline_direct, P->batched_before, &P->best_d, &P->res_d);
    if (!out->have_d) return;
    bool better = false;  // than the direct path before, where it was timed
    for (size_t i = 0; i < T->nshapes; ++i)
        if (T->shapes[i].batch &&
            (T->shapes[i].t_dir <= 0 || P->res_d.times[i] < T->shapes[i].t_dir))
            better = true;
    if (!better) {
        out->have_d = false;
        return;
    }
    clmha__cand_direct_params(&P->best_d, out->final.direct);
    for (size_t i = 0; i < T->nshapes; ++i)
        if (T->shapes[i].batch) T->shapes[i].t_dir = P->res_d.times[i];
}

// C2 and the final check: the split (per shape the faster path, one cut for all); then the
// final set applied, both routines checked (odd sizes on both sides of the split: padding and
// the pad/transpose kernels of the indirect path) and everything timed.
static clmha_status phase_final(tuner *T, const phases *P, gemm_outcome *out) {
    clmha__tuning *final = &out->final;
    final->min_indirect = choose_min_indirect(T, P->split ? P->split : P->fallback->min_indirect);
    if (out->have_d && P->split && same_paths(T, final->min_indirect, P->split))
        final->min_indirect = P->split;  // the winner of B is built with it
    clmha__tuner_trace(T, "XGEMM_MIN_INDIRECT_SIZE %zu (split guess %zu)", final->min_indirect,
                       P->split);
    size_t cut = final->min_indirect;
    if (cut > 0 && cut <= 1500) {
        T->checks[4] = (gshape){.m = cut + 37, .n = cut + 53, .k = cut + 29, .tb = true};
        T->checks[5] = (gshape){.m = cut + 45, .n = cut + 31, .k = cut + 57};
        for (int i = 4; i < 6; ++i) {
            gshape *c = &T->checks[i];
            snprintf(c->label, sizeof c->label, "check sgemm %s (%zu, %zu, %zu)",
                     c->tb ? "NT" : "NN", c->m, c->n, c->k);
        }
        T->nchecks = 6;
        clmha_status st = CLMHA_SUCCESS;
        for (size_t i = 4; i < 6 && !st; ++i) st = clmha__tuner_shape_alloc(T, &T->checks[i]);
        if (st) return st;
    }
    double plain_after = 0, batched_after = 0;
    // XgemmDirect untouched: the GEMMs on its path are what ran before (and, on PoCL, a direct
    // kernel takes long to build).
    T->skip_direct_below = out->have_d ? 0 : final->min_indirect;
    out->final_ok = (out->have_x || out->have_d) &&
                    clmha__tuning_override(&T->tg, final) == CLMHA_SUCCESS &&
                    clmha__tuner_run_checks(T, true, true) &&
                    clmha__tuner_time_all(T, true, &plain_after, &batched_after);
    double before = P->plain_before + P->batched_before;
    out->improved = out->final_ok && plain_after + batched_after < before;
    clmha__tuner_trace(T, "final %s: %.3f s (before %.3f s)", out->final_ok ? "ok" : T->msg,
                       plain_after + batched_after, before);
    return CLMHA_SUCCESS;
}

clmha_status clmha__gemm_search(tuner *T, const clmha__tuning *fallback,
                                const clmha__tuning *before, gemm_outcome *out) {
    memset(out, 0, sizeof *out);
    // Every kernel not searched keeps `fallback` (what was in effect, as far as it is known).
    out->final = *fallback;
    phases P = {.fallback = fallback, .before = before};
    clmha_status st = phase_before(T, &P);
    if (st) return st;
    phase_xgemm(T, &P, out);
    phase_indirect_batched(T, &P, out);
    phase_direct(T, &P, out);
    return phase_final(T, &P, out);
}
