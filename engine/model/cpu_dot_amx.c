/* The AMX instance of the fast CPU path (cpu_dot.h, M40_ISA_AMX): Intel's tile unit
 * multiplies the int16 activation records by the quantized weights as int8 tiles, a
 * record split into its signed high byte and unsigned low byte (q = 256 hi + lo), so the
 * integer sum of every 32-element unit (16 for Q6_K, whose scales cover 16) is the exact
 * one the AVX-512 kernels form, for 16 weight rows and 16 tokens at once (TDPBSSD and
 * TDPBSUD, about 4.7 ns a tile op whatever its K and N; BENCHMARKS.md, thirty-fifth
 * session).
 *
 * One arithmetic for every batch size. A (row, token) product is, in F32, eight partial
 * sums p[l] (l = the unit's index mod 8), each p[l] = fma(S, I, p[l]) over its units in
 * order, with I the unit's integer sum (converted to F32), S = (the weight's unit scale)
 * * (the record's d), and where the type has mins then p[l] = fma(m, s, p[l]) (the unit's
 * signed min: -dmin * mn for Q4_K and Q5_K, + m for Q4_1 and Q5_1; s the record's); the
 * result is ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)). The one-token kernels
 * here (decode: a row at a time on AVX-512 VNNI, eight units' sums in one vector) and
 * the tile kernel (prefill and batches of 4+ tokens: 16 rows by 16 tokens on AMX, the
 * same partial sums as vectors over tokens) both compute exactly that, so a prompt
 * gives the same bits in one call or a token a call (batch invariance). The one-token
 * kernels come twice: on the int16 records (m40_dot_q_fn) and on the same records split
 * into bytes (m40_dot_split_prep), which the matmul takes for decode: the same integers
 * in fewer instructions, the F32 part one function (amx_scale_group). The AVX-512
 * instance's kernels sum in another order: this instance has its own one-token kernels
 * for the types it tiles (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and takes the
 * AVX-512 instance's for the others (F16, F32, the quantizer, GLU, axpy).
 *
 * Linux hands out the tile registers on request (arch_prctl ARCH_REQ_XCOMP_PERM);
 * m40_amx_usable asks once for the process. M40_CPU_AMX=0 keeps the AVX-512 instance
 * (to measure one against the other). */
#include "cpu_dot.h"

#include <stdlib.h>

#if defined(__x86_64__)

#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ref/ggml_types.h"

#define AMX_AVX "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
#define AMX_FN static inline __attribute__((target(AMX_AVX), always_inline))
#define AMX_KERNEL static __attribute__((target(AMX_AVX)))
#define AMX_TILE_TARGET AMX_AVX ",amx-tile,amx-int8"
#define AMX_TILE_FN static inline __attribute__((target(AMX_TILE_TARGET), always_inline))

int m40_amx_usable(void)
{
    const char *env = getenv("M40_CPU_AMX");
    if (env && env[0] == '0')
        return 0;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
        return 0; /* AMX-TILE, AMX-INT8 */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)))
        return 0; /* OSXSAVE: xgetbv runs */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17))
        return 0; /* the OS saves the tile state (XTILECFG, XTILEDATA) */
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: without it the first tile load faults */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

AMX_FN float amx_f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* ------------------------------------------------ unit levels, as int8 */

AMX_FN int64_t amx_block_bytes(uint32_t type);

/* The 32 levels of a unit (32 elements; Q6_K: the two units of 16 in them) of `type`, in
 * element order, from the unit's block (32-element types; j unused) or its super-block
 * and its index j there (K-quants): signed, or with raw the stored ones (Q4_0's, Q5_0's
 * and Q6_K's offset of -8, -16, -32 left to the caller; Q8_0's are signed either way). */
