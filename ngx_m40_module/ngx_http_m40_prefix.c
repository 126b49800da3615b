/* $m40_prefix_hash: a hash of the leading part of a request's prompt, for a front
 * nginx that balances several m40 hosts with `hash $m40_prefix_hash consistent;`,
 * so that requests sharing a system prompt land on the host whose prefix cache
 * holds its KV blocks (conf/multi-host.conf).
 *
 * The front has no model: it cannot render the chat template nor tokenize, so the
 * hash is not over the rendered prompt's first blocks but over what a template
 * renders first, taken from the JSON body:
 *   - the system part: top-level "system" (/v1/messages), top-level "instructions"
 *     (/v1/responses), then the leading "system"/"developer" messages of "messages"
 *     (/v1/chat/completions) or "input" (/v1/responses), in order;
 *   - without any system part, the first message (usually the user's) instead, so a
 *     conversation without a system prompt still keeps its turns on one host;
 *   - /v1/completions: "prompt" (a string, the first of an array of strings, or
 *     token ids written in decimal).
 * Each piece is written as role "\n" text "\0" (text parts of array contents joined
 * by "\n"), the whole cut to m40_prefix_hash_bytes, and hashed with FNV-1a 64 into
 * 16 hex digits. Two requests with the same system prompt get the same value
 * whatever their user text; the value says nothing of what follows the cut.
 *
 * Bounded work on the event loop: the body is parsed with jansson only when it is
 * under NGX_HTTP_M40_PREFIX_PARSE_MAX (256 KB, about 2.5 ms of CPU at jansson's
 * 10 ms per MB; jansson needs the whole document, and its nesting depth is capped
 * at 2048). A larger body is not parsed: its first m40_prefix_hash_bytes raw bytes
 * are hashed (stable for one client, which writes the same leading fields, system
 * prompt first, the same way each time). Reading a body that nginx wrote to a temp
 * file reads at most that many bytes of it.
 *
 * No body (GET, or the variable evaluated before the body was read), a body still
 * being read (proxy_request_buffering off), invalid JSON or JSON without any of the
 * fields: the empty string, never an error. nginx's hash balancer (plain and
 * consistent) sends a request whose key is empty to its round-robin peer: those
 * requests are spread, not piled onto one host. */
#include "ngx_http_m40_module.h"


#define NGX_HTTP_M40_PREFIX_PARSE_MAX  (256 * 1024)

#define NGX_HTTP_M40_FNV_OFFSET  0xcbf29ce484222325ULL
#define NGX_HTTP_M40_FNV_PRIME   0x100000001b3ULL


/* The canonical bytes, cut at cap. */
typedef struct {
    u_char  *buf;
    size_t   len;
    size_t   cap;
} ngx_http_m40_prefix_buf_t;


static ngx_int_t ngx_http_m40_prefix_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data);


static ngx_str_t  ngx_http_m40_prefix_hash_name = ngx_string("m40_prefix_hash");


ngx_int_t
ngx_http_m40_prefix_add_variables(ngx_conf_t *cf)
{
    ngx_http_variable_t  *var;

    /* Not NGX_HTTP_VAR_NOCACHEABLE: the handler says per evaluation whether its
     * value may be kept (only once the whole body was there to hash). */
    var = ngx_http_add_variable(cf, &ngx_http_m40_prefix_hash_name, 0);
    if (var == NULL) {
        return NGX_ERROR;
    }

    var->get_handler = ngx_http_m40_prefix_variable;

    return NGX_OK;
}


static uint64_t
ngx_http_m40_fnv1a64(const u_char *p, size_t len)
{
    uint64_t  h = NGX_HTTP_M40_FNV_OFFSET;

    while (len--) {
        h ^= *p++;
        h *= NGX_HTTP_M40_FNV_PRIME;
    }

    return h;
}


static void
ngx_http_m40_prefix_add(ngx_http_m40_prefix_buf_t *b, const void *data,
    size_t len)
{
    if (len > b->cap - b->len) {
        len = b->cap - b->len;
    }

    ngx_memcpy(b->buf + b->len, data, len);
    b->len += len;
}


static ngx_flag_t
ngx_http_m40_prefix_full(ngx_http_m40_prefix_buf_t *b)
{
    return b->len >= b->cap;
}


/* A message's text: a string, or the "text" of the text parts of an array
 * (chat's {"type":"text"}, Anthropic's text blocks, Responses' input_text);
 * images and other parts are left out. */
