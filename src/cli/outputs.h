// The output files of `clmha run`: refusing outputs that are the same file or an input, and
// writing several .npy files all or none (temporary files next to their targets, then renames
// that are undone when one fails). Used by run.c for the output, the weights and the gradients.
#ifndef CLMHA_CLI_OUTPUTS_H
#define CLMHA_CLI_OUTPUTS_H

#include <stdbool.h>
#include <stddef.h>

// One .npy output: float32, float16 or float64.
typedef struct clmha__cli_out {
    const char *flag;  // the option that names it: "--output", "--grads-dir"
    const char *path;  // the file
    const float *data;
    const double *f64;  // when set: the values, written as float64 ('<f8'); data is unused
    size_t ndim;
    size_t shape[4];
    bool half;  // written as float16 ('<f2'), else float32
} clmha__cli_out;

// A named input file (NULL path: not given).
typedef struct clmha__cli_in {
    const char *flag;
    const char *path;
} clmha__cli_in;

// Refuses outputs that are the same file however spelled ("o.npy" and "./o.npy", hard links)
// and outputs that name an input: writing them would lose the input or one of the outputs.
// Reports (as "clmha <cmd>: ...") and returns false.
bool clmha__cli_outputs_distinct(const char *cmd, const clmha__cli_out *out, size_t count,
                                 const clmha__cli_in *in, size_t in_count);

// Writes the outputs: each file whole or not at all, and all of them or none: every file goes
// to a temporary file next to its target first, then they are renamed over their targets; an
// output that existed is kept as a hard link until every rename succeeded and put back when
// one fails. On failure every file that existed is as it was and no new file is left; the
// failure is reported. What the command printed on stdout is flushed first: a stdout that
// cannot be written fails the call before any file is committed.
bool clmha__cli_write_outputs(const char *cmd, const clmha__cli_out *out, size_t count);

// Whether clmha__cli_write_outputs() committed files (stdout flushed just before): the command
// has succeeded, and closing stdout at exit has nothing left to lose (main.c).
bool clmha__cli_outputs_committed(void);

#endif
