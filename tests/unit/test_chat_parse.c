/* Chat output parsing (engine/m40_chat_parse.h): crafted outputs of each tool-call
 * convention and of <think> reasoning, fed whole and in every split into two pieces and
 * byte by byte (streaming must give the same result as one feed), also with calls
 * streamed (TOOL_BEGIN, TOOL_ARGS..., TOOL_CALL in order, the fragments adding up to the
 * arguments); arguments stream as they are written (nothing waits for a call's end) and
 * text that is no call is not held; random bytes, random mixes of the markers and
 * generated calls (cut short, or with a byte changed) at random chunkings never crash and
 * agree with one feed, intact generated calls are read exactly, and with tool parsing
 * and reasoning splitting off the content is the input exactly. */
#include <stdint.h>

#include "check.h"
#include "m40_chat_parse.h"

/* What the pieces add up to: content, reasoning, and the calls as "name(args);".
 * Incremental runs also join each call's TOOL_ARGS and check them against its
 * TOOL_CALL (bad_index counts any disorder). */
typedef struct {
    char content[4096];
    size_t nc;
    char reasoning[4096];
    size_t nr;
    char calls[4096];
    size_t ncalls_text;
    int ncalls;
    int bad_index;
    int incremental;
    int open;           /* a TOOL_BEGIN without its TOOL_CALL yet */
    int begun;          /* TOOL_BEGINs */
    char args[4096];    /* the open call's TOOL_ARGS joined */
    size_t na;
    char name[256];
} result;

static void app(char *dst, size_t *n, size_t cap, const char *s, size_t len)
{
    if (*n + len >= cap)
        len = cap - 1 - *n;
    memcpy(dst + *n, s, len);
    *n += len;
    dst[*n] = '\0';
}

static int collect(void *ud, const m40_piece *pc)
{
    result *r = ud;
    if (pc->kind == M40_PIECE_CONTENT) {
        app(r->content, &r->nc, sizeof r->content, pc->text, pc->len);
    } else if (pc->kind == M40_PIECE_REASONING) {
        app(r->reasoning, &r->nr, sizeof r->reasoning, pc->text, pc->len);
    } else if (pc->kind == M40_PIECE_TOOL_BEGIN) {
        if (!r->incremental || r->open || pc->index != r->begun || !pc->name || !pc->name[0])
            r->bad_index = 1;
        r->begun++;
        r->open = 1;
        r->na = 0;
        r->args[0] = '\0';
        snprintf(r->name, sizeof r->name, "%s", pc->name ? pc->name : "");
    } else if (pc->kind == M40_PIECE_TOOL_ARGS) {
        if (!r->incremental || !r->open || pc->index != r->begun - 1 || pc->len == 0)
            r->bad_index = 1;
        app(r->args, &r->na, sizeof r->args, pc->text, pc->len);
    } else {
        if (pc->index != r->ncalls)
            r->bad_index = 1;
        if (r->incremental && (!r->open || pc->index != r->begun - 1 || strcmp(r->args, pc->arguments) != 0 ||
                               strcmp(r->name, pc->name) != 0))
            r->bad_index = 1; /* the streamed call is not the call */
        r->open = 0;
        r->ncalls++;
        app(r->calls, &r->ncalls_text, sizeof r->calls, pc->name, strlen(pc->name));
        app(r->calls, &r->ncalls_text, sizeof r->calls, "(", 1);
        app(r->calls, &r->ncalls_text, sizeof r->calls, pc->arguments, strlen(pc->arguments));
        app(r->calls, &r->ncalls_text, sizeof r->calls, ");", 2);
    }
    return 0;
}

/* Feeds s in pieces of the given sizes (cycled; 0 means all at once). */
static int incremental_runs; /* run() asks for TOOL_BEGIN and TOOL_ARGS */

static void run(m40_tool_format f, m40_reasoning_mode m, int open, const char *s, size_t len, const size_t *sizes,
                int n_sizes, result *r)
{
    memset(r, 0, sizeof *r);
    m40_chat_parse *p = m40_chat_parse_new(f, m, open);
    r->incremental = incremental_runs;
    m40_chat_parse_incremental(p, incremental_runs);
    size_t i = 0;
    int k = 0;
    while (i < len) {
        size_t n = n_sizes ? sizes[k++ % n_sizes] : len;
        if (n == 0 || n > len - i)
            n = len - i;
        m40_chat_parse_feed(p, s + i, n, collect, r);
        i += n;
    }
    m40_chat_parse_finish(p, collect, r);
    if (m40_chat_parse_tool_calls(p) != r->ncalls || r->open || (r->incremental && r->begun != r->ncalls))
        r->bad_index = 1;
    m40_chat_parse_free(p);
}

static int same(const result *a, const result *b)
{
    return strcmp(a->content, b->content) == 0 && strcmp(a->reasoning, b->reasoning) == 0 &&
           strcmp(a->calls, b->calls) == 0 && a->ncalls == b->ncalls && !a->bad_index && !b->bad_index;
}

