/* m40 pull ORG/REPO[:QUANT] | ORG/REPO/FILE.gguf: a GGUF model from a Hugging Face-style
 * hub into the model store (store.h).
 *
 * The file list and each LFS file's sha256 come from {endpoint}/api/models/{repo}/tree/
 * {revision}?recursive=true; files from {endpoint}/{repo}/resolve/{revision}/{file}
 * (redirects followed, the hub's X-Linked-ETag read as a second source of the sha256).
 * A download goes to FILE.partial and resumes with HTTP Range after a dropped connection
 * (a few retries here, or a later m40 pull); the file counts as present only after its
 * size, sha256 and the GGUF reader accepted it. A split model's shards all come. */
#define _XOPEN_SOURCE 700
#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"
#include "gguf/gguf.h"
#include "http.h"
#include "sha256.h"
#include "store.h"

#define PULL_TRIES 6

typedef struct {
    char *path;      /* inside the repository */
    uint64_t size;   /* 0: unknown */
    char sha[65];    /* "" when the hub gave none */
} hub_file;

static void pull_usage(FILE *f)
{
    fprintf(f, "usage: m40 pull ORG/REPO[:QUANT] | ORG/REPO/FILE.gguf [--revision REV]\n"
               "  downloads a GGUF model from a Hugging Face-style hub into the model store\n"
               "  QUANT        the quantization in the file's name, e.g. Q4_K_M (case-insensitive)\n"
               "  --revision   branch, tag or commit (default main)\n"
               "environment: HF_ENDPOINT (default https://huggingface.co), HF_TOKEN (or the\n"
               "  token file of huggingface-cli login), M40_MODELS (the store, default\n"
               "  ~/.cache/m40/models)\n");
}

static int is_hex64(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (!isxdigit((unsigned char)s[n]))
            return 0;
    return n == 64;
}

/* HF_TOKEN, else the file huggingface_hub's login writes ($HF_TOKEN_PATH,
 * $HF_HOME/token, ~/.cache/huggingface/token). */
static const char *hf_token(char *buf, size_t len)
{
    const char *t = getenv("HF_TOKEN");
    if (t && *t)
        return t;
    char path[4096];
    if (getenv("HF_TOKEN_PATH"))
        snprintf(path, sizeof path, "%s", getenv("HF_TOKEN_PATH"));
    else if (getenv("HF_HOME"))
        snprintf(path, sizeof path, "%s/token", getenv("HF_HOME"));
    else if (getenv("HOME"))
        snprintf(path, sizeof path, "%s/.cache/huggingface/token", getenv("HOME"));
    else
        return NULL;
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    size_t n = fread(buf, 1, len - 1, f);
    fclose(f);
    buf[n] = '\0';
    while (n && isspace((unsigned char)buf[n - 1]))
        buf[--n] = '\0';
    return n ? buf : NULL;
}

static void fmt_bytes(char *out, size_t len, double b)
{
    if (b >= 1073741824.0)
        snprintf(out, len, "%.2f GiB", b / 1073741824.0);
    else if (b >= 1048576.0)
        snprintf(out, len, "%.1f MiB", b / 1048576.0);
    else if (b >= 1024.0)
        snprintf(out, len, "%.1f KiB", b / 1024.0);
    else
        snprintf(out, len, "%.0f B", b);
}

/* Appends s to out, %-escaping what is not safe in a URL path; '/' kept when keep_slash. */
static void url_append(char *out, size_t len, const char *s, int keep_slash)
{
    size_t o = strlen(out);
    for (; *s && o + 4 < len; s++) {
        unsigned char c = (unsigned char)*s;
        if (isalnum(c) || strchr("-._~", c) || (keep_slash && c == '/'))
            out[o++] = (char)c;
        else
            o += (size_t)snprintf(out + o, len - o, "%%%02X", c);
    }
    out[o] = '\0';
}

/* Why a hub request failed, in words an operator can act on. */
static void http_reason(long status, const char *what, const char *repo, int have_token, char *err, size_t errlen)
{
    if (status == 401 || status == 403)
        snprintf(err, errlen, "%s: HTTP %ld: the repository %s is private or gated, or does not exist;%s", what,
                 status, repo,
                 have_token ? " check that HF_TOKEN is valid and has access to it (accept the model's licence on"
                              " the hub first for a gated model)"
                            : " if it exists, set HF_TOKEN to an access token with read access to it");
    else if (status == 404)
        snprintf(err, errlen, "%s: HTTP 404: %s not found (check the repository name and the revision)", what, repo);
    else
        snprintf(err, errlen, "%s: HTTP %ld", what, status);
}

