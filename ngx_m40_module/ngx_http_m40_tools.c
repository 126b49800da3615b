/* Tool calling and reasoning on /v1/chat/completions: the glue between a choice's
 * events and the output parser (engine/m40_chat_parse.h: which convention, which
 * reasoning mode). The request side (tools, tool_choice, parallel_tool_calls,
 * chat_template_kwargs, the tool fields of messages) is checked with the rest of the
 * request in engine/serve/api_params.c.
 *
 * The definitions reach the chat template as its `tools` variable, exactly as the
 * client sent them (validated); the template decides how the model sees them.
 * tool_choice "required" and a named function are guaranteed by constrained decoding:
 * the named function is the only one the template shows, and the engine compiles a
 * grammar of calls to the tools shown (each call's arguments a sentence of its
 * parameters' JSON Schema) in the markup of the request's parser (Hermes, Llama 3,
 * Mistral, harmony or bare JSON), so even a model that would answer in prose returns a call
 * the parser takes (engine/serve/constrain.c). */
#include "ngx_http_m40_module.h"

#include "m40_chat_parse.h"


/* Mistral's templates take only tool call ids of 9 characters (they raise "Tool call
 * IDs should be alphanumeric strings with length 9!" otherwise), while the ids we,
 * OpenAI and Anthropic give out are longer: as vLLM does for Mistral models, a longer
 * id is cut to its last 9 characters, in an assistant's tool_calls and in the tool
 * result alike, so that a conversation goes back in as it came out. */
static void
ngx_http_m40_mistral_ids(json_t *messages)
{
    size_t       i, k, len;
    json_t      *m, *c, *id, *cut;
    const char  *s;

    json_array_foreach(messages, i, m) {
        id = json_object_get(m, "tool_call_id");
        s = json_string_value(id);
        len = json_string_length(id);
        if (s != NULL && len > 9) {
            cut = json_string(s + len - 9);   /* NULL if it cuts a character */
            if (cut != NULL) {
                json_object_set_new(m, "tool_call_id", cut);
            }
        }

        json_array_foreach(json_object_get(m, "tool_calls"), k, c) {
            id = json_object_get(c, "id");
            s = json_string_value(id);
            len = json_string_length(id);
            if (s != NULL && len > 9) {
                cut = json_string(s + len - 9);
                if (cut != NULL) {
                    json_object_set_new(c, "id", cut);
                }
            }
        }
    }
}


/* Decides once per request how its output is parsed. */
void
ngx_http_m40_output_mode(ngx_http_m40_ctx_t *ctx, ngx_http_m40_params_t *p)
{
    const char                *tmpl;
    ngx_uint_t                 fmt;
    ngx_http_m40_main_conf_t  *mcf;

    mcf = ctx->mcf;
    ctx->tool_format = M40_TOOLS_NONE;
    ctx->reasoning = M40_REASONING_INLINE;
    ctx->parallel_tool_calls = p->parallel_tool_calls ? 1 : 0;

    if (ctx->kind != NGX_HTTP_M40_CHAT || mcf->engine == NULL) {
        return;
    }

    tmpl = m40_engine_chat_template(mcf->engine);

    if (p->messages != NULL
        && m40_tool_format_detect(tmpl) == M40_TOOLS_MISTRAL)
    {
        ngx_http_m40_mistral_ids(p->messages);
    }

    fmt = mcf->tool_parser != NGX_HTTP_M40_TOOL_PARSER_AUTO
          ? mcf->tool_parser : (ngx_uint_t) m40_tool_format_detect(tmpl);

    /* Harmony's channels are the whole output's structure, not only its calls:
     * they are parsed with or without tools. */
    if (p->tools != NULL || fmt == M40_TOOLS_HARMONY) {
        ctx->tool_format = fmt;
    }

    /* Only templates that think get their output split: elsewhere a literal
     * "<think>" in an answer stays an answer. */
    if (m40_template_thinks(tmpl)) {
        ctx->reasoning = mcf->reasoning;
    }

    ctx->parse = ctx->tool_format != M40_TOOLS_NONE
                 || ctx->reasoning != M40_REASONING_INLINE;

    /* m40_tool_format none: no markup to force, the output is content */
    ctx->forced_tools = p->tools != NULL && ctx->tool_format != M40_TOOLS_NONE
                        && !ctx->count_only
                        && (p->tool_choice == NGX_HTTP_M40_TOOL_CHOICE_REQUIRED
                            || p->tool_choice == NGX_HTTP_M40_TOOL_CHOICE_NAMED);
}


ngx_int_t
ngx_http_m40_parser_feed(ngx_http_m40_ctx_t *ctx, ngx_http_m40_choice_t *ch,
    m40_event *ev, m40_piece_cb cb, void *ud)
{
    if (ch->parser == NULL) {
        ch->parser = m40_chat_parse_new((m40_tool_format) ctx->tool_format,
                                        (m40_reasoning_mode) ctx->reasoning,
                                        ev->reasoning_open);
        if (ch->parser == NULL) {
            return NGX_ERROR;
        }

        /* streamed: a call's name as soon as it is known, then its arguments
         * as they are written (the same calls either way) */
        m40_chat_parse_incremental(ch->parser, ctx->stream);
    }

    if (ev->type == M40_EV_DONE) {
        return m40_chat_parse_finish(ch->parser, cb, ud) == 0 ? NGX_OK
                                                               : NGX_ERROR;
    }

    return m40_chat_parse_feed(ch->parser, ev->text ? ev->text : "",
                               ev->text_len, cb, ud) == 0 ? NGX_OK : NGX_ERROR;
}


/* A tool call of the response: {"id", "type", "function": {"name", "arguments"}}
 * (arguments "" for a call that has just begun: TOOL_BEGIN); the id is "call_" and
 * 24 random letters and digits, as OpenAI's look. */
json_t *
ngx_http_m40_tool_call_json(const m40_piece *pc, ngx_flag_t with_index)
{
    static const char  alnum[] = "abcdefghijklmnopqrstuvwxyz"
                                 "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    char               id[5 + 24 + 1];
    ngx_uint_t         i;
    json_t            *c;

    ngx_memcpy(id, "call_", 5);
    for (i = 0; i < 24; i++) {
        id[5 + i] = alnum[(ngx_uint_t) ngx_random() % (sizeof(alnum) - 1)];
    }
    id[29] = '\0';

    c = json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", id, "type", "function",
                  "function", "name", pc->name,
                  "arguments", pc->arguments ? pc->arguments : "");
    if (c != NULL && with_index) {
        json_object_set_new(c, "index", json_integer(pc->index));
    }

    return c;
}


void
ngx_http_m40_parser_free(ngx_http_m40_choice_t *ch)
{
    if (ch->parser) {
        m40_chat_parse_free(ch->parser);
        ch->parser = NULL;
    }

    if (ch->tool_calls) {
        json_decref(ch->tool_calls);
        ch->tool_calls = NULL;
    }
}
