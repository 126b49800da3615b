/* nginx's own error pages in OpenAI's error shape (Anthropic's on the /v1/messages
 * paths), in the servers that serve m40.
 *
 * Some 4xx and 5xx never reach m40's handlers: a body over client_max_body_size (413),
 * a malformed request (invalid chunk size, Content-Length with chunked, a negative or
 * duplicate Content-Length, an HTTP/2 preface on an HTTP/1 port: 400), a header too large
 * (494), a request timeout (408). nginx answers them with its HTML "special response";
 * an SDK expects JSON it can parse. In a server where a location has m40_api, this
 * header/body filter pair replaces exactly those responses (nginx sets r->err_status and
 * text/html for them) by {"error": {...}} with the same status; m40's own errors, the
 * pages of the operator's error_page directives and every other server are left alone. */
#include "ngx_http_m40_module.h"

/* The responses this filter rewrites are marked by the address of their content type:
 * the header filter points it at json_type, the body filter at json_sent once the JSON
 * is out (the module's request context belongs to the API handlers, so the marks live in
 * the response itself). */
static u_char  ngx_http_m40_errpage_json_type[] = "application/json";
static u_char  ngx_http_m40_errpage_json_sent[] = "application/json";

static ngx_http_output_header_filter_pt  ngx_http_next_header_filter;
static ngx_http_output_body_filter_pt    ngx_http_next_body_filter;


static const char *
ngx_http_m40_errpage_message(ngx_uint_t status)
{
    switch (status) {
    case NGX_HTTP_BAD_REQUEST:
        return "malformed HTTP request";
    case NGX_HTTP_REQUEST_TIME_OUT:
        return "the request was not received in time";
    case NGX_HTTP_LENGTH_REQUIRED:
        return "the request needs a Content-Length or a chunked body";
    case NGX_HTTP_REQUEST_ENTITY_TOO_LARGE:
        return "the request body is larger than this server accepts "
               "(client_max_body_size)";
    case NGX_HTTP_REQUEST_URI_TOO_LARGE:
        return "the request URI is too long";
    case NGX_HTTP_REQUEST_HEADER_TOO_LARGE:
        return "a request header is too large";
    case NGX_HTTP_NOT_ALLOWED:
        return "method not allowed";
    case NGX_HTTP_NOT_FOUND:
        return "not found";
    case NGX_HTTP_FORBIDDEN:
        return "forbidden";
    case NGX_HTTP_NOT_IMPLEMENTED:
        return "not implemented";
    case NGX_HTTP_SERVICE_UNAVAILABLE:
        return "the service is unavailable";
    default:
        return status >= 500 ? "internal server error" : "the request was refused";
    }
}


/* Anthropic's Messages API paths answer in Anthropic's error shape. */
static ngx_uint_t
ngx_http_m40_errpage_anthropic(ngx_http_request_t *r)
{
    static const ngx_str_t  paths[] = { ngx_string("/v1/messages"),
                                        ngx_string("/v1/messages/count_tokens") };
    ngx_uint_t              i;

    for (i = 0; i < sizeof(paths) / sizeof(paths[0]); i++) {
        if (r->uri.len >= paths[i].len
            && ngx_strncmp(r->uri.data + r->uri.len - paths[i].len,
                           paths[i].data, paths[i].len) == 0)
        {
            return 1;
        }
    }

    return 0;
}


/* The body for status: constant texts, no escaping needed. Returns its end. */
static u_char *
ngx_http_m40_errpage_body(ngx_http_request_t *r, u_char *buf, size_t len,
    ngx_uint_t status)
{
    if (ngx_http_m40_errpage_anthropic(r)) {
        return ngx_snprintf(buf, len,
                            "{\"type\":\"error\",\"error\":{\"type\":\"%s\","
                            "\"message\":\"%s\"}}\n",
                            ngx_http_m40_anthropic_error_type(status),
                            ngx_http_m40_errpage_message(status));
    }

    return ngx_snprintf(buf, len,
                        "{\"error\":{\"message\":\"%s\",\"type\":\"%s\","
                        "\"param\":null,\"code\":\"http_%ui\"}}\n",
                        ngx_http_m40_errpage_message(status),
                        status >= 500 ? "server_error"
                                      : "invalid_request_error",
                        status);
}


static ngx_int_t
ngx_http_m40_errpage_header_filter(ngx_http_request_t *r)
{
    u_char                    buf[512];
    ngx_http_m40_srv_conf_t  *scf;

    scf = ngx_http_get_module_srv_conf(r, ngx_http_m40_module);

    /* r->error_page: the operator's own error_page answered it; theirs stands */
    if (r != r->main || scf == NULL || !scf->json_errors || r->error_page
        || r->err_status < NGX_HTTP_BAD_REQUEST
        || r->headers_out.content_type.len < sizeof("text/html") - 1
        || ngx_strncmp(r->headers_out.content_type.data, "text/html",
                       sizeof("text/html") - 1) != 0)
    {
        return ngx_http_next_header_filter(r);
    }

    r->headers_out.content_type.data = ngx_http_m40_errpage_json_type;
    r->headers_out.content_type.len = sizeof(ngx_http_m40_errpage_json_type) - 1;
    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;
    r->headers_out.charset.len = 0;
    r->headers_out.content_length_n =
        ngx_http_m40_errpage_body(r, buf, sizeof(buf), r->err_status) - buf;
    if (r->headers_out.content_length) {
        r->headers_out.content_length->hash = 0;
        r->headers_out.content_length = NULL;
    }

    return ngx_http_next_header_filter(r);
}


static ngx_int_t
ngx_http_m40_errpage_body_filter(ngx_http_request_t *r, ngx_chain_t *in)
{
    u_char       *type;
    ngx_buf_t    *b;
    ngx_chain_t   out, *cl;

    type = r->headers_out.content_type.data;
    if (type != ngx_http_m40_errpage_json_type
        && type != ngx_http_m40_errpage_json_sent)
    {
        return ngx_http_next_body_filter(r, in);
    }

    /* nginx's HTML is consumed, never sent */
    for (cl = in; cl; cl = cl->next) {
        cl->buf->pos = cl->buf->last;
        cl->buf->file_pos = cl->buf->file_last;
    }

    if (type == ngx_http_m40_errpage_json_sent) {
        return NGX_OK;
    }

    r->headers_out.content_type.data = ngx_http_m40_errpage_json_sent;

    b = ngx_create_temp_buf(r->pool, 512);
    if (b == NULL) {
        return NGX_ERROR;
    }
    b->last = ngx_http_m40_errpage_body(r, b->pos, 512, r->err_status);
    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    out.buf = b;
    out.next = NULL;

    return ngx_http_next_body_filter(r, &out);
}


ngx_int_t
ngx_http_m40_errors_init(ngx_conf_t *cf)
{
    ngx_http_next_header_filter = ngx_http_top_header_filter;
    ngx_http_top_header_filter = ngx_http_m40_errpage_header_filter;

    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_m40_errpage_body_filter;

    return NGX_OK;
}
