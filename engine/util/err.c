/* Error messages into the caller's buffer (see err.h). */
#include "err.h"

#include <stdarg.h>
#include <stdio.h>

void m40_set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}
