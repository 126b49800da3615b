/* `m40 info MODEL`: what a GGUF file holds, read through the same validating reader
 * the engine uses (so a file info accepts is one the engine can at least parse). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "store.h"
#include "ref/ggml_types.h"
#include "gguf/gguf.h"

/* One value on one line: strings quoted and cut short, arrays summarized with their
 * first items (vocabularies run to 262k entries). */
static void print_value(FILE *f, const m40_gguf_value *v, int depth)
{
    switch (v->type) {
    case M40_GGUF_UINT8: case M40_GGUF_UINT16: case M40_GGUF_UINT32: case M40_GGUF_UINT64:
        fprintf(f, "%" PRIu64, v->v.u64);
        break;
    case M40_GGUF_INT8: case M40_GGUF_INT16: case M40_GGUF_INT32: case M40_GGUF_INT64:
        fprintf(f, "%" PRId64, v->v.i64);
        break;
    case M40_GGUF_FLOAT32: case M40_GGUF_FLOAT64:
        fprintf(f, "%g", v->v.f64);
        break;
    case M40_GGUF_BOOL:
        fputs(v->v.b ? "true" : "false", f);
        break;
    case M40_GGUF_STRING: {
        fputc('"', f);
        uint64_t n = v->v.str.len < 60 ? v->v.str.len : 60;
        for (uint64_t i = 0; i < n; i++) {
            unsigned char c = (unsigned char)v->v.str.ptr[i];
            if (c == '"' || c == '\\')
                fprintf(f, "\\%c", c);
            else if (c < 0x20 || c == 0x7f)
                fprintf(f, "\\x%02x", c);
            else
                fputc(c, f);
        }
        fputc('"', f);
        if (n < v->v.str.len)
            fprintf(f, "... (%" PRIu64 " bytes)", v->v.str.len);
        break;
    }
    case M40_GGUF_ARRAY: {
        uint64_t shown = v->v.arr.n < 4 ? v->v.arr.n : 4;
        fprintf(f, "[%s x %" PRIu64 "]", m40_gguf_type_name(v->v.arr.type), v->v.arr.n);
        if (depth > 0 || !shown)
            break;
        fputs(" [", f);
        for (uint64_t i = 0; i < shown; i++) {
            if (i)
                fputs(", ", f);
            print_value(f, &v->v.arr.items[i], depth + 1);
        }
        fputs(shown < v->v.arr.n ? ", ...]" : "]", f);
        break;
    }
    default:
        fputs("?", f);
    }
}

static void print_bytes(FILE *f, uint64_t n)
{
    if (n >= (1u << 20))
        fprintf(f, "%.2f MiB", n / 1048576.0);
    else if (n >= 1024)
        fprintf(f, "%.1f KiB", n / 1024.0);
    else
        fprintf(f, "%" PRIu64 " B", n);
}

static void print_opt_u32(const m40_gguf *g, const char *label, const char *key)
{
    uint32_t v;
    if (!m40_gguf_get_u32(g, key, &v))
        printf("  %-34s %u\n", label, v);
}

static void print_tokenizer(const m40_gguf *g)
{
    const char *model = m40_gguf_get_str(g, "tokenizer.ggml.model");
    const char *pre = m40_gguf_get_str(g, "tokenizer.ggml.pre");
    const m40_gguf_value *tokens = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    const m40_gguf_value *merges = m40_gguf_get_arr(g, "tokenizer.ggml.merges", M40_GGUF_STRING);
    const m40_gguf_value *tmpl = m40_gguf_get(g, "tokenizer.chat_template");
    printf("tokenizer:\n");
    printf("  %-34s %s\n", "model", model ? model : "(none)");
    if (pre)
        printf("  %-34s %s\n", "pre", pre);
    if (tokens)
        printf("  %-34s %" PRIu64 "\n", "vocab size", tokens->v.arr.n);
    else
        printf("  %-34s (no tokenizer.ggml.tokens)\n", "vocab size");
    if (merges)
        printf("  %-34s %" PRIu64 "\n", "merges", merges->v.arr.n);
    print_opt_u32(g, "bos id", "tokenizer.ggml.bos_token_id");
    print_opt_u32(g, "eos id", "tokenizer.ggml.eos_token_id");
    print_opt_u32(g, "unk id", "tokenizer.ggml.unknown_token_id");
    print_opt_u32(g, "pad id", "tokenizer.ggml.padding_token_id");
    int b;
    if (!m40_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b))
        printf("  %-34s %s\n", "add bos", b ? "yes" : "no");
    if (tmpl && tmpl->type == M40_GGUF_STRING)
        printf("  %-34s present (%" PRIu64 " bytes)\n", "chat template", tmpl->v.str.len);
    else
        printf("  %-34s absent\n", "chat template");
}

