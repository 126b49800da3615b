/* The regrouped device layouts of kernels.h 0. (m40k_g8_type, m40k_repack_g8: host code
 * of the CUDA build, so this runs without a GPU). Every byte of a repacked row is checked
 * against where the layout's description puts it, computed here from the description
 * alone:
 *   Q8_0_G8, per 8 blocks (34 bytes: d f16 | qs[32]) of a row: d[8] | qs[8][32];
 *   Q6_K_G8, per 8 superblocks (210 bytes: ql | qh | scales (208) | d f16):
 *            {ql | qh | scales}[8] | d[8].
 * Also: rows keep their length, widths that do not take whole groups have no layout,
 * and other types have none. Without CUDA in the build: skipped. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#ifdef M40_HAVE_CUDA
#include "kernels.h"

static uint32_t rng = 12345u;
static uint8_t rnd8(void)
{
    rng = rng * 1664525u + 1013904223u;
    return (uint8_t)(rng >> 24);
}

/* the byte at offset o of group g, block (superblock) j of the original row layout, as the
 * regrouped layout places it: the offset within the regrouped group */
static size_t q8_place(int j, int o) { return o < 2 ? (size_t)(2 * j + o) : (size_t)(16 + 32 * j + (o - 2)); }
static size_t q6_place(int j, int o) { return o < 208 ? (size_t)(208 * j + o) : (size_t)(1664 + 2 * j + (o - 208)); }

static void check_type(int type, int64_t K, int rows)
{
    const int q8 = type == M40K_TYPE_Q8_0;
    const int bb = q8 ? 34 : 210, be = q8 ? 32 : 256, gb = 8 * bb;
    const size_t row_bytes = (size_t)(K / be) * bb, n = row_bytes * rows;
    uint8_t *src = malloc(n), *dst = malloc(n);
    if (!src || !dst) {
        CHECK(0, "out of memory");
        free(src);
        free(dst);
        return;
    }
    for (size_t i = 0; i < n; i++)
        src[i] = rnd8();
    memset(dst, 0xA5, n);
    CHECK(m40k_g8_type(type, K) == (q8 ? M40K_TYPE_Q8_0_G8 : M40K_TYPE_Q6_K_G8), "type %d K %lld: regrouped type",
          type, (long long)K);
    CHECK(m40k_repack_g8(type, src, dst, rows, K) == 0, "type %d K %lld: repack", type, (long long)K);
    size_t bad = 0;
    const size_t groups = n / gb;
    for (size_t g = 0; g < groups; g++)
        for (int j = 0; j < 8; j++)
            for (int o = 0; o < bb; o++) {
                const size_t from = g * gb + (size_t)j * bb + o;
                const size_t to = g * gb + (q8 ? q8_place(j, o) : q6_place(j, o));
                bad += dst[to] != src[from];
            }
    CHECK(bad == 0, "type %d K %lld x %d rows: %zu bytes misplaced", type, (long long)K, rows, bad);
    CHECK(n % gb == 0 && row_bytes % gb == 0 && gb % 16 == 0, "type %d: rows take whole 16-byte-aligned groups", type);
    free(src);
    free(dst);
}

int main(void)
{
    check_type(M40K_TYPE_Q8_0, 256, 3);
    check_type(M40K_TYPE_Q8_0, 4096, 5);
    check_type(M40K_TYPE_Q6_K, 2048, 3);
    check_type(M40K_TYPE_Q6_K, 14336, 2);
    /* widths without whole groups and other types: no layout, nothing written */
    uint8_t a[1024] = {0}, b[1024];
    memset(b, 0x5A, sizeof b);
    CHECK(m40k_g8_type(M40K_TYPE_Q8_0, 96) == M40K_TYPE_Q8_0 && m40k_g8_type(M40K_TYPE_Q6_K, 768) == M40K_TYPE_Q6_K &&
              m40k_g8_type(M40K_TYPE_Q4_K, 4096) == M40K_TYPE_Q4_K && m40k_g8_type(M40K_TYPE_F16, 4096) == M40K_TYPE_F16,
          "no regrouped type for Q8_0 K 96, Q6_K K 768, Q4_K, F16");
    CHECK(m40k_repack_g8(M40K_TYPE_Q8_0, a, b, 1, 96) != 0 &&
              m40k_repack_g8(M40K_TYPE_Q6_K, a, b, 1, 768) != 0 &&
              m40k_repack_g8(M40K_TYPE_Q4_K, a, b, 1, 256) != 0 && b[0] == 0x5A && b[1023] == 0x5A,
          "repack refuses those and writes nothing");
    CHECK(m40k_g8_type(M40K_TYPE_Q8_0, 0) == M40K_TYPE_Q8_0 && m40k_g8_type(M40K_TYPE_Q6_K, -2048) == M40K_TYPE_Q6_K,
          "no layout for K <= 0");
    return check_done();
}
#else
int main(void)
{
    SKIP("a build without CUDA has no regrouped layouts");
    return check_done();
}
#endif
