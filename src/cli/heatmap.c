// Attention-weight heatmaps as PNG images: layout, a 5x7 bitmap font, a viridis-like colormap,
// block averaging for long sequences, and an all-or-nothing PNG write (libpng's png_image API).
#define _POSIX_C_SOURCE 200809L

#include "heatmap.h"

#include "base/file_write.h"
#include "base/message.h"

#include <errno.h>
#include <math.h>
#include <png.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
    TILE_TARGET = 192,     // largest tile side, pixels
    TILE_MIN_TARGET = 32,  // smallest tile budget when there are very many heads
    CELL_MAX = 64,         // largest cell side, pixels
    GRID_BUDGET = 4096,    // the grid of tiles should fit in about this width
    SLOT_EXTRA = 40,       // gutters and gaps around a tile, roughly, at font scale 2
    MAX_SIDE = 16384,      // largest image side
    MAX_HEADS = 100000,
    LABEL_CHARS = 8,       // room kept for the colour bar labels ("1.8e+308")
};
#define MAX_PIXELS ((size_t)32 << 20)

// ---- font ----------------------------------------------------------------------------------

// 5x7 glyphs, drawn by hand: lower-case letters (descenders folded into the 7 rows), digits and
// the punctuation the labels use. Unknown characters are left blank.
typedef struct glyph {
    char c;
    const char *rows[7];
} glyph;