/* Checks one case whole, at every split point and byte by byte. */
static void expect(const char *what, m40_tool_format f, m40_reasoning_mode m, int open, const char *out,
                   const char *content, const char *reasoning, const char *calls)
{
    result whole, part;
    size_t len = strlen(out);
    run(f, m, open, out, len, NULL, 0, &whole);
    CHECK(strcmp(whole.content, content) == 0, "%s: content [%s], want [%s]", what, whole.content, content);
    CHECK(strcmp(whole.reasoning, reasoning) == 0, "%s: reasoning [%s], want [%s]", what, whole.reasoning,
          reasoning);
    CHECK(strcmp(whole.calls, calls) == 0, "%s: calls [%s], want [%s]", what, whole.calls, calls);
    CHECK(!whole.bad_index, "%s: call indexes", what);
    int split_ok = 1;
    for (size_t cut = 1; cut < len; cut++) {
        size_t sizes[2] = {cut, len};
        run(f, m, open, out, len, sizes, 2, &part);
        if (!same(&whole, &part)) {
            split_ok = 0;
            fprintf(stderr, "%s: split at %zu gives content [%s] reasoning [%s] calls [%s]\n", what, cut,
                    part.content, part.reasoning, part.calls);
            break;
        }
    }
    CHECK(split_ok, "%s: two-piece feeds agree with one", what);
    size_t one = 1;
    run(f, m, open, out, len, &one, 1, &part);
    CHECK(same(&whole, &part), "%s: byte-by-byte feed agrees (content [%s] calls [%s])", what, part.content,
          part.calls);
    /* streamed calls: the same, at every cut, their pieces in order and adding up */
    incremental_runs = 1;
    split_ok = 1;
    for (size_t cut = 0; cut < len; cut++) {
        size_t sizes[2] = {cut ? cut : 1, cut ? len : 1};
        run(f, m, open, out, len, sizes, 2, &part);
        if (!same(&whole, &part)) {
            split_ok = 0;
            fprintf(stderr, "%s: incremental, split at %zu: content [%s] calls [%s] bad %d\n", what, cut,
                    part.content, part.calls, part.bad_index);
            break;
        }
    }
    incremental_runs = 0;
    CHECK(split_ok, "%s: incremental feeds (two pieces, byte by byte) agree with one", what);
}

static void test_detect(void)
{
    CHECK(m40_tool_format_detect("{{ '<tool_call>' }}") == M40_TOOLS_HERMES, "hermes");
    CHECK(m40_tool_format_detect("[TOOL_CALLS] x") == M40_TOOLS_MISTRAL, "mistral");
    CHECK(m40_tool_format_detect("<|start_header_id|> \"parameters\"") == M40_TOOLS_LLAMA3, "llama3");
    CHECK(m40_tool_format_detect("<|python_tag|>") == M40_TOOLS_LLAMA3, "python_tag");
    CHECK(m40_tool_format_detect("{{ messages }}") == M40_TOOLS_JSON, "fallback");
    CHECK(m40_tool_format_detect(NULL) == M40_TOOLS_JSON, "no template");
    CHECK(m40_template_thinks("a <think> b") && !m40_template_thinks("nothing") && !m40_template_thinks(NULL),
          "thinks");
    CHECK(m40_tool_format_from_name("hermes", 6) == M40_TOOLS_HERMES && m40_tool_format_from_name("none", 4) == 0 &&
              m40_tool_format_from_name("herm", 4) == -1,
          "names");
    CHECK(strcmp(m40_tool_format_name(M40_TOOLS_MISTRAL), "mistral") == 0, "name of");
    CHECK(m40_tool_format_detect("{{ '<|start|>assistant<|channel|>final<|message|>' }} <tool_call>") ==
              M40_TOOLS_HARMONY,
          "harmony (before the others' words)");
    CHECK(m40_template_thinks("<|channel|>analysis"), "harmony thinks");
    CHECK(m40_tool_format_from_name("harmony", 7) == M40_TOOLS_HARMONY &&
              strcmp(m40_tool_format_name(M40_TOOLS_HARMONY), "harmony") == 0,
          "harmony name");
}

/* Our harmony-style template (tests/templates) is detected as harmony. */
static void test_detect_harmony_template(void)
{
    FILE *f = fopen("tests/templates/harmony-style.jinja", "rb");
    if (!f) {
        SKIP("tests/templates/harmony-style.jinja not found (run from the repository root)");
        return;
    }
    static char src[1 << 16];
    size_t n = fread(src, 1, sizeof src - 1, f);
    fclose(f);
    src[n] = '\0';
    CHECK(m40_tool_format_detect(src) == M40_TOOLS_HARMONY && m40_template_thinks(src), "harmony-style.jinja");
}

