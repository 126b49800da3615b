/* Output parsing for chat: content, reasoning and tool calls (m40_chat_parse.h).
 *
 * A small state machine over the text not yet handed out (buf):
 *   TEXT   content; scans for the markers that switch state ("<think>", the format's
 *          tool-call opener) and holds back a tail that could be the start of one;
 *   THINK  reasoning until "</think>" (its tail held the same way);
 *   CALL   Hermes: one call's JSON until "</tool_call>", then TEXT again;
 *   REST   everything to the end is one block of calls (Llama 3 JSON, python_tag,
 *          Mistral, the JSON fallback): parsed at the finish, since none of these
 *          formats has a closing marker to parse at earlier.
 * Calls are parsed all or nothing: a block that does not parse as calls goes back
 * out as content with its markup, which is what vLLM's parsers do. Arguments are
 * re-serialized compactly from the parsed object, so what the client gets is always
 * one valid JSON object text.
 *
 * Harmony (gpt-oss) has no free text at all: its output is messages, each a header
 * ("<|channel|>NAME", a recipient " to=functions.NAME", a content type) up to
 * "<|message|>", then a body up to <|end|>, <|return|> or <|call|>. Three more states:
 *   H_INIT  between messages: decides, on as few bytes as it must, whether a header
 *           starts here (<|start|>, <|channel|>, or " to=" right after the prompt's
 *           "<|start|>assistant"); anything else is content;
 *   H_HEAD  the header, held until "<|message|>" (it is short; a header that grows past
 *           HEAD_MAX, or meets an end marker first, was no header and goes out as content);
 *   H_BODY  the body: the analysis channel streams as reasoning, final and commentary
 *           as content, a call to functions.NAME is held and parsed at its end marker
 *           (all or nothing, like the others); a header we do not know (another
 *           recipient, another channel) streams as content with its markup, so nothing
 *           the model wrote is lost. The end markers are gone from the text when the
 *           tokenizer makes <|return|> and <|call|> end the generation (real gpt-oss
 *           files); the end of the output closes the last message then. */
#include "m40_chat_parse.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

enum { S_TEXT, S_THINK, S_CALL, S_REST, S_H_INIT, S_H_HEAD, S_H_BODY };

/* Harmony body kinds. */
enum { HB_CONTENT, HB_REASONING, HB_CALL, HB_RAW };

/* A harmony header longer than this without "<|message|>" is no header. Real ones are
 * "<|channel|>commentary to=functions.NAME <|constrain|>json" with NAME <= 64. */
#define HEAD_MAX 256

struct m40_chat_parse {
    m40_tool_format tools;
    m40_reasoning_mode reasoning;
    int state;
    const char *rest_marker; /* REST: the opener it began with ("" for bare JSON) */
    char *buf;
    size_t len, cap;
    int n_calls;
    int content_started;     /* non-whitespace content went out */
    int skip_ws;             /* drop whitespace before the next content (after </think>) */
    int after_call;          /* a call went out: whitespace-only content between calls is dropped */
    /* harmony */
    int h_kind;              /* H_BODY: HB_* */
    int h_first;             /* H_INIT: still at the start of the output */
    char *h_head;            /* H_HEAD: the opener consumed ("<|start|>" or ""); H_BODY: the
                              * whole header as written (for content when it is no call) */
    char h_name[72];         /* HB_CALL: the function's name */
};

static const char THINK_OPEN[] = "<think>";
static const char THINK_CLOSE[] = "</think>";
static const char HERMES_OPEN[] = "<tool_call>";
static const char HERMES_CLOSE[] = "</tool_call>";
static const char MISTRAL_OPEN[] = "[TOOL_CALLS]";
static const char PYTHON_TAG[] = "<|python_tag|>";
static const char H_START[] = "<|start|>";
static const char H_CHANNEL[] = "<|channel|>";
static const char H_MESSAGE[] = "<|message|>";
static const char H_END[] = "<|end|>";
static const char H_RETURN[] = "<|return|>";
static const char H_CALL[] = "<|call|>";

