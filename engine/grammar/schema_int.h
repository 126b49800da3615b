/* What json_schema.c and pattern.c share: a growing string, GBNF literals, the error. This
 * folder's private header for the JSON Schema compiler. */
#ifndef M40_SCHEMA_INT_H
#define M40_SCHEMA_INT_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char *s;
    size_t n, cap;
    int oom;
} sbuf;

/* A compile's error: the first message is kept (later ones follow from it). */
typedef struct {
    char *err;
    size_t errlen;
    int failed;
} schema_err;

static inline int schema_fail(schema_err *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline int schema_fail(schema_err *e, const char *fmt, ...)
{
    if (!e->failed && e->err && e->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->err, e->errlen, fmt, ap);
        va_end(ap);
    }
    e->failed = 1;
    return -1;
}

static inline void sb_add(sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (b->n + n + 1 > cap)
            cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}
static inline void sb_puts(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }
/* Short formatted pieces only (names, numbers, characters: under 512 bytes; longer marks
 * the buffer out of memory). A string of any length, such as a sub-schema's expression,
 * goes through sb_puts. */
static inline void sb_printf(sbuf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof tmp) {
        b->oom = 1;
        return;
    }
    sb_add(b, tmp, (size_t)n);
}

/* A GBNF string literal for raw bytes. */
static inline void lit(sbuf *b, const char *s, size_t n)
{
    sb_puts(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[3] = {'\\', (char)c, 0};
            sb_puts(b, e);
        } else if (c < 0x20 || c == 0x7f)
            sb_printf(b, "\\x%02X", c);
        else
            sb_add(b, (const char *)&c, 1);
    }
    sb_puts(b, "\"");
}

/* pattern.c: a JSON Schema "pattern" (a regular-expression subset) as a GBNF expression
 * for the characters between the string's quotes, appended to e. 0, or -1 with err
 * naming what is not supported. */
int m40_pattern_to_gbnf(const char *re, size_t len, sbuf *e, char *err, size_t errlen);

#endif