/* The shared real templates pick the parser their model family writes. */
static void test_detect_shared(void)
{
    static const struct {
        const char *file;
        m40_tool_format f;
        int thinks;
    } cases[] = {
        {"Qwen-Qwen2.5-7B-Instruct.jinja", M40_TOOLS_HERMES, 0},
        {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", M40_TOOLS_HERMES, 0},
        {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", M40_TOOLS_HERMES, 0},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", M40_TOOLS_LLAMA3, 0},
        {"meta-llama-Llama-3.2-3B-Instruct.jinja", M40_TOOLS_LLAMA3, 0},
        {"meta-llama-Llama-3.3-70B-Instruct.jinja", M40_TOOLS_LLAMA3, 0},
        {"mistralai-Mistral-Nemo-Instruct-2407.jinja", M40_TOOLS_MISTRAL, 0},
        {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", M40_TOOLS_JSON, 1},
        {"deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", M40_TOOLS_JSON, 1},
        {"google-gemma-2-2b-it.jinja", M40_TOOLS_JSON, 0},
    };
    const char *shared = check_shared_dir();
    if (!shared) {
        SKIP("../shared absent: template detection on real templates not checked");
        return;
    }
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/templates/%s", shared, cases[i].file);
        FILE *f = fopen(path, "rb");
        if (!f) {
            SKIP("%s not found", path);
            continue;
        }
        static char src[1 << 20];
        size_t n = fread(src, 1, sizeof src - 1, f);
        fclose(f);
        src[n] = '\0';
        CHECK(m40_tool_format_detect(src) == cases[i].f, "%s: %s", cases[i].file,
              m40_tool_format_name(m40_tool_format_detect(src)));
        CHECK(m40_template_thinks(src) == cases[i].thinks, "%s thinks", cases[i].file);
    }
}

static void test_hermes(void)
{
    const m40_tool_format H = M40_TOOLS_HERMES;
    const m40_reasoning_mode S = M40_REASONING_SEPARATE;
    expect("plain", H, S, 0, "Hello <b>world</b> <tool", "Hello <b>world</b> <tool", "", "");
    expect("one call", H, S, 0,
           "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>",
           "", "", "get_weather({\"city\":\"Paris\",\"days\":2});");
    expect("text then two calls", H, S, 0,
           "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n"
           "{\"name\": \"b\", \"arguments\": {\"x\": [1, {\"y\": \"</tool\"}]}}\n</tool_call>\n",
           "Let me check.\n", "", "a({});b({\"x\":[1,{\"y\":\"</tool\"}]});");
    expect("unclosed call at the end", H, S, 0, "<tool_call>{\"name\": \"f\", \"arguments\": {\"q\": 1}}", "", "",
           "f({\"q\":1});");
    expect("broken call is content", H, S, 0, "<tool_call>{\"name\": \"f\", \"arg</tool_call>",
           "<tool_call>{\"name\": \"f\", \"arg</tool_call>", "", "");
    expect("call without name is content", H, S, 0, "<tool_call>{\"arguments\": {}}</tool_call>",
           "<tool_call>{\"arguments\": {}}</tool_call>", "", "");
    expect("arguments as a JSON string", H, S, 0, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
           "", "", "f({\"a\":1});");
    expect("no arguments", H, S, 0, "<tool_call>{\"name\": \"f\"}</tool_call>", "", "", "f({});");
    expect("think then call", H, S, 0,
           "<think>\nI should call f.\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "",
           "\nI should call f.\n", "f({});");
    expect("tools off", M40_TOOLS_NONE, S, 0, "<tool_call>{\"name\": \"f\"}</tool_call>",
           "<tool_call>{\"name\": \"f\"}</tool_call>", "", "");
}

static void test_reasoning(void)
{
    const m40_tool_format N = M40_TOOLS_NONE;
    expect("qwen3 think", N, M40_REASONING_SEPARATE, 0, "<think>\nstep 1 < 2\n</think>\n\nThe answer is 3.",
           "The answer is 3.", "\nstep 1 < 2\n", "");
    expect("r1: prompt opened think", N, M40_REASONING_SEPARATE, 1, "hmm </thin k>\n</think>\n\nYes.", "Yes.",
           "hmm </thin k>\n", "");
    expect("unfinished thinking", N, M40_REASONING_SEPARATE, 1, "still thinking <", "", "still thinking <", "");
    expect("inline keeps tags", N, M40_REASONING_INLINE, 0, "<think>a</think>b", "<think>a</think>b", "", "");
    expect("none drops reasoning", N, M40_REASONING_NONE, 1, "a</think>  b", "b", "", "");
    expect("empty think (enable_thinking off)", N, M40_REASONING_SEPARATE, 0, "<think>\n\n</think>\n\nHi", "Hi",
           "\n\n", "");
}

static void test_llama3(void)
{
    const m40_tool_format L = M40_TOOLS_LLAMA3;
    const m40_reasoning_mode S = M40_REASONING_SEPARATE;
    expect("json call", L, S, 0, " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "", "",
           "get_weather({\"city\":\"Paris\"});");
    expect("two calls with ;", L, S, 0, "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"k\": true}}",
           "", "", "a({});b({\"k\":true});");
    expect("python_tag", L, S, 0, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}", "", "",
           "f({\"x\":1});");
    expect("text with braces", L, S, 0, "Use {x} here.", "Use {x} here.", "", "");
    expect("json that is no call", L, S, 0, "{\"answer\": 42}", "{\"answer\": 42}", "", "");
    expect("broken json", L, S, 0, "{\"name\": \"f\", \"parameters\": {", "{\"name\": \"f\", \"parameters\": {", "", "");
    expect("r1 distill (llama) thinking then call", L, S, 1, "ok</think>\n{\"name\": \"f\", \"parameters\": {}}", "",
           "ok", "f({});");
}

static void test_mistral(void)
{
    const m40_tool_format M = M40_TOOLS_MISTRAL;
    const m40_reasoning_mode S = M40_REASONING_SEPARATE;
    expect("array", M, S, 0,
           "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"q\": \"x\"}}, {\"name\": \"b\", \"arguments\": {}}]", "",
           "", "a({\"q\":\"x\"});b({});");
    expect("text before", M, S, 0, "Sure. [TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {}}]", "Sure. ", "",
           "a({});");
    expect("[ARGS] spelling", M, S, 0, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}", "", "",
           "get_weather({\"city\":\"Paris\"});");
    expect("garbage after marker", M, S, 0, "[TOOL_CALLS] nope", "[TOOL_CALLS] nope", "", "");
    expect("a [ that is text", M, S, 0, "[1, 2] [TOOL", "[1, 2] [TOOL", "", "");
}

