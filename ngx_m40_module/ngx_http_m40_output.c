/* JSON into nginx buffers, the pieces of OpenAI response objects (envelope,
 * usage, logprobs), OpenAI-shaped error responses, UTF-8 repair.
 *
 * jansson serializes straight into pool memory: json_dumpb() with no buffer
 * measures, a second call fills a buffer of exactly that size. */
#include "ngx_http_m40_module.h"

#include <math.h>

#define NGX_HTTP_M40_JSON_FLAGS  (JSON_COMPACT)


/* Writes prefix + json + suffix into b (which must have room: see
 * ngx_http_m40_json_size). Returns the bytes written, 0 on failure. */
size_t
ngx_http_m40_json_write(json_t *json, ngx_buf_t *b, const char *prefix,
    const char *suffix)
{
    size_t  n, room, pl, sl;

    pl = prefix ? ngx_strlen(prefix) : 0;
    sl = suffix ? ngx_strlen(suffix) : 0;
    room = (size_t) (b->end - b->last);

    if (room < pl + sl) {
        return 0;
    }

    if (pl) {
        b->last = ngx_cpymem(b->last, prefix, pl);
    }

    n = json_dumpb(json, (char *) b->last, room - pl - sl,
                   NGX_HTTP_M40_JSON_FLAGS);
    if (n == 0 || n > room - pl - sl) {
        b->last -= pl;
        return 0;
    }

    b->last += n;

    if (sl) {
        b->last = ngx_cpymem(b->last, suffix, sl);
    }

    return pl + n + sl;
}


ngx_buf_t *
ngx_http_m40_json_buf(ngx_pool_t *pool, json_t *json, const char *prefix,
    const char *suffix)
{
    size_t      size;
    ngx_buf_t  *b;

    size = json_dumpb(json, NULL, 0, NGX_HTTP_M40_JSON_FLAGS);
    if (size == 0) {
        return NULL;
    }

    size += (prefix ? ngx_strlen(prefix) : 0) + (suffix ? ngx_strlen(suffix) : 0);

    b = ngx_create_temp_buf(pool, size);
    if (b == NULL) {
        return NULL;
    }

    if (ngx_http_m40_json_write(json, b, prefix, suffix) == 0) {
        return NULL;
    }

    return b;
}


/* Length of the valid UTF-8 sequence at p (1..4), 0 when invalid. */
static size_t
ngx_http_m40_utf8_seq(const u_char *p, size_t n)
{
    size_t    len, i;
    uint32_t  cp;

    if (p[0] < 0x80) {
        return 1;
    }

    if ((p[0] & 0xe0) == 0xc0) {
        len = 2; cp = p[0] & 0x1f;
    } else if ((p[0] & 0xf0) == 0xe0) {
        len = 3; cp = p[0] & 0x0f;
    } else if ((p[0] & 0xf8) == 0xf0) {
        len = 4; cp = p[0] & 0x07;
    } else {
        return 0;
    }

    if (n < len) {
        return 0;
    }

    for (i = 1; i < len; i++) {
        if ((p[i] & 0xc0) != 0x80) {
            return 0;
        }
        cp = (cp << 6) | (p[i] & 0x3f);
    }

    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800)
        || (len == 4 && cp < 0x10000) || cp > 0x10ffff
        || (cp >= 0xd800 && cp <= 0xdfff))
    {
        return 0;
    }

    return len;
}


/* A JSON string of s; invalid UTF-8 (a token that ends inside a character, for
 * example) becomes U+FFFD instead of failing the whole response. */
json_t *
ngx_http_m40_json_text(const char *s, size_t len)
{
    u_char        *out, *o;
    size_t         i, k;
    json_t        *j;
    const u_char  *p = (const u_char *) s;

    j = json_stringn(s, len);
    if (j) {
        return j;
    }

    out = malloc(len * 3 + 1);
    if (out == NULL) {
        return NULL;
    }

    o = out;
    for (i = 0; i < len; /* void */) {
        k = ngx_http_m40_utf8_seq(p + i, len - i);
        if (k == 0 || (k == 1 && p[i] == 0)) {
            if (k == 0) {
                *o++ = 0xef; *o++ = 0xbf; *o++ = 0xbd;
            }
            i++;
            continue;
        }
        o = ngx_cpymem(o, p + i, k);
        i += k;
    }

    j = json_stringn((const char *) out, (size_t) (o - out));
    free(out);

    return j;
}


