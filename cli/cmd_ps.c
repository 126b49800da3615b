/* m40 ps [URL]: what a running m40 server holds, from its /health: per model the state,
 * device, memory, sequences running of the slots, requests queued and the context.
 * /health is either one model's object or {"models": [...]} of several (several
 * m40_model per nginx); both are read. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli.h"
#include "http.h"

static void fmt_bytes(char *out, size_t len, json_t *v)
{
    if (!json_is_number(v)) {
        snprintf(out, len, "-");
        return;
    }
    double b = json_number_value(v);
    if (b >= 1073741824.0)
        snprintf(out, len, "%.2f GiB", b / 1073741824.0);
    else
        snprintf(out, len, "%.1f MiB", b / 1048576.0);
}

static void fmt_int(char *out, size_t len, json_t *v)
{
    if (json_is_integer(v))
        snprintf(out, len, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    else
        snprintf(out, len, "-");
}

static void row(json_t *m)
{
    const char *name = json_string_value(json_object_get(m, "model"));
    if (!name)
        name = json_string_value(json_object_get(m, "name"));
    const char *state = json_string_value(json_object_get(m, "status"));
    if (!state)
        state = json_string_value(json_object_get(m, "state"));
    const char *device = json_string_value(json_object_get(m, "device"));
    char mem[32], run[32], max[32], queued[32], ctx[32], seqs[64];
    fmt_bytes(mem, sizeof mem, json_object_get(m, "memory_bytes"));
    fmt_int(run, sizeof run, json_object_get(m, "running"));
    fmt_int(max, sizeof max, json_object_get(m, "max_seqs"));
    fmt_int(queued, sizeof queued, json_object_get(m, "queued"));
    fmt_int(ctx, sizeof ctx, json_object_get(m, "ctx_size"));
    snprintf(seqs, sizeof seqs, "%s/%s", run, max);
    printf("%-24s  %-8s  %-7s  %10s  %9s  %6s  %7s\n", name ? name : "?", state ? state : "?", device ? device : "-",
           mem, seqs, queued, ctx);
}

int m40_cmd_ps(int argc, char **argv)
{
    const char *base = "http://127.0.0.1:8080";
    if (argc > 2 || (argc == 2 && argv[1][0] == '-')) {
        int help = argc == 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"));
        fprintf(help ? stdout : stderr,
                "usage: m40 ps [URL]   what a running m40 server holds (default %s, m40 serve's)\n", base);
        return help ? 0 : 2;
    }
    if (argc == 2)
        base = argv[1];
    char url[4096];
    size_t bl = strlen(base);
    while (bl && base[bl - 1] == '/')
        bl--;
    snprintf(url, sizeof url, "%.*s/health", (int)bl, base);
    m40_http_buf b;
    char err[1024];
    long st = m40_http_get(url, NULL, &b, err, sizeof err);
    if (st < 0) {
        fprintf(stderr, "m40 ps: no m40 server answers at %.*s (%s)\n", (int)bl, base, err);
        free(b.data);
        return 1;
    }
    json_t *root = json_loads(b.data, 0, NULL);
    free(b.data);
    /* 503 is a model loading or failed: its body still says which */
    if (!json_is_object(root)) {
        fprintf(stderr, "m40 ps: %s answered HTTP %ld without the JSON of m40's /health\n", url, st);
        json_decref(root);
        return 1;
    }
    printf("%-24s  %-8s  %-7s  %10s  %9s  %6s  %7s\n", "NAME", "STATE", "DEVICE", "MEMORY", "SEQUENCES", "QUEUED",
           "CONTEXT");
    json_t *models = json_object_get(root, "models");
    if (json_is_array(models)) {
        size_t i;
        json_t *m;
        json_array_foreach(models, i, m) row(m);
    } else {
        row(root);
    }
    json_decref(root);
    return 0;
}
