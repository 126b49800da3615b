/* Language features of the chat-template interpreter, one small template each, with
 * the output jinja2 (trim_blocks, lstrip_blocks, HF's tojson) gives for it; plus
 * hostile templates that must fail cleanly under the limits. The full templates are
 * compared with jinja2 itself by test_jinja_templates. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "check.h"
#include "template/jinja.h"

static char err[512];

/* Render src with variables from a JSON object (NULL: none). NULL on error (err). */
static char *render_lim(const char *src, const char *vars_json, const m40_jinja_limits *lim)
{
    m40_jinja *t;
    char *out = NULL;
    err[0] = 0;
    if (m40_jinja_parse(src, strlen(src), &t, err, sizeof err))
        return NULL;
    m40_jarena *a = m40_jarena_new(0);
    m40_jvalue ctx;
    json_error_t je;
    json_t *j = json_loads(vars_json ? vars_json : "{}", 0, &je);
    if (!a || !j || m40_jv_from_json(a, j, &ctx, err, sizeof err) == 0) {
        size_t len;
        if (a && j && m40_jinja_render(t, ctx, lim, &out, &len, err, sizeof err) == 0 && strlen(out) != len) {
            snprintf(err, sizeof err, "length mismatch");
            free(out);
            out = NULL;
        }
    }
    if (!j)
        snprintf(err, sizeof err, "bad test JSON: %s", je.text);
    json_decref(j);
    m40_jarena_free(a);
    m40_jinja_free(t);
    return out;
}

static char *render(const char *src, const char *vars) { return render_lim(src, vars, NULL); }

#define EXPECT(src, vars, want)                                                               \
    do {                                                                                      \
        char *got_ = render(src, vars);                                                       \
        CHECK(got_ && !strcmp(got_, want), "%s\n  want: [%s]\n  got:  [%s] %s", src, want,    \
              got_ ? got_ : "(error)", got_ ? "" : err);                                      \
        free(got_);                                                                           \
    } while (0)

/* The render fails and the message contains `part`. */
#define EXPECT_ERR(src, vars, part)                                                           \
    do {                                                                                      \
        char *got_ = render(src, vars);                                                       \
        CHECK(!got_ && strstr(err, part), "%s\n  want error containing [%s]\n  got: [%s] %s", \
              src, part, got_ ? got_ : "(error)", err);                                       \
        free(got_);                                                                           \
    } while (0)

static void test_text_and_whitespace(void)
{
    EXPECT("hello", NULL, "hello");
    EXPECT("line\n", NULL, "line");            /* one trailing newline dropped */
    EXPECT("line\n\n", NULL, "line\n");
    EXPECT("a\r\nb", NULL, "a\nb");            /* newlines normalized */
    EXPECT("{# comment #}x", NULL, "x");
    /* trim_blocks: the newline after %} goes; lstrip_blocks: indentation before {% goes */
    EXPECT("{% if true %}\n  yes\n  {% endif %}\nend", NULL, "  yes\nend");
    EXPECT("a  {%- if true %} b {% endif -%}  c", NULL, "a b c");
    EXPECT("a {{- 'x' -}} b", NULL, "axb");
    EXPECT("  {{ 'v' }}", NULL, "  v");       /* lstrip does not apply to {{ */
    EXPECT("x\n    {%+ if true %}y{% endif %}", NULL, "x\n    y");
    EXPECT("{% if true +%}\nz{% endif %}", NULL, "\nz");
    EXPECT("{% raw %}{{ a }}{% endraw %}", NULL, "{{ a }}");
    EXPECT("  {# c #}\nq", NULL, "q");
    EXPECT("{{ {'a': {'b': 1}} }}", NULL, "{'a': {'b': 1}}"); /* }} inside braces */
}

