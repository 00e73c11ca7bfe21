// Attention heatmaps (src/cli/heatmap.c): the PNG is read back with libpng and checked against the
// layout (image size, cell positions, colours of known weights, the colour bar); bad paths and
// arguments are refused without leaving files behind.
#define _POSIX_C_SOURCE 200809L

#include <criterion/criterion.h>

#include "cli/heatmap.h"
#include "support.h"

#include <math.h>
#include <png.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MSG_SIZE 1024

// ---- helpers -------------------------------------------------------------------------------

typedef struct rgb_image {
    unsigned char *px;
    size_t w, h;
} rgb_image;

static rgb_image read_png(const char *path) {
    png_image png;
    memset(&png, 0, sizeof png);
    png.version = PNG_IMAGE_VERSION;
    cr_assert(png_image_begin_read_from_file(&png, path), "%s: %s", path, png.message);
    png.format = PNG_FORMAT_RGB;
    rgb_image im = {malloc(PNG_IMAGE_SIZE(png)), png.width, png.height};
    cr_assert_not_null(im.px);
    cr_assert(png_image_finish_read(&png, NULL, im.px, 0, NULL), "%s: %s", path, png.message);
    return im;
}

static void assert_pixel(const rgb_image *im, size_t x, size_t y, const unsigned char rgb[3],
                         const char *what) {
    cr_assert_lt(x, im->w);
    cr_assert_lt(y, im->h);
    const unsigned char *p = im->px + (y * im->w + x) * 3;
    cr_assert(p[0] == rgb[0] && p[1] == rgb[1] && p[2] == rgb[2],
              "%s at (%zu, %zu): (%u, %u, %u), expected (%u, %u, %u)", what, x, y, p[0], p[1],
              p[2], rgb[0], rgb[1], rgb[2]);
}

// Centre pixel of cell (r, c) of tile t.
static void cell_centre(const clmha__heatmap_layout *l, size_t t, size_t r, size_t c, size_t *x,
                        size_t *y) {
    clmha__heatmap_tile_origin(l, t, x, y);
    *x += c * l->cell_w + l->cell_w / 2;
    *y += r * l->cell_h + l->cell_h / 2;
}

static void assert_cell(const rgb_image *im, const clmha__heatmap_layout *l, size_t t, size_t r,
                        size_t c, double value) {
    unsigned char rgb[3];
    clmha__heatmap_color(value, rgb);
    size_t x, y;
    cell_centre(l, t, r, c, &x, &y);
    char what[64];
    snprintf(what, sizeof what, "tile %zu cell (%zu, %zu)", t, r, c);
    assert_pixel(im, x, y, rgb, what);
}

// ---- colormap ------------------------------------------------------------------------------

static const unsigned char bottom[3] = {70, 10, 90}, top[3] = {250, 230, 40};

Test(heatmap, colormap_ends_and_order) {
    unsigned char rgb[3], prev[3];
    clmha__heatmap_color(0.0, rgb);
    cr_assert(memcmp(rgb, bottom, 3) == 0);
    clmha__heatmap_color(1.0, rgb);
    cr_assert(memcmp(rgb, top, 3) == 0);
    clmha__heatmap_color(-5.0, rgb);
    cr_assert(memcmp(rgb, bottom, 3) == 0);
    clmha__heatmap_color(INFINITY, rgb);
    cr_assert(memcmp(rgb, top, 3) == 0);
    clmha__heatmap_color(NAN, rgb);
    cr_assert(rgb[0] == rgb[1] && rgb[1] == rgb[2], "NaN is grey");
    // luminance rises with the value
    clmha__heatmap_color(0.0, prev);
    for (int i = 1; i <= 100; ++i) {
        clmha__heatmap_color(i / 100.0, rgb);
        double l0 = 0.2126 * prev[0] + 0.7152 * prev[1] + 0.0722 * prev[2];
        double l1 = 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2];
        cr_assert_gt(l1, l0 - 0.5, "luminance drops at %d%%", i);
        memcpy(prev, rgb, 3);
    }
}

