/* Weight types: fp16/bf16 conversions, dequantization of hand-built blocks of every
 * supported type, quantize/dequantize round trips, fused dot products against
 * dequantize+dot, and dequantization of real tensors from the shared models.
 *
 * The hand-built blocks are made in the ENCODING direction: the test picks the
 * integer levels and scales it wants, packs them into bytes following the format
 * description, and expects the decoder to give back d*sc*q - dmin*m. The packing
 * here is written independently of the decoder in kernels/ref/quant.c, and a few
 * literal byte patterns with hand-computed values pin the layout further. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "ref/ggml_types.h"
#include "gguf/gguf.h"
#include "ref/quant.h"

/* ------------------------------------------------------------- random */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rnd32(void)
{
    /* xorshift64*: small, deterministic, good enough for test data */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

static int rndi(int lo, int hi) /* inclusive */
{
    return lo + (int)(rnd32() % (uint32_t)(hi - lo + 1));
}

static float rndu(void) /* [0, 1) */
{
    return (float)(rnd32() >> 8) * 0x1p-24f;
}

static float rndn(void) /* standard normal, Box-Muller */
{
    float u = rndu(), v = rndu();
    if (u < 1e-7f)
        u = 1e-7f;
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

/* ------------------------------------------------------------- helpers */

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static float f16r(float f) /* value as fp16 would store it */
{
    return m40_fp16_to_fp32(m40_fp32_to_fp16(f));
}

/* Compare decoded values to expectations; one CHECK per call so that a broken
 * decoder prints the first bad element instead of 256 lines. */
static void expect_row(const char *what, const float *got, const float *want, int n)
{
    int bad = -1;
    for (int i = 0; i < n && bad < 0; i++)
        if (!(got[i] == want[i] || fabsf(got[i] - want[i]) <= 1e-6f * fabsf(want[i])))
            bad = i;
    CHECK(bad < 0, "%s: element %d is %.9g, expected %.9g", what, bad, bad >= 0 ? got[bad] : 0.0,
          bad >= 0 ? want[bad] : 0.0);
}

/* ------------------------------------------------------------- fp16 / bf16 */

static void test_fp16(void)
{
    CHECK(m40_fp16_to_fp32(0x3c00) == 1.0f, "1.0");
    CHECK(m40_fp16_to_fp32(0xc000) == -2.0f, "-2.0");
    CHECK(m40_fp16_to_fp32(0x7bff) == 65504.0f, "65504");
    CHECK(m40_fp16_to_fp32(0x0001) == 0x1p-24f, "smallest subnormal");
    CHECK(m40_fp16_to_fp32(0x03ff) == 1023.0f * 0x1p-24f, "largest subnormal");
    CHECK(m40_fp16_to_fp32(0x0400) == 0x1p-14f, "smallest normal");
    CHECK(m40_fp16_to_fp32(0x3555) == 0x1.554p-2f, "0x3555");
    CHECK(isinf(m40_fp16_to_fp32(0x7c00)) && m40_fp16_to_fp32(0x7c00) > 0, "+inf");
    CHECK(isinf(m40_fp16_to_fp32(0xfc00)) && m40_fp16_to_fp32(0xfc00) < 0, "-inf");
    CHECK(isnan(m40_fp16_to_fp32(0x7e00)) && isnan(m40_fp16_to_fp32(0x7c01)) && isnan(m40_fp16_to_fp32(0xfd00)),
          "nan");
    CHECK(m40_fp16_to_fp32(0x8000) == 0.0f && signbit(m40_fp16_to_fp32(0x8000)), "-0");

    CHECK(m40_fp32_to_fp16(1.0f) == 0x3c00, "1.0 -> %04x", m40_fp32_to_fp16(1.0f));
    CHECK(m40_fp32_to_fp16(-2.0f) == 0xc000, "-2.0 -> %04x", m40_fp32_to_fp16(-2.0f));
    CHECK(m40_fp32_to_fp16(65504.0f) == 0x7bff, "65504");
    CHECK(m40_fp32_to_fp16(65519.0f) == 0x7bff, "65519 rounds down to 65504");
    CHECK(m40_fp32_to_fp16(65520.0f) == 0x7c00, "65520 is a tie, even neighbour is inf");
    CHECK(m40_fp32_to_fp16(1e6f) == 0x7c00 && m40_fp32_to_fp16(-1e6f) == 0xfc00, "overflow to inf");
    CHECK(m40_fp32_to_fp16(INFINITY) == 0x7c00 && m40_fp32_to_fp16(-INFINITY) == 0xfc00, "inf");
    uint16_t hn = m40_fp32_to_fp16(NAN);
    CHECK((hn & 0x7c00) == 0x7c00 && (hn & 0x3ff) != 0, "nan stays nan: %04x", hn);
    /* a NaN whose payload sits only in low bits must not become an infinity */
    uint32_t nanbits = 0x7f800001u;
    float tiny_nan;
    memcpy(&tiny_nan, &nanbits, 4);
    hn = m40_fp32_to_fp16(tiny_nan);
    CHECK((hn & 0x7c00) == 0x7c00 && (hn & 0x3ff) != 0, "low-payload nan stays nan: %04x", hn);
    CHECK(m40_fp32_to_fp16(0x1p-24f) == 0x0001, "smallest subnormal");
    CHECK(m40_fp32_to_fp16(0x1p-25f) == 0x0000, "2^-25 is a tie, rounds to even 0");
    CHECK(m40_fp32_to_fp16(0x1.8p-25f) == 0x0001, "0.75 ulp rounds up");
    CHECK(m40_fp32_to_fp16(0x1.8p-24f) == 0x0002, "1.5 ulp tie rounds to even 2");
    CHECK(m40_fp32_to_fp16(0x1.4p-24f) == 0x0001, "1.25 ulp rounds to 1");
    CHECK(m40_fp32_to_fp16(0x1p-30f) == 0x0000, "underflow to 0");
    CHECK(m40_fp32_to_fp16(-0x1p-30f) == 0x8000, "underflow to -0");
    CHECK(m40_fp32_to_fp16(1.0f + 0x1p-11f) == 0x3c00, "tie 1+2^-11 rounds to even 1.0");
    CHECK(m40_fp32_to_fp16(1.0f + 0x1.8p-10f) == 0x3c02, "tie 1+3*2^-11 rounds to even 0x3c02");
    CHECK(m40_fp32_to_fp16(1.0f + 0x1.2p-11f) == 0x3c01, "just above tie rounds up");
    CHECK(m40_fp32_to_fp16(0x1.ffcp-15f) == 0x0400, "rounding carries subnormal into smallest normal");
    CHECK(m40_fp32_to_fp16(0.1f) == 0x2e66, "0.1 -> %04x", m40_fp32_to_fp16(0.1f));

    /* Exhaustive: every non-NaN half survives the round trip bit for bit; and
     * for every pair of adjacent positive finite halves, the midpoint (exact in
     * float) goes to the even one, and the floats just either side of it go to
     * the nearer one. */
    int bad_rt = 0, bad_mid = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = m40_fp16_to_fp32((uint16_t)h);
        if (isnan(f)) {
            if (!isnan(m40_fp16_to_fp32(m40_fp32_to_fp16(f))))
                bad_rt++;
            continue;
        }
        if (m40_fp32_to_fp16(f) != h)
            bad_rt++;
        if (h < 0x7bff) {
            float g = m40_fp16_to_fp32((uint16_t)(h + 1));
            float mid = f + (g - f) * 0.5f; /* exact */
            uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
            if (m40_fp32_to_fp16(mid) != even || m40_fp32_to_fp16(nextafterf(mid, 0.0f)) != h ||
                m40_fp32_to_fp16(nextafterf(mid, INFINITY)) != h + 1)
                bad_mid++;
        }
    }
    CHECK(bad_rt == 0, "%d halves do not round-trip", bad_rt);
    CHECK(bad_mid == 0, "%d midpoints round wrongly", bad_mid);
}

static void test_bf16(void)
{
    CHECK(m40_bf16_to_fp32(0x3f80) == 1.0f, "1.0");
    CHECK(m40_bf16_to_fp32(0xc000) == -2.0f, "-2.0");
    CHECK(m40_bf16_to_fp32(0x0001) == 0x1p-133f, "smallest subnormal");
    CHECK(m40_bf16_to_fp32(0x7f7f) == 0x1.fep127f, "largest finite");
    CHECK(isinf(m40_bf16_to_fp32(0x7f80)) && isnan(m40_bf16_to_fp32(0x7fc0)), "inf, nan");
    CHECK(m40_fp32_to_bf16(1.0f) == 0x3f80 && m40_fp32_to_bf16(-2.0f) == 0xc000, "1, -2");
    CHECK(m40_fp32_to_bf16(1.0f + 0x1p-8f) == 0x3f80, "tie rounds to even 1.0");
    CHECK(m40_fp32_to_bf16(1.0f + 0x1.8p-7f) == 0x3f82, "tie rounds to even 0x3f82");
    CHECK(m40_fp32_to_bf16(1.0f + 0x1.2p-8f) == 0x3f81, "above tie rounds up");
    CHECK(m40_fp32_to_bf16(0x1p-133f) == 0x0001, "subnormal");
    CHECK(m40_fp32_to_bf16(0x1p-134f) == 0x0000, "subnormal tie to even 0");
    CHECK(m40_fp32_to_bf16(3.4028235e38f) == 0x7f80, "FLT_MAX rounds to inf");
    CHECK(m40_fp32_to_bf16(INFINITY) == 0x7f80 && m40_fp32_to_bf16(-INFINITY) == 0xff80, "inf");
    uint32_t nanbits = 0x7f800001u;
    float tiny_nan;
    memcpy(&tiny_nan, &nanbits, 4);
    uint16_t b = m40_fp32_to_bf16(tiny_nan);
    CHECK((b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0, "low-payload nan stays nan: %04x", b);
    CHECK(isnan(m40_bf16_to_fp32(m40_fp32_to_bf16(NAN))), "nan");

    int bad_rt = 0, bad_mid = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = m40_bf16_to_fp32((uint16_t)h);
        if (isnan(f))
            continue;
        if (m40_fp32_to_bf16(f) != h)
            bad_rt++;
        if (h < 0x7f7f) {
            float g = m40_bf16_to_fp32((uint16_t)(h + 1));
            float mid = f + (g - f) * 0.5f; /* exact, and (f + g) could overflow */
            uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
            if (m40_fp32_to_bf16(mid) != even || m40_fp32_to_bf16(nextafterf(mid, 0.0f)) != h ||
                m40_fp32_to_bf16(nextafterf(mid, INFINITY)) != h + 1)
                bad_mid++;
        }
    }
    CHECK(bad_rt == 0, "%d bf16 values do not round-trip", bad_rt);
    CHECK(bad_mid == 0, "%d bf16 midpoints round wrongly", bad_mid);
}

/* ------------------------------------------------------- hand-built blocks */

static void test_plain_types(void)
{
    uint8_t buf[16];
    float out[4];
    const float v[4] = {1.0f, -2.5f, 0x1p-20f, 1000.0f};

    memcpy(buf, v, sizeof v);
    m40_dequantize_row(M40_TYPE_F32, buf, out, 4);
    CHECK(memcmp(out, v, sizeof v) == 0, "F32 copies");

    put16(buf + 0, 0x3c00); /* 1 */
    put16(buf + 2, 0xc100); /* -2.5 */
    put16(buf + 4, 0x0010); /* 16 * 2^-24 = 2^-20, subnormal */
    put16(buf + 6, 0x63d0); /* 1000 */
    m40_dequantize_row(M40_TYPE_F16, buf, out, 4);
    CHECK(memcmp(out, v, sizeof v) == 0, "F16: %g %g %g %g", out[0], out[1], out[2], out[3]);

    put16(buf + 0, 0x3f80);
    put16(buf + 2, 0xc020);
    put16(buf + 4, 0x3580); /* 2^-20 */
    put16(buf + 6, 0x447a); /* 1000 */
    m40_dequantize_row(M40_TYPE_BF16, buf, out, 4);
    CHECK(memcmp(out, v, sizeof v) == 0, "BF16: %g %g %g %g", out[0], out[1], out[2], out[3]);
}

static void test_q4_0(void)
{
    uint8_t blk[18];
    float out[32], want[32];
    int q[32];
    put16(blk, 0x3800); /* d = 0.5 */
    for (int i = 0; i < 32; i++)
        q[i] = rndi(0, 15);
    for (int j = 0; j < 16; j++)
        blk[2 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
    for (int i = 0; i < 32; i++)
        want[i] = 0.5f * (float)(q[i] - 8);
    m40_dequantize_row(M40_TYPE_Q4_0, blk, out, 32);
    expect_row("Q4_0 random levels", out, want, 32);

    /* literal: byte 0 = 0x1f -> element 0 is nibble 15 -> 0.5*7, element 16 is 1 -> -3.5 */
    memset(blk + 2, 0x88, 16);
    blk[2] = 0x1f;
    m40_dequantize_row(M40_TYPE_Q4_0, blk, out, 32);
    CHECK(out[0] == 3.5f && out[16] == -3.5f && out[1] == 0.0f && out[31] == 0.0f, "Q4_0 literal: %g %g",
          out[0], out[16]);
}

static void test_q4_1(void)
{
    uint8_t blk[20];
    float out[32], want[32];
    int q[32];
    put16(blk, 0x3400);     /* d = 0.25 */
    put16(blk + 2, 0xbc00); /* m = -1 */
    for (int i = 0; i < 32; i++)
        q[i] = rndi(0, 15);
    for (int j = 0; j < 16; j++)
        blk[4 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
    for (int i = 0; i < 32; i++)
        want[i] = 0.25f * (float)q[i] - 1.0f;
    m40_dequantize_row(M40_TYPE_Q4_1, blk, out, 32);
    expect_row("Q4_1", out, want, 32);
}

static void test_q5(int with_min)
{
    uint8_t blk[24];
    float out[32], want[32];
    int q[32];
    uint8_t *qh, *qs;
    if (with_min) {
        put16(blk, 0x3400);     /* 0.25 */
        put16(blk + 2, 0xc000); /* -2 */
        qh = blk + 4;
        qs = blk + 8;
    } else {
        put16(blk, 0x3c00); /* 1 */
        qh = blk + 2;
        qs = blk + 6;
    }
    for (int i = 0; i < 32; i++)
        q[i] = rndi(0, 31);
    uint32_t h = 0;
    for (int i = 0; i < 32; i++)
        h |= (uint32_t)(q[i] >> 4) << i; /* element i's 5th bit is bit i of qh */
    for (int k = 0; k < 4; k++)
        qh[k] = (uint8_t)(h >> (8 * k));
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)((q[j] & 15) | ((q[j + 16] & 15) << 4));
    for (int i = 0; i < 32; i++)
        want[i] = with_min ? 0.25f * (float)q[i] - 2.0f : (float)(q[i] - 16);
    m40_dequantize_row(with_min ? M40_TYPE_Q5_1 : M40_TYPE_Q5_0, blk, out, 32);
    expect_row(with_min ? "Q5_1" : "Q5_0", out, want, 32);

    if (!with_min) {
        /* literal: qh = 00 00 01 80 -> bits 16 and 31 set; elements 16 and 31 get +16 */
        memset(blk + 2, 0, 20);
        blk[4] = 0x01;
        blk[5] = 0x80;
        m40_dequantize_row(M40_TYPE_Q5_0, blk, out, 32);
        CHECK(out[16] == 0.0f && out[31] == 0.0f && out[0] == -16.0f && out[15] == -16.0f,
              "Q5_0 literal: %g %g %g", out[16], out[31], out[0]);
    }
}

static void test_q8_0(void)
{
    uint8_t blk[34];
    float out[32], want[32];
    put16(blk, 0x4000); /* 2 */
    for (int i = 0; i < 32; i++) {
        int v = rndi(-128, 127);
        blk[2 + i] = (uint8_t)(int8_t)v;
        want[i] = 2.0f * (float)v;
    }
    m40_dequantize_row(M40_TYPE_Q8_0, blk, out, 32);
    expect_row("Q8_0", out, want, 32);
}

static void test_q2_k(void)
{
    uint8_t blk[84] = {0};
    float out[256], want[256];
    int q[256], sc[16], mn[16];
    for (int i = 0; i < 256; i++)
        q[i] = rndi(0, 3);
    for (int s = 0; s < 16; s++) {
        sc[s] = rndi(0, 15);
        mn[s] = rndi(0, 15);
        blk[s] = (uint8_t)(sc[s] | (mn[s] << 4));
    }
    /* element 128n + 32j + l lives in bits 2j..2j+1 of qs[32n + l] */
    for (int e = 0; e < 256; e++) {
        int n = e / 128, j = (e % 128) / 32, l = e % 32;
        blk[16 + 32 * n + l] |= (uint8_t)(q[e] << (2 * j));
    }
    put16(blk + 80, 0x3800); /* d = 0.5 */
    put16(blk + 82, 0x3400); /* dmin = 0.25 */
    for (int e = 0; e < 256; e++)
        want[e] = 0.5f * (float)sc[e / 16] * (float)q[e] - 0.25f * (float)mn[e / 16];
    m40_dequantize_row(M40_TYPE_Q2_K, blk, out, 256);
    expect_row("Q2_K", out, want, 256);

    /* literal: scales[1] = 0x23 (sc 3, m 2), qs[16] = 0x0c (field 1 = 3)
     * -> element 32*1 + 16 = 48 sits in sub-block 3, so take scales[3] = 0x41:
     *    element 48 = 0.5*1*3 - 0.25*4 = 0.5; element 16 (field 0 of qs[16] = 0) = -0.25*2 */
    memset(blk, 0, 80);
    blk[1] = 0x23;
    blk[3] = 0x41;
    blk[16 + 16] = 0x0c;
    m40_dequantize_row(M40_TYPE_Q2_K, blk, out, 256);
    CHECK(out[48] == 0.5f && out[16] == -0.5f && out[0] == 0.0f, "Q2_K literal: %g %g", out[48], out[16]);
}

static void test_q3_k(void)
{
    uint8_t blk[110] = {0};
    float out[256], want[256];
    int q[256], sc[16];
    for (int i = 0; i < 256; i++)
        q[i] = rndi(-4, 3);
    for (int s = 0; s < 16; s++)
        sc[s] = rndi(-32, 31);
    for (int e = 0; e < 256; e++) {
        int n = e / 128, j = (e % 128) / 32, l = e % 32, u = q[e] + 4;
        blk[32 + 32 * n + l] |= (uint8_t)((u & 3) << (2 * j));
        if (u & 4) /* high bit set = no -4 */
            blk[l] |= (uint8_t)(1u << (4 * n + j));
    }
    uint8_t *s12 = blk + 96;
    for (int i = 0; i < 16; i++) {
        int u = sc[i] + 32;
        if (i < 8)
            s12[i] |= (uint8_t)(u & 15);
        else
            s12[i - 8] |= (uint8_t)((u & 15) << 4);
        s12[8 + i % 4] |= (uint8_t)((u >> 4) << (2 * (i / 4)));
    }
    put16(blk + 108, 0x3400); /* 0.25 */
    for (int e = 0; e < 256; e++)
        want[e] = 0.25f * (float)sc[e / 16] * (float)q[e];
    m40_dequantize_row(M40_TYPE_Q3_K, blk, out, 256);
    expect_row("Q3_K", out, want, 256);

    /* literal: all scale bytes 0 -> every scale is -32; hmask 0 and qs 0 -> q = -4:
     * every element is 0.25 * -32 * -4 = 32. Then byte 8 = 0x02 raises scale 0's
     * top bits to 2 -> scale 0 = 32 - 32 = 0. */
    memset(blk, 0, 108);
    m40_dequantize_row(M40_TYPE_Q3_K, blk, out, 256);
    CHECK(out[0] == 32.0f && out[255] == 32.0f, "Q3_K literal zeros: %g", out[0]);
    blk[96 + 8] = 0x02;
    m40_dequantize_row(M40_TYPE_Q3_K, blk, out, 256);
    CHECK(out[0] == 0.0f && out[15] == 0.0f && out[16] == 32.0f, "Q3_K literal scale 0: %g %g", out[0],
          out[16]);
}

/* Q4_K/Q5_K scale+min packing, written as "where does each bit go". */
static void pack_k4_scales(uint8_t *s12, const int *sc, const int *mn)
{
    memset(s12, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            s12[j] |= (uint8_t)sc[j];
            s12[j + 4] |= (uint8_t)mn[j];
        } else {
            s12[j + 4] |= (uint8_t)((sc[j] & 15) | ((mn[j] & 15) << 4));
            s12[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            s12[j] |= (uint8_t)((mn[j] >> 4) << 6);
        }
    }
}

static void test_q45_k(int five)
{
    uint8_t blk[176] = {0};
    float out[256], want[256];
    int q[256], sc[8], mn[8];
    uint8_t *qs = blk + (five ? 48 : 16);
    for (int i = 0; i < 256; i++)
        q[i] = rndi(0, five ? 31 : 15);
    for (int j = 0; j < 8; j++) {
        sc[j] = rndi(0, 63);
        mn[j] = rndi(0, 63);
    }
    put16(blk, 0x3000);     /* d = 0.125 */
    put16(blk + 2, 0x2c00); /* dmin = 0.0625 */
    pack_k4_scales(blk + 4, sc, mn);
    /* chunk c of 64: low nibbles of qs[32c + l] are elements 64c + l, high nibbles 64c + 32 + l;
     * Q5_K: the 5th bit of element e is bit e/32 of qh[e % 32] */
    for (int e = 0; e < 256; e++) {
        int c = e / 64, l = e % 32, hi = (e % 64) >= 32;
        qs[32 * c + l] |= (uint8_t)((q[e] & 15) << (hi ? 4 : 0));
        if (five)
            blk[16 + l] |= (uint8_t)((q[e] >> 4) << (e / 32));
    }
    for (int e = 0; e < 256; e++)
        want[e] = 0.125f * (float)sc[e / 32] * (float)q[e] - 0.0625f * (float)mn[e / 32];
    m40_dequantize_row(five ? M40_TYPE_Q5_K : M40_TYPE_Q4_K, blk, out, 256);
    expect_row(five ? "Q5_K" : "Q4_K", out, want, 256);

    if (!five) {
        /* literal: scale bytes
         *   [0]=0x45 -> sc0 = 5, top bits 01 feed sc4's bits 4-5
         *   [4]=0x03 -> m0 = 3
         *   [8]=0x27 -> sc4 low = 7, m4 low = 2 -> sc4 = 7 | 1<<4 = 23, m4 = 2
         * qs[0] = 0x9f: element 0 = 15, element 32 = 9 (sub-block 1: sc1 = m1 = 0)
         * qs[64] = 0x04: element 128 (sub-block 4) = 4
         *   e0   = 0.125*5*15 - 0.0625*3 = 9.1875
         *   e128 = 0.125*23*4 - 0.0625*2 = 11.375
         *   e1   = -0.1875 (q 0) */
        memset(blk + 4, 0, 140);
        blk[4 + 0] = 0x45;
        blk[4 + 4] = 0x03;
        blk[4 + 8] = 0x27;
        blk[16 + 0] = 0x9f;
        blk[16 + 64] = 0x04;
        m40_dequantize_row(M40_TYPE_Q4_K, blk, out, 256);
        CHECK(out[0] == 9.1875f && out[128] == 11.375f && out[1] == -0.1875f && out[32] == 0.0f,
              "Q4_K literal: %g %g %g %g", out[0], out[128], out[1], out[32]);
    }
}

static void pack_q6_k(uint8_t *blk, const int *q /* -32..31 */, const int *sc, uint16_t d)
{
    memset(blk, 0, 210);
    /* half n, quarter k, l: low nibble of ql[64n + l + 32(k&1)] (k < 2) or its high
     * nibble (k >= 2); top 2 bits at bits 2k of qh[32n + l] */
    for (int e = 0; e < 256; e++) {
        int n = e / 128, k = (e % 128) / 32, l = e % 32, u = q[e] + 32;
        blk[64 * n + l + 32 * (k & 1)] |= (uint8_t)((u & 15) << (k >= 2 ? 4 : 0));
        blk[128 + 32 * n + l] |= (uint8_t)((u >> 4) << (2 * k));
    }
    for (int s = 0; s < 16; s++)
        blk[192 + s] = (uint8_t)(int8_t)sc[s];
    put16(blk + 208, d);
}

static void test_q6_k(void)
{
    uint8_t blk[210];
    float out[256], want[256];
    int q[256], sc[16];
    for (int i = 0; i < 256; i++)
        q[i] = rndi(-32, 31);
    for (int s = 0; s < 16; s++)
        sc[s] = rndi(-128, 127);
    pack_q6_k(blk, q, sc, 0x2c00); /* 0.0625 */
    for (int e = 0; e < 256; e++)
        want[e] = 0.0625f * (float)sc[e / 16] * (float)q[e];
    m40_dequantize_row(M40_TYPE_Q6_K, blk, out, 256);
    expect_row("Q6_K", out, want, 256);

    /* literal: ql all 0, qh all 0 -> q = -32 everywhere. qh[0] = 0x40 gives element
     * 96 (quarter 3, l 0) top bits 01 -> q = 16 - 32 = -16. scales[6] (element 96
     * is sub-block 6) = -2: 0.0625 * -2 * -16 = 2. Element 0: scales[0] = 1 -> -2. */
    memset(blk, 0, 210);
    blk[128] = 0x40;
    blk[192 + 0] = 1;
    blk[192 + 6] = (uint8_t)(int8_t)-2;
    put16(blk + 208, 0x2c00);
    m40_dequantize_row(M40_TYPE_Q6_K, blk, out, 256);
    CHECK(out[96] == 2.0f && out[0] == -2.0f && out[97] == 4.0f && out[16] == 0.0f,
          "Q6_K literal: %g %g %g %g", out[96], out[0], out[97], out[16]);
}

/* MXFP4, written from the OCP microscaling spec rather than ggml's doubled-integer
 * form: a nibble is E2M1 (sign bit 3, exponent bits 2..1 with bias 1, mantissa bit 0;
 * exponent 0 is subnormal, m * 0.5), the block's value scale is 2^(e - 127), element
 * j < 16 the low nibble of byte j and j + 16 its high nibble. */
static float e2m1(int nib)
{
    int sgn = nib >> 3, ex = (nib >> 1) & 3, m = nib & 1;
    float mag = ex == 0 ? 0.5f * (float)m : ldexpf(1.0f + 0.5f * (float)m, ex - 1);
    return sgn ? -mag : mag;
}

static void test_mxfp4(void)
{
    uint8_t blk[2 * 17];
    float out[64], want[64];
    int q[64];
    const int es[2] = {rndi(110, 140), rndi(110, 140)};
    for (int b = 0; b < 2; b++) {
        blk[17 * b] = (uint8_t)es[b];
        for (int i = 0; i < 32; i++)
            q[32 * b + i] = rndi(0, 15);
        for (int j = 0; j < 16; j++)
            blk[17 * b + 1 + j] = (uint8_t)(q[32 * b + j] | (q[32 * b + j + 16] << 4));
        for (int i = 0; i < 32; i++)
            want[32 * b + i] = e2m1(q[32 * b + i]) * ldexpf(1.0f, es[b] - 127);
    }
    m40_dequantize_row(M40_TYPE_MXFP4, blk, out, 64);
    expect_row("MXFP4 random nibbles, two blocks", out, want, 64);
    CHECK(m40_type_get(M40_TYPE_MXFP4) && m40_type_get(M40_TYPE_MXFP4)->block_elems == 32 &&
              m40_type_get(M40_TYPE_MXFP4)->block_bytes == 17 && strcmp(m40_type_name(39), "MXFP4") == 0,
          "MXFP4 is GGUF type 39, 17 bytes per 32");

    /* literals: e = 127 (scale 1); byte 0 = 0x7f: element 0 is nibble f = -6, element 16
     * nibble 7 = +6; byte 1 = 0x92: element 1 nibble 2 = 1, element 17 nibble 9 = -0.5;
     * nibble 8 is -0, which must read as zero */
    memset(blk, 0, 17);
    blk[0] = 127;
    blk[1] = 0x7f;
    blk[2] = 0x92;
    blk[3] = 0x08;
    m40_dequantize_row(M40_TYPE_MXFP4, blk, out, 32);
    CHECK(out[0] == -6.0f && out[16] == 6.0f && out[1] == 1.0f && out[17] == -0.5f && out[2] == 0.0f &&
              out[18] == 0.0f && out[31] == 0.0f,
          "MXFP4 literal: %g %g %g %g %g", out[0], out[16], out[1], out[17], out[2]);
    /* the extreme scales: e = 0 is 2^-127 (a subnormal float), e = 254 is 2^127 */
    blk[0] = 0;
    m40_dequantize_row(M40_TYPE_MXFP4, blk, out, 32);
    CHECK(out[1] == 0x1p-127f && out[16] == 6.0f * 0x1p-127f, "MXFP4 e=0: %g %g", out[1], out[16]);
    blk[0] = 254;
    m40_dequantize_row(M40_TYPE_MXFP4, blk, out, 32);
    CHECK(out[1] == 0x1p127f && out[17] == -0x1p126f, "MXFP4 e=254: %g %g", out[1], out[17]);

    /* values that are exactly levels times a power of two come back bit for bit, with
     * the scale the smallest that holds the largest (6 * 2^-3 here: e = 124) */
    float x[32], y[32];
    for (int i = 0; i < 32; i++)
        x[i] = e2m1(rndi(0, 15)) * 0x1p-3f;
    x[9] = -6.0f * 0x1p-3f;
    CHECK(m40_quantize_row(M40_TYPE_MXFP4, x, blk, 32) == 0, "MXFP4 quantizes");
    m40_dequantize_row(M40_TYPE_MXFP4, blk, y, 32);
    expect_row("MXFP4 exact levels round trip", y, x, 32);
    CHECK(blk[0] == 124, "MXFP4 scale byte %d, expected 124", blk[0]);
    /* nearest level: 2.4 -> 2, 2.6 -> 3, 5.1 -> 6, 4.9 -> 4, -11 -> -12, 0.2 -> 0; 6 sets e = 127 */
    const float in[7] = {2.4f, 2.6f, 5.1f, 4.9f, -11.0f, 0.2f, 6.0f}, exp_[7] = {2, 3, 6, 4, -12, 0, 6};
    for (int i = 0; i < 32; i++)
        x[i] = i < 7 ? in[i] : 0.0f;
    x[8] = 12.0f; /* the largest: scale 2 would not do, levels step in units of 1 at e = 128 */
    m40_quantize_row(M40_TYPE_MXFP4, x, blk, 32);
    m40_dequantize_row(M40_TYPE_MXFP4, blk, y, 32);
    int bad = -1;
    for (int i = 0; i < 7; i++)
        if (y[i] != exp_[i])
            bad = i;
    CHECK(blk[0] == 128 && bad < 0 && y[8] == 12.0f, "MXFP4 nearest levels: e %d, element %d is %g", blk[0],
          bad, bad >= 0 ? y[bad] : 0.0);
}

/* ---------------------------------------------------------------- round trips */

static double rel_rms(const float *a, const float *b, int64_t n)
{
    double e = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        e += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        s += (double)a[i] * a[i];
    }
    return s > 0 ? sqrt(e / s) : sqrt(e);
}

static void test_roundtrip(void)
{
    enum { N = 256 * 16 };
    static float x[N], y[N];
    static uint8_t q[N * 4];
    static const struct {
        uint32_t type;
        double bound;
    } cases[] = {
        {M40_TYPE_F32, 0.0},    {M40_TYPE_F16, 5e-4},  {M40_TYPE_BF16, 4e-3}, {M40_TYPE_Q8_0, 0.01},
        {M40_TYPE_Q4_0, 0.10},  {M40_TYPE_Q4_K, 0.08}, {M40_TYPE_Q6_K, 0.02}, {M40_TYPE_Q4_1, 0.10},
        {M40_TYPE_Q5_0, 0.05},  {M40_TYPE_Q5_1, 0.05}, {M40_TYPE_MXFP4, 0.125},
    };
    /* Gaussian data with a per-256 magnitude that varies over 3 decades, so super
     * scales and sub-block scales are both exercised. */
    for (int b = 0; b < N / 256; b++) {
        float mag = powf(10.0f, -2.0f + 3.0f * rndu());
        for (int i = 0; i < 256; i++)
            x[256 * b + i] = mag * rndn();
    }
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const char *name = m40_type_name(cases[c].type);
        int rc = m40_quantize_row(cases[c].type, x, q, N);
        CHECK(rc == 0, "quantize %s", name);
        m40_dequantize_row(cases[c].type, q, y, N);
        /* measure per 256-block so that small-magnitude blocks count as much as big ones */
        double worst = 0, mean = 0;
        for (int b = 0; b < N / 256; b++) {
            double r = rel_rms(x + 256 * b, y + 256 * b, 256);
            mean += r / (N / 256);
            if (r > worst)
                worst = r;
        }
        printf("round trip %-5s per-block relative RMS error: mean %.5f worst %.5f (bounds %.3g, %.3g)\n", name,
               mean, worst, cases[c].bound, 1.25 * cases[c].bound);
        CHECK(mean <= cases[c].bound, "%s mean relative RMS error %.5f > %.3g", name, mean, cases[c].bound);
        CHECK(worst <= 1.25 * cases[c].bound, "%s worst relative RMS error %.5f > %.3g", name, worst,
              1.25 * cases[c].bound);

        /* an all-zero row must come back as zeros (no 0/0 in the scale search) */
        float z[256] = {0}, zy[256];
        memset(zy, 0xff, sizeof zy);
        m40_quantize_row(cases[c].type, z, q, 256);
        m40_dequantize_row(cases[c].type, q, zy, 256);
        int nz = 0;
        for (int i = 0; i < 256; i++)
            nz += zy[i] != 0.0f;
        CHECK(nz == 0, "%s: zero row dequantizes to %d non-zeros", name, nz);

        /* a block of one repeated positive value and one of a single spike */
        float cst[256], sp[256] = {0};
        for (int i = 0; i < 256; i++)
            cst[i] = 0.75f;
        sp[77] = -3.0f;
        m40_quantize_row(cases[c].type, cst, q, 256);
        m40_dequantize_row(cases[c].type, q, zy, 256);
        CHECK(rel_rms(cst, zy, 256) <= cases[c].bound + 1e-3, "%s constant row error %.4f", name,
              rel_rms(cst, zy, 256));
        m40_quantize_row(cases[c].type, sp, q, 256);
        m40_dequantize_row(cases[c].type, q, zy, 256);
        CHECK(rel_rms(sp, zy, 256) <= cases[c].bound + 1e-3, "%s spike row error %.4f", name,
              rel_rms(sp, zy, 256));
    }

    /* Q8_0 max-abs scale: the largest magnitude is stored exactly as +-127 */
    float blk[32];
    for (int i = 0; i < 32; i++)
        blk[i] = (float)(i - 16) / 16.0f;
    blk[5] = -4.0f;
    m40_quantize_row(M40_TYPE_Q8_0, blk, q, 32);
    CHECK((int8_t)q[2 + 5] == -127 && m40_fp16_to_fp32((uint16_t)(q[0] | q[1] << 8)) == f16r(4.0f / 127.0f),
          "Q8_0 max-abs scale: q=%d", (int8_t)q[2 + 5]);

    /* types without a quantizer, and lengths that are not whole blocks */
    CHECK(m40_quantize_row(M40_TYPE_Q2_K, x, q, 256) == -1, "Q2_K has no quantizer");
    CHECK(m40_quantize_row(M40_TYPE_Q8_1, x, q, 32) == -1, "Q8_1 has no quantizer");
    CHECK(m40_quantize_row(999, x, q, 32) == -1, "unknown type");
    CHECK(m40_quantize_row(M40_TYPE_Q8_0, x, q, 33) == -1, "Q8_0 partial block");
    CHECK(m40_quantize_row(M40_TYPE_Q4_K, x, q, 32) == -1, "Q4_K partial super-block");
}

