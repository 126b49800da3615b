/* Greedy sampling helpers: one block per row. Pass 1 finds the max (lowest id on ties)
 * and the log-sum-exp; each of the top_k further passes finds the largest entry that
 * comes after the previous pick in (value descending, id ascending) order, so no list
 * of taken ids is needed. NaN logits are never picked. */
#include "cuda_common.h"

#include <math.h>

#define SAMPLE_THREADS 1024

/* (value, id) a precedes b: larger value, or equal value and smaller id */
__device__ __forceinline__ bool s_before(float va, int ia, float vb, int ib)
{
    return va > vb || (va == vb && ia < ib);
}

/* the block's best of every thread's (bv, bi), to every thread */
__device__ void s_reduce_best(float *sv, int *si, float &bv, int &bi)
{
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || s_before(ov, oi, bv, bi)))
            bv = ov, bi = oi;
    }
    const int w = threadIdx.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        sv[w] = bv, si[w] = bi;
    __syncthreads();
    bv = -INFINITY, bi = -1;
    for (int j = 0; j < (int)(blockDim.x >> 5); j++)
        if (si[j] >= 0 && (bi < 0 || s_before(sv[j], si[j], bv, bi)))
            bv = sv[j], bi = si[j];
}

/* block-wide best (value, id) among entries strictly after (pv, pi) */
__device__ void s_best_after(const float *l, int n, float pv, int pi, bool bounded, float *sv, int *si, float &bv,
                             int &bi)
{
    bv = -INFINITY;
    bi = -1;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = l[i];
        if (v != v)
            continue;
        if (bounded && !s_before(pv, pi, v, i))
            continue;
        if (bi < 0 || s_before(v, i, bv, bi))
            bv = v, bi = i;
    }
    s_reduce_best(sv, si, bv, bi);
}

/* Rows of up to SAMPLE_REG * SAMPLE_THREADS entries (32,768: Llama 2's and Mistral's
 * 32,000 and 32,768) are read once, in one round of loads into registers
 * (constant offsets from one address: 32 values fit the 64 registers a thread has at
 * 1024 threads): each thread finds its best entry and the sum of exp over its entries
 * relative to its own max, and the block combines those (sums rescaled to the row's
 * max). At the end of a decode step this kernel is on the step's path, and the loops'
 * rounds of dependent loads were most of its time. Longer rows take the loops. */
#define SAMPLE_REG 32

__global__ __launch_bounds__(SAMPLE_THREADS) void sample_greedy_kernel(const float *__restrict__ logits, int64_t stride,
                                                                       int n_vocab, int32_t *token, float *logprob,
                                                                       int top_k, int32_t *top_tokens,
                                                                       float *top_logprobs)
{
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float red[32];
    m40k_pdl_begin(); /* PDL-launched after the head's product */
    M40K_LAUNDER(logits);
    const float *l = logits + blockIdx.x * stride;
    float bv;
    int bi;
    float sum = 0.0f;
    if (n_vocab <= SAMPLE_REG * SAMPLE_THREADS) {
        /* entry threadIdx.x + k*SAMPLE_THREADS (constant offsets from one address);
         * NaN past the row (skipped as NaN logits are) */
        float r[SAMPLE_REG];
        const float *lt = l + threadIdx.x;
        const int nt = n_vocab - (int)threadIdx.x; /* entries of this thread: k*SAMPLE_THREADS < nt */
#pragma unroll
        for (int k = 0; k < SAMPLE_REG; k++)
            r[k] = k * SAMPLE_THREADS < nt ? lt[k * SAMPLE_THREADS] : NAN;
        bv = -INFINITY;
        bi = -1;
#pragma unroll
        for (int k = 0; k < SAMPLE_REG; k++) {
            const int i = threadIdx.x + k * SAMPLE_THREADS;
            if (r[k] == r[k] && (bi < 0 || s_before(r[k], i, bv, bi)))
                bv = r[k], bi = i;
        }
        const float mt = bi >= 0 ? bv : 0.0f; /* the thread's own max */
        float st = 0.0f;
#pragma unroll
        for (int k = 0; k < SAMPLE_REG; k++)
            if (r[k] == r[k])
                st += __expf(r[k] - mt);
        const bool some = bi >= 0;
        s_reduce_best(sv, si, bv, bi);
        if (some)
            sum = st * __expf(mt - (bi >= 0 ? bv : 0.0f));
    } else {
        s_best_after(l, n_vocab, 0.0f, 0, false, sv, si, bv, bi);
        const float mx = bi >= 0 ? bv : 0.0f;
        for (int i = threadIdx.x; i < n_vocab; i += blockDim.x)
            if (l[i] == l[i])
                sum += __expf(l[i] - mx);
    }
    const float mx = bi >= 0 ? bv : 0.0f;
    sum = m40k_warp_sum(sum);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = sum;
    __syncthreads();
    float total = 0.0f;
    for (int j = 0; j < (int)(blockDim.x >> 5); j++)
        total += red[j];
    const float lse = mx + logf(total);
    if (threadIdx.x == 0) {
        token[blockIdx.x] = bi;
        logprob[blockIdx.x] = bi >= 0 ? bv - lse : -INFINITY;
    }
    float pv = bv;
    int pi = bi;
    for (int j = 0; j < top_k; j++) {
        if (j > 0)
            s_best_after(l, n_vocab, pv, pi, true, sv, si, pv, pi);
        if (threadIdx.x == 0) {
            top_tokens[blockIdx.x * top_k + j] = pi;
            top_logprobs[blockIdx.x * top_k + j] = pi >= 0 ? pv - lse : -INFINITY;
        }
        if (pi < 0)
            pv = -INFINITY; /* nothing left: the rest stay -1 */
    }
}

