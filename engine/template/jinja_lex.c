/* Lexer: template source -> tokens, following jinja2's lexer with trim_blocks=True
 * and lstrip_blocks=True: "-" on a tag strips all whitespace on that side, "+"
 * keeps it; a block or comment tag alone on its line loses its indentation and the
 * newline after it; "}}" inside brackets is not the end of a tag. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

_Noreturn void jp_fail(jparser *p, int line, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->errlen, "line %d: %s", line, msg);
    longjmp(p->fail, 1);
}

void *jp_alloc(jparser *p, size_t n)
{
    void *m = m40_jarena_alloc(p->arena, n);
    if (!m)
        jp_fail(p, 0, "out of memory parsing the template");
    return m;
}

/* Tokens live in a malloc'd array that m40_jinja_parse frees once the AST exists. */
static void push_tok(jparser *p, enum tok_kind k, int line, const char *s, size_t len)
{
    if (p->ntoks == p->cap) {
        size_t nc = p->cap ? p->cap * 2 : 256;
        jtoken *nt = realloc(p->toks, nc * sizeof *nt);
        if (!nt)
            jp_fail(p, line, "out of memory parsing the template");
        p->toks = nt;
        p->cap = nc;
    }
    jtoken *t = &p->toks[p->ntoks++];
    memset(t, 0, sizeof *t);
    t->kind = k;
    t->line = line;
    t->s = s;
    t->len = len;
}

static int count_lines(const char *s, size_t n)
{
    int c = 0;
    for (size_t i = 0; i < n; i++)
        c += s[i] == '\n';
    return c;
}

/* Length of the Python-whitespace run starting at s[i] (for "-%}" and friends). */
static size_t ws_run(const char *s, size_t len, size_t i)
{
    size_t j = i;
    while (j < len) {
        size_t k = j;
        uint32_t c = jutf8_next(s, len, &k);
        if (!jpy_isspace(c))
            break;
        j = k;
    }
    return j - i;
}

/* Length of text with trailing Python whitespace removed. */
static size_t rstrip_len(const char *s, size_t n)
{
    size_t end = 0;
    for (size_t i = 0; i < n;) {
        uint32_t c = jutf8_next(s, n, &i);
        if (!jpy_isspace(c))
            end = i;
    }
    return end;
}

static int all_space(const char *s, size_t n)
{
    return n > 0 && ws_run(s, n, 0) == n;
}

/* Python unicode-escape decoding, as jinja2 applies it to string literals. */
static void decode_string(jparser *p, const char *s, size_t n, jtoken *t)
{
    /* decoding never lengthens the text; allocating first keeps the error paths
     * below free of arena failures while the jbuf is live */
    char *d = jp_alloc(p, n + 1);
    jbuf b;
    jbuf_init(&b, 0);
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c != '\\' || i + 1 >= n) {
            jbuf_putc(&b, c);
            continue;
        }
        char e = s[++i];
        switch (e) {
        case '\n': break; /* line continuation */
        case '\\': jbuf_putc(&b, '\\'); break;
        case '\'': jbuf_putc(&b, '\''); break;
        case '"': jbuf_putc(&b, '"'); break;
        case 'a': jbuf_putc(&b, '\a'); break;
        case 'b': jbuf_putc(&b, '\b'); break;
        case 'f': jbuf_putc(&b, '\f'); break;
        case 'n': jbuf_putc(&b, '\n'); break;
        case 'r': jbuf_putc(&b, '\r'); break;
        case 't': jbuf_putc(&b, '\t'); break;
        case 'v': jbuf_putc(&b, '\v'); break;
        case 'x': case 'u': case 'U': {
            int want = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            int k;
            for (k = 0; k < want && i + 1 + k < n && isxdigit((unsigned char)s[i + 1 + k]); k++) {
                char h = s[i + 1 + k];
                cp = cp * 16 + (uint32_t)(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
            }
            if (k < want || cp > 0x10FFFF) {
                jbuf_free(&b);
                jp_fail(p, t->line, "truncated \\%cXXXX escape in a string", e);
            }
            jutf8_put(&b, cp);
            i += (size_t)want;
            break;
        }
        default:
            if (e >= '0' && e <= '7') {
                uint32_t cp = 0;
                int k = 0;
                while (k < 3 && i + (size_t)k < n && s[i + k] >= '0' && s[i + k] <= '7') {
                    cp = cp * 8 + (uint32_t)(s[i + k] - '0');
                    k++;
                }
                jutf8_put(&b, cp);
                i += (size_t)k - 1;
            } else { /* unknown escapes stay as written, as in Python */
                jbuf_putc(&b, '\\');
                jbuf_putc(&b, e);
            }
        }
    }
    if (b.failed) {
        jbuf_free(&b);
        jp_fail(p, t->line, "out of memory");
    }
    memcpy(d, b.p ? b.p : "", b.len);
    d[b.len] = 0;
    t->s = d;
    t->len = b.len;
    jbuf_free(&b);
}

static const char *ops3[] = {"//", "**", "==", "!=", "<=", ">=", NULL};

