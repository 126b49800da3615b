/* SHA-256 (FIPS 180-4), for checking downloaded files against the hub's LFS oid.
 * Small and self-contained: no crypto library is among the project's dependencies. */
#ifndef M40_CLI_SHA256_H
#define M40_CLI_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t h[8];
    uint64_t bytes;
    uint8_t buf[64];
    size_t fill;
} m40_sha256;

void m40_sha256_init(m40_sha256 *s);
void m40_sha256_update(m40_sha256 *s, const void *data, size_t n);
/* Writes the digest as 64 lowercase hex digits and a NUL. */
void m40_sha256_hex(m40_sha256 *s, char out[65]);
/* Hashes a whole file: 0, or -1 with errno set. */
int m40_sha256_file(const char *path, char out[65]);

#endif