static void test_control_flow(void)
{
    EXPECT("{% if x == 1 %}one{% elif x == 2 %}two{% else %}other{% endif %}", "{\"x\":2}", "two");
    EXPECT("{% if x %}t{% else %}f{% endif %}", "{\"x\":[]}", "f");
    EXPECT("{% for i in [1,2,3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
           "{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
           NULL, "103TrueFalse3;212FalseFalse3;321FalseTrue3;");
    EXPECT("{% for x in [] %}a{% else %}empty{% endfor %}", NULL, "empty");
    EXPECT("{% for x in [1,2,3,4] if x is even %}{{ x }}{{ loop.last }},{% endfor %}", NULL, "2False,4True,");
    EXPECT("{% for k, v in d.items() %}{{ k }}={{ v }} {% endfor %}", "{\"d\":{\"b\":1,\"a\":2}}", "b=1 a=2 ");
    EXPECT("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}"
           "{{ i }}{% endfor %}", NULL, "02");
    EXPECT("{% for a in 'xy' %}{% for b in [1, 2] %}{{ a }}{{ b }}{{ loop.index }} {% endfor %}{% endfor %}", NULL,
           "x11 x22 y11 y22 ");
    EXPECT("{% for x in [1, 2, 3] %}{{ loop.previtem }}>{{ x }}>{{ loop.nextitem }} {% endfor %}", NULL,
           ">1>2 1>2>3 2>3> ");
    EXPECT("{% for x in range(4) %}{{ loop.cycle('a', 'b') }}{% endfor %}", NULL, "abab");
}

static void test_scoping(void)
{
    /* set in a loop stays in the iteration; namespace attributes survive */
    EXPECT("{% set x = 0 %}{% for i in [1,2] %}{% set x = i %}{% endfor %}{{ x }}", NULL, "0");
    EXPECT("{% set ns = namespace(x=0) %}{% for i in [1,2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}",
           NULL, "3");
    EXPECT("{% set ns = namespace() %}{% set ns.a = 'v' %}{{ ns.a }}", NULL, "v");
    EXPECT("{% if true %}{% set y = 5 %}{% endif %}{{ y }}", NULL, "5"); /* if opens no scope */
    EXPECT("{% set a, b = 1, 2 %}{{ b }}{{ a }}", NULL, "21");
    EXPECT("{% set x %}in {{ 1 + 1 }}{% endset %}[{{ x }}]", NULL, "[in 2]");
    EXPECT("{% set x | upper %}abc{% endset %}{{ x }}", NULL, "ABC");
    EXPECT("{% with a = 1 %}{{ a }}{% endwith %}{{ a is defined }}", NULL, "1False");
    EXPECT_ERR("{% set n = 1 %}{% set n.a = 2 %}", NULL, "non-namespace");
}

static void test_macros(void)
{
    EXPECT("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
           "{{ greet('Ann') }} {{ greet('Bo', '?') }} {{ greet(punct='.', name='Cy') }}",
           NULL, "Hi Ann! Hi Bo? Hi Cy.");
    EXPECT("{% macro m(a) %}[{{ a }}]{% endmacro %}{{ m() }}", NULL, "[]");
    /* macros read top-level variables at call time */
    EXPECT("{% set x = 1 %}{% macro m() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ m() }}", NULL, "2");
    EXPECT("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}", NULL, "321");
    EXPECT("{% macro box() %}<{{ caller() }}>{% endmacro %}{% call box() %}inner{% endcall %}", NULL, "<inner>");
    EXPECT("{% macro row(x) %}{{ caller(x * 2) }}{% endmacro %}{% call(v) row(4) %}v={{ v }}{% endcall %}", NULL,
           "v=8");
    EXPECT("{% filter upper %}shout {{ 'it' }}{% endfilter %}", NULL, "SHOUT IT");
    EXPECT_ERR("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", NULL, "takes not more than 1");
    EXPECT("{% generation %}{% set g = 1 %}gen{% endgeneration %}{{ g is defined }}", NULL, "genFalse");
}