AMX_FN __m256i amx_levels_in(uint32_t type, const uint8_t *blk, int j, int raw)
{
    switch (type) {
    case M40_TYPE_Q8_0:
        return _mm256_loadu_si256((const __m256i *)(const void *)(blk + 2));
    case M40_TYPE_Q4_0:
    case M40_TYPE_Q4_1:
    case M40_TYPE_Q5_0:
    case M40_TYPE_Q5_1: { /* d | [m] | [qh] | qs: the low nibbles are elements 0..15 */
        const int five = type == M40_TYPE_Q5_0 || type == M40_TYPE_Q5_1;
        const int min = type == M40_TYPE_Q4_1 || type == M40_TYPE_Q5_1;
        const uint8_t *b = blk;
        const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(b + 2 + (five ? 4 : 0) + (min ? 2 : 0)));
        const __m128i m = _mm_set1_epi8(15);
        __m256i l = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
        if (five) {
            uint32_t qh;
            memcpy(&qh, b + (min ? 4 : 2), 4);
            l = _mm256_or_si256(l, _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10)));
        }
        return min || raw ? l : _mm256_sub_epi8(l, _mm256_set1_epi8(five ? 16 : 8));
    }
    case M40_TYPE_Q4_K:
    case M40_TYPE_Q5_K: { /* sub-block 2c + h: the low (h 0) or high nibbles of qs[32c .. 32c + 32),
                           * Q5_K's 5th bit bit 2c + h of qh[l] */
        const int five = type == M40_TYPE_Q5_K;
        const uint8_t *sb = blk;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(sb + (five ? 48 : 16) + 32 * (j / 2)));
        __m256i l = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
        if (five) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(const void *)(sb + 16));
            const __mmask32 bit = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << j)));
            l = _mm256_or_si256(l, _mm256_maskz_mov_epi8(bit, _mm256_set1_epi8(0x10)));
        }
        return l;
    }
    default: { /* Q6_K: block jb = 4n + k of its super-block is quarter k of half n */
        const uint8_t *w = blk;
        const int jb = j, n = jb / 4, k = jb % 4;
        const __m256i A = _mm256_loadu_si256((const __m256i *)(const void *)(w + 64 * n));
        const __m256i B = _mm256_loadu_si256((const __m256i *)(const void *)(w + 64 * n + 32));
        const __m256i H = _mm256_loadu_si256((const __m256i *)(const void *)(w + 128 + 32 * n));
        const __m256i m4 = _mm256_set1_epi8(15);
        __m256i l;
        if (k == 0)
            l = _mm256_or_si256(_mm256_and_si256(A, m4),
                                _mm256_slli_epi16(_mm256_and_si256(H, _mm256_set1_epi8(3)), 4));
        else if (k == 1)
            l = _mm256_or_si256(_mm256_and_si256(B, m4),
                                _mm256_slli_epi16(_mm256_and_si256(H, _mm256_set1_epi8(0x0c)), 2));
        else if (k == 2)
            l = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4),
                                _mm256_and_si256(H, _mm256_set1_epi8(0x30)));
        else
            l = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4),
                                _mm256_srli_epi16(_mm256_and_si256(H, _mm256_set1_epi8((char)0xc0)), 2));
        return raw ? l : _mm256_sub_epi8(l, _mm256_set1_epi8(32));
    }
    }
}

/* Unit u's signed levels, from the row (the kernels' groups find the block once for 8
 * units and call amx_levels_in) */
AMX_FN __m256i amx_levels(uint32_t type, const uint8_t *row, int64_t u)
{
    if (type == M40_TYPE_Q4_K || type == M40_TYPE_Q5_K || type == M40_TYPE_Q6_K) {
        const int64_t sb = type == M40_TYPE_Q4_K ? 144 : type == M40_TYPE_Q5_K ? 176 : 210;
        return amx_levels_in(type, row + sb * (u / 8), (int)(u % 8), 0);
    }
    return amx_levels_in(type, row + amx_block_bytes(type) * u, 0, 0);
}

/* The types whose weights carry a min: a unit's term m * s beside its levels' product */
AMX_FN int amx_has_mins(uint32_t type)
{
    return type == M40_TYPE_Q4_K || type == M40_TYPE_Q5_K || type == M40_TYPE_Q4_1 || type == M40_TYPE_Q5_1;
}

/* Bytes of a 32-element block of the 32-block types */
AMX_FN int64_t amx_block_bytes(uint32_t type)
{
    return type == M40_TYPE_Q8_0   ? 34
           : type == M40_TYPE_Q4_0 ? 18
           : type == M40_TYPE_Q4_1 ? 20
           : type == M40_TYPE_Q5_0 ? 22
                                   : 24;
}

/* ------------------------------------------------ one token, one row */

/* The scales of the 8 scaled units that start at unit g (scaled units: 32 elements, Q6_K
 * 16; n of them real) of a row, and in *mins their signed mins (-dmin * mn for the
 * K-quants, m for Q4_1 and Q5_1; the caller zeroes it for the others). Each is exact in
 * F32 (an F16, or an F16 times an integer of at most 8 bits). The one-token kernels and
 * the tiles' staging both take them from here. */
