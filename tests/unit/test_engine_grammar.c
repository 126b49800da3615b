/* Constrained decoding through the engine's public API on the CPU (stories260K): outputs
 * under a GBNF grammar, a JSON Schema and json_object are sentences of their grammars at
 * temperature 1 over many seeds, 4 sequences at once; a grammar that is complete ends the
 * sequence (finish stop) even with ignore_eos; bad grammars and schemas are 400 ERROR
 * events naming the problem; two constraints at once are refused at submit. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "engine_jobs.h"
#include "grammar/grammar.h"

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

    m40_engine_destroy(e);
    return check_done();
}