static int safe_path(const char *p)
{
    if (!*p || *p == '/' || strstr(p, "//") || strchr(p, '\\'))
        return 0;
    for (const char *s = p; s; s = strchr(s, '/')) {
        if (*s == '/')
            s++;
        if (!strncmp(s, "..", 2) && (s[2] == '/' || !s[2]))
            return 0;
        if (!strncmp(s, ".", 1) && (s[1] == '/' || !s[1]))
            return 0;
    }
    for (const unsigned char *s = (const unsigned char *)p; *s; s++)
        if (*s < 0x20)
            return 0;
    return 1;
}

/* The repository's GGUF files. 0, or -1 with the reason. */
static int list_repo(const char *endpoint, const char *repo, const char *rev, const char *token, hub_file **out,
                     size_t *n, char *err, size_t errlen)
{
    char url[8192];
    snprintf(url, sizeof url, "%s/api/models/", endpoint);
    url_append(url, sizeof url, repo, 1);
    strcat(url, "/tree/");
    url_append(url, sizeof url, rev, 0);
    strcat(url, "?recursive=true");
    m40_http_buf b;
    char cerr[512];
    long st = m40_http_get(url, token, &b, cerr, sizeof cerr);
    if (st < 0) {
        snprintf(err, errlen, "listing the files of %s: %s", repo, cerr);
        free(b.data);
        return -1;
    }
    if (st != 200) {
        http_reason(st, "listing the files", repo, token != NULL, err, errlen);
        free(b.data);
        return -1;
    }
    json_error_t je;
    json_t *root = json_loads(b.data, 0, &je);
    free(b.data);
    if (!json_is_array(root)) {
        snprintf(err, errlen, "listing the files of %s: the hub's answer is not a JSON array (%s)", repo,
                 root ? "another JSON value" : je.text);
        json_decref(root);
        return -1;
    }
    *out = calloc(json_array_size(root) + 1, sizeof **out);
    *n = 0;
    size_t i;
    json_t *it;
    json_array_foreach(root, i, it)
    {
        const char *type = json_string_value(json_object_get(it, "type"));
        const char *path = json_string_value(json_object_get(it, "path"));
        if (!path || (type && strcmp(type, "file")))
            continue;
        size_t pl = strlen(path);
        if (pl < 5 || strcasecmp(path + pl - 5, ".gguf") || !safe_path(path))
            continue;
        hub_file *f = &(*out)[(*n)++];
        f->path = strdup(path);
        json_t *lfs = json_object_get(it, "lfs");
        json_t *size = json_object_get(lfs ? lfs : it, "size");
        f->size = json_is_integer(size) && json_integer_value(size) > 0 ? (uint64_t)json_integer_value(size) : 0;
        const char *oid = json_string_value(json_object_get(lfs, "oid"));
        if (oid && !strncmp(oid, "sha256:", 7))
            oid += 7;
        if (oid && is_hex64(oid))
            for (int k = 0; k < 65; k++)
                f->sha[k] = (char)tolower((unsigned char)oid[k]);
    }
    json_decref(root);
    return 0;
}

/* ---- one download ---- */

