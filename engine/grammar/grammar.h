/* Grammars for constrained decoding (README.md in this folder says how the parts fit).
 *
 * A grammar is immutable once parsed; a matcher (one per sequence) holds the lazily built
 * automaton and the cached token masks, so it is used by one thread at a time. */
#ifndef M40_GRAMMAR_H
#define M40_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

typedef struct m40_grammar m40_grammar;

/* Parses GBNF source (rules `name ::= alternatives`, the start rule is `root`). NULL with
 * a message naming the problem (and the line) in err on any error: syntax, an undefined
 * rule, left recursion (also through rules that can match the empty string), sizes past
 * the limits. Never crashes on any input bytes. */
m40_grammar *m40_grammar_parse(const char *src, size_t len, char *err, size_t errlen);
void m40_grammar_free(m40_grammar *g);

/* ---- byte-level matcher: states are small integers ---- */
typedef struct m40_gmatch m40_gmatch;

#define M40_GM_DEAD (-1)   /* no string with this prefix is in the language */

/* Does not take g: g must outlive the matcher. NULL when out of memory. */
m40_gmatch *m40_gmatch_new(const m40_grammar *g);
void m40_gmatch_free(m40_gmatch *m);
int32_t m40_gmatch_start(m40_gmatch *m);          /* M40_GM_DEAD only on failure (see error) */
int32_t m40_gmatch_next(m40_gmatch *m, int32_t state, uint8_t byte);
int m40_gmatch_accepting(const m40_gmatch *m, int32_t state); /* the input so far is a sentence */
int m40_gmatch_final(const m40_gmatch *m, int32_t state);     /* accepting and nothing may follow */
/* Non-NULL once the automaton hit a size limit (states then read as dead). */
const char *m40_gmatch_error(const m40_gmatch *m);
/* 1 when the whole of s[0..n) is a sentence of the grammar. */
int m40_gmatch_full(m40_gmatch *m, const char *s, size_t n);

/* ---- token level ---- */

/* The vocabulary as bytes: token i decodes to bytes[i][0..lens[i]) (NULL/0 for tokens
 * that are no text, e.g. control tokens: never allowed under a grammar); eog[i] != 0 for
 * the end-of-generation tokens, allowed exactly where the grammar can end. Copied: the
 * arrays may be freed afterwards. Built once per model and shared read-only. */
typedef struct m40_token_trie m40_token_trie;
m40_token_trie *m40_token_trie_new(int32_t n_vocab, const char *const *bytes, const int32_t *lens,
                                   const uint8_t *eog);
void m40_token_trie_free(m40_token_trie *t);
int32_t m40_token_trie_n_vocab(const m40_token_trie *t);

/* One constrained sequence: owns g (freed with it), borrows the trie. */
typedef struct m40_gconstraint m40_gconstraint;
m40_gconstraint *m40_gconstraint_new(m40_grammar *g, const m40_token_trie *t);
void m40_gconstraint_free(m40_gconstraint *c);
/* Allowed tokens in the current state: bit (id & 31) of word id >> 5. Cached per state;
 * valid until the next accept. NULL when out of memory or the automaton overflowed. */
const uint32_t *m40_gconstraint_mask(m40_gconstraint *c);
/* Sets the logits of disallowed tokens to -INFINITY. Returns the number still allowed
 * (0: nothing can follow, the caller ends the sequence). */
int32_t m40_gconstraint_apply(m40_gconstraint *c, float *logits);
/* The greedy pick among the allowed tokens, without writing the row: the id whose logit
 * is largest (lowest id on ties; the order of m40k_argmax, sample_hd.h), -1 when nothing
 * is allowed or every allowed logit is NaN. The same token as m40_gconstraint_apply
 * followed by m40k_argmax wherever some allowed logit is above -inf. */
int32_t m40_gconstraint_argmax(m40_gconstraint *c, const float *logits);
/* Advances by a sampled token. 0, or -1 when the token was not allowed (state unchanged). */
int m40_gconstraint_accept(m40_gconstraint *c, int32_t token);
/* The output so far is complete and nothing but end-of-generation may follow. */
int m40_gconstraint_done(const m40_gconstraint *c);
/* Non-NULL once the automaton hit a limit or memory ran out: the output cannot go on. */
const char *m40_gconstraint_error(const m40_gconstraint *c);
int m40_gconstraint_can_end(const m40_gconstraint *c);

/* ---- JSON Schema ---- */

/* Compiles a JSON Schema (JSON text) into GBNF source (malloc'd, NUL-terminated) whose
 * every sentence validates against the schema. NULL with err naming the problem, e.g.
 * "unsupported JSON Schema keyword 'not'". schema_json NULL: any JSON object (the
 * response_format {"type": "json_object"}). */
char *m40_json_schema_to_gbnf(const char *schema_json, size_t len, char *err, size_t errlen);
/* The same with the schema's rule named `rule` instead of "root" (letters, digits, '-';
 * not one of the prelude's names): the caller writes the root around it (forced tool
 * calls wrap a call object in the model's markup). */
char *m40_json_schema_to_gbnf_rule(const char *schema_json, size_t len, const char *rule, char *err, size_t errlen);
/* n schemas at once, schema i as rule rules[i] (one prelude, no rule name twice): the
 * harmony format names the function outside its arguments, so each tool's parameters
 * need a rule of their own. A NULL schema is any JSON object. */
char *m40_json_schema_to_gbnf_rules(const char *const *schemas, const size_t *lens, const char *const *rules, int n,
                                    char *err, size_t errlen);

#endif
