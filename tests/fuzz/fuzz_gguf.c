/* libFuzzer harness: the GGUF reader on arbitrary bytes (what a hostile model file is),
 * then what the engine reads from a file that opens: the metadata getters the loaders
 * use and the tokenizer built from the vocabulary arrays. Never crashes, never leaks. */
#include <stddef.h>
#include <stdint.h>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    m40_gguf *g = NULL;
    if (m40_gguf_open_mem(data, size, &g, err, sizeof err) != 0)
        return 0;
    uint32_t u;
    int64_t i;
    float f;
    int b;
    (void)m40_gguf_get_str(g, "general.architecture");
    (void)m40_gguf_get_str(g, "tokenizer.chat_template");
    (void)m40_gguf_get_u32(g, "general.alignment", &u);
    (void)m40_gguf_get_i64(g, "general.file_type", &i);
    (void)m40_gguf_get_f32(g, "general.x", &f);
    (void)m40_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b);
    (void)m40_gguf_get_arch_u32(g, "context_length", &u);
    (void)m40_gguf_get_arch_f32(g, "rope.freq_base", &f);
    m40_tokenizer *t = NULL;
    if (m40_tokenizer_from_gguf(g, &t, err, sizeof err) == 0) {
        int32_t ids[64];
        static const char text[] = "Hello <|im_end|> w\xc3\xb6rld \xff\xfe 123";
        (void)m40_tokenize(t, text, sizeof text - 1, 1, 1, ids, 64, err, sizeof err);
        m40_tokenizer_free(t);
    }
    m40_gguf_close(g);
    return 0;
}