typedef struct {
    CURL *c;
    FILE *f;
    const char *name;
    uint64_t offset;       /* bytes in the .partial before this request */
    uint64_t written;      /* this request's bytes */
    uint64_t total;        /* expected size, 0: unknown */
    int decided;           /* the first body byte's response code was looked at */
    int bad_range;         /* a 206 that does not start where the partial ends */
    int write_errno;
    long range_start;      /* Content-Range's first byte, -1: none */
    char linked_etag[128];
    int tty;
    double last_draw, t0;
    int last_quarter;
} xfer;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static size_t on_header(char *p, size_t size, size_t n, void *ud)
{
    xfer *x = ud;
    size_t len = size * n;
    char line[512];
    size_t l = len < sizeof line - 1 ? len : sizeof line - 1;
    memcpy(line, p, l);
    line[l] = '\0';
    while (l && (line[l - 1] == '\r' || line[l - 1] == '\n'))
        line[--l] = '\0';
    if (!strncmp(line, "HTTP/", 5))
        x->range_start = -1; /* a new response (after a redirect) */
    else if (!strncasecmp(line, "content-range:", 14)) {
        const char *v = line + 14;
        while (*v == ' ')
            v++;
        if (!strncasecmp(v, "bytes ", 6))
            x->range_start = strtol(v + 6, NULL, 10);
    } else if (!strncasecmp(line, "x-linked-etag:", 14)) {
        /* the LFS file's sha256, quoted, maybe weak ("W/") */
        const char *v = line + 14;
        while (*v == ' ')
            v++;
        if (!strncmp(v, "W/", 2))
            v += 2;
        if (*v == '"')
            v++;
        snprintf(x->linked_etag, sizeof x->linked_etag, "%.127s", v);
        char *q = strchr(x->linked_etag, '"');
        if (q)
            *q = '\0';
    }
    return len;
}

static size_t on_body(char *p, size_t size, size_t n, void *ud)
{
    xfer *x = ud;
    size_t len = size * n;
    long code = 0;
    curl_easy_getinfo(x->c, CURLINFO_RESPONSE_CODE, &code);
    if (code != 200 && code != 206)
        return len; /* an error page: the status says it all */
    if (!x->decided) {
        x->decided = 1;
        if (code == 206 && (x->range_start < 0 || (uint64_t)x->range_start != x->offset)) {
            x->bad_range = 1;
            return 0;
        }
        if (code == 200 && x->offset > 0) {
            /* the server ignored the Range: start over */
            if (ftruncate(fileno(x->f), 0) != 0 || fseek(x->f, 0, SEEK_SET) != 0) {
                x->write_errno = errno;
                return 0;
            }
            x->offset = 0;
        }
    }
    if (fwrite(p, 1, len, x->f) != len) {
        x->write_errno = errno ? errno : EIO;
        return 0;
    }
    x->written += len;
    return len;
}

static void draw(xfer *x, int final)
{
    double t = now_s();
    uint64_t have = x->offset + x->written;
    if (x->tty) {
        if (!final && t - x->last_draw < 0.1)
            return;
        x->last_draw = t;
        char a[32], b[32], r[32];
        fmt_bytes(a, sizeof a, (double)have);
        fmt_bytes(b, sizeof b, (double)x->total);
        double el = t - x->t0;
        fmt_bytes(r, sizeof r, el > 0 ? x->written / el : 0);
        int pct = x->total ? (int)(100.0 * have / x->total) : 0;
        char bar[31];
        int fill = pct * 30 / 100;
        for (int i = 0; i < 30; i++)
            bar[i] = i < fill ? '#' : '-';
        bar[30] = '\0';
        fprintf(stderr, "\r%.40s [%s] %3d%% %s / %s  %s/s   ", x->name, bar, pct, a, x->total ? b : "?", r);
        if (final)
            fputc('\n', stderr);
    } else if (x->total) {
        int q = (int)(4.0 * have / x->total);
        if (q > x->last_quarter && q < 4) {
            x->last_quarter = q;
            char a[32], b[32];
            fmt_bytes(a, sizeof a, (double)have);
            fmt_bytes(b, sizeof b, (double)x->total);
            fprintf(stderr, "%s: %d%% (%s of %s)\n", x->name, q * 25, a, b);
        }
    }
}

static int on_progress(void *ud, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ult, curl_off_t uln)
{
    xfer *x = ud;
    if (!x->total && dltotal > 0)
        x->total = x->offset + (uint64_t)dltotal;
    draw(x, 0);
    return 0;
}

static int retryable(CURLcode rc)
{
    return rc == CURLE_PARTIAL_FILE || rc == CURLE_RECV_ERROR || rc == CURLE_SEND_ERROR || rc == CURLE_GOT_NOTHING
           || rc == CURLE_OPERATION_TIMEDOUT || rc == CURLE_COULDNT_CONNECT || rc == CURLE_HTTP2
           || rc == CURLE_HTTP2_STREAM || rc == CURLE_SSL_CONNECT_ERROR;
}