static void
ngx_http_m40_prefix_text(ngx_http_m40_prefix_buf_t *b, json_t *content)
{
    size_t       i;
    json_t      *part, *text, *type;
    ngx_flag_t   first;

    if (json_is_string(content)) {
        ngx_http_m40_prefix_add(b, json_string_value(content),
                                json_string_length(content));
        return;
    }

    if (!json_is_array(content)) {
        return;
    }

    first = 1;
    json_array_foreach(content, i, part) {
        if (ngx_http_m40_prefix_full(b)) {
            return;
        }

        if (json_is_string(part)) {
            text = part;

        } else if (json_is_object(part)) {
            type = json_object_get(part, "type");
            if (type != NULL && json_is_string(type)
                && ngx_strcmp(json_string_value(type), "text") != 0
                && ngx_strcmp(json_string_value(type), "input_text") != 0
                && ngx_strcmp(json_string_value(type), "output_text") != 0)
            {
                continue;
            }

            text = json_object_get(part, "text");
            if (!json_is_string(text)) {
                continue;
            }

        } else {
            continue;
        }

        if (!first) {
            ngx_http_m40_prefix_add(b, "\n", 1);
        }

        first = 0;
        ngx_http_m40_prefix_add(b, json_string_value(text),
                                json_string_length(text));
    }
}


static void
ngx_http_m40_prefix_piece(ngx_http_m40_prefix_buf_t *b, const char *role,
    size_t role_len, json_t *content)
{
    ngx_http_m40_prefix_add(b, role, role_len);
    ngx_http_m40_prefix_add(b, "\n", 1);
    ngx_http_m40_prefix_text(b, content);
    ngx_http_m40_prefix_add(b, "", 1);
}


/* The leading system/developer messages of a "messages" or "input" array; without
 * any system part so far (have == 0), its first message instead. */
static void
ngx_http_m40_prefix_messages(ngx_http_m40_prefix_buf_t *b, json_t *msgs,
    ngx_flag_t have)
{
    size_t       i, len;
    json_t      *m, *role;
    const char  *name;

    json_array_foreach(msgs, i, m) {
        if (ngx_http_m40_prefix_full(b) || !json_is_object(m)) {
            return;
        }

        role = json_object_get(m, "role");
        if (!json_is_string(role)) {
            return;     /* e.g. a Responses function_call item: past the start */
        }

        name = json_string_value(role);
        len = json_string_length(role);

        if (ngx_strcmp(name, "system") == 0
            || ngx_strcmp(name, "developer") == 0)
        {
            ngx_http_m40_prefix_piece(b, name, len,
                                      json_object_get(m, "content"));
            have = 1;
            continue;
        }

        if (!have) {
            ngx_http_m40_prefix_piece(b, name, len,
                                      json_object_get(m, "content"));
        }

        return;
    }
}


/* /v1/completions' prompt: a string, an array of strings (the first), token ids
 * or an array of arrays of them (the first, in decimal). */
static void
ngx_http_m40_prefix_prompt(ngx_http_m40_prefix_buf_t *b, json_t *prompt)
{
    size_t   i;
    u_char   num[NGX_INT64_LEN + 2], *e;
    json_t  *first, *t;

    if (json_is_array(prompt) && json_array_size(prompt) > 0) {
        first = json_array_get(prompt, 0);
        if (json_is_string(first) || json_is_array(first)) {
            prompt = first;
        }
    }

    ngx_http_m40_prefix_add(b, "prompt\n", sizeof("prompt\n") - 1);

    if (json_is_string(prompt)) {
        ngx_http_m40_prefix_add(b, json_string_value(prompt),
                                json_string_length(prompt));
        return;
    }

    if (!json_is_array(prompt)) {
        return;
    }

    json_array_foreach(prompt, i, t) {
        if (ngx_http_m40_prefix_full(b)) {
            return;
        }

        if (!json_is_integer(t)) {
            continue;
        }

        e = ngx_sprintf(num, "%L,", (int64_t) json_integer_value(t));
        ngx_http_m40_prefix_add(b, num, e - num);
    }
}


/* The canonical bytes of a parsed body (nothing when it has none of the fields). */
static void
ngx_http_m40_prefix_canonical(ngx_http_m40_prefix_buf_t *b, json_t *root)
{
    json_t      *v, *msgs;
    ngx_flag_t   have;

    if (!json_is_object(root)) {
        return;
    }

    have = 0;

    v = json_object_get(root, "system");                 /* /v1/messages */
    if (json_is_string(v) || json_is_array(v)) {
        ngx_http_m40_prefix_piece(b, "system", sizeof("system") - 1, v);
        have = 1;
    }

    v = json_object_get(root, "instructions");           /* /v1/responses */
    if (json_is_string(v)) {
        ngx_http_m40_prefix_piece(b, "system", sizeof("system") - 1, v);
        have = 1;
    }

    msgs = json_object_get(root, "messages");
    if (!json_is_array(msgs)) {
        msgs = json_object_get(root, "input");
    }

    if (json_is_array(msgs)) {
        ngx_http_m40_prefix_messages(b, msgs, have);
        return;
    }

    if (json_is_string(msgs)) {                           /* Responses' text input */
        if (!have) {
            ngx_http_m40_prefix_piece(b, "user", sizeof("user") - 1, msgs);
        }
        return;
    }

    if (have) {
        return;
    }

    v = json_object_get(root, "prompt");                  /* /v1/completions */
    if (v != NULL) {
        ngx_http_m40_prefix_prompt(b, v);
    }
}


