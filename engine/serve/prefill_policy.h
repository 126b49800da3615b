/* The scheduler's prefill policy: which sequences run in a step and how many prompt
 * tokens each one gets. Pure functions over plain numbers (no model, no GPU, no
 * threads, no clock), so that tests/unit/test_prefill_policy.c can drive them with
 * synthetic step timings; scheduler.c feeds them the real ones.
 *
 * A step (m40_step_plan) carries the next token of EVERY decoding sequence (the policy
 * never holds one back), then prompt chunks for the sequences still prefilling, oldest
 * admission first (FIFO), under three limits:
 *   - chunk: prompt tokens of one sequence in one step, so that a long prompt at the
 *     head of the line shares the step with the prompts behind it instead of holding
 *     them for its whole length;
 *   - budget: prompt tokens of all sequences in one step. Several prompts move in the
 *     same step: on a GPU a step of a few thousand rows runs the matmuls at the tensor
 *     cores' rate, where one 512-token chunk a step left most of a RAG burst waiting;
 *   - the ITL guard, only while some sequence is decoding: the step's predicted time
 *     stays within `guard` times the predicted time of the same step without prompt
 *     tokens (m40_itl_guard; off by default), so that a long prompt arriving does not
 *     multiply the inter-token latency of every running stream. The oldest prompt
 *     still gets at least `floor` tokens a step (it always progresses), and never a
 *     chunk so small that the chunk's fixed cost outweighs its useful work (see
 *     m40_prefill_alloc).
 * With nothing decoding the guard has nobody to protect and the budget applies alone.
 * Nor does it hold back a prompt that was already waiting when the earliest of the
 * running streams got its first token: a stream is protected from prompts that arrive
 * after it started, not from those that were ahead of it or came with it. In a burst
 * (64 long prompts at once) the first prompts done start streaming while the rest
 * still wait; guarding those 4 streams against the 60 prompts that came with them cost
 * the burst's time to first token several times over (tests/unit/test_prefill_policy.c
 * prints both), where a prompt arriving among running streams is still guarded.
 *
 * The guard's predictions come from m40_step_cost, a cost model fitted online from the
 * measured time of every step (the forward call's wall time):
 *
 *   T = D + R
 *   D = d0 + d1 B + d2 K                     decode part: B decode rows, K the keys they
 *                                            attend (sum over rows of context + 1)
 *   R = r0 + sum over chunks of              prompt part, per chunk of k tokens from
 *       r1 k + r2 keys(s, k) + r3 (s + k)    position s; keys(s, k) = k s + k(k+1)/2
 *
 * r1 is the chunk's matmul rows, r2 its attention work (each token attends every
 * earlier one: at 94k context a prompt token's attention costs several times its
 * matmuls), r3 the chunk's critical path: a prefill attention block walks the cache for
 * a run of query rows of one KV head, so a small chunk at a long context keeps few SMs
 * busy; the tensor-core kernel's key splits (kernels/kernels.h 7d) spread that walk
 * over up to 16 blocks, which makes r3 small where they run (sm_80+, head dims
 * 64/128/256) and leaves it large elsewhere; the fit finds which. r0 is what any
 * step with prompt tokens costs on top (plain launches instead of a decode step's CUDA
 * graph, the prefill kernels).
 *
 * D is fitted on decode-only steps alone and R on the rest after subtracting D: a
 * decode step's matmuls read the weights once whatever the rows, so prompt rows up to
 * a few hundred ride on a decode step almost for free, and a single linear fit over
 * both kinds of steps would put the decode step's time wherever that bend made it
 * convenient. When no decode-only step has been seen lately for about this many decode
 * rows (m40_step_cost_wants_probe), the plan gives one step no prompt tokens to measure
 * D (at most one step in M40_PROBE_GAP). Both fits are exponentially weighted least
 * squares with non-negative coefficients (r0 may be negative: the bend above), forgetting
 * old steps (contexts grow, the batch changes).
 *
 * Three details keep the loop honest. The target is aimed below by 2.33 standard errors
 * of the recent predictions, so that it bounds the steps' 99th percentile, not their
 * mean. One guarded step in four halves the first chunk (not below the floor): without
 * that the guard's own choices keep the chunk size constant and the fits could never
 * tell a per-token cost from a fixed one. And where even the floor is predicted over
 * the target (a long context where the attention cannot be split), the guard cannot
 * help the streams and only slows the prompt: it then takes the chunk where the
 * proportional part at least equals the fixed part, losing at most half the prompt's
 * rate. */