static void test_json(void)
{
    const m40_tool_format J = M40_TOOLS_JSON;
    const m40_reasoning_mode S = M40_REASONING_SEPARATE;
    expect("object", J, S, 0, "{\"name\": \"f\", \"arguments\": {\"a\": \"\\u00e9\", \"b\": \"\xc3\xa9\"}}", "", "",
           "f({\"a\":\"\\u00e9\",\"b\":\"\xc3\xa9\"});"); /* strings as the model wrote them */
    expect("array", J, S, 0, "[{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"g\", \"parameters\": {}}]", "", "",
           "f({});g({});");
    expect("empty array is content", J, S, 0, "[]", "[]", "", "");
    expect("text", J, S, 0, "  Hello", "  Hello", "", "");
    expect("only blanks", J, S, 0, " \n", " \n", "", "");
}

/* gpt-oss harmony: the output starts right after the prompt's "<|start|>assistant". The
 * real tokenizer ends generation at <|return|> and <|call|> (absent then); a vocabulary
 * without those tokens writes them as text (present). */
static void test_harmony(void)
{
    const m40_tool_format X = M40_TOOLS_HARMONY;
    const m40_reasoning_mode S = M40_REASONING_SEPARATE;
    static const char A[] = "<|channel|>analysis<|message|>";
    static const char F[] = "<|start|>assistant<|channel|>final<|message|>";
    char buf[1024];
    snprintf(buf, sizeof buf, "%sThe user wants 2+2 < 5.<|end|>%sIt is 4.", A, F);
    expect("analysis then final", X, S, 0, buf, "It is 4.", "The user wants 2+2 < 5.", "");
    snprintf(buf, sizeof buf, "%sT<|end|>%sA<|return|>", A, F);
    expect("final with <|return|> as text", X, S, 0, buf, "A", "T", "");
    expect("none drops analysis", X, M40_REASONING_NONE, 0, buf, "A", "", "");
    expect("inline keeps analysis with its markup", X, M40_REASONING_INLINE, 0, buf,
           "<|channel|>analysis<|message|>T<|end|>A", "", "");
    expect("final only", X, S, 0, "<|channel|>final<|message|>Hi <|there", "Hi <|there", "", "");
    expect("call, recipient in the channel", X, S, 0,
           "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", "
           "\"days\": 2}<|call|>",
           "", "", "get_weather({\"city\":\"Paris\",\"days\":2});");
    snprintf(buf, sizeof buf,
             "%sNeed the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
             "<|constrain|>json<|message|>{\"city\":\"a<b\"}",
             A);
    expect("analysis then call ended by <|call|> as a token (absent)", X, S, 0, buf, "", "Need the weather.",
           "get_weather({\"city\":\"a<b\"});");
    expect("recipient before the channel (right after the prompt)", X, S, 0,
           " to=functions.now<|channel|>commentary json<|message|>{}<|call|>", "", "", "now({});");
    snprintf(buf, sizeof buf,
             "%sx<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{\"a\": [1]}<|call|>", A);
    expect("recipient in the role after <|start|>", X, S, 0, buf, "", "x", "f({\"a\":[1]});");
    expect("preamble then call", X, S, 0,
           "<|channel|>commentary<|message|>Checking the clock.<|end|><|start|>assistant<|channel|>commentary "
           "to=functions.now <|constrain|>json<|message|>{}",
           "Checking the clock.", "", "now({});");
    expect("two calls (text-form markers)", X, S, 0,
           "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{}<|call|><|start|>assistant<|channel|>"
           "commentary to=functions.b <|constrain|>json<|message|>{\"k\": true}<|call|>",
           "", "", "a({});b({\"k\":true});");
    expect("bad arguments are content with their markup", X, S, 0,
           "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops<|call|>",
           "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops<|call|>", "", "");
    expect("arguments not an object are content", X, S, 0,
           "<|channel|>commentary to=functions.f<|message|>[1]",
           "<|channel|>commentary to=functions.f<|message|>[1]", "", "");
    expect("a built-in tool's call is content", X, S, 0,
           "<|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"q\": 1}<|call|>",
           "<|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"q\": 1}<|call|>", "", "");
    expect("bad function name is content", X, S, 0, "<|channel|>commentary to=functions.a/b<|message|>{}",
           "<|channel|>commentary to=functions.a/b<|message|>{}", "", "");
    expect("unknown channel is content", X, S, 0, "<|channel|>secret<|message|>x<|end|>",
           "<|channel|>secret<|message|>x<|end|>", "", "");
    expect("another author's turn is content", X, S, 0,
           "<|start|>functions.f to=assistant<|channel|>commentary<|message|>\"r\"<|end|>",
           "<|start|>functions.f to=assistant<|channel|>commentary<|message|>\"r\"<|end|>", "", "");
    expect("plain text", X, S, 0, "Hello <|world|> to=x", "Hello <|world|> to=x", "", "");
    expect("text that starts like a recipient", X, S, 0, " tomorrow", " tomorrow", "", "");
    expect("header without <|message|>", X, S, 0, "<|channel|>final no message", "<|channel|>final no message", "",
           "");
    expect("header broken by an end marker", X, S, 0, "<|channel|>analysis<|end|>rest",
           "<|channel|>analysis<|end|>rest", "", "");
    expect("unfinished analysis (length)", X, S, 0, "<|channel|>analysis<|message|>still <|en", "", "still <|en",
           "");
    expect("stray end marker is kept", X, S, 0, "a<|end|>b", "a<|end|>b", "", "");
    char big[600];
    int n = snprintf(big, sizeof big, "<|channel|>");
    for (int i = 0; i < 300; i++)
        big[n++] = 'x';
    snprintf(big + n, sizeof big - (size_t)n, "<|message|>hi");
    expect("a header longer than any is content", X, S, 0, big, big, "", "");
}

