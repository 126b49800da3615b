/* The scheduler's prefill policy (prefill_policy.h says what and why). */
#include "prefill_policy.h"

#include <math.h>
#include <string.h>

/* Feature scales: each feature is about 1 at the sizes a 7B model on one GPU sees (64
 * decode rows of 4k context, a 1,024-token prompt part, a chunk at 32k context), so
 * that the fits' tiny ridge treats the coefficients alike. */
#define SC_ROWS 64.0
#define SC_DEC_KEYS 262144.0   /* 64 rows x 4,096 keys */
#define SC_TOKENS 1024.0
#define SC_PRE_KEYS 33554432.0 /* 1,024 tokens x 32,768 keys */
#define SC_ENDS 32768.0

/* Forgetting: the decode part changes slowly (contexts grow a token a step), the prompt
 * part is fitted where the guard works now (the matmuls' cost per row bends where the
 * weights stop being the bound: a local fit tracks the operating point). */
#define DEC_LAMBDA 0.98
#define PRE_LAMBDA 0.95
/* A step measured at more than this times its prediction counts as this much: a CUDA
 * graph capture, a scratch buffer grown, the machine busy elsewhere; a real change of
 * cost still gets learned, up to this factor a step. */
#define CLIP 3.0
/* The fits' default prior toward 0 (times the weight of the data), and the prior on the
 * prompt part's fixed costs r0 and r3: while the chunks seen all had one size, the data
 * cannot tell a fixed cost from a cost per token; counted per token, the guard shrinks
 * the next chunks, and the steps that follow show whatever fixed cost there is. Counted
 * as fixed, the guard would find it could save nothing and keep the chunks as they
 * were, never learning otherwise. */
#define RIDGE 1e-6
#define RIDGE_FIXED 1e-2
/* The guard aims a step's predicted time this many standard errors of the recent
 * predictions (of steps with prompt tokens) below its target, so that the target
 * bounds the 99th percentile of the steps rather than their mean (at most half the
 * room goes to this margin). */
#define MARGIN_Z 2.33
/* One guarded step in this many varies the first chunk's size (m40_prefill_alloc_take). */
#define DITHER_EVERY 4

/* ---------- exponentially weighted non-negative least squares ---------- */

void m40_ewls_init(m40_ewls *f, int n, double lambda)
{
    memset(f, 0, sizeof *f);
    f->n = n < 1 ? 1 : n > M40_EWLS_MAX ? M40_EWLS_MAX : n;
    f->lambda = lambda > 0.0 && lambda <= 1.0 ? lambda : 1.0;
    for (int i = 0; i < M40_EWLS_MAX; i++)
        f->ridge[i] = RIDGE;
}

/* Solves (S + diag(ridge) w) theta = s over the features still free, dropping the most
 * negative coefficient and solving again until none is negative (the active-set idea
 * of Lawson-Hanson, enough for 4 features). The default ridge, a millionth of the
 * weight, only keeps the system solvable when a feature never varied (e.g. a constant
 * batch size): collinear coefficients then share the effect and predictions at the
 * data stay right. A larger ridge on a coefficient makes its feature's collinear
 * partners take the effect unless the data insist (m40_step_cost_init). */
static void ewls_solve(m40_ewls *f)
{
    const int n = f->n;
    int on[M40_EWLS_MAX];
    for (int i = 0; i < n; i++)
        on[i] = 1;
    for (int round = 0; round <= n; round++) {
        int idx[M40_EWLS_MAX], m = 0;
        for (int i = 0; i < n; i++)
            if (on[i])
                idx[m++] = i;
        double A[M40_EWLS_MAX][M40_EWLS_MAX + 1], x[M40_EWLS_MAX];
        for (int r = 0; r < m; r++) {
            for (int c = 0; c < m; c++)
                A[r][c] = f->S[idx[r]][idx[c]] + (r == c ? f->ridge[idx[r]] * (f->w + 1.0) : 0.0);
            A[r][m] = f->s[idx[r]];
        }
        /* Gaussian elimination with partial pivoting: S + rho I is symmetric positive
         * definite, so every pivot is positive. */
        for (int c = 0; c < m; c++) {
            int p = c;
            for (int r = c + 1; r < m; r++)
                if (fabs(A[r][c]) > fabs(A[p][c]))
                    p = r;
            if (p != c)
                for (int k = 0; k <= m; k++) {
                    double t = A[c][k];
                    A[c][k] = A[p][k];
                    A[p][k] = t;
                }
            for (int r = c + 1; r < m; r++) {
                double q = A[r][c] / A[c][c];
                for (int k = c; k <= m; k++)
                    A[r][k] -= q * A[c][k];
            }
        }
        for (int r = m - 1; r >= 0; r--) {
            double v = A[r][m];
            for (int k = r + 1; k < m; k++)
                v -= A[r][k] * x[k];
            x[r] = v / A[r][r];
        }
        int worst = -1;
        for (int r = 0; r < m; r++)
            if (x[r] < 0.0 && !f->free_sign[idx[r]] && (worst < 0 || x[r] < x[worst]))
                worst = r;
        if (worst < 0 || round == n) {
            for (int i = 0; i < n; i++)
                f->theta[i] = 0.0;
            for (int r = 0; r < m; r++)
                f->theta[idx[r]] = !isfinite(x[r]) ? 0.0 : x[r] > 0.0 || f->free_sign[idx[r]] ? x[r] : 0.0;
            return;
        }
        on[idx[worst]] = 0;
    }
}

