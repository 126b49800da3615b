/* libFuzzer harness: the constrained-decoding compilers on arbitrary request text: the
 * first byte picks GBNF (grammar) or JSON Schema (response_format) for the rest; what
 * compiles is then run: the matcher's start state, the input itself fed byte by byte,
 * and a walk of a few steps over a small byte vocabulary's masks. Never crashes, never
 * hangs (every bound of the compiler and the matcher is part of what is tested). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "grammar/grammar.h"

static m40_token_trie *trie;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    if (!trie) { /* 256 single bytes and a few longer pieces */
        static char pieces[260][4];
        static const char *bytes[260];
        static int32_t lens[260];
        for (int i = 0; i < 256; i++)
            pieces[i][0] = (char)i, bytes[i] = pieces[i], lens[i] = 1;
        const char *more[] = {"{\"", "\":", "true", "null"};
        for (int i = 0; i < 4; i++)
            bytes[256 + i] = more[i], lens[256 + i] = (int32_t)(i < 2 ? 2 : 4);
        trie = m40_token_trie_new(260, bytes, lens, 0);
    }
    char err[256];
    const char *src = (const char *)data + 1;
    size_t len = size - 1;
    char *gbnf = NULL;
    if (data[0] & 1) {
        gbnf = m40_json_schema_to_gbnf(src, len, err, sizeof err);
        if (!gbnf)
            return 0;
        src = gbnf;
        len = 0;
        while (src[len])
            len++;
    }
    m40_grammar *g = m40_grammar_parse(src, len, err, sizeof err);
    if (g) {
        m40_gmatch *m = m40_gmatch_new(g);
        if (m) {
            (void)m40_gmatch_full(m, (const char *)data + 1, size - 1 < 256 ? size - 1 : 256);
            m40_gmatch_free(m);
        }
        m40_gconstraint *c = trie ? m40_gconstraint_new(g, trie) : NULL;
        if (c) {
            float logits[260];
            for (int step = 0; step < 8 && !m40_gconstraint_done(c); step++) {
                for (int i = 0; i < 260; i++)
                    logits[i] = (float)((i * 7 + step) % 13);
                if (m40_gconstraint_apply(c, logits) <= 0)
                    break;
                int32_t tok = -1;
                for (int i = 0; i < 260; i++)
                    if (logits[i] > -1e30f && (tok < 0 || logits[i] > logits[tok]))
                        tok = i;
                if (tok < 0 || m40_gconstraint_accept(c, tok) != 0)
                    break;
            }
            m40_gconstraint_free(c);
        } else {
            m40_grammar_free(g);
        }
    }
    free(gbnf);
    return 0;
}