/* m40_quantize_row_quick (mkmodel --quick): the K-quants within the round trip's bounds
 * and close to the searched fit; every other type byte-identical to m40_quantize_row. */
static void test_quick(void)
{
    enum { N = 256 * 16 };
    static float x[N], y[N];
    static uint8_t q[N * 4], q2[N * 4];
    for (int b = 0; b < N / 256; b++) {
        float mag = powf(10.0f, -2.0f + 3.0f * rndu());
        for (int i = 0; i < 256; i++)
            x[256 * b + i] = mag * rndn();
    }
    static const struct {
        uint32_t type;
        double bound;
    } kq[] = {{M40_TYPE_Q4_K, 0.08}, {M40_TYPE_Q6_K, 0.02}};
    for (size_t c = 0; c < sizeof kq / sizeof kq[0]; c++) {
        double mean[2] = {0, 0}, worst[2] = {0, 0};
        for (int v = 0; v < 2; v++) {
            CHECK((v ? m40_quantize_row_quick : m40_quantize_row)(kq[c].type, x, q, N) == 0, "quantize");
            m40_dequantize_row(kq[c].type, q, y, N);
            for (int b = 0; b < N / 256; b++) {
                double r = rel_rms(x + 256 * b, y + 256 * b, 256);
                mean[v] += r / (N / 256);
                worst[v] = r > worst[v] ? r : worst[v];
            }
        }
        printf("quick %-5s per-block relative RMS error: mean %.5f worst %.5f (searched: %.5f, %.5f)\n",
               m40_type_name(kq[c].type), mean[1], worst[1], mean[0], worst[0]);
        CHECK(mean[1] <= kq[c].bound && worst[1] <= 1.25 * kq[c].bound, "%s quick error %.5f / %.5f",
              m40_type_name(kq[c].type), mean[1], worst[1]);
        CHECK(mean[1] <= 1.2 * mean[0] && mean[1] >= mean[0], "%s quick mean %.5f against searched %.5f",
              m40_type_name(kq[c].type), mean[1], mean[0]);
    }
    static const uint32_t same[] = {M40_TYPE_F32, M40_TYPE_F16, M40_TYPE_BF16, M40_TYPE_Q8_0, M40_TYPE_Q4_0,
                                    M40_TYPE_Q4_1, M40_TYPE_Q5_0, M40_TYPE_Q5_1, M40_TYPE_MXFP4};
    for (size_t c = 0; c < sizeof same / sizeof same[0]; c++) {
        memset(q, 0, sizeof q);
        memset(q2, 0, sizeof q2);
        CHECK(m40_quantize_row(same[c], x, q, N) == 0 && m40_quantize_row_quick(same[c], x, q2, N) == 0 &&
                  !memcmp(q, q2, sizeof q),
              "%s: quick differs from m40_quantize_row", m40_type_name(same[c]));
    }
    CHECK(m40_quantize_row_quick(M40_TYPE_Q4_K, x, q, 32) == -1, "quick: Q4_K partial super-block");
}

