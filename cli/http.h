/* The CLI's HTTP client: libcurl, set up the same way for every command that talks to a
 * server (m40 pull to the hub, m40 ps to a running m40). */
#ifndef M40_CLI_HTTP_H
#define M40_CLI_HTTP_H

#include <stddef.h>

#include <curl/curl.h>

typedef struct {
    char *data; /* NUL-terminated */
    size_t len;
} m40_http_buf;

/* A handle with the common options: redirects followed, a user agent, connect and
 * stall timeouts, and "Authorization: Bearer TOKEN" when token is not NULL (curl drops
 * it when a redirect leaves the host, as the hub's signed CDN links want). *headers
 * receives the list to free with curl_slist_free_all after the transfer. */
CURL *m40_http_handle(const char *url, const char *token, struct curl_slist **headers);

/* GET url into out (freed by the caller). Returns the final HTTP status, or -1 with
 * curl's reason in err when no response came. */
long m40_http_get(const char *url, const char *token, m40_http_buf *out, char *err, size_t errlen);

#endif