AMX_FN __m256 amx_ws8(uint32_t type, const uint8_t *row, int64_t g, int n, __m256 *mins)
{
    switch (type) {
    case M40_TYPE_Q8_0:
    case M40_TYPE_Q4_0:
    case M40_TYPE_Q4_1:
    case M40_TYPE_Q5_0:
    case M40_TYPE_Q5_1: {
        const int64_t bytes = amx_block_bytes(type);
        const int min = type == M40_TYPE_Q4_1 || type == M40_TYPE_Q5_1;
        const uint8_t *b = row + bytes * g;
        __m128i h = _mm_setzero_si128(), hm = _mm_setzero_si128();
        uint16_t v;
        /* (the lane of _mm_insert_epi16 is an immediate) */
#define AMX_D(j)                                                                                                       \
    do {                                                                                                               \
        if (j < n) {                                                                                                   \
            memcpy(&v, b + bytes * j, 2);                                                                              \
            h = _mm_insert_epi16(h, v, j);                                                                             \
            if (min) {                                                                                                 \
                memcpy(&v, b + bytes * j + 2, 2);                                                                      \
                hm = _mm_insert_epi16(hm, v, j);                                                                       \
            }                                                                                                          \
        }                                                                                                              \
    } while (0)
        AMX_D(0);
        AMX_D(1);
        AMX_D(2);
        AMX_D(3);
        AMX_D(4);
        AMX_D(5);
        AMX_D(6);
        AMX_D(7);
#undef AMX_D
        if (min)
            *mins = _mm256_cvtph_ps(hm);
        return _mm256_cvtph_ps(h);
    }
    case M40_TYPE_Q4_K:
    case M40_TYPE_Q5_K: {
        const uint8_t *w = row + (type == M40_TYPE_Q5_K ? 176 : 144) * (g / 8);
        uint64_t sc, mn;
        m40_q4_k_scales8(w, &sc, &mn);
        /* negated: the min comes off (exact, as the scalar twin's -(dmin * mn)) */
        *mins =
            _mm256_xor_ps(_mm256_set1_ps(-0.0f),
                          _mm256_mul_ps(_mm256_set1_ps(amx_f16(w + 2)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)))));
        return _mm256_mul_ps(_mm256_set1_ps(amx_f16(w)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
    }
    default: {
        const uint8_t *w = row + 210 * (g / 16);
        const __m128i sc = _mm_loadl_epi64((const __m128i *)(const void *)(w + 192 + g % 16));
        return _mm256_mul_ps(_mm256_set1_ps(amx_f16(w + 208)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    }
    }
}

/* Eight units' int32 lane vectors -> their eight sums (lane j: v[j]'s lanes added). */
AMX_FN __m256i amx_reduce8(const __m256i *v)
{
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

AMX_FN float amx_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Software prefetch of the group's weight bytes AMX_PF ahead (as cpu_dot_x86.h's: a
 * decode product streams its row from memory once, and the group's instructions keep
 * too few lines in flight for the latency without it). */
#define AMX_PF 2048

/* The weight bytes of the group of 8 scaled units from g, AMX_PF ahead */
AMX_FN void amx_prefetch_group(uint32_t type, const uint8_t *w, int64_t g)
{
    const int64_t gb = type == M40_TYPE_Q4_K   ? 144
                       : type == M40_TYPE_Q5_K ? 176
                       : type == M40_TYPE_Q6_K ? 105
                                               : 8 * amx_block_bytes(type);
    const uint8_t *pw = w + gb * (g / 8) + AMX_PF;
    for (int64_t o = 0; o < gb; o += 64)
        _mm_prefetch((const char *)(pw + o), _MM_HINT_T0);
}

/* The F32 part of a group, the arithmetic every kernel of this instance shares: the 8
 * units' integer sums I (n of them real) with their records' d into the partial sums p,
 * then their mins' terms. */
AMX_FN __m256 amx_scale_group(uint32_t type, const uint8_t *w, const float *xsum, int64_t g, int n, __m256i I,
                              __m256 xd, __m256 p)
{
    const __mmask8 k = (__mmask8)((1u << n) - 1);
    __m256 mn = _mm256_setzero_ps();
    const __m256 S = _mm256_mul_ps(amx_ws8(type, w, g, n, &mn), xd);
    p = _mm256_mask3_fmadd_ps(S, _mm256_cvtepi32_ps(I), p, k);
    if (amx_has_mins(type))
        p = _mm256_mask3_fmadd_ps(mn, _mm256_maskz_loadu_ps(k, xsum + g), p, k);
    return p;
}

/* The group of 8 scaled units from unit g (n of them real) into the partial sums p. */
AMX_FN __m256 amx_group(uint32_t type, const uint8_t *w, const m40_xq *x, const float *xsum, int64_t g, int n,
                        int shared, __m256 p)
{
    const int q6 = type == M40_TYPE_Q6_K;
    const __mmask8 k = (__mmask8)((1u << n) - 1);
    amx_prefetch_group(type, w, g);
    __m256i v[8];
    if (q6) {
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j += 2)
        { /* one 32-element unit: two scaled units */
            if (j < n) {
                const int64_t u = (g + j) / 2;
                const __m256i l = amx_levels(type, w, u);
                const int16_t *q = x[u].q;
                v[j] = _mm256_dpwssd_epi32(_mm256_setzero_si256(), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(l)),
                                           _mm256_loadu_si256((const __m256i *)(const void *)q));
                v[j + 1] =
                    _mm256_dpwssd_epi32(_mm256_setzero_si256(), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(l, 1)),
                                        _mm256_loadu_si256((const __m256i *)(const void *)(q + 16)));
            } else
                v[j] = v[j + 1] = _mm256_setzero_si256();
        }
    } else {
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)
        {
            if (j < n) {
                const __m256i l = amx_levels(type, w, g + j);
                const int16_t *q = x[g + j].q;
                __m256i a = _mm256_dpwssd_epi32(_mm256_setzero_si256(), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(l)),
                                                _mm256_loadu_si256((const __m256i *)(const void *)q));
                v[j] = _mm256_dpwssd_epi32(a, _mm256_cvtepi8_epi16(_mm256_extracti128_si256(l, 1)),
                                           _mm256_loadu_si256((const __m256i *)(const void *)(q + 16)));
            } else
                v[j] = _mm256_setzero_si256();
        }
    }
    const m40_xq *x0 = &x[q6 ? g / 2 : g];
    /* the records of a super-block share d where K is a multiple of 256 (m40_xq_quantize);
     * else each unit's own (a scaled unit's record: unit j of Q6_K is in record j / 2) */
    const __m256i rec = q6 ? _mm256_setr_epi32(0, 0, 20, 20, 40, 40, 60, 60)
                           : _mm256_setr_epi32(0, 20, 40, 60, 80, 100, 120, 140); /* m40_xq: 20 floats */
    const __m256 xd =
        shared ? _mm256_set1_ps(x0->d) : _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), k, rec, &x0->d, 4);
    return amx_scale_group(type, w, xsum, g, n, amx_reduce8(v), xd, p);
}