static const glyph font[] = {
    {'0', {" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "}},
    {'1', {"  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
    {'2', {" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"}},
    {'3', {"#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "}},
    {'4', {"   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "}},
    {'5', {"#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "}},
    {'6', {"  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "}},
    {'7', {"#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "}},
    {'8', {" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "}},
    {'9', {" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "}},
    {'a', {"     ", "     ", " ### ", "    #", " ####", "#   #", " ####"}},
    {'b', {"#    ", "#    ", "#### ", "#   #", "#   #", "#   #", "#### "}},
    {'c', {"     ", "     ", " ### ", "#    ", "#    ", "#   #", " ### "}},
    {'d', {"    #", "    #", " ####", "#   #", "#   #", "#   #", " ####"}},
    {'e', {"     ", "     ", " ### ", "#   #", "#####", "#    ", " ### "}},
    {'f', {"  ## ", " #  #", " #   ", "###  ", " #   ", " #   ", " #   "}},
    {'g', {"     ", "     ", " ####", "#   #", " ####", "    #", " ### "}},
    {'h', {"#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#   #"}},
    {'i', {"  #  ", "     ", " ##  ", "  #  ", "  #  ", "  #  ", " ### "}},
    {'j', {"   # ", "     ", "  ## ", "   # ", "   # ", "#  # ", " ##  "}},
    {'k', {"#    ", "#    ", "#  # ", "# #  ", "##   ", "# #  ", "#  # "}},
    {'l', {" ##  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
    {'m', {"     ", "     ", "## # ", "# # #", "# # #", "#   #", "#   #"}},
    {'n', {"     ", "     ", "# ## ", "##  #", "#   #", "#   #", "#   #"}},
    {'o', {"     ", "     ", " ### ", "#   #", "#   #", "#   #", " ### "}},
    {'p', {"     ", "     ", "#### ", "#   #", "#### ", "#    ", "#    "}},
    {'q', {"     ", "     ", " ####", "#   #", " ####", "    #", "    #"}},
    {'r', {"     ", "     ", "# ## ", "##  #", "#    ", "#    ", "#    "}},
    {'s', {"     ", "     ", " ####", "#    ", " ### ", "    #", "#### "}},
    {'t', {" #   ", " #   ", "###  ", " #   ", " #   ", " #  #", "  ## "}},
    {'u', {"     ", "     ", "#   #", "#   #", "#   #", "#  ##", " ## #"}},
    {'v', {"     ", "     ", "#   #", "#   #", "#   #", " # # ", "  #  "}},
    {'w', {"     ", "     ", "#   #", "#   #", "# # #", "# # #", " # # "}},
    {'x', {"     ", "     ", "#   #", " # # ", "  #  ", " # # ", "#   #"}},
    {'y', {"     ", "     ", "#   #", "#   #", " ####", "    #", " ### "}},
    {'z', {"     ", "     ", "#####", "   # ", "  #  ", " #   ", "#####"}},
    {'.', {"     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "}},
    {',', {"     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "}},
    {':', {"     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "}},
    {'-', {"     ", "     ", "     ", " ### ", "     ", "     ", "     "}},
    {'+', {"     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "}},
    {'(', {"   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "}},
    {')', {" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "}},
};

static const glyph *find_glyph(char c) {
    for (size_t i = 0; i < sizeof font / sizeof font[0]; ++i)
        if (font[i].c == c) return &font[i];
    return NULL;  // space and anything unknown
}

// Width in pixels of @p n characters at @p scale (6-pixel advance, no gap after the last).
static size_t text_width(size_t n, size_t scale) { return n ? (n * 6 - 1) * scale : 0; }

// ---- colormap ------------------------------------------------------------------------------

// Hand-picked control points of a perceptually ordered ramp (dark purple, blue, teal, green,
// yellow) whose luminance rises steadily; evenly spaced, interpolated linearly.
static const unsigned char ramp[6][3] = {
    {70, 10, 90}, {65, 70, 135}, {45, 115, 140}, {35, 160, 130}, {115, 200, 85}, {250, 230, 40},
};
static const unsigned char nan_grey[3] = {128, 128, 128};

void clmha__heatmap_color(double t, unsigned char rgb[3]) {
    if (isnan(t)) {
        memcpy(rgb, nan_grey, 3);
        return;
    }
    if (!(t > 0.0)) t = 0.0;
    if (t > 1.0) t = 1.0;
    double pos = t * 5.0;
    size_t i = (size_t)pos;
    if (i >= 5) i = 4;
    double frac = pos - (double)i;
    for (int k = 0; k < 3; ++k) {
        double v = ramp[i][k] + (ramp[i + 1][k] - ramp[i][k]) * frac;
        rgb[k] = (unsigned char)lround(v);
    }
}

// ---- layout --------------------------------------------------------------------------------

static size_t clamp_size(size_t v, size_t lo, size_t hi) { return v < lo ? lo : v > hi ? hi : v; }

enum { TITLE_LINES = 3, TITLE_CHARS = 160 };

// The title's parts "attention weights: 2 heads", "3 queries x 4 keys" and, when averaged,
// "averaged to R x C", joined with ", " on as few lines of at most @p wrap characters as hold
// them (a part longer than that gets a line of its own). Returns the number of lines.
static size_t title_lines(char lines[TITLE_LINES][TITLE_CHARS], size_t wrap, size_t heads,
                          size_t tgt_len, size_t src_len, size_t rows, size_t cols) {
    char parts[TITLE_LINES][TITLE_CHARS];
    size_t n = 2, count = 0;
    snprintf(parts[0], TITLE_CHARS, "attention weights: %zu head%s", heads, heads == 1 ? "" : "s");
    snprintf(parts[1], TITLE_CHARS, "%zu quer%s x %zu key%s", tgt_len, tgt_len == 1 ? "y" : "ies",
             src_len, src_len == 1 ? "" : "s");
    if (rows < tgt_len || cols < src_len)
        snprintf(parts[n++], TITLE_CHARS, "averaged to %zu x %zu", rows, cols);
    for (size_t i = 0; i < n; ++i) {
        size_t used = count ? strlen(lines[count - 1]) : 0;
        if (count && used + 2 + strlen(parts[i]) <= wrap) {
            snprintf(lines[count - 1] + used, TITLE_CHARS - used, ", %s", parts[i]);
        } else {
            if (count) snprintf(lines[count - 1] + used, TITLE_CHARS - used, ",");
            snprintf(lines[count++], TITLE_CHARS, "%s", parts[i]);
        }
    }
    return count;
}

clmha_status clmha__heatmap_plan(size_t heads, size_t tgt_len, size_t src_len,
                                 clmha__heatmap_layout *out, char *msg, size_t msg_size) {
    if (!out) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "heatmap: layout is NULL");
    memset(out, 0, sizeof *out);
    if (heads == 0 || tgt_len == 0 || src_len == 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "heatmap: heads (%zu), tgt_len (%zu) and src_len (%zu) must be positive",
                          heads, tgt_len, src_len);
    if (tgt_len > SIZE_MAX / src_len || heads > SIZE_MAX / (tgt_len * src_len))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                          "heatmap: %zu x %zu x %zu weights overflow", heads, tgt_len, src_len);
    if (heads > MAX_HEADS)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "heatmap: %zu heads are too many to draw in one image", heads);
    clmha__heatmap_layout l;
    memset(&l, 0, sizeof l);
    l.tiles = heads > 1 ? heads + 1 : 1;
    l.grid_cols = 1;
    while (l.grid_cols * l.grid_cols < l.tiles) ++l.grid_cols;
    l.grid_rows = (l.tiles + l.grid_cols - 1) / l.grid_cols;

    size_t target = GRID_BUDGET / l.grid_cols;
    target = clamp_size(target > SLOT_EXTRA ? target - SLOT_EXTRA : 0, TILE_MIN_TARGET,
                        TILE_TARGET);
    size_t s = target >= 128 ? 2 : 1;
    l.font_scale = s;
    l.rows = tgt_len < target ? tgt_len : target;
    l.cols = src_len < target ? src_len : target;
    l.cell_h = clamp_size(target / l.rows, 1, CELL_MAX);
    l.cell_w = clamp_size(target / l.cols, 1, CELL_MAX);
    l.tile_h = l.rows * l.cell_h;
    l.tile_w = l.cols * l.cell_w;

    size_t glyph_h = 7 * s, pad = 4 * s, margin = 6 * s;
    l.tile_dx = glyph_h + 2 * pad;  // "query", written upwards
    l.tile_dy = glyph_h + pad;      // "head N"
    l.slot_w = l.tile_dx + l.tile_w + 2 * pad;
    l.slot_h = l.tile_dy + l.tile_h + pad + glyph_h + 2 * pad;  // "key" below, then a gap
    l.grid_x = margin;
    l.bar_x = l.grid_x + l.grid_cols * l.slot_w + pad;
    l.bar_w = 4 * pad;
    l.bar_h = l.tile_h > 64 ? l.tile_h : 64;
    l.width = l.bar_x + l.bar_w + pad + text_width(LABEL_CHARS, s) + margin;

    // the title wraps to the width; a very long part widens the image
    char lines[TITLE_LINES][TITLE_CHARS];
    l.title_wrap = ((l.width - 2 * margin) / s + 1) / 6;
    l.title_lines = title_lines(lines, l.title_wrap, heads, tgt_len, src_len, l.rows, l.cols);
    for (size_t i = 0; i < l.title_lines; ++i) {
        size_t w = 2 * margin + text_width(strlen(lines[i]), s);
        if (w > l.width) l.width = w;
    }
    l.grid_y = margin + l.title_lines * (glyph_h + 3 * s) + pad;
    l.bar_y = l.grid_y + l.tile_dy;
    size_t grid_bottom = l.grid_y + l.grid_rows * l.slot_h;
    size_t bar_bottom = l.bar_y + l.bar_h + pad;
    l.height = (grid_bottom > bar_bottom ? grid_bottom : bar_bottom) + margin;

    if (l.width > MAX_SIDE || l.height > MAX_SIDE || l.width * l.height > MAX_PIXELS)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "heatmap: %zu heads are too many to draw in one image (%zu x %zu pixels)",
                          heads, l.width, l.height);
    *out = l;
    return CLMHA_SUCCESS;
}

