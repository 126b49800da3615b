/* libFuzzer harness: the prefix key of a request body (m40_prefix_key,
 * engine/serve/prefix_key.c), what $m40_prefix_hash hashes on a front nginx for every
 * request it balances.
 *
 * The first two bytes pick the cap (1..65536); the rest is the body, parsed by jansson
 * as the module does (json_loadb, flags 0). Checked: the key never passes the cap (a
 * guard byte after it stays), the same body gives the same key, and a key below the
 * cap stays the same with a larger cap (the cut only cuts). Everything is freed
 * (LeakSanitizer). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "m40_prefix_key.h"
#include "util/hash.h"

#define CHECK(c, ...)                                                                                                  \
    do {                                                                                                               \
        if (!(c)) {                                                                                                    \
            fprintf(stderr, "fuzz_prefix: " __VA_ARGS__);                                                              \
            fprintf(stderr, "\n");                                                                                     \
            abort();                                                                                                   \
        }                                                                                                              \
    } while (0)

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size)
{
    if (size < 2)
        return 0;
    size_t cap = ((size_t)data[0] << 8 | data[1]) + 1;
    json_error_t jerr;
    json_t *root = json_loadb((const char *)data + 2, size - 2, 0, &jerr);
    if (!root)
        return 0;
    unsigned char *a = malloc(cap + 1), *b = malloc(cap + 1), *c = malloc(cap + 65);
    CHECK(a && b && c, "out of memory");
    a[cap] = 0x5A;
    size_t n = m40_prefix_key(root, a, cap);
    CHECK(n <= cap && a[cap] == 0x5A, "key of %zu bytes past the cap %zu", n, cap);
    size_t m = m40_prefix_key(root, b, cap);
    CHECK(m == n && memcmp(a, b, n) == 0, "the same body gave keys of %zu and %zu bytes", n, m);
    size_t k = m40_prefix_key(root, c, cap + 64);
    CHECK(k >= n && memcmp(a, c, n) == 0 && (n == cap || k == n), "cap %zu: %zu bytes, cap +64: %zu", cap, n, k);
    (void)m40_fnv1a64(a, n);
    free(a);
    free(b);
    free(c);
    json_decref(root);
    return 0;
}