extern "C" int m40k_sample_greedy(const float *logits, int64_t stride, int rows, int n_vocab, int32_t *token,
                                  float *logprob, int top_k, int32_t *top_tokens, float *top_logprobs,
                                  m40k_stream stream)
{
    if (rows <= 0)
        return 0;
    if (n_vocab <= 0 || top_k < 0 || top_k > 32 || (top_k > 0 && (!top_tokens || !top_logprobs)))
        return M40K_INVALID;
    M40K_LAUNCH_PDL(sample_greedy_kernel, rows, SAMPLE_THREADS, 0, stream, logits, stride, n_vocab, token, logprob,
                    top_k, top_tokens, top_logprobs);
    return m40k_launch_status();
}

/* ---- full sampling (m40k_sample, kernels.h 9b) ----
 * One block per sequence. Passes over the row: bias and penalties (the listed entries
 * only), max + argmax, sum of exp for the logprobs (plus the total fixed-point mass when
 * top-p needs it), then radix descents. A descent finds the first element of the rank
 * order (ordered float key descending, id ascending) whose inclusive count reaches K or
 * whose inclusive mass reaches T: four passes build 256-bucket histograms (count and
 * mass) of one key byte among the elements that share the bytes chosen so far; a
 * bucket holding a single element ends it early; equal keys (whose masses are equal)
 * are resolved arithmetically plus one ordered scan for the j-th id. Every mass is an
 * integer, so the GPU's sums equal the CPU twin's whatever the order. */

#define FIXP 1099511627776.0f /* 2^40 */

__device__ __forceinline__ float smp_lv(float x) { return x != x ? -INFINITY : x == 0.0f ? 0.0f : x; }

/* m40_ref_sample_exp, operation for operation (no fused multiply-add) */
__device__ __forceinline__ float smp_exp(float x)
{
    if (!(x > -32.0f))
        return 0.0f;
    const float n = rintf(__fmul_rn(x, 1.44269504f));
    float r = __fsub_rn(x, __fmul_rn(n, 0.693145751953125f));
    r = __fsub_rn(r, __fmul_rn(n, 1.42860677e-06f));
    float p = 1.0f / 720.0f;
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 120.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 24.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 6.0f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return __fmul_rn(p, __uint_as_float((uint32_t)(127 + (int)n) << 23));
}

struct smp_shared {
    uint32_t cnt[256];
    unsigned long long mass[256];
    int last[256];
    float fred[32];
    unsigned long long ured[32];
    uint32_t wcount[32];
    int b;
    uint32_t c_above;
    unsigned long long m_above;
    int found;
    int n_top;
    int top[20];
};

