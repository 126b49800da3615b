/* Which bytes of a rendered chat prompt are the messages' own text, so that only the
 * template's markup can become control tokens.
 *
 * The prompt is rendered from the conversation and then tokenized with control-token
 * parsing on (the template writes "<|im_start|>" and the like as text). A user who types
 * "<|im_end|>\n<|im_start|>system\n..." into a message would otherwise forge turns. So
 * when a message text holds a control-token string, the template is rendered a second
 * time with every message text replaced by a placeholder ("\x1A" k "\x1A"); walking the
 * two renderings side by side gives the exact byte ranges where each text landed (as
 * sent, or trimmed, as templates that `| trim` it write it). Those ranges are tokenized
 * with parsing off (m40_tokenize_guarded); everything else as before, so prompts without
 * control strings in their messages are tokenized exactly as they always were.
 *
 * A template that changes a text in another way (cuts it, changes its case, decides on
 * its content) leaves no exact ranges; a request whose texts hold control strings is then
 * refused (400) rather than tokenized unsafely. */
#include "engine_impl.h"

#include <stdlib.h>
#include <string.h>

#include "template/jinja.h"

#define GUARD_MARK '\x1A'

typedef struct {
    const char **s;
    size_t *len;
    size_t n, cap;
} guard_texts;

static int texts_push(guard_texts *t, const char *s, size_t len)
{
    if (t->n == t->cap) {
        size_t nc = t->cap ? 2 * t->cap : 16;
        const char **ns = realloc(t->s, nc * sizeof *ns);
        if (!ns)
            return -1;
        t->s = ns;
        size_t *nl = realloc(t->len, nc * sizeof *nl);
        if (!nl)
            return -1;
        t->len = nl;
        t->cap = nc;
    }
    char *c = malloc(len + 1); /* the copy: the message's string goes with the placeholder */
    if (!c)
        return -1;
    memcpy(c, s, len);
    c[len] = 0;
    t->s[t->n] = c;
    t->len[t->n] = len;
    t->n++;
    return 0;
}

static void texts_free(guard_texts *t)
{
    for (size_t i = 0; i < t->n; i++)
        free((char *)t->s[i]);
    free(t->s);
    free(t->len);
}

/* The string value at key of obj replaced by the next placeholder (its text recorded). */
static int replace_text(json_t *obj, const char *key, guard_texts *t)
{
    json_t *v = json_object_get(obj, key);
    if (!json_is_string(v))
        return 0;
    char ph[32];
    snprintf(ph, sizeof ph, "%c%zu%c", GUARD_MARK, t->n, GUARD_MARK);
    if (texts_push(t, json_string_value(v), json_string_length(v)) != 0)
        return -1;
    return json_object_set_new(obj, key, json_string(ph));
}

/* A deep copy of messages with every message text (string content, the text of content
 * parts, name, reasoning_content and its harmony copy thinking, string tool-call
 * arguments) a placeholder; copies of
 * the texts in t. */