static void test_expressions(void)
{
    EXPECT("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 8 }}",
           NULL, "7 9 3 -4 2 3.5 256");
    EXPECT("{{ 'a' ~ 1 ~ none ~ true }} {{ 'ab' * 2 }} {{ [1] + [2] }}", NULL, "a1NoneTrue abab [1, 2]");
    EXPECT("{{ 1 < 2 < 3 }} {{ 2 < 1 < 3 }} {{ 1 == 1.0 }} {{ 'b' in 'abc' }} {{ 4 not in [1] }}", NULL,
           "True False True True True");
    EXPECT("{{ none or 'd' }} {{ 0 and 'x' }} {{ not 0 }} {{ 'y' if 0 else 'n' }} [{{ 'y' if 0 }}]", NULL,
           "d 0 True n []");
    EXPECT("{{ s[1:] }} {{ s[::-1] }} {{ s[-2:] }} {{ s[0] }} {{ l[1:2] }} {{ l[-1] }}",
           "{\"s\":\"héllo\",\"l\":[1,2,3]}", "éllo olléh lo h [2] 3");
    EXPECT("{{ m.role }} {{ m['role'] }} {{ m.items }}", "{\"m\":{\"role\":\"user\",\"items\":5}}",
           "user user <function items>"); /* m.items is the dict method, as in jinja2 */
    EXPECT("{{ m['items'] }}", "{\"m\":{\"items\":5}}", "5");
    EXPECT("{{ 'a\\nb\\t\\'\\\"\\u00e9\\x41' }}", NULL, "a\nb\t'\"éA");
    EXPECT("{{ 'ab' 'cd' }}", NULL, "abcd");
}

static void test_printing(void)
{
    EXPECT("{{ none }} {{ true }} {{ 3.0 }} {{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1.5e-5 }} {{ 123456789.0 }}", NULL,
           "None True 3.0 0.30000000000000004 1e+16 1.5e-05 123456789.0");
    EXPECT("{{ [1, 'a', none, {'k': [true]}] }} {{ (1,) }} {{ (1, 2) }}", NULL,
           "[1, 'a', None, {'k': [True]}] (1,) (1, 2)");
    EXPECT("{{ [\"it's\", 'say \"x\"', 'both \\'\"'] }}", NULL, "[\"it's\", 'say \"x\"', 'both \\'\"']");
    EXPECT("[{{ missing }}]", NULL, "[]");
}

static void test_undefined(void)
{
    EXPECT("{{ missing is defined }} {{ missing is undefined }} {{ missing|length }} {{ missing == missing }}", NULL,
           "False True 0 True");
    EXPECT("{% for x in missing %}x{% endfor %}{{ 'a' in missing }}", NULL, "False");
    EXPECT_ERR("{{ missing.attr }}", NULL, "'missing' is undefined");
    EXPECT_ERR("{{ missing + 1 }}", NULL, "'missing' is undefined");
    EXPECT("{{ d.nope is defined }} {{ d['nope'] is defined }} {{ l[5] is defined }}", "{\"d\":{},\"l\":[1]}",
           "False False False");
    EXPECT_ERR("{{ 'a' + 1 }}", NULL, "unsupported operand");
    EXPECT_ERR("{{ raise_exception('Roles must alternate') }}", NULL, "Roles must alternate");
    char *out = render("{{ raise_exception('exact message') }}", NULL);
    CHECK(!out && !strcmp(err, "exact message"), "raise_exception message is passed through: [%s]", err);
    free(out);
}

