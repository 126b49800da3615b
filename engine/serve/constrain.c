/* Constrained decoding in the engine: a request's grammar (GBNF, a JSON Schema or "any
 * JSON object") is compiled on the tokenizer thread, beside its prompt, so a large schema
 * never delays anybody's step; the engine thread then only walks the compiled automaton
 * (engine/grammar). The vocabulary trie the masks walk is built once, by the tokenizer
 * thread, on the first constrained request (engines that never see one never pay for it);
 * the engine thread reaches it only through requests handed over under e->mu. */
#include "engine_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static m40_token_trie *vocab_trie_build(const m40_tokenizer *tok)
{
    int32_t n = m40_tokenizer_n_vocab(tok);
    char **bytes = calloc((size_t)n, sizeof *bytes);
    int32_t *lens = calloc((size_t)n, sizeof *lens);
    uint8_t *eog = calloc((size_t)n, 1);
    m40_token_trie *t = NULL;
    if (!bytes || !lens || !eog)
        goto out;
    for (int32_t id = 0; id < n; id++) {
        char buf[256];
        eog[id] = (uint8_t)(m40_tokenizer_is_eog(tok, id) != 0);
        /* render_special 0: control tokens are no text and never match a grammar */
        int k = m40_token_to_bytes(tok, id, 0, buf, (int)sizeof buf);
        if (k <= 0 || k > (int)sizeof buf)
            continue; /* longer pieces than 256 bytes: left out (never allowed) */
        if (!(bytes[id] = malloc((size_t)k)))
            goto out;
        memcpy(bytes[id], buf, (size_t)k);
        lens[id] = k;
    }
    t = m40_token_trie_new(n, (const char *const *)bytes, lens, eog);
out:
    for (int32_t id = 0; bytes && id < n; id++)
        free(bytes[id]);
    free(bytes);
    free(lens);
    free(eog);
    return t;
}

int m40_request_compile_grammar(m40_engine *e, m40_request *r, int *status, char *msg, size_t msglen)
{
    if (!r->grammar_src && !r->json_schema && !r->json_object)
        return 0;
    char err[256] = "";
    const char *field = r->grammar_src ? "grammar" : "response_format";
    char *src = NULL;
    *status = 400;
    if (!r->grammar_src) {
        src = m40_json_schema_to_gbnf(r->json_schema, r->json_schema ? strlen(r->json_schema) : 0, err, sizeof err);
        if (!src) {
            snprintf(msg, msglen, "invalid '%s': %.200s", field, err);
            return -1;
        }
    }
    const char *g = src ? src : r->grammar_src;
    r->grammar = m40_grammar_parse(g, strlen(g), err, sizeof err);
    free(src);
    if (!r->grammar) {
        snprintf(msg, msglen, "invalid '%s': %.200s", field, err);
        return -1;
    }
    /* The start state once here: a grammar too ambiguous or deep to even start is the
     * caller's 400 now, not the engine thread's 500 later. */
    m40_gmatch *probe = m40_gmatch_new(r->grammar);
    const char *why = probe ? m40_gmatch_error(probe) : "grammar: out of memory";
    if (why) {
        snprintf(msg, msglen, "invalid '%s': %.200s", field, why);
        m40_gmatch_free(probe);
        return -1;
    }
    m40_gmatch_free(probe);
    if (!e->vocab_trie && !(e->vocab_trie = vocab_trie_build(e->tok))) {
        *status = 500;
        snprintf(msg, msglen, "out of memory building the vocabulary trie");
        return -1;
    }
    return 0;
}
