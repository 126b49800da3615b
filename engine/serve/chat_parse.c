/* Output parsing for chat: content, reasoning and tool calls (m40_chat_parse.h).
 *
 * A small state machine over the text not yet handed out (buf):
 *   TEXT   content; scans for the markers that switch state ("<think>", the format's
 *          tool-call opener) and holds back a tail that could be the start of one;
 *   THINK  reasoning until "</think>" (its tail held the same way);
 *   CALL   Hermes: call JSON until "</tool_call>" (its partial tail held), then TEXT;
 *   REST   Llama 3 JSON, python_tag, Mistral, the JSON fallback: calls until the end
 *          or, once calls went out, until text that starts none (then TEXT again).
 * Both read their block byte by byte as it comes (see "calls, read byte by byte"),
 * so a call's name and arguments stream as they are written; a block whose first
 * call does not parse goes back out as content with its markup, as vLLM's parsers do.
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
 *           as content, a call to functions.NAME streams its arguments object as the
 *           others' calls do (content with its header if it is no object); a header
 *           we do not know (another
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

/* The call markup being read (see "calls, read byte by byte" below). */
typedef struct {
    int dec;                /* D_*: what the block turned out to be */
    int item;               /* I_*: what is being read */
    int single;             /* one bare arguments object and nothing else (harmony) */
    size_t pos;             /* bytes of the block read */
    int rc;                 /* a callback's nonzero value */
    /* the JSON reader */
    int js, num, hex, lit_i, str_key, depth;
    const char *lit;
    size_t str_start;
    char stack[128];
    /* the call being read */
    int call_depth;         /* depth of a call object's members (1, or 2 in an array) */
    int in_call, key, val, name_ok, name_bad, args_kind, in_args, args_depth, args_done;
    int committed;          /* it went out (M40_PIECE_TOOL_BEGIN) */
    int index;
    size_t astr_start, astr_end;   /* arguments written as a JSON string: its body */
    size_t mname_start, mname_end; /* Mistral's "name[ARGS]": the name */
} call_scan;

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
    int after_call;          /* a call went out: blanks after it are held in pend, dropped if
                              * another call or the end comes next, else they go out with the
                              * content that follows (so chunking cannot change the answer) */
    char *pend;
    size_t pend_len, pend_cap;
    /* harmony */
    int h_kind;              /* H_BODY: HB_* */
    int h_first;             /* H_INIT: still at the start of the output */
    char *h_head;            /* H_HEAD: the opener consumed ("<|start|>" or ""); H_BODY: the
                              * whole header as written (for content when it is no call) */
    char h_name[72];         /* HB_CALL: the function's name */
    /* calls */
    int incremental;         /* TOOL_BEGIN and TOOL_ARGS pieces wanted */
    call_scan sc;
    char *args;              /* the call's arguments so far (NUL-terminated) */
    size_t args_len, args_cap, args_sent;
    char call_name[256];
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
    free(p->args);
    free(p->pend);
    free(p);
}

void m40_chat_parse_incremental(m40_chat_parse *p, int on)
{
    p->incremental = on;
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
        if (p->after_call) {
            if (all_ws(s, n)) {
                if (p->pend_len + n > p->pend_cap) {
                    size_t cap = p->pend_cap ? p->pend_cap : 64;
                    while (cap < p->pend_len + n)
                        cap *= 2;
                    char *b = realloc(p->pend, cap);
                    if (!b)
                        return -1;
                    p->pend = b;
                    p->pend_cap = cap;
                }
                memcpy(p->pend + p->pend_len, s, n);
                p->pend_len += n;
                return 0;
            }
            p->after_call = 0;
            if (p->pend_len) {
                m40_piece blanks = {.kind = kind, .text = p->pend, .len = p->pend_len};
                int rc;
                p->pend_len = 0;
                if ((rc = cb(ud, &blanks)) != 0)
                    return rc;
            }
        }
        if (!all_ws(s, n))
            p->content_started = 1;
    }
    m40_piece pc = {.kind = kind, .text = s, .len = n};
    return cb(ud, &pc);
}

