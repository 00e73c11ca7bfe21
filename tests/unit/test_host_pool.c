// The process's worker threads for the host path's regions (src/device/host_pool.c): every
// member of a region runs once with its own t and the region's team, members past the caller's
// run in other threads, callers from several threads at once and a region started from inside a
// member each get every member, a pool thread runs its member with all the process's CPUs (the
// wake-up hint given back), and a forked child starts its own threads.
#define _GNU_SOURCE  // sched_getaffinity

#include <criterion/criterion.h>

#include "device/host_pool.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <sys/wait.h>
#include <unistd.h>

#define MOST 12

typedef struct region {
    atomic_int runs[MOST];
    atomic_int wrong_team;
    size_t team;
    pthread_t caller;
    atomic_int in_other_threads;  // members run by a thread other than the caller
} region;

static void count_member(void *arg, size_t t, size_t team) {
    region *r = arg;
    if (team != r->team || t >= MOST) atomic_fetch_add(&r->wrong_team, 1);
    else atomic_fetch_add(&r->runs[t], 1);
    if (!pthread_equal(pthread_self(), r->caller)) atomic_fetch_add(&r->in_other_threads, 1);
}

// Runs a region of @p team members that count themselves; false (with what went wrong on
// stderr) unless each ran once with the right team.
static bool region_ok(size_t team, int *other_threads) {
    region r = {.team = team, .caller = pthread_self()};
    clmha__host_pool_run(team, count_member, &r);
    bool ok = atomic_load(&r.wrong_team) == 0;
    for (size_t t = 0; t < team; ++t) ok = ok && atomic_load(&r.runs[t]) == 1;
    if (other_threads) *other_threads = atomic_load(&r.in_other_threads);
    return ok;
}

Test(host_pool, every_member_once) {
    for (size_t team = 1; team <= MOST; ++team)
        for (int round = 0; round < 20; ++round)
            cr_assert(region_ok(team, NULL), "team %zu, round %d: a member ran not once", team,
                      round);
}

Test(host_pool, members_run_in_other_threads) {
    int other = 0;
    cr_assert(region_ok(1, &other));
    cr_assert_eq(other, 0, "a team of 1 runs in the calling thread alone");
    cr_assert(region_ok(4, &other));
    cr_assert_eq(other, 3, "members 1-3 ran in the pool's threads: %d of 3", other);
}

static void *many_regions(void *arg) {
    (void)arg;
    for (int round = 0; round < 300; ++round)
        if (!region_ok((size_t)(2 + round % 4), NULL)) return (void *)1;
    return NULL;
}

Test(host_pool, callers_in_parallel) {
    pthread_t th[4];
    for (int i = 0; i < 4; ++i) cr_assert_eq(pthread_create(&th[i], NULL, many_regions, NULL), 0);
    for (int i = 0; i < 4; ++i) {
        void *failed = NULL;
        pthread_join(th[i], &failed);
        cr_assert_null(failed, "caller %d: a region's member ran not once", i);
    }
}

static void nested_member(void *arg, size_t t, size_t team) {
    (void)team;
    atomic_int *ok = arg;
    if (t == 1 && region_ok(3, NULL)) atomic_fetch_add(ok, 1);
}

Test(host_pool, region_inside_a_member) {
    atomic_int ok = 0;
    clmha__host_pool_run(2, nested_member, &ok);
    cr_assert_eq(atomic_load(&ok), 1, "the inner region did not run each member once");
}

static void cpus_member(void *arg, size_t t, size_t team) {
    (void)team;
    atomic_int *cpus = arg;
    cpu_set_t set;
    if (t == 1 && sched_getaffinity(0, sizeof set, &set) == 0) atomic_store(cpus, CPU_COUNT(&set));
}

Test(host_pool, pool_threads_keep_all_cpus) {
    cpu_set_t set;
    cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0);
    int all = CPU_COUNT(&set);
    if (all < 2) cr_skip_test("one CPU: no other CPU to steer a woken thread to");
    for (int round = 0; round < 10; ++round) {
        atomic_int cpus = 0;
        clmha__host_pool_run(2, cpus_member, &cpus);
        cr_assert_eq(atomic_load(&cpus), all,
                     "round %d: member 1 ran on %d of the process's %d CPUs", round,
                     atomic_load(&cpus), all);
    }
}

Test(host_pool, forked_child_starts_its_own) {
    cr_assert(region_ok(3, NULL));
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int other = 0;
        bool ok = region_ok(3, &other) && other == 2 && region_ok(5, NULL);
        _exit(ok ? 0 : 1);
    }
    // A child whose region waits for threads it does not have never returns: stopped after 30 s.
    int status = 0;
    pid_t done = 0;
    for (int waited = 0; (done = waitpid(pid, &status, WNOHANG)) == 0 && waited < 3000; ++waited)
        usleep(10000);
    if (done == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        cr_assert_fail("the child's region did not return in 30 s");
    }
    cr_assert_eq(done, pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "the child's regions failed (status %d)", status);
}