ngx_int_t
ngx_http_m40_send_json(ngx_http_request_t *r, ngx_uint_t status, json_t *json)
{
    ngx_int_t    rc;
    ngx_buf_t   *b;
    ngx_chain_t  out;

    b = ngx_http_m40_json_buf(r->pool, json, NULL, "\n");
    if (b == NULL) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "m40: cannot serialize a JSON response");
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    r->headers_out.status = status;
    r->headers_out.content_length_n = b->last - b->pos;
    ngx_str_set(&r->headers_out.content_type, "application/json");
    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;

    rc = ngx_http_send_header(r);
    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}


void
ngx_http_m40_error_set(ngx_http_m40_error_t *err, ngx_uint_t status,
    const char *type, const char *param, const char *code, const char *fmt, ...)
{
    u_char   *p;
    va_list   args;

    err->status = status;
    err->type = type;
    err->param = param;
    err->code = code;

    va_start(args, fmt);
    p = ngx_vslprintf((u_char *) err->message,
                      (u_char *) err->message + sizeof(err->message) - 1,
                      fmt, args);
    va_end(args);
    *p = '\0';
}


json_t *
ngx_http_m40_error_json(ngx_http_m40_error_t *err)
{
    json_t  *e;

    e = json_object();
    if (e == NULL) {
        return NULL;
    }

    json_object_set_new(e, "message",
                        ngx_http_m40_json_text(err->message,
                                               ngx_strlen(err->message)));
    json_object_set_new(e, "type", json_string(err->type));
    json_object_set_new(e, "param",
                        err->param ? json_string(err->param) : json_null());
    json_object_set_new(e, "code",
                        err->code ? json_string(err->code) : json_null());

    return json_pack("{s:o}", "error", e);
}


ngx_int_t
ngx_http_m40_send_error(ngx_http_request_t *r, ngx_http_m40_error_t *err)
{
    json_t           *j;
    ngx_int_t         rc;
    ngx_uint_t           level;
    ngx_table_elt_t     *h;
    ngx_http_m40_ctx_t  *ctx;


    level = (err->status >= 500) ? NGX_LOG_ERR : NGX_LOG_INFO;
    ngx_log_error(level, r->connection->log, 0, "m40: %ui %s", err->status,
                  err->message);

    if (err->status == NGX_HTTP_TOO_MANY_REQUESTS
        || err->status == NGX_HTTP_SERVICE_UNAVAILABLE)
    {
        h = ngx_list_push(&r->headers_out.headers);
        if (h == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
        h->hash = 1;
        ngx_str_set(&h->key, "Retry-After");
        ngx_str_set(&h->value, "1");
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_m40_module);
    j = ctx && ctx->dialect && ctx->dialect->error_json
        ? ctx->dialect->error_json(err) : ngx_http_m40_error_json(err);
    if (j == NULL) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "m40: cannot build an error response");
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    rc = ngx_http_m40_send_json(r, err->status, j);
    json_decref(j);

    return rc;
}


ngx_int_t
ngx_http_m40_send_simple_error(ngx_http_request_t *r, ngx_uint_t status,
    const char *type, const char *code, const char *fmt, ...)
{
    u_char                *p;
    va_list                args;
    ngx_http_m40_error_t   err;

    err.status = status;
    err.type = type;
    err.param = NULL;
    err.code = code;

    va_start(args, fmt);
    p = ngx_vslprintf((u_char *) err.message,
                      (u_char *) err.message + sizeof(err.message) - 1,
                      fmt, args);
    va_end(args);
    *p = '\0';

    return ngx_http_m40_send_error(r, &err);
}


/* ---- response objects ---- */

const char *
ngx_http_m40_finish_reason(m40_finish f)
{
    switch (f) {
    case M40_FINISH_LENGTH:
        return "length";
    case M40_FINISH_CANCELLED:
        return "abort";
    default:
        return "stop";
    }
}


/* The choices share one prompt: it counts once, and cached_tokens is what the
 * least lucky choice found in the prefix cache (the others of n > 1 find the blocks
 * the first one computes). */
json_t *
ngx_http_m40_usage_json(ngx_http_m40_ctx_t *ctx)
{
    int32_t     prompt, cached, completion;
    ngx_uint_t  i;

    prompt = 0;
    cached = ctx->n > 0 ? ctx->choices[0].cached_tokens : 0;
    completion = 0;

    for (i = 0; i < ctx->n; i++) {
        if (ctx->choices[i].prompt_tokens > prompt) {
            prompt = ctx->choices[i].prompt_tokens;
        }
        if (ctx->choices[i].cached_tokens < cached) {
            cached = ctx->choices[i].cached_tokens;
        }
        completion += ctx->choices[i].completion_tokens;
    }

    return json_pack("{s:i,s:i,s:i,s:{s:i}}", "prompt_tokens", (int) prompt,
                     "completion_tokens", (int) completion,
                     "total_tokens", (int) (prompt + completion),
                     "prompt_tokens_details", "cached_tokens", (int) cached);
}