/* The product of one row with one token's records, in the arithmetic above. */
AMX_FN float amx_dot(uint32_t type, const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)
{
    const int64_t nu = type == M40_TYPE_Q6_K ? K / 16 : K / 32; /* scaled units */
    const int shared = K % 256 == 0;
    __m256 p = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= nu; g += 8) /* whole groups: no masks to test */
        p = amx_group(type, w, x, xsum, g, 8, shared, p);
    if (g < nu)
        p = amx_group(type, w, x, xsum, g, (int)(nu - g), shared, p);
    return amx_hsum(p);
}

#define AMX_DOT(name, type)                                                                                            \
    AMX_KERNEL float amx_##name(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)                       \
    {                                                                                                                  \
        return amx_dot(type, w, x, xsum, K);                                                                           \
    }
AMX_DOT(q8_0, M40_TYPE_Q8_0)
AMX_DOT(q4_0, M40_TYPE_Q4_0)
AMX_DOT(q5_0, M40_TYPE_Q5_0)
AMX_DOT(q4_1, M40_TYPE_Q4_1)
AMX_DOT(q5_1, M40_TYPE_Q5_1)
AMX_DOT(q4_k, M40_TYPE_Q4_K)
AMX_DOT(q5_k, M40_TYPE_Q5_K)
AMX_DOT(q6_k, M40_TYPE_Q6_K)

/* ------------------------------------------------ one token, split records */

size_t m40_dot_split_bytes(int64_t nb) { return ((size_t)nb * 80 + 63) / 64 * 64; }

AMX_KERNEL void amx_split_prep(const m40_xq *x, int64_t nb, uint8_t *out)
{
    float *d = (float *)(void *)(out + 64 * nb);
    int32_t *h = (int32_t *)(void *)(d + nb), *hs = h + 2 * nb;
    for (int64_t u = 0; u < nb; u++) {
        const __m512i q = _mm512_loadu_si512((const void *)x[u].q);
        _mm256_storeu_si256((__m256i *)(void *)(out + 64 * u), _mm512_cvtepi16_epi8(q));
        _mm256_storeu_si256((__m256i *)(void *)(out + 64 * u + 32), _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8)));
        d[u] = x[u].d;
        h[2 * u] = x[u].h[0], h[2 * u + 1] = x[u].h[1];
        hs[u] = x[u].h[0] + x[u].h[1];
    }
}

void m40_dot_split_prep(const m40_xq *x, int64_t nb, void *out) { amx_split_prep(x, nb, out); }

/* A unit's integer sum of raw levels l (unsigned bytes) with the split record at xu:
 * 256 * (l . hi) + (l . lo), lane by lane (each lane's four products). */
AMX_FN __m256i amx_split_unit(__m256i l, const uint8_t *xu)
{
    const __m256i a =
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), l, _mm256_loadu_si256((const __m256i *)(const void *)(xu + 32)));
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(a, 8), _mm256_loadu_si256((const __m256i *)(const void *)xu), l);
}