struct smp_ctx {
    const float *l;
    int n;
    float max, temp;
};

/* probability of logit x at the context's temperature, and its fixed-point mass */
__device__ __forceinline__ float smp_prob(const smp_ctx &c, float x)
{
    return smp_exp(__fdiv_rn(__fsub_rn(smp_lv(x), c.max), c.temp));
}
__device__ __forceinline__ uint64_t smp_mass(const smp_ctx &c, float x)
{
    return (uint64_t)__fmul_rn(smp_prob(c, x), FIXP);
}

struct smp_sel {
    int id; /* -1: no element satisfies the condition */
    uint32_t key;
    uint32_t cnt;  /* inclusive count up to and with it */
    uint64_t mass; /* inclusive mass */
};

__device__ float smp_block_sum_f(float v, smp_shared &sh)
{
    v = m40k_warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        sh.fred[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.0f;
    for (int j = 0; j < (int)(blockDim.x >> 5); j++)
        t += sh.fred[j];
    return t;
}

__device__ uint64_t smp_block_sum_u64(uint64_t v, smp_shared &sh)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, (unsigned long long)v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        sh.ured[threadIdx.x >> 5] = v;
    __syncthreads();
    uint64_t t = 0;
    for (int j = 0; j < (int)(blockDim.x >> 5); j++)
        t += sh.ured[j];
    return t;
}

/* block-wide first in rank order of (key, id) pairs (id -1: none), result in every thread */
__device__ void smp_first_rank(uint32_t &key, int &id, smp_shared &sh)
{
    for (int o = 16; o > 0; o >>= 1) {
        const uint32_t ok = __shfl_xor_sync(0xffffffffu, key, o);
        const int oi = __shfl_xor_sync(0xffffffffu, id, o);
        if (oi >= 0 && (id < 0 || ok > key || (ok == key && oi < id)))
            key = ok, id = oi;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        sh.wcount[threadIdx.x >> 5] = key, sh.last[threadIdx.x >> 5] = id;
    __syncthreads();
    key = 0, id = -1;
    for (int j = 0; j < (int)(blockDim.x >> 5); j++) {
        const uint32_t ok = sh.wcount[j];
        const int oi = sh.last[j];
        if (oi >= 0 && (id < 0 || ok > key || (ok == key && oi < id)))
            key = ok, id = oi;
    }
}

/* id of the j-th (1-based) element, in id order, whose key equals `key` */
__device__ int smp_nth_with_key(const smp_ctx &c, uint32_t key, uint32_t j, smp_shared &sh)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    uint32_t base = 0;
    __syncthreads();
    if (threadIdx.x == 0)
        sh.found = -1;
    for (int t0 = 0; t0 < c.n; t0 += blockDim.x) {
        const int i = t0 + threadIdx.x;
        const bool f = i < c.n && m40k_rank_key(c.l[i]) == key;
        const uint32_t bal = __ballot_sync(0xffffffffu, f);
        __syncthreads();
        if (lane == 0)
            sh.wcount[w] = __popc(bal);
        __syncthreads();
        uint32_t before = base, total = 0;
        for (int u = 0; u < nw; u++) {
            if (u < w)
                before += sh.wcount[u];
            total += sh.wcount[u];
        }
        before += __popc(bal & ((1u << lane) - 1u));
        if (f && before + 1 == j)
            sh.found = i;
        base += total;
        if (base >= j)
            break;
    }
    __syncthreads();
    return sh.found;
}

