/* Tensor parallelism against one rank, shared by the CPU twin's test (test_tp.c) and the
 * GPU's (tests/gpu/test_tp_gpu.c): the same file loaded with tp = 1 and with tp = n on
 * the same device, fed the same mixed batches (two prompts of different lengths in one
 * call, then decode steps of both sequences together), must give the same logits within
 * tol (relative to the largest |logit| of the row) and the same greedy tokens. */
#ifndef M40_TEST_TP_COMPARE_H
#define M40_TEST_TP_COMPARE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "model/model.h"

#define TPC_A 19 /* prompt lengths: odd, unequal, across a 16-token KV block */
#define TPC_B 7
#define TPC_STEPS 4

/* One model's logits for the whole script: prefill rows (both last rows), then each
 * step's two rows (fixed tokens); the greedy ids of every row, the decode steps' through
 * the argmax path (on the GPU: the device's pick). */
static int tpc_run(const char *path, int device, int tp, float **out_logits, int32_t **out_ids, int32_t *n_vocab,
                   char *err, size_t errlen)
{
    m40_model_options o = {.n_threads = 2, .device = device, .tp = tp};
    m40_model *m = NULL;
    if (m40_model_load_opts(path, &o, &m, err, errlen))
        return -1;
    const int32_t V = m40_model_get_params(m)->n_vocab;
    *n_vocab = V;
    m40_kv *kv = m40_kv_new_opts(m, 2, 64, NULL, err, errlen);
    const int rows = 2 * (1 + TPC_STEPS);
    float *lg = malloc((size_t)rows * (size_t)V * sizeof *lg);
    float *scratch = malloc((size_t)2 * (size_t)V * sizeof *scratch);
    int32_t *ids = malloc((size_t)rows * sizeof *ids);
    int rc = -1;
    if (!kv || !lg || !scratch || !ids)
        goto out;
    int32_t tok[TPC_A + TPC_B], pos[TPC_A + TPC_B], slot[TPC_A + TPC_B];
    uint8_t want[TPC_A + TPC_B] = {0};
    for (int i = 0; i < TPC_A + TPC_B; i++) {
        int a = i < TPC_A;
        tok[i] = (int32_t)((i * 7919 + 13) % (V - 3)) + 3;
        pos[i] = a ? i : i - TPC_A;
        slot[i] = a ? 0 : 1;
    }
    want[TPC_A - 1] = want[TPC_A + TPC_B - 1] = 1;
    m40_batch b = {.n = TPC_A + TPC_B, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
    if (m40_model_forward(m, kv, &b, lg, err, errlen))
        goto out;
    int32_t next[2], p2[2] = {TPC_A, TPC_B}, s2[2] = {0, 1};
    uint8_t w2[2] = {1, 1};
    for (int k = 0; k < 2; k++) {
        int32_t best = 0;
        for (int32_t v = 1; v < V; v++)
            if (lg[(size_t)k * V + v] > lg[(size_t)k * V + best])
                best = v;
        ids[k] = best;
    }
    for (int s = 0; s < TPC_STEPS; s++) {
        /* the tokens fed are a fixed script, not the picks: a near tie picked differently
         * would otherwise change every later row */
        for (int k = 0; k < 2; k++)
            next[k] = (int32_t)((s * 31 + k * 17 + 5) % (V - 3)) + 3;
        float *row = lg + (size_t)(2 + 2 * s) * V;
        m40_batch d = {.n = 2, .tokens = next, .pos = p2, .slot = s2, .want_logits = w2};
        if (m40_model_forward(m, kv, &d, row, err, errlen))
            goto out;
        /* the same step again through the argmax path (positions rewritten in place) */
        int32_t am[2];
        d.argmax = am;
        if (m40_model_forward(m, kv, &d, scratch, err, errlen))
            goto out;
        for (int k = 0; k < 2; k++) {
            ids[2 + 2 * s + k] = am[k];
            p2[k]++;
        }
    }
    *out_logits = lg;
    *out_ids = ids;
    lg = NULL;
    ids = NULL;
    rc = 0;
out:
    free(lg);
    free(ids);
    free(scratch);
    m40_kv_free(kv);
    m40_model_free(m);
    return rc;
}

/* Checks tp = n against tp = 1; returns the largest relative difference seen (or -1). */
static double tpc_compare(const char *path, const char *label, int device, int tp, double tol)
{
    char err[512];
    float *l1 = NULL, *ln = NULL;
    int32_t *i1 = NULL, *in = NULL, V = 0, Vn = 0;
    int rc1 = tpc_run(path, device, 1, &l1, &i1, &V, err, sizeof err);
    CHECK(rc1 == 0, "%s tp=1: %s", label, err);
    int rcn = rc1 == 0 ? tpc_run(path, device, tp, &ln, &in, &Vn, err, sizeof err) : -1;
    CHECK(rc1 != 0 || rcn == 0, "%s tp=%d: %s", label, tp, err);
    double worst = -1;
    if (rc1 == 0 && rcn == 0) {
        worst = 0;
        const int rows = 2 * (1 + TPC_STEPS);
        int ids_same = 1;
        for (int r = 0; r < rows; r++) {
            double mx = 1e-6, d = 0;
            for (int32_t v = 0; v < V; v++) {
                double a = l1[(size_t)r * V + v], b = ln[(size_t)r * V + v];
                if (fabs(a) > mx)
                    mx = fabs(a);
                if (!(fabs(a - b) <= d)) /* NaN counts as the worst */
                    d = isnan(b) ? INFINITY : fabs(a - b);
            }
            if (d / mx > worst)
                worst = d / mx;
            /* a different pick only where the two were within tol of a tie */
            ids_same &= i1[r] == in[r] || (in[r] >= 0 && in[r] < V &&
                                           fabs(l1[(size_t)r * V + i1[r]] - l1[(size_t)r * V + in[r]]) <= tol * mx);
        }
        CHECK(worst <= tol, "%s tp=%d: logits differ from tp=1 by %.3g of the row's largest (tolerance %.3g)", label,
              tp, worst, tol);
        CHECK(ids_same, "%s tp=%d: greedy tokens differ from tp=1", label, tp);
        printf("%s: tp=%d against tp=1: largest logit difference %.3g of the row's largest\n", label, tp, worst);
    }
    free(l1);
    free(ln);
    free(i1);
    free(in);
    return worst;
}

#endif
