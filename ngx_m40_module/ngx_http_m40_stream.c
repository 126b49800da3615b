/* Streaming answers (Server-Sent Events) for /v1/chat/completions and
 * /v1/completions, and the transport of the other dialects' typed events
 * ("event: NAME" lines; the dialect formats them and ends the stream without
 * "[DONE]").
 *
 * Events are pulled from the engine only while the client connection can take
 * them: when nginx cannot send everything (a slow reader), pulling stops, the
 * events wait in the engine's queue, and the write event resumes the pump once the
 * socket drains. Memory here is bounded by one round of chunks (ROUND_BYTES), and
 * chunk buffers are recycled through the free/busy chains. */
#include "ngx_http_m40_module.h"


#define NGX_HTTP_M40_ROUND_BYTES  65536   /* most output pulled per round */

static void ngx_http_m40_stream_writer(ngx_http_request_t *r);


static ngx_int_t
ngx_http_m40_add_header(ngx_http_request_t *r, const char *key,
    const char *value)
{
    ngx_table_elt_t  *h;

    h = ngx_list_push(&r->headers_out.headers);
    if (h == NULL) {
        return NGX_ERROR;
    }

    h->hash = 1;
    h->key.data = (u_char *) key;
    h->key.len = ngx_strlen(key);
    h->value.data = (u_char *) value;
    h->value.len = ngx_strlen(value);

    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_stream_header(ngx_http_m40_ctx_t *ctx)
{
    ngx_http_request_t  *r;

    r = ctx->request;

    r->headers_out.status = NGX_HTTP_OK;
    r->headers_out.content_length_n = -1;
    ngx_str_set(&r->headers_out.content_type, "text/event-stream");
    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;

    if (ngx_http_m40_add_header(r, "Cache-Control", "no-cache") != NGX_OK
        || ngx_http_m40_add_header(r, "X-Accel-Buffering", "no") != NGX_OK)
    {
        return NGX_ERROR;
    }

    ctx->header_sent = 1;

    return ngx_http_send_header(r);
}


/* Points b at [start, end) as an empty temporary buffer of the module. */
static void
ngx_http_m40_buf_reset(ngx_buf_t *b, u_char *start, u_char *end)
{
    ngx_memzero(b, sizeof(ngx_buf_t));
    b->start = start;
    b->end = end;
    b->pos = start;
    b->last = start;
    b->temporary = 1;
    b->tag = (ngx_buf_tag_t) &ngx_http_m40_module;
}


/* Appends "data: JSON\n\n" (after "event: NAME\n" when named) to the chain, in a
 * recycled buffer when one is free. Takes j. The event is dumped straight into a
 * recycled buffer; only when it does not fit (or no buffer is free) is it measured
 * with a second dump and a buffer of that size (4 KB at least) taken from the pool:
 * a token's event almost always fits the 4 KB of the one before it. */
static ngx_int_t
ngx_http_m40_emit_named(ngx_http_m40_ctx_t *ctx, const char *event, json_t *j,
    ngx_chain_t ***last, size_t *bytes)
{
    u_char       *start;
    size_t        need, size;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;
    u_char        prefix[96];

    if (j == NULL) {
        return NGX_ERROR;
    }

    if (event) {
        *ngx_snprintf(prefix, sizeof(prefix) - 1, "event: %s\ndata: ", event)
            = '\0';
    } else {
        ngx_cpystrn(prefix, (u_char *) "data: ", sizeof(prefix));
    }

    cl = ngx_chain_get_free_buf(ctx->request->pool, &ctx->free);
    if (cl == NULL) {
        json_decref(j);
        return NGX_ERROR;
    }

    b = cl->buf;
    start = b->start;

    if (start != NULL) {
        ngx_http_m40_buf_reset(b, start, b->end);
    }

    if (start == NULL
        || ngx_http_m40_json_write(j, b, (const char *) prefix, "\n\n") == 0)
    {
        need = json_dumpb(j, NULL, 0, JSON_COMPACT);
        if (need == 0) {
            json_decref(j);
            return NGX_ERROR;
        }
        need += ngx_strlen(prefix) + 2;

        size = ngx_max(need, 4096);
        start = ngx_palloc(ctx->request->pool, size);
        if (start == NULL) {
            json_decref(j);
            return NGX_ERROR;
        }

        ngx_http_m40_buf_reset(b, start, start + size);

        if (ngx_http_m40_json_write(j, b, (const char *) prefix, "\n\n") == 0) {
            json_decref(j);
            return NGX_ERROR;
        }
    }

    json_decref(j);

    **last = cl;
    *last = &cl->next;
    *bytes += b->last - b->pos;

    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_emit(ngx_http_m40_ctx_t *ctx, json_t *j, ngx_chain_t ***last,
    size_t *bytes)
{
    return ngx_http_m40_emit_named(ctx, NULL, j, last, bytes);
}


/* A dialect's typed event: "event: NAME" and its JSON (taken). */
ngx_int_t
ngx_http_m40_sse_event(ngx_http_m40_sse_t *out, const char *event, json_t *data)
{
    return ngx_http_m40_emit_named(out->ctx, event, data, out->last,
                                   out->bytes);
}


/* One streaming choice object; takes ownership of delta_or_text and lp. */
static json_t *
ngx_http_m40_chunk(ngx_http_m40_ctx_t *ctx, ngx_uint_t index,
    json_t *delta_or_text, json_t *lp, const char *finish)
{
    json_t  *c, *root;

    c = json_pack("{s:I,s:o,s:o,s:o}",
                  "index", (json_int_t) index,
                  ctx->kind == NGX_HTTP_M40_CHAT ? "delta" : "text",
                  delta_or_text,
                  "logprobs", lp ? lp : json_null(),
                  "finish_reason", finish ? json_string(finish) : json_null());
    if (c == NULL) {
        return NULL;
    }

    root = ngx_http_m40_object(ctx, ctx->kind == NGX_HTTP_M40_CHAT
                                    ? "chat.completion.chunk"
                                    : "text_completion",
                               json_pack("[o]", c));
    if (root && ctx->include_usage) {
        json_object_set_new(root, "usage", json_null());
    }

    return root;
}


/* The event's logprobs as a chunk carries them; *lp NULL when not asked for. */
static ngx_int_t
ngx_http_m40_event_logprobs(ngx_http_m40_ctx_t *ctx, ngx_http_m40_choice_t *ch,
    m40_event *ev, json_t **lp)
{
    json_t  *inner;

    *lp = NULL;
    if (!ctx->logprobs) {
        return NGX_OK;
    }

    inner = ctx->kind == NGX_HTTP_M40_CHAT
            ? json_array()
            : json_pack("{s:[],s:[],s:[],s:[]}", "tokens",
                        "token_logprobs", "top_logprobs", "text_offset");
    if (inner == NULL
        || ngx_http_m40_logprobs_add(ctx, ch, inner, ev) != NGX_OK)
    {
        json_decref(inner);
        return NGX_ERROR;
    }

    *lp = ctx->kind == NGX_HTTP_M40_CHAT
          ? json_pack("{s:o,s:n}", "content", inner, "refusal")
          : inner;

    return *lp ? NGX_OK : NGX_ERROR;
}


static json_t *
ngx_http_m40_text_chunk(ngx_http_m40_ctx_t *ctx, ngx_http_m40_choice_t *ch,
    m40_event *ev)
{
    json_t  *text, *lp;

    text = ngx_http_m40_json_text(ev->text ? ev->text : "", ev->text_len);
    if (text == NULL) {
        return NULL;
    }

    if (ngx_http_m40_event_logprobs(ctx, ch, ev, &lp) != NGX_OK) {
        json_decref(text);
        return NULL;
    }

    if (ctx->kind == NGX_HTTP_M40_CHAT) {
        text = json_pack("{s:o}", "content", text);
    }

    return ngx_http_m40_chunk(ctx, ch->index, text, lp, NULL);
}


/* Output parser pieces of a streaming chat choice, as chunks: content and
 * reasoning_content deltas, and each tool call as OpenAI streams one: its index,
 * id, type and name (arguments "") as soon as the name is known, then its
 * arguments' fragments as they are written (index and function.arguments). The
 * event's logprobs ride on the first chunk it produces (or an empty delta when the
 * parser held everything back). */
typedef struct {
    ngx_http_m40_ctx_t     *ctx;
    ngx_http_m40_choice_t  *ch;
    ngx_chain_t          ***last;
    size_t                 *bytes;
    json_t                 *lp;
} ngx_http_m40_stream_pieces_t;


static ngx_int_t
ngx_http_m40_piece_emit(ngx_http_m40_stream_pieces_t *sp, json_t *delta)
{
    json_t  *lp;

    lp = sp->lp;
    sp->lp = NULL;

    if (delta == NULL) {
        json_decref(lp);
        return NGX_ERROR;
    }

    return ngx_http_m40_emit(sp->ctx,
                             ngx_http_m40_chunk(sp->ctx, sp->ch->index, delta,
                                                lp, NULL),
                             sp->last, sp->bytes);
}


static int
ngx_http_m40_stream_piece(void *ud, const m40_piece *pc)
{
    ngx_http_m40_stream_pieces_t *sp = ud;

    json_t                 *c, *text;
    ngx_http_m40_choice_t  *ch;

    ch = sp->ch;

    if (pc->kind == M40_PIECE_CONTENT || pc->kind == M40_PIECE_REASONING) {
        text = ngx_http_m40_json_text(pc->text, pc->len);
        return ngx_http_m40_piece_emit(sp, text == NULL ? NULL
                   : json_pack("{s:o}", pc->kind == M40_PIECE_CONTENT
                                        ? "content" : "reasoning_content",
                               text)) == NGX_OK ? 0 : -1;
    }

    if (!sp->ctx->parallel_tool_calls && pc->index > 0) {
        return 0;   /* parallel_tool_calls false: the first call only */
    }

    switch (pc->kind) {

    case M40_PIECE_TOOL_BEGIN:
        c = ngx_http_m40_tool_call_json(pc, 0);
        if (c == NULL) {
            return -1;
        }
        json_object_set_new(c, "index",
                            json_integer((json_int_t) ch->n_tool_calls));
        json_object_set_new(json_object_get(c, "function"), "arguments",
                            json_string(""));
        ch->n_tool_calls++;

        return ngx_http_m40_piece_emit(sp, json_pack("{s:[o]}", "tool_calls", c))
               == NGX_OK ? 0 : -1;

    case M40_PIECE_TOOL_ARGS:
        text = ngx_http_m40_json_text(pc->text, pc->len);
        c = text == NULL ? NULL
            : json_pack("{s:[{s:I,s:{s:o}}]}", "tool_calls", "index",
                        (json_int_t) ch->n_tool_calls - 1, "function",
                        "arguments", text);

        return ngx_http_m40_piece_emit(sp, c) == NGX_OK ? 0 : -1;

    default:
        return 0;   /* TOOL_CALL: the call's end; its pieces went out */
    }
}


static ngx_int_t
ngx_http_m40_stream_parse(ngx_http_m40_ctx_t *ctx, ngx_http_m40_choice_t *ch,
    m40_event *ev, ngx_chain_t ***last, size_t *bytes)
{
    ngx_int_t                     rc;
    ngx_http_m40_sse_t            out;
    ngx_http_m40_stream_pieces_t  sp;

    if (ctx->dialect) {
        out.ctx = ctx;
        out.ch = ch;
        out.last = last;
        out.bytes = bytes;
        rc = ngx_http_m40_parser_feed(ctx, ch, ev, ctx->dialect->piece, &out);
        if (rc == NGX_OK && ev->type == M40_EV_DONE) {
            ngx_http_m40_choice_done(ctx, ch, ev);
            rc = ctx->dialect->done(&out);
        }
        return rc;
    }

    sp.ctx = ctx;
    sp.ch = ch;
    sp.last = last;
    sp.bytes = bytes;
    sp.lp = NULL;

    if (ev->type == M40_EV_TEXT
        && ngx_http_m40_event_logprobs(ctx, ch, ev, &sp.lp) != NGX_OK)
    {
        return NGX_ERROR;
    }

    rc = ngx_http_m40_parser_feed(ctx, ch, ev, ngx_http_m40_stream_piece, &sp);

    if (rc == NGX_OK && sp.lp != NULL) {
        rc = ngx_http_m40_piece_emit(&sp, json_object());
    }

    json_decref(sp.lp);

    return rc;
}


/* Called when the first event arrives: status line and headers, then the role
 * chunk of every choice (chat) or the echoed prompt (completions). */
static ngx_int_t
ngx_http_m40_stream_open(ngx_http_m40_ctx_t *ctx, ngx_chain_t ***last,
    size_t *bytes)
{
    json_t              *first;
    ngx_int_t            rc;
    ngx_uint_t           i;
    ngx_http_m40_sse_t   out;

    rc = ngx_http_m40_stream_header(ctx);
    if (rc == NGX_ERROR || rc > NGX_OK) {
        return NGX_ERROR;
    }

    if (ctx->dialect) {
        out.ctx = ctx;
        out.ch = &ctx->choices[0];
        out.last = last;
        out.bytes = bytes;
        return ctx->dialect->open(&out);
    }

    for (i = 0; i < ctx->n; i++) {
        if (ctx->kind == NGX_HTTP_M40_CHAT) {
            first = json_pack("{s:s,s:s}", "role", "assistant", "content", "");

        } else if (ctx->echo_prefix.len) {
            first = ngx_http_m40_json_text((const char *) ctx->echo_prefix.data,
                                           ctx->echo_prefix.len);
        } else {
            continue;
        }

        if (ngx_http_m40_emit(ctx, ngx_http_m40_chunk(ctx, i, first, NULL, NULL),
                              last, bytes)
            != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_wait_write(ngx_http_m40_ctx_t *ctx)
{
    ngx_event_t               *wev;
    ngx_http_request_t        *r;
    ngx_http_core_loc_conf_t  *clcf;

    r = ctx->request;
    wev = r->connection->write;
    clcf = ngx_http_get_module_loc_conf(r, ngx_http_core_module);

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "m40 stream %s: client is slow, pausing", ctx->id);

    ctx->waiting_write = 1;
    r->write_event_handler = ngx_http_m40_stream_writer;

    if (!wev->delayed) {
        ngx_add_timer(wev, clcf->send_timeout);
    }

    if (ngx_handle_write_event(wev, clcf->send_lowat) != NGX_OK) {
        return NGX_ERROR;
    }

    return NGX_DONE;
}


ngx_int_t
ngx_http_m40_pump(ngx_http_m40_ctx_t *ctx)
{
    size_t                   bytes;
    ngx_int_t                rc;
    json_t                  *usage;
    ngx_buf_t               *b;
    ngx_uint_t               i, polled;
    m40_event                ev;
    ngx_chain_t             *out, **last, *cl;
    ngx_http_request_t      *r;
    ngx_http_m40_sse_t       sse;
    ngx_http_m40_error_t     err;
    ngx_http_m40_choice_t   *ch;
    static u_char            done[] = "data: [DONE]\n\n";

    r = ctx->request;

    for ( ;; ) {
        out = NULL;
        last = &out;
        bytes = 0;
        polled = 0;

        for (i = 0; i < ctx->n && !ctx->finished; i++) {
            ch = &ctx->choices[i];

            while (!ch->done && bytes < NGX_HTTP_M40_ROUND_BYTES
                   && m40_request_poll(ch->req, &ev))
            {
                polled = 1;

                if (ev.prompt_tokens > 0) {
                    /* for message_start */
                    ch->prompt_tokens = ev.prompt_tokens;
                    ch->cached_tokens = ev.cached_tokens;
                }

                if (!ctx->header_sent) {
                    if (ev.type == M40_EV_ERROR) {
                        /* nothing sent yet: a plain HTTP error */
                        ngx_http_m40_event_error(&err, &ev);
                        m40_event_clear(&ev);
                        ctx->finished = 1;
                        return ngx_http_m40_send_error(r, &err);
                    }

                    if (ngx_http_m40_stream_open(ctx, &last, &bytes)
                        != NGX_OK)
                    {
                        m40_event_clear(&ev);
                        return NGX_ERROR;
                    }
                }

                switch (ev.type) {

                case M40_EV_TEXT:
                    if (ctx->parse) {
                        if (ngx_http_m40_stream_parse(ctx, ch, &ev, &last,
                                                      &bytes)
                            != NGX_OK)
                        {
                            m40_event_clear(&ev);
                            return NGX_ERROR;
                        }
                        break;
                    }

                    if ((ev.text_len > 0 || (ctx->logprobs && ev.n_tokens > 0))
                        && ngx_http_m40_emit(ctx,
                                             ngx_http_m40_text_chunk(ctx, ch,
                                                                     &ev),
                                             &last, &bytes)
                           != NGX_OK)
                    {
                        m40_event_clear(&ev);
                        return NGX_ERROR;
                    }
                    break;

                case M40_EV_DONE:
                    if (ctx->parse
                        && ngx_http_m40_stream_parse(ctx, ch, &ev, &last,
                                                     &bytes)
                           != NGX_OK)
                    {
                        m40_event_clear(&ev);
                        return NGX_ERROR;
                    }
                    if (ctx->dialect) {
                        break;  /* done, with the dialect's closing events */
                    }
                    ngx_http_m40_choice_done(ctx, ch, &ev);
                    rc = ngx_http_m40_emit(ctx,
                             ngx_http_m40_chunk(ctx, ch->index,
                                 ctx->kind == NGX_HTTP_M40_CHAT
                                 ? json_object() : json_string(""),
                                 NULL,
                                 ch->n_tool_calls > 0
                                 && ch->finish != M40_FINISH_LENGTH
                                 ? "tool_calls"
                                 : ngx_http_m40_finish_reason(ch->finish)),
                             &last, &bytes);
                    if (rc != NGX_OK) {
                        m40_event_clear(&ev);
                        return NGX_ERROR;
                    }
                    break;

                default: /* M40_EV_ERROR after the headers: an error event */
                    ngx_http_m40_event_error(&err, &ev);
                    ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                                  "m40: generation failed mid-stream: %s",
                                  err.message);
                    if (ctx->dialect) {
                        sse.ctx = ctx;
                        sse.ch = ch;
                        sse.last = &last;
                        sse.bytes = &bytes;
                        rc = ctx->dialect->fail(&sse, &err);
                    } else {
                        rc = ngx_http_m40_emit(ctx,
                                               ngx_http_m40_error_json(&err),
                                               &last, &bytes);
                    }
                    if (rc != NGX_OK)
                    {
                        m40_event_clear(&ev);
                        return NGX_ERROR;
                    }
                    ctx->n_done = ctx->n;
                    ctx->include_usage = 0;
                    break;
                }

                m40_event_clear(&ev);

                if (ctx->n_done == ctx->n) {
                    break;
                }
            }

            if (ctx->n_done == ctx->n) {
                break;
            }
        }

        if (ctx->n_done == ctx->n && !ctx->finished && ctx->dialect) {
            /* the dialect's last event is out: no [DONE] */
            cl = ngx_alloc_chain_link(r->pool);
            b = ngx_calloc_buf(r->pool);
            if (cl == NULL || b == NULL) {
                return NGX_ERROR;
            }

            b->last_buf = (r == r->main) ? 1 : 0;
            b->last_in_chain = 1;
            b->sync = 1;

            cl->buf = b;
            cl->next = NULL;
            *last = cl;
            last = &cl->next;

            ctx->finished = 1;

        } else if (ctx->n_done == ctx->n && !ctx->finished) {
            if (ctx->include_usage) {
                /* the last chunk before [DONE]: no choices, the usage */
                usage = ngx_http_m40_object(ctx,
                                            ctx->kind == NGX_HTTP_M40_CHAT
                                            ? "chat.completion.chunk"
                                            : "text_completion",
                                            json_array());
                if (usage) {
                    json_object_set_new(usage, "usage",
                                        ngx_http_m40_usage_json(ctx));
                }

                if (ngx_http_m40_emit(ctx, usage, &last, &bytes) != NGX_OK) {
                    return NGX_ERROR;
                }
            }

            cl = ngx_alloc_chain_link(r->pool);
            b = ngx_calloc_buf(r->pool);
            if (cl == NULL || b == NULL) {
                return NGX_ERROR;
            }

            b->pos = done;
            b->last = done + sizeof(done) - 1;
            b->memory = 1;
            b->last_buf = (r == r->main) ? 1 : 0;
            b->last_in_chain = 1;

            cl->buf = b;
            cl->next = NULL;
            *last = cl;
            last = &cl->next;

            ctx->finished = 1;
        }

        if (out == NULL) {
            return NGX_DONE;        /* nothing new: wait for the engine */
        }

        for (cl = out; cl->next; cl = cl->next) { /* void */ }
        cl->buf->flush = 1;

        rc = ngx_http_output_filter(r, out);

        ngx_chain_update_chains(r->pool, &ctx->free, &ctx->busy, &out,
                                (ngx_buf_tag_t) &ngx_http_m40_module);

        if (rc == NGX_ERROR) {
            return NGX_ERROR;       /* the client is gone */
        }

        if (ctx->finished) {
            return rc;              /* nginx sends what is left, then closes */
        }

        if (rc == NGX_AGAIN || r->connection->buffered) {
            return ngx_http_m40_wait_write(ctx);
        }

        if (!polled) {
            return NGX_DONE;
        }
    }
}


static void
ngx_http_m40_stream_writer(ngx_http_request_t *r)
{
    ngx_int_t                  rc;
    ngx_event_t               *wev;
    ngx_chain_t               *out;
    ngx_connection_t          *c;
    ngx_http_m40_ctx_t        *ctx;
    ngx_http_core_loc_conf_t  *clcf;

    c = r->connection;
    wev = c->write;
    ctx = ngx_http_get_module_ctx(r, ngx_http_m40_module);
    clcf = ngx_http_get_module_loc_conf(r, ngx_http_core_module);

    if (wev->timedout) {
        ngx_log_error(NGX_LOG_INFO, c->log, NGX_ETIMEDOUT,
                      "m40: client timed out reading the stream");
        c->timedout = 1;
        ngx_http_finalize_request(r, NGX_HTTP_REQUEST_TIME_OUT);
        return;
    }

    if (wev->delayed || r->aio) {
        if (!wev->delayed) {
            ngx_add_timer(wev, clcf->send_timeout);
        }

        if (ngx_handle_write_event(wev, clcf->send_lowat) != NGX_OK) {
            ngx_http_finalize_request(r, NGX_ERROR);
        }

        return;
    }

    rc = ngx_http_output_filter(r, NULL);

    out = NULL;
    ngx_chain_update_chains(r->pool, &ctx->free, &ctx->busy, &out,
                            (ngx_buf_tag_t) &ngx_http_m40_module);

    if (rc == NGX_ERROR) {
        ngx_http_finalize_request(r, NGX_ERROR);
        return;
    }

    if (rc == NGX_AGAIN || c->buffered) {
        if (!wev->delayed) {
            ngx_add_timer(wev, clcf->send_timeout);
        }

        if (ngx_handle_write_event(wev, clcf->send_lowat) != NGX_OK) {
            ngx_http_finalize_request(r, NGX_ERROR);
        }

        return;
    }

    if (wev->timer_set) {
        ngx_del_timer(wev);
    }

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, c->log, 0,
                   "m40 stream %s: client caught up, resuming", ctx->id);

    ctx->waiting_write = 0;
    r->write_event_handler = ngx_http_request_empty_handler;

    rc = ngx_http_m40_process(ctx);
    if (rc != NGX_DONE) {
        ngx_http_finalize_request(r, rc);
    }
}
