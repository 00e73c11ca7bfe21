// Attention-weight heatmaps as PNG images (libpng). Used by the `clmha` program and the tests;
// not part of the library's public API.
//
// The image shows one tile per head and, when there is more than one head, a tile of the head
// average ("mean"), in a grid of about square shape, under a title. Each tile is labelled
// ("head 0", ..., "mean") and has the axis hints "query" (rows, top to bottom, written upwards
// on its left) and "key" (columns, left to right, below it). A colour bar on the right maps
// 0 (bottom) to the largest weight shown (top) through a viridis-like colormap; NaN cells are
// grey. Text uses a built-in 5x7 bitmap font. Long sequences are averaged down so that a tile
// stays at most ~192 pixels on a side; short ones get cells of up to 64 pixels.
#ifndef CLMHA_HEATMAP_H
#define CLMHA_HEATMAP_H

#include <clmha.h>

// Where everything goes in the image (pixels, origin top left). Filled by clmha__heatmap_plan().
typedef struct clmha__heatmap_layout {
    size_t width, height;        // the image
    size_t tiles;                // heads, plus one for the mean when heads > 1
    size_t grid_cols, grid_rows; // tiles per grid row, rows of tiles
    size_t rows, cols;           // cells per tile: tgt_len and src_len, or fewer when averaged
    size_t cell_w, cell_h;       // pixels per cell
    size_t tile_w, tile_h;       // cols * cell_w, rows * cell_h
    size_t font_scale;           // 1 or 2: glyphs are 5x7 pixels times this
    size_t title_lines;          // lines of the title (it wraps to the width)
    size_t title_wrap;           // at most this many characters a title line
    size_t grid_x, grid_y;       // top left of the first grid slot
    size_t slot_w, slot_h;       // one tile with its label, axis hints and gaps
    size_t tile_dx, tile_dy;     // position of the tile inside its slot
    size_t bar_x, bar_y, bar_w, bar_h;  // the colour bar (top = largest value)
} clmha__heatmap_layout;

// Computes the layout for @p heads tiles of (tgt_len, src_len) weights.
// @return CLMHA_SUCCESS, CLMHA_INVALID_ARGUMENT (a size is 0, or too many heads to draw in one
//         image), CLMHA_SIZE_OVERFLOW (heads * tgt_len * src_len overflows)
clmha_status clmha__heatmap_plan(size_t heads, size_t tgt_len, size_t src_len,
                                 clmha__heatmap_layout *out, char *msg, size_t msg_size);

// Top left pixel of tile @p tile (0 .. tiles-1; the mean tile is the last).
void clmha__heatmap_tile_origin(const clmha__heatmap_layout *layout, size_t tile, size_t *x,
                                size_t *y);

// Colour of @p t in [0, 1] (clamped; NaN gives grey): 0 is dark purple, 1 is yellow.
void clmha__heatmap_color(double t, unsigned char rgb[3]);

// Writes the heatmap of @p weights, (heads, tgt_len, src_len) row-major for one batch item, to
// the PNG file @p path. The file appears whole or not at all (temporary file in the same folder,
// then rename).
// @return CLMHA_SUCCESS, CLMHA_INVALID_ARGUMENT, CLMHA_SIZE_OVERFLOW, CLMHA_OUT_OF_MEMORY,
//         CLMHA_IO_ERROR (with the path and the reason)
clmha_status clmha__heatmap_write(const char *path, const float *weights, size_t heads,
                                  size_t tgt_len, size_t src_len, char *msg, size_t msg_size);

// A new, empty regular file next to @p path (same folder, name ".clmha-heatmap-XXXXXX"), its
// name in @p out: where a heatmap is written before it is renamed over @p path, so that it
// can wait for other outputs (clmha run writes it with its .npy files).
// @return CLMHA_SUCCESS, CLMHA_INVALID_ARGUMENT (the name does not fit in @p out_size),
//         CLMHA_IO_ERROR (with the folder and the reason)
clmha_status clmha__heatmap_temp_path(const char *path, char *out, size_t out_size, char *msg,
                                      size_t msg_size);

#endif
