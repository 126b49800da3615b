/* The prefix key of a request body: what a chat template renders first, as canonical
 * bytes, for $m40_prefix_hash (a front nginx's `hash $m40_prefix_hash consistent;`
 * sends requests sharing a system prompt to the host that has its KV blocks cached).
 *
 * Public beside m40_engine.h; the code is engine/serve/prefix_key.c, plain C and
 * jansson, no nginx headers, so that the libFuzzer harness tests/fuzz/fuzz_prefix.c and
 * the unit test drive what the module runs. The front has no model: it can neither
 * render the template nor tokenize, so the key is taken from the JSON:
 *   - the system part: top-level "system" (/v1/messages: a string or text blocks),
 *     top-level "instructions" (/v1/responses), then the leading "system" and
 *     "developer" messages of "messages" (/v1/chat/completions) or "input"
 *     (/v1/responses), in order;
 *   - without any system part, the first message instead (a conversation without a
 *     system prompt keeps its turns together);
 *   - /v1/completions: "prompt\n" and the prompt (the first of an array of strings;
 *     token ids in decimal, each followed by ',').
 * Each message is role "\n" text "\0"; the text parts of an array content ("text",
 * "input_text", "output_text", or plain strings) are joined by "\n", other parts left
 * out. The whole is cut at cap bytes. */
#ifndef M40_PREFIX_KEY_H
#define M40_PREFIX_KEY_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

/* The canonical bytes of a parsed body into out[0..cap); their count (0: the body has
 * none of the fields, or is not an object). */
size_t m40_prefix_key(const json_t *root, unsigned char *out, size_t cap);

/* The module hashes those bytes with m40_fnv1a64 (util/hash.h). */

#endif
