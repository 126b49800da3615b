/* The model store: where it is, what is in it, and which file a name means (store.h). */
#define _XOPEN_SOURCE 700
#include "store.h"

#include <ctype.h>
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

int m40_store_dir(char *out, size_t len)
{
    const char *env = getenv("M40_MODELS");
    int n;
    if (env && *env)
        n = snprintf(out, len, "%s", env);
    else if (getenv("XDG_CACHE_HOME") && *getenv("XDG_CACHE_HOME"))
        n = snprintf(out, len, "%s/m40/models", getenv("XDG_CACHE_HOME"));
    else if (getenv("HOME") && *getenv("HOME"))
        n = snprintf(out, len, "%s/.cache/m40/models", getenv("HOME"));
    else
        return -1;
    if (n <= 0 || (size_t)n >= len)
        return -1;
    while (n > 1 && out[n - 1] == '/') /* "store/" and "store" name the same names */
        out[--n] = '\0';
    return 0;
}

int m40_store_mkdirs_for(const char *path)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    char *last = strrchr(buf, '/');
    if (!last || last == buf)
        return 0;
    *last = '\0';
    for (char *p = buf + 1; ; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return -1;
            *p = c;
            if (!c)
                break;
        }
    }
    return 0;
}

int m40_split_name(const char *name, int *index, int *count, size_t *prefix_len)
{
    /* "-NNNNN-of-NNNNN.gguf": 20 characters at the end */
    size_t n = strlen(name);
    if (n < 20)
        return 0;
    const char *s = name + n - 20;
    if (s[0] != '-' || strncmp(s + 6, "-of-", 4) || strcasecmp(s + 15, ".gguf"))
        return 0;
    for (int i = 0; i < 5; i++)
        if (!isdigit((unsigned char)s[1 + i]) || !isdigit((unsigned char)s[10 + i]))
            return 0;
    int a = atoi(s + 1), b = atoi(s + 10);
    if (a < 1 || b < 1 || a > b)
        return 0;
    *index = a;
    *count = b;
    *prefix_len = (size_t)(s - name);
    return 1;
}

int m40_quant_match(const char *file, const char *quant)
{
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    size_t q = strlen(quant);
    if (!q)
        return 0;
    for (const char *p = base; *p; p++) {
        if (strncasecmp(p, quant, q))
            continue;
        char before = p == base ? '-' : p[-1], after = p[q];
        if ((before == '-' || before == '.' || before == '_') && (after == '\0' || after == '-' || after == '.'))
            return 1;
    }
    return 0;
}

const char *m40_ftype_name(uint32_t ft)
{
    /* llama.cpp's llama_ftype (general.file_type); gaps are retired numbers */
    static const char *const names[] = {
        [0] = "F32",      [1] = "F16",     [2] = "Q4_0",     [3] = "Q4_1",    [7] = "Q8_0",
        [8] = "Q5_0",     [9] = "Q5_1",    [10] = "Q2_K",    [11] = "Q3_K_S", [12] = "Q3_K_M",
        [13] = "Q3_K_L",  [14] = "Q4_K_S", [15] = "Q4_K_M",  [16] = "Q5_K_S", [17] = "Q5_K_M",
        [18] = "Q6_K",    [19] = "IQ2_XXS", [20] = "IQ2_XS", [21] = "Q2_K_S", [22] = "IQ3_XS",
        [23] = "IQ3_XXS", [24] = "IQ1_S",  [25] = "IQ4_NL",  [26] = "IQ3_S",  [27] = "IQ3_M",
        [28] = "IQ2_S",   [29] = "IQ2_M",  [30] = "IQ4_XS",  [31] = "IQ1_M",  [32] = "BF16",
        [36] = "TQ1_0",   [37] = "TQ2_0",  [38] = "MXFP4_MOE"};
    return ft < sizeof names / sizeof names[0] ? names[ft] : NULL;
}

/* ---- scanning ---- */

static struct {
    m40_store_entry *v;
    size_t n, cap;
    size_t root_len;
    int failed;
} scan;

static int has_suffix(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcasecmp(s + a - b, suf);
}

static int visit(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)ftw;
    if (type != FTW_F || !S_ISREG(st->st_mode) || !has_suffix(path, ".gguf"))
        return 0;
    char sum[PATH_MAX];
    if (snprintf(sum, sizeof sum, "%s.sha256", path) >= (int)sizeof sum || access(sum, F_OK) != 0)
        return 0; /* not (yet) verified: not a model of the store */
    const char *rel = path + scan.root_len + 1;
    int idx = 1, count = 1;
    size_t plen = 0;
    int split = m40_split_name(rel, &idx, &count, &plen);
    /* a shard joins the entry of its first shard, found by the name's prefix */
    for (size_t i = 0; split && i < scan.n; i++) {
        m40_store_entry *e = &scan.v[i];
        size_t ep;
        int ei, ec;
        if (e->shards == count && m40_split_name(e->name, &ei, &ec, &ep) && ep == plen
            && !strncmp(e->name, rel, plen)) {
            e->size += (uint64_t)st->st_size;
            e->shards_present++;
            if (idx == 1) {
                snprintf(e->name, sizeof e->name, "%s", rel);
                snprintf(e->path, sizeof e->path, "%s", path);
            }
            return 0;
        }
    }
    if (scan.n == scan.cap) {
        size_t cap = scan.cap ? 2 * scan.cap : 16;
        m40_store_entry *v = realloc(scan.v, cap * sizeof *v);
        if (!v) {
            scan.failed = 1;
            return 1;
        }
        scan.v = v;
        scan.cap = cap;
    }
    m40_store_entry *e = &scan.v[scan.n++];
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s", rel);
    snprintf(e->path, sizeof e->path, "%s", path);
    e->size = (uint64_t)st->st_size;
    e->shards = split ? count : 1;
    e->shards_present = 1;
    return 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const m40_store_entry *)a)->name, ((const m40_store_entry *)b)->name);
}

