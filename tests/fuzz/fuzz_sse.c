/* libFuzzer harness: the streaming output path, from token bytes to Server-Sent Events.
 *
 * The input's text goes through what a stream's bytes go through: the engine's
 * incremental detokenizer (pushed as single-byte tokens, <0xNN>, so that a character can
 * be split at any byte, or as the tokenizer's own ids), the chat output parser (tool
 * calls and <think> splitting, the format chosen by the first byte), then the module's
 * UTF-8 repair (ngx_http_m40_json_text) and event writer (ngx_http_m40_json_write with
 * "data: " and "\n\n", as ngx_http_m40_emit calls it). The raw bytes, cut at the points
 * the second byte picks, also go straight to the module's side (text a submitter could
 * get from any engine). Checked on every event:
 *   - "data: " + one line of JSON + "\n\n", valid UTF-8, parses back;
 *   - what the detokenizer gives out is valid UTF-8 (an incomplete tail is held, an
 *     invalid one is U+FFFD), and for valid input the pieces put together are the input;
 *   - a piece of valid UTF-8 passes the repair unchanged, so the events' texts put
 *     together are the detokenized text, byte for byte, when nothing is parsed out.
 * The module's files are built against the configured nginx tree (build/nginx). */
#include <ngx_config.h>
#include <ngx_core.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ngx_http_m40_module.h"
#include "gguf/gguf.h"
#include "gguf/mkmodel.h"
#include "tokenizer/tokenizer.h"

static m40_tokenizer *tok;
static int32_t byte_id[256];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    char err[256], path[256];
    snprintf(path, sizeof path, "/tmp/m40-fuzz-sse-%d.gguf", (int)getpid());
    m40_mkmodel_opts o = {0};
    o.shape = m40_mkmodel_find_shape("tiny");
    o.ftype = M40_MK_F32;
    o.seed = 1;
    o.n_threads = 1;
    m40_gguf *g = NULL;
    if (!o.shape || m40_mkmodel_write(&o, path, NULL, err, sizeof err) != 0 || m40_gguf_open(path, &g, err, sizeof err) != 0
        || m40_tokenizer_from_gguf(g, &tok, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_sse: cannot make the vocabulary: %s\n", err);
        exit(1);
    }
    m40_gguf_close(g);
    unlink(path);
    for (int b = 0; b < 256; b++) {
        char piece[8];
        snprintf(piece, sizeof piece, "<0x%02X>", b);
        byte_id[b] = m40_tokenizer_find_piece(tok, piece);
        if (byte_id[b] < 0) {
            fprintf(stderr, "fuzz_sse: the vocabulary has no byte token %s\n", piece);
            exit(1);
        }
    }
    return 0;
}

/* The harness's own checkers are not instrumented for coverage: their branches say nothing
 * about the code under test, and every byte of every event goes through them (a tenth of
 * an execution with the instrumentation). */
#define CHECKER __attribute__((no_sanitize("coverage")))

/* Length of the valid UTF-8 sequence at p, 0 when invalid (RFC 3629: no overlongs, no
 * surrogates, nothing past U+10FFFF). Written apart from the module's own. */
CHECKER static size_t utf8_len(const unsigned char *p, size_t n)
{
    if (p[0] < 0x80)
        return 1;
    size_t len = p[0] >= 0xc2 && p[0] <= 0xdf ? 2 : p[0] >= 0xe0 && p[0] <= 0xef ? 3 : p[0] >= 0xf0 && p[0] <= 0xf4 ? 4 : 0;
    if (len == 0 || n < len)
        return 0;
    for (size_t i = 1; i < len; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    if ((p[0] == 0xe0 && p[1] < 0xa0) || (p[0] == 0xed && p[1] > 0x9f) || (p[0] == 0xf0 && p[1] < 0x90)
        || (p[0] == 0xf4 && p[1] > 0x8f))
        return 0;
    return len;
}

CHECKER static int valid_utf8(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_len(p + i, n - i);
        if (k == 0)
            return 0;
        i += k;
    }
    return 1;
}

#define CHECK(c, ...)                                                                                                  \
    do {                                                                                                               \
        if (!(c)) {                                                                                                    \
            fprintf(stderr, "fuzz_sse: " __VA_ARGS__);                                                                 \
            fprintf(stderr, "\n");                                                                                     \
            abort();                                                                                                   \
        }                                                                                                              \
    } while (0)

