/* `m40 mkmodel`: a synthetic GGUF in the shape of a real model (engine/gguf/mkmodel.h says
 * what the weights, types and vocabulary are). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "gguf/mkmodel.h"

static void mk_usage(FILE *f)
{
    fprintf(f, "usage: m40 mkmodel --shape NAME --type TYPE [--seed S] [--layers N] [--threads N] [--quick] [--dry-run] "
               "OUT.gguf\n\nshapes:\n");
    for (int i = 0; m40_mkmodel_shape_at(i); i++) {
        const m40_mkmodel_shape *s = m40_mkmodel_shape_at(i);
        char experts[96] = "";
        if (s->n_experts)
            snprintf(experts, sizeof experts, ", %d experts (%d used) of ffn %d", s->n_experts, s->n_experts_used,
                     s->expert_ffn_dim);
        fprintf(f, "  %-15s %s: dim %d, %d layers, %d/%d heads, ffn %d%s, vocab %d, ctx %d, rope base %g\n",
                s->name, s->description, s->dim, s->n_layers, s->n_heads, s->n_kv_heads, s->ffn_dim, experts,
                s->n_vocab, s->ctx, s->rope_base);
    }
    fprintf(f, "types: %s\n", m40_mkmodel_type_list());
    fprintf(f, "--quick: Q4_K and Q6_K scales fitted at one candidate step instead of the search (several\n"
               "times faster, a little less accurate): large shapes for speed runs, not for accuracy tests\n");
}

/* Whole decimal number in [lo, hi]; -1 otherwise. */
static int parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    if (!s || !*s || *s == '-' || *s == '+')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static void shape_names(char *buf, size_t cap)
{
    size_t n = 0;
    buf[0] = 0;
    for (int i = 0; m40_mkmodel_shape_at(i) && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%s", i ? ", " : "", m40_mkmodel_shape_at(i)->name);
}

int m40_cmd_mkmodel(int argc, char **argv)
{
    const char *shape_name = NULL, *type_name = NULL, *out = NULL;
    uint64_t seed = 1, layers = 0, threads = 0;
    int dry_run = 0, quick = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            mk_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--dry-run")) {
            dry_run = 1;
            continue;
        }
        if (!strcmp(a, "--quick")) {
            quick = 1;
            continue;
        }
        int takes = !strcmp(a, "--shape") || !strcmp(a, "--type") || !strcmp(a, "--seed") ||
                    !strcmp(a, "--layers") || !strcmp(a, "--threads");
        if (takes) {
            if (i + 1 >= argc) {
                fprintf(stderr, "m40 mkmodel: %s needs a value\n", a);
                mk_usage(stderr);
                return 2;
            }
            const char *v = argv[++i];
            if (!strcmp(a, "--shape"))
                shape_name = v;
            else if (!strcmp(a, "--type"))
                type_name = v;
            else if (!strcmp(a, "--seed") && parse_u64(v, 0, UINT64_MAX, &seed)) {
                fprintf(stderr, "m40 mkmodel: --seed '%s' is not a non-negative integer\n", v);
                return 2;
            } else if (!strcmp(a, "--layers") && parse_u64(v, 1, 4096, &layers)) {
                fprintf(stderr, "m40 mkmodel: --layers '%s' is not an integer in 1..4096\n", v);
                return 2;
            } else if (!strcmp(a, "--threads") && parse_u64(v, 1, 4096, &threads)) {
                fprintf(stderr, "m40 mkmodel: --threads '%s' is not an integer in 1..4096\n", v);
                return 2;
            }
            continue;
        }
        if (a[0] == '-' && a[1]) {
            fprintf(stderr, "m40 mkmodel: unknown option '%s'\n", a);
            mk_usage(stderr);
            return 2;
        }
        if (out) {
            fprintf(stderr, "m40 mkmodel: more than one output file ('%s', '%s')\n", out, a);
            mk_usage(stderr);
            return 2;
        }
        out = a;
    }
    if (!shape_name || !type_name || !out) {
        fprintf(stderr, "m40 mkmodel: %s is required\n", !shape_name ? "--shape" : !type_name ? "--type" : "OUT.gguf");
        mk_usage(stderr);
        return 2;
    }
    const m40_mkmodel_shape *shape = m40_mkmodel_find_shape(shape_name);
    if (!shape) {
        char names[256];
        shape_names(names, sizeof names);
        fprintf(stderr, "m40 mkmodel: unknown shape '%s' (shapes: %s)\n", shape_name, names);
        return 2;
    }
    m40_mkmodel_ftype ft;
    if (m40_mkmodel_parse_type(type_name, &ft) != 0) {
        fprintf(stderr, "m40 mkmodel: unknown type '%s' (types: %s)\n", type_name, m40_mkmodel_type_list());
        return 2;
    }

    m40_mkmodel_opts o = {.shape = shape, .ftype = ft, .seed = seed, .n_layers = (int32_t)layers,
                          .n_threads = (int)threads, .dry_run = dry_run, .quick = quick};
    m40_mkmodel_stats st;
    char err[512];
    if (m40_mkmodel_write(&o, out, &st, err, sizeof err) != 0) {
        fprintf(stderr, "m40: %s: %s\n", out, err);
        return 1;
    }
    int n_layers = layers ? (int)layers : shape->n_layers;
    if (dry_run) {
        printf("%s: %s %s, %d layers: %" PRIu64 " tensors, %" PRIu64 " parameters, %" PRIu64
               " bytes (not written)\n",
               out, shape->name, m40_mkmodel_type_name(ft), n_layers, st.n_tensors, st.n_params, st.file_bytes);
        return 0;
    }
    fprintf(stderr,
            "wrote %s: %s %s, %d layers, seed %" PRIu64 ": %" PRIu64 " tensors, %" PRIu64 " parameters, %.3f GB "
            "in %.2f s (%.0f MB/s, %d threads)\n",
            out, shape->name, m40_mkmodel_type_name(ft), n_layers, seed, st.n_tensors, st.n_params,
            st.file_bytes / 1e9, st.seconds, st.seconds > 0 ? st.file_bytes / 1e6 / st.seconds : 0.0,
            st.n_threads);
    return 0;
}
