/* The prefix key of a request body (m40_prefix_key.h has what it covers and why). */
#include "m40_prefix_key.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    unsigned char *buf;
    size_t len;
    size_t cap;
} key_buf;

static int full(const key_buf *b) { return b->len >= b->cap; }

static void add(key_buf *b, const void *data, size_t len)
{
    if (len > b->cap - b->len)
        len = b->cap - b->len;
    if (len)
        memcpy(b->buf + b->len, data, len);
    b->len += len;
}

static void add_string(key_buf *b, const json_t *s) { add(b, json_string_value(s), json_string_length(s)); }

static int text_part_type(const json_t *type)
{
    if (type == NULL)
        return 1;
    if (!json_is_string(type))
        return 0;
    const char *t = json_string_value(type);
    return strcmp(t, "text") == 0 || strcmp(t, "input_text") == 0 || strcmp(t, "output_text") == 0;
}

/* A message's text: a string, or the text parts of an array (images etc. left out). */
static void add_text(key_buf *b, const json_t *content)
{
    if (json_is_string(content)) {
        add_string(b, content);
        return;
    }
    if (!json_is_array(content))
        return;
    int first = 1;
    size_t i;
    const json_t *part;
    json_array_foreach(content, i, part) {
        if (full(b))
            return;
        const json_t *text = NULL;
        if (json_is_string(part))
            text = part;
        else if (json_is_object(part) && text_part_type(json_object_get(part, "type")))
            text = json_object_get(part, "text");
        if (!json_is_string(text))
            continue;
        if (!first)
            add(b, "\n", 1);
        first = 0;
        add_string(b, text);
    }
}

static void add_piece(key_buf *b, const char *role, size_t role_len, const json_t *content)
{
    add(b, role, role_len);
    add(b, "\n", 1);
    add_text(b, content);
    add(b, "", 1);
}

/* The leading system/developer messages; without a system part so far, the first
 * message instead. Stops at the first item without a string role (a Responses
 * function_call item: past the start anyway). */
static void add_messages(key_buf *b, const json_t *msgs, int have)
{
    size_t i;
    const json_t *m;
    json_array_foreach(msgs, i, m) {
        if (full(b) || !json_is_object(m))
            return;
        const json_t *role = json_object_get(m, "role");
        if (!json_is_string(role))
            return;
        const char *name = json_string_value(role);
        size_t len = json_string_length(role);
        int sys = strcmp(name, "system") == 0 || strcmp(name, "developer") == 0;
        if (sys || !have)
            add_piece(b, name, len, json_object_get(m, "content"));
        if (!sys)
            return;
        have = 1;
    }
}

static void add_prompt(key_buf *b, const json_t *prompt)
{
    if (json_is_array(prompt) && json_array_size(prompt) > 0) {
        const json_t *first = json_array_get(prompt, 0);
        if (json_is_string(first) || json_is_array(first))
            prompt = first;
    }
    add(b, "prompt\n", 7);
    if (json_is_string(prompt)) {
        add_string(b, prompt);
        return;
    }
    if (!json_is_array(prompt))
        return;
    size_t i;
    const json_t *t;
    json_array_foreach(prompt, i, t) {
        if (full(b))
            return;
        if (!json_is_integer(t))
            continue;
        char num[32];
        int n = snprintf(num, sizeof num, "%" PRId64 ",", (int64_t)json_integer_value(t));
        if (n > 0)
            add(b, num, (size_t)n);
    }
}

size_t m40_prefix_key(const json_t *root, unsigned char *out, size_t cap)
{
    key_buf b = {out, 0, cap};
    if (!json_is_object(root) || cap == 0)
        return 0;
    int have = 0;
    const json_t *v = json_object_get(root, "system"); /* /v1/messages */
    if (json_is_string(v) || json_is_array(v)) {
        add_piece(&b, "system", 6, v);
        have = 1;
    }
    v = json_object_get(root, "instructions"); /* /v1/responses */
    if (json_is_string(v)) {
        add_piece(&b, "system", 6, v);
        have = 1;
    }
    const json_t *msgs = json_object_get(root, "messages");
    if (!json_is_array(msgs))
        msgs = json_object_get(root, "input");
    if (json_is_array(msgs)) {
        add_messages(&b, msgs, have);
        return b.len;
    }
    if (json_is_string(msgs)) { /* Responses' text input */
        if (!have)
            add_piece(&b, "user", 4, msgs);
        return b.len;
    }
    if (!have && (v = json_object_get(root, "prompt")) != NULL) /* /v1/completions */
        add_prompt(&b, v);
    return b.len;
}
