/* Byte-for-byte comparison of our chat-template rendering with Python's jinja2.
 *
 * Every template in ../shared/templates/ and tests/templates/ (*.jinja), and the
 * tokenizer.chat_template of every GGUF in ../shared/models/ and models/next/ that has
 * one (a model's own template, e.g. gpt-oss's harmony format), is
 * rendered over every conversation in tests/jinja/conv_*.json, by us and by
 * tests/jinja/render.py (jinja2 set up as Hugging Face's apply_chat_template sets
 * it up). A pair passes when both renderings are identical, or when both refuse
 * (raise_exception, undefined variable, type error). Each template must render at
 * least one conversation successfully, so "both refused" cannot hide a template
 * we do not understand. Skips when python3 or jinja2 is missing.
 * M40_JINJA_VERBOSE=1 prints both error messages of every pair refused by both. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include <unistd.h>

#include "check.h"
#include "gguf/gguf.h"
#include "template/jinja.h"

#define FIXED_NOW 1721952000 /* 2024-07-26 00:00:00 UTC, as in render.py */

typedef struct {
    char **v;
    size_t n, cap;
} strlist;

static void sl_push(strlist *l, const char *s)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 16;
        l->v = realloc(l->v, l->cap * sizeof *l->v);
        if (!l->v) {
            perror("realloc");
            exit(2);
        }
    }
    l->v[l->n] = strdup(s);
    if (!l->v[l->n]) {
        perror("strdup");
        exit(2);
    }
    l->n++;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void list_dir(strlist *l, const char *dir, const char *prefix, const char *suffix)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    size_t first = l->n;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name), ns = strlen(suffix), np = strlen(prefix);
        if (n > ns + np && !strcmp(e->d_name + n - ns, suffix) && !strncmp(e->d_name, prefix, np)) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            sl_push(l, path);
        }
    }
    closedir(d);
    qsort(l->v + first, l->n - first, sizeof *l->v, cmp_str);
}

/* The chat templates of the GGUF files in dir, each written to tmpdir/<file>.jinja
 * (render.py reads a file) and listed. */
static void list_gguf_templates(strlist *l, const char *dir, const char *tmpdir)
{
    strlist files = {0};
    list_dir(&files, dir, "", ".gguf");
    for (size_t i = 0; i < files.n; i++) {
        m40_gguf *g = NULL;
        char err[256];
        if (m40_gguf_open(files.v[i], &g, err, sizeof err) != 0) {
            CHECK(0, "%s: %s", files.v[i], err);
            continue;
        }
        const m40_gguf_value *v = m40_gguf_get(g, "tokenizer.chat_template");
        if (v && v->type == M40_GGUF_STRING) {
            const char *name = strrchr(files.v[i], '/') ? strrchr(files.v[i], '/') + 1 : files.v[i];
            char path[4096];
            snprintf(path, sizeof path, "%s/%s.jinja", tmpdir, name);
            FILE *f = fopen(path, "wb");
            int ok = f && fwrite(v->v.str.ptr, 1, v->v.str.len, f) == v->v.str.len;
            if (f)
                ok &= fclose(f) == 0;
            CHECK(ok, "cannot write %s", path);
            if (ok)
                sl_push(l, path);
        }
        m40_gguf_close(g);
    }
    for (size_t i = 0; i < files.n; i++)
        free(files.v[i]);
    free(files.v);
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += got;
        if (cap - n - 1 == 0) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = n;
    }
    return buf;
}