// ---- a small known input -------------------------------------------------------------------

enum { H = 2, L = 3, S = 4 };
static const float weights[H * L * S] = {
    // head 0
    1.0f, 0.0f, 0.0f, 0.0f,
    0.5f, 0.5f, 0.0f, 0.0f,
    0.25f, 0.25f, 0.25f, 0.25f,
    // head 1
    1.0f, 0.0f, 0.0f, 0.0f,
    0.0f, 0.0f, 0.0f, 1.0f,
    0.0f, 0.5f, 0.5f, 0.0f,
};

Test(heatmap, layout_of_two_heads) {
    clmha__heatmap_layout l;
    char msg[MSG_SIZE] = "";
    cr_assert_eq(clmha__heatmap_plan(H, L, S, &l, msg, sizeof msg), CLMHA_SUCCESS, "%s", msg);
    cr_assert_eq(l.tiles, 3);  // two heads and the mean
    cr_assert_eq(l.grid_cols, 2);
    cr_assert_eq(l.grid_rows, 2);
    cr_assert_eq(l.rows, L);
    cr_assert_eq(l.cols, S);
    cr_assert_eq(l.cell_h, 64);
    cr_assert_eq(l.cell_w, 48);
    cr_assert_eq(l.tile_w, 192);
    cr_assert_eq(l.tile_h, 192);
    cr_assert_eq(l.font_scale, 2);
    // tiles do not overlap and lie inside the image, left of the colour bar
    for (size_t t = 0; t < l.tiles; ++t) {
        size_t x, y;
        clmha__heatmap_tile_origin(&l, t, &x, &y);
        cr_assert_leq(x + l.tile_w, l.bar_x);
        cr_assert_leq(y + l.tile_h, l.height);
    }
    size_t x0, y0, x1, y1, x2, y2;
    clmha__heatmap_tile_origin(&l, 0, &x0, &y0);
    clmha__heatmap_tile_origin(&l, 1, &x1, &y1);
    clmha__heatmap_tile_origin(&l, 2, &x2, &y2);
    cr_assert_eq(y0, y1);
    cr_assert_geq(x1, x0 + l.tile_w);
    cr_assert_eq(x2, x0);
    cr_assert_geq(y2, y0 + l.tile_h);
    cr_assert_leq(l.bar_x + l.bar_w, l.width);
    cr_assert_leq(l.bar_y + l.bar_h, l.height);
}

