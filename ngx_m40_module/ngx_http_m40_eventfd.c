/* An eventfd in the worker's event loop, as a pseudo connection: how another thread
 * (the engine's, the JSON parser's) wakes the loop. The fd belongs to whoever created
 * it; these functions only register it, drain it and take it out again. */
#include "ngx_http_m40_module.h"


/* NULL (logged) when the worker has no free connection or the fd cannot be added. */
ngx_connection_t *
ngx_http_m40_eventfd_add(int fd, ngx_event_handler_pt handler, void *data,
    const char *what, ngx_log_t *log)
{
    ngx_connection_t  *c;

    c = ngx_get_connection(fd, log);
    if (c == NULL) {
        ngx_log_error(NGX_LOG_EMERG, log, 0,
                      "m40: no free connection for the %s eventfd", what);
        return NULL;
    }

    c->data = data;
    c->read->handler = handler;
    c->read->log = log;
    c->write->log = log;

    if (ngx_handle_read_event(c->read, 0) != NGX_OK) {
        ngx_log_error(NGX_LOG_EMERG, log, 0,
                      "m40: cannot add the %s eventfd to the event loop", what);
        c->fd = (ngx_socket_t) -1;
        ngx_free_connection(c);
        return NULL;
    }

    return c;
}


/* Called first by the handler: a notification written after this read makes the fd
 * readable again, so none is lost. */
void
ngx_http_m40_eventfd_drain(ngx_event_t *rev)
{
    ssize_t            rn;
    uint64_t           counter;
    ngx_connection_t  *c;

    c = rev->data;

    for ( ;; ) {
        rn = read(c->fd, &counter, sizeof(counter));
        if (rn == (ssize_t) sizeof(counter)) {
            continue;
        }

        if (rn == -1 && ngx_errno == NGX_EINTR) {
            continue;
        }

        if (rn == -1 && ngx_errno != NGX_EAGAIN) {
            ngx_log_error(NGX_LOG_ALERT, rev->log, ngx_errno,
                          "m40: read() from an eventfd failed");
        }

        break;
    }
}


/* Called last by the handler. */
void
ngx_http_m40_eventfd_rearm(ngx_event_t *rev)
{
    if (ngx_handle_read_event(rev, 0) != NGX_OK) {
        ngx_log_error(NGX_LOG_ALERT, rev->log, 0,
                      "m40: cannot re-arm an eventfd");
    }
}


/* Out of the loop; the fd stays open (its owner closes it). A connection left with
 * its fd would be reported as an "open socket left" when the worker exits. */
void
ngx_http_m40_eventfd_del(ngx_connection_t *c)
{
    if (c->read->active) {
        ngx_del_event(c->read, NGX_READ_EVENT, 0);
    }

    /* with accept_mutex on, a readable fd's event waits in the posted queue: an
     * engine unloaded meanwhile (keep_alive) must not have it run */
    if (c->read->posted) {
        ngx_delete_posted_event(c->read);
    }

    c->fd = (ngx_socket_t) -1;
    ngx_free_connection(c);
}
