/* Constrained decoding through the engine's public API on the CPU (stories260K): outputs
 * under a GBNF grammar, a JSON Schema and json_object are sentences of their grammars at
 * temperature 1 over many seeds, 4 sequences at once; a grammar that is complete ends the
 * sequence (finish stop) even with ignore_eos; bad grammars and schemas are 400 ERROR
 * events naming the problem; two constraints at once are refused at submit.
 * Forced tool calls (tool_choice required/named): in each parser's markup the output
 * parser finds only calls of the given tools, each one's arguments valid, one call
 * unless parallel calls are allowed (harmony: always one); tools' $defs are hoisted
 * (clashing names are a 400; harmony compiles each tool's parameters apart). count_only ends after tokenizing; DONE names the stop string that matched. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "engine_jobs.h"
#include "grammar/grammar.h"
#include "m40_chat_parse.h"

#include <jansson.h>

static m40_engine *start(const char *path)
{
    m40_engine_config cfg = {.model_path = path, .model_name = "stories", .device = -1, .ctx_size = 512,
                             .max_seqs = 4, .max_queue = 64, .n_threads = 2};
    m40_engine *e = NULL;
    char err[256];
    if (m40_engine_create(&cfg, &e, err, sizeof err) != 0) {
        fprintf(stderr, "create: %s\n", err);
        return NULL;
    }
    double end = now_s() + 60;
    while (m40_engine_get_state(e, err, sizeof err) == M40_ENGINE_LOADING && now_s() < end)
        usleep(10000);
    return e;
}

static void params(m40_request_params *p, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    p->prompt = "Once upon a time";
    p->prompt_len = strlen(p->prompt);
    p->max_tokens = 300;
    m40_sampler_params_default(&p->sampling);
    p->sampling.temperature = 1.0f;
    p->sampling.seed = seed;
}

/* Runs n requests (4 at a time in the engine) and checks each output against gbnf. */
static void run_batch(m40_engine *e, m40_request_params *p, const char *gbnf, int n, const char *what)
{
    char err[256];
    m40_grammar *g = m40_grammar_parse(gbnf, strlen(gbnf), err, sizeof err);
    CHECK(g != NULL, "%s: %s", what, err);
    if (!g)
        return;
    m40_gmatch *m = m40_gmatch_new(g);
    job *jobs = calloc((size_t)n, sizeof *jobs);
    job **jp = calloc((size_t)n, sizeof *jp);
    for (int i = 0; i < n; i++) {
        jp[i] = &jobs[i];
        p->sampling.seed = 1000 + (uint64_t)i;
        int st = m40_engine_submit(e, p, &jobs[i], &jobs[i].req, err, sizeof err);
        CHECK(st == M40_SUBMIT_OK, "%s submit: %s", what, err);
    }
    CHECK(pump(e, jp, n, 120) == 0, "%s: timeout", what);
    int ok = 0;
    for (int i = 0; i < n; i++) {
        if (jobs[i].finish == M40_FINISH_STOP) {
            CHECK(m40_gmatch_full(m, jobs[i].text, jobs[i].len), "%s seed %d: '%s' is no sentence", what, i,
                  jobs[i].text);
            ok++;
        } else {
            CHECK(jobs[i].finish == M40_FINISH_LENGTH && !jobs[i].err_status, "%s seed %d: finish %d err %s", what,
                  i, (int)jobs[i].finish, jobs[i].err_msg);
        }
        m40_request_release(jobs[i].req);
    }
    CHECK(ok > n / 2, "%s: only %d of %d complete", what, ok, n);
    free(jobs);
    free(jp);
    m40_gmatch_free(m);
    m40_grammar_free(g);
}