void clmha__heatmap_tile_origin(const clmha__heatmap_layout *l, size_t tile, size_t *x,
                                size_t *y) {
    size_t col = l->grid_cols ? tile % l->grid_cols : 0;
    size_t row = l->grid_cols ? tile / l->grid_cols : 0;
    *x = l->grid_x + col * l->slot_w + l->tile_dx;
    *y = l->grid_y + row * l->slot_h + l->tile_dy;
}

// ---- drawing -------------------------------------------------------------------------------

typedef struct image {
    unsigned char *px;  // RGB, row-major
    size_t w, h;
} image;

static const unsigned char ink[3] = {30, 30, 30};
static const unsigned char hint_ink[3] = {110, 110, 110};
static const unsigned char frame[3] = {190, 190, 190};

static void fill_rect(image *im, size_t x, size_t y, size_t w, size_t h,
                      const unsigned char rgb[3]) {
    if (x >= im->w || y >= im->h) return;
    if (w > im->w - x) w = im->w - x;
    if (h > im->h - y) h = im->h - y;
    for (size_t r = y; r < y + h; ++r)
        for (size_t c = x; c < x + w; ++c) memcpy(im->px + (r * im->w + c) * 3, rgb, 3);
}

// Text with its top left corner at (x, y).
static void draw_text(image *im, size_t x, size_t y, size_t s, const char *text,
                      const unsigned char rgb[3]) {
    for (size_t i = 0; text[i]; ++i) {
        const glyph *g = find_glyph(text[i]);
        if (!g) continue;
        for (size_t r = 0; r < 7; ++r)
            for (size_t c = 0; c < 5; ++c)
                if (g->rows[r][c] == '#') fill_rect(im, x + (i * 6 + c) * s, y + r * s, s, s, rgb);
    }
}

