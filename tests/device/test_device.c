#define _POSIX_C_SOURCE 200809L
// Device enumeration and selection by spec string; contexts from the environment.
#include <criterion/criterion.h>

#include <clmha.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static clmha_device_info *list_all(size_t *count) {
    cr_assert_eq(clmha_device_count(count), CLMHA_SUCCESS);
    if (*count == 0) return NULL;
    clmha_device_info *all = calloc(*count, sizeof *all);
    cr_assert_not_null(all);
    for (size_t i = 0; i < *count; ++i) {
        all[i].struct_size = sizeof all[i];
        cr_assert_eq(clmha_device_describe(i, &all[i]), CLMHA_SUCCESS, "%s",
                     clmha_last_create_error());
    }
    return all;
}

Test(device, every_listed_device_is_selected_by_its_spec) {
    size_t count;
    clmha_device_info *all = list_all(&count);
    if (!count) cr_skip_test("no OpenCL device");
    for (size_t i = 0; i < count; ++i) {
        clmha_device_info got = {.struct_size = sizeof got};
        char msg[256];
        cr_assert_eq(clmha_device_select(all[i].spec, &got, msg, sizeof msg), CLMHA_SUCCESS,
                     "%s", msg);
        cr_assert_eq(got.device, all[i].device);
        cr_assert_str_eq(got.spec, all[i].spec);
        cr_assert_gt(got.compute_units, 0);
        cr_assert_gt(got.max_alloc_bytes, 0);
        cr_assert_gt(strlen(got.device_name), 0);
    }
    free(all);
}

Test(device, default_is_first_gpu_else_first_device) {
    size_t count;
    clmha_device_info *all = list_all(&count);
    if (!count) cr_skip_test("no OpenCL device");
    cl_device_id want = all[0].device;
    for (size_t i = count; i-- > 0;)
        if (all[i].type & CL_DEVICE_TYPE_GPU) want = all[i].device;
    clmha_device_info got = {.struct_size = sizeof got};
    cr_assert_eq(clmha_device_select(NULL, &got, NULL, 0), CLMHA_SUCCESS);
    cr_assert_eq(got.device, want);
    cr_assert_eq(clmha_device_select("", &got, NULL, 0), CLMHA_SUCCESS);
    cr_assert_eq(got.device, want);
    free(all);
}

static bool contains_nocase(const char *hay, const char *needle) {
    for (; *hay; ++hay) {
        size_t i = 0;
        while (needle[i] && tolower((unsigned char)hay[i]) == tolower((unsigned char)needle[i]))
            ++i;
        if (!needle[i]) return true;
    }
    return false;
}

Test(device, type_names_and_name_substrings) {
    size_t count;
    clmha_device_info *all = list_all(&count);
    if (!count) cr_skip_test("no OpenCL device");
    const char *types[] = {"gpu", "CPU", "Accelerator"};
    cl_device_type bits[] = {CL_DEVICE_TYPE_GPU, CL_DEVICE_TYPE_CPU, CL_DEVICE_TYPE_ACCELERATOR};
    for (int t = 0; t < 3; ++t) {
        long first = -1;
        for (size_t i = 0; i < count && first < 0; ++i)
            if (all[i].type & bits[t]) first = (long)i;
        clmha_device_info got = {.struct_size = sizeof got};
        char msg[512];
        clmha_status st = clmha_device_select(types[t], &got, msg, sizeof msg);
        if (first < 0) {
            cr_assert_eq(st, CLMHA_DEVICE_NOT_FOUND);
            cr_assert(strstr(msg, types[t]) != NULL, "%s", msg);
        } else {
            cr_assert_eq(st, CLMHA_SUCCESS);
            cr_assert_eq(got.device, all[first].device);
        }
    }
    // A name part in another case selects the first device whose name contains it.
    char part[8] = {0};
    for (int i = 0; i < 4 && all[0].device_name[i + 1]; ++i)
        part[i] = (char)toupper((unsigned char)all[0].device_name[i + 1]);
    long want = -1;
    for (size_t i = 0; i < count && want < 0; ++i)
        if (contains_nocase(all[i].platform_name, part) || contains_nocase(all[i].device_name, part))
            want = (long)i;
    cr_assert_geq(want, 0);
    clmha_device_info got = {.struct_size = sizeof got};
    cr_assert_eq(clmha_device_select(part, &got, NULL, 0), CLMHA_SUCCESS, "%s", part);
    cr_assert_eq(got.device, all[want].device, "\"%s\" picked %s", part, got.device_name);
    free(all);
}

