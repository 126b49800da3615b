/* Error messages: the engine's functions that can fail take (char *err, size_t errlen)
 * and say why there, so that the caller (the nginx module, m40, a test) decides where
 * the message goes. */
#ifndef M40_ERR_H
#define M40_ERR_H

#include <stddef.h>

/* printf into err (when err and errlen are set). */
void m40_set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