/* Downloads f into dest (resuming dest.partial), verifies it and moves it in place. */
static int fetch(const char *endpoint, const char *repo, const char *rev, const char *token, const hub_file *hf,
                 const char *dest, char *err, size_t errlen)
{
    char partial[PATH_MAX + 16], sumfile[PATH_MAX + 16];
    snprintf(partial, sizeof partial, "%s.partial", dest);
    snprintf(sumfile, sizeof sumfile, "%s.sha256", dest);
    const char *name = strrchr(hf->path, '/') ? strrchr(hf->path, '/') + 1 : hf->path;

    /* already here and verified against the same sha256: nothing to do */
    if (hf->sha[0] && access(dest, F_OK) == 0) {
        FILE *s = fopen(sumfile, "r");
        char have[65] = "";
        if (s) {
            if (fscanf(s, "%64s", have) != 1)
                have[0] = '\0';
            fclose(s);
        }
        if (!strcmp(have, hf->sha)) {
            fprintf(stderr, "%s: up to date\n", name);
            return 0;
        }
    }
    if (m40_store_mkdirs_for(dest) != 0) {
        snprintf(err, errlen, "cannot create the folder of %s: %s", dest, strerror(errno));
        return -1;
    }

    char url[8192];
    snprintf(url, sizeof url, "%s/", endpoint);
    url_append(url, sizeof url, repo, 1);
    strcat(url, "/resolve/");
    url_append(url, sizeof url, rev, 0);
    strcat(url, "/");
    url_append(url, sizeof url, hf->path, 1);

    xfer x;
    memset(&x, 0, sizeof x); /* a partial already whole skips the transfer: no X-Linked-ETag then */
    int done = 0;
    for (int attempt = 1; attempt <= PULL_TRIES && !done; attempt++) {
        FILE *f = fopen(partial, "ab");
        if (!f) {
            snprintf(err, errlen, "%s: %s", partial, strerror(errno));
            return -1;
        }
        struct stat st;
        fstat(fileno(f), &st);
        uint64_t offset = (uint64_t)st.st_size;
        if (hf->size && offset > hf->size) { /* not the file we expect: start over */
            if (ftruncate(fileno(f), 0) != 0) {
                snprintf(err, errlen, "%s: %s", partial, strerror(errno));
                fclose(f);
                return -1;
            }
            offset = 0;
        }
        if (hf->size && offset == hf->size && hf->sha[0]) { /* complete before: just verify */
            fclose(f);
            done = 1;
            break;
        }
        if (hf->size) { /* fail early, not after hours, when the disk cannot hold it */
            struct statvfs vfs;
            char dir[PATH_MAX];
            snprintf(dir, sizeof dir, "%s", dest);
            *strrchr(dir, '/') = '\0';
            if (statvfs(dir, &vfs) == 0 && (uint64_t)vfs.f_bavail * vfs.f_frsize < hf->size - offset) {
                char need[32], have[32];
                fmt_bytes(need, sizeof need, (double)(hf->size - offset));
                fmt_bytes(have, sizeof have, (double)vfs.f_bavail * vfs.f_frsize);
                snprintf(err, errlen, "not enough disk space in %s: %s to download, %s free", dir, need, have);
                fclose(f);
                return -1;
            }
        }
        memset(&x, 0, sizeof x);
        x.f = f;
        x.name = name;
        x.offset = offset;
        x.total = hf->size;
        x.range_start = -1;
        x.tty = isatty(2);
        x.t0 = now_s();
        x.last_quarter = hf->size ? (int)(4.0 * offset / hf->size) : 0;
        struct curl_slist *h;
        x.c = m40_http_handle(url, token, &h);
        if (!x.c) {
            fclose(f);
            snprintf(err, errlen, "cannot start libcurl");
            return -1;
        }
        char range[64];
        if (offset) {
            snprintf(range, sizeof range, "%llu-", (unsigned long long)offset);
            curl_easy_setopt(x.c, CURLOPT_RANGE, range);
            if (attempt == 1) {
                char a[32];
                fmt_bytes(a, sizeof a, (double)offset);
                fprintf(stderr, "%s: resuming after %s\n", name, a);
            }
        }
        curl_easy_setopt(x.c, CURLOPT_HEADERFUNCTION, on_header);
        curl_easy_setopt(x.c, CURLOPT_HEADERDATA, &x);
        curl_easy_setopt(x.c, CURLOPT_WRITEFUNCTION, on_body);
        curl_easy_setopt(x.c, CURLOPT_WRITEDATA, &x);
        curl_easy_setopt(x.c, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(x.c, CURLOPT_XFERINFODATA, &x);
        curl_easy_setopt(x.c, CURLOPT_NOPROGRESS, 0L);
        CURLcode rc = curl_easy_perform(x.c);
        long status = 0;
        curl_easy_getinfo(x.c, CURLINFO_RESPONSE_CODE, &status);
        curl_slist_free_all(h);
        curl_easy_cleanup(x.c);
        int close_err = fclose(f) != 0 ? errno : 0;
        if (x.written || x.tty)
            draw(&x, 1);
        if (x.write_errno || close_err) {
            int e = x.write_errno ? x.write_errno : close_err;
            snprintf(err, errlen, "writing %s: %s%s", partial, strerror(e),
                     e == ENOSPC ? " (the disk is full: free some space and run m40 pull again; it resumes)" : "");
            return -1;
        }
        if (x.bad_range) {
            snprintf(err, errlen, "%s: the server answered the range request from byte %llu with another range",
                     name, (unsigned long long)offset);
            unlink(partial);
            return -1;
        }
        if (rc == CURLE_OK && status == 416) { /* the partial is whole, or not this file */
            if (hf->size && offset == hf->size) {
                done = 1;
                break;
            }
            if (truncate(partial, 0) != 0) {
                snprintf(err, errlen, "%s: %s", partial, strerror(errno));
                return -1;
            }
            continue;
        }
        if (rc == CURLE_OK && status != 200 && status != 206) {
            http_reason(status, name, repo, token != NULL, err, errlen);
            return -1;
        }
        if (rc != CURLE_OK) {
            if (!retryable(rc) || attempt == PULL_TRIES) {
                snprintf(err, errlen, "downloading %s: %s (the partial download is kept: run m40 pull again to resume)",
                         name, curl_easy_strerror(rc));
                return -1;
            }
            fprintf(stderr, "%s: %s; resuming (attempt %d of %d)\n", name, curl_easy_strerror(rc), attempt + 1,
                    PULL_TRIES);
            usleep(200000u * (unsigned)attempt);
            continue;
        }
        done = 1;
    }
    if (!done) {
        snprintf(err, errlen, "downloading %s: no complete answer after %d tries", name, PULL_TRIES);
        return -1;
    }

    /* the sha256: the file list's, which the resolve answer's X-Linked-ETag must agree with */
    char want[65] = "";
    if (hf->sha[0])
        memcpy(want, hf->sha, 65);
    if (x.linked_etag[0] && is_hex64(x.linked_etag)) {
        char le[65];
        for (int k = 0; k < 65; k++)
            le[k] = (char)tolower((unsigned char)x.linked_etag[k]);
        if (want[0] && strcmp(want, le)) {
            snprintf(err, errlen, "%s: the hub gives two sha256s (file list %s, X-Linked-ETag %s); not trusting "
                                  "either (the partial download was removed)", name, want, le);
            unlink(partial);
            return -1;
        }
        memcpy(want, le, 65);
    }
    if (!want[0]) {
        snprintf(err, errlen, "%s: the hub gives no sha256 for it (not an LFS file?), so it cannot be verified", name);
        unlink(partial);
        return -1;
    }
    struct stat st;
    if (stat(partial, &st) != 0 || (hf->size && (uint64_t)st.st_size != hf->size)) {
        snprintf(err, errlen, "%s: %llu bytes downloaded, the hub lists %llu (the partial download was removed)",
                 name, (unsigned long long)st.st_size, (unsigned long long)hf->size);
        unlink(partial);
        return -1;
    }
    char got[65];
    if (m40_sha256_file(partial, got) != 0) {
        snprintf(err, errlen, "reading %s: %s", partial, strerror(errno));
        return -1;
    }
    if (strcmp(got, want)) {
        snprintf(err, errlen, "%s: checksum mismatch: the hub says sha256 %s, the download is %s (the partial "
                              "download was removed; run m40 pull again)", name, want, got);
        unlink(partial);
        return -1;
    }
    m40_gguf *g = NULL;
    char gerr[512];
    if (m40_gguf_open(partial, &g, gerr, sizeof gerr) != 0) {
        snprintf(err, errlen, "%s is not a valid GGUF file: %s (removed)", name, gerr);
        unlink(partial);
        return -1;
    }
    m40_gguf_close(g);
    /* the .gguf first, the .sha256 last: the store lists a file only once both exist */
    unlink(sumfile);
    if (rename(partial, dest) != 0) {
        snprintf(err, errlen, "rename %s: %s", partial, strerror(errno));
        return -1;
    }
    FILE *s = fopen(sumfile, "w");
    if (!s || fprintf(s, "%s  %s\n", got, name) < 0 || fclose(s) != 0) {
        snprintf(err, errlen, "writing %s: %s", sumfile, strerror(errno));
        return -1;
    }
    char sz[32];
    fmt_bytes(sz, sizeof sz, (double)st.st_size);
    fprintf(stderr, "%s: %s, sha256 %.12s... verified\n", name, sz, got);
    return 0;
}

/* ---- choosing the files ---- */

/* The shards that belong with files[i] (itself alone when it is not split), as indices. */
static size_t group_of(const hub_file *files, size_t n, size_t i, size_t *idx)
{
    int a, count;
    size_t plen, k = 0;
    if (!m40_split_name(files[i].path, &a, &count, &plen)) {
        idx[0] = i;
        return 1;
    }
    for (int want = 1; want <= count; want++)
        for (size_t j = 0; j < n; j++) {
            int b, c2;
            size_t p2;
            if (m40_split_name(files[j].path, &b, &c2, &p2) && b == want && c2 == count && p2 == plen
                && !strncmp(files[j].path, files[i].path, plen))
                idx[k++] = j;
        }
    return k;
}

/* Is files[i] the name of a model (a whole file, or a split's first shard)? */
static int model_head(const hub_file *f)
{
    int a, c;
    size_t p;
    return !m40_split_name(f->path, &a, &c, &p) || a == 1;
}

static void list_choices(const hub_file *files, size_t n, const char *quant, const char *repo)
{
    for (size_t i = 0; i < n; i++)
        if (model_head(&files[i]) && (!quant || m40_quant_match(files[i].path, quant))) {
            char sz[32];
            fmt_bytes(sz, sizeof sz, (double)files[i].size);
            fprintf(stderr, "  m40 pull %s/%s   (%s)\n", repo, files[i].path, sz);
        }
}

int m40_cmd_pull(int argc, char **argv)
{
    const char *spec = NULL, *rev = "main";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            pull_usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--revision") && i + 1 < argc)
            rev = argv[++i];
        else if (argv[i][0] == '-' || spec) {
            pull_usage(stderr);
            return 2;
        } else
            spec = argv[i];
    }
    if (!spec || !*rev) {
        pull_usage(stderr);
        return 2;
    }
    /* The hub's URLs are built in 8 KB buffers: the endpoint (< 2 KB), the repository (<
     * 512 bytes, never escaped) and the revision escaped (3 bytes a byte at most) then fit
     * with the literal parts (a longer revision let strcat write past the buffer). Hub
     * revisions are branch and tag names or commit hashes, far below this. */
    if (strlen(rev) > 255) {
        fprintf(stderr, "m40 pull: --revision: longer than 255 bytes\n");
        return 2;
    }

    /* ORG/REPO, ORG/REPO:QUANT or ORG/REPO/PATH.gguf */
    char repo[512], file[4096] = "", quant[64] = "";
    const char *s1 = strchr(spec, '/');
    const char *s2 = s1 ? strchr(s1 + 1, '/') : NULL;
    if (!s1 || s1 == spec) {
        fprintf(stderr, "m40 pull: %s: expected ORG/REPO[:QUANT] or ORG/REPO/FILE.gguf\n", spec);
        return 2;
    }
    size_t rl = s2 ? (size_t)(s2 - spec) : strlen(spec);
    const char *colon = s2 ? NULL : strchr(s1, ':');
    if (colon) {
        rl = (size_t)(colon - spec);
        snprintf(quant, sizeof quant, "%s", colon + 1);
    }
    if (rl >= sizeof repo) {
        fprintf(stderr, "m40 pull: repository name too long\n");
        return 2;
    }
    memcpy(repo, spec, rl);
    repo[rl] = '\0';
    if (s2)
        snprintf(file, sizeof file, "%s", s2 + 1);
    for (const char *p = repo; *p; p++)
        if (!(isalnum((unsigned char)*p) || strchr("-_./", *p))) {
            fprintf(stderr, "m40 pull: %s: not a valid repository name\n", repo);
            return 2;
        }
    if (strstr(repo, "..") || repo[rl - 1] == '/' || (colon && !quant[0])
        || (file[0] && (strlen(file) < 6 || strcasecmp(file + strlen(file) - 5, ".gguf") || !safe_path(file)))) {
        fprintf(stderr, "m40 pull: %s: expected ORG/REPO[:QUANT] or ORG/REPO/FILE.gguf\n", spec);
        return 2;
    }

    char endpoint[2048];
    const char *ep = getenv("HF_ENDPOINT");
    snprintf(endpoint, sizeof endpoint, "%s", ep && *ep ? ep : "https://huggingface.co");
    for (size_t l = strlen(endpoint); l > 0 && endpoint[l - 1] == '/'; l--)
        endpoint[l - 1] = '\0';
    char tokbuf[1024];
    const char *token = hf_token(tokbuf, sizeof tokbuf);
    char store[PATH_MAX];
    if (m40_store_dir(store, sizeof store) != 0) {
        fprintf(stderr, "m40 pull: no model store: set M40_MODELS or HOME\n");
        return 1;
    }

    char err[3 * PATH_MAX];
    hub_file *files = NULL;
    size_t n = 0;
    if (list_repo(endpoint, repo, rev, token, &files, &n, err, sizeof err) != 0) {
        fprintf(stderr, "m40 pull: %s\n", err);
        return 1;
    }
    int rc = 1;
    size_t *group = calloc(n + 1, sizeof *group), ng = 0;
    size_t pick = n;
    if (file[0]) {
        for (size_t i = 0; i < n; i++)
            if (!strcmp(files[i].path, file))
                pick = i;
        if (pick == n) {
            fprintf(stderr, "m40 pull: %s has no file %s at revision %s", repo, file, rev);
            fprintf(stderr, n ? "; its GGUF files:\n" : " (and no GGUF file at all)\n");
            list_choices(files, n, NULL, repo);
            goto out;
        }
    } else {
        size_t hits = 0;
        for (size_t i = 0; i < n; i++)
            if (model_head(&files[i]) && (!quant[0] || m40_quant_match(files[i].path, quant)) && !hits++)
                pick = i;
        if (hits != 1) {
            if (!n)
                fprintf(stderr, "m40 pull: %s has no GGUF file at revision %s\n", repo, rev);
            else if (!hits)
                fprintf(stderr, "m40 pull: no GGUF file of %s matches the quantization %s; its GGUF files:\n", repo,
                        quant);
            else
                fprintf(stderr, "m40 pull: %s holds %zu GGUF models%s%s; name one:\n", repo, hits,
                        quant[0] ? " matching " : "", quant);
            list_choices(files, n, hits ? (quant[0] ? quant : NULL) : NULL, repo);
            goto out;
        }
    }
    ng = group_of(files, n, pick, group);
    int a, count;
    size_t plen;
    if (m40_split_name(files[pick].path, &a, &count, &plen) && ng != (size_t)count) {
        fprintf(stderr, "m40 pull: %s is shard %d of a %d-file split model, but the repository lists %zu of them\n",
                files[pick].path, a, count, ng);
        goto out;
    }
    if (ng > 1)
        fprintf(stderr, "m40 pull: %s is split in %zu files; fetching them all\n", files[group[0]].path, ng);
    for (size_t k = 0; k < ng; k++) {
        const hub_file *hf = &files[group[k]];
        char dest[PATH_MAX];
        if (snprintf(dest, sizeof dest, "%s/%s/%s", store, repo, hf->path) >= (int)sizeof dest) {
            fprintf(stderr, "m40 pull: path too long\n");
            goto out;
        }
        if (fetch(endpoint, repo, rev, token, hf, dest, err, sizeof err) != 0) {
            fprintf(stderr, "m40 pull: %s\n", err);
            goto out;
        }
    }
    printf("%s/%s\n", repo, files[group[0]].path);
    fprintf(stderr, "m40 pull: done; serve it with: m40 serve %s/%s\n", repo, files[group[0]].path);
    rc = 0;
out:
    for (size_t i = 0; i < n; i++)
        free(files[i].path);
    free(files);
    free(group);
    return rc;
}