static void test_filters(void)
{
    EXPECT("[{{ '  x \\n'|trim }}] {{ 'abc'|length }} {{ 'héllo'|length }} {{ [1,2]|count }}", NULL, "[x] 3 5 2");
    EXPECT("{{ 'ab'|upper }} {{ 'AB'|lower }} {{ 'hello world-wide'|title }} {{ 'hELLO'|capitalize }}", NULL,
           "AB ab Hello World-Wide Hello");
    EXPECT("{{ 'aXbX'|replace('X', '-') }} {{ [1, 2]|join(', ') }} {{ ['a', 'b']|join }}", NULL, "a-b- 1, 2 ab");
    EXPECT("{{ x|default('d') }} {{ ''|default('e', true) }} {{ 0|d('z') }}", NULL, "d e 0");
    EXPECT("{{ [3, 4]|first }} {{ [3, 4]|last }} {{ 'ab'|list }} {{ 5|string ~ 'x' }}", NULL, "3 4 ['a', 'b'] 5x");
    EXPECT("{{ '7'|int + 1 }} {{ '7.9'|int }} {{ 'q'|int(-1) }} {{ '2.5'|float }} {{ -2|abs }}", NULL,
           "8 7 -1 2.5 2");
    EXPECT("{{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 5|round }} {{ 2.1|round(0, 'ceil') }}", NULL,
           "2.0 4.0 2.67 5 3.0");
    EXPECT("{% for k, v in {'a': 1}|items %}{{ k }}{{ v }}{% endfor %}", NULL, "a1");
    EXPECT("{{ ms|selectattr('role', 'equalto', 'user')|map(attribute='c')|list }} "
           "{{ ms|rejectattr('role', 'eq', 'user')|map(attribute='c')|join }}",
           "{\"ms\":[{\"role\":\"user\",\"c\":1},{\"role\":\"bot\",\"c\":2},{\"role\":\"user\",\"c\":3}]}",
           "[1, 3] 2");
    EXPECT("{{ [1, 0, 2]|select|list }} {{ [1, 2, 3]|reject('odd')|list }} {{ ['a', 'A', 'b']|unique|list }}", NULL,
           "[1, 2] [2] ['a', 'b']");
    EXPECT("{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, first=true) }}|{{ 'x\\n'|indent }}", NULL,
           "a\n  b\n\n  c|  a\n  b|x\n");
    /* filters return generators in jinja2: truthy, no len, used up by one pass */
    EXPECT("{% set g = [1, 2]|select %}{{ g|list }}{{ g|list }}", NULL, "[1, 2][]");
    EXPECT_ERR("{{ [1]|select|length }}", NULL, "no len");
    /* |safe makes a Markup: adding a plain string escapes it */
    EXPECT("{{ '<b>'|safe + '<i>' }} {{ '<'|e }}", NULL, "<b>&lt;i&gt; &lt;");
    EXPECT_ERR("{{ 1|nosuchfilter }}", NULL, "no filter named 'nosuchfilter'");
}

static void test_tojson(void)
{
    /* HF's tojson: json.dumps(ensure_ascii=False), insertion order, ", " and ": " */
    EXPECT("{{ d|tojson }}", "{\"d\":{\"z\":1,\"a\":[true,null,1.5],\"s\":\"é\\\"\\n<\"}}",
           "{\"z\": 1, \"a\": [true, null, 1.5], \"s\": \"é\\\"\\n<\"}");
    EXPECT("{{ d|tojson(indent=2) }}", "{\"d\":{\"a\":[1,{}],\"b\":[]}}",
           "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}");
    EXPECT("{{ {1: 'x'}|tojson }} {{ 'ctl\\x01'|tojson }}", NULL, "{\"1\": \"x\"} \"ctl\\u0001\"");
    EXPECT_ERR("{{ missing|tojson }}", NULL, "not JSON serializable");
}