// Text turned a quarter turn anticlockwise (read bottom to top): its first character's bottom
// left corner, as seen when reading, is at (x + glyph height, y_bottom); the glyphs' tops face
// left.
static void draw_text_up(image *im, size_t x, size_t y_bottom, size_t s, const char *text,
                         const unsigned char rgb[3]) {
    if (y_bottom < text_width(strlen(text), s)) return;
    for (size_t i = 0; text[i]; ++i) {
        const glyph *g = find_glyph(text[i]);
        if (!g) continue;
        for (size_t r = 0; r < 7; ++r)
            for (size_t c = 0; c < 5; ++c)
                if (g->rows[r][c] == '#')
                    fill_rect(im, x + r * s, y_bottom - (i * 6 + c + 1) * s, s, s, rgb);
    }
}

// First row (or column) of block @p i of @p bins blocks over @p n elements (bins <= n): blocks
// are contiguous, non-empty and cover everything; no product exceeds n or bins * bins.
static size_t block_start(size_t i, size_t n, size_t bins) {
    return i * (n / bins) + i * (n % bins) / bins;
}

// grid (rows, cols) = block averages of w (tgt_len, src_len).
static void average_blocks(const float *w, size_t tgt_len, size_t src_len, size_t rows,
                           size_t cols, float *grid) {
    for (size_t r = 0; r < rows; ++r) {
        size_t r0 = block_start(r, tgt_len, rows), r1 = block_start(r + 1, tgt_len, rows);
        for (size_t c = 0; c < cols; ++c) {
            size_t c0 = block_start(c, src_len, cols), c1 = block_start(c + 1, src_len, cols);
            double sum = 0.0;
            for (size_t i = r0; i < r1; ++i)
                for (size_t j = c0; j < c1; ++j) sum += (double)w[i * src_len + j];
            grid[r * cols + c] = (float)(sum / ((double)(r1 - r0) * (double)(c1 - c0)));
        }
    }
}

static void draw_tile(image *im, const clmha__heatmap_layout *l, size_t tile, const char *label,
                      const float *grid, double top) {
    size_t x, y, s = l->font_scale;
    clmha__heatmap_tile_origin(l, tile, &x, &y);
    fill_rect(im, x - 1, y - 1, l->tile_w + 2, l->tile_h + 2, frame);
    for (size_t r = 0; r < l->rows; ++r)
        for (size_t c = 0; c < l->cols; ++c) {
            unsigned char rgb[3];
            clmha__heatmap_color((double)grid[r * l->cols + c] / top, rgb);
            fill_rect(im, x + c * l->cell_w, y + r * l->cell_h, l->cell_w, l->cell_h, rgb);
        }
    draw_text(im, x, y - l->tile_dy, s, label, ink);
    size_t key_w = text_width(3, s), query_w = text_width(5, s);
    if (l->tile_w >= key_w)
        draw_text(im, x + (l->tile_w - key_w) / 2, y + l->tile_h + 4 * s, s, "key", hint_ink);
    if (l->tile_h >= query_w)
        draw_text_up(im, x - 4 * s - 7 * s, y + (l->tile_h + query_w) / 2, s, "query", hint_ink);
}

// The colour bar's end labels: 0 and the top of the scale, in the same format.
static void scale_labels(double top, char *lo, char *hi, size_t size) {
    if (top >= 0.1 && top < 1000.0) {
        snprintf(lo, size, "0.00");
        snprintf(hi, size, "%.2f", top);
    } else {
        snprintf(lo, size, "0");
        snprintf(hi, size, "%.2g", top);
    }
}

// ---- writing -------------------------------------------------------------------------------

// Writes image @p user (an image) to @p f as an RGB PNG.
static bool write_png(FILE *f, void *user, char *why, size_t why_size) {
    const image *im = user;
    png_image png;
    memset(&png, 0, sizeof png);
    png.version = PNG_IMAGE_VERSION;
    png.width = (png_uint_32)im->w;
    png.height = (png_uint_32)im->h;
    png.format = PNG_FORMAT_RGB;
    bool ok = png_image_write_to_stdio(&png, f, 0, im->px, 0, NULL) != 0;
    if (!ok) snprintf(why, why_size, "%s", png.message);
    png_image_free(&png);
    return ok;
}