/* ---------------------------------------------------------------- dot products */

/* Random bytes for a row, with every fp16 scale field replaced by a finite random
 * value (random bytes could be inf/nan there), and plain float types drawn from
 * real numbers. */
static void random_row(uint32_t type, uint8_t *buf, int64_t n)
{
    const m40_type_info *ti = m40_type_get(type);
    int64_t nb = n / ti->block_elems;
    if (type == M40_TYPE_F32 || type == M40_TYPE_F16 || type == M40_TYPE_BF16) {
        for (int64_t i = 0; i < n; i++) {
            float v = rndn();
            if (type == M40_TYPE_F32)
                memcpy(buf + 4 * i, &v, 4);
            else
                put16(buf + 2 * i, type == M40_TYPE_F16 ? m40_fp32_to_fp16(v) : m40_fp32_to_bf16(v));
        }
        return;
    }
    for (int64_t i = 0; i < nb * (int64_t)ti->block_bytes; i++)
        buf[i] = (uint8_t)rnd32();
    /* offsets of fp16 fields in each block */
    int offs[2] = {-1, -1};
    switch (type) {
    case M40_TYPE_Q4_0: case M40_TYPE_Q5_0: case M40_TYPE_Q8_0: offs[0] = 0; break;
    case M40_TYPE_Q4_1: case M40_TYPE_Q5_1: case M40_TYPE_Q4_K: case M40_TYPE_Q5_K: offs[0] = 0; offs[1] = 2; break;
    case M40_TYPE_Q2_K: offs[0] = 80; offs[1] = 82; break;
    case M40_TYPE_Q3_K: offs[0] = 108; break;
    case M40_TYPE_Q6_K: offs[0] = 208; break;
    default: break;
    }
    if (type == M40_TYPE_MXFP4) /* an E8M0 scale byte near 1 (2^-8..2^5), not up to 2^127 */
        for (int64_t b = 0; b < nb; b++)
            buf[b * ti->block_bytes] = (uint8_t)rndi(120, 133);
    for (int64_t b = 0; b < nb; b++)
        for (int k = 0; k < 2; k++)
            if (offs[k] >= 0)
                put16(buf + b * ti->block_bytes + offs[k], m40_fp32_to_fp16(0.01f + 0.1f * rndu()));
}