#ifndef M40_PREFILL_POLICY_H
#define M40_PREFILL_POLICY_H

#include <stdint.h>

/* The oldest prompt's tokens per step, however tight the guard. */
#define M40_PREFILL_FLOOR 16
/* A probe step (no prompt tokens: D measured) at most once in this many steps, and one
 * when the last decode-only step is older than M40_PROBE_MAX_AGE steps or had decode
 * rows outside [B / M40_PROBE_ROWS_RATIO, B * M40_PROBE_ROWS_RATIO]. */
#define M40_PROBE_GAP 16
#define M40_PROBE_MAX_AGE 256
#define M40_PROBE_ROWS_RATIO 1.5

/* Exponentially weighted least squares, at most 4 features, coefficients >= 0 unless
 * free_sign says otherwise. */
#define M40_EWLS_MAX 4
typedef struct {
    int n;                                  /* features */
    double lambda;                          /* weight kept per observation, (0, 1] */
    double S[M40_EWLS_MAX][M40_EWLS_MAX];   /* decayed sum of x x^T */
    double s[M40_EWLS_MAX];                 /* decayed sum of x y */
    double w;                               /* decayed count of observations */
    double ridge[M40_EWLS_MAX];             /* prior toward 0 per coefficient, times w */
    int free_sign[M40_EWLS_MAX];            /* 1: this coefficient may be negative */
    double theta[M40_EWLS_MAX];             /* the fit (solved after every observation) */
} m40_ewls;

void m40_ewls_init(m40_ewls *f, int n, double lambda);
void m40_ewls_add(m40_ewls *f, const double *x, double y);
double m40_ewls_predict(const m40_ewls *f, const double *x);

/* What a step carries, in the terms of the cost model. */
typedef struct {
    int32_t n_dec;       /* decode rows (B) */
    double dec_keys;     /* keys they attend (K) */
    int32_t n_chunks;    /* prompt chunks */
    int32_t prefill;     /* prompt tokens (sum of k) */
    double pre_keys;     /* sum of keys(s, k) */
    double pre_ends;     /* sum of s + k */
} m40_step_shape;

void m40_step_shape_clear(m40_step_shape *sh);
void m40_step_shape_add_decode(m40_step_shape *sh, int32_t n_past);
void m40_step_shape_add_chunk(m40_step_shape *sh, int32_t start, int32_t k);

typedef struct {
    m40_ewls dec;        /* D: [1, B, K] (scaled) */
    m40_ewls pre;        /* R: [1, P, keys, ends] (scaled) */
    int64_t steps;       /* steps observed */
    int64_t dec_step;    /* the step index of the last decode-only observation; -1: none */
    int32_t dec_rows;    /* its decode rows */
    double pre_err2;     /* mean square error of the predictions of steps with prompt
                          * tokens (decayed like the fit) */
} m40_step_cost;

void m40_step_cost_init(m40_step_cost *c);
/* One step's measured time (seconds). A step with neither rows counts nothing. */
void m40_step_cost_observe(m40_step_cost *c, const m40_step_shape *sh, double seconds);
/* Predicted seconds: of a decode-only step (n_dec rows attending dec_keys keys; 0 when
 * no decode-only step has been observed); of a chunk's own part of R; of r0. */
double m40_step_cost_decode(const m40_step_cost *c, int32_t n_dec, double dec_keys);
double m40_step_cost_chunk(const m40_step_cost *c, int32_t start, int32_t k);
double m40_step_cost_mixed(const m40_step_cost *c);
/* Predicted seconds of a whole step of shape sh: D, plus R where it carries prompt
 * tokens (what m40_step_cost_observe compares the measured time with). */
double m40_step_cost_predict(const m40_step_cost *c, const m40_step_shape *sh);
/* Whether the next step with n_dec decode rows should carry no prompt tokens, so that
 * D is measured (see above). */