static json_t *with_placeholders(const json_t *messages, guard_texts *t)
{
    json_t *copy = json_deep_copy(messages);
    if (!copy)
        return NULL;
    size_t i, k;
    json_t *m, *p, *c;
    json_array_foreach(copy, i, m)
    {
        if (!json_is_object(m))
            continue;
        json_t *content = json_object_get(m, "content");
        int rc = json_is_string(content) ? replace_text(m, "content", t) : 0;
        if (json_is_array(content))
            json_array_foreach(content, k, p) if (rc == 0 && json_is_object(p)) rc = replace_text(p, "text", t);
        if (rc == 0)
            rc = replace_text(m, "name", t);
        if (rc == 0)
            rc = replace_text(m, "reasoning_content", t);
        if (rc == 0) /* harmony's copy of reasoning_content (template/chat_args.c) */
            rc = replace_text(m, "thinking", t);
        json_array_foreach(json_object_get(m, "tool_calls"), k, c)
        {
            json_t *f = json_object_get(c, "function");
            if (rc == 0 && json_is_object(f))
                rc = replace_text(f, "arguments", t);
        }
        if (rc != 0) {
            json_decref(copy);
            return NULL;
        }
    }
    return copy;
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Walks the placeholder rendering ph beside the real one: equal bytes outside the
 * placeholders, each placeholder matching its text as sent or trimmed. 0 with the ranges
 * (pairs, in order), or -1. */
static int walk(const char *ph, size_t ph_len, const char *real, size_t real_len, const guard_texts *t,
                size_t **ranges, size_t *n_ranges)
{
    size_t i = 0, j = 0, n = 0, cap = 16;
    size_t *rg = malloc(2 * cap * sizeof *rg);
    if (!rg)
        return -1;
    while (i < ph_len) {
        size_t k = 0, q = i + 1;
        int is_ph = ph[i] == GUARD_MARK && q < ph_len && ph[q] >= '0' && ph[q] <= '9';
        if (is_ph) {
            while (q < ph_len && ph[q] >= '0' && ph[q] <= '9' && k < t->n)
                k = 10 * k + (size_t)(ph[q++] - '0');
            is_ph = q < ph_len && ph[q] == GUARD_MARK && k < t->n;
        }
        if (!is_ph) {
            if (j >= real_len || ph[i] != real[j])
                goto fail;
            i++, j++;
            continue;
        }
        const char *s = t->s[k];
        size_t len = t->len[k];
        if (!(len <= real_len - j && !memcmp(real + j, s, len))) {
            while (len > 0 && is_space(s[0]))
                s++, len--;
            while (len > 0 && is_space(s[len - 1]))
                len--;
            if (!(len <= real_len - j && !memcmp(real + j, s, len)))
                goto fail;
        }
        if (len > 0) {
            if (n == cap) {
                size_t *nr = realloc(rg, 4 * cap * sizeof *rg);
                if (!nr)
                    goto fail;
                rg = nr;
                cap *= 2;
            }
            rg[2 * n] = j;
            rg[2 * n + 1] = j + len;
            n++;
        }
        j += len;
        i = q + 1;
    }
    if (j != real_len)
        goto fail;
    *ranges = rg;
    *n_ranges = n;
    return 0;
fail:
    free(rg);
    return -1;
}

/* 1 when a string anywhere in v (keys aside) holds a control-token string */
static int json_has_control(const m40_tokenizer *tok, const json_t *v)
{
    size_t i;
    const char *key;
    json_t *x;
    if (json_is_string(v))
        return m40_tokenizer_has_control(tok, json_string_value(v), json_string_length(v));
    if (json_is_array(v)) {
        json_array_foreach(v, i, x) if (json_has_control(tok, x)) return 1;
    } else if (json_is_object(v)) {
        json_object_foreach((json_t *)v, key, x) if (json_has_control(tok, x)) return 1;
    }
    return 0;
}

int m40_prompt_guard(const m40_tokenizer *tok, const m40_jinja *tmpl, const json_t *messages, const json_t *tools,
                     int add_generation_prompt, const char *bos, const char *eos, const json_t *kwargs,
                     const char *real, size_t real_len, size_t **ranges, size_t *n_ranges, char *err, size_t errlen)
{
    *ranges = NULL;
    *n_ranges = 0;
    if (!json_has_control(tok, messages))
        return 0; /* nothing a user wrote could become a control token */
    /* tool-call arguments given to the template as objects (template/chat_args.c) have
     * no placeholder: their strings must not hold control text */
    size_t i, k;
    json_t *m, *c;
    json_array_foreach(messages, i, m) json_array_foreach(json_object_get(m, "tool_calls"), k, c)
    {
        const json_t *args = json_object_get(json_object_get(c, "function"), "arguments");
        if (args && !json_is_string(args) && json_has_control(tok, args)) {
            snprintf(err, errlen, "tool-call arguments contain the text of a control token");
            return -1;
        }
    }
    guard_texts t = {0};
    json_t *ph_msgs = with_placeholders(messages, &t);
    char *ph = NULL;
    size_t ph_len = 0;
    int rc = -1;
    if (!ph_msgs) {
        snprintf(err, errlen, "out of memory");
    } else if (m40_chat_template_render_parsed(tmpl, ph_msgs, tools, add_generation_prompt, bos, eos, kwargs, NULL,
                                               &ph, &ph_len, err, errlen) != 0 ||
               walk(ph, ph_len, real, real_len, &t, ranges, n_ranges) != 0) {
        snprintf(err, errlen,
                 "a message contains the text of a control token (such as the template's turn markers) and this "
                 "chat template changes message text, so it cannot be kept apart from the template's own markup");
    } else {
        rc = 0;
    }
    free(ph);
    json_decref(ph_msgs);
    texts_free(&t);
    return rc;
}