static void test_dot(void)
{
    static const uint32_t types[] = {M40_TYPE_F32,  M40_TYPE_F16,  M40_TYPE_BF16, M40_TYPE_Q8_0, M40_TYPE_Q4_0,
                                     M40_TYPE_Q4_1, M40_TYPE_Q5_0, M40_TYPE_Q5_1, M40_TYPE_Q2_K, M40_TYPE_Q3_K,
                                     M40_TYPE_Q4_K, M40_TYPE_Q5_K, M40_TYPE_Q6_K, M40_TYPE_MXFP4};
    static const int blocks[] = {1, 3, 7, 33};
    static uint8_t raw[33 * 256 * 4 + 1];
    static float deq[33 * 256], x[33 * 256];
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const m40_type_info *ti = m40_type_get(types[t]);
        int worst_bad = 0;
        double worst = 0;
        for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
            /* plain types: block size 1, so also use lengths that leave a tail
             * after the 8-wide and 256-wide loops */
            int64_t n = (int64_t)blocks[b] * (ti->block_elems == 1 ? 37 : ti->block_elems);
            /* +1: an odd address, as blocks inside a mapped file are not aligned */
            uint8_t *row = raw + 1;
            random_row(types[t], row, n);
            for (int64_t i = 0; i < n; i++)
                x[i] = rndn();
            m40_dequantize_row(types[t], row, deq, n);
            double ref = 0, mag = 0;
            for (int64_t i = 0; i < n; i++) {
                ref += (double)deq[i] * x[i];
                mag += fabs((double)deq[i] * x[i]);
            }
            float got = m40_dot_row(types[t], row, x, n);
            double err = fabs(got - ref) / (mag > 0 ? mag : 1);
            if (err > worst)
                worst = err;
            if (!(err <= 1e-5) || !(mag > 0))
                worst_bad++;
        }
        CHECK(worst_bad == 0, "%s: dot_row disagrees with dequantize+dot: rel error %.3g", ti->name, worst);
    }
}