typedef struct {
    char *buf; /* the texts the events carried, put together */
    size_t len, cap;
    int input_valid;
    int incremental; /* the parser streams calls (TOOL_BEGIN, TOOL_ARGS) */
    int open;        /* a streamed call is open */
    int index;       /* its index */
    struct sink_args {
        char *buf;
        size_t len, cap;
    } args;          /* its fragments joined */
} sink;

static void append(sink *s, const char *p, size_t n)
{
    if (s->len + n + 1 > s->cap) {
        s->cap = (s->len + n + 1) * 2;
        s->buf = realloc(s->buf, s->cap);
        CHECK(s->buf, "out of memory");
    }
    memcpy(s->buf + s->len, p, n);
    s->len += n;
}

/* One event as the stream writer makes it: {"choices":[{"delta":{KEY:text}}]} after
 * "data: ", then "\n\n"; returns the text the event carries (a new reference).
 *
 * Cost: an input makes an event every 1 to 7 bytes, and building the chunk, freeing it and
 * parsing the whole event back was 85% of an execution (about 17 us an event under ASan,
 * 2.5 ms for 100 bytes). The chunk is built once and only its delta changes; the line is
 * checked byte for byte around the text (the chunk's fixed JSON before and after it) and
 * only the text's JSON string is parsed back: the same checks on what the module wrote
 * (one line, valid UTF-8, JSON that gives the text back), at a fraction of the cost. */
static json_t *chunk, *delta;
static char head[256], tail[64]; /* the event around the text, for the key in use */
static size_t head_len, tail_len;
static const char *head_key;
static u_char *mem;
static size_t mem_cap;

static void event_frame(const char *key)
{
    if (head_key == key)
        return;
    /* the chunk with an empty text, dumped: what surrounds "" is what surrounds any text */
    json_object_clear(delta);
    CHECK(json_object_set_new(delta, key, json_string("")) == 0, "json_object_set_new failed");
    char line[sizeof head + sizeof tail];
    size_t n = json_dumpb(chunk, line, sizeof line, JSON_COMPACT);
    CHECK(n > 0 && n < sizeof line, "the empty chunk does not dump");
    const char *q = strstr(line, "\"\"");
    CHECK(q && (size_t)(q - line) + 7 < sizeof head, "no empty text in %.*s", (int)n, line);
    /* head: "data: " and the dump up to the text's opening quote; tail: from its closing
     * quote to the end, and "\n\n" */
    head_len = 6 + (size_t)(q - line) + 1;
    memcpy(head, "data: ", 6);
    memcpy(head + 6, line, head_len - 6);
    tail_len = n - (size_t)(q + 1 - line) + 2;
    CHECK(tail_len < sizeof tail, "tail");
    memcpy(tail, q + 1, tail_len - 2);
    memcpy(tail + tail_len - 2, "\n\n", 2);
    head_key = key;
}