/* first element of the rank order with inclusive count >= K or inclusive mass >= T */
__device__ smp_sel smp_descend(const smp_ctx &c, uint32_t K, uint64_t T, smp_shared &sh)
{
    uint32_t prefix = 0, c_above = 0;
    uint64_t m_above = 0;
    smp_sel r = {-1, 0, 0, 0};
    for (int d = 0; d < 4; d++) {
        const int shift = 24 - 8 * d;
        __syncthreads();
        if (threadIdx.x < 256)
            sh.cnt[threadIdx.x] = 0, sh.mass[threadIdx.x] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < c.n; i += blockDim.x) {
            const float x = c.l[i];
            const uint32_t key = m40k_rank_key(x);
            if (d > 0 && (key >> (shift + 8)) != prefix)
                continue;
            const int b = (key >> shift) & 255;
            atomicAdd(&sh.cnt[b], 1u);
            const uint64_t m = smp_mass(c, x);
            if (m)
                atomicAdd(&sh.mass[b], (unsigned long long)m);
            sh.last[b] = i;
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            uint32_t lc = 0;
            uint64_t lm = 0;
            for (int k = 0; k < 8; k++) {
                const int b = 255 - (lane * 8 + k);
                lc += sh.cnt[b];
                lm += sh.mass[b];
            }
            uint32_t ic = lc;
            uint64_t im = lm;
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t tc = __shfl_up_sync(0xffffffffu, ic, o);
                const uint64_t tm = __shfl_up_sync(0xffffffffu, (unsigned long long)im, o);
                if (lane >= o)
                    ic += tc, im += tm;
            }
            uint32_t cc = c_above + ic - lc;
            uint64_t mm = m_above + im - lm;
            int found = -1;
            for (int k = 0; k < 8; k++) {
                const int b = 255 - (lane * 8 + k);
                if (sh.cnt[b] && (cc + sh.cnt[b] >= K || mm + sh.mass[b] >= T)) {
                    found = b;
                    break;
                }
                cc += sh.cnt[b];
                mm += sh.mass[b];
            }
            const uint32_t bal = __ballot_sync(0xffffffffu, found >= 0);
            if (bal == 0) {
                if (lane == 0)
                    sh.b = -1;
            } else if (lane == __ffs(bal) - 1) {
                sh.b = found, sh.c_above = cc, sh.m_above = mm;
            }
        }
        __syncthreads();
        const int b = sh.b;
        if (b < 0)
            return r;
        c_above = sh.c_above;
        m_above = sh.m_above;
        prefix = (prefix << 8) | (uint32_t)b;
        const uint32_t nb = sh.cnt[b];
        const uint64_t mb = sh.mass[b];
        if (nb == 1) {
            const int id = sh.last[b];
            r.id = id;
            r.key = m40k_rank_key(c.l[id]);
            r.cnt = c_above + 1;
            r.mass = m_above + smp_mass(c, c.l[id]);
            return r;
        }
        if (d == 3) {
            /* nb elements with the very same key: equal masses q, taken in id order */
            const uint64_t q = mb / nb;
            uint64_t j = K > c_above ? (uint64_t)(K - c_above) : 1;
            if (q > 0) {
                /* smallest j with m_above + j * q >= T, i.e. ceil((T - m_above) / q), computed
                 * without overflow: T is ~0 ("no mass condition") for the top-k and top-N
                 * descents, where T - m_above + q - 1 used to wrap around to a tiny value */
                const uint64_t need = T > m_above ? T - m_above : 1;
                const uint64_t jm = need / q + (need % q != 0);
                if (jm < j)
                    j = jm;
            }
            if (j < 1)
                j = 1;
            if (j > nb)
                j = nb;
            r.id = smp_nth_with_key(c, prefix, (uint32_t)j, sh);
            r.key = prefix;
            r.cnt = c_above + (uint32_t)j;
            r.mass = m_above + j * q;
            return r;
        }
    }
    return r;
}

__device__ __forceinline__ bool smp_ranked_le(uint32_t key, int id, const smp_sel &e)
{
    return key > e.key || (key == e.key && id <= e.id);
}