/* s[0..n) without the blanks between JSON tokens (what a call's arguments are). */
static size_t minify(const char *s, size_t n, char *out)
{
    size_t k = 0;
    int in_str = 0, esc = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (in_str) {
            out[k++] = c;
            if (esc)
                esc = 0;
            else if (c == '\\')
                esc = 1;
            else if (c == '"')
                in_str = 0;
        } else if (c != ' ' && c != '\n' && c != '\t' && c != '\r') {
            out[k++] = c;
            in_str = c == '"';
        }
    }
    out[k] = '\0';
    return k;
}

/* A call's arguments stream as they are written: fed byte by byte, once the name and
 * two bytes of the arguments are in, the TOOL_ARGS so far are exactly the arguments
 * written so far (nothing waits for the call's end); the name comes first, once. */
static void expect_streaming(const char *what, m40_tool_format f, const char *out, const char *args_text,
                             const char *name)
{
    size_t len = strlen(out);
    const char *a = strstr(out, args_text);
    if (!a) {
        CHECK(0, "%s: bad case", what);
        return;
    }
    size_t from = (size_t)(a - out), to = from + strlen(args_text);
    char want[1024], final_args[1024];
    minify(args_text, strlen(args_text), final_args);
    result r;
    memset(&r, 0, sizeof r);
    r.incremental = 1;
    m40_chat_parse *p = m40_chat_parse_new(f, M40_REASONING_SEPARATE, 0);
    m40_chat_parse_incremental(p, 1);
    int lagged = 0, early = 0;
    for (size_t i = 0; i < len; i++) {
        m40_chat_parse_feed(p, out + i, 1, collect, &r);
        size_t fed = i + 1;
        if (fed <= from) {
            early += r.begun != 0;
            continue;
        }
        size_t w = minify(out + from, (fed < to ? fed : to) - from, want);
        /* a character's bytes come together: a fragment is always decodable */
        while (w > 0 && (unsigned char)want[w - 1] >= 0x80) {
            size_t k = w - 1;
            while (k > 0 && ((unsigned char)want[k] & 0xc0) == 0x80)
                k--;
            unsigned char lead = (unsigned char)want[k];
            size_t need = lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : 2;
            if (w - k < need)
                want[w = k] = '\0';
            break;
        }
        if (w >= 2 && (r.begun != 1 || strcmp(r.args, want) != 0 || strcmp(r.name, name) != 0)) {
            if (!lagged)
                fprintf(stderr, "%s: after %zu bytes streamed [%s], written [%s]\n", what, fed, r.args, want);
            lagged++;
        }
    }
    m40_chat_parse_finish(p, collect, &r);
    m40_chat_parse_free(p);
    CHECK(early == 0 && lagged == 0 && !r.bad_index && r.ncalls == 1 && strcmp(r.args, final_args) == 0,
          "%s: the arguments stream as written (%d early, %d behind, %d calls)", what, early, lagged, r.ncalls);
}

static void test_streaming(void)
{
    const char *args = "{\"city\": \"Paris\", \"days\": [1, 2.50, -3e+2], \"ok\": true, \"q\": {\"x\": null, "
                       "\"s\": \"a\\\"b\\u00e9 \\n \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"}}";
    char buf[1024];
    snprintf(buf, sizeof buf, "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": %s}\n</tool_call>", args);
    expect_streaming("hermes", M40_TOOLS_HERMES, buf, args, "get_weather");
    snprintf(buf, sizeof buf, "{\"name\": \"get_weather\", \"parameters\": %s}", args);
    expect_streaming("llama3 json", M40_TOOLS_LLAMA3, buf, args, "get_weather");
    snprintf(buf, sizeof buf, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": %s}", args);
    expect_streaming("llama3 python_tag", M40_TOOLS_LLAMA3, buf, args, "get_weather");
    snprintf(buf, sizeof buf, "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": %s, \"id\": \"abc123xyz\"}]",
             args);
    expect_streaming("mistral", M40_TOOLS_MISTRAL, buf, args, "get_weather");
    snprintf(buf, sizeof buf, "[TOOL_CALLS]get_weather[ARGS]%s", args);
    expect_streaming("mistral [ARGS]", M40_TOOLS_MISTRAL, buf, args, "get_weather");
    snprintf(buf, sizeof buf, "[{\"name\": \"get_weather\", \"arguments\": %s}]", args);
    expect_streaming("json fallback", M40_TOOLS_JSON, buf, args, "get_weather");
    snprintf(buf, sizeof buf,
             "<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant<|channel|>commentary "
             "to=functions.get_weather <|constrain|>json<|message|>%s<|call|>",
             args);
    expect_streaming("harmony", M40_TOOLS_HARMONY, buf, args, "get_weather");
}

/* Markup that turned out to be no call is not held to the block's end: fed byte by
 * byte, once `seen` bytes are in the content so far is `out`'s first `shown` bytes. */
static void expect_released(const char *what, m40_tool_format f, const char *out, size_t seen, size_t shown)
{
    result r;
    memset(&r, 0, sizeof r);
    m40_chat_parse *p = m40_chat_parse_new(f, M40_REASONING_SEPARATE, 0);
    for (size_t i = 0; i < seen; i++)
        m40_chat_parse_feed(p, out + i, 1, collect, &r);
    CHECK(r.nc == shown && memcmp(r.content, out, shown) == 0, "%s: after %zu bytes the content is [%s]", what, seen,
          r.content);
    m40_chat_parse_feed(p, out + seen, strlen(out) - seen, collect, &r);
    m40_chat_parse_finish(p, collect, &r);
    m40_chat_parse_free(p);
    CHECK(strcmp(r.content, out) == 0 && r.ncalls == 0, "%s: all content at the end [%s]", what, r.content);
}