/* Tokens inside {{ }} or {% %}; returns the position after the closing tag and sets
 * *ends_nl when the consumed closing text ends with a newline (lstrip bookkeeping). */
static size_t lex_tag(jparser *p, size_t i, int *line, int is_block, int *ends_nl)
{
    const char *s = p->src;
    size_t n = p->len;
    int depth = 0; /* brackets: "}}" inside a dict literal is not the end */
    *ends_nl = 0;
    for (;;) {
        while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r' ||
                         s[i] == '\f' || s[i] == '\v')) {
            if (s[i] == '\n')
                (*line)++;
            i++;
        }
        if (i >= n)
            jp_fail(p, *line, "unexpected end of template, expected '%s'", is_block ? "%}" : "}}");
        char end1 = is_block ? '%' : '}';
        if (depth == 0) {
            size_t e = i;
            int strip = 0, keep = 0;
            if (s[e] == '-' && e + 2 < n + 0 && s[e + 1] == end1 && s[e + 2] == '}') {
                strip = 1;
                e++;
            } else if (is_block && s[e] == '+' && e + 2 < n && s[e + 1] == '%' && s[e + 2] == '}') {
                keep = 1;
                e++;
            }
            if (e + 1 < n && s[e] == end1 && s[e + 1] == '}') {
                push_tok(p, is_block ? T_BLOCK_END : T_VAR_END, *line, s + i, 0);
                e += 2;
                if (strip) {
                    size_t w = ws_run(s, n, e);
                    *line += count_lines(s + e, w);
                    e += w;
                    *ends_nl = w > 0 && s[e - 1] == '\n';
                } else if (is_block && !keep && e < n && s[e] == '\n') { /* trim_blocks */
                    (*line)++;
                    e++;
                    *ends_nl = 1;
                }
                return e;
            }
        }
        char c = s[i];
        if (isalpha((unsigned char)c) || c == '_') {
            size_t j = i;
            while (j < n && (isalnum((unsigned char)s[j]) || s[j] == '_'))
                j++;
            push_tok(p, T_NAME, *line, s + i, j - i);
            i = j;
        } else if (c == '\'' || c == '"') {
            size_t j = i + 1;
            while (j < n && s[j] != c) {
                if (s[j] == '\\')
                    j++;
                j++;
            }
            if (j >= n)
                jp_fail(p, *line, "unterminated string");
            push_tok(p, T_STRING, *line, NULL, 0);
            decode_string(p, s + i + 1, j - i - 1, &p->toks[p->ntoks - 1]);
            *line += count_lines(s + i, j - i);
            i = j + 1;
        } else if (isdigit((unsigned char)c)) {
            /* the literal's extent first (digits and '_', an optional fraction and
             * exponent), then its digits into num: a literal longer than num is an error,
             * never a write past it or a silently shortened value */
            size_t j = i;
            int is_float = 0;
            while (j < n && (isdigit((unsigned char)s[j]) || s[j] == '_'))
                j++;
            if (j + 1 < n && s[j] == '.' && isdigit((unsigned char)s[j + 1])) {
                is_float = 1;
                j++;
                while (j < n && (isdigit((unsigned char)s[j]) || s[j] == '_'))
                    j++;
            }
            if (j < n && (s[j] == 'e' || s[j] == 'E')) {
                size_t q = j + 1;
                if (q < n && (s[q] == '+' || s[q] == '-'))
                    q++;
                if (q < n && isdigit((unsigned char)s[q])) {
                    is_float = 1;
                    j = q;
                    while (j < n && isdigit((unsigned char)s[j]))
                        j++;
                }
            }
            char num[64];
            size_t k = 0;
            for (size_t q = i; q < j; q++) {
                if (s[q] == '_')
                    continue;
                if (k == sizeof num - 1)
                    jp_fail(p, *line, "number literal longer than %d characters", (int)sizeof num - 1);
                num[k++] = s[q];
            }
            num[k] = 0;
            push_tok(p, is_float ? T_FLOAT : T_INT, *line, s + i, j - i);
            if (is_float)
                p->toks[p->ntoks - 1].f = strtod(num, NULL);
            else
                p->toks[p->ntoks - 1].i = strtoll(num, NULL, 10);
            i = j;
        } else {
            size_t oplen = 1;
            for (int k = 0; ops3[k]; k++)
                if (i + 1 < n && s[i] == ops3[k][0] && s[i + 1] == ops3[k][1])
                    oplen = 2;
            if (oplen == 1 && !strchr("+-*/%~<>=()[]{},.:|;", c))
                jp_fail(p, *line, "unexpected character '%c'", c);
            if ((c == '(' || c == '[' || c == '{') && ++depth > JP_MAX_DEPTH)
                jp_fail(p, *line, "template nests too deeply (more than %d levels)", JP_MAX_DEPTH);
            else if (c == ')' || c == ']' || c == '}') {
                if (depth == 0)
                    jp_fail(p, *line, "unexpected '%c'", c);
                depth--;
            }
            push_tok(p, T_OP, *line, s + i, oplen);
            i += oplen;
        }
    }
}