/* amx_group on split records (xs, nb of them): the same integer sums, so the same p */
AMX_FN __m256 amx_sgroup(uint32_t type, const uint8_t *w, const uint8_t *xs, int64_t nb, const float *xsum, int64_t g,
                         int n, int j0, __m256 p)
{
    const int q6 = type == M40_TYPE_Q6_K;
    const int off = type == M40_TYPE_Q4_0 ? 8 : type == M40_TYPE_Q5_0 ? 16 : q6 ? 32 : 0;
    const __mmask8 k = (__mmask8)((1u << n) - 1);
    const float *xd = (const float *)(const void *)(xs + 64 * nb);
    const int32_t *xh = (const int32_t *)(const void *)(xd + nb), *xhs = xh + 2 * nb;
    amx_prefetch_group(type, w, g);
    __m256i I;
    __m256 d;
    if (q6) { /* a unit of 32 holds two scaled units: lanes 0-3 and 4-7 */
        __m256i v[4];
        const uint8_t *sb = w + 210 * (g / 16), *xu = xs + 64 * (g / 2); /* j0: g / 2 % 8, 0 or 4 */
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) v[j] =
            2 * j < n ? amx_split_unit(amx_levels_in(type, sb, j0 + j, 1), xu + 64 * j) : _mm256_setzero_si256();
        /* (v0 lo, v1 lo, v2 lo, v3 lo | v0 hi, ...) -> scaled units in order */
        I = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3])),
                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        I = _mm256_sub_epi32(I, _mm256_slli_epi32(_mm256_maskz_loadu_epi32(k, xh + g), 5));
        d = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_maskz_loadu_ps((__mmask8)((1u << (n / 2)) - 1), xd + g / 2)),
            _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    } else {
        __m256i v[8];
        const int kq = type == M40_TYPE_Q4_K || type == M40_TYPE_Q5_K;
        const int64_t bb = kq ? 0 : amx_block_bytes(type);
        const uint8_t *b0 = kq ? w + (type == M40_TYPE_Q5_K ? 176 : 144) * (g / 8) : w + bb * g, *xu = xs + 64 * g;
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) v[j] =
            j < n ? amx_split_unit(amx_levels_in(type, kq ? b0 : b0 + bb * j, j, 1), xu + 64 * j)
                  : _mm256_setzero_si256();
        I = amx_reduce8(v);
        if (off)
            I = _mm256_sub_epi32(I, _mm256_mullo_epi32(_mm256_maskz_loadu_epi32(k, xhs + g), _mm256_set1_epi32(off)));
        d = _mm256_maskz_loadu_ps(k, xd + g);
    }
    return amx_scale_group(type, w, xsum, g, n, I, d, p);
}

AMX_FN float amx_sdot(uint32_t type, const uint8_t *w, const uint8_t *xs, const float *xsum, int64_t K)
{
    const int64_t nu = type == M40_TYPE_Q6_K ? K / 16 : K / 32, nb = K / 32;
    __m256 p = _mm256_setzero_ps();
    int64_t g = 0;
    if (type == M40_TYPE_Q6_K) /* whole super-blocks (K a multiple of 256): the halves' j0 known */
        for (; g < nu; g += 16) {
            p = amx_sgroup(type, w, xs, nb, xsum, g, 8, 0, p);
            p = amx_sgroup(type, w, xs, nb, xsum, g + 8, 8, 4, p);
        }
    for (; g + 8 <= nu; g += 8)
        p = amx_sgroup(type, w, xs, nb, xsum, g, 8, 0, p);
    if (g < nu)
        p = amx_sgroup(type, w, xs, nb, xsum, g, (int)(nu - g), 0, p);
    return amx_hsum(p);
}

#define AMX_SDOT(name, type)                                                                                           \
    AMX_KERNEL float amx_s_##name(const uint8_t *w, const void *xs, const float *xsum, int64_t K)                      \
    {                                                                                                                  \
        return amx_sdot(type, w, xs, xsum, K);                                                                         \
    }
AMX_SDOT(q4_0, M40_TYPE_Q4_0)
AMX_SDOT(q5_0, M40_TYPE_Q5_0)
AMX_SDOT(q4_1, M40_TYPE_Q4_1)
AMX_SDOT(q5_1, M40_TYPE_Q5_1)
AMX_SDOT(q4_k, M40_TYPE_Q4_K)
AMX_SDOT(q5_k, M40_TYPE_Q5_K)
AMX_SDOT(q6_k, M40_TYPE_Q6_K)

/* ------------------------------------------------ tiles: 16 rows x 16 tokens */

/* The tokens' records as the tile unit's B operand (m40_dot_tile_prep): for each tile of
 * 16 tokens and unit of 32, the high bytes (8 rows of 64: row i holds elements 4i .. 4i
 * + 3 of each token, token t at byte 4t), the low bytes, then the 16 records' d and s
 * (tokens past the end: zeros). */
#define AMX_XU_BYTES (512 + 512 + 64 + 64)

size_t m40_dot_tile_prep_bytes(int32_t n, int64_t K)
{
    return (size_t)((n + 15) / 16) * (size_t)(K / 32) * AMX_XU_BYTES;
}

AMX_KERNEL void amx_prep(const m40_xq *x, const float *xsum, int64_t nb, int32_t n, int32_t tile, uint8_t *out)
{
    uint8_t *o = out + (size_t)tile * (size_t)nb * AMX_XU_BYTES;
    for (int64_t u = 0; u < nb; u++, o += AMX_XU_BYTES) {
        memset(o, 0, AMX_XU_BYTES);
        float *xd = (float *)(void *)(o + 1024), *s = xd + 16;
        for (int t = 0; t < 16 && tile * 16 + t < n; t++) {
            const m40_xq *r = &x[(size_t)(tile * 16 + t) * (size_t)nb + (size_t)u];
            const __m512i q = _mm512_loadu_si512((const void *)r->q);
            uint32_t hi[8], lo[8];
            _mm256_storeu_si256((__m256i *)(void *)hi, _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8)));
            _mm256_storeu_si256((__m256i *)(void *)lo, _mm512_cvtepi16_epi8(q));
            for (int i = 0; i < 8; i++) {
                memcpy(o + 64 * i + 4 * t, &hi[i], 4);
                memcpy(o + 512 + 64 * i + 4 * t, &lo[i], 4);
            }
            xd[t] = r->d;
            s[t] = xsum[(size_t)(tile * 16 + t) * (size_t)nb + (size_t)u];
        }
    }
}

