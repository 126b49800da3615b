/* What gbnf.c builds and matcher.c runs: this folder's private header. */
#ifndef M40_GRAMMAR_INT_H
#define M40_GRAMMAR_INT_H

#include <stdint.h>

#include "grammar.h"

/* Elements of one flat array. An alternative is a run of SET/REF elements ended by END;
 * rule r's alternatives start at alts[rule_alt0[r] .. rule_alt0[r] + rule_nalt[r]). */
enum { GE_SET = 1, GE_REF = 2, GE_END = 3 };
typedef struct {
    int32_t type;
    int32_t v;          /* SET: index into sets; REF: rule index */
} m40_gelem;

struct m40_grammar {
    m40_gelem *el;
    int32_t n_el;
    int32_t *alts;
    int32_t n_alts;
    int32_t *rule_alt0, *rule_nalt;
    int32_t n_rules;
    uint32_t (*sets)[8];  /* 256-bit byte sets */
    int32_t n_sets;
    int32_t root;
};

static inline int m40_gset_has(const uint32_t *set, uint8_t b) { return (set[b >> 5] >> (b & 31)) & 1; }

/* Limits that keep hostile grammars bounded (elements, repetition counts, stack depth). */
#define M40_GRAMMAR_MAX_ELEMS (1 << 22)
#define M40_GRAMMAR_MAX_REPEAT 4096
#define M40_GRAMMAR_MAX_DEPTH 4096

#endif