/* `{% raw %}` (with optional -/+): returns the position after the opening tag or 0. */
static size_t match_raw_open(const char *s, size_t n, size_t i, int *strip_after)
{
    size_t j = i + 2;
    if (j < n && (s[j] == '-' || s[j] == '+'))
        j++;
    while (j < n && isspace((unsigned char)s[j]))
        j++;
    if (j + 3 > n || memcmp(s + j, "raw", 3) != 0)
        return 0;
    j += 3;
    while (j < n && isspace((unsigned char)s[j]))
        j++;
    *strip_after = 0;
    if (j + 2 < n && s[j] == '-' && s[j + 1] == '%' && s[j + 2] == '}') {
        *strip_after = 1;
        return j + 3;
    }
    if (j + 1 < n && s[j] == '%' && s[j + 1] == '}')
        return j + 2;
    return 0;
}

void jp_lex(jparser *p)
{
    const char *s = p->src;
    size_t n = p->len, i = 0;
    int line = 1, line_starting = 1;
    while (i < n) {
        /* next tag start */
        size_t t = i;
        while (t + 1 < n && !(s[t] == '{' && (s[t + 1] == '{' || s[t + 1] == '%' || s[t + 1] == '#')))
            t++;
        if (t + 1 >= n) {
            push_tok(p, T_DATA, line, s + i, n - i);
            break;
        }
        char kind = s[t + 1];
        char sign = t + 2 < n ? s[t + 2] : 0;
        size_t textlen = t - i;
        if (sign == '-') {
            textlen = rstrip_len(s + i, textlen);
        } else if (sign != '+' && kind != '{') { /* lstrip_blocks */
            size_t lpos = 0;
            for (size_t k = textlen; k > 0; k--)
                if (s[i + k - 1] == '\n') {
                    lpos = k;
                    break;
                }
            if ((lpos > 0 || line_starting) && all_space(s + i + lpos, textlen - lpos))
                textlen = lpos;
        }
        if (textlen)
            push_tok(p, T_DATA, line, s + i, textlen);
        line += count_lines(s + i, t - i);
        int strip_after;
        size_t rawend = kind == '%' ? match_raw_open(s, n, t, &strip_after) : 0;
        if (rawend) {
            /* find {% endraw %} */
            size_t j = rawend;
            if (strip_after)
                j += ws_run(s, n, j);
            for (size_t k = j; k + 1 < n; k++) {
                if (s[k] != '{' || s[k + 1] != '%')
                    continue;
                size_t q = k + 2;
                char esign = q < n ? s[q] : 0;
                if (esign == '-' || esign == '+')
                    q++;
                while (q < n && isspace((unsigned char)s[q]))
                    q++;
                if (q + 6 > n || memcmp(s + q, "endraw", 6) != 0)
                    continue;
                q += 6;
                while (q < n && isspace((unsigned char)s[q]))
                    q++;
                int strip = 0;
                if (q < n && s[q] == '-') {
                    strip = 1;
                    q++;
                } else if (q < n && s[q] == '+')
                    q++;
                if (q + 1 >= n || s[q] != '%' || s[q + 1] != '}')
                    continue;
                size_t body = k - j;
                if (esign == '-')
                    body = rstrip_len(s + j, body);
                if (body)
                    push_tok(p, T_DATA, line, s + j, body);
                line += count_lines(s + t, q + 2 - t);
                i = q + 2;
                line_starting = 0;
                if (strip) {
                    size_t w = ws_run(s, n, i);
                    line += count_lines(s + i, w);
                    i += w;
                    line_starting = w > 0 && s[i - 1] == '\n';
                } else if (i < n && s[i] == '\n') {
                    i++;
                    line++;
                    line_starting = 1;
                }
                goto next;
            }
            jp_fail(p, line, "missing end of raw directive");
        }
        if (kind == '#') {
            size_t j = t + 2;
            while (j + 1 < n && !(s[j] == '#' && s[j + 1] == '}'))
                j++;
            if (j + 1 >= n)
                jp_fail(p, line, "missing end of comment tag");
            int strip = j > t + 2 && s[j - 1] == '-';
            int keep = j > t + 2 && s[j - 1] == '+';
            line += count_lines(s + t, j + 2 - t);
            i = j + 2;
            line_starting = 0;
            if (strip) {
                size_t w = ws_run(s, n, i);
                line += count_lines(s + i, w);
                i += w;
                line_starting = w > 0 && s[i - 1] == '\n';
            } else if (!keep && i < n && s[i] == '\n') {
                i++;
                line++;
                line_starting = 1;
            }
            continue;
        }
        push_tok(p, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN, line, s + t, 2);
        i = t + 2 + (sign == '-' || (sign == '+' && kind == '%'));
        int ends_nl;
        i = lex_tag(p, i, &line, kind == '%', &ends_nl);
        line_starting = ends_nl;
    next:;
    }
    push_tok(p, T_EOF, line, s + n, 0);
}