static void test_supported(void)
{
    static const uint32_t yes[] = {M40_TYPE_F32,  M40_TYPE_F16,  M40_TYPE_BF16, M40_TYPE_Q8_0, M40_TYPE_Q4_0,
                                   M40_TYPE_Q4_1, M40_TYPE_Q5_0, M40_TYPE_Q5_1, M40_TYPE_Q2_K, M40_TYPE_Q3_K,
                                   M40_TYPE_Q4_K, M40_TYPE_Q5_K, M40_TYPE_Q6_K, M40_TYPE_MXFP4};
    static const uint32_t no[] = {4, 5, M40_TYPE_Q8_1, M40_TYPE_Q8_K, M40_TYPE_I8, M40_TYPE_I32, M40_TYPE_F64,
                                  16, 29, 38, 40, 1000, UINT32_MAX};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
        CHECK(m40_type_supported(yes[i]) == 1, "type %u should be supported", yes[i]);
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        CHECK(m40_type_supported(no[i]) == 0, "type %u should not be supported", no[i]);
}

/* ---------------------------------------------------------------- real tensors */

static void test_real_models(void)
{
    static const char *models[] = {"models/tiny-llama-q8_0.gguf", "models/tiny-llama-q4_0.gguf",
                                   "models/tiny-llama-q4km.gguf", "models/tiny-llama-spm-gqa-f16.gguf",
                                   "models/stories260K.gguf"};
    for (size_t m = 0; m < sizeof models / sizeof models[0]; m++) {
        char path[8192], err[256]; /* larger than check.h's dir buffer, so the join cannot truncate */
        if (!check_shared_file(models[m], path, sizeof path)) {
            SKIP("%s not found (shared fixtures absent)", models[m]);
            continue;
        }
        m40_gguf *g = NULL;
        if (m40_gguf_open(path, &g, err, sizeof err) != 0) {
            CHECK(0, "open %s: %s", path, err);
            continue;
        }
        uint32_t seen = 0; /* bitmask of types already checked in this file */
        for (uint64_t i = 0; i < m40_gguf_n_tensors(g); i++) {
            const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
            if (t->type >= 32 || (seen & (1u << t->type)))
                continue;
            seen |= 1u << t->type;
            CHECK(m40_type_supported(t->type), "%s: tensor %s has unsupported type %s", models[m], t->name,
                  m40_type_name(t->type));
            if (!m40_type_supported(t->type))
                continue;
            int64_t n = (int64_t)t->ne[0];
            float *row = malloc((size_t)n * sizeof *row), *x = malloc((size_t)n * sizeof *x);
            if (!row || !x) {
                CHECK(0, "out of memory");
                free(row);
                free(x);
                continue;
            }
            m40_dequantize_row(t->type, t->data, row, n);
            int finite = 1;
            double ss = 0, ref = 0, mag = 0;
            for (int64_t k = 0; k < n; k++) {
                finite &= isfinite(row[k]) != 0;
                ss += (double)row[k] * row[k];
                x[k] = rndn();
                ref += (double)row[k] * x[k];
                mag += fabs((double)row[k] * x[k]);
            }
            double rms = sqrt(ss / (double)n);
            /* weights of these models are O(0.01..10); zeros or huge values mean a
             * wrong layout or scale field */
            CHECK(finite && rms > 1e-6 && rms < 1e3, "%s %s (%s): first row finite=%d rms=%g", models[m], t->name,
                  m40_type_name(t->type), finite, rms);
            float got = m40_dot_row(t->type, t->data, x, n);
            CHECK(fabs(got - ref) <= 1e-5 * mag, "%s %s (%s): dot_row %g vs %g", models[m], t->name,
                  m40_type_name(t->type), got, ref);
            printf("real %-36s %-20s %-5s n=%-5lld rms %.4g\n", models[m], t->name, m40_type_name(t->type),
                   (long long)n, rms);
            free(row);
            free(x);
        }
        m40_gguf_close(g);
    }
}

