/* m40 bench: prefill and decode throughput of the forward pass (engine/model/model.h), with
 * no scheduler, HTTP or sampling in the way.
 *
 * Prefill: --prompt-len random token ids run through a fresh KV slot, one forward call
 * per --chunk tokens. Decode: --gen greedy steps after that prompt, one forward call per
 * step; with --batch B, B sequences in B slots advance together, one call of B tokens
 * per step; the greedy picks are made by the forward pass (m40_batch.argmax: on the GPU
 * only the token ids come back, as in the server's engine). Each measurement is
 * repeated --reps times after --warmup untimed runs; every run and the median are
 * printed.
 *
 * The roofline (see GUIDE.md, "Performance method"): a decode step reads every weight
 * once, so steps/s can not beat bandwidth / weight bytes. The weight bytes are the sum
 * of the GGUF's tensor sizes; KV cache and activation traffic are left out, so the
 * printed fraction is an upper bound on how much of the memory system the weights use.
 * A mixture of experts reads only the experts its tokens chose: a step of B tokens reads
 * the expert tensors (ffn_*_exps) in the share 1 - (1 - k/E)^B that B uniform routings
 * of k of E experts touch on average (k/E at batch 1), and the other tensors whole. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "store.h"
#include "ref/ggml_types.h"
#include "model/model.h"
#include "sample_hd.h" /* m40k_argmax: the greedy pick as the GPU makes it */

#define BENCH_DEFAULT_BANDWIDTH_GBS 3020.0 /* H100 80GB HBM3 copy bandwidth, GUIDE.md */

typedef struct {
    const char *model_path;
    long threads, prompt_len, gen, reps, warmup, batch, chunk, device, tp;
    unsigned long long seed;
    double bandwidth_gbs;
    int gpu_time;
    int exact;
    int batch_invariant;
} bench_opts;

typedef struct {
    double prefill_s; /* all batch slots together */
    double decode_s;
    double decode_dev_s; /* --gpu-time: device time of the decode calls (events), else 0 */
    double decode_coll_s; /* --gpu-time, tensor parallelism without graphs: the collectives' share */
    int64_t decode_colls;
} bench_run;

static void bench_usage(FILE *f)
{
    fprintf(f,
            "usage: m40 bench MODEL [options]\n"
            "  --device D        cpu (default) or a CUDA device index (weights uploaded once, paged F16 KV)\n"
            "  --tp N            tensor parallelism: GPUs D .. D+N-1 over NCCL (the roofline counts N GPUs'\n"
            "                    bandwidth), or N simulated ranks on the CPU\n"
            "  --threads N       CPU threads (default: all)\n"
            "  --prompt-len N    random prompt tokens prefilled per sequence (default 512)\n"
            "  --chunk N         prompt tokens per prefill forward call (default 512)\n"
            "  --gen N           greedy decode steps per sequence (default 128)\n"
            "  --batch B         sequences decoded together, one forward call of B tokens per step (default 1)\n"
            "  --reps N          repetitions; each is printed, then the median (default 3)\n"
            "  --warmup N        untimed repetitions first (default 1): kernel loading, handle creation and\n"
            "                    the decode steps' CUDA graph capture stay out of the timed ones\n"
            "  --bandwidth GB/s  memory bandwidth of the roofline (default %.0f: H100 80GB HBM3 copy)\n"
            "  --seed S          seed of the random prompt token ids (default 1)\n"
            "  --gpu-time        also time each decode step's device work with CUDA events and print\n"
            "                    it beside the wall time (the difference: host work and launch gaps)\n"
            "  --exact           CPU: the exact F32 reference products (as m40 eval) instead of the fast\n"
            "                    int16 path\n"
            "  --batch-invariant GPU: every row computed as if the batch held it alone, as m40 serve\n"
            "                    --batch-invariant does (the price of the guarantee; not with --tp;\n"
            "                    no change on the cpu)\n",
            BENCH_DEFAULT_BANDWIDTH_GBS);
}

