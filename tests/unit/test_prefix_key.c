/* The prefix key of a request body (engine/m40_prefix_key.h), what $m40_prefix_hash
 * hashes: the system part of each API's body, the first message without one, the
 * completions prompt, the cut at cap, and nothing for bodies without the fields.
 * FNV-1a 64 against its published test vectors. */
#include "check.h"
#include "m40_prefix_key.h"
#include "util/hash.h"

#include <stdint.h>

static unsigned char out[4096];

/* The key of body (JSON) with cap; its length. */
static size_t key(const char *body, size_t cap)
{
    json_error_t jerr;
    json_t *root = json_loads(body, 0, &jerr);
    if (!root) {
        fprintf(stderr, "bad test JSON %s: %s\n", body, jerr.text);
        exit(2);
    }
    memset(out, 0xAA, sizeof out);
    size_t n = m40_prefix_key(root, out, cap);
    json_decref(root);
    return n;
}

/* body's key (cap 4096) is exactly want (len bytes, NULs included). */
static void is(const char *body, const char *want, size_t len)
{
    size_t n = key(body, sizeof out);
    CHECK(n == len && memcmp(out, want, len) == 0, "%s: got %zu bytes \"%.*s\"", body, n, (int)n, out);
}

#define IS(body, lit) is(body, lit, sizeof(lit) - 1)

int main(void)
{
    /* FNV-1a 64 test vectors (Fowler/Noll/Vo) */
    CHECK(m40_fnv1a64("", 0) == 0xcbf29ce484222325ULL, "empty");
    CHECK(m40_fnv1a64("a", 1) == 0xaf63dc4c8601ec8cULL, "a");
    CHECK(m40_fnv1a64("foobar", 6) == 0x85944171f73967e8ULL, "foobar");

    /* chat: the system messages only, whatever the user says */
    IS("{\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":\"u1\"}]}",
       "system\nS\0");
    IS("{\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"system\",\"content\":\"T\"},"
       "{\"role\":\"developer\",\"content\":\"D\"},{\"role\":\"user\",\"content\":\"u\"},"
       "{\"role\":\"system\",\"content\":\"late\"}]}",
       "system\nS\0system\nT\0developer\nD\0");
    /* content parts: text joined by \n, images left out */
    IS("{\"messages\":[{\"role\":\"system\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
       "{\"type\":\"image_url\",\"image_url\":{\"url\":\"x\"}},{\"type\":\"text\",\"text\":\"b\"}]}]}",
       "system\na\nb\0");
    /* no system part: the first message */
    IS("{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":\"yo\"}]}",
       "user\nhi\0");
    /* /v1/messages: top-level system (a string or text blocks), then the messages' start */
    IS("{\"system\":\"S\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", "system\nS\0");
    IS("{\"system\":[{\"type\":\"text\",\"text\":\"S\"}],\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
       "system\nS\0");
    /* /v1/responses: instructions, input items, or a text input */
    IS("{\"instructions\":\"S\",\"input\":\"hi\"}", "system\nS\0");
    IS("{\"input\":\"hi\"}", "user\nhi\0");
    IS("{\"input\":[{\"role\":\"developer\",\"content\":[{\"type\":\"input_text\",\"text\":\"D\"}]},"
       "{\"role\":\"user\",\"content\":\"u\"}]}",
       "developer\nD\0");
    IS("{\"input\":[{\"type\":\"function_call\",\"name\":\"f\"}]}", "");
    /* /v1/completions */
    IS("{\"prompt\":\"Once\"}", "prompt\nOnce");
    IS("{\"prompt\":[\"Once\",\"Twice\"]}", "prompt\nOnce");
    IS("{\"prompt\":[1,2,-3]}", "prompt\n1,2,-3,");
    IS("{\"prompt\":[[7,8],[9]]}", "prompt\n7,8,");
    /* nothing to key on */
    IS("{}", "");
    IS("[1,2]", "");
    IS("{\"messages\":5}", "");
    IS("{\"messages\":[1,{\"role\":\"system\",\"content\":\"S\"}]}", "");
    IS("{\"messages\":[{\"role\":7,\"content\":\"S\"}]}", "");
    IS("{\"messages\":[{\"role\":\"user\",\"content\":{\"x\":1}}]}", "user\n\0");
    /* the cut: never past cap, and equal prefixes give equal keys */
    size_t n = key("{\"messages\":[{\"role\":\"system\",\"content\":\"abcdefgh\"}]}", 10);
    CHECK(n == 10 && memcmp(out, "system\nabc", 10) == 0 && out[10] == 0xAA, "cut: %zu", n);
    n = key("{\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12]}", 12);
    CHECK(n == 12 && memcmp(out, "prompt\n1,2,3", 12) == 0 && out[12] == 0xAA, "cut ids: %zu", n);
    n = key("{\"messages\":[{\"role\":\"system\",\"content\":\"S\"}]}", 0);
    CHECK(n == 0 && out[0] == 0xAA, "cap 0: %zu", n);
    return check_done();
}