static json_t *event(json_t *text, const char *key)
{
    if (!chunk) {
        chunk = json_pack("{s:s,s:[{s:i,s:{},s:n}]}", "object", "chat.completion.chunk", "choices", "index", 0,
                          "delta", "finish_reason");
        CHECK(chunk, "json_pack failed");
        delta = json_object_get(json_array_get(json_object_get(chunk, "choices"), 0), "delta");
    }
    event_frame(key);
    json_object_clear(delta);
    CHECK(json_object_set(delta, key, text) == 0, "json_object_set failed");
    /* exactly the room the event takes, worked out apart from the chunk: the frame around
     * the text and the text as a JSON string, quotes included (the frame's last and first
     * bytes). ngx_http_m40_emit dumps the chunk into a recycled buffer and measures it
     * with a second dump only when it does not fit; here every event gets exactly its
     * room (the writer's bound checked at the edge), measured without a dump of the
     * whole chunk (two dumps an event were half of an execution). */
    const size_t need = head_len - 1 + json_dumpb(text, NULL, 0, JSON_ENCODE_ANY | JSON_COMPACT) + tail_len - 1;
    if (need > mem_cap) {
        mem_cap = need * 2;
        free(mem);
        mem = malloc(mem_cap);
        CHECK(mem, "out of memory");
    }
    ngx_buf_t b;
    memset(&b, 0, sizeof b);
    b.start = b.pos = b.last = mem;
    b.end = mem + need; /* no byte to spare: the module gives at least this */
    size_t n = ngx_http_m40_json_write(chunk, &b, "data: ", "\n\n");
    json_object_clear(delta); /* the text is the caller's again */
    CHECK(n == need && b.last == b.end, "event of %zu bytes, %zu expected", n, need);
    const char *ev = (const char *)mem;
    CHECK(n >= head_len + tail_len && memcmp(ev, head, head_len) == 0
              && memcmp(ev + n - tail_len, tail, tail_len) == 0, "event framing: %.*s", (int)n, ev);
    CHECK(memchr(ev, '\n', n - 2) == NULL && memchr(ev, '\r', n - 2) == NULL, "a line break inside an event");
    CHECK(valid_utf8(ev, n), "an event is not valid UTF-8: %.*s", (int)n, ev);
    /* the text's JSON string: from the opening quote (the last byte of head) to the
     * closing one (the first of tail) */
    json_error_t jerr;
    json_t *t = json_loadb(ev + head_len - 1, n - head_len - tail_len + 2, JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);
    CHECK(json_is_string(t), "an event's text does not parse back: %s", jerr.text);
    return t;
}

/* A text piece through the module: repair, event, and what the client reads. */
static void emit_text(sink *s, const char *p, size_t n, const char *key)
{
    json_t *j = ngx_http_m40_json_text(p, n);
    CHECK(j, "ngx_http_m40_json_text failed on %zu bytes", n);
    json_t *got = event(j, key);
    const char *g = json_string_value(got);
    size_t gl = json_string_length(got);
    if (valid_utf8(p, n))
        CHECK(gl == n && (n == 0 || memcmp(g, p, n) == 0), "valid text of %zu bytes changed on the way (%zu)", n, gl);
    if (!strcmp(key, "content"))
        append(s, g, gl);
    json_decref(got);
    json_decref(j);
}

