// The fault sweep's scenario of the `clmha run` program (see fault_sweep.c and sweep.h):
// the program runs a forward and a backward on a PyTorch case (tests/cli/grad_self: a layer
// file, the query, the output's gradient, PyTorch's float64 output and gradients), writing the
// output and the gradients, with the preloaded injection failing its call number `at`.
#define _GNU_SOURCE
#include "sweep.h"

#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { MAX_VALUES = 4096 };
#define CLI_TOL 1e-4  // test_cli's: max |clmha - torch| <= CLI_TOL * (1 + max |torch|)

// The values of a .npy file of float32 or float64 ('<f4', '<f8') as doubles into @p v (at most
// MAX_VALUES); -1 when the file is not one.
static long npy_values(const char *path, double *v) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    static unsigned char buf[128 + MAX_VALUES * 8];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    if (n < 10 || memcmp(buf, "\x93NUMPY", 6) != 0) return -1;
    size_t head = buf[6] == 1 ? 10 + (size_t)(buf[8] | buf[9] << 8)
                              : 12 + (size_t)(buf[8] | buf[9] << 8 | buf[10] << 16);
    if (head > n || head > 1024) return -1;
    char text[1100];
    memcpy(text, buf, head);
    text[head] = '\0';
    const char *dict = text + (buf[6] == 1 ? 10 : 12);  // after the header's length
    size_t elem = strstr(dict, "'<f8'") ? 8 : strstr(dict, "'<f4'") ? 4 : 0;
    if (!elem || (n - head) % elem) return -1;
    long count = (long)((n - head) / elem);
    for (long i = 0; i < count; ++i) {
        if (elem == 8) memcpy(&v[i], buf + head + i * 8, 8);
        else {
            float x;
            memcpy(&x, buf + head + i * 4, 4);
            v[i] = x;
        }
    }
    return count;
}

// Whether the .npy file @p got holds @p want's values within test_cli's tolerance (reported).
static bool npy_close(const char *got, const char *want) {
    static double g[MAX_VALUES], w[MAX_VALUES];
    long ng = npy_values(got, g), nw = npy_values(want, w);
    if (ng < 0 || ng != nw) {
        fprintf(stderr, "  clmha run: %s: %ld values, %s has %ld\n", got, ng, want, nw);
        return false;
    }
    double err = 0, top = 0;
    for (long i = 0; i < nw; ++i) {
        double d = fabs(g[i] - w[i]);
        if (!(d <= err)) err = d;  // NaN wins
        if (fabs(w[i]) > top) top = fabs(w[i]);
    }
    if (err <= CLI_TOL * (1 + top)) return true;
    fprintf(stderr, "  clmha run: %s: max error %.3g against PyTorch\n", got, err);
    return false;
}

// Whether the run's folder @p dir holds the output and every gradient, right.
static bool outputs_right(const char *dir, const char *cases) {
    char got[512], want[512];
    snprintf(got, sizeof got, "%s/output.npy", dir);
    snprintf(want, sizeof want, "%s/expected_output.npy", cases);
    bool right = npy_close(got, want);
    snprintf(want, sizeof want, "%s/expected_grads", cases);
    DIR *d = opendir(want);
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.') {
            snprintf(got, sizeof got, "%s/grads/%s", dir, e->d_name);
            snprintf(want, sizeof want, "%s/expected_grads/%s", cases, e->d_name);
            right = npy_close(got, want) && right;
        }
    if (d) closedir(d);
    return d && right;
}