/* ---- calls, read byte by byte ----
 *
 * A block of call markup (Hermes' body, everything after Llama 3's or Mistral's opener
 * or a bare JSON answer, a harmony call's body) is read by a small JSON reader one
 * byte at a time, so that a call's arguments reach the client while they are written:
 * the call goes out (its name: M40_PIECE_TOOL_BEGIN) as soon as its name is known and
 * its arguments object has two significant bytes ("{}" or '{' and what follows it:
 * enough to tell a call from "{oops"), then each byte of the arguments as it is read
 * (M40_PIECE_TOOL_ARGS), then the whole call (M40_PIECE_TOOL_CALL). The arguments
 * are the model's text without the blanks between tokens (strings are kept as
 * written, escapes and all); a streamed call and the same call not streamed are the
 * same bytes, since both are this one pass. Only bytes that could still be markup (a
 * closing marker's start) are held, and a character's first bytes until its last. A
 * call whose arguments are no object as written (a JSON string holding one, as some
 * models write, null, or absent) goes out whole when its object ends.
 *
 * A block is decided at its first call: until then nothing goes out, and if the first
 * object is no call ({"answer": 42}, no name, arguments neither object, string nor
 * null) or the JSON breaks, the block goes back out as content with its markup, as
 * vLLM does with a call that does not parse: what was read of it at once, the rest as
 * the text it is (release_text). After one call went out the block is
 * calls: what breaks a call later ends it with its arguments as far as they were
 * valid (as OpenAI's are when max_tokens cuts a call) and the rest of the block is
 * dropped; where the markup has no closer (Llama 3, Mistral, bare JSON), text after a
 * finished call goes on as content. */

#define MAX_DEPTH 128

enum { D_UNDECIDED, D_CALLS, D_TEXT, D_DROP };
/* What the block reader is in: between calls, a JSON call object or array of them,
 * Mistral's "name[ARGS]" name, an arguments object whose call is already named. */
enum { I_BETWEEN, I_JSON, I_MNAME, I_BARE };
/* The JSON reader's states. */
enum { J_VALUE, J_OBJ0, J_KEY, J_COLON, J_AFTER, J_ARR0, J_STR, J_ESC, J_HEX, J_NUM, J_LIT };
/* Members of a call object. */
enum { K_OTHER, K_NAME, K_ARGS };
/* What its arguments member held. */
enum { A_NONE, A_OBJECT, A_STRING, A_NULL, A_OTHER };
/* Number states (JSON's grammar); the odd ones are complete numbers. */
enum { N_MINUS = 0, N_ZERO = 1, N_DOT = 2, N_INT = 3, N_E = 4, N_FRAC = 5, N_ESIGN = 6, N_EXP = 7 };

enum { LX_OK, LX_BAD, LX_DONE, LX_CB };

