/* m40_ui: the chat page.
 *
 * One self-contained HTML page (its CSS and JavaScript inline, nothing fetched from
 * elsewhere) is compiled into the module: ngx_m40_module/ui/chat.html, turned into
 * a byte array by ui/embed.sh at build time (build/ui/ngx_http_m40_ui_page.h). The
 * page talks to the API with relative URLs ("v1/models", "v1/chat/completions"), so
 * it works where the API is reachable under the page's directory: m40_ui and m40_api
 * in one location (what `m40 serve` writes), or the page at "/" beside the API.
 *
 * The page is served at the location's own URI only ("/" for `location /`, and
 * "/index.html" there too): every other URI of a location that also has m40_api
 * stays the API's (JSON 404 for a typo, not a page), and a location with m40_ui
 * alone answers 404 to anything else. */
#include "ngx_http_m40_module.h"
#include "ngx_http_m40_ui_page.h"   /* generated: ngx_http_m40_ui_page[] */


static ngx_int_t ngx_http_m40_ui_handler(ngx_http_request_t *r);


/* m40_ui on|off (location) */
char *
ngx_http_m40_ui(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_m40_loc_conf_t *lcf = conf;

    ngx_str_t                 *value;
    ngx_http_core_loc_conf_t  *clcf;

    if (lcf->ui != NGX_CONF_UNSET) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (ngx_strcasecmp(value[1].data, (u_char *) "on") == 0) {
        lcf->ui = 1;

    } else if (ngx_strcasecmp(value[1].data, (u_char *) "off") == 0) {
        lcf->ui = 0;
        return NGX_CONF_OK;

    } else {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid value \"%V\" in \"%V\" directive, "
                           "it must be \"on\" or \"off\"",
                           &value[1], &cmd->name);
        return NGX_CONF_ERROR;
    }

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);

    /* The page lives at the location's URI: a regex or named location has none. */
    if (clcf->named
#if (NGX_PCRE)
        || clcf->regex
#endif
        )
    {
        return "needs a prefix or exact location (\"location /\", "
               "\"location = /chat\")";
    }

    /* With m40_api in the same location, its handler serves the page first
     * (ngx_http_m40_ui_serve); m40_api may come before or after this line. */
    if (lcf->api != 1) {
        clcf->handler = ngx_http_m40_ui_handler;
    }

    return NGX_CONF_OK;
}


/* NGX_DECLINED when the request's URI is not the page's. */
ngx_int_t
ngx_http_m40_ui_serve(ngx_http_request_t *r)
{
    size_t                     n;
    ngx_int_t                  rc;
    ngx_buf_t                 *b;
    ngx_chain_t                out;
    ngx_table_elt_t           *h;
    ngx_http_core_loc_conf_t  *clcf;

    static const struct {
        ngx_str_t  key;
        ngx_str_t  value;
    } headers[] = {
        /* everything is inline; the page may only talk to its own origin */
        { ngx_string("Content-Security-Policy"),
          ngx_string("default-src 'none'; script-src 'unsafe-inline'; "
                     "style-src 'unsafe-inline'; connect-src 'self'; "
                     "img-src data:; base-uri 'none'; form-action 'none'; "
                     "frame-ancestors 'none'") },
        { ngx_string("X-Content-Type-Options"), ngx_string("nosniff") },
        { ngx_string("Referrer-Policy"), ngx_string("no-referrer") },
        /* a new module build brings a new page: never a stale copy */
        { ngx_string("Cache-Control"), ngx_string("no-cache") },
    };

    clcf = ngx_http_get_module_loc_conf(r, ngx_http_core_module);
    n = clcf->name.len;

    if (!(r->uri.len == n
          && ngx_strncmp(r->uri.data, clcf->name.data, n) == 0)
        && !(n > 0 && clcf->name.data[n - 1] == '/'
             && r->uri.len == n + sizeof("index.html") - 1
             && ngx_strncmp(r->uri.data, clcf->name.data, n) == 0
             && ngx_strncmp(r->uri.data + n, "index.html",
                            sizeof("index.html") - 1) == 0))
    {
        return NGX_DECLINED;
    }

    if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
        h = ngx_list_push(&r->headers_out.headers);
        if (h == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
        h->hash = 1;
        ngx_str_set(&h->key, "Allow");
        ngx_str_set(&h->value, "GET, HEAD");
        return NGX_HTTP_NOT_ALLOWED;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    for (n = 0; n < sizeof(headers) / sizeof(headers[0]); n++) {
        h = ngx_list_push(&r->headers_out.headers);
        if (h == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
        h->hash = 1;
        h->key = headers[n].key;
        h->value = headers[n].value;
    }

    r->headers_out.status = NGX_HTTP_OK;
    r->headers_out.content_length_n = ngx_http_m40_ui_page_len;
    ngx_str_set(&r->headers_out.content_type, "text/html; charset=utf-8");
    r->headers_out.content_type_len = sizeof("text/html") - 1;

    rc = ngx_http_send_header(r);
    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    b = ngx_calloc_buf(r->pool);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    b->pos = (u_char *) ngx_http_m40_ui_page;
    b->last = b->pos + ngx_http_m40_ui_page_len;
    b->memory = 1;              /* read-only: the page is shared by all requests */
    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}


/* The content handler of a location with m40_ui and no m40_api. */
static ngx_int_t
ngx_http_m40_ui_handler(ngx_http_request_t *r)
{
    ngx_int_t  rc;

    rc = ngx_http_m40_ui_serve(r);
    if (rc != NGX_DECLINED) {
        return rc;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    return NGX_HTTP_NOT_FOUND;
}