/* Up to max bytes of the body from its start into p (memory buffers, or the temp
 * file nginx wrote a large body to); the count, or -1 when the file read fails. */
static ssize_t
ngx_http_m40_prefix_read(ngx_http_request_t *r, u_char *p, size_t max)
{
    off_t         size;
    size_t        got, n;
    ssize_t       rd;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    got = 0;

    for (cl = r->request_body->bufs; cl && got < max; cl = cl->next) {
        b = cl->buf;

        if (ngx_buf_special(b) || ngx_buf_size(b) == 0) {
            continue;
        }

        if (ngx_buf_in_memory(b)) {
            n = ngx_min((size_t) (b->last - b->pos), max - got);
            p = ngx_cpymem(p, b->pos, n);
            got += n;
            continue;
        }

        if (!b->in_file || b->file == NULL) {
            return -1;
        }

        size = b->file_last - b->file_pos;
        n = (size_t) ngx_min(size, (off_t) (max - got));
        rd = ngx_read_file(b->file, p, n, b->file_pos);
        if (rd < 0 || (size_t) rd != n) {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "m40: $m40_prefix_hash: reading the request body "
                          "from \"%V\" returned %z of %uz bytes",
                          &b->file->name, rd, n);
            return -1;
        }

        p += n;
        got += n;
    }

    return (ssize_t) got;
}


static off_t
ngx_http_m40_prefix_body_size(ngx_http_request_t *r)
{
    off_t         total;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    total = 0;

    for (cl = r->request_body->bufs; cl; cl = cl->next) {
        b = cl->buf;
        if (!ngx_buf_special(b)) {
            total += ngx_buf_size(b);
        }
    }

    return total;
}


static ngx_int_t
ngx_http_m40_prefix_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data)
{
    off_t                       size;
    size_t                      want;
    ssize_t                     got;
    u_char                     *raw, *hex;
    json_t                     *root;
    json_error_t                jerr;
    ngx_http_request_body_t    *rb;
    ngx_http_m40_loc_conf_t    *lcf;
    ngx_http_m40_prefix_buf_t   b;

    v->valid = 1;
    v->not_found = 0;
    v->no_cacheable = 0;
    v->escape = 0;
    v->len = 0;
    v->data = (u_char *) "";

    rb = r->request_body;

    if (rb == NULL || r->request_body_no_buffering || rb->rest > 0) {
        /* Not read yet, or read as it is forwarded: evaluated again later, the
         * value may differ, so it is not kept. */
        v->no_cacheable = 1;
        return NGX_OK;
    }

    size = ngx_http_m40_prefix_body_size(r);
    if (size == 0) {
        return NGX_OK;
    }

    lcf = ngx_http_get_module_loc_conf(r, ngx_http_m40_module);

    b.cap = lcf->prefix_hash_bytes;
    b.len = 0;

    if (size > NGX_HTTP_M40_PREFIX_PARSE_MAX) {
        b.buf = ngx_pnalloc(r->pool, b.cap);
        if (b.buf == NULL) {
            return NGX_ERROR;
        }

        got = ngx_http_m40_prefix_read(r, b.buf, b.cap);
        if (got <= 0) {
            return NGX_OK;
        }

        b.len = (size_t) got;
        raw = b.buf;

    } else {
        want = (size_t) size;
        raw = ngx_pnalloc(r->pool, want + b.cap);
        if (raw == NULL) {
            return NGX_ERROR;
        }

        got = ngx_http_m40_prefix_read(r, raw, want);
        if (got <= 0) {
            return NGX_OK;
        }

        root = json_loadb((const char *) raw, (size_t) got, 0, &jerr);
        if (root == NULL) {
            ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                           "m40: $m40_prefix_hash: body not JSON: %s",
                           jerr.text);
            return NGX_OK;
        }

        b.buf = raw + want;     /* the canonical bytes, after the body */
        raw = b.buf;
        ngx_http_m40_prefix_canonical(&b, root);
        json_decref(root);

        if (b.len == 0) {
            return NGX_OK;
        }
    }

    hex = ngx_pnalloc(r->pool, 16);
    if (hex == NULL) {
        return NGX_ERROR;
    }

    ngx_sprintf(hex, "%016xL", ngx_http_m40_fnv1a64(raw, b.len));

    v->len = 16;
    v->data = hex;

    return NGX_OK;
}