static void test_tests_and_methods(void)
{
    EXPECT("{{ none is none }} {{ 'x' is string }} {{ {} is mapping }} {{ 'x' is iterable }} {{ 1 is iterable }} "
           "{{ 1 is number }} {{ true is boolean }} {{ 3 is odd }} {{ 4 is divisibleby 2 }} {{ 1 is not none }}",
           NULL, "True True True True False True True True True True");
    EXPECT("{{ x is true }} {{ x is false }} {{ 2 is gt 1 }} {{ 'a' is in 'ab' }} {{ [] is sequence }}",
           "{\"x\":false}", "False True True True True");
    EXPECT("{{ ' a b '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ ' a'.lstrip() }}|{{ 'a '.rstrip() }}|"
           "{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}",
           NULL, "a b|hi|a|a|['a', 'b', '', 'c']|['a', 'b']|['a', 'b c']");
    EXPECT("{{ 'hello'.startswith('he') }} {{ 'hello'.endswith(('x', 'lo')) }} {{ 'ab'.upper() }} "
           "{{ \"they're here\".title() }} {{ 'aaa'.replace('a', 'b', 2) }} {{ 'abc'.find('c') }}",
           NULL, "True True AB They'Re Here bba 2");
    EXPECT("{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 0) }} {{ d.keys()|list }} {{ d.values()|list }}",
           "{\"d\":{\"a\":1}}", "1 None 0 ['a'] [1]");
    EXPECT("{{ 'Ünï'|upper }} {{ 'ΑΒΓ'|lower }} {{ 'straße'|upper }}", NULL, "ÜNÏ αβγ STRASSE");
}

static void test_strftime(void)
{
    m40_jinja_limits lim = {0};
    lim.now = 1721952000; /* 2024-07-26 00:00:00 UTC */
    char *out = render_lim("{{ strftime_now('%d %b %Y') }}", NULL, &lim);
    CHECK(out && !strcmp(out, "26 Jul 2024"), "strftime_now with an injected date: [%s] %s", out ? out : "", err);
    free(out);
    out = render_lim("{{ strftime_now('%Y') | int > 2000 }}", NULL, NULL);
    CHECK(out && !strcmp(out, "True"), "strftime_now with the current date: [%s] %s", out ? out : "", err);
    free(out);
}

static void test_parse_errors(void)
{
    const char *bad[] = {
        "{% if x %}never closed",       "{{ 1 + }}",         "{% endfor %}",
        "{% for x in %}{% endfor %}",   "{{ 'unterminated }}", "{% include 'x' %}",
        "{% macro m( %}{% endmacro %}", "{{ a | }}",         "{# open comment",
        "{{ (1, 2 }}",                  "{{ [1, 2) }}",      "{% raw %}never ends",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        m40_jinja *t = NULL;
        int rc = m40_jinja_parse(bad[i], strlen(bad[i]), &t, err, sizeof err);
        CHECK(rc == -1 && t == NULL && strstr(err, "line "), "parse error expected for %s (got: %s)", bad[i], err);
        m40_jinja_free(t);
    }
    m40_jinja *t = NULL;
    const char *src = "ok\n\n{% if %}";
    m40_jinja_parse(src, strlen(src), &t, err, sizeof err);
    CHECK(strstr(err, "line 3") != NULL, "error names the line: %s", err);
    m40_jinja_free(t);
}