void m40_ewls_add(m40_ewls *f, const double *x, double y)
{
    if (!isfinite(y))
        return;
    for (int i = 0; i < f->n; i++) {
        if (!isfinite(x[i]))
            return;
    }
    for (int i = 0; i < f->n; i++) {
        for (int j = 0; j < f->n; j++)
            f->S[i][j] = f->lambda * f->S[i][j] + x[i] * x[j];
        f->s[i] = f->lambda * f->s[i] + x[i] * y;
    }
    f->w = f->lambda * f->w + 1.0;
    ewls_solve(f);
}

double m40_ewls_predict(const m40_ewls *f, const double *x)
{
    double y = 0.0;
    for (int i = 0; i < f->n; i++)
        y += f->theta[i] * x[i];
    return y;
}

/* ---------- the step's shape and its cost ---------- */

void m40_step_shape_clear(m40_step_shape *sh)
{
    memset(sh, 0, sizeof *sh);
}

void m40_step_shape_add_decode(m40_step_shape *sh, int32_t n_past)
{
    sh->n_dec++;
    sh->dec_keys += (double)n_past + 1.0;
}

/* Keys attended by k prompt tokens at positions s .. s+k-1 (each sees itself and every
 * earlier position). */
static double chunk_keys(int32_t s, int32_t k)
{
    return (double)k * (double)s + (double)k * ((double)k + 1.0) / 2.0;
}

void m40_step_shape_add_chunk(m40_step_shape *sh, int32_t start, int32_t k)
{
    if (k <= 0)
        return;
    sh->n_chunks++;
    sh->prefill += k;
    sh->pre_keys += chunk_keys(start, k);
    sh->pre_ends += (double)start + (double)k;
}

static void dec_features(int32_t n_dec, double dec_keys, double x[3])
{
    x[0] = 1.0;
    x[1] = (double)n_dec / SC_ROWS;
    x[2] = dec_keys / SC_DEC_KEYS;
}

static void pre_features(const m40_step_shape *sh, double x[4])
{
    x[0] = 1.0;
    x[1] = (double)sh->prefill / SC_TOKENS;
    x[2] = sh->pre_keys / SC_PRE_KEYS;
    x[3] = sh->pre_ends / SC_ENDS;
}

void m40_step_cost_init(m40_step_cost *c)
{
    memset(c, 0, sizeof *c);
    m40_ewls_init(&c->dec, 3, DEC_LAMBDA);
    m40_ewls_init(&c->pre, 4, PRE_LAMBDA);
    c->pre.ridge[0] = c->pre.ridge[3] = RIDGE_FIXED;
    /* r0 may be negative: prompt rows that ride on a decode step's weight reads cost
     * nearly nothing up to a few hundred rows, then the matmuls' full rate; near the
     * operating point a line with a negative intercept fits that bend, one through the
     * origin would make every row pay the full rate and the guard take too few. */
    c->pre.free_sign[0] = 1;
    c->dec_step = -1;
}

double m40_step_cost_decode(const m40_step_cost *c, int32_t n_dec, double dec_keys)
{
    if (c->dec.w <= 0.0)
        return 0.0;
    double x[3];
    dec_features(n_dec, dec_keys, x);
    double y = m40_ewls_predict(&c->dec, x);
    return y > 0.0 ? y : 0.0;
}

double m40_step_cost_chunk(const m40_step_cost *c, int32_t start, int32_t k)
{
    if (k <= 0)
        return 0.0;
    const double *t = c->pre.theta;
    return t[1] * (double)k / SC_TOKENS + t[2] * chunk_keys(start, k) / SC_PRE_KEYS +
           t[3] * ((double)start + (double)k) / SC_ENDS;
}

double m40_step_cost_mixed(const m40_step_cost *c)
{
    return c->pre.theta[0];
}

double m40_step_cost_predict(const m40_step_cost *c, const m40_step_shape *sh)
{
    double y = m40_step_cost_decode(c, sh->n_dec, sh->dec_keys);
    if (sh->prefill > 0) {
        double x[4];
        pre_features(sh, x);
        y += m40_ewls_predict(&c->pre, x);
    }
    return y;
}

