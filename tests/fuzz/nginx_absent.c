/* fuzz_sse links the module's ngx_http_m40_output.c, whose other functions call into
 * nginx (send a header, log, format an error). nginx is not in the harness, and these
 * calls are never on the path the harness drives (UTF-8 repair, event writing): each
 * one stops the run loudly if it ever is. Declared as nginx declares them. */
#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include <stdio.h>
#include <stdlib.h>

static void absent(const char *fn)
{
    fprintf(stderr, "fuzz_sse: reached %s, which needs a running nginx\n", fn);
    abort();
}

ngx_buf_t *ngx_create_temp_buf(ngx_pool_t *pool, size_t size)
{
    absent("ngx_create_temp_buf");
    return NULL;
}

ngx_int_t ngx_http_output_filter(ngx_http_request_t *r, ngx_chain_t *chain)
{
    absent("ngx_http_output_filter");
    return NGX_ERROR;
}

ngx_int_t ngx_http_send_header(ngx_http_request_t *r)
{
    absent("ngx_http_send_header");
    return NGX_ERROR;
}

void *ngx_list_push(ngx_list_t *list)
{
    absent("ngx_list_push");
    return NULL;
}

void ngx_log_error_core(ngx_uint_t level, ngx_log_t *log, ngx_err_t err, const char *fmt, ...)
{
    absent("ngx_log_error_core");
}

u_char *ngx_vslprintf(u_char *buf, u_char *last, const char *fmt, va_list args)
{
    absent("ngx_vslprintf");
    return buf;
}

/* The module object: ngx_http_m40_send_error reads the request's module context through
 * it (the Anthropic error shape of /v1/messages). Never reached by the harness, like the
 * functions above; zeroed, as nginx's own would be before its init. */
ngx_module_t ngx_http_m40_module;