static void test_hostile(void)
{
    /* deep nesting: parentheses, nested ifs, nested lists */
    size_t n = 100000;
    char *src = malloc(n * 2 + 16);
    CHECK(src != NULL, "malloc");
    if (!src)
        return;
    memcpy(src, "{{ ", 3);
    memset(src + 3, '(', n);
    strcpy(src + 3 + n, "1 }}");
    m40_jinja *t = NULL;
    CHECK(m40_jinja_parse(src, strlen(src), &t, err, sizeof err) == -1 && strstr(err, "nests too deeply"),
          "100000 parentheses fail cleanly: %s", err);
    m40_jinja_free(t);
    src[0] = 0;
    for (size_t i = 0; i < 5000; i++)
        strcat(src + i * 11, "{% if 1 %}");
    t = NULL;
    CHECK(m40_jinja_parse(src, strlen(src), &t, err, sizeof err) == -1, "5000 nested ifs fail cleanly: %s", err);
    m40_jinja_free(t);
    free(src);

    m40_jinja_limits lim = {0};
    lim.max_steps = 100000;
    char *out = render_lim("{% for i in range(1000) %}{% for j in range(1000) %}{{ j }}{% endfor %}{% endfor %}",
                           NULL, &lim);
    CHECK(!out && strstr(err, "steps"), "runaway loops hit the step limit: %s", err);
    free(out);
    out = render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", NULL);
    CHECK(!out && strstr(err, "nest deeper"), "unbounded recursion hits the depth limit: %s", err);
    free(out);
    out = render("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}", NULL);
    CHECK(!out && (strstr(err, "steps") || strstr(err, "memory")), "exponential recursion hits a limit: %s", err);
    free(out);
    lim.max_steps = 0;
    lim.max_output = 1000;
    out = render_lim("{% for i in range(200) %}0123456789{% endfor %}", NULL, &lim);
    CHECK(!out && strstr(err, "exceeds 1000 bytes"), "output limit: %s", err);
    free(out);
    lim.max_output = 0;
    lim.max_memory = 4 << 20;
    out = render_lim("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}"
                     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
                     NULL, &lim);
    CHECK(!out && (strstr(err, "memory") || strstr(err, "too long")), "doubling strings hit a limit: %s", err);
    free(out);
    out = render("{{ 'x' * 100000000000 }}", NULL);
    CHECK(!out && strstr(err, "too large"), "huge repetition is refused: %s", err);
    free(out);
    out = render("{% set ns = namespace() %}{% set ns.self = ns %}{{ ns }}", NULL);
    CHECK(!out, "a namespace holding itself cannot be printed forever");
    free(out);
    out = render("{{ range(100000000)|length }}", NULL);
    CHECK(!out, "huge range is refused: %s", err);
    free(out);
    /* found by fuzz_jinja: escaping a list writes its repr, and |list turns that string into
     * a list of its characters again, each round several times longer; ten rounds took
     * seconds and gigabytes within the memory limit. Each character made is a step, and
     * no string value grows past the output limit. */
    lim.max_memory = (size_t)1 << 30;
    lim.max_steps = 100000;
    out = render_lim("{{ range(3)|e|list|e|list|e|list|e|list|e|list|e|list|e|list|e|list|e|list|e }}", NULL, &lim);
    CHECK(!out && (strstr(err, "steps") || strstr(err, "exceeds")), "|e|list rounds hit the step limit: %s", err);
    free(out);
    lim.max_steps = 0;
    lim.max_output = 1000;
    out = render_lim("{{ (range(400)|string|e)|length }}", NULL, &lim);
    CHECK(!out && strstr(err, "exceeds 1000 bytes"), "a string value past the output limit: %s", err);
    free(out);
    lim.max_output = 0;
    lim.max_memory = 0;

    /* long left-associative chains: parsed by loops but evaluated one level a link, so
     * a 50,000-link chain used to run the stack out at render time (a worker crash for
     * every chat request); now it is refused at parse time, naming the limit */
    const char *links[] = {" + 1", ".a", "|string", " and 1", " ** 1"};
    for (size_t li = 0; li < sizeof links / sizeof links[0]; li++) {
        const size_t nl = 50000, ll = strlen(links[li]);
        char *chain = malloc(nl * ll + 32);
        CHECK(chain != NULL, "malloc");
        if (!chain)
            return;
        size_t at = (size_t)sprintf(chain, "{{ 1");
        for (size_t i = 0; i < nl; i++, at += ll)
            memcpy(chain + at, links[li], ll);
        strcpy(chain + at, " }}");
        t = NULL;
        CHECK(m40_jinja_parse(chain, strlen(chain), &t, err, sizeof err) == -1 && strstr(err, "nests too deeply") &&
                  strstr(err, "500"),
              "a 50,000-link '%s' chain fails cleanly at parse time: %s", links[li], err);
        m40_jinja_free(t);
        free(chain);
    }
    /* a chain below the limit still renders */
    char chain[4096];
    size_t at = (size_t)sprintf(chain, "{{ 1");
    for (int i = 0; i < 400; i++)
        at += (size_t)sprintf(chain + at, " + 1");
    strcpy(chain + at, " }}");
    out = render(chain, NULL);
    CHECK(out && !strcmp(out, "401"), "a 400-link chain renders: %s", out ? out : err);
    free(out);
    /* number literals longer than the lexer's buffer: an error, not a write past it (63
     * digits then ".5" wrote one byte past the 64-byte buffer) */
    char num[160] = "{{ ";
    memset(num + 3, '7', 63);
    strcpy(num + 66, ".5 }}");
    t = NULL;
    CHECK(m40_jinja_parse(num, strlen(num), &t, err, sizeof err) == -1 && strstr(err, "number literal longer"),
          "63 digits and a fraction fail cleanly: %s", err);
    m40_jinja_free(t);
    memset(num + 3, '7', 100);
    strcpy(num + 103, "e5 }}");
    t = NULL;
    CHECK(m40_jinja_parse(num, strlen(num), &t, err, sizeof err) == -1 && strstr(err, "number literal longer"),
          "100 digits and an exponent fail cleanly: %s", err);
    m40_jinja_free(t);
    EXPECT("{{ 1_000 + 2.5e1 + 0.25 }}", NULL, "1025.25");
    /* a slice inside a tuple subscript had no object: a NULL dereference at render
     * (found by fuzz_jinja) */
    t = NULL;
    CHECK(m40_jinja_parse("{{ 'abc'[0,:] }}", 16, &t, err, sizeof err) == -1 && strstr(err, "slice"),
          "x[0, :] fails cleanly: %s", err);
    m40_jinja_free(t);
    EXPECT("{{ 'abcdef'[1:4] ~ 'xyz'[::-1] }}", NULL, "bcdzyx");
    /* a step past the end in one stride: the index stepped by INT64_MAX overflowed (UBSan
     * in jr_slice, found by fuzz_jinja with 'abc'[1::777...7]) */
    EXPECT("{{ 'abc'[1::9223372036854775807] ~ 'abc'[2::-9223372036854775807] ~ 'abc'[::9223372036854775807] }}",
           NULL, "bca");
    EXPECT("{{ [1, 2, 3][1::9223372036854775807] | join(',') }}{{ [1, 2, 3][::-9223372036854775807] | join(',') }}",
           NULL, "23");
    /* empty sequences repeated 10^15 times: empty at once (found by fuzz_jinja: a spin) */
    EXPECT("{{ '' * 3444444444444444 }}{{ ([] * 3444444444444444) | length }}", NULL, "0");
    /* a source over 1 MiB (possible only through a GGUF file or a configured path) */
    const size_t big = ((size_t)1 << 20) + 1;
    char *huge = malloc(big + 1);
    CHECK(huge != NULL, "malloc");
    if (!huge)
        return;
    memset(huge, 'x', big);
    huge[big] = 0;
    t = NULL;
    CHECK(m40_jinja_parse(huge, big, &t, err, sizeof err) == -1 && strstr(err, "limit"),
          "a template over 1 MiB is refused: %s", err);
    m40_jinja_free(t);
    free(huge);
}