static int on_piece(void *ud, const m40_piece *pc)
{
    sink *s = ud;
    if (pc->kind == M40_PIECE_TOOL_BEGIN) {
        CHECK(s->incremental && !s->open && pc->name && pc->name[0], "a call begun out of order or without name");
        s->open = 1;
        s->index = pc->index;
        s->args.len = 0;
        json_t *c = ngx_http_m40_json_text(pc->name, strlen(pc->name));
        CHECK(c, "tool call name");
        json_decref(event(c, "name"));
        json_decref(c);
        return 0;
    }
    if (pc->kind == M40_PIECE_TOOL_ARGS) {
        CHECK(s->incremental && s->open && pc->index == s->index && pc->len > 0, "arguments outside their call");
        if (s->input_valid)
            CHECK(valid_utf8(pc->text, pc->len), "an arguments fragment of %zu bytes is not UTF-8", pc->len);
        sink frag = {0};
        emit_text(&frag, pc->text, pc->len, "content"); /* through the module's repair and events */
        free(frag.buf);
        if (s->args.len + pc->len + 1 > s->args.cap) {
            s->args.cap = (s->args.len + pc->len + 1) * 2;
            s->args.buf = realloc(s->args.buf, s->args.cap);
            CHECK(s->args.buf, "out of memory");
        }
        memcpy(s->args.buf + s->args.len, pc->text, pc->len);
        s->args.len += pc->len;
        s->args.buf[s->args.len] = '\0';
        return 0;
    }
    if (pc->kind == M40_PIECE_TOOL_CALL) {
        CHECK(pc->name && pc->arguments, "a tool call without name or arguments");
        /* an object's text; only a call cut short (the end of the output, or JSON that
         * broke inside it) is a valid prefix of one instead */
        CHECK(pc->arguments[0] == '{', "tool call arguments do not start an object: %s", pc->arguments);
        json_t *args = json_loads(pc->arguments, JSON_DECODE_ANY, NULL);
        CHECK(!args || json_is_object(args), "tool call arguments are not a JSON object: %s", pc->arguments);
        json_decref(args);
        if (s->incremental) {
            CHECK(s->open && pc->index == s->index, "a call ended that was not begun");
            CHECK(strlen(pc->arguments) == s->args.len && memcmp(pc->arguments, s->args.buf ? s->args.buf : "",
                                                                 s->args.len) == 0,
                  "the streamed arguments are not the call's: %s", pc->arguments);
            s->open = 0;
        }
        json_t *c = ngx_http_m40_json_text(pc->name, strlen(pc->name));
        CHECK(c, "tool call name");
        json_decref(event(c, "name"));
        json_decref(c);
        return 0;
    }
    if (s->input_valid)
        CHECK(valid_utf8(pc->text, pc->len), "the parser cut a character: a piece of %zu bytes is not UTF-8", pc->len);
    if (pc->kind == M40_PIECE_REASONING) {
        emit_text(s, pc->text, pc->len, "reasoning_content");
    } else
        emit_text(s, pc->text, pc->len, "content");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2 || size > 4096) /* one event a byte at worst: keep runs fast */
        return 0;
    const unsigned mode = data[0], cut = data[1];
    const char *text = (const char *)data + 2;
    const size_t len = size - 2;

    /* 1. the raw bytes cut every (cut % 7 + 1) bytes straight into events */
    sink raw = {0};
    size_t step = cut % 7 + 1;
    for (size_t i = 0; i < len; i += step)
        emit_text(&raw, text + i, len - i < step ? len - i : step, "content");
    free(raw.buf);

    /* 2. the detokenizer, then the output parser, then the events */
    m40_tool_format tools = (m40_tool_format)(mode % 6); /* harmony (5) too */
    m40_reasoning_mode reasoning = (m40_reasoning_mode)((mode / 6) % 3);
    m40_chat_parse *cp = m40_chat_parse_new(tools, reasoning, (mode >> 7) & 1);
    m40_detok *d = m40_detok_new(tok);
    CHECK(cp && d, "out of memory");
    sink s = {0}, dt = {0};
    s.input_valid = 1; /* the detokenizer's output must be valid whatever came in */
    s.incremental = (cut & 0x40) != 0;
    m40_chat_parse_incremental(cp, s.incremental);
    int as_bytes = (cut & 0x80) != 0;
    int32_t ids[4096];
    int64_t n_ids = 0;
    if (!as_bytes) {
        char err[128];
        n_ids = m40_tokenize(tok, text, len, 0, 0, ids, 4096, err, sizeof err);
        if (n_ids < 0 || n_ids > 4096)
            as_bytes = 1;
    }
    size_t total = as_bytes ? len : (size_t)n_ids;
    for (size_t i = 0; i <= total; i++) {
        size_t k;
        const char *out = i == total ? m40_detok_flush(d, &k)
                                     : m40_detok_push(d, as_bytes ? byte_id[(unsigned char)text[i]] : ids[i], &k);
        if (!k)
            continue;
        CHECK(out && valid_utf8(out, k), "the detokenizer gave out %zu bytes that are not UTF-8", k);
        append(&dt, out, k);
        CHECK(m40_chat_parse_feed(cp, out, k, on_piece, &s) == 0, "the parser failed");
    }
    CHECK(m40_chat_parse_finish(cp, on_piece, &s) == 0, "the parser failed at the end");
    CHECK(!s.open, "a streamed call never ended");
    if (as_bytes && valid_utf8(text, len))
        CHECK(dt.len == len && (len == 0 || memcmp(dt.buf, text, len) == 0),
              "byte tokens of valid text detokenized to something else");
    /* nothing to take out (no tool format; <think> left inline, or no '<' at all and
     * not opened by the prompt): the events' content is the detokenized text */
    if (tools == M40_TOOLS_NONE
        && (reasoning == M40_REASONING_INLINE || (!((mode >> 7) & 1) && !memchr(dt.buf ? dt.buf : "", '<', dt.len))))
        CHECK(s.len == dt.len && (dt.len == 0 || memcmp(s.buf, dt.buf, dt.len) == 0),
              "the events' content is not the text (%zu bytes, %zu detokenized)", s.len, dt.len);
    m40_chat_parse_free(cp);
    m40_detok_free(d);
    free(s.buf);
    free(s.args.buf);
    free(dt.buf);
    return 0;
}