Test(heatmap, pixels_match_the_weights) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-heatmap");
    snprintf(path, sizeof path, "%s/w.png", dir);
    cr_assert_eq(clmha__heatmap_write(path, weights, H, L, S, msg, sizeof msg), CLMHA_SUCCESS,
                 "%s", msg);
    cr_assert_eq(tmpdir_count(dir), 1, "a temporary file was left behind");
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(sb.st_mode & 0777, 0644);

    clmha__heatmap_layout l;
    cr_assert_eq(clmha__heatmap_plan(H, L, S, &l, msg, sizeof msg), CLMHA_SUCCESS);
    rgb_image im = read_png(path);
    cr_assert_eq(im.w, l.width);
    cr_assert_eq(im.h, l.height);

    // weight 1.0 (the largest) is the top colour, 0.0 the bottom one
    size_t x, y;
    cell_centre(&l, 0, 0, 0, &x, &y);
    assert_pixel(&im, x, y, top, "head 0 weight 1.0");
    cell_centre(&l, 0, 0, 1, &x, &y);
    assert_pixel(&im, x, y, bottom, "head 0 weight 0.0");
    cell_centre(&l, 1, 1, 3, &x, &y);
    assert_pixel(&im, x, y, top, "head 1 weight 1.0");
    cell_centre(&l, 2, 0, 0, &x, &y);
    assert_pixel(&im, x, y, top, "mean weight 1.0");
    // every cell of the heads and of the mean
    for (size_t r = 0; r < L; ++r)
        for (size_t c = 0; c < S; ++c) {
            double mean = 0.0;
            for (size_t h = 0; h < H; ++h) {
                assert_cell(&im, &l, h, r, c, weights[(h * L + r) * S + c]);
                mean += weights[(h * L + r) * S + c];
            }
            assert_cell(&im, &l, 2, r, c, mean / H);
        }
    // the cells fill their tile: the corners of cell (0, 0) and (L-1, S-1) of head 0
    size_t tx, ty;
    clmha__heatmap_tile_origin(&l, 0, &tx, &ty);
    assert_pixel(&im, tx, ty, top, "tile corner");
    assert_pixel(&im, tx + l.cell_w - 1, ty + l.cell_h - 1, top, "cell corner");
    unsigned char quarter[3];
    clmha__heatmap_color(0.25, quarter);
    assert_pixel(&im, tx + l.tile_w - 1, ty + l.tile_h - 1, quarter, "last cell corner");
    // the colour bar: top colour at the top, bottom colour at the bottom
    assert_pixel(&im, l.bar_x + l.bar_w / 2, l.bar_y, top, "bar top");
    assert_pixel(&im, l.bar_x + l.bar_w / 2, l.bar_y + l.bar_h - 1, bottom, "bar bottom");
    // the corner of the image is background
    const unsigned char white[3] = {255, 255, 255};
    assert_pixel(&im, 0, 0, white, "background");
    assert_pixel(&im, im.w - 1, im.h - 1, white, "background");
    free(im.px);
    tmpdir_remove(dir);
}

// The scale runs to the largest weight: a head whose largest weight is 0.2 still reaches the top
// colour. NaN cells are grey. One head: no mean tile.
Test(heatmap, scale_to_the_largest_weight_and_nan) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-heatmap");
    snprintf(path, sizeof path, "%s/s.png", dir);
    const float w[2 * 2] = {0.2f, 0.1f, 0.0f, NAN};
    cr_assert_eq(clmha__heatmap_write(path, w, 1, 2, 2, msg, sizeof msg), CLMHA_SUCCESS, "%s",
                 msg);
    clmha__heatmap_layout l;
    cr_assert_eq(clmha__heatmap_plan(1, 2, 2, &l, msg, sizeof msg), CLMHA_SUCCESS);
    cr_assert_eq(l.tiles, 1);
    rgb_image im = read_png(path);
    cr_assert_eq(im.w, l.width);
    cr_assert_eq(im.h, l.height);
    assert_cell(&im, &l, 0, 0, 0, 1.0);
    assert_cell(&im, &l, 0, 0, 1, 0.5);
    assert_cell(&im, &l, 0, 1, 0, 0.0);
    assert_cell(&im, &l, 0, 1, 1, NAN);
    free(im.px);
    tmpdir_remove(dir);
}

// Long sequences are averaged down to at most 192 cells a side.
Test(heatmap, long_sequences_are_averaged) {
    enum { LL = 1000, SS = 300 };
    float *w = calloc((size_t)LL * SS, sizeof *w);
    cr_assert_not_null(w);
    for (size_t i = 0; i < LL / 2; ++i)
        for (size_t j = 0; j < SS; ++j) w[i * SS + j] = 0.01f;  // top half: 0.01
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-heatmap");
    snprintf(path, sizeof path, "%s/long.png", dir);
    cr_assert_eq(clmha__heatmap_write(path, w, 1, LL, SS, msg, sizeof msg), CLMHA_SUCCESS, "%s",
                 msg);
    clmha__heatmap_layout l;
    cr_assert_eq(clmha__heatmap_plan(1, LL, SS, &l, msg, sizeof msg), CLMHA_SUCCESS);
    cr_assert_eq(l.rows, 192);
    cr_assert_eq(l.cols, 192);
    cr_assert_eq(l.cell_w, 1);
    cr_assert_eq(l.cell_h, 1);
    rgb_image im = read_png(path);
    cr_assert_eq(im.w, l.width);
    cr_assert_eq(im.h, l.height);
    assert_cell(&im, &l, 0, 0, 0, 1.0);
    assert_cell(&im, &l, 0, 0, 191, 1.0);
    assert_cell(&im, &l, 0, 191, 0, 0.0);
    free(im.px);
    free(w);
    tmpdir_remove(dir);
}