static void test_chat_convenience(void)
{
    const char *tmpl = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}{{ tools is none }}{{ lang }}";
    json_t *msgs = json_pack("[{s:s,s:s},{s:s,s:s}]", "role", "system", "content", "sys", "role", "user",
                             "content", "hi");
    json_t *extra = json_pack("{s:s}", "lang", "fr");
    char *out = NULL;
    size_t len = 0;
    int rc = m40_chat_template_render(tmpl, msgs, NULL, 1, "<s>", "</s>", extra, NULL, &out, &len, err, sizeof err);
    const char *want = "<s><system>sys</s><user>hi</s><assistant>Truefr";
    CHECK(rc == 0 && out && !strcmp(out, want) && len == strlen(want), "chat convenience: [%s] %s",
          out ? out : "", err);
    free(out);
    json_t *tools = json_pack("[{s:s}]", "type", "function");
    out = NULL;
    rc = m40_chat_template_render("{{ tools|length }}{{ tools[0].type }}", msgs, tools, 0, NULL, NULL, NULL, NULL,
                                  &out, &len, err, sizeof err);
    CHECK(rc == 0 && out && !strcmp(out, "1function"), "tools reach the template: [%s] %s", out ? out : "", err);
    free(out);
    out = NULL;
    rc = m40_chat_template_render("{% for m in messages %}{{ raise_exception('no ' + m.role) }}{% endfor %}", msgs,
                                  NULL, 0, NULL, NULL, NULL, NULL, &out, &len, err, sizeof err);
    CHECK(rc == -1 && out == NULL && !strcmp(err, "no system"), "raise_exception through the convenience: %s", err);
    json_decref(tools);
    json_decref(extra);
    json_decref(msgs);
}