static void expect_400(m40_engine *e, m40_request_params *p, const char *needle)
{
    job j;
    memset(&j, 0, sizeof j);
    char err[256];
    job *jp = &j;
    CHECK(m40_engine_submit(e, p, &j, &j.req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
    CHECK(pump(e, &jp, 1, 30) == 0, "timeout");
    CHECK(j.err_status == 400 && strstr(j.err_msg, needle), "want 400 with '%s', got %d '%s'", needle, j.err_status,
          j.err_msg);
    m40_request_release(j.req);
}


/* What the output parser makes of a forced output. */
typedef struct {
    int calls, bad, content;
} call_check;

static int check_piece(void *ud, const m40_piece *pc)
{
    call_check *c = ud;
    if (pc->kind != M40_PIECE_TOOL_CALL) {
        for (size_t i = 0; i < pc->len; i++)
            if (pc->text[i] != ' ' && pc->text[i] != '\n')
                c->content = 1;
        return 0;
    }
    c->calls++;
    json_t *a = json_loads(pc->arguments, 0, NULL);
    if (!strcmp(pc->name, "f")) {
        json_t *n = json_object_get(a, "n");
        c->bad += !(json_is_integer(n) && json_integer_value(n) >= 0 && json_integer_value(n) <= 9 &&
                    json_object_size(a) == 1);
    } else if (!strcmp(pc->name, "g")) {
        json_t *d = json_object_get(a, "d");
        c->bad += !(json_is_boolean(json_object_get(a, "b")) && json_is_integer(d) &&
                    (json_integer_value(d) == 1 || json_integer_value(d) == 2));
    } else {
        c->bad++;
    }
    json_decref(a);
    return 0;
}

static const char *const TOOLS_JSON =
    "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\",\"properties\":"
    "{\"n\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":9}},\"required\":[\"n\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"g\",\"parameters\":{\"type\":\"object\",\"$defs\":{\"two\":"
    "{\"enum\":[1,2]}},\"properties\":{\"b\":{\"type\":\"boolean\"},\"d\":{\"$ref\":\"#/$defs/two\"}},"
    "\"required\":[\"b\",\"d\"],\"additionalProperties\":false}}}]";

static void chat_params(m40_request_params *p, json_t *msgs, json_t *tools)
{
    memset(p, 0, sizeof *p);
    p->messages = msgs;
    p->tools = tools;
    p->add_generation_prompt = 1;
    p->max_tokens = 300;
    m40_sampler_params_default(&p->sampling);
    p->sampling.temperature = 1.0f;
}