Test(device, context_from_env_follows_clmha_device) {
    size_t count;
    clmha_device_info *all = list_all(&count);
    if (!count) cr_skip_test("no OpenCL device");
    const char *saved = getenv("CLMHA_DEVICE");
    char *keep = saved ? strdup(saved) : NULL;
    setenv("CLMHA_DEVICE", all[count - 1].spec, 1);
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS, "%s",
                 clmha_last_create_error());
    cr_assert_eq(clmha_context_cl_device(ctx), all[count - 1].device);
    cr_assert(strstr(clmha_context_device_name(ctx), all[count - 1].device_name) != NULL);
    clmha_context_release(ctx);
    setenv("CLMHA_DEVICE", "no-such-device-anywhere", 1);
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_DEVICE_NOT_FOUND);
    cr_assert_null(ctx);
    cr_assert(strstr(clmha_last_create_error(), "no-such-device-anywhere") != NULL);
    if (keep) setenv("CLMHA_DEVICE", keep, 1);
    else unsetenv("CLMHA_DEVICE");
    free(keep);
    free(all);
}

// A spec that starts like "P:D" (digits, signs or spaces, then a colon) is an index pair and
// must be exactly two decimal numbers that fit an unsigned int: anything else is refused with
// CLMHA_INVALID_ARGUMENT and a message naming the spec, before any device is looked at (so
// these hold without a device too). It used to be read by sscanf("%u:%u"), which wraps
// 4294967296 and -4294967296 to 0 and so picked device 0:0.
Test(device, malformed_index_specs_are_refused) {
    static const struct {
        const char *spec;
        const char *why;
    } bad[] = {
        {"4294967296:0", "platform index 4294967296 is larger than 4294967295"},
        {"0:4294967296", "device index 4294967296 is larger than 4294967295"},
        {"-4294967296:0", "platform index is not a decimal number"},
        {"-1:0", "platform index is not a decimal number"},
        {"0:-1", "device index is not a decimal number"},
        {"+0:0", "platform index is not a decimal number"},
        {"18446744073709551617:0", "is larger than 4294967295"},
        {"99999999999999999999999999:0", "is larger than 4294967295"},
        {"0:0x", "device index is not a decimal number"},
        {"0:0 ", "device index is not a decimal number"},
        {" 0:0", "platform index is not a decimal number"},
        {"0 :0", "platform index is not a decimal number"},
        {"0:0:0", "device index is not a decimal number"},
        {"0:", "device index is empty"},
        {":0", "platform index is empty"},
        {":", "platform index is empty"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; ++i) {
        clmha_device_info got;
        memset(&got, 0x5a, sizeof got);
        got.struct_size = sizeof got;
        char msg[512] = "";
        clmha_status st = clmha_device_select(bad[i].spec, &got, msg, sizeof msg);
        cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "\"%s\": status %d (%s)", bad[i].spec, (int)st,
                     msg);
        char quoted[64];
        snprintf(quoted, sizeof quoted, "\"%s\"", bad[i].spec);
        cr_expect(strstr(msg, quoted) != NULL, "\"%s\": message \"%s\" does not name it",
                  bad[i].spec, msg);
        cr_expect(strstr(msg, bad[i].why) != NULL, "\"%s\": message \"%s\" lacks \"%s\"",
                  bad[i].spec, msg, bad[i].why);
        cr_expect_eq(((unsigned char *)&got)[sizeof got.struct_size], 0x5a, "\"%s\": out written",
                     bad[i].spec);
        // The same through a context.
        clmha_context *ctx = (clmha_context *)&got;
        cr_expect_eq(clmha_context_create(&ctx, bad[i].spec), CLMHA_INVALID_ARGUMENT, "\"%s\"",
                     bad[i].spec);
        cr_expect_null(ctx);
        cr_expect(strstr(clmha_last_create_error(), quoted) != NULL, "\"%s\": %s", bad[i].spec,
                  clmha_last_create_error());
    }
}

// Well-formed index pairs still select, leading zeros included; a pair that fits but names no
// device is "not found", with the list of devices.
Test(device, index_specs_in_range) {
    size_t count;
    clmha_device_info *all = list_all(&count);
    if (!count) cr_skip_test("no OpenCL device");
    char spec[64];
    snprintf(spec, sizeof spec, "00%u:0%u", all[0].platform_index, all[0].device_index);
    clmha_device_info got = {.struct_size = sizeof got};
    char msg[512];
    cr_expect_eq(clmha_device_select(spec, &got, msg, sizeof msg), CLMHA_SUCCESS, "%s", msg);
    cr_expect_eq(got.device, all[0].device);
    cr_expect_eq(clmha_device_select("4294967295:0", &got, msg, sizeof msg),
                 CLMHA_DEVICE_NOT_FOUND, "%s", msg);
    cr_expect(strstr(msg, "4294967295:0") != NULL, "%s", msg);
    // Names that are not index pairs keep matching by substring.
    cr_expect_eq(clmha_device_select("no-such:device", &got, msg, sizeof msg),
                 CLMHA_DEVICE_NOT_FOUND, "%s", msg);
    free(all);
}

Test(device, version) {
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", CLMHA_VERSION_MAJOR, CLMHA_VERSION_MINOR,
             CLMHA_VERSION_PATCH);
    cr_assert_str_eq(clmha_version(), want);
}