json_t *
ngx_http_m40_object(ngx_http_m40_ctx_t *ctx, const char *object,
    json_t *choices)
{
    return json_pack("{s:s,s:s,s:I,s:s%,s:o}",
                     "id", ctx->id,
                     "object", object,
                     "created", (json_int_t) ctx->created,
                     "model", (const char *) ctx->model->model_name.data,
                     (size_t) ctx->model->model_name.len,
                     "choices", choices);
}


/* ---- logprobs ---- */

static double
ngx_http_m40_logprob_value(float lp)
{
    /* JSON has no infinities; OpenAI reports impossible tokens as -9999 */
    return isfinite(lp) ? (double) lp : -9999.0;
}


static json_t *
ngx_http_m40_token_json(const m40_token_logprob *t)
{
    int32_t  i, n;
    json_t  *bytes;

    n = t->n_bytes < 0 ? 0 : (t->n_bytes > 64 ? 64 : t->n_bytes);

    bytes = json_array();
    for (i = 0; bytes && i < n; i++) {
        json_array_append_new(bytes, json_integer((u_char) t->bytes[i]));
    }

    return json_pack("{s:o,s:f,s:o}",
                     "token", ngx_http_m40_json_text(t->bytes, (size_t) n),
                     "logprob", ngx_http_m40_logprob_value(t->logprob),
                     "bytes", bytes);
}


/* Appends the logprobs of one TEXT event: to a chat "content" array, or to the
 * four parallel arrays of a legacy completions logprobs object. */
ngx_int_t
ngx_http_m40_logprobs_add(ngx_http_m40_ctx_t *ctx, ngx_http_m40_choice_t *ch,
    json_t *lp, m40_event *ev)
{
    int32_t                   i, k, n_top;
    json_t                   *entry, *top, *alt;
    const m40_token_logprob  *t, *a;

    if (ev->tokens == NULL) {
        return NGX_OK;
    }

    n_top = ev->top ? ev->n_top : 0;

    for (i = 0; i < ev->n_tokens; i++) {
        t = &ev->tokens[i];

        if (ctx->kind == NGX_HTTP_M40_CHAT) {
            entry = ngx_http_m40_token_json(t);
            top = json_array();
            if (entry == NULL || top == NULL) {
                json_decref(entry);
                json_decref(top);
                return NGX_ERROR;
            }

            for (k = 0; k < n_top; k++) {
                alt = ngx_http_m40_token_json(&ev->top[i * n_top + k]);
                if (alt == NULL || json_array_append_new(top, alt) != 0) {
                    json_decref(entry);
                    json_decref(top);
                    return NGX_ERROR;
                }
            }

            json_object_set_new(entry, "top_logprobs", top);

            if (json_array_append_new(lp, entry) != 0) {
                return NGX_ERROR;
            }

            continue;
        }

        top = json_object();
        if (top == NULL) {
            return NGX_ERROR;
        }

        for (k = 0; k < n_top; k++) {
            a = &ev->top[i * n_top + k];
            alt = ngx_http_m40_json_text(a->bytes, (size_t) (a->n_bytes < 0
                                         ? 0 : ngx_min(a->n_bytes, 64)));
            if (alt == NULL) {
                json_decref(top);
                return NGX_ERROR;
            }
            json_object_set_new(top, json_string_value(alt),
                                json_real(ngx_http_m40_logprob_value(a->logprob)));
            json_decref(alt);
        }

        json_array_append_new(json_object_get(lp, "tokens"),
                              ngx_http_m40_json_text(t->bytes,
                                  (size_t) (t->n_bytes < 0
                                            ? 0 : ngx_min(t->n_bytes, 64))));
        json_array_append_new(json_object_get(lp, "token_logprobs"),
                              json_real(ngx_http_m40_logprob_value(t->logprob)));
        json_array_append_new(json_object_get(lp, "top_logprobs"), top);
        json_array_append_new(json_object_get(lp, "text_offset"),
                              json_integer((json_int_t) ch->text_offset));

        ch->text_offset += (size_t) (t->n_bytes < 0 ? 0 : t->n_bytes);
    }

    return NGX_OK;
}