void m40_step_cost_observe(m40_step_cost *c, const m40_step_shape *sh, double seconds)
{
    if ((sh->n_dec <= 0 && sh->prefill <= 0) || !(seconds >= 0.0) || !isfinite(seconds))
        return;
    /* D is known for this step when decode-only steps were seen (a step of prompt
     * tokens alone still pays D's fixed part, d0). */
    const double d = m40_step_cost_decode(c, sh->n_dec, sh->dec_keys);
    if (sh->prefill <= 0) {
        double x[3];
        dec_features(sh->n_dec, sh->dec_keys, x);
        double y = seconds;
        if (c->dec.w >= 2.0 && d > 0.0 && y > CLIP * d)
            y = CLIP * d;
        m40_ewls_add(&c->dec, x, y);
        c->dec_step = c->steps;
        c->dec_rows = sh->n_dec;
    } else {
        double x[4];
        pre_features(sh, x);
        if (c->pre.w >= 2.0) {
            double pred = d + m40_ewls_predict(&c->pre, x);
            if (pred > 0.0 && seconds > CLIP * pred)
                seconds = CLIP * pred;
            double e = seconds - pred;
            c->pre_err2 = PRE_LAMBDA * c->pre_err2 + (1.0 - PRE_LAMBDA) * e * e;
        }
        double r = seconds - d;
        m40_ewls_add(&c->pre, x, r > 0.0 ? r : 0.0);
    }
    c->steps++;
}

int m40_step_cost_wants_probe(const m40_step_cost *c, int32_t n_dec)
{
    if (n_dec <= 0)
        return 0;
    if (c->dec_step < 0)
        return 1;
    const int64_t age = c->steps - c->dec_step;
    if (age < M40_PROBE_GAP)
        return 0;
    if (age > M40_PROBE_MAX_AGE)
        return 1;
    return (double)n_dec > (double)c->dec_rows * M40_PROBE_ROWS_RATIO ||
           (double)n_dec * M40_PROBE_ROWS_RATIO < (double)c->dec_rows;
}

/* ---------- the allocator ---------- */

void m40_prefill_alloc_begin(m40_prefill_alloc *a, const m40_prefill_policy *pol, const m40_step_cost *cost,
                             int32_t n_dec, double dec_keys, int may_probe)
{
    memset(a, 0, sizeof *a);
    a->pol = pol;
    a->cost = cost;
    a->budget_left = pol->budget;
    a->guarded = pol->guard >= 1.0 && n_dec > 0 && cost != NULL;
    if (!a->guarded)
        return;
    if (may_probe && m40_step_cost_wants_probe(cost, n_dec)) {
        a->probe = 1;
        return;
    }
    const double d = m40_step_cost_decode(cost, n_dec, dec_keys);
    const double room = (pol->guard - 1.0) * d;
    double margin = MARGIN_Z * sqrt(cost->pre_err2);
    if (margin > 0.5 * room)
        margin = 0.5 * room;
    a->allow = room - m40_step_cost_mixed(cost) - margin;
}