static void print_tensors(const m40_gguf *g)
{
    uint64_t count[M40_TYPE_COUNT] = {0}, bytes[M40_TYPE_COUNT] = {0}, total = 0, params = 0;
    uint64_t n = m40_gguf_n_tensors(g);
    for (uint64_t i = 0; i < n; i++) {
        const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
        /* the reader only accepts known types, all below M40_TYPE_COUNT */
        count[t->type]++;
        bytes[t->type] += t->nbytes;
        total += t->nbytes;
        params += t->n_elems;
    }
    printf("tensors: %" PRIu64 ", %" PRIu64 " parameters, ", n, params);
    print_bytes(stdout, total);
    printf("\n");
    for (uint32_t ty = 0; ty < M40_TYPE_COUNT; ty++) {
        if (!count[ty])
            continue;
        printf("  %-8s %6" PRIu64 " tensors  ", m40_type_name(ty), count[ty]);
        print_bytes(stdout, bytes[ty]);
        printf("\n");
    }
    if (!n)
        return;
    printf("\n%-40s %-6s %-26s %s\n", "name", "type", "shape", "size");
    for (uint64_t i = 0; i < n; i++) {
        const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
        char shape[128];
        int k = 0;
        for (uint32_t d = 0; d < t->n_dims && k >= 0 && (size_t)k < sizeof shape; d++)
            k += snprintf(shape + k, sizeof shape - k, d ? " x %" PRIu64 : "%" PRIu64, t->ne[d]);
        printf("%-40s %-6s %-26s ", t->name, m40_type_name(t->type), shape);
        print_bytes(stdout, t->nbytes);
        printf("\n");
    }
}

int m40_cmd_info(int argc, char **argv)
{
    if (argc != 2 || argv[1][0] == '-') {
        if (argc == 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
            printf("usage: m40 info MODEL\n");
            return 0;
        }
        fprintf(stderr, "usage: m40 info MODEL\n");
        return 2;
    }
    char stored[PATH_MAX];
    const char *path = m40_model_arg("info", argv[1], stored, sizeof stored);
    char err[512];
    m40_gguf *g;
    if (m40_gguf_open(path, &g, err, sizeof err)) {
        fprintf(stderr, "m40: %s: %s\n", path, err);
        return 1;
    }
    const char *arch = m40_gguf_arch(g);
    const char *name = m40_gguf_get_str(g, "general.name");
    printf("file:                                %s\n", path);
    printf("GGUF version:                        %u\n", m40_gguf_version(g));
    printf("alignment:                           %" PRIu64 "\n", m40_gguf_alignment(g));
    printf("data offset:                         %" PRIu64 "\n", m40_gguf_data_offset(g));
    printf("file size:                           %" PRIu64 "\n", m40_gguf_file_size(g));
    printf("metadata keys:                       %" PRIu64 "\n", m40_gguf_n_kv(g));
    printf("architecture:                        %s\n", arch ? arch : "(none)");
    printf("name:                                %s\n", name ? name : "(none)");

    /* every "<arch>." key: hyperparameters differ per architecture, so list what the
     * file has instead of a fixed set */
    if (arch) {
        size_t al = strlen(arch);
        printf("hyperparameters:\n");
        int any = 0;
        for (uint64_t i = 0; i < m40_gguf_n_kv(g); i++) {
            const m40_gguf_kv *kv = m40_gguf_kv_at(g, i);
            if (strncmp(kv->key, arch, al) || kv->key[al] != '.')
                continue;
            printf("  %-34s ", kv->key + al + 1);
            print_value(stdout, &kv->value, 0);
            printf("\n");
            any = 1;
        }
        if (!any)
            printf("  (none)\n");
    }
    print_tokenizer(g);
    print_tensors(g);
    m40_gguf_close(g);
    if (fflush(stdout) != 0) {
        fprintf(stderr, "m40: writing output failed\n");
        return 1;
    }
    return 0;
}