/* The tiny-llama q8_0 / q4_0 / q4km files hold the SAME random weights, quantized
 * by an independent implementation into different types. Decoding a tensor from
 * two files must therefore agree to within the quantization error of the coarser
 * type; a wrong bit layout, scale field or sign would give errors of order 100%.
 * This pins our decoders to the independent encoder, not just to this test's own
 * reading of the format. */
static void test_cross_models(void)
{
    static const char *models[] = {"models/tiny-llama-q8_0.gguf", "models/tiny-llama-q4_0.gguf",
                                   "models/tiny-llama-q4km.gguf"};
    m40_gguf *g[3] = {NULL, NULL, NULL};
    char path[8192], err[256]; /* larger than check.h's dir buffer, so the join cannot truncate */
    for (int i = 0; i < 3; i++) {
        if (!check_shared_file(models[i], path, sizeof path)) {
            SKIP("%s not found (shared fixtures absent): cross-type comparison skipped", models[i]);
            goto out;
        }
        if (m40_gguf_open(path, &g[i], err, sizeof err) != 0) {
            CHECK(0, "open %s: %s", path, err);
            goto out;
        }
    }
    int compared[M40_TYPE_COUNT] = {0};
    for (uint64_t t = 0; t < m40_gguf_n_tensors(g[0]); t++) {
        const m40_gguf_tensor *a = m40_gguf_tensor_at(g[0], t);
        for (int j = 1; j < 3; j++) {
            const m40_gguf_tensor *b = m40_gguf_find_tensor(g[j], a->name);
            if (!b || b->n_elems != a->n_elems || a->ne[0] != b->ne[0] || b->type >= M40_TYPE_COUNT ||
                !m40_type_supported(a->type) || !m40_type_supported(b->type))
                continue;
            /* at most 64 rows: enough statistics, and the 32000-row embedding stays cheap */
            int64_t rows = (int64_t)(a->n_elems / a->ne[0]), n;
            n = (int64_t)a->ne[0] * (rows < 64 ? rows : 64);
            float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
            if (!x || !y) {
                CHECK(0, "out of memory");
                free(x);
                free(y);
                continue;
            }
            m40_dequantize_row(a->type, a->data, x, n);
            m40_dequantize_row(b->type, b->data, y, n);
            double r = rel_rms(x, y, n), bound;
            switch (b->type) {
            case M40_TYPE_Q4_0: bound = 0.11; break; /* measured 0.086 */
            case M40_TYPE_Q4_K: bound = 0.09; break; /* measured 0.072 */
            case M40_TYPE_Q6_K: bound = 0.03; break; /* measured 0.019 */
            default: bound = a->type == b->type && a->type == M40_TYPE_F32 ? 0.0 : 0.02; break;
            }
            CHECK(r <= bound, "%s: %s (%s) vs %s (%s): relative RMS difference %.4f > %.3g", a->name, models[0],
                  m40_type_name(a->type), models[j], m40_type_name(b->type), r, bound);
            compared[b->type]++;
            free(x);
            free(y);
        }
    }
    CHECK(compared[M40_TYPE_Q4_0] > 0 && compared[M40_TYPE_Q4_K] > 0 && compared[M40_TYPE_Q6_K] > 0,
          "cross-type comparison found Q4_0 %d, Q4_K %d, Q6_K %d tensors", compared[M40_TYPE_Q4_0],
          compared[M40_TYPE_Q4_K], compared[M40_TYPE_Q6_K]);
out:
    for (int i = 0; i < 3; i++)
        if (g[i])
            m40_gguf_close(g[i]);
}

int main(void)
{
    test_fp16();
    test_bf16();
    test_supported();
    test_plain_types();
    test_q4_0();
    test_q4_1();
    test_q5(0);
    test_q5(1);
    test_q8_0();
    test_q2_k();
    test_q3_k();
    test_q45_k(0);
    test_q45_k(1);
    test_q6_k();
    test_mxfp4();
    test_roundtrip();
    test_quick();
    test_dot();
    test_real_models();
    test_cross_models();
    return check_done();
}
