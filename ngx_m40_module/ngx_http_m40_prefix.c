/* $m40_prefix_hash: a hash of the leading part of a request's prompt, for a front
 * nginx that balances several m40 hosts with `hash $m40_prefix_hash consistent;`,
 * so that requests sharing a system prompt land on the host whose prefix cache
 * holds its KV blocks (conf/multi-host.conf).
 *
 * The front has no model: it cannot render the chat template nor tokenize, so the
 * hash is not over the rendered prompt's first blocks but over what a template renders
 * first, read from the JSON body: the system part (or, without one, the first message;
 * /v1/completions: the prompt) as canonical bytes (m40_prefix_key.h, plain C and
 * jansson in engine/serve/prefix_key.c, fuzzed by tests/fuzz/fuzz_prefix.c), cut to
 * m40_prefix_hash_bytes and hashed with FNV-1a 64 into 16 hex digits. Two requests
 * with the same system prompt get the same value whatever their user text.
 *
 * Bounded work on the event loop: the body is parsed with jansson only when it is
 * under NGX_HTTP_M40_PREFIX_PARSE_MAX (256 KB, about 2.5 ms of CPU at jansson's
 * 10 ms per MB; jansson needs the whole document, and its nesting depth is capped
 * at 2048). A larger body is not parsed: its first m40_prefix_hash_bytes raw bytes
 * are hashed (stable for one client, which writes the same leading fields, system
 * prompt first, the same way each time). A body that nginx wrote to a temp file
 * (over client_body_buffer_size) is read back from it, the page cache: at most 256 KB
 * to parse, or those first bytes.
 *
 * No body (GET, or the variable evaluated before the body was read), a body still
 * being read (proxy_request_buffering off), invalid JSON or JSON without any of the
 * fields: the empty string, never an error. nginx's hash balancer (plain and
 * consistent) sends a request whose key is empty to its round-robin peer: those
 * requests are spread, not piled onto one host. */
#include "ngx_http_m40_module.h"

#include "m40_prefix_key.h"
#include "util/hash.h"


#define NGX_HTTP_M40_PREFIX_PARSE_MAX  (256 * 1024)


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
    off_t                     size;
    size_t                    cap, len;
    ssize_t                   got;
    u_char                   *body, *key, *hex;
    json_t                   *root;
    json_error_t              jerr;
    ngx_http_request_body_t  *rb;
    ngx_http_m40_loc_conf_t  *lcf;

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
    cap = lcf->prefix_hash_bytes;

    if (size > NGX_HTTP_M40_PREFIX_PARSE_MAX) {
        /* too large to parse here: its first bytes as they are */
        key = ngx_pnalloc(r->pool, cap);
        if (key == NULL) {
            return NGX_ERROR;
        }

        got = ngx_http_m40_prefix_read(r, key, cap);
        if (got <= 0) {
            return NGX_OK;
        }

        len = (size_t) got;

    } else {
        body = ngx_pnalloc(r->pool, (size_t) size + cap);
        if (body == NULL) {
            return NGX_ERROR;
        }

        got = ngx_http_m40_prefix_read(r, body, (size_t) size);
        if (got <= 0) {
            return NGX_OK;
        }

        root = json_loadb((const char *) body, (size_t) got, 0, &jerr);
        if (root == NULL) {
            ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                           "m40: $m40_prefix_hash: body not JSON: %s",
                           jerr.text);
            return NGX_OK;
        }

        key = body + size;      /* the canonical bytes, after the body */
        len = m40_prefix_key(root, key, cap);
        json_decref(root);

        if (len == 0) {
            return NGX_OK;
        }
    }

    hex = ngx_pnalloc(r->pool, 16);
    if (hex == NULL) {
        return NGX_ERROR;
    }

    ngx_sprintf(hex, "%016xL", m40_fnv1a64(key, len));

    v->len = 16;
    v->data = hex;

    return NGX_OK;
}