static void forced_calls(m40_engine *e, json_t *msgs, json_t *tools, m40_tool_format fmt, int parallel, int greedy)
{
    enum { N = 6 };
    job jobs[N];
    job *jp[N];
    char err[256];
    m40_request_params p;
    chat_params(&p, msgs, tools);
    p.tool_call_format = fmt;
    p.tool_call_parallel = parallel;
    if (greedy)
        p.sampling.temperature = 0.0f; /* the model's own argmax path is not for constrained rows */
    memset(jobs, 0, sizeof jobs);
    for (int i = 0; i < N; i++) {
        jp[i] = &jobs[i];
        p.sampling.seed = 77 + (uint64_t)i;
        CHECK(m40_engine_submit(e, &p, &jobs[i], &jobs[i].req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
    }
    CHECK(pump(e, jp, N, 120) == 0, "forced %s: timeout", m40_tool_format_name(fmt));
    int stopped = 0;
    for (int i = 0; i < N; i++) {
        CHECK(!jobs[i].err_status, "forced %s: %s", m40_tool_format_name(fmt), jobs[i].err_msg);
        /* more calls may follow with parallel ones, up to max_tokens; one call always ends */
        CHECK(jobs[i].finish == M40_FINISH_STOP || (parallel && jobs[i].finish == M40_FINISH_LENGTH),
              "forced %s seed %d: finish %d '%s'", m40_tool_format_name(fmt), i, (int)jobs[i].finish, jobs[i].text);
        if (jobs[i].finish == M40_FINISH_STOP) {
            stopped++;
            call_check c = {0};
            m40_chat_parse *cp = m40_chat_parse_new(fmt, M40_REASONING_INLINE, 0);
            m40_chat_parse_feed(cp, jobs[i].text, jobs[i].len, check_piece, &c);
            m40_chat_parse_finish(cp, check_piece, &c);
            m40_chat_parse_free(cp);
            CHECK(c.calls >= 1 && (parallel || c.calls == 1) && !c.bad && !c.content,
                  "forced %s seed %d: %d calls, %d bad, content %d in '%s'", m40_tool_format_name(fmt), i, c.calls,
                  c.bad, c.content, jobs[i].text);
        }
        m40_request_release(jobs[i].req);
    }
    CHECK(stopped > N / 2, "forced %s: only %d of %d complete", m40_tool_format_name(fmt), stopped, N);
}

/* The step's helper threads (M40_PICK_THREADS, scheduler.c: the grammar masks while the
 * forward pass runs, then every row's pick; on by default on a GPU engine, asked for here
 * on the CPU): constrained and free rows mixed, the texts are those of the serial engine
 * (each request samples from its own seed; this model's logits do not depend on what
 * else is in the batch), and each constrained one is a sentence of its grammar. */
static void pick_threads_same(const char *path, const char *schema, const char *schema_gbnf)
{
    enum { NJ = 12 };
    static job jobs[2][NJ];
    const char *gbnf = "root ::= \"The \" (\"cat\" | \"dog\" | [a-z]{1,6}) \" is \" [0-9]{1,3} \".\"";
    char err[256];
    for (int v = 0; v < 2; v++) {
        if (v)
            setenv("M40_PICK_THREADS", "3", 1);
        else
            unsetenv("M40_PICK_THREADS");
        m40_engine *e = start(path);
        unsetenv("M40_PICK_THREADS");
        CHECK(e != NULL, "engine (pick threads %d)", v ? 3 : 0);
        if (!e)
            return;
        job *jp[NJ];
        for (int i = 0; i < NJ; i++) {
            m40_request_params p;
            params(&p, 1);
            p.sampling.seed = 77 + (uint64_t)i;
            p.max_tokens = 60;
            if (i % 3 == 0)
                p.grammar = gbnf;
            else if (i % 3 == 1)
                p.json_schema = schema;
            memset(&jobs[v][i], 0, sizeof jobs[v][i]);
            jp[i] = &jobs[v][i];
            CHECK(m40_engine_submit(e, &p, jp[i], &jp[i]->req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
        }
        CHECK(pump(e, jp, NJ, 120) == 0, "pick threads %d: timeout", v ? 3 : 0);
        for (int i = 0; i < NJ; i++)
            m40_request_release(jobs[v][i].req);
        m40_engine_destroy(e);
    }
    m40_grammar *g1 = m40_grammar_parse(gbnf, strlen(gbnf), err, sizeof err);
    m40_grammar *g2 = schema_gbnf ? m40_grammar_parse(schema_gbnf, strlen(schema_gbnf), err, sizeof err) : NULL;
    m40_gmatch *m1 = g1 ? m40_gmatch_new(g1) : NULL, *m2 = g2 ? m40_gmatch_new(g2) : NULL;
    int same = 0, valid = 0, constrained = 0;
    for (int i = 0; i < NJ; i++) {
        const job *a = &jobs[0][i], *b = &jobs[1][i];
        same += a->len == b->len && !memcmp(a->text, b->text, a->len) && a->finish == b->finish;
        if (i % 3 < 2 && b->finish == M40_FINISH_STOP) {
            constrained++;
            valid += m40_gmatch_full(i % 3 == 0 ? m1 : m2, b->text, b->len);
        }
    }
    printf("pick threads: %d of %d texts equal to the serial engine's; %d of %d complete constrained ones valid\n",
           same, NJ, valid, constrained);
    CHECK(same == NJ, "pick threads: %d of %d texts equal to the serial engine's", same, NJ);
    CHECK(m1 && m2 && constrained >= 4 && valid == constrained, "pick threads: %d of %d constrained texts valid", valid,
          constrained);
    m40_gmatch_free(m1);
    m40_gmatch_free(m2);
    m40_grammar_free(g1);
    m40_grammar_free(g2);
}

int main(void)
{
    char path[4096];
    if (!check_shared_file("models/stories260K.gguf", path, sizeof path)) {
        SKIP("../shared/models/stories260K.gguf is absent");
        return check_done();
    }
    m40_engine *e = start(path);
    CHECK(e != NULL, "engine");
    if (!e)
        return check_done();
    m40_request_params p;

    const char *gbnf = "root ::= \"The \" (\"cat\" | \"dog\" | [a-z]{1,6}) \" is \" [0-9]{1,3} \".\"";
    params(&p, 1);
    p.grammar = gbnf;
    run_batch(e, &p, gbnf, 12, "gbnf");
    p.ignore_eos = 1; /* a complete grammar still ends the output */
    run_batch(e, &p, gbnf, 4, "gbnf ignore_eos");

    /* a grammar that starts with a space: the text keeps it (no SentencePiece stripping) */
    const char *spaced = "root ::= \" The\" [a-z ]{1,12} \".\"";
    params(&p, 1);
    p.grammar = spaced;
    run_batch(e, &p, spaced, 8, "leading space");

    const char *schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":99},"
                         "\"b\":{\"enum\":[\"x\",\"y\"]},\"c\":{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},"
                         "\"maxItems\":3}},\"required\":[\"a\",\"b\",\"c\"],\"additionalProperties\":false}";
    char err[256];
    char *schema_gbnf = m40_json_schema_to_gbnf(schema, strlen(schema), err, sizeof err);
    CHECK(schema_gbnf != NULL, "%s", err);
    params(&p, 1);
    p.json_schema = schema;
    if (schema_gbnf)
        run_batch(e, &p, schema_gbnf, 12, "json_schema");
    pick_threads_same(path, schema, schema_gbnf);
    free(schema_gbnf);

    params(&p, 1);
    p.json_object = 1;
    p.max_tokens = 400;
    char *obj_gbnf = m40_json_schema_to_gbnf(NULL, 0, err, sizeof err);
    if (obj_gbnf) { /* an unbounded object may meet max_tokens: run_batch allows "length" */
        job j;
        memset(&j, 0, sizeof j);
        job *jp = &j;
        p.sampling.seed = 5;
        CHECK(m40_engine_submit(e, &p, &j, &j.req, err, sizeof err) == M40_SUBMIT_OK, "submit");
        CHECK(pump(e, &jp, 1, 60) == 0, "timeout");
        CHECK(j.len > 0 && j.text[0] == '{', "json_object output '%s'", j.text);
        m40_request_release(j.req);
    }
    free(obj_gbnf);

    params(&p, 1);
    p.grammar = "root ::= \"a\" | missing";
    expect_400(e, &p, "'missing' is used but not defined");
    params(&p, 1);
    p.json_schema = "{\"type\":\"string\",\"not\":{}}";
    expect_400(e, &p, "unsupported JSON Schema keyword 'not'");
    params(&p, 1);
    p.grammar = "root ::= a0\na0 ::= a1 | a1\na1 ::= a2 | a2\na2 ::= a3 | a3\na3 ::= a4 | a4\na4 ::= a5 | a5\n"
                "a5 ::= a6 | a6\na6 ::= a7 | a7\na7 ::= a8 | a8\na8 ::= a9 | a9\na9 ::= a10 | a10\n"
                "a10 ::= a11 | a11\na11 ::= a12 | a12\na12 ::= a13 | a13\na13 ::= a14 | a14\na14 ::= a15 | a15\n"
                "a15 ::= a16 | a16\na16 ::= a17 | a17\na17 ::= \"y\"";
    expect_400(e, &p, "ambiguous");
    params(&p, 1);
    p.json_schema = "{\"type\": ";
    expect_400(e, &p, "not valid JSON");

    params(&p, 1);
    p.grammar = "root ::= \"a\"";
    p.json_object = 1;
    job j;
    CHECK(m40_engine_submit(e, &p, &j, &j.req, err, sizeof err) == M40_SUBMIT_INVALID && strstr(err, "at most one"),
          "two constraints: %s", err);


    /* forced tool calls in each parser's markup, one call and parallel ones */
    json_t *msgs = json_loads("[{\"role\":\"user\",\"content\":\"Call a tool\"}]", 0, NULL);
    json_t *tools = json_loads(TOOLS_JSON, 0, NULL);
    CHECK(msgs && tools, "test JSON");
    static const m40_tool_format fmts[] = {M40_TOOLS_HERMES, M40_TOOLS_LLAMA3, M40_TOOLS_MISTRAL, M40_TOOLS_JSON,
                                           M40_TOOLS_HARMONY};
    for (int f = 0; f < 5; f++)
        for (int par = 0; par < 2; par++)
            forced_calls(e, msgs, tools, fmts[f], par, 0);
    forced_calls(e, msgs, tools, M40_TOOLS_HERMES, 0, 1);
    forced_calls(e, msgs, tools, M40_TOOLS_HARMONY, 0, 1);

    /* two tools' $defs of one name: 400; a keyword the compiler lacks: 400 naming it */
    json_t *clash = json_loads(TOOLS_JSON, 0, NULL);
    json_object_set_new(json_object_get(json_object_get(json_array_get(clash, 0), "function"), "parameters"), "$defs",
                        json_pack("{s:{s:[i]}}", "two", "enum", 3));
    m40_request_params tp;
    chat_params(&tp, msgs, clash);
    tp.tool_call_format = M40_TOOLS_HERMES;
    expect_400(e, &tp, "$defs");
    json_decref(clash);
    json_t *unsup = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"h\",\"parameters\":"
                               "{\"type\":\"object\",\"not\":{}}}}]", 0, NULL);
    chat_params(&tp, msgs, unsup);
    tp.tool_call_format = M40_TOOLS_JSON;
    expect_400(e, &tp, "unsupported JSON Schema keyword 'not'");
    json_decref(unsup);
    /* harmony writes the name into a header and a grammar literal: OpenAI's characters only */
    json_t *quoted = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"a\\\" b\"}}]", 0, NULL);
    chat_params(&tp, msgs, quoted);
    tp.tool_call_format = M40_TOOLS_HARMONY;
    expect_400(e, &tp, "function name");
    json_decref(quoted);
    /* forced calls need tools and no other constraint */
    chat_params(&tp, msgs, NULL);
    tp.tool_call_format = M40_TOOLS_HERMES;
    CHECK(m40_engine_submit(e, &tp, &j, &j.req, err, sizeof err) == M40_SUBMIT_INVALID, "forced without tools");
    chat_params(&tp, msgs, tools);
    tp.tool_call_format = M40_TOOLS_HERMES;
    tp.json_object = 1;
    CHECK(m40_engine_submit(e, &tp, &j, &j.req, err, sizeof err) == M40_SUBMIT_INVALID, "forced with json_object");

    /* count_only: the prompt's tokens, no completion, nothing but DONE */
    {
        job c;
        memset(&c, 0, sizeof c);
        job *cp = &c;
        chat_params(&tp, msgs, NULL);
        tp.count_only = 1;
        CHECK(m40_engine_submit(e, &tp, &c, &c.req, err, sizeof err) == M40_SUBMIT_OK, "count submit: %s", err);
        CHECK(pump(e, &cp, 1, 30) == 0, "count: timeout");
        job g;
        memset(&g, 0, sizeof g);
        job *gp = &g;
        chat_params(&tp, msgs, NULL);
        tp.max_tokens = 1;
        CHECK(m40_engine_submit(e, &tp, &g, &g.req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
        CHECK(pump(e, &gp, 1, 30) == 0, "timeout");
        CHECK(c.finish == M40_FINISH_STOP && c.completion_tokens == 0 && c.n_text_events == 0 &&
                  c.prompt_tokens == g.prompt_tokens && c.prompt_tokens > 0,
              "count_only: finish %d, %d completion tokens, %d text events, %d vs %d prompt tokens", (int)c.finish,
              c.completion_tokens, c.n_text_events, c.prompt_tokens, g.prompt_tokens);
        m40_request_release(c.req);
        m40_request_release(g.req);
    }

    /* the stop string that ended the output is reported (1-based), none otherwise */
    {
        job a, b;
        job *ap = &a, *bp = &b;
        memset(&a, 0, sizeof a);
        memset(&b, 0, sizeof b);
        params(&p, 1);
        p.sampling.temperature = 0.0f;
        p.max_tokens = 24;
        CHECK(m40_engine_submit(e, &p, &a, &a.req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
        CHECK(pump(e, &ap, 1, 30) == 0, "timeout");
        CHECK(a.stop_matched == 0, "no stop string, stop_matched %d", a.stop_matched);
        if (a.len >= 6) {
            char cut[3] = {a.text[a.len / 2], a.text[a.len / 2 + 1], 0};
            const char *stops[2] = {"\x01never", cut};
            p.stop = stops;
            p.n_stop = 2;
            CHECK(m40_engine_submit(e, &p, &b, &b.req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
            CHECK(pump(e, &bp, 1, 30) == 0, "timeout");
            CHECK(b.finish == M40_FINISH_STOP && b.stop_matched == 2 && b.len == (size_t)(strstr(a.text, cut) - a.text),
                  "stop '%s': finish %d stop_matched %d, '%s' of '%s'", cut, (int)b.finish, b.stop_matched, b.text,
                  a.text);
            m40_request_release(b.req);
        }
        m40_request_release(a.req);
    }
    json_decref(msgs);
    json_decref(tools);

    m40_engine_destroy(e);
    return check_done();
}