m40_tool_format m40_tool_format_detect(const char *src)
{
    if (!src)
        return M40_TOOLS_JSON;
    /* first: gpt-oss's template also mentions other conventions' words in its docs */
    if (strstr(src, H_CHANNEL))
        return M40_TOOLS_HARMONY;
    if (strstr(src, HERMES_OPEN))
        return M40_TOOLS_HERMES;
    if (strstr(src, MISTRAL_OPEN))
        return M40_TOOLS_MISTRAL;
    if (strstr(src, PYTHON_TAG) || (strstr(src, "<|start_header_id|>") && strstr(src, "parameters")))
        return M40_TOOLS_LLAMA3;
    return M40_TOOLS_JSON;
}

int m40_template_thinks(const char *src)
{
    /* R1 distills' templates only strip "</think>" from history; their prompt opens it. */
    return src && (strstr(src, THINK_OPEN) != NULL || strstr(src, THINK_CLOSE) != NULL || strstr(src, H_CHANNEL) != NULL);
}

static const char *const format_names[] = {"none", "hermes", "llama3", "mistral", "json", "harmony"};

int m40_tool_format_from_name(const char *name, size_t len)
{
    for (int i = 0; i < (int)(sizeof format_names / sizeof *format_names); i++)
        if (strlen(format_names[i]) == len && memcmp(format_names[i], name, len) == 0)
            return i;
    return -1;
}

const char *m40_tool_format_name(m40_tool_format f)
{
    return (unsigned)f < sizeof format_names / sizeof *format_names ? format_names[f] : "?";
}

m40_chat_parse *m40_chat_parse_new(m40_tool_format tools, m40_reasoning_mode reasoning, int reasoning_open)
{
    m40_chat_parse *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->tools = tools;
    p->reasoning = reasoning;
    p->state = reasoning != M40_REASONING_INLINE && reasoning_open ? S_THINK : S_TEXT;
    if (tools == M40_TOOLS_HARMONY) {
        p->state = S_H_INIT; /* harmony has no <think>: reasoning_open means nothing here */
        p->h_first = 1;
    }
    return p;
}

void m40_chat_parse_free(m40_chat_parse *p)
{
    if (!p)
        return;
    free(p->buf);
    free(p->h_head);
    free(p);
}

int m40_chat_parse_tool_calls(const m40_chat_parse *p)
{
    return p->n_calls;
}

static int is_ws(char c)
{
    return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

static int all_ws(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!is_ws(s[i]))
            return 0;
    return 1;
}

/* First occurrence of the NUL-terminated needle in s[0..n), or -1. */
static long find(const char *s, size_t n, const char *needle)
{
    size_t m = strlen(needle);
    if (m > n)
        return -1;
    for (size_t i = 0; i + m <= n; i++)
        if (s[i] == needle[0] && memcmp(s + i, needle, m) == 0)
            return (long)i;
    return -1;
}

/* Longest k < strlen(marker) with s ending in marker's first k bytes: what to hold back. */
static size_t partial_tail(const char *s, size_t n, const char *marker)
{
    size_t m = strlen(marker);
    for (size_t k = m - 1; k > 0; k--)
        if (k <= n && memcmp(s + n - k, marker, k) == 0)
            return k;
    return 0;
}

static void consume(m40_chat_parse *p, size_t n)
{
    if (n == 0)
        return;
    memmove(p->buf, p->buf + n, p->len - n);
    p->len -= n;
}

static int emit_text(m40_chat_parse *p, m40_piece_kind kind, const char *s, size_t n, m40_piece_cb cb, void *ud)
{
    if (n == 0)
        return 0;
    if (kind == M40_PIECE_REASONING && p->reasoning == M40_REASONING_NONE)
        return 0;
    if (kind == M40_PIECE_CONTENT) {
        if (p->after_call && all_ws(s, n))
            return 0;
        if (!all_ws(s, n))
            p->content_started = 1;
    }
    m40_piece pc = {.kind = kind, .text = s, .len = n};
    return cb(ud, &pc);
}

