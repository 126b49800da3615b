/* Splitting a chat model's output into content, reasoning and tool calls.
 *
 * Public beside m40_engine.h (the nginx module includes both and nothing deeper);
 * the code is engine/serve/chat_parse.c, plain C and jansson, no nginx headers, so the
 * unit tests drive it on crafted outputs and random bytes.
 *
 * The submitter feeds the text of each TEXT event as it arrives and gets pieces back
 * at once: content and reasoning as soon as no marker can start in them, a tool call
 * as it is written (with m40_chat_parse_incremental: its name as soon as it is known,
 * then its arguments' text as it comes) and whole when it ends; its markup never
 * reaches the content. Text that could be the start of a marker is held until the next
 * feed or the finish. Output that looks like a tool call but whose first call does not
 * parse comes back as content, markup and all, as vLLM does: a model's bad call is the
 * client's to see, not ours to hide. How the text is cut into feeds changes nothing
 * but where the pieces split. */
#ifndef M40_CHAT_PARSE_H
#define M40_CHAT_PARSE_H

#include <stddef.h>

/* How a model family writes tool calls (one parser each). */
typedef enum {
    M40_TOOLS_NONE = 0,   /* no tool parsing: everything is content */
    M40_TOOLS_HERMES,     /* Hermes, Qwen2.5/Qwen3: <tool_call>{"name":..,"arguments":{..}}</tool_call> */
    M40_TOOLS_LLAMA3,     /* Llama 3.x: the whole output {"name":..,"parameters":{..}} (or
                           * several joined by ';'), or <|python_tag|> then such JSON */
    M40_TOOLS_MISTRAL,    /* Mistral: [TOOL_CALLS][{"name":..,"arguments":{..}}, ...] */
    M40_TOOLS_JSON,       /* fallback: the whole output a JSON call object or array of them */
    M40_TOOLS_HARMONY,    /* gpt-oss harmony channels: the whole output is messages
                           * "<|channel|>analysis<|message|>..<|end|>" (reasoning),
                           * "<|start|>assistant<|channel|>final<|message|>.." (content),
                           * "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}"
                           * (a call; the recipient may also stand before <|channel|>); ended
                           * by <|end|>, <|return|>, <|call|> or the end of the output. The
                           * channels are the output's structure, so this parser also runs
                           * for requests without tools (and splits reasoning by itself). */
} m40_tool_format;

/* What happens to "<think>...</think>" (harmony: to the analysis channel; INLINE gives
 * its messages to the content, markup and all). */
typedef enum {
    M40_REASONING_SEPARATE = 0, /* reasoning pieces, apart from the content */
    M40_REASONING_INLINE,       /* left in the content, tags and all (no splitting) */
    M40_REASONING_NONE,         /* dropped */
} m40_reasoning_mode;

/* The convention a chat template's text shows ("<|channel|>" for harmony, "<tool_call>",
 * "[TOOL_CALLS]", "<|python_tag|>" or Llama 3's header tokens with "parameters");
 * M40_TOOLS_JSON when it shows none (or src is NULL). */
m40_tool_format m40_tool_format_detect(const char *src);
/* 1 when the template knows "<think>" or "</think>" (Qwen3, DeepSeek-R1 distills) or
 * harmony's analysis channel (gpt-oss). */
int m40_template_thinks(const char *src);
/* "hermes", "llama3", "mistral", "json", "harmony", "none" <-> the enum; -1 when unknown. */
int m40_tool_format_from_name(const char *name, size_t len);
const char *m40_tool_format_name(m40_tool_format f);

typedef enum {
    M40_PIECE_CONTENT = 1,
    M40_PIECE_REASONING,
    M40_PIECE_TOOL_CALL,  /* a call, complete: it ends the call */
    M40_PIECE_TOOL_BEGIN, /* incremental only: a call starts (index, name) */
    M40_PIECE_TOOL_ARGS,  /* incremental only: the next bytes of its arguments (index, text) */
} m40_piece_kind;

/* A call's pieces come together, nothing between them: TOOL_BEGIN, TOOL_ARGS..., then
 * TOOL_CALL, whose arguments are exactly the TOOL_ARGS texts joined. */
typedef struct {
    m40_piece_kind kind;
    const char *text;      /* CONTENT, REASONING, TOOL_ARGS: bytes (not NUL-terminated) */
    size_t len;
    int index;             /* TOOL_*: 0, 1, ... in output order */
    const char *name;      /* TOOL_BEGIN, TOOL_CALL: NUL-terminated */
    const char *arguments; /* TOOL_CALL: the arguments' JSON text, NUL-terminated: the model's
                            * object without blanks between tokens ("{}" if absent); only a call
                            * cut short (max_tokens, or JSON that broke inside it) ends with
                            * the arguments as far as they were valid, as OpenAI's do */
} m40_piece;

/* Called for each piece; pointers are valid only during the call. Nonzero stops the
 * parser (feed/finish return it). */
typedef int (*m40_piece_cb)(void *ud, const m40_piece *piece);

typedef struct m40_chat_parse m40_chat_parse;

/* reasoning: how to treat <think> (INLINE: no splitting); reasoning_open: the output
 * starts inside a <think> the prompt opened. NULL when out of memory. */
m40_chat_parse *m40_chat_parse_new(m40_tool_format tools, m40_reasoning_mode reasoning, int reasoning_open);
void m40_chat_parse_free(m40_chat_parse *p);
/* 0, a callback's nonzero value, or -1 out of memory. */
int m40_chat_parse_feed(m40_chat_parse *p, const char *text, size_t len, m40_piece_cb cb, void *ud);
/* End of output: flushes what was held (an unclosed call is parsed as it is). */
int m40_chat_parse_finish(m40_chat_parse *p, m40_piece_cb cb, void *ud);
/* on: also TOOL_BEGIN and TOOL_ARGS pieces (streaming); off (the default): TOOL_CALL
 * only. Either way the same calls with the same arguments. */
void m40_chat_parse_incremental(m40_chat_parse *p, int on);
/* Tool calls emitted so far. */
int m40_chat_parse_tool_calls(const m40_chat_parse *p);

#endif