/* Run render.py on one template and all conversations; its framed output. */
static char *run_reference(const char *tmpl, const strlist *convs, size_t *len)
{
    size_t cap = 256 + strlen(tmpl);
    for (size_t i = 0; i < convs->n; i++)
        cap += strlen(convs->v[i]) + 4;
    char *cmd = malloc(cap);
    if (!cmd)
        return NULL;
    size_t o = (size_t)snprintf(cmd, cap, "python3 tests/jinja/render.py '%s'", tmpl);
    for (size_t i = 0; i < convs->n; i++)
        o += (size_t)snprintf(cmd + o, cap - o, " '%s'", convs->v[i]);
    FILE *p = popen(cmd, "r");
    free(cmd);
    if (!p)
        return NULL;
    size_t bcap = 1 << 16, n = 0, got;
    char *buf = malloc(bcap);
    while (buf && (got = fread(buf + n, 1, bcap - n, p)) > 0) {
        n += got;
        if (n == bcap) {
            char *nb = realloc(buf, bcap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            bcap *= 2;
        }
    }
    int status = pclose(p);
    if (status != 0) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

/* One frame "OK n\n<bytes>" / "ERR n\n<bytes>" at *pos. */
static int next_frame(const char *buf, size_t len, size_t *pos, int *ok, const char **data, size_t *dlen)
{
    const char *nl = memchr(buf + *pos, '\n', len - *pos);
    if (!nl)
        return -1;
    if (!strncmp(buf + *pos, "OK ", 3))
        *ok = 1;
    else if (!strncmp(buf + *pos, "ERR ", 4))
        *ok = 0;
    else
        return -1;
    size_t n = strtoul(buf + *pos + (*ok ? 3 : 4), NULL, 10);
    size_t start = (size_t)(nl - buf) + 1;
    if (start + n > len)
        return -1;
    *data = buf + start;
    *dlen = n;
    *pos = start + n;
    return 0;
}

static void show(const char *label, const char *s, size_t n, size_t at)
{
    size_t from = at > 60 ? at - 60 : 0, to = at + 60 < n ? at + 60 : n;
    fprintf(stderr, "    %s @%zu: \"", label, at);
    for (size_t i = from; i < to; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n')
            fputs("\\n", stderr);
        else if (c == '"' || c == '\\')
            fprintf(stderr, "\\%c", c);
        else if (c < 0x20)
            fprintf(stderr, "\\x%02x", c);
        else
            fputc(c, stderr);
    }
    fputs("\"\n", stderr);
}

static const char *base(const char *p)
{
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

/* m40_chat_harmony_messages on its own: what changes, what does not. */
static void test_harmony_messages(void)
{
    json_t *plain = json_loads("[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":null,"
                               "\"reasoning_content\":\"r\"}]", 0, NULL);
    CHECK(m40_chat_harmony_messages(plain) == NULL, "no tool-call turn: nothing changes");
    json_t *m = json_loads("[{\"role\":\"assistant\",\"content\":null,\"reasoning_content\":\"why\",\"tool_calls\":[{}]},"
                           "{\"role\":\"assistant\",\"content\":\"said\",\"reasoning_content\":\"r\",\"tool_calls\":[{}]},"
                           "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{}]}]", 0, NULL);
    json_t *h = m40_chat_harmony_messages(m);
    CHECK(h && json_array_size(h) == 3, "changed copy");
    if (h) {
        json_t *a = json_array_get(h, 0), *b = json_array_get(h, 1), *c = json_array_get(h, 2);
        CHECK(!json_object_get(a, "content") && !strcmp(json_string_value(json_object_get(a, "thinking")), "why"),
              "null content goes, reasoning_content becomes thinking");
        CHECK(!json_object_get(b, "thinking") && json_is_string(json_object_get(b, "content")),
              "with content no thinking (the template refuses both)");
        CHECK(!json_object_get(c, "content") && !json_object_get(c, "thinking"), "null content goes alone");
        CHECK(json_is_null(json_object_get(json_array_get(m, 0), "content")), "the original is untouched");
    }
    json_decref(h);
    json_decref(m);
    json_decref(plain);
}

int main(void)
{
    test_harmony_messages();
    if (system("python3 -c 'import jinja2' >/dev/null 2>&1") != 0) {
        SKIP("python3 with jinja2 not available: no reference renderings");
        return check_done();
    }
    strlist tmpls = {0}, convs = {0};
    const char *shared = check_shared_dir();
    char tmpdir[] = "/tmp/m40-gguf-templates-XXXXXX";
    int have_tmp = mkdtemp(tmpdir) != NULL;
    CHECK(have_tmp, "mkdtemp");
    if (shared) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/templates", shared);
        list_dir(&tmpls, dir, "", ".jinja");
        if (have_tmp) {
            size_t before = tmpls.n;
            snprintf(dir, sizeof dir, "%s/models", shared);
            list_gguf_templates(&tmpls, dir, tmpdir);
            snprintf(dir, sizeof dir, "%s/models/next", shared);
            list_gguf_templates(&tmpls, dir, tmpdir);
            printf("%zu chat templates from the GGUF files of %s/models\n", tmpls.n - before, shared);
        }
    } else {
        SKIP("../shared absent: only the project's own templates are compared");
    }
    list_dir(&tmpls, "tests/templates", "", ".jinja");
    list_dir(&convs, "tests/jinja", "conv_", ".json");
    CHECK(convs.n > 0, "no conversations under tests/jinja");
    CHECK(tmpls.n > 0, "no templates found");

    m40_jinja_limits lim = {0};
    lim.now = FIXED_NOW;
    int all_identical_templates = 0;
    for (size_t ti = 0; ti < tmpls.n; ti++) {
        size_t slen, rlen;
        char *src = read_file(tmpls.v[ti], &slen);
        CHECK(src != NULL, "cannot read %s", tmpls.v[ti]);
        if (!src)
            continue;
        char *ref = run_reference(tmpls.v[ti], &convs, &rlen);
        CHECK(ref != NULL, "render.py failed on %s", tmpls.v[ti]);
        if (!ref) {
            free(src);
            continue;
        }
        char perr[512] = "";
        m40_jinja *t = NULL;
        int parsed = m40_jinja_parse(src, slen, &t, perr, sizeof perr) == 0;
        size_t pos = 0, identical = 0, both_err = 0, mismatched = 0;
        for (size_t ci = 0; ci < convs.n; ci++) {
            int ref_ok;
            const char *rdata;
            size_t rdlen;
            if (next_frame(ref, rlen, &pos, &ref_ok, &rdata, &rdlen)) {
                CHECK(0, "bad render.py output for %s", tmpls.v[ti]);
                break;
            }
            json_error_t jerr;
            json_t *conv = json_load_file(convs.v[ci], 0, &jerr);
            CHECK(conv != NULL, "%s: %s", convs.v[ci], jerr.text);
            if (!conv)
                continue;
            char err[512] = "";
            char *out = NULL;
            size_t olen = 0;
            int ok = 0;
            if (parsed) {
                json_t *agp = json_object_get(conv, "add_generation_prompt");
                json_t *msgs = json_object_get(conv, "messages");
                /* OpenAI-shaped messages: as engine/serve/prompt.c renders them (harmony
                 * templates get reasoning_content as thinking, no null content first) */
                int openai = json_is_true(json_object_get(conv, "openai"));
                json_t *hm = openai && strstr(src, "<|channel|>") ? m40_chat_harmony_messages(msgs) : NULL;
                if (hm)
                    msgs = hm;
                json_t *objs = openai ? m40_chat_arguments_as_objects(msgs) : NULL;
                for (int pass = objs ? 0 : 1; pass < 2 && !ok; pass++) {
                    free(out);
                    out = NULL;
                    ok = m40_chat_template_render_parsed(
                             t, pass == 0 ? objs : msgs, json_object_get(conv, "tools"), json_is_true(agp),
                             json_string_value(json_object_get(conv, "bos_token")),
                             json_string_value(json_object_get(conv, "eos_token")), json_object_get(conv, "extra"),
                             &lim, &out, &olen, err, sizeof err) == 0;
                }
                json_decref(objs);
                json_decref(hm);
            } else {
                snprintf(err, sizeof err, "%s", perr);
            }
            if (ok && ref_ok && olen == rdlen && memcmp(out, rdata, olen) == 0) {
                identical++;
            } else if (!ok && !ref_ok) {
                both_err++;
                if (getenv("M40_JINJA_VERBOSE"))
                    fprintf(stderr, "  both refused %s x %s\n    ours:   %s\n    jinja2: %.*s\n",
                            base(tmpls.v[ti]), base(convs.v[ci]), err, (int)rdlen, rdata);
            } else {
                mismatched++;
                CHECK(0, "%s x %s: ours %s, jinja2 %s", base(tmpls.v[ti]), base(convs.v[ci]),
                      ok ? "rendered" : err, ref_ok ? "rendered" : "failed");
                if (!ref_ok)
                    fprintf(stderr, "    jinja2: %.*s\n", (int)rdlen, rdata);
                if (ok && ref_ok) {
                    size_t at = 0;
                    while (at < olen && at < rdlen && out[at] == rdata[at])
                        at++;
                    show("ours  ", out, olen, at);
                    show("jinja2", rdata, rdlen, at);
                }
            }
            free(out);
            json_decref(conv);
        }
        CHECK(parsed, "%s: parse error: %s", base(tmpls.v[ti]), perr);
        CHECK(identical > 0, "%s: no conversation rendered successfully by both", base(tmpls.v[ti]));
        if (!mismatched && identical)
            all_identical_templates++;
        printf("%-60s %zu identical, %zu refused by both, %zu different\n", base(tmpls.v[ti]), identical,
               both_err, mismatched);
        m40_jinja_free(t);
        free(ref);
        free(src);
    }
    printf("%d of %zu templates byte-identical to jinja2 over %zu conversations\n", all_identical_templates,
           tmpls.n, convs.n);
    for (size_t i = 0; i < tmpls.n; i++) {
        if (have_tmp && !strncmp(tmpls.v[i], tmpdir, strlen(tmpdir)))
            unlink(tmpls.v[i]);
        free(tmpls.v[i]);
    }
    if (have_tmp)
        rmdir(tmpdir);
    for (size_t i = 0; i < convs.n; i++)
        free(convs.v[i]);
    free(tmpls.v);
    free(convs.v);
    return check_done();
}