int m40_store_scan(m40_store_entry **out, size_t *n)
{
    char root[PATH_MAX];
    *out = NULL;
    *n = 0;
    if (m40_store_dir(root, sizeof root) != 0)
        return -1;
    struct stat st;
    if (stat(root, &st) != 0)
        return errno == ENOENT ? 0 : -1;
    memset(&scan, 0, sizeof scan);
    scan.root_len = strlen(root);
    if (nftw(root, visit, 32, FTW_PHYS) != 0 || scan.failed) {
        free(scan.v);
        return -1;
    }
    /* a split whose shards came in another order may have been named by a later one */
    for (size_t i = 0; i < scan.n; i++) {
        m40_store_entry *e = &scan.v[i];
        int idx, count;
        size_t plen;
        if (e->shards > 1 && m40_split_name(e->name, &idx, &count, &plen) && idx != 1)
            e->shards_present = -e->shards_present; /* first shard missing: flagged incomplete */
    }
    qsort(scan.v, scan.n, sizeof *scan.v, by_name);
    *out = scan.v;
    *n = scan.n;
    return 0;
}

/* ---- names ---- */

static const char *base_of(const char *name)
{
    const char *s = strrchr(name, '/');
    return s ? s + 1 : name;
}

/* Rule r of m40_store_resolve's list: does entry name e match arg? */
static int rule_matches(int r, const char *name, const char *arg)
{
    size_t al = strlen(arg);
    switch (r) {
    case 0:
        return !strcmp(name, arg);
    case 1:
        return !strncmp(name, arg, al) && !strcasecmp(name + al, ".gguf");
    case 2: {
        const char *colon = strrchr(arg, ':');
        if (!colon || colon == arg || strchr(colon, '/'))
            return 0;
        size_t rl = (size_t)(colon - arg);
        return !strncmp(name, arg, rl) && name[rl] == '/' && m40_quant_match(name, colon + 1);
    }
    case 3:
        return al && !strncmp(name, arg, al) && name[al] == '/';
    case 4: {
        const char *b = base_of(name);
        size_t bl = strlen(b);
        return !strcmp(b, arg) || (bl == al + 5 && !strncmp(b, arg, al) && !strcasecmp(b + al, ".gguf"));
    }
    }
    return 0;
}

int m40_store_resolve(const char *arg, char *path, size_t pathlen, char *err, size_t errlen)
{
    struct stat st;
    if (stat(arg, &st) == 0 && S_ISREG(st.st_mode)) {
        snprintf(path, pathlen, "%s", arg);
        return 0;
    }
    m40_store_entry *v;
    size_t n;
    char root[PATH_MAX] = "";
    m40_store_dir(root, sizeof root);
    if (m40_store_scan(&v, &n) != 0) {
        snprintf(err, errlen, "cannot read the model store %s: %s", root, strerror(errno));
        return -1;
    }
    int rc = -1;
    snprintf(err, errlen, "no file %s and no model of that name in the store %s (m40 list shows it, m40 pull fills it)",
             arg, root);
    for (int r = 0; r < 5; r++) {
        size_t hits = 0, first = 0;
        for (size_t i = 0; i < n; i++)
            if (rule_matches(r, v[i].name, arg) && !hits++)
                first = i;
        if (hits == 1) {
            m40_store_entry *e = &v[first];
            if (e->shards_present != e->shards) {
                snprintf(err, errlen, "%s: %d of the %d shards are in the store; m40 pull it again", e->name,
                         e->shards_present < 0 ? -e->shards_present : e->shards_present, e->shards);
                rc = -2;
                break;
            }
            snprintf(path, pathlen, "%s", e->path);
            rc = 0;
            break;
        }
        if (hits > 1) {
            int w = snprintf(err, errlen, "%s is ambiguous in the store; it could be:", arg);
            for (size_t i = 0; i < n && w > 0 && (size_t)w < errlen; i++)
                if (rule_matches(r, v[i].name, arg))
                    w += snprintf(err + w, errlen - w, " %s", v[i].name);
            rc = -2;
            break;
        }
    }
    free(v);
    return rc;
}

const char *m40_model_arg(const char *cmd, const char *arg, char *buf, size_t len)
{
    char err[1024];
    int rc = m40_store_resolve(arg, buf, len, err, sizeof err);
    if (rc == 0)
        return buf;
    /* a path that does not exist is the loader's to report; a store name gets the reason */
    if (rc == -2 || (arg[0] != '/' && arg[0] != '.' && !has_suffix(arg, ".gguf")))
        fprintf(stderr, "m40 %s: %s\n", cmd, err);
    return arg;
}
