/* m40 list: the models of the store (store.h) with what their GGUF metadata says. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "gguf/gguf.h"
#include "ref/ggml_types.h"
#include "store.h"

static void fmt_size(char *out, size_t len, uint64_t b)
{
    if (b >= (1ull << 30))
        snprintf(out, len, "%.1f GiB", b / 1073741824.0);
    else if (b >= (1ull << 20))
        snprintf(out, len, "%.1f MiB", b / 1048576.0);
    else
        snprintf(out, len, "%.1f KiB", b / 1024.0);
}

/* general.file_type's name; without it, the type most of the weights' bytes have. */
static void quant_of(const m40_gguf *g, char *out, size_t len)
{
    uint32_t ft;
    const char *name;
    if (!m40_gguf_get_u32(g, "general.file_type", &ft) && (name = m40_ftype_name(ft))) {
        snprintf(out, len, "%s", name);
        return;
    }
    uint64_t bytes[64] = {0};
    for (uint64_t i = 0; i < m40_gguf_n_tensors(g); i++) {
        const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
        if (t->type < 64)
            bytes[t->type] += t->nbytes;
    }
    int best = -1;
    for (int t = 0; t < 64; t++)
        if (bytes[t] && (best < 0 || bytes[t] > bytes[best]))
            best = t;
    snprintf(out, len, "%s", best >= 0 ? m40_type_name((uint32_t)best) : "?");
}

int m40_cmd_list(int argc, char **argv)
{
    if (argc > 1) {
        if (strcmp(argv[1], "-h") && strcmp(argv[1], "--help")) {
            fprintf(stderr, "usage: m40 list\n");
            return 2;
        }
        printf("usage: m40 list\n  the models of the store ($M40_MODELS, default ~/.cache/m40/models)\n");
        return 0;
    }
    char root[PATH_MAX] = "";
    m40_store_dir(root, sizeof root);
    m40_store_entry *v;
    size_t n;
    if (m40_store_scan(&v, &n) != 0) {
        fprintf(stderr, "m40 list: cannot read the model store %s\n", root);
        return 1;
    }
    size_t w = 4;
    for (size_t i = 0; i < n; i++)
        if (strlen(v[i].name) > w)
            w = strlen(v[i].name);
    printf("%-*s  %10s  %-12s  %-9s  %s\n", (int)w, "NAME", "SIZE", "ARCH", "QUANT", "CONTEXT");
    for (size_t i = 0; i < n; i++) {
        char size[32], quant[32] = "?", arch[64] = "?", ctx[32] = "?", note[96] = "";
        fmt_size(size, sizeof size, v[i].size);
        m40_gguf *g = NULL;
        char err[256];
        if (m40_gguf_open(v[i].path, &g, err, sizeof err) == 0) {
            const char *a = m40_gguf_arch(g);
            uint32_t c;
            if (a)
                snprintf(arch, sizeof arch, "%s", a);
            if (!m40_gguf_get_arch_u32(g, "context_length", &c))
                snprintf(ctx, sizeof ctx, "%u", c);
            quant_of(g, quant, sizeof quant);
            m40_gguf_close(g);
        } else {
            snprintf(note, sizeof note, "  (unreadable: %.70s)", err);
        }
        if (v[i].shards > 1 && v[i].shards_present != v[i].shards)
            snprintf(note, sizeof note, "  (%d of %d shards: incomplete)",
                     v[i].shards_present < 0 ? -v[i].shards_present : v[i].shards_present, v[i].shards);
        else if (v[i].shards > 1)
            snprintf(note, sizeof note, "  (%d shards)", v[i].shards);
        printf("%-*s  %10s  %-12s  %-9s  %s%s\n", (int)w, v[i].name, size, arch, quant, ctx, note);
    }
    if (!n)
        fprintf(stderr, "m40 list: the store %s holds no model (m40 pull ORG/REPO:QUANT fetches one)\n", root);
    free(v);
    return 0;
}