static int is_name_char(unsigned char c)
{
    return c == '_' || c == '-' || c == '.' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

static void sc_reset(m40_chat_parse *p, int item, int single)
{
    memset(&p->sc, 0, sizeof p->sc);
    p->sc.item = item;
    p->sc.single = single;
    p->args_len = p->args_sent = 0;
}

/* A call object (or a named bare arguments object) starts. */
static void call_begin(m40_chat_parse *p, int named)
{
    call_scan *s = &p->sc;
    s->in_call = 1;
    s->key = s->val = K_OTHER;
    s->name_ok = named;
    s->name_bad = 0;
    s->args_kind = A_NONE;
    s->in_args = s->args_done = s->committed = 0;
    p->args_len = p->args_sent = 0;
}

static int args_put(m40_chat_parse *p, const char *s, size_t n)
{
    if (p->args_len + n + 1 > p->args_cap) {
        size_t cap = p->args_cap ? p->args_cap : 128;
        while (cap < p->args_len + n + 1)
            cap *= 2;
        char *a = realloc(p->args, cap);
        if (!a)
            return -1;
        p->args = a;
        p->args_cap = cap;
    }
    memcpy(p->args + p->args_len, s, n);
    p->args_len += n;
    p->args[p->args_len] = '\0';
    return 0;
}

/* The call goes out: its index and name. */
static int call_start(m40_chat_parse *p, m40_piece_cb cb, void *ud)
{
    call_scan *s = &p->sc;
    s->committed = 1;
    s->index = p->n_calls++;
    s->dec = D_CALLS;
    p->after_call = 1;
    p->pend_len = 0; /* blanks between calls are no answer */
    if (!p->incremental)
        return 0;
    m40_piece pc = {.kind = M40_PIECE_TOOL_BEGIN, .index = s->index, .name = p->call_name};
    return cb(ud, &pc);
}

/* n less a UTF-8 character s[0..n) ends inside of (a fragment must be text a client
 * can decode: the rest of the character comes with the next). */
static size_t utf8_whole(const char *s, size_t n)
{
    for (size_t k = 1; k <= 3 && k <= n; k++) {
        unsigned char c = (unsigned char)s[n - k];
        if ((c & 0xc0) == 0x80)
            continue; /* a continuation byte: look further back */
        size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
        return need > k ? n - k : n;
    }
    return n;
}

/* The arguments read since the last flush (all: the call ends; else whole
 * characters only). */
static int flush_args(m40_chat_parse *p, int all, m40_piece_cb cb, void *ud)
{
    size_t end = all ? p->args_len : utf8_whole(p->args, p->args_len);
    if (!p->sc.committed || end <= p->args_sent)
        return 0;
    m40_piece pc = {
        .kind = M40_PIECE_TOOL_ARGS, .index = p->sc.index, .text = p->args + p->args_sent, .len = end - p->args_sent};
    p->args_sent = end;
    return p->incremental ? cb(ud, &pc) : 0;
}

static int call_end(m40_chat_parse *p, m40_piece_cb cb, void *ud)
{
    int rc = flush_args(p, 1, cb, ud);
    call_scan *s = &p->sc;
    s->committed = 0;
    s->in_call = s->in_args = 0;
    if (rc != 0)
        return rc;
    if (p->args_len == 0 && args_put(p, "", 0) != 0)
        return -1;
    m40_piece pc = {.kind = M40_PIECE_TOOL_CALL, .index = s->index, .name = p->call_name, .arguments = p->args};
    return cb(ud, &pc);
}

/* What the reader met is no call: the block is content if nothing went out yet,
 * else an open call ends here and the rest of the block is dropped. */
static int not_call(m40_chat_parse *p, m40_piece_cb cb, void *ud)
{
    int rc = p->sc.committed ? call_end(p, cb, ud) : 0;
    p->sc.dec = p->sc.dec == D_UNDECIDED ? D_TEXT : D_DROP;
    return rc;
}

static int maybe_commit(m40_chat_parse *p, m40_piece_cb cb, void *ud)
{
    call_scan *s = &p->sc;
    if (s->committed || !s->in_call || !s->name_ok || s->name_bad || s->args_kind != A_OBJECT || p->args_len < 2)
        return 0;
    return call_start(p, cb, ud);
}

/* blk[a..b) is a JSON string's body (escapes as written): decoded into dst. */
static int decode_string(const char *blk, size_t a, size_t b, char *dst, size_t cap)
{
    if (memchr(blk + a, '\\', b - a) == NULL) {
        if (b - a >= cap || memchr(blk + a, '\0', b - a))
            return -1;
        memcpy(dst, blk + a, b - a);
        dst[b - a] = '\0';
        return 0;
    }
    json_t *v = json_loadb(blk + a - 1, b - a + 2, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    int ok = json_is_string(v) && json_string_length(v) < cap && !memchr(json_string_value(v), '\0', json_string_length(v));
    if (ok)
        memcpy(dst, json_string_value(v), json_string_length(v) + 1);
    json_decref(v);
    return ok ? 0 : -1;
}

/* A call object (or bare arguments) ended and nothing went out yet: a call if it has
 * a name and arguments that are an object, a string holding one (some models write
 * that), null or absent. */
static int call_resolve(m40_chat_parse *p, const char *blk, m40_piece_cb cb, void *ud)
{
    call_scan *s = &p->sc;
    if (s->committed)
        return call_end(p, cb, ud);
    int ok = s->name_ok && !s->name_bad && p->call_name[0];
    if (ok && s->args_kind == A_OBJECT) {
        ok = s->args_done;
    } else if (ok && s->args_kind == A_STRING) {
        json_t *v = json_loadb(blk + s->astr_start - 1, s->astr_end - s->astr_start + 2, JSON_DECODE_ANY, NULL);
        json_t *inner = json_is_string(v) ? json_loadb(json_string_value(v), json_string_length(v), 0, NULL) : NULL;
        char *text = json_is_object(inner) ? json_dumps(inner, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
        json_decref(v);
        json_decref(inner);
        p->args_len = 0;
        ok = text && args_put(p, text, strlen(text)) == 0;
        free(text);
    } else if (ok && (s->args_kind == A_NONE || s->args_kind == A_NULL)) {
        p->args_len = 0;
        ok = args_put(p, "{}", 2) == 0;
    } else {
        ok = 0;
    }
    if (!ok) {
        s->in_call = 0;
        return not_call(p, cb, ud);
    }
    int rc = call_start(p, cb, ud);
    return rc != 0 ? rc : call_end(p, cb, ud);
}

/* A value starts with c at the reader's depth (before an opening bracket is pushed). */
static int value_begin(m40_chat_parse *p, unsigned char c)
{
    call_scan *s = &p->sc;
    int d = s->depth;
    if (s->item == I_BARE) {
        if (d == 0) {
            if (c != '{')
                return LX_BAD;
            s->args_kind = A_OBJECT;
            s->in_args = 1;
            s->args_depth = 1;
        }
        return LX_OK;
    }
    if (d == 0) {
        if (c == '{') {
            s->call_depth = 1;
            call_begin(p, 0);
        } else if (c == '[') {
            s->call_depth = 2;
        } else {
            return LX_BAD;
        }
    } else if (d == 1 && s->call_depth == 2 && !s->in_call) {
        if (c != '{')
            return LX_BAD;
        call_begin(p, 0);
    } else if (d == s->call_depth && s->in_call) {
        if (s->key == K_NAME && !s->name_ok) {
            if (c == '"')
                s->val = K_NAME;
            else
                s->name_bad = 1;
        } else if (s->key == K_ARGS && s->args_kind == A_NONE) {
            s->args_kind = c == '{' ? A_OBJECT : c == '"' ? A_STRING : c == 'n' ? A_NULL : A_OTHER;
            if (c == '{') {
                s->in_args = 1;
                s->args_depth = d + 1;
                p->args_len = p->args_sent = 0;
            } else if (c == '"') {
                s->val = K_ARGS;
            }
        }
        s->key = K_OTHER;
    }
    return LX_OK;
}

/* A string ended: blk[str_start..pos - 1) is its body. */
static void string_end(m40_chat_parse *p, const char *blk)
{
    call_scan *s = &p->sc;
    size_t a = s->str_start, b = s->pos - 1;
    if (!s->in_call || s->item != I_JSON || s->depth != s->call_depth)
        return;
    if (s->str_key) {
        size_t n = b - a;
        s->key = n == 4 && memcmp(blk + a, "name", 4) == 0                                              ? K_NAME
                 : (n == 9 && memcmp(blk + a, "arguments", 9) == 0) || (n == 10 && memcmp(blk + a, "parameters", 10) == 0) ? K_ARGS
                                                                                                         : K_OTHER;
    } else if (s->val == K_NAME) {
        if (decode_string(blk, a, b, p->call_name, sizeof p->call_name) == 0 && p->call_name[0])
            s->name_ok = 1;
        else
            s->name_bad = 1;
        s->val = K_OTHER;
    } else if (s->val == K_ARGS) {
        s->astr_start = a;
        s->astr_end = b;
        s->val = K_OTHER;
    }
}

/* A container closed (the reader's depth is already the outer one). */
static int container_end(m40_chat_parse *p, const char *blk, unsigned char c, m40_piece_cb cb, void *ud)
{
    call_scan *s = &p->sc;
    int rc;
    if (s->in_args && s->depth == s->args_depth - 1) {
        s->in_args = 0;
        s->args_done = 1;
        if (s->item == I_BARE) {
            if ((rc = maybe_commit(p, cb, ud)) != 0)
                return rc;
            return call_resolve(p, blk, cb, ud);
        }
    }
    if (s->item == I_JSON && s->in_call && c == '}' && s->depth == s->call_depth - 1)
        return call_resolve(p, blk, cb, ud);
    return 0;
}

static int num_step(int st, unsigned char c)
{
    int digit = c >= '0' && c <= '9';
    switch (st) {
    case -1:
        return c == '-' ? N_MINUS : c == '0' ? N_ZERO : digit ? N_INT : -1;
    case N_MINUS:
        return c == '0' ? N_ZERO : digit ? N_INT : -1;
    case N_ZERO:
    case N_INT:
        if (digit && st == N_INT)
            return N_INT;
        return c == '.' ? N_DOT : (c == 'e' || c == 'E') ? N_E : -1;
    case N_DOT:
        return digit ? N_FRAC : -1;
    case N_FRAC:
        return digit ? N_FRAC : (c == 'e' || c == 'E') ? N_E : -1;
    case N_E:
        return (c == '+' || c == '-') ? N_ESIGN : digit ? N_EXP : -1;
    case N_ESIGN:
    case N_EXP:
        return digit ? N_EXP : -1;
    }
    return -1;
}

/* A scalar or container value is complete. */
static int value_end(m40_chat_parse *p)
{
    p->sc.js = J_AFTER;
    return p->sc.depth == 0 ? LX_DONE : LX_OK;
}

/* One byte of JSON at blk[pos]: LX_OK (read), LX_DONE (read, and a top-level value
 * ended), LX_BAD (not JSON, or not the shape of calls), LX_CB (a callback's nonzero
 * value, in p->sc.rc). */
static int lex(m40_chat_parse *p, const char *blk, m40_piece_cb cb, void *ud)
{
    call_scan *s = &p->sc;
    unsigned char c = (unsigned char)blk[s->pos];
    char ch = (char)c;
    int st, rc;
    switch (s->js) {
    case J_STR:
        if (c < 0x20)
            return LX_BAD;
        if (s->in_args && args_put(p, &ch, 1) != 0)
            goto oom;
        s->pos++;
        if (c == '\\') {
            s->js = J_ESC;
        } else if (c == '"') {
            string_end(p, blk);
            if (s->str_key) {
                s->js = J_COLON;
                return LX_OK;
            }
            return value_end(p);
        }
        return LX_OK;
    case J_ESC:
        if (!strchr("\"\\/bfnrtu", ch) || c == 0)
            return LX_BAD;
        s->js = c == 'u' ? J_HEX : J_STR;
        s->hex = 4;
        goto take;
    case J_HEX:
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')))
            return LX_BAD;
        if (--s->hex == 0)
            s->js = J_STR;
        goto take;
    case J_LIT:
        if (c != (unsigned char)s->lit[s->lit_i])
            return LX_BAD;
        s->lit_i++;
        if (s->in_args && args_put(p, &ch, 1) != 0)
            goto oom;
        s->pos++;
        return s->lit[s->lit_i] == '\0' ? value_end(p) : LX_OK;
    case J_NUM:
        st = num_step(s->num, c);
        if (st >= 0) {
            s->num = st;
            goto take;
        }
        if (!(s->num & 1))
            return LX_BAD; /* "-", "1.", "1e": not a number yet */
        if ((rc = value_end(p)) != LX_OK)
            return rc; /* (a number never stands alone at the top) */
        return lex(p, blk, cb, ud);
    default:
        break;
    }
    if (is_ws(ch)) {
        s->pos++;
        return LX_OK;
    }
    switch (s->js) {
    case J_COLON:
        if (c != ':')
            return LX_BAD;
        s->js = J_VALUE;
        goto take;
    case J_OBJ0:
    case J_KEY:
        if (c == '}' && s->js == J_OBJ0)
            goto close;
        if (c != '"')
            return LX_BAD;
        s->js = J_STR;
        s->str_key = 1;
        s->str_start = s->pos + 1;
        goto take;
    case J_AFTER:
        if (c == ',') {
            s->js = s->stack[s->depth - 1] == '{' ? J_KEY : J_VALUE;
            goto take;
        }
        if ((c == '}' || c == ']') && s->stack[s->depth - 1] == (c == '}' ? '{' : '['))
            goto close;
        return LX_BAD;
    case J_ARR0:
        if (c == ']')
            goto close;
        /* fall through */
    default: /* J_VALUE */
        if ((rc = value_begin(p, c)) != LX_OK)
            return rc;
        if (c == '{' || c == '[') {
            if (s->depth == MAX_DEPTH)
                return LX_BAD;
            s->stack[s->depth++] = ch;
            s->js = c == '{' ? J_OBJ0 : J_ARR0;
        } else if (c == '"') {
            s->js = J_STR;
            s->str_key = 0;
            s->str_start = s->pos + 1;
        } else if ((st = num_step(-1, c)) >= 0) {
            s->js = J_NUM;
            s->num = st;
        } else if (c == 't' || c == 'f' || c == 'n') {
            s->js = J_LIT;
            s->lit = c == 't' ? "true" : c == 'f' ? "false" : "null";
            s->lit_i = 1;
        } else {
            return LX_BAD;
        }
        goto take;
    }
take:
    if (s->in_args && args_put(p, &ch, 1) != 0)
        goto oom;
    s->pos++;
    return LX_OK;
close:
    if (s->in_args && args_put(p, &ch, 1) != 0)
        goto oom;
    s->pos++;
    s->depth--;
    if ((rc = container_end(p, blk, c, cb, ud)) != 0) {
        s->rc = rc;
        return LX_CB;
    }
    return value_end(p);
oom:
    s->rc = -1;
    return LX_CB;
}

/* Reads the block blk[pos..n) (final: nothing more will follow n). rest: the markup
 * has no closer, so after finished calls a byte that starts none is where text
 * begins: *tail is set to it (else to (size_t)-1). */
static int scan_block(m40_chat_parse *p, const char *blk, size_t n, int final, int rest, m40_piece_cb cb, void *ud,
                      size_t *tail)
{
    call_scan *s = &p->sc;
    int rc;
    *tail = (size_t)-1;
    while (s->pos < n && (s->dec == D_UNDECIDED || s->dec == D_CALLS)) {
        unsigned char c = (unsigned char)blk[s->pos];
        if (s->item == I_BETWEEN) {
            if (is_ws((char)c) || (c == ';' && !s->single)) {
                s->pos++;
                continue;
            }
            if (p->tools == M40_TOOLS_MISTRAL && c == '[' && !s->single) {
                size_t m = sizeof MISTRAL_OPEN - 1, k = n - s->pos < m ? n - s->pos : m;
                if (memcmp(blk + s->pos, MISTRAL_OPEN, k) == 0) {
                    if (k < m && !final)
                        break; /* could still be the next call's marker */
                    if (k == m) {
                        s->pos += m;
                        continue;
                    }
                }
            }
            if ((c == '{' || c == '[') && !s->single) {
                s->item = I_JSON;
                s->js = J_VALUE;
            } else if (p->tools == M40_TOOLS_MISTRAL && is_name_char(c) && !s->single) {
                s->item = I_MNAME;
                s->mname_start = s->pos++;
                s->mname_end = 0;
                continue;
            } else if (s->dec == D_CALLS && rest) {
                *tail = s->pos;
                return 0;
            } else {
                if ((rc = not_call(p, cb, ud)) != 0)
                    return rc;
                continue;
            }
        }
        if (s->item == I_MNAME) {
            /* Mistral's newer spelling: name[ARGS]{...} */
            if (is_name_char(c) && !s->mname_end) {
                s->pos++;
                continue;
            }
            if (is_ws((char)c)) {
                if (!s->mname_end)
                    s->mname_end = s->pos;
                s->pos++;
                continue;
            }
            size_t m = 6, k = n - s->pos < m ? n - s->pos : m;
            if (c == '[' && memcmp(blk + s->pos, "[ARGS]", k) == 0) {
                if (k < m && !final)
                    break;
                size_t e = s->mname_end ? s->mname_end : s->pos;
                if (k == m && e - s->mname_start < sizeof p->call_name) {
                    memcpy(p->call_name, blk + s->mname_start, e - s->mname_start);
                    p->call_name[e - s->mname_start] = '\0';
                    s->pos += m;
                    s->item = I_BARE;
                    s->js = J_VALUE;
                    call_begin(p, 1);
                    continue;
                }
            }
            if ((rc = not_call(p, cb, ud)) != 0)
                return rc;
            continue;
        }
        int r = lex(p, blk, cb, ud);
        if (r == LX_CB)
            return s->rc;
        if (r == LX_BAD) {
            if ((rc = not_call(p, cb, ud)) != 0)
                return rc;
            continue;
        }
        if (r == LX_DONE) {
            s->item = I_BETWEEN;
            s->in_call = 0;
        }
        if ((rc = maybe_commit(p, cb, ud)) != 0)
            return rc;
    }
    return flush_args(p, 0, cb, ud);
}

/* The block turned out to be no call (D_TEXT): what was read of it goes out as content
 * at once, its opener first, and the caller goes on with the rest as text (nothing is
 * held that can no longer be markup). */
static int release_text(m40_chat_parse *p, const char *open, m40_piece_cb cb, void *ud)
{
    size_t n = p->sc.pos;
    int rc;
    if ((rc = emit_text(p, M40_PIECE_CONTENT, open, strlen(open), cb, ud)) == 0)
        rc = emit_text(p, M40_PIECE_CONTENT, p->buf, n, cb, ud);
    consume(p, n);
    return rc;
}

/* The block blk[0..n) ended (its closer, or the output's end): an open call ends
 * there (cut short); an undecided block, or one that was no call, is content with
 * its markup. */
static int finish_block(m40_chat_parse *p, const char *open, const char *blk, size_t n, const char *close,
                        m40_piece_cb cb, void *ud)
{
    int rc;
    if (p->sc.committed && (rc = call_end(p, cb, ud)) != 0)
        return rc;
    if (p->sc.dec == D_CALLS || p->sc.dec == D_DROP) {
        p->after_call = 1;
        return 0;
    }
    /* markup that failed to parse is content, even between calls */
    if ((rc = emit_text(p, M40_PIECE_CONTENT, open, strlen(open), cb, ud)) != 0 ||
        (rc = emit_text(p, M40_PIECE_CONTENT, blk, n, cb, ud)) != 0)
        return rc;
    return emit_text(p, M40_PIECE_CONTENT, close, strlen(close), cb, ud);
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
                if (kind == HB_CALL) {
                    memcpy(p->call_name, p->h_name, sizeof p->h_name);
                    sc_reset(p, I_BARE, 1);
                    call_begin(p, 1);
                }
                if (kind == HB_RAW && (rc = emit_text(p, M40_PIECE_CONTENT, p->h_head, strlen(p->h_head), cb, ud)) != 0)
                    return rc;
                continue;
            }
            size_t n;
            if (j >= 0)
                n = (size_t)j; /* an end marker or <|start|> before any <|message|> */
            else if (final)
                n = p->len;
            else if (win == HEAD_MAX + sizeof H_MESSAGE - 1) /* whole characters: the window may end in one */
                n = utf8_whole(p->buf, win - partial_any(p->buf, win, H_HEAD_BREAKS, 5));
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
            /* the arguments object, read as it comes; an end marker's start is held */
            size_t n = j >= 0 ? (size_t)j : final ? p->len : p->len - partial_any(p->buf, p->len, H_BODY_ENDS, 5), tail;
            if ((rc = scan_block(p, p->buf, n, j >= 0 || final, 0, cb, ud, &tail)) != 0)
                return rc;
            if (p->sc.dec == D_TEXT) {
                /* no object: the message is content as written, header and all */
                rc = release_text(p, p->h_head, cb, ud);
                h_raw_body(p);
                if (rc != 0)
                    return rc;
                continue;
            }
            if (j < 0 && !final)
                return 0;
            rc = finish_block(p, p->h_head, p->buf, n, end, cb, ud);
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
            size_t n = i >= 0 ? (size_t)i : final ? p->len : p->len - partial_tail(p->buf, p->len, HERMES_CLOSE), tail;
            if ((rc = scan_block(p, p->buf, n, i >= 0 || final, 0, cb, ud, &tail)) != 0)
                return rc;
            if (p->sc.dec == D_TEXT) {
                /* no call: content, and the rest (its closer too) is text again */
                rc = release_text(p, HERMES_OPEN, cb, ud);
                p->state = S_TEXT;
                if (rc != 0)
                    return rc;
                continue;
            }
            if (i < 0 && !final)
                return 0;
            rc = finish_block(p, HERMES_OPEN, p->buf, n, i >= 0 ? HERMES_CLOSE : "", cb, ud);
            consume(p, i >= 0 ? n + sizeof HERMES_CLOSE - 1 : n);
            p->state = S_TEXT;
            if (rc != 0)
                return rc;
            continue;
        }
        if (p->state == S_REST) {
            size_t tail;
            if ((rc = scan_block(p, p->buf, p->len, final, 1, cb, ud, &tail)) != 0)
                return rc;
            if (tail != (size_t)-1) {
                /* the calls ended and text follows: it is content (and may open more) */
                consume(p, tail);
                p->state = S_TEXT;
                p->content_started = 1;
                continue;
            }
            if (p->sc.dec == D_TEXT) {
                /* no call ({"answer": 42}): content, and the rest is text again */
                rc = release_text(p, p->rest_marker, cb, ud);
                p->state = S_TEXT;
                p->content_started = 1;
                if (rc != 0)
                    return rc;
                continue;
            }
            if (!final)
                return 0;
            rc = finish_block(p, p->rest_marker, p->buf, p->len, "", cb, ud);
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
                sc_reset(p, I_BETWEEN, 0);
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
                sc_reset(p, I_BETWEEN, 0);
            } else {
                p->state = S_REST;
                p->rest_marker = marker;
                sc_reset(p, I_BETWEEN, 0);
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