static void test_released(void)
{
    const char *j = "{\"answer\": 42} and then a long explanation";
    expect_released("json answer", M40_TOOLS_JSON, j, strlen("{\"answer\": 42} and"), strlen("{\"answer\": 42} and"));
    expect_released("llama3 json answer", M40_TOOLS_LLAMA3, j, strlen("{\"answer\": 42}"), strlen("{\"answer\": 42}"));
    const char *h = "<tool_call>oops, no JSON here</tool_call> bye";
    expect_released("hermes no JSON", M40_TOOLS_HERMES, h, strlen("<tool_call>oops, no"),
                    strlen("<tool_call>oops, no"));
    const char *m = "[TOOL_CALLS] nope, just text";
    expect_released("mistral no call", M40_TOOLS_MISTRAL, m, strlen("[TOOL_CALLS] nope, just"),
                    strlen("[TOOL_CALLS] nope, just"));
    const char *x = "<|channel|>commentary to=functions.f<|message|>not json at all";
    expect_released("harmony no object", M40_TOOLS_HARMONY, x, strlen(x) - 3, strlen(x) - 3);
}

/* What streaming changed: a call is decided at its start, so later trouble cuts it
 * short instead of turning it into content; numbers and strings are the model's. */
static void test_calls_cut_short(void)
{
    const m40_reasoning_mode S = M40_REASONING_SEPARATE;
    expect("max_tokens inside the arguments", M40_TOOLS_HERMES, S, 0,
           "<tool_call>{\"name\": \"f\", \"arguments\": {\"q\": \"Par", "", "", "f({\"q\":\"Par);");
    expect("broken inside the arguments", M40_TOOLS_HERMES, S, 0,
           "<tool_call>{\"name\": \"f\", \"arguments\": {\"q\": 1,, }}</tool_call>after", "after", "",
           "f({\"q\":1,);"); /* as far as it was valid */
    expect("junk after the call's object is dropped", M40_TOOLS_HERMES, S, 0,
           "<tool_call>{\"name\": \"f\", \"arguments\": {}}}\n</tool_call>", "", "", "f({});");
    expect("second object no call: dropped", M40_TOOLS_HERMES, S, 0,
           "<tool_call>{\"name\": \"f\", \"arguments\": {}} {\"x\": 1}</tool_call>", "", "", "f({});");
    expect("name after the arguments", M40_TOOLS_HERMES, S, 0,
           "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>", "", "", "f({\"a\":1});");
    expect("name with an escape", M40_TOOLS_HERMES, S, 0,
           "<tool_call>{\"name\": \"g\\u0065t\", \"arguments\": {}}</tool_call>", "", "", "get({});");
    expect("name not a string", M40_TOOLS_HERMES, S, 0, "<tool_call>{\"name\": 1, \"arguments\": {}}</tool_call>",
           "<tool_call>{\"name\": 1, \"arguments\": {}}</tool_call>", "", "");
    expect("arguments an array", M40_TOOLS_HERMES, S, 0, "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
           "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>", "", "");
    expect("arguments null", M40_TOOLS_HERMES, S, 0, "<tool_call>{\"name\": \"f\", \"arguments\": null}</tool_call>",
           "", "", "f({});");
    expect("numbers as written", M40_TOOLS_JSON, S, 0,
           "{\"name\": \"f\", \"arguments\": {\"a\": 1.0, \"b\": 1e5, \"c\": 12345678901234567890}}", "", "",
           "f({\"a\":1.0,\"b\":1e5,\"c\":12345678901234567890});");
    expect("text after llama3 calls is content", M40_TOOLS_LLAMA3, S, 0,
           "{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {\"k\": 1}}\nDone.",
           "Done.", "", "f({});g({\"k\":1});");
    expect("mistral: several [ARGS] calls", M40_TOOLS_MISTRAL, S, 0,
           "[TOOL_CALLS]a[ARGS]{\"x\": 1}[TOOL_CALLS]b[ARGS]{}", "", "", "a({\"x\":1});b({});");
    expect("mistral: [ARGS] not an object", M40_TOOLS_MISTRAL, S, 0, "[TOOL_CALLS]a[ARGS]1",
           "[TOOL_CALLS]a[ARGS]1", "", "");
    expect("harmony: cut inside the arguments", M40_TOOLS_HARMONY, S, 0,
           "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": [1, ", "", "", "f({\"a\":[1,);");
    expect("harmony: junk after the object is dropped", M40_TOOLS_HARMONY, S, 0,
           "<|channel|>commentary to=functions.f<|message|>{} x<|call|><|start|>assistant<|channel|>final<|message|>ok",
           "ok", "", "f({});");
    char deep[200];
    memset(deep, '[', 150);
    deep[150] = '\0';
    expect("nesting deeper than the reader's stack is no call", M40_TOOLS_JSON, S, 0, deep, deep, "", "");
}

/* Random bytes and random marker soup at random chunkings: no crash, every piece is
 * reported with sane fields, and with everything off the content is the input. */
static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static int sane(void *ud, const m40_piece *pc)
{
    int *bad = ud;
    if (pc->kind == M40_PIECE_TOOL_CALL) {
        if (!pc->name || !pc->arguments || !pc->name[0] || pc->arguments[0] != '{')
            (*bad)++;
    } else if (pc->kind != M40_PIECE_CONTENT && pc->kind != M40_PIECE_REASONING) {
        (*bad)++;
    } else if (pc->len == 0 || !pc->text) {
        (*bad)++;
    }
    return 0;
}

/* A random JSON value (objects and arrays nest to depth 3) appended at *n. */
static void gen_value(char *b, size_t *n, size_t cap, int depth)
{
    static const char *const scalars[] = {"0", "-12", "3.25", "1e-7", "true", "false", "null", "\"\"",
                                          "\"Paris\"", "\"a\\\"b\"", "\"\\u00e9\\n\"", "\"\xc3\xa9\xe2\x82\xac\"",
                                          "\"x y\""};
    if (*n + 64 > cap)
        return;
    uint32_t r = rnd() % 8;
    if (depth < 3 && r < 3) {
        int k = (int)(rnd() % 4), obj = r < 2;
        b[(*n)++] = obj ? '{' : '[';
        for (int i = 0; i < k && *n + 64 < cap; i++) {
            if (i)
                *n += (size_t)snprintf(b + *n, cap - *n, rnd() & 1 ? ", " : ",");
            if (obj)
                *n += (size_t)snprintf(b + *n, cap - *n, "\"k%d\":%s", i, rnd() & 1 ? " " : "");
            gen_value(b, n, cap, depth + 1);
        }
        b[(*n)++] = obj ? '}' : ']';
    } else {
        *n += (size_t)snprintf(b + *n, cap - *n, "%s", scalars[rnd() % (sizeof scalars / sizeof *scalars)]);
    }
    b[*n] = '\0';
}

/* A model's answer with calls in format f: text, calls with random arguments, text;
 * sometimes cut short or with a byte changed (*intact 0). Returns its length; want
 * gets the calls as result.calls spells them. */
static size_t gen_calls(m40_tool_format f, char *b, size_t cap, char *want, size_t want_cap, int *intact)
{
    size_t n = 0, w = 0, a0;
    want[0] = '\0';
    int calls = 1 + (int)(rnd() % 3);
    if (f == M40_TOOLS_HERMES && rnd() % 2)
        n += (size_t)snprintf(b, cap, "Let me see.\n");
    if (f == M40_TOOLS_MISTRAL)
        n += (size_t)snprintf(b + n, cap - n, "[TOOL_CALLS]%s", rnd() % 2 ? "[" : "");
    if (f == M40_TOOLS_LLAMA3 && rnd() % 2)
        n += (size_t)snprintf(b + n, cap - n, "<|python_tag|>");
    if (f == M40_TOOLS_JSON && calls > 1)
        n += (size_t)snprintf(b + n, cap - n, "[");
    int mistral_array = f == M40_TOOLS_MISTRAL && b[n - 1] == '[';
    for (int c = 0; c < calls && n + 200 < cap; c++) {
        if (f == M40_TOOLS_HARMONY) {
            n += (size_t)snprintf(b + n, cap - n, "%s<|channel|>commentary to=functions.f%d <|constrain|>json<|message|>",
                                  c ? "<|start|>assistant" : "", c);
            a0 = n;
            b[n++] = '{';
            n += (size_t)snprintf(b + n, cap - n, "\"a\": ");
            gen_value(b, &n, cap, 1);
            b[n++] = '}';
            w += (size_t)snprintf(want + w, want_cap - w, "f%d(", c);
            w += minify(b + a0, n - a0, want + w);
            w += (size_t)snprintf(want + w, want_cap - w, ");");
            n += (size_t)snprintf(b + n, cap - n, "<|call|>");
            continue;
        }
        if (f == M40_TOOLS_HERMES)
            n += (size_t)snprintf(b + n, cap - n, "<tool_call>\n");
        else if (c && f == M40_TOOLS_LLAMA3)
            n += (size_t)snprintf(b + n, cap - n, "; ");
        else if (c && (f == M40_TOOLS_JSON || mistral_array))
            n += (size_t)snprintf(b + n, cap - n, ", ");
        else if (c && f == M40_TOOLS_MISTRAL)
            n += (size_t)snprintf(b + n, cap - n, "[TOOL_CALLS]");
        if (f == M40_TOOLS_MISTRAL && !mistral_array) {
            n += (size_t)snprintf(b + n, cap - n, "f%d[ARGS]{\"a\": ", c);
        } else {
            n += (size_t)snprintf(b + n, cap - n, "{\"name\": \"f%d\", \"%s\": {\"a\": ", c,
                                  f == M40_TOOLS_LLAMA3 ? "parameters" : "arguments");
        }
        a0 = n;
        gen_value(b, &n, cap, 1);
        w += (size_t)snprintf(want + w, want_cap - w, "f%d({\"a\":", c);
        w += minify(b + a0, n - a0, want + w);
        w += (size_t)snprintf(want + w, want_cap - w, "});");
        n += (size_t)snprintf(b + n, cap - n, "}%s", f == M40_TOOLS_MISTRAL && !mistral_array ? "" : "}");
        if (f == M40_TOOLS_HERMES)
            n += (size_t)snprintf(b + n, cap - n, "\n</tool_call>\n");
    }
    if (f == M40_TOOLS_JSON && calls > 1)
        n += (size_t)snprintf(b + n, cap - n, "]");
    if (mistral_array)
        n += (size_t)snprintf(b + n, cap - n, "]");
    if (rnd() % 3 == 0 && n + 20 < cap)
        n += (size_t)snprintf(b + n, cap - n, "%s", f == M40_TOOLS_HARMONY ? "<|start|>assistant<|channel|>final<|message|>ok" : "\nDone.");
    uint32_t r = rnd() % 4;
    *intact = r > 1;
    if (r == 0)
        n = rnd() % (n + 1); /* max_tokens */
    else if (r == 1)
        b[rnd() % n] = "{}[]\",:x \\<"[rnd() % 12]; /* a model's slip */
    return n;
}

static void test_fuzz(void)
{
    static const char *const bits[] = {"<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]",
                                       "<|python_tag|>", "{", "}", "[", "]", "\"name\"", ":", "\"f\"", ",",
                                       "\"arguments\"", "{}", "\"parameters\"", " ", "\n", ";", "[ARGS]", "<", "\"",
                                       "\\", "x", "\xff", "\xc3\xa9", "1", "<|start|>", "assistant",
                                       "<|channel|>", "analysis", "final", "commentary", " to=functions.f",
                                       "<|constrain|>json", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                                       /* the call reader's states: numbers, literals, escapes, names */
                                       "\"name\": \"f\", \"arguments\": {", "true", "nul", "l", "-", "0",
                                       "1.5e-3", "e", ".", "\\u00e9", "\\n", "\\", "\t", "\xe2\x82", "\xac",
                                       "{\"name\": \"g\", \"parameters\": ", "get_weather[ARGS]"};
    int bad = 0, identity_bad = 0, harmony_split_bad = 0, calls_bad = 0, calls_checked = 0;
    char buf[1200];
    for (int iter = 0; iter < 6000; iter++) {
        size_t len = 0;
        int n = (int)(rnd() % 40);
        if (iter % 4 == 3) {
            /* calls as models write them: with the format's parser, intact ones are read
             * exactly (arguments = their text without blanks), whatever the chunking */
            char want[1200];
            int intact;
            m40_tool_format gf = (m40_tool_format)(1 + iter / 4 % M40_TOOLS_HARMONY);
            len = gen_calls(gf, buf, sizeof buf, want, sizeof want, &intact);
            if (intact) {
                result r;
                size_t cs[2] = {1 + rnd() % 4, 1 + rnd() % 9};
                incremental_runs = 1;
                run(gf, M40_REASONING_SEPARATE, 0, buf, len, cs, 2, &r);
                incremental_runs = 0;
                if (strcmp(r.calls, want) != 0 || r.bad_index) {
                    if (!calls_bad)
                        fprintf(stderr, "format %d: [%.*s]\ncalls [%s]\nwant  [%s]\n", (int)gf, (int)len, buf, r.calls,
                                want);
                    calls_bad++;
                }
                calls_checked++;
            }
        }
        for (int k = 0; k < n && len < sizeof buf - 40 && iter % 4 != 3; k++) {
            if (iter % 3 == 0) {
                buf[len++] = (char)(rnd() & 0xff);
            } else {
                const char *b = bits[rnd() % (sizeof bits / sizeof *bits)];
                memcpy(buf + len, b, strlen(b));
                len += strlen(b);
            }
        }
        for (int f = 0; f <= M40_TOOLS_HARMONY; f++) {
            for (int m = 0; m <= M40_REASONING_NONE; m++) {
                m40_chat_parse *p = m40_chat_parse_new((m40_tool_format)f, (m40_reasoning_mode)m, (int)(rnd() & 1));
                size_t i = 0;
                while (i < len) {
                    size_t c = 1 + rnd() % 7;
                    if (c > len - i)
                        c = len - i;
                    m40_chat_parse_feed(p, buf + i, c, sane, &bad);
                    i += c;
                }
                m40_chat_parse_finish(p, sane, &bad);
                m40_chat_parse_free(p);
            }
        }
        /* any chunking agrees, and streamed calls add up to the calls (every format) */
        for (int f = 1; f <= M40_TOOLS_HARMONY; f++) {
            for (int m = 0; m <= M40_REASONING_NONE; m++) {
                result whole, part;
                size_t cs[3] = {1 + rnd() % 5, 1 + rnd() % 13, 1};
                int open = (int)(rnd() & 1);
                run((m40_tool_format)f, (m40_reasoning_mode)m, open, buf, len, NULL, 0, &whole);
                incremental_runs = 1;
                run((m40_tool_format)f, (m40_reasoning_mode)m, open, buf, len, cs, 3, &part);
                incremental_runs = 0;
                if (!same(&whole, &part)) {
                    if (!harmony_split_bad) {
                        fprintf(stderr, "format %d mode %d open %d sizes %zu %zu: [", f, m, open, cs[0], cs[1]);
                        fwrite(buf, 1, len, stderr);
                        fprintf(stderr, "]\nwhole [%s][%s][%s] part [%s][%s][%s] bad %d\n", whole.content,
                                whole.reasoning, whole.calls, part.content, part.reasoning, part.calls,
                                part.bad_index);
                    }
                    harmony_split_bad++;
                }
            }
        }
        result r;
        size_t sizes[3] = {1 + rnd() % 5, 1 + rnd() % 9, 1};
        run(M40_TOOLS_NONE, M40_REASONING_INLINE, 0, buf, len, sizes, 3, &r);
        if (r.nc != len || memcmp(r.content, buf, len) != 0)
            identity_bad++;
    }
    CHECK(bad == 0, "%d malformed pieces", bad);
    CHECK(harmony_split_bad == 0, "%d outputs parsed differently when chunked (or streamed calls not the calls)",
          harmony_split_bad);
    CHECK(calls_bad == 0 && calls_checked > 500, "%d of %d well-formed generated outputs' calls misread", calls_bad,
          calls_checked);
    CHECK(identity_bad == 0, "%d outputs not passed through unchanged with parsing off", identity_bad);
}

int main(void)
{
    test_detect();
    test_detect_shared();
    test_hermes();
    test_reasoning();
    test_llama3();
    test_mistral();
    test_json();
    test_detect_harmony_template();
    test_harmony();
    test_streaming();
    test_released();
    test_calls_cut_short();
    test_fuzz();
    return check_done();
}