int m40_step_cost_wants_probe(const m40_step_cost *c, int32_t n_dec);

typedef struct {
    int32_t budget;      /* prompt tokens a step, all sequences (> 0) */
    int32_t chunk;       /* prompt tokens a step, one sequence (> 0) */
    int32_t floor;       /* the oldest prompt's tokens a step under the guard */
    double guard;        /* a step with prompt tokens may take guard x the decode-only
                          * step while anything decodes (>= 1; 1: only the floor); < 1
                          * (0): the guard is off */
} m40_prefill_policy;

/* The prompt-token allocator of one step: begin once, then take per prefilling
 * sequence in FIFO order. */
typedef struct {
    const m40_prefill_policy *pol;
    const m40_step_cost *cost;
    int32_t budget_left;
    double allow;        /* guarded: seconds left for prompt chunks */
    int guarded;         /* the guard limits this step */
    int probe;           /* this step measures D: no prompt tokens */
    int limited;         /* the guard gave some sequence less than budget and chunk allowed */
    int32_t chunks;      /* chunks given so far */
} m40_prefill_alloc;

/* n_dec, dec_keys: the step's decode rows (all of them run, whatever follows).
 * may_probe: 0 when this step must carry prompt tokens anyway (an exempt prompt waits). */
void m40_prefill_alloc_begin(m40_prefill_alloc *a, const m40_prefill_policy *pol, const m40_step_cost *cost,
                             int32_t n_dec, double dec_keys, int may_probe);
/* Tokens for the next prefilling sequence in FIFO order: its chunk starts at position
 * start with remaining prompt tokens left. Without the guard, or exempt from it (it was
 * waiting before the streams started): min(remaining, chunk, budget left), its predicted
 * cost counted against what the guarded ones behind it may use. Guarded: the largest
 * such k whose predicted cost fits what is left of (guard - 1) x D - r0; for the first
 * sequence given tokens at least min(floor, ...), and, when the chunk's fixed part (r3 s,
 * plus r0) would outweigh its proportional part, the smallest k where it no longer does
 * (a chunk that small buys little ITL and costs much progress: the long-context case of
 * the comment above). */
int32_t m40_prefill_alloc_take(m40_prefill_alloc *a, int32_t start, int32_t remaining, int exempt);

/* One slot as the planner sees it. */
typedef struct {
    int active;          /* runs this step (0: free slot, or preempted this step) */
    uint64_t order;      /* admission order: lower is older */
    int32_t n_past;      /* tokens in its cache */
    int32_t n_prompt;    /* tokens to prefill */
    int32_t n_prefilled; /* of them computed; == n_prompt: decoding */
    int fresh;           /* no chunk yet since (re)admission: first_chunk is asked first */
    double arrived;      /* when its request arrived (any clock, the same for all) */
    double streaming;    /* decoding: when its first token came */
} m40_plan_seq;

/* Called before a fresh sequence's first chunk, oldest first, with take[] filled for
 * the older ones: 0 skips the sequence this step; 1 lets it go on, *n_prefilled
 * possibly moved forward (a cached prefix). NULL: always 1. */
typedef int (*m40_plan_first_fn)(void *ctx, int32_t i, int32_t *n_prefilled);

typedef struct {
    int32_t n_dec;       /* decode rows */
    int32_t prefill;     /* prompt tokens */
    int guarded, probe, limited; /* as in m40_prefill_alloc */
} m40_plan_info;

/* Plans one step over n slots: take[i] = 1 for every active decoding slot, the
 * allocator's tokens for the prefilling ones (0 when skipped). A prefilling slot that
 * arrived before the earliest `streaming` of the decoding ones is exempt from the
 * guard. seqs[i].n_prefilled may be moved by first_chunk. Fills the step's shape;
 * returns its tokens. */
int32_t m40_step_plan(const m40_prefill_policy *pol, const m40_step_cost *cost, m40_plan_seq *seqs, int32_t n,
                      m40_plan_first_fn first_chunk, void *ctx, int32_t *take, m40_step_shape *shape,
                      m40_plan_info *info);

#endif