clmha_status clmha__heatmap_write(const char *path, const float *weights, size_t heads,
                                  size_t tgt_len, size_t src_len, char *msg, size_t msg_size) {
    clmha_status st;
    image im = {NULL, 0, 0};
    float *grid = NULL;
    double *mean = NULL;
    if (!path || !weights)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "heatmap: path or weights is NULL");
    clmha__heatmap_layout l;
    if ((st = clmha__heatmap_plan(heads, tgt_len, src_len, &l, msg, msg_size))) return st;

    // the plan caps width * height, and rows, cols <= TILE_TARGET: no product overflows
    size_t cells = l.rows * l.cols, per_head = tgt_len * src_len;
    im.w = l.width;
    im.h = l.height;
    im.px = malloc(im.w * im.h * 3);
    grid = malloc(cells * sizeof *grid);
    mean = calloc(cells, sizeof *mean);
    if (!im.px || !grid || !mean) {
        st = clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY,
                        "heatmap: out of memory for a %zu x %zu image for '%s'", im.w, im.h, path);
        goto fail;
    }
    memset(im.px, 255, im.w * im.h * 3);

    // The scale runs from 0 to the largest value shown (the mean never exceeds it).
    double top = 0.0;
    for (size_t h = 0; h < heads; ++h) {
        average_blocks(weights + h * per_head, tgt_len, src_len, l.rows, l.cols, grid);
        for (size_t i = 0; i < cells; ++i)
            if (isfinite(grid[i]) && grid[i] > top) top = grid[i];
    }
    if (!(top > 0.0)) top = 1.0;

    char label[32];
    for (size_t h = 0; h < heads; ++h) {
        average_blocks(weights + h * per_head, tgt_len, src_len, l.rows, l.cols, grid);
        for (size_t i = 0; i < cells; ++i) mean[i] += grid[i];
        snprintf(label, sizeof label, "head %zu", h);
        draw_tile(&im, &l, h, label, grid, top);
    }
    if (heads > 1) {
        for (size_t i = 0; i < cells; ++i) grid[i] = (float)(mean[i] / (double)heads);
        draw_tile(&im, &l, heads, "mean", grid, top);
    }

    char lines[TITLE_LINES][TITLE_CHARS];
    size_t s = l.font_scale;
    title_lines(lines, l.title_wrap, heads, tgt_len, src_len, l.rows, l.cols);
    for (size_t i = 0; i < l.title_lines; ++i)
        draw_text(&im, 6 * s, 6 * s + i * 10 * s, s, lines[i], ink);

    fill_rect(&im, l.bar_x - 1, l.bar_y - 1, l.bar_w + 2, l.bar_h + 2, frame);
    for (size_t r = 0; r < l.bar_h; ++r) {
        unsigned char rgb[3];
        clmha__heatmap_color(l.bar_h > 1 ? 1.0 - (double)r / (double)(l.bar_h - 1) : 1.0, rgb);
        fill_rect(&im, l.bar_x, l.bar_y + r, l.bar_w, 1, rgb);
    }
    char lo[32], hi[32];
    scale_labels(top, lo, hi, sizeof lo);
    size_t label_x = l.bar_x + l.bar_w + 4 * s;
    draw_text(&im, label_x, l.bar_y, s, hi, ink);
    draw_text(&im, label_x, l.bar_y + l.bar_h - 7 * s, s, lo, ink);

    // All or nothing: a temporary file next to the target, renamed over it when complete.
    st = clmha__file_write_whole(path, write_png, &im, msg, msg_size);
fail:
    free(im.px);
    free(grid);
    free(mean);
    return st;
}

clmha_status clmha__heatmap_temp_path(const char *path, char *out, size_t out_size, char *msg,
                                      size_t msg_size) {
    if (out_size) out[0] = '\0';
    const char *slash = path ? strrchr(path, '/') : NULL;
    int dir_len = slash ? (int)(slash - path) + 1 : 0;  // with its '/'
    int n = path ? snprintf(out, out_size, "%.*s.clmha-heatmap-XXXXXX", dir_len, path) : -1;
    if (n < 0 || (size_t)n >= out_size) {
        if (out_size) out[0] = '\0';
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "heatmap: no room for a temporary file name next to the target");
    }
    int fd = mkstemp(out);
    if (fd < 0) {
        int err = errno;
        out[0] = '\0';
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR,
                          "cannot create a temporary file in its folder: %s", strerror(err));
    }
    // The mode the PNG takes (clmha__file_write_whole keeps the mode of the file it replaces):
    // the target's when it exists, else rw-r--r--, as for a file written in place.
    struct stat sb;
    fchmod(fd, stat(path, &sb) == 0 && S_ISREG(sb.st_mode) ? sb.st_mode & 07777 : 0644);
    close(fd);
    return CLMHA_SUCCESS;
}