/* The largest k in [0, kmax] whose chunk cost fits allow (the cost grows with k). */
static int32_t largest_fit(const m40_step_cost *c, int32_t s, int32_t kmax, double allow)
{
    if (allow <= 0.0 || m40_step_cost_chunk(c, s, 1) > allow)
        return 0;
    int32_t lo = 1, hi = kmax; /* lo fits */
    while (lo < hi) {
        int32_t mid = lo + (hi - lo + 1) / 2;
        if (m40_step_cost_chunk(c, s, mid) <= allow)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The chunk's proportional part at k tokens: its cost less the part any chunk from s
 * pays (r3 s: the walk over the s keys before it). */
static double chunk_var(const m40_step_cost *c, int32_t s, int32_t k)
{
    return m40_step_cost_chunk(c, s, k) - c->pre.theta[3] * (double)s / SC_ENDS;
}

int32_t m40_prefill_alloc_take(m40_prefill_alloc *a, int32_t start, int32_t remaining, int exempt)
{
    const m40_prefill_policy *pol = a->pol;
    int32_t kmax = remaining;
    if (kmax > pol->chunk)
        kmax = pol->chunk;
    if (kmax > a->budget_left)
        kmax = a->budget_left;
    if (kmax <= 0)
        return 0;
    int32_t k = kmax;
    if (a->probe) {
        k = 0;
    } else if (a->guarded && exempt) {
        a->allow -= m40_step_cost_chunk(a->cost, start, k);
    } else if (a->guarded) {
        const m40_step_cost *c = a->cost;
        k = largest_fit(c, start, kmax, a->allow);
        if (a->chunks == 0) {
            /* The oldest prompt that runs always progresses... */
            int32_t lo = pol->floor < kmax ? pol->floor : kmax;
            if (k < lo)
                k = lo;
            /* ...and not by a chunk whose fixed part outweighs its work: then the step
             * is over the guard's target anyway, and a chunk too small to fill the GPU
             * saves little time for the progress it gives up. */
            const double r0 = m40_step_cost_mixed(c);
            const double fixed = (r0 > 0.0 ? r0 : 0.0) + c->pre.theta[3] * (double)start / SC_ENDS;
            if (k < kmax && chunk_var(c, start, k) < fixed) {
                int32_t lo2 = k + 1, hi = kmax; /* the smallest k with var >= fixed, else kmax */
                while (lo2 < hi) {
                    int32_t mid = lo2 + (hi - lo2) / 2;
                    if (chunk_var(c, start, mid) >= fixed)
                        hi = mid;
                    else
                        lo2 = mid + 1;
                }
                k = lo2;
            }
        }
        /* Every DITHER_EVERY-th guarded step the first chunk is halved (not below the
         * floor): steps of one chunk size alone cannot tell the fits' per-token terms
         * from the fixed ones, and the guard's own choices would otherwise keep the
         * size constant. Halving never takes a step over the target; it costs
         * 1/(2 DITHER_EVERY) of the guarded prompt tokens. (Doubling at the floor to
         * learn there was tried: where the cost really is per token, those steps set
         * the 99th percentile; the chunks above the floor teach the split first.) */
        if (a->chunks == 0 && c->steps % DITHER_EVERY == DITHER_EVERY - 1) {
            int32_t lo = pol->floor < kmax ? pol->floor : kmax;
            if (k / 2 >= lo)
                k /= 2;
        }
        if (k > 0)
            a->allow -= m40_step_cost_chunk(c, start, k);
    }
    if (k < kmax)
        a->limited = 1;
    if (k > 0) {
        a->budget_left -= k;
        a->chunks++;
    }
    return k;
}

/* ---------- one step's plan ---------- */

int32_t m40_step_plan(const m40_prefill_policy *pol, const m40_step_cost *cost, m40_plan_seq *seqs, int32_t n,
                      m40_plan_first_fn first_chunk, void *ctx, int32_t *take, m40_step_shape *shape,
                      m40_plan_info *info)
{
    m40_step_shape_clear(shape);
    memset(info, 0, sizeof *info);
    int32_t total = 0, waiting = 0, oldest = -1;
    double since = INFINITY; /* the earliest first token of the decoding sequences */
    /* Every decoding sequence first, one token each: nothing below can remove one. */
    for (int32_t i = 0; i < n; i++) {
        const m40_plan_seq *q = &seqs[i];
        take[i] = 0;
        if (!q->active)
            continue;
        if (q->n_prefilled >= q->n_prompt) {
            take[i] = 1;
            m40_step_shape_add_decode(shape, q->n_past);
            total++;
            if (q->streaming < since)
                since = q->streaming;
        } else {
            waiting++;
            if (oldest < 0 || q->order < seqs[oldest].order)
                oldest = i;
        }
    }
    /* no probe while the oldest prompt is exempt: it runs this step either way */
    m40_prefill_alloc a;
    m40_prefill_alloc_begin(&a, pol, cost, shape->n_dec, shape->dec_keys,
                            oldest < 0 || !(seqs[oldest].arrived < since));
    /* Then prompt chunks, oldest admission first; take -1 marks one passed over. */
    while (waiting > 0 && !a.probe && a.budget_left > 0) {
        int32_t best = -1;
        for (int32_t i = 0; i < n; i++) {
            const m40_plan_seq *q = &seqs[i];
            if (q->active && q->n_prefilled < q->n_prompt && take[i] == 0 &&
                (best < 0 || q->order < seqs[best].order))
                best = i;
        }
        if (best < 0)
            break;
        m40_plan_seq *q = &seqs[best];
        const int exempt = q->arrived < since;
        if (a.guarded && !exempt && a.chunks > 0 && a.allow <= 0.0) {
            a.limited = 1; /* nothing more fits: the guard holds the rest back */
            break;
        }
        if (q->fresh && first_chunk && !first_chunk(ctx, best, &q->n_prefilled)) {
            take[best] = -1;
            continue;
        }
        int32_t k = m40_prefill_alloc_take(&a, q->n_prefilled, q->n_prompt - q->n_prefilled, exempt);
        if (k <= 0) {
            take[best] = -1;
            continue;
        }
        take[best] = k;
        m40_step_shape_add_chunk(shape, q->n_prefilled, k);
        total += k;
    }
    for (int32_t i = 0; i < n; i++)
        if (take[i] < 0)
            take[i] = 0;
    info->n_dec = shape->n_dec;
    info->prefill = shape->prefill;
    info->guarded = a.guarded && waiting > 0;
    info->probe = a.probe && waiting > 0;
    info->limited = (a.limited || a.probe) && waiting > 0;
    return total;
}