// Whether the run's folder holds nothing but the empty gradients folder (reported).
static bool nothing_written(const char *dir) {
    char sub[512];
    snprintf(sub, sizeof sub, "%s/grads", dir);
    const char *dirs[2] = {dir, sub};
    bool clean = true;
    for (int i = 0; i < 2; ++i) {
        DIR *d = opendir(dirs[i]);
        struct dirent *e;
        while (d && (e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
                !(i == 0 && strcmp(e->d_name, "grads") == 0)) {
                fprintf(stderr, "  clmha run: a failed run left %s/%s\n", dirs[i], e->d_name);
                clean = false;
            }
        if (d) closedir(d);
        clean = clean && d;
    }
    return clean;
}

// Runs the program into the fresh folder @p dir (its stderr into @p err_path, what the
// preloaded library saw into @p report); the program's wait status, or -1 for a hang.
static int run_program(const char *program, const char *cases, const char *dir,
                       const char *err_path, const char *report) {
    char layer[512], query[512], grad[512], out[512], grads[512];
    snprintf(layer, sizeof layer, "%s/layer.safetensors", cases);
    snprintf(query, sizeof query, "%s/query.npy", cases);
    snprintf(grad, sizeof grad, "%s/grad_output.npy", cases);
    snprintf(out, sizeof out, "%s/output.npy", dir);
    snprintf(grads, sizeof grads, "%s/grads", dir);
    if (mkdir(grads, 0700) != 0) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        setenv("CLMHA_FAULT_REPORT", report, 1);
        setenv("CLMHA_FAULT_PROGRAM", "1", 1);  // the program's own calls (its files) too
        if (!freopen("/dev/null", "w", stdout) || !freopen(err_path, "w", stderr)) _exit(125);
        execl(program, program, "run", "--layer", layer, "--query", query, "--grad-output",
              grad, "--output", out, "--grads-dir", grads, (char *)NULL);
        _exit(126);
    }
    int status = 0;
    for (int waited = 0; waitpid(pid, &status, WNOHANG) == 0; ++waited) {
        if (waited > 1700) {  // 170 s: before the sweep's own limit for this process
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        struct timespec ts = {0, 100000000};
        nanosleep(&ts, NULL);
    }
    return status;
}

// Whether the program's stderr names what failed as @p kind's rule asks (fault_sweep.c).
static bool message_names(const char *err_path, const char *kind, const char *name) {
    static char text[8192];
    FILE *f = fopen(err_path, "r");
    size_t n = f ? fread(text, 1, sizeof text - 1, f) : 0;
    if (f) fclose(f);
    text[n] = '\0';
    bool named = strcmp(kind, "alloc") == 0 ? strstr(text, "memory") != NULL
                 : strcmp(kind, "io") == 0  ? strchr(text, '/') || strstr(text, "stdout")
                                            : strstr(text, name) != NULL;
    if (!named) fprintf(stderr, "  clmha run, call %s: stderr \"%s\"\n", name, text);
    return named;
}

// One run in a fresh folder: its outcome (with *report filled).
static int one_run(const char *program, const char *cases, const char *kind,
                   cli_report *report) {
    char dir[] = "/tmp/clmha-fault-cli-XXXXXX", err_path[600], rep_path[600];
    if (!mkdtemp(dir)) return OUT_SETUP;
    snprintf(err_path, sizeof err_path, "%s.err", dir);
    snprintf(rep_path, sizeof rep_path, "%s.report", dir);
    int status = run_program(program, cases, dir, err_path, rep_path);
    FILE *f = fopen(rep_path, "r");
    *report = (cli_report){0};
    bool read = f && fscanf(f, "%ld %ld %ld %63s", &report->calls, &report->held,
                            &report->allocations, report->failed) == 4;
    if (f) fclose(f);
    int outcome;
    if (status < 0 || !WIFEXITED(status)) {
        fprintf(stderr, "  clmha run, call %s: %s\n", report->failed,
                status < 0 ? "hung" : "crashed");
        outcome = OUT_CRASHED;
    } else if (!read) {
        outcome = OUT_SETUP;
    } else if (WEXITSTATUS(status) == 0) {
        outcome = outputs_right(dir, cases) ? OUT_RECOVERED : OUT_WRONG;
    } else {
        outcome = !message_names(err_path, kind, report->failed) ? OUT_MESSAGE
                  : !nothing_written(dir)                        ? OUT_WRITTEN
                                                                 : OUT_REFUSED;
        if (outcome == OUT_WRITTEN)
            fprintf(stderr, "  clmha run, call %s failed: files written\n", report->failed);
    }
    char cmd[2000];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s' '%s'", dir, err_path, rep_path);
    if (system(cmd) != 0) fprintf(stderr, "  clmha run: could not remove %s\n", dir);
    return outcome;
}

int cli_sweep_run(const char *program, const char *cases, long at, cli_report *report) {
    const char *kind = getenv("CLMHA_FAULT_KIND");
    kind = kind ? kind : "cl";
    char at_s[32];
    snprintf(at_s, sizeof at_s, "%ld", at);
    setenv("CLMHA_FAULT_AT", at_s, 1);
    int outcome = one_run(program, cases, kind, report);
    if (at == 0 || !strcmp(report->failed, "-") || outcome > OUT_RECOVERED) return outcome;
    // The same run without faults: nothing the failed one left (caches, tuning files) harms it.
    setenv("CLMHA_FAULT_AT", "0", 1);
    cli_report again;
    if (one_run(program, cases, kind, &again) != OUT_RECOVERED) {
        fprintf(stderr, "  clmha run, call %ld (%s): the run after it failed\n", at,
                report->failed);
        return OUT_RETRY;
    }
    return outcome;
}