void m40_dot_tile_prep(const m40_xq *x, const float *xsum, int64_t nb, int32_t n, int32_t tile, void *out)
{
    amx_prep(x, xsum, nb, n, tile, out);
}

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* A thread's weight staging (m40_thread_scratch slot 0): for each panel of 16 rows, its
 * units' levels [unit][16 rows][32], their scales and mins [row][scaled unit]. This many
 * bytes of panels are staged at once: every token tile then meets all of them while its
 * records stay in L2 (a 16-row panel alone would read the whole of x from L3 again for
 * each panel). */
#define AMX_STAGE_BUDGET (1u << 20)

/* Stages the nrows (<= 16) rows at w into st (the rest zero). */
AMX_FN void amx_stage_panel(uint32_t type, const uint8_t *w, size_t row_bytes, int nrows, int64_t nb, uint8_t *st)
{
    const int q6 = type == M40_TYPE_Q6_K, mins = amx_has_mins(type);
    const int64_t nu = q6 ? 2 * nb : nb;
    int8_t *lv = (int8_t *)st;
    float *wsc = (float *)(void *)(st + (size_t)nb * 512), *wmn = wsc + (size_t)nu * 16;
    for (int64_t u = 0; u < nb; u++)
        for (int r = 0; r < 16; r++) {
            __m256i l = r < nrows ? amx_levels(type, w + (size_t)r * row_bytes, u) : _mm256_setzero_si256();
            _mm256_storeu_si256((__m256i *)(void *)(lv + 512 * u + 32 * r), l);
        }
    /* scales and mins [row][scaled unit]: the one-token kernel's vectors (amx_ws8) */
    memset(wsc, 0, (size_t)nu * 16 * sizeof *wsc * (mins ? 2 : 1));
    for (int r = 0; r < nrows; r++)
        for (int64_t g = 0; g < nu; g += 8) {
            const int n = nu - g < 8 ? (int)(nu - g) : 8;
            const __mmask8 k = (__mmask8)((1u << n) - 1);
            __m256 mn = _mm256_setzero_ps();
            _mm256_mask_storeu_ps(wsc + r * nu + g, k, amx_ws8(type, w + (size_t)r * row_bytes, g, n, &mn));
            if (mins)
                _mm256_mask_storeu_ps(wmn + r * nu + g, k, mn);
        }
}

/* One staged panel (st) against one tile of 16 tokens (xt: its prepared records):
 * out[t * ostride + r] for r < nrows and tokens t < nt. The tile configuration is
 * loaded. */
AMX_TILE_FN void amx_panel_tile(uint32_t type, const uint8_t *st, int nrows, int64_t nb, const uint8_t *xt, int nt,
                                float *out, int64_t ostride)
{
    const int q6 = type == M40_TYPE_Q6_K, mins = amx_has_mins(type);
    const int64_t nu = q6 ? 2 * nb : nb;
    const int8_t *lv = (const int8_t *)st;
    const float *wsc = (const float *)(const void *)(st + (size_t)nb * 512), *wmn = wsc + (size_t)nu * 16;
    int32_t c[2][16][16] __attribute__((aligned(64)));
    float p[8][16][16] __attribute__((aligned(64))); /* partial sums [l][row][token] */
    for (int64_t l = nu; l < 8; l++)                 /* lanes without a unit (K < 256) */
        memset(p[l], 0, sizeof p[l]);
        /* Unit su's products go to tiles (0, 1) or (5, 6) by its parity, with its levels in 2
         * or 7: the next unit's products are issued before this one's sums are read back,
         * so the tile unit works while the vector unit scales (one pair: about half the
         * speed; BENCHMARKS.md, thirty-fifth session). */
#define AMX_ISSUE(C0, C1, W, su_)                                                                                      \
    do {                                                                                                               \
        const int64_t u_ = q6 ? (su_) / 2 : (su_), h_ = q6 ? (su_) % 2 : 0;                                            \
        const uint8_t *x_ = xt + (size_t)u_ * AMX_XU_BYTES + 256 * h_;                                                 \
        _tile_zero(C0);                                                                                                \
        _tile_zero(C1);                                                                                                \
        _tile_loadd(W, lv + 512 * u_ + 16 * h_, 32);                                                                   \
        _tile_loadd(3, x_, 64);                                                                                        \
        _tile_loadd(4, x_ + 512, 64);                                                                                  \
        _tile_dpbssd(C0, W, 3);                                                                                        \
        _tile_dpbsud(C1, W, 4);                                                                                        \
    } while (0)
    AMX_ISSUE(0, 1, 2, 0);
    for (int64_t su = 0; su < nu; su++) { /* scaled units */
        const int64_t u = q6 ? su / 2 : su;
        const uint8_t *xu = xt + (size_t)u * AMX_XU_BYTES;
        if (su % 2 == 0) {
            if (su + 1 < nu)
                AMX_ISSUE(5, 6, 7, su + 1);
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
        } else {
            if (su + 1 < nu)
                AMX_ISSUE(0, 1, 2, su + 1);
            _tile_stored(5, c[0], 64);
            _tile_stored(6, c[1], 64);
        }
        const __m512 xd = _mm512_loadu_ps((const float *)(const void *)(xu + 1024));
        const __m512 s = _mm512_loadu_ps((const float *)(const void *)(xu + 1088));
        float *pl = &p[su % 8][0][0];
        for (int r = 0; r < 16; r++) {
            const __m512i I = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)c[0][r]), 8),
                                               _mm512_load_si512((const void *)c[1][r]));
            const __m512 S = _mm512_mul_ps(_mm512_set1_ps(wsc[r * nu + su]), xd);
            /* a lane's first unit adds to 0, as the one-token kernel's zeroed lanes */
            __m512 acc =
                _mm512_fmadd_ps(S, _mm512_cvtepi32_ps(I), su < 8 ? _mm512_setzero_ps() : _mm512_load_ps(pl + 16 * r));
            if (mins)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(wmn[r * nu + su]), s, acc);
            _mm512_store_ps(pl + 16 * r, acc);
        }
    }