__global__ __launch_bounds__(SAMPLE_THREADS) void sample_kernel(
    float *__restrict__ logits, int64_t stride, int n_vocab, const m40k_sample_params *__restrict__ params,
    const int32_t *bias_indptr, const int32_t *bias_ids, const float *bias_values, const int32_t *pen_indptr,
    const int32_t *pen_ids, const int32_t *pen_counts, int32_t *token, float *logprob, int n_top, int32_t *top_ids,
    float *top_logprobs)
{
    __shared__ smp_shared sh;
    __shared__ float sv[32];
    __shared__ int si[32];
    const int s = blockIdx.x;
    float *l = logits + (int64_t)s * stride;
    const m40k_sample_params P = params[s];

    if (bias_indptr && threadIdx.x == 0)
        for (int j = bias_indptr[s]; j < bias_indptr[s + 1]; j++) {
            const int id = bias_ids[j];
            if (id >= 0 && id < n_vocab)
                l[id] = __fadd_rn(l[id], bias_values[j]);
        }
    __syncthreads();
    if (pen_indptr)
        for (int j = pen_indptr[s] + threadIdx.x; j < pen_indptr[s + 1]; j += blockDim.x) {
            const int id = pen_ids[j];
            if (id < 0 || id >= n_vocab)
                continue;
            float x = l[id];
            if (P.repetition_penalty != 1.0f)
                x = x > 0 ? __fdiv_rn(x, P.repetition_penalty) : __fmul_rn(x, P.repetition_penalty);
            const float d = __fadd_rn(__fmul_rn((float)pen_counts[j], P.frequency_penalty), P.presence_penalty);
            l[id] = __fsub_rn(x, d);
        }
    __syncthreads();

    /* max and argmax (first in rank order): NaN counts as -inf, so something is found */
    float bv = -INFINITY;
    int bi = -1;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float v = smp_lv(l[i]);
        if (bi < 0 || s_before(v, i, bv, bi))
            bv = v, bi = i;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || s_before(ov, oi, bv, bi)))
            bv = ov, bi = oi;
    }
    if ((threadIdx.x & 31) == 0)
        sv[threadIdx.x >> 5] = bv, si[threadIdx.x >> 5] = bi;
    __syncthreads();
    bv = -INFINITY, bi = -1;
    for (int j = 0; j < (int)(blockDim.x >> 5); j++)
        if (si[j] >= 0 && (bi < 0 || s_before(sv[j], si[j], bv, bi)))
            bv = sv[j], bi = si[j];
    const float max = bv;
    const bool finite = isfinite(max);
    const bool greedy = !(P.temperature > 0.0f) || P.top_k == 1 || !finite;
    const int k_eff = P.top_k > 0 && P.top_k < n_vocab ? P.top_k : n_vocab;
    const bool use_top_p = !greedy && P.top_p < 1.0f;

    smp_ctx c;
    c.l = l;
    c.n = n_vocab;
    c.max = max;
    c.temp = greedy ? 1.0f : P.temperature;

    float sum = 0.0f;
    uint64_t total = 0;
    const bool need_total = use_top_p && k_eff == n_vocab;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float x = l[i];
        if (finite)
            sum += expf(smp_lv(x) - max);
        if (need_total)
            total += smp_mass(c, x);
    }
    sum = smp_block_sum_f(sum, sh);
    if (need_total)
        total = smp_block_sum_u64(total, sh);
    const float lse = finite ? max + logf(sum) : max;

    int tok = bi;
    if (!greedy) {
        /* cut after top-k and top-p: element e2 (none: the whole row) */
        smp_sel e2 = {-1, 0, 0, 0};
        if (k_eff < n_vocab) {
            e2 = smp_descend(c, (uint32_t)k_eff, ~0ull, sh);
            total = e2.mass;
        }
        if (use_top_p) {
            const double t = ceil((double)P.top_p * (double)total);
            const uint64_t thr = t < 1.0 ? 1 : t >= (double)total ? total : (uint64_t)t;
            e2 = smp_descend(c, (uint32_t)k_eff, thr, sh);
        }
        uint64_t kept = e2.id >= 0 ? e2.mass : total;
        if (e2.id < 0 && !need_total && !(P.min_p > 0.0f)) { /* no cut at all: the whole row */
            uint64_t m = 0;
            for (int i = threadIdx.x; i < n_vocab; i += blockDim.x)
                m += smp_mass(c, l[i]);
            kept = smp_block_sum_u64(m, sh);
        }
        if (P.min_p > 0.0f) {
            /* the kept prefix ends before the first element (in rank order, up to e2)
             * with p < min_p; the first element has p = 1 and always stays */
            const float min_p = P.min_p < 1.0f ? P.min_p : 1.0f;
            uint32_t fk = 0;
            int fi = -1;
            for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
                const float x = l[i];
                const uint32_t key = m40k_rank_key(x);
                if (e2.id >= 0 && !smp_ranked_le(key, i, e2))
                    continue;
                if (fi >= 0 && !(key > fk || (key == fk && i < fi)))
                    continue;
                if (smp_prob(c, x) < min_p)
                    fk = key, fi = i;
            }
            smp_first_rank(fk, fi, sh);
            uint64_t m = 0;
            for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
                const float x = l[i];
                const uint32_t key = m40k_rank_key(x);
                if (e2.id >= 0 && !smp_ranked_le(key, i, e2))
                    continue;
                if (fi >= 0 && !(key > fk || (key == fk && i < fi)))
                    continue;
                m += smp_mass(c, x);
            }
            kept = smp_block_sum_u64(m, sh);
        }
        const uint64_t r = __umul64hi(m40k_sample_random(P.seed, P.step), kept);
        const smp_sel e = smp_descend(c, ~0u, r + 1, sh);
        tok = e.id >= 0 ? e.id : bi;
    }
    if (threadIdx.x == 0) {
        token[s] = tok;
        logprob[s] = smp_lv(l[tok]) - lse;
    }

    if (n_top > 0) {
        const int nt = n_top < n_vocab ? n_top : n_vocab;
        c.temp = 1.0f; /* masses are not used here */
        const smp_sel e = smp_descend(c, (uint32_t)nt, ~0ull, sh);
        __syncthreads();
        if (threadIdx.x == 0)
            sh.n_top = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n_vocab; i += blockDim.x)
            if (smp_ranked_le(m40k_rank_key(l[i]), i, e)) {
                const int slot = atomicAdd(&sh.n_top, 1);
                if (slot < 20)
                    sh.top[slot] = i;
            }
        __syncthreads();
        if (threadIdx.x == 0) {
            const int have = sh.n_top < nt ? sh.n_top : nt;
            for (int a = 1; a < have; a++) { /* insertion sort in rank order */
                const int id = sh.top[a];
                const uint32_t key = m40k_rank_key(l[id]);
                int b = a;
                while (b > 0) {
                    const uint32_t kb = m40k_rank_key(l[sh.top[b - 1]]);
                    if (kb > key || (kb == key && sh.top[b - 1] < id))
                        break;
                    sh.top[b] = sh.top[b - 1];
                    b--;
                }
                sh.top[b] = id;
            }
            for (int j = 0; j < n_top; j++) {
                const int id = j < have ? sh.top[j] : -1;
                top_ids[s * n_top + j] = id;
                top_logprobs[s * n_top + j] = id >= 0 ? smp_lv(l[id]) - lse : -INFINITY;
            }
        }
    }
}

extern "C" int m40k_sample(float *logits, int64_t stride, int n_seq, int n_vocab, const m40k_sample_params *params,
                           const int32_t *bias_indptr, const int32_t *bias_ids, const float *bias_values,
                           const int32_t *pen_indptr, const int32_t *pen_ids, const int32_t *pen_counts,
                           int32_t *token, float *logprob, int n_top, int32_t *top_ids, float *top_logprobs,
                           m40k_stream stream)
{
    if (n_seq <= 0)
        return 0;
    if (n_vocab <= 0 || n_vocab > (1 << 23) || stride < n_vocab || !logits || !params || !token || !logprob ||
        n_top < 0 || n_top > 20 || (n_top > 0 && (!top_ids || !top_logprobs)) ||
        (bias_indptr && (!bias_ids || !bias_values)) || (pen_indptr && (!pen_ids || !pen_counts)))
        return M40K_INVALID;
    sample_kernel<<<n_seq, SAMPLE_THREADS, 0, stream>>>(logits, stride, n_vocab, params, bias_indptr, bias_ids,
                                                        bias_values, pen_indptr, pen_ids, pen_counts, token,
                                                        logprob, n_top, top_ids, top_logprobs);
    return m40k_launch_status();
}