static int parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* xorshift64*: reproducible prompt token ids, no libc rand() state shared with anyone. */
static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, long n)
{
    double *s = malloc((size_t)n * sizeof *s);
    if (!s)
        return v[0];
    memcpy(s, v, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    double m = n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
    free(s);
    return m;
}

/* Human-readable bytes: "14.48 GB (14483464192 bytes)" style, decimal units like the GUIDE. */
static void print_bytes(double b)
{
    if (b >= 1e9)
        printf("%.2f GB", b / 1e9);
    else if (b >= 1e6)
        printf("%.2f MB", b / 1e6);
    else
        printf("%.2f kB", b / 1e3);
    printf(" (%.0f bytes)", b);
}

/* One repetition: prefill every slot with its own random prompt, then decode greedily.
 * Buffers are the caller's, sized for batch tokens of chunk / batch rows of logits. */
static int bench_once(m40_model *m, m40_kv *kv, const bench_opts *o, uint64_t *rng, bench_run *r, char *err,
                      size_t errlen)
{
    const m40_model_params *p = m40_model_get_params(m);
    const int32_t B = (int32_t)o->batch, V = p->n_vocab;
    size_t nbuf = (size_t)(o->chunk > o->batch ? o->chunk : o->batch);
    int32_t *tok = malloc(nbuf * sizeof *tok), *pos = malloc(nbuf * sizeof *pos);
    int32_t *slot = malloc(nbuf * sizeof *slot), *next = malloc((size_t)B * sizeof *next);
    uint8_t *want = malloc(nbuf);
    float *logits = malloc((size_t)B * (size_t)V * sizeof *logits);
    int rc = -1;
    if (!tok || !pos || !slot || !next || !want || !logits) {
        snprintf(err, errlen, "out of memory for the batch buffers");
        goto out;
    }

    /* Prefill: slot s restarts at position 0, which is all a fresh slot needs. Each
     * forward call carries up to --chunk prompt tokens, of one slot or several (a slot's
     * prompt continues in the next call where the chunk ends); a slot's last prompt
     * token wants logits, its greedy pick starts the decode. */
    double t0 = now_s();
    {
        int32_t s = 0, n = 0, n_out = 0, first_out = 0;
        long at = 0;
        while (s < B) {
            tok[n] = (int32_t)(rng_next(rng) % (uint64_t)V);
            pos[n] = (int32_t)at;
            slot[n] = s;
            want[n] = at + 1 == o->prompt_len;
            n_out += want[n];
            n++;
            if (++at == o->prompt_len)
                s++, at = 0;
            if (n == (int32_t)o->chunk || s == B) {
                m40_batch b = {.n = n, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
                if (m40_model_forward(m, kv, &b, logits, err, errlen))
                    goto out;
                for (int32_t k = 0; k < n_out; k++)
                    next[first_out + k] = m40k_argmax(logits + (size_t)k * (size_t)V, V);
                first_out += n_out;
                n = n_out = 0;
            }
        }
    }
    r->prefill_s = now_s() - t0;

    /* Decode: every step feeds each slot its previous greedy token. */
    for (int32_t s = 0; s < B; s++)
        want[s] = 1;
    double dev0 = 0, coll0 = 0;
    int64_t nd0 = 0, nc0 = 0;
    if (o->gpu_time) {
        m40_model_step_time(m, &dev0, &nd0);
        m40_model_collective_time(m, &coll0, &nc0);
    }
    t0 = now_s();
    for (long step = 0; step < o->gen; step++) {
        for (int32_t s = 0; s < B; s++) {
            tok[s] = next[s];
            pos[s] = (int32_t)(o->prompt_len + step);
            slot[s] = s;
        }
        /* greedy picks made where the logits are (on the GPU: B ids come back instead
         * of B rows of logits), as the server's engine does */
        m40_batch b = {.n = B, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want, .argmax = next};
        if (m40_model_forward(m, kv, &b, logits, err, errlen))
            goto out;
    }
    r->decode_s = now_s() - t0;
    r->decode_dev_s = 0;
    r->decode_coll_s = 0;
    r->decode_colls = 0;
    if (o->gpu_time) {
        double dev1 = 0;
        int64_t nd1 = 0;
        m40_model_step_time(m, &dev1, &nd1);
        r->decode_dev_s = dev1 - dev0;
        double coll1 = 0;
        int64_t nc1 = 0;
        m40_model_collective_time(m, &coll1, &nc1);
        r->decode_coll_s = coll1 - coll0;
        r->decode_colls = nc1 - nc0;
    }
    rc = 0;
out:
    free(tok);
    free(pos);
    free(slot);
    free(next);
    free(want);
    free(logits);
    return rc;
}

static int parse_args(int argc, char **argv, bench_opts *o)
{
    *o = (bench_opts){.threads = 0, .prompt_len = 512, .gen = 128, .reps = 3, .warmup = 1, .batch = 1, .chunk = 512,
                      .seed = 1, .bandwidth_gbs = BENCH_DEFAULT_BANDWIDTH_GBS, .device = -1, .tp = 1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            bench_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--gpu-time")) {
            o->gpu_time = 1;
            continue;
        }
        if (!strcmp(a, "--exact")) {
            o->exact = 1;
            continue;
        }
        if (!strcmp(a, "--batch-invariant")) {
            o->batch_invariant = 1;
            continue;
        }
        if (!(a[0] == '-' && a[1] == '-')) {
            if (o->model_path) {
                fprintf(stderr, "m40 bench: more than one model given ('%s')\n", a);
                return 2;
            }
            o->model_path = a;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "m40 bench: %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        long *target = NULL, lo = 0, hi = 0;
        if (!strcmp(a, "--device")) {
            long dev;
            if (!strcmp(v, "cpu") || !strcmp(v, "-1")) {
                o->device = -1;
                continue;
            }
            if (parse_long(v, 0, 1024, &dev)) {
                fprintf(stderr, "m40 bench: --device must be cpu or a GPU index\n");
                return 2;
            }
            o->device = dev;
            continue;
        } else if (!strcmp(a, "--tp")) {
            target = &o->tp, lo = 1, hi = 64;
        } else if (!strcmp(a, "--threads")) {
            target = &o->threads, lo = 0, hi = 1024;
        } else if (!strcmp(a, "--prompt-len")) {
            target = &o->prompt_len, lo = 1, hi = 1L << 24;
        } else if (!strcmp(a, "--chunk")) {
            target = &o->chunk, lo = 1, hi = 1L << 20;
        } else if (!strcmp(a, "--gen")) {
            target = &o->gen, lo = 1, hi = 1L << 24;
        } else if (!strcmp(a, "--batch")) {
            target = &o->batch, lo = 1, hi = 4096;
        } else if (!strcmp(a, "--reps")) {
            target = &o->reps, lo = 1, hi = 1000;
        } else if (!strcmp(a, "--warmup")) {
            target = &o->warmup, lo = 0, hi = 1000;
        } else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            o->seed = strtoull(v, &end, 10);
            if (!*v || *end || errno) {
                fprintf(stderr, "m40 bench: --seed needs a non-negative integer\n");
                return 2;
            }
            continue;
        } else if (!strcmp(a, "--bandwidth")) {
            char *end;
            errno = 0;
            o->bandwidth_gbs = strtod(v, &end);
            if (!*v || *end || errno || !(o->bandwidth_gbs > 0)) {
                fprintf(stderr, "m40 bench: --bandwidth needs a positive number of GB/s\n");
                return 2;
            }
            continue;
        } else {
            fprintf(stderr, "m40 bench: unknown option %s\n", a);
            bench_usage(stderr);
            return 2;
        }
        if (parse_long(v, lo, hi, target)) {
            fprintf(stderr, "m40 bench: %s must be an integer in %ld..%ld\n", a, lo, hi);
            return 2;
        }
    }
    if (!o->model_path) {
        bench_usage(stderr);
        return 2;
    }
    return -1; /* go on */
}

int m40_cmd_bench(int argc, char **argv)
{
    bench_opts o;
    int prc = parse_args(argc, argv, &o);
    if (prc >= 0)
        return prc;

    char err[512], stored[PATH_MAX];
    o.model_path = m40_model_arg("bench", o.model_path, stored, sizeof stored);
    m40_model *m = NULL;
    m40_model_options mo = {.n_threads = (int)o.threads,
                            .device = (int)o.device,
                            .log_progress = 1,
                            .cpu_fast = !o.exact,
                            .tp = (int)o.tp,
                            .batch_invariant = o.batch_invariant};
    if (m40_model_load_opts(o.model_path, &mo, &m, err, sizeof err)) {
        fprintf(stderr, "m40 bench: %s\n", err);
        return 1;
    }
    const m40_model_params *p = m40_model_get_params(m);
    const m40_gguf *g = m40_model_gguf(m);
    double weight_bytes = 0, expert_bytes = 0;
    for (uint64_t i = 0; i < m40_gguf_n_tensors(g); i++) {
        const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
        if (p->n_experts > 0 && strstr(t->name, "_exps.weight"))
            expert_bytes += (double)t->nbytes;
        else
            weight_bytes += (double)t->nbytes;
    }
    double file_weight_bytes = weight_bytes + expert_bytes, expert_share = 1.0;
    if (p->n_experts > 0) {
        double miss = 1.0;
        for (long b = 0; b < o.batch; b++)
            miss *= 1.0 - (double)p->n_experts_used / (double)p->n_experts;
        expert_share = 1.0 - miss;
        weight_bytes += expert_bytes * expert_share;
    }

    long ctx = o.prompt_len + o.gen;
    if (ctx > INT32_MAX) {
        fprintf(stderr, "m40 bench: --prompt-len + --gen is too large\n");
        m40_model_free(m);
        return 2;
    }
    int on_gpu = m40_model_device(m) >= 0;
    if (o.gpu_time && (!on_gpu || m40_model_step_timing(m, 1))) {
        fprintf(stderr, "m40 bench: --gpu-time needs a model on a CUDA device (--device N)\n");
        m40_model_free(m);
        return 2;
    }
    double kv_bytes = (double)o.batch * p->n_layers * (double)ctx * 2.0 * p->n_kv_heads * p->head_dim * (on_gpu ? 2.0 : 4.0);
    /* the pool holds every slot's whole context, no more: as m40_kv_new sizes it */
    m40_kv_options ko = {.max_tokens = o.batch * ((ctx + 15) / 16 * 16)};
    char kerr[400];
    m40_kv *kv = m40_kv_new_opts(m, (int32_t)o.batch, (int32_t)ctx, &ko, kerr, sizeof kerr);
    if (!kv) {
        fprintf(stderr, "m40 bench: cannot allocate the KV cache (%ld slots of %ld positions, %.2f GB): %s\n",
                o.batch, ctx, kv_bytes / 1e9, kerr);
        m40_model_free(m);
        return 1;
    }

    printf("model:    %s (%s, %s%s%s)\n", o.model_path, p->arch, m40_type_name(p->weight_type),
           p->name[0] ? ", " : "", p->name);
    printf("shape:    %d layers, dim %d, %d heads / %d kv heads x %d, ffn %d, vocab %d\n", (int)p->n_layers,
           (int)p->dim, (int)p->n_heads, (int)p->n_kv_heads, (int)p->head_dim, (int)p->ffn_dim, (int)p->n_vocab);
    printf("weights:  ");
    print_bytes(file_weight_bytes);
    printf(" = sum of the GGUF's tensor sizes\n");
    if (p->n_experts > 0) {
        printf("experts:  %d of %d per token, expert ffn %d: a step of %ld tokens reads ", (int)p->n_experts_used,
               (int)p->n_experts, (int)p->expert_ffn_dim, o.batch);
        print_bytes(weight_bytes);
        printf(" (%.1f%% of the expert tensors, all the others)\n", 100.0 * expert_share);
    }
    /* the option, or M40_BATCH_INVARIANT=1: what the model loaded with */
    const int batch_invariant = m40_model_tuning(m)->batch_invariant;
    if (on_gpu)
        printf("device:   cuda:%d (paged KV pool of %d blocks of 16 tokens%s)\n", m40_model_device(m),
               (int)m40_kv_pool_blocks(kv), batch_invariant ? "; batch invariant" : "");
    else
        printf("device:   cpu, %d threads, %s path\n", m40_model_n_threads(m), m40_model_cpu_path(m));
    printf("setup:    prompt %ld random tokens (chunks of %ld), decode %ld greedy steps, batch %ld, %ld reps "
           "after %ld warm-up; KV cache %.2f GB (%s)\n",
           o.prompt_len, o.chunk, o.gen, o.batch, o.reps, o.warmup, kv_bytes / 1e9, on_gpu ? "F16, paged" : "F32");
    fflush(stdout);

    double *prefill_tps = calloc((size_t)o.reps, sizeof *prefill_tps);
    double *decode_tps = calloc((size_t)o.reps, sizeof *decode_tps);
    double *step_ps = calloc((size_t)o.reps, sizeof *step_ps);
    int rc = 1;
    if (!prefill_tps || !decode_tps || !step_ps) {
        fprintf(stderr, "m40 bench: out of memory\n");
        goto out;
    }
    uint64_t rng = o.seed * 0x9E3779B97F4A7C15ULL + 0x2545F4914F6CDD1DULL;
    if (!rng)
        rng = 1;
    /* Warm-up (METHOD: the first use of each kernel loads it, cuBLAS sets up, the first
     * decode steps of a shape run without and then capture its CUDA graph; the server
     * does the same at start, M40_WARMUP): the same work, not timed. */
    for (long r = 0; r < o.warmup; r++) {
        bench_run run;
        if (bench_once(m, kv, &o, &rng, &run, err, sizeof err)) {
            fprintf(stderr, "m40 bench: warm-up %ld: %s\n", r + 1, err);
            goto out;
        }
        printf("warm-up %ld: prefill %.3f s, decode %.3f s (not counted)\n", r + 1, run.prefill_s, run.decode_s);
        fflush(stdout);
    }
    for (long r = 0; r < o.reps; r++) {
        bench_run run;
        if (bench_once(m, kv, &o, &rng, &run, err, sizeof err)) {
            fprintf(stderr, "m40 bench: run %ld: %s\n", r + 1, err);
            goto out;
        }
        prefill_tps[r] = (double)(o.prompt_len * o.batch) / run.prefill_s;
        step_ps[r] = (double)o.gen / run.decode_s;
        decode_tps[r] = step_ps[r] * (double)o.batch;
        printf("run %ld:    prefill %ld tokens in %.3f s = %.1f tok/s;  decode %ld x %ld tokens in %.3f s = "
               "%.2f tok/s (%.2f steps/s)\n",
               r + 1, o.prompt_len * o.batch, run.prefill_s, prefill_tps[r], o.gen, o.batch, run.decode_s,
               decode_tps[r], step_ps[r]);
        if (o.gpu_time)
            printf("          decode step: %.3f ms wall, %.3f ms device work (table upload to the last copy back), "
                   "%.3f ms outside it\n",
                   1e3 * run.decode_s / (double)o.gen, 1e3 * run.decode_dev_s / (double)o.gen,
                   1e3 * (run.decode_s - run.decode_dev_s) / (double)o.gen);
        if (o.gpu_time && run.decode_colls > 0)
            printf("          collectives: %.3f ms a step (%.1f calls of %.1f us), rank 0's stream\n",
                   1e3 * run.decode_coll_s / (double)o.gen, (double)run.decode_colls / (double)o.gen,
                   1e6 * run.decode_coll_s / (double)run.decode_colls);
        fflush(stdout);
    }

    double pf = median(prefill_tps, o.reps), dt = median(decode_tps, o.reps), st = median(step_ps, o.reps);
    double implied_gbs = weight_bytes * st / 1e9;
    if (on_gpu && o.tp > 1) { /* N GPUs read their shards at once: the aggregate bandwidth */
        o.bandwidth_gbs *= (double)o.tp;
        printf("tp:       %ld GPUs, each reading its shard: the roofline counts %ld x the bandwidth\n", o.tp, o.tp);
    }
    double roof_steps = o.bandwidth_gbs * 1e9 / weight_bytes;
    printf("median:   prefill %.1f tok/s, decode %.2f tok/s (batch %ld, %.2f steps/s)\n", pf, dt, o.batch, st);
    printf("roofline: decode reads the weights once per step: %.4g GB x %.2f steps/s = %.4g GB/s of weight "
           "reads;\n          against --bandwidth %.0f GB/s (roofline %.1f steps/s = %.1f tok/s at batch %ld) "
           "that is %.2f%% of the roofline (weights only; KV cache reads not counted)\n",
           weight_bytes / 1e9, st, implied_gbs, o.bandwidth_gbs, roof_steps, roof_steps * (double)o.batch, o.batch,
           100.0 * implied_gbs / o.bandwidth_gbs);
    /* One line for scripts (tests/bench/run-all.sh). */
    printf("result: prefill_tok_s=%.2f decode_tok_s=%.3f batch=%ld weight_bytes=%.0f weight_gb_s=%.2f "
           "roofline_pct=%.3f bandwidth_gb_s=%.0f device=%s\n",
           pf, dt, o.batch, weight_bytes, implied_gbs, 100.0 * implied_gbs / o.bandwidth_gbs, o.bandwidth_gbs,
           on_gpu ? "cuda" : "cpu");
    rc = 0;
out:
    free(prefill_tps);
    free(decode_tps);
    free(step_ps);
    m40_kv_free(kv);
    m40_model_free(m);
    return rc;
}
