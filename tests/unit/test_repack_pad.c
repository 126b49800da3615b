/* The padded device layouts of kernels.h 0. (m40k_repack_q6_k_p, m40k_repack_mxfp4_p: host
 * code of the CUDA build, so this runs without a GPU). Every byte of a repacked row is
 * checked against where the layout's description puts it, computed here from the
 * description alone:
 *   Q6_K_P, per superblock (210 bytes: ql | qh | scales | d): the 210 bytes, then 14 zero
 *           bytes (224; rows of K/256 superblocks);
 *   MXFP4_P, per 8 blocks (17 bytes: e | qs[16]) of a row: qs[8][16] | e[8] | 8 zero
 *           bytes (144; rows of ceil(K/256) chunks, the blocks past K all zero bytes).
 * Also: row lengths that are not whole blocks are refused and nothing is written. Without
 * CUDA in the build: skipped. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#ifdef M40_HAVE_CUDA
#include "kernels.h"

static uint32_t rng = 2718281u;
static uint8_t rnd8(void)
{
    rng = rng * 1664525u + 1013904223u;
    return (uint8_t)(rng >> 24);
}

/* src: n_in random bytes; dst: n_out bytes of 0xA5 (every one the repack must write). */
static int buffers(size_t n_in, size_t n_out, uint8_t **src, uint8_t **dst)
{
    *src = malloc(n_in), *dst = malloc(n_out);
    if (!*src || !*dst) {
        CHECK(0, "out of memory");
        free(*src);
        free(*dst);
        return -1;
    }
    for (size_t i = 0; i < n_in; i++)
        (*src)[i] = rnd8();
    memset(*dst, 0xA5, n_out);
    return 0;
}

static void check_q6(int64_t K, int rows)
{
    const size_t in_row = (size_t)(K / 256) * 210, out_row = (size_t)(K / 256) * 224;
    uint8_t *src, *dst;
    if (buffers(in_row * rows, out_row * rows, &src, &dst))
        return;
    CHECK(m40k_padded_row_bytes(M40K_TYPE_Q6_K_P, K) == (int64_t)out_row, "Q6_K_P K %lld: row bytes", (long long)K);
    CHECK(m40k_repack_q6_k_p(src, dst, rows, K) == 0, "Q6_K_P K %lld: repack", (long long)K);
    size_t bad = 0;
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < K / 256; b++)
            for (int o = 0; o < 224; o++) {
                const uint8_t want = o < 210 ? src[r * in_row + (size_t)b * 210 + o] : 0;
                bad += dst[r * out_row + (size_t)b * 224 + o] != want;
            }
    CHECK(bad == 0, "Q6_K_P K %lld x %d rows: %zu bytes misplaced", (long long)K, rows, bad);
    free(src);
    free(dst);
}

static void check_mxfp4(int64_t K, int rows)
{
    const int64_t blocks = K / 32, chunks = (K + 255) / 256;
    const size_t in_row = (size_t)blocks * 17, out_row = (size_t)chunks * 144;
    uint8_t *src, *dst;
    if (buffers(in_row * rows, out_row * rows, &src, &dst))
        return;
    CHECK(m40k_padded_row_bytes(M40K_TYPE_MXFP4_P, K) == (int64_t)out_row, "MXFP4_P K %lld: row bytes",
          (long long)K);
    CHECK(m40k_repack_mxfp4_p(src, dst, rows, K) == 0, "MXFP4_P K %lld: repack", (long long)K);
    size_t bad = 0;
    for (int r = 0; r < rows; r++) {
        const uint8_t *row = dst + r * out_row;
        for (int64_t b = 0; b < chunks * 8; b++) {
            const uint8_t *c = row + (b / 8) * 144;
            const uint8_t *in = src + r * in_row + (size_t)b * 17;
            bad += c[128 + b % 8] != (b < blocks ? in[0] : 0);
            for (int i = 0; i < 16; i++)
                bad += c[16 * (b % 8) + i] != (b < blocks ? in[1 + i] : 0);
        }
        for (int64_t c = 0; c < chunks; c++)
            for (int i = 136; i < 144; i++)
                bad += row[c * 144 + i] != 0;
    }
    CHECK(bad == 0, "MXFP4_P K %lld x %d rows: %zu bytes misplaced", (long long)K, rows, bad);
    CHECK(out_row % 16 == 0, "MXFP4_P K %lld: rows of 16-byte multiples", (long long)K);
    free(src);
    free(dst);
}

int main(void)
{
    check_q6(256, 3);
    check_q6(768, 4); /* Qwen3-30B-A3B's down experts */
    check_q6(2048, 2);
    check_mxfp4(32, 2);
    check_mxfp4(256, 3);
    check_mxfp4(2880, 3); /* gpt-oss: 90 blocks, 12 chunks, the last with 2 */
    check_mxfp4(352, 5);
    uint8_t a[2048] = {0}, b[2048];
    memset(b, 0x5A, sizeof b);
    CHECK(m40k_repack_q6_k_p(a, b, 1, 100) != 0 && m40k_repack_q6_k_p(a, b, 1, 0) != 0 &&
              m40k_repack_q6_k_p(a, b, -1, 256) != 0 && m40k_repack_mxfp4_p(a, b, 1, 48) != 0 &&
              m40k_repack_mxfp4_p(a, b, 1, -32) != 0 && b[0] == 0x5A && b[2047] == 0x5A,
          "K of no whole block, K <= 0, rows < 0: refused, nothing written");
    CHECK(m40k_padded_row_bytes(M40K_TYPE_Q6_K_P, 100) == 0 && m40k_padded_row_bytes(M40K_TYPE_MXFP4_P, 48) == 0 &&
              m40k_padded_row_bytes(M40K_TYPE_MXFP4_P, 0) == 0 && m40k_padded_row_bytes(M40K_TYPE_Q6_K, 256) == 0,
          "no padded row for a K of no whole block, K 0, or a type without a padded layout");
    return check_done();
}
#else
int main(void)
{
    SKIP("a build without CUDA has no padded layouts");
    return check_done();
}
#endif