#undef AMX_ISSUE
    for (int r = 0; r < nrows; r++) {
        const __m512 f = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_load_ps(p[0][r]), _mm512_load_ps(p[4][r])),
                                                     _mm512_add_ps(_mm512_load_ps(p[2][r]), _mm512_load_ps(p[6][r]))),
                                       _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(p[1][r]), _mm512_load_ps(p[5][r])),
                                                     _mm512_add_ps(_mm512_load_ps(p[3][r]), _mm512_load_ps(p[7][r]))));
        float v[16];
        _mm512_storeu_ps(v, f);
        for (int t = 0; t < nt; t++)
            out[(int64_t)t * ostride + r] = v[t];
    }
}

/* out[t * ostride + r] = row r of the nrows at w . token t, t < n, from the prepared
 * records xp (m40_dot_tile_prep): groups of 16-row panels staged at once, every token
 * tile against each group. -1: no memory for the staging. */
AMX_TILE_FN int amx_tile(uint32_t type, const uint8_t *w, size_t row_bytes, int nrows, int64_t K, const void *xp,
                         int32_t n, float *out, int64_t ostride)
{
    const int q6 = type == M40_TYPE_Q6_K;
    const int64_t nb = K / 32, nu = q6 ? 2 * nb : nb;
    const size_t panel = ((size_t)nb * 512 + (size_t)nu * 64 + (size_t)nb * 64 + 63) / 64 * 64;
    const int npanels = (nrows + 15) / 16;
    int group = (int)(AMX_STAGE_BUDGET / panel);
    group = group < 1 ? 1 : group > npanels ? npanels : group;
    uint8_t *amx_stage = m40_thread_scratch(0, (size_t)group * panel);
    if (!amx_stage)
        return -1;
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i += 5) { /* two sets: C 16 rows x 16 tokens, A the rows' levels */
        cfg.rows[i] = cfg.rows[i + 1] = 16, cfg.colsb[i] = cfg.colsb[i + 1] = 64;
        cfg.rows[i + 2] = 16, cfg.colsb[i + 2] = q6 ? 16 : 32;
    }
    cfg.rows[3] = cfg.rows[4] = q6 ? 4 : 8, cfg.colsb[3] = cfg.colsb[4] = 64; /* B: records */
    _tile_loadconfig(&cfg);
    for (int p0 = 0; p0 < npanels; p0 += group) {
        const int g = npanels - p0 < group ? npanels - p0 : group;
        for (int q = 0; q < g; q++) {
            const int r0 = 16 * (p0 + q);
            amx_stage_panel(type, w + (size_t)r0 * row_bytes, row_bytes, nrows - r0 < 16 ? nrows - r0 : 16, nb,
                            amx_stage + (size_t)q * panel);
        }
        for (int32_t tile = 0; tile * 16 < n; tile++) {
            const uint8_t *xt = (const uint8_t *)xp + (size_t)tile * (size_t)nb * AMX_XU_BYTES;
            const int nt = n - tile * 16 < 16 ? n - tile * 16 : 16;
            for (int q = 0; q < g; q++) {
                const int r0 = 16 * (p0 + q);
                amx_panel_tile(type, amx_stage + (size_t)q * panel, nrows - r0 < 16 ? nrows - r0 : 16, nb, xt, nt,
                               out + (int64_t)tile * 16 * ostride + r0, ostride);
            }
        }
    }
    _tile_release();
    return 0;
}

#define AMX_TILE(name, type)                                                                                           \
    static __attribute__((target(AMX_TILE_TARGET))) int amx_tile_##name(const uint8_t *w, size_t row_bytes, int nrows, \
                                                                        int64_t K, const void *xp, int32_t n,          \
                                                                        float *out, int64_t ostride)                   \
    {                                                                                                                  \
        return amx_tile(type, w, row_bytes, nrows, K, xp, n, out, ostride);                                            \
    }
