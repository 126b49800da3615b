/* libFuzzer harness: the Jinja lexer, parser and evaluator on arbitrary template
 * sources (a chat template comes from a GGUF file or a configured path), rendered with a
 * chat-shaped context under the limits the engine uses. Never crashes, never leaks. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "template/jinja.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static json_t *messages;
    if (!messages)
        messages = json_loads("[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                              "{\"role\":\"user\",\"content\":\"Hi <|im_end|> {{ x }}\"},"
                              "{\"role\":\"assistant\",\"content\":\"Hello.\"},"
                              "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"and?\"}]}]",
                              0, NULL);
    char *src = malloc(size + 1);
    if (!src)
        return 0;
    memcpy(src, data, size);
    src[size] = 0;
    static json_t *tools;
    if (!tools)
        tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":"
                           "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"}}}}}]",
                           0, NULL);
    /* tight limits keep each run short; the engine's own are looser but of the same kind.
     * 20,000 steps (200,000 before): a loop, range() or a long filter chain stops at the
     * same check ten times sooner. On the last session's 15,914-file corpus the edges and
     * features are the same (2,162 / 11,603) and 60,000 runs take 8.1 CPU-s instead of
     * 10.9 (5,510 -> 7,398 executions a CPU-second). A smaller max_memory (8 MB) lost an
     * edge: it stays. */
    m40_jinja_limits lim = {0};
    lim.max_steps = 20000;
    lim.max_output = 1 << 20;
    lim.max_memory = 64 << 20;
    char err[256], *out = NULL;
    size_t out_len = 0;
    (void)m40_chat_template_render(src, messages, size % 2 ? tools : NULL, 1, "<s>", "</s>", NULL, &lim, &out,
                                   &out_len, err, sizeof err);
    free(out);
    free(src);
    return 0;
}