static void test_values_api(void)
{
    m40_jarena *a = m40_jarena_new(0);
    m40_jvalue d, l, s;
    CHECK(a && m40_jv_dict(a, &d) == 0 && m40_jv_list(a, &l) == 0, "constructors");
    for (int i = 0; i < 100; i++) { /* grows past the hash index threshold */
        char k[16];
        snprintf(k, sizeof k, "k%d", i);
        CHECK(m40_jv_dict_set_cstr(a, d, k, m40_jv_int(i)) == 0, "dict_set");
    }
    CHECK(m40_jv_dict_set_cstr(a, d, "k5", m40_jv_int(-5)) == 0, "replace");
    CHECK(m40_jv_dict_get_cstr(d, "k5").u.i == -5 && m40_jv_dict_get_cstr(d, "k99").u.i == 99 &&
              m40_jv_dict_get_cstr(d, "nope").type == M40_JV_UNDEFINED,
          "lookups after growth");
    CHECK(m40_jv_cstr(a, "x", &s) == 0 && m40_jv_list_push(a, l, s) == 0 && m40_jv_list_push(a, l, m40_jv_float(0.5)) == 0,
          "list push");
    m40_jvalue ctx;
    m40_jv_dict(a, &ctx);
    m40_jv_dict_set_cstr(a, ctx, "d", d);
    m40_jv_dict_set_cstr(a, ctx, "l", l);
    m40_jinja *t;
    const char *src = "{{ d|length }} {{ d.k5 }} {{ (d|list)[1] }} {{ l }}";
    char *out = NULL;
    size_t len;
    CHECK(m40_jinja_parse(src, strlen(src), &t, err, sizeof err) == 0, "parse: %s", err);
    CHECK(m40_jinja_render(t, ctx, NULL, &out, &len, err, sizeof err) == 0 && !strcmp(out, "100 -5 k1 ['x', 0.5]"),
          "render with API-built values: [%s] %s", out ? out : "", err);
    free(out);
    /* the parsed template is reusable */
    out = NULL;
    CHECK(m40_jinja_render(t, ctx, NULL, &out, &len, err, sizeof err) == 0 && out && !strcmp(out, "100 -5 k1 ['x', 0.5]"),
          "second render of one template: %s", err);
    free(out);
    m40_jinja_free(t);
    m40_jarena *tiny = m40_jarena_new(1024);
    m40_jvalue big;
    char buf[4096];
    memset(buf, 'a', sizeof buf);
    CHECK(tiny && m40_jv_str(tiny, buf, sizeof buf, &big) == -1, "arena cap is enforced");
    m40_jarena_free(tiny);
    m40_jarena_free(a);
}

int main(void)
{
    test_text_and_whitespace();
    test_control_flow();
    test_scoping();
    test_macros();
    test_expressions();
    test_printing();
    test_undefined();
    test_filters();
    test_tojson();
    test_tests_and_methods();
    test_strftime();
    test_parse_errors();
    test_hostile();
    test_chat_convenience();
    test_values_api();
    return check_done();
}