AMX_TILE(q8_0, M40_TYPE_Q8_0)
AMX_TILE(q4_0, M40_TYPE_Q4_0)
AMX_TILE(q5_0, M40_TYPE_Q5_0)
AMX_TILE(q4_1, M40_TYPE_Q4_1)
AMX_TILE(q5_1, M40_TYPE_Q5_1)
AMX_TILE(q4_k, M40_TYPE_Q4_K)
AMX_TILE(q5_k, M40_TYPE_Q5_K)
AMX_TILE(q6_k, M40_TYPE_Q6_K)

/* ------------------------------------------------ the instance */

static const m40_cpu_kernels *amx_base(void) { return m40_cpu_kernels_avx512(); }

/* The tiled types: their one-token kernel and their tile kernel */
static const struct {
    uint32_t type;
    m40_dot_q_fn q;
    m40_dot_tile_fn tile;
    m40_dot_s_fn split; /* NULL for Q8_0: its signed levels meet signed high bytes */
} amx_types[] = {
    {M40_TYPE_Q8_0, amx_q8_0, amx_tile_q8_0, NULL},       {M40_TYPE_Q4_0, amx_q4_0, amx_tile_q4_0, amx_s_q4_0},
    {M40_TYPE_Q5_0, amx_q5_0, amx_tile_q5_0, amx_s_q5_0}, {M40_TYPE_Q4_1, amx_q4_1, amx_tile_q4_1, amx_s_q4_1},
    {M40_TYPE_Q5_1, amx_q5_1, amx_tile_q5_1, amx_s_q5_1}, {M40_TYPE_Q4_K, amx_q4_k, amx_tile_q4_k, amx_s_q4_k},
    {M40_TYPE_Q5_K, amx_q5_k, amx_tile_q5_k, amx_s_q5_k}, {M40_TYPE_Q6_K, amx_q6_k, amx_tile_q6_k, amx_s_q6_k},
};

static int amx_find(uint32_t type)
{
    for (size_t i = 0; i < sizeof amx_types / sizeof amx_types[0]; i++)
        if (amx_types[i].type == type)
            return (int)i;
    return -1;
}

static m40_dot_q_fn amx_table_q(uint32_t type)
{
    const int i = amx_find(type);
    return i >= 0 ? amx_types[i].q : amx_base()->q(type);
}

static m40_dot_tile_fn amx_table_tile(uint32_t type)
{
    const int i = amx_find(type);
    return i >= 0 ? amx_types[i].tile : NULL;
}

static m40_dot_s_fn amx_table_split(uint32_t type)
{
    const int i = amx_find(type);
    return i >= 0 ? amx_types[i].split : NULL;
}

/* the tiled types have no piecewise kernel here: batches of 4+ tokens take the tiles */
static m40_dot_part_fn amx_table_part(uint32_t type) { return amx_table_tile(type) ? NULL : amx_base()->part(type); }
static m40_dot_fin_fn amx_table_fin(uint32_t type) { return amx_table_tile(type) ? NULL : amx_base()->fin(type); }
static m40_dot_f_fn amx_table_f(uint32_t type) { return amx_base()->f(type); }
static m40_glu_fn amx_table_glu(int act) { return amx_base()->glu ? amx_base()->glu(act) : NULL; }

static m40_cpu_kernels amx_kernels;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

/* The table takes the AVX-512 instance's quantizer and axpy (its own file's statics) */
static void amx_kernels_init(void)
{
    const m40_cpu_kernels *b = amx_base();
    amx_kernels = (m40_cpu_kernels){.q = amx_table_q,
                                    .part = amx_table_part,
                                    .fin = amx_table_fin,
                                    .f = amx_table_f,
                                    .glu = amx_table_glu,
                                    .quantize = b->quantize,
                                    .axpy = b->axpy,
                                    .tile = amx_table_tile,
                                    .split = amx_table_split};
}

const m40_cpu_kernels *m40_cpu_kernels_amx(void)
{
    if (!amx_base())
        return NULL;
    pthread_once(&amx_once, amx_kernels_init);
    return &amx_kernels;
}

#else

int m40_amx_usable(void) { return 0; }
const m40_cpu_kernels *m40_cpu_kernels_amx(void) { return NULL; }
size_t m40_dot_tile_prep_bytes(int32_t n, int64_t K)
{
    (void)n, (void)K;
    return 0;
}
void m40_dot_tile_prep(const m40_xq *x, const float *xsum, int64_t nb, int32_t n, int32_t tile, void *out)
{
    (void)x, (void)xsum, (void)nb, (void)n, (void)tile, (void)out;
}
size_t m40_dot_split_bytes(int64_t nb)
{
    (void)nb;
    return 0;
}
void m40_dot_split_prep(const m40_xq *x, int64_t nb, void *out) { (void)x, (void)nb, (void)out; }

#endif