Test(heatmap, many_heads_stay_bounded) {
    clmha__heatmap_layout l;
    char msg[MSG_SIZE] = "";
    cr_assert_eq(clmha__heatmap_plan(64, 512, 512, &l, msg, sizeof msg), CLMHA_SUCCESS);
    cr_assert_eq(l.tiles, 65);
    cr_assert_leq(l.width, 4400);
    cr_assert_leq(l.height, 4400);
    cr_assert_geq(l.tile_w, 32);
    cr_assert_eq(clmha__heatmap_plan(100001, 1, 1, &l, msg, sizeof msg), CLMHA_INVALID_ARGUMENT);
    cr_assert(strstr(msg, "too many"), "%s", msg);
    cr_assert_eq(clmha__heatmap_plan(20000, 1, 1, &l, msg, sizeof msg), CLMHA_INVALID_ARGUMENT);
    cr_assert(strstr(msg, "too many"), "%s", msg);
}

// ---- failures ------------------------------------------------------------------------------

Test(heatmap, missing_folder_is_io_error_and_leaves_nothing) {
    char dir[64], path[160], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-heatmap");
    snprintf(path, sizeof path, "%s/no/such/folder/w.png", dir);
    cr_assert_eq(clmha__heatmap_write(path, weights, H, L, S, msg, sizeof msg), CLMHA_IO_ERROR);
    cr_assert(strstr(msg, "no/such/folder/w.png"), "%s", msg);
    cr_assert(strstr(msg, "No such file or directory"), "%s", msg);
    cr_assert_eq(access(path, F_OK), -1);
    cr_assert_eq(tmpdir_count(dir), 0);
    tmpdir_remove(dir);
}

Test(heatmap, failed_rename_removes_the_temporary_file) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-heatmap");
    snprintf(path, sizeof path, "%s/w.png", dir);
    cr_assert_eq(mkdir(path, 0755), 0);  // the target is a folder
    cr_assert_eq(clmha__heatmap_write(path, weights, H, L, S, msg, sizeof msg), CLMHA_IO_ERROR);
    cr_assert(strstr(msg, "w.png"), "%s", msg);
    cr_assert_eq(tmpdir_count(dir), 1, "the temporary file was left behind");
    tmpdir_remove(dir);
}

Test(heatmap, bad_arguments) {
    char msg[MSG_SIZE] = "";
    const char *path = "/tmp/clmha_heatmap_never.png";
    cr_assert_eq(clmha__heatmap_write(path, weights, 0, L, S, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert(strstr(msg, "must be positive"), "%s", msg);
    cr_assert_eq(clmha__heatmap_write(path, weights, H, 0, S, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha__heatmap_write(path, weights, H, L, 0, NULL, 0), CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha__heatmap_write(path, NULL, H, L, S, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha__heatmap_write(NULL, weights, H, L, S, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha__heatmap_write(path, weights, 2, SIZE_MAX / 2, 3, msg, sizeof msg),
                 CLMHA_SIZE_OVERFLOW);
    cr_assert(strstr(msg, "overflow"), "%s", msg);
    cr_assert_eq(access(path, F_OK), -1);
    cr_assert_eq(clmha__heatmap_plan(1, 1, 1, NULL, msg, sizeof msg), CLMHA_INVALID_ARGUMENT);
}