/* One call object -> appended to calls as {"name": string, "arguments": string}. */
static int add_call(json_t *calls, json_t *obj)
{
    json_t *name = json_object_get(obj, "name");
    if (!json_is_object(obj) || !json_is_string(name) || json_string_length(name) == 0)
        return -1;
    json_t *args = json_object_get(obj, "arguments");
    if (!args)
        args = json_object_get(obj, "parameters");
    char *text;
    if (!args || json_is_null(args)) {
        text = strdup("{}");
    } else if (json_is_object(args)) {
        text = json_dumps(args, JSON_COMPACT | JSON_PRESERVE_ORDER);
    } else if (json_is_string(args)) {
        /* Some models write the arguments as a JSON string already; accept it only
         * when it holds an object, so the client always gets one. */
        json_t *inner = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
        int ok = json_is_object(inner);
        text = ok ? json_dumps(inner, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
        json_decref(inner);
        if (!ok)
            return -1;
    } else {
        return -1;
    }
    if (!text)
        return -1;
    json_t *c = json_pack("{s:s,s:s}", "name", json_string_value(name), "arguments", text);
    free(text);
    if (!c || json_array_append_new(calls, c) != 0)
        return -1;
    return 0;
}

/* s[0..n): JSON values (objects, or arrays of objects), separated by whitespace or ';'.
 * Returns the calls, or NULL when anything in it is not a call. */
static json_t *parse_calls(const char *s, size_t n)
{
    json_t *calls = json_array();
    size_t i = 0;
    if (!calls)
        return NULL;
    for (;;) {
        while (i < n && (is_ws(s[i]) || s[i] == ';'))
            i++;
        if (i == n)
            break;
        json_error_t jerr;
        json_t *v = json_loadb(s + i, n - i, JSON_DISABLE_EOF_CHECK | JSON_DECODE_ANY, &jerr);
        if (!v)
            goto fail;
        int bad = 0;
        if (json_is_array(v)) {
            size_t k;
            json_t *el;
            if (json_array_size(v) == 0)
                bad = 1;
            json_array_foreach(v, k, el) if (!bad && add_call(calls, el) != 0) bad = 1;
        } else {
            bad = add_call(calls, v) != 0;
        }
        json_decref(v);
        if (bad || jerr.position <= 0)
            goto fail;
        i += (size_t)jerr.position;
    }
    if (json_array_size(calls) == 0)
        goto fail;
    return calls;
fail:
    json_decref(calls);
    return NULL;
}

/* Mistral's newer spelling: name[ARGS]{...} after [TOOL_CALLS]. */
static json_t *parse_mistral_args(const char *s, size_t n)
{
    long a = find(s, n, "[ARGS]");
    if (a <= 0)
        return NULL;
    size_t nl = (size_t)a;
    while (nl > 0 && is_ws(s[nl - 1]))
        nl--;
    size_t st = 0;
    while (st < nl && is_ws(s[st]))
        st++;
    if (st == nl)
        return NULL;
    for (size_t i = st; i < nl; i++)
        if (!(s[i] == '_' || s[i] == '-' || s[i] == '.' || (s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'z') ||
              (s[i] >= 'A' && s[i] <= 'Z')))
            return NULL;
    json_t *args = json_loadb(s + a + 6, n - (size_t)a - 6, 0, NULL);
    if (!json_is_object(args)) {
        json_decref(args);
        return NULL;
    }
    json_t *obj = json_object();
    json_t *calls = json_array();
    json_object_set_new(obj, "name", json_stringn(s + st, nl - st));
    json_object_set_new(obj, "arguments", args);
    if (!calls || add_call(calls, obj) != 0) {
        json_decref(calls);
        calls = NULL;
    }
    json_decref(obj);
    return calls;
}

/* Emits s[0..n) as calls, or (not calls) as content with its markup around it. */
static int emit_block(m40_chat_parse *p, const char *open, const char *s, size_t n, const char *close, m40_piece_cb cb,
                      void *ud)
{
    json_t *calls = parse_calls(s, n);
    if (!calls && p->tools == M40_TOOLS_MISTRAL)
        calls = parse_mistral_args(s, n);
    if (calls) {
        size_t k;
        json_t *c;
        int rc = 0;
        json_array_foreach(calls, k, c)
        {
            m40_piece pc = {.kind = M40_PIECE_TOOL_CALL,
                            .index = p->n_calls++,
                            .name = json_string_value(json_object_get(c, "name")),
                            .arguments = json_string_value(json_object_get(c, "arguments"))};
            if ((rc = cb(ud, &pc)) != 0)
                break;
        }
        json_decref(calls);
        p->after_call = 1;
        return rc;
    }
    int rc;
    p->after_call = 0; /* markup that failed to parse is content, even between calls */
    if ((rc = emit_text(p, M40_PIECE_CONTENT, open, strlen(open), cb, ud)) != 0 ||
        (rc = emit_text(p, M40_PIECE_CONTENT, s, n, cb, ud)) != 0 ||
        (rc = emit_text(p, M40_PIECE_CONTENT, close, strlen(close), cb, ud)) != 0)
        return rc;
    return 0;
}

static const char *tool_opener(const m40_chat_parse *p)
{
    switch (p->tools) {
    case M40_TOOLS_HERMES:
        return HERMES_OPEN;
    case M40_TOOLS_MISTRAL:
        return MISTRAL_OPEN;
    case M40_TOOLS_LLAMA3:
        return PYTHON_TAG;
    default:
        return NULL;
    }
}

/* ---- harmony (gpt-oss) ---- */

/* Ends of a body: the three end markers (consumed), then the starts of a next header
 * (left for H_INIT). */
static const char *const H_BODY_ENDS[] = {H_END, H_RETURN, H_CALL, H_START, H_CHANNEL};
/* What ends a header: <|message|>, or (no header after all) a marker no header holds. */
static const char *const H_HEAD_BREAKS[] = {H_MESSAGE, H_START, H_END, H_RETURN, H_CALL};
/* What starts one: the last two only at the output's start, where the prompt has just
 * written "<|start|>assistant" and the recipient may come before the channel. */
static const char *const H_OPENERS[] = {H_START, H_CHANNEL, " to=", "to="};

/* The earliest of k markers in s[0..n) (its index into *which), or -1. */
static long find_any(const char *s, size_t n, const char *const *markers, int k, int *which)
{
    long best = -1;
    for (int i = 0; i < k; i++) {
        long j = find(s, n, markers[i]);
        if (j >= 0 && (best < 0 || j < best)) {
            best = j;
            *which = i;
        }
    }
    return best;
}

static size_t partial_any(const char *s, size_t n, const char *const *markers, int k)
{
    size_t keep = 0;
    for (int i = 0; i < k; i++) {
        size_t t = partial_tail(s, n, markers[i]);
        if (t > keep)
            keep = t;
    }
    return keep;
}

/* h_head = a[0..na) b[0..nb) c (c NUL-terminated); -1 out of memory. */
static int set_head(m40_chat_parse *p, const char *a, size_t na, const char *b, size_t nb, const char *c)
{
    size_t nc = strlen(c);
    char *h = malloc(na + nb + nc + 1);
    if (!h)
        return -1;
    memcpy(h, a, na);
    memcpy(h + na, b, nb);
    memcpy(h + na + nb, c, nc + 1);
    free(p->h_head);
    p->h_head = h;
    return 0;
}

static size_t word_end(const char *h, size_t i, size_t n)
{
    while (i < n && h[i] != ' ' && h[i] != '<')
        i++;
    return i;
}

/* The kind of body a header h[0..n) announces (after_start: it follows <|start|>, so
 * the author's name comes first), and for a call the function's name into h_name.
 * Words: "<|channel|>NAME", "to=RECIPIENT", "<|constrain|>TYPE", a bare content type. */
static int h_classify(m40_chat_parse *p, const char *h, size_t n, int after_start)
{
    size_t i = 0, e;
    const char *chan = NULL, *to = NULL;
    size_t nchan = 0, nto = 0;
    if (after_start) {
        /* only the assistant's messages are the answer; a model writing another
         * author's turn (a tool's result) has gone astray: show it as it is */
        e = word_end(h, 0, n);
        if (e != 9 || memcmp(h, "assistant", 9) != 0)
            return HB_RAW;
        i = e;
    }
    while (i < n) {
        if (h[i] == ' ') {
            i++;
        } else if (n - i >= sizeof H_CHANNEL - 1 && memcmp(h + i, H_CHANNEL, sizeof H_CHANNEL - 1) == 0) {
            if (chan)
                return HB_RAW;
            i += sizeof H_CHANNEL - 1;
            e = word_end(h, i, n);
            chan = h + i;
            nchan = e - i;
            i = e;
        } else if (n - i >= 3 && memcmp(h + i, "to=", 3) == 0) {
            if (to)
                return HB_RAW;
            i += 3;
            e = word_end(h, i, n);
            to = h + i;
            nto = e - i;
            i = e;
        } else if (n - i >= 13 && memcmp(h + i, "<|constrain|>", 13) == 0) {
            i = word_end(h, i + 13, n);
        } else if (h[i] == '<') {
            return HB_RAW; /* a marker headers do not hold */
        } else {
            i = word_end(h, i, n); /* a content type ("json") */
        }
    }
    if (to) {
        size_t nn = nto - 10;
        if (nto <= 10 || memcmp(to, "functions.", 10) != 0 || nn >= sizeof p->h_name)
            return HB_RAW; /* a built-in tool (browser, python) we do not serve */
        for (size_t k = 10; k < nto; k++)
            if (!(to[k] == '_' || to[k] == '-' || (to[k] >= '0' && to[k] <= '9') || (to[k] >= 'a' && to[k] <= 'z') ||
                  (to[k] >= 'A' && to[k] <= 'Z')))
                return HB_RAW;
        memcpy(p->h_name, to + 10, nn);
        p->h_name[nn] = '\0';
        return HB_CALL;
    }
    if (nchan == 8 && memcmp(chan, "analysis", 8) == 0)
        return p->reasoning == M40_REASONING_INLINE ? HB_RAW : HB_REASONING;
    /* commentary without a recipient: a preamble the user is meant to see */
    if ((nchan == 5 && memcmp(chan, "final", 5) == 0) || (nchan == 10 && memcmp(chan, "commentary", 10) == 0))
        return HB_CONTENT;
    return HB_RAW;
}

/* A call's body s[0..n) (ended by `end`, "" at the output's end): a call when it is
 * one JSON object, else content with its header and end marker. */
static int h_emit_call(m40_chat_parse *p, const char *s, size_t n, const char *end, m40_piece_cb cb, void *ud)
{
    json_t *args = json_loadb(s, n, 0, NULL);
    char *text = json_is_object(args) ? json_dumps(args, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(args);
    int rc;
    if (text) {
        m40_piece pc = {.kind = M40_PIECE_TOOL_CALL, .index = p->n_calls++, .name = p->h_name, .arguments = text};
        rc = cb(ud, &pc);
        free(text);
        p->after_call = 1;
        return rc;
    }
    p->after_call = 0;
    if ((rc = emit_text(p, M40_PIECE_CONTENT, p->h_head, strlen(p->h_head), cb, ud)) != 0 ||
        (rc = emit_text(p, M40_PIECE_CONTENT, s, n, cb, ud)) != 0)
        return rc;
    return emit_text(p, M40_PIECE_CONTENT, end, strlen(end), cb, ud);
}

/* Body text that is no message of a header: content as written, end markers and all. */
static void h_raw_body(m40_chat_parse *p)
{
    free(p->h_head);
    p->h_head = NULL;
    p->h_kind = HB_RAW;
    p->state = S_H_BODY;
}

static int run_harmony(m40_chat_parse *p, int final, m40_piece_cb cb, void *ud)
{
    int rc, w = 0;
    for (;;) {
        if (p->state == S_H_INIT) {
            if (p->len == 0)
                return 0;
            int started = 0, pending = 0;
            for (int i = 0; i < (p->h_first ? 4 : 2) && !started; i++) {
                size_t m = strlen(H_OPENERS[i]), k = p->len < m ? p->len : m;
                if (memcmp(p->buf, H_OPENERS[i], k) != 0)
                    continue;
                if (k < m) {
                    pending = 1;
                    continue;
                }
                const char *opener = i == 0 ? H_START : "";
                if (set_head(p, opener, strlen(opener), "", 0, "") != 0)
                    return -1;
                consume(p, i == 0 ? m : 0);
                p->state = S_H_HEAD;
                started = 1;
            }
            if (!started && pending && !final)
                return 0;
            p->h_first = 0;
            if (!started)
                h_raw_body(p);
            continue;
        }
        if (p->state == S_H_HEAD) {
            /* Decided on the first HEAD_MAX + |<|message|>| bytes only, so that how the
             * text was chunked never changes the answer. */
            size_t win = p->len < HEAD_MAX + sizeof H_MESSAGE - 1 ? p->len : HEAD_MAX + sizeof H_MESSAGE - 1;
            long j = find_any(p->buf, win, H_HEAD_BREAKS, 5, &w);
            if (j >= 0 && w == 0) {
                int kind = h_classify(p, p->buf, (size_t)j, p->h_head[0] != '\0');
                if (set_head(p, p->h_head, strlen(p->h_head), p->buf, (size_t)j, H_MESSAGE) != 0)
                    return -1;
                consume(p, (size_t)j + sizeof H_MESSAGE - 1);
                p->h_kind = kind;
                p->state = S_H_BODY;
                if (kind == HB_RAW && (rc = emit_text(p, M40_PIECE_CONTENT, p->h_head, strlen(p->h_head), cb, ud)) != 0)
                    return rc;
                continue;
            }
            size_t n;
            if (j >= 0)
                n = (size_t)j; /* an end marker or <|start|> before any <|message|> */
            else if (final)
                n = p->len;
            else if (win == HEAD_MAX + sizeof H_MESSAGE - 1)
                n = win - partial_any(p->buf, win, H_HEAD_BREAKS, 5);
            else
                return 0;
            /* no header after all: what was held is content, markup and all */
            if ((rc = emit_text(p, M40_PIECE_CONTENT, p->h_head, strlen(p->h_head), cb, ud)) != 0)
                return rc;
            rc = emit_text(p, M40_PIECE_CONTENT, p->buf, n, cb, ud);
            consume(p, n);
            h_raw_body(p);
            if (rc != 0)
                return rc;
            continue;
        }
        /* S_H_BODY */
        long j = find_any(p->buf, p->len, H_BODY_ENDS, 5, &w);
        const char *end = j >= 0 && w < 3 ? H_BODY_ENDS[w] : "";
        if (p->h_kind == HB_CALL) {
            if (j < 0 && !final)
                return 0;
            size_t n = j >= 0 ? (size_t)j : p->len;
            rc = h_emit_call(p, p->buf, n, end, cb, ud);
            consume(p, n + strlen(end));
            p->state = S_H_INIT;
            if (rc != 0)
                return rc;
            continue;
        }
        m40_piece_kind kind = p->h_kind == HB_REASONING ? M40_PIECE_REASONING : M40_PIECE_CONTENT;
        if (j >= 0) {
            if ((rc = emit_text(p, kind, p->buf, (size_t)j, cb, ud)) != 0)
                return rc;
            /* a raw body keeps its end marker: it is text, not structure we read */
            if (p->h_kind == HB_RAW && (rc = emit_text(p, M40_PIECE_CONTENT, end, strlen(end), cb, ud)) != 0)
                return rc;
            consume(p, (size_t)j + strlen(end));
            p->state = S_H_INIT;
            continue;
        }
        size_t keep = final ? 0 : partial_any(p->buf, p->len, H_BODY_ENDS, 5);
        if ((rc = emit_text(p, kind, p->buf, p->len - keep, cb, ud)) != 0)
            return rc;
        consume(p, p->len - keep);
        return 0;
    }
}

static int run(m40_chat_parse *p, int final, m40_piece_cb cb, void *ud)
{
    int rc;
    if (p->tools == M40_TOOLS_HARMONY)
        return run_harmony(p, final, cb, ud);
    for (;;) {
        if (p->state == S_THINK) {
            long i = find(p->buf, p->len, THINK_CLOSE);
            if (i >= 0) {
                if ((rc = emit_text(p, M40_PIECE_REASONING, p->buf, (size_t)i, cb, ud)) != 0)
                    return rc;
                consume(p, (size_t)i + sizeof THINK_CLOSE - 1);
                p->state = S_TEXT;
                p->skip_ws = 1;
                continue;
            }
            size_t keep = final ? 0 : partial_tail(p->buf, p->len, THINK_CLOSE);
            size_t n = p->len - keep;
            if ((rc = emit_text(p, M40_PIECE_REASONING, p->buf, n, cb, ud)) != 0)
                return rc;
            consume(p, n);
            return 0;
        }
        if (p->state == S_CALL) {
            long i = find(p->buf, p->len, HERMES_CLOSE);
            if (i < 0 && !final)
                return 0;
            size_t n = i >= 0 ? (size_t)i : p->len;
            rc = emit_block(p, HERMES_OPEN, p->buf, n, i >= 0 ? HERMES_CLOSE : "", cb, ud);
            consume(p, i >= 0 ? n + sizeof HERMES_CLOSE - 1 : n);
            p->state = S_TEXT;
            if (rc != 0)
                return rc;
            continue;
        }
        if (p->state == S_REST) {
            if (!final)
                return 0;
            rc = emit_block(p, p->rest_marker, p->buf, p->len, "", cb, ud);
            consume(p, p->len);
            return rc;
        }
        /* S_TEXT */
        if (p->skip_ws) {
            size_t j = 0;
            while (j < p->len && is_ws(p->buf[j]))
                j++;
            consume(p, j);
            if (p->len == 0)
                return 0;
            p->skip_ws = 0;
        }
        if ((p->tools == M40_TOOLS_LLAMA3 || p->tools == M40_TOOLS_JSON) && !p->content_started) {
            /* The whole answer may be a call: decide on its first non-blank byte. */
            size_t j = 0;
            while (j < p->len && is_ws(p->buf[j]))
                j++;
            if (j == p->len && !final)
                return 0;
            if (j < p->len && (p->buf[j] == '{' || p->buf[j] == '[')) {
                consume(p, j);
                p->state = S_REST;
                p->rest_marker = "";
                continue;
            }
        }
        const char *opener = tool_opener(p);
        long best = -1;
        const char *marker = NULL;
        if (opener) {
            best = find(p->buf, p->len, opener);
            if (best >= 0)
                marker = opener;
        }
        if (p->reasoning != M40_REASONING_INLINE) {
            long t = find(p->buf, p->len, THINK_OPEN);
            if (t >= 0 && (best < 0 || t < best)) {
                best = t;
                marker = THINK_OPEN;
            }
        }
        if (marker) {
            if ((rc = emit_text(p, M40_PIECE_CONTENT, p->buf, (size_t)best, cb, ud)) != 0)
                return rc;
            consume(p, (size_t)best + strlen(marker));
            if (marker == THINK_OPEN) {
                p->state = S_THINK;
            } else if (marker == HERMES_OPEN) {
                p->state = S_CALL;
            } else {
                p->state = S_REST;
                p->rest_marker = marker;
            }
            continue;
        }
        size_t keep = 0;
        if (!final) {
            if (opener)
                keep = partial_tail(p->buf, p->len, opener);
            if (p->reasoning != M40_REASONING_INLINE) {
                size_t k = partial_tail(p->buf, p->len, THINK_OPEN);
                if (k > keep)
                    keep = k;
            }
        }
        size_t n = p->len - keep;
        if ((rc = emit_text(p, M40_PIECE_CONTENT, p->buf, n, cb, ud)) != 0)
            return rc;
        consume(p, n);
        return 0;
    }
}

int m40_chat_parse_feed(m40_chat_parse *p, const char *text, size_t len, m40_piece_cb cb, void *ud)
{
    if (p->len + len + 1 > p->cap) {
        size_t cap = p->cap ? p->cap : 256;
        while (cap < p->len + len + 1)
            cap *= 2;
        char *nb = realloc(p->buf, cap);
        if (!nb)
            return -1;
        p->buf = nb;
        p->cap = cap;
    }
    memcpy(p->buf + p->len, text, len);
    p->len += len;
    return run(p, 0, cb, ud);
}

int m40_chat_parse_finish(m40_chat_parse *p, m40_piece_cb cb, void *ud)
{
    return run(p, 1, cb, ud);
}
