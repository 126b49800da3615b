/* libcurl set up once for the CLI (http.h). */
#include "http.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int inited;

CURL *m40_http_handle(const char *url, const char *token, struct curl_slist **headers)
{
    if (!inited) {
        curl_global_init(CURL_GLOBAL_DEFAULT);
        inited = 1;
    }
    *headers = NULL;
    CURL *c = curl_easy_init();
    if (!c)
        return NULL;
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(c, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "m40/0.1.0");
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 30L);
    /* a stalled connection (under 1 byte/s for 60 s) is an error the caller may retry */
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, 60L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    if (token && *token) {
        char h[4096];
        snprintf(h, sizeof h, "Authorization: Bearer %s", token);
        *headers = curl_slist_append(*headers, h);
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, *headers);
    }
    return c;
}

static size_t to_buf(char *p, size_t size, size_t n, void *ud)
{
    m40_http_buf *b = ud;
    size_t add = size * n;
    if (b->len + add > (64u << 20)) /* an API answer, never a file: refuse a runaway body */
        return 0;
    char *d = realloc(b->data, b->len + add + 1);
    if (!d)
        return 0;
    memcpy(d + b->len, p, add);
    b->data = d;
    b->len += add;
    d[b->len] = '\0';
    return add;
}

long m40_http_get(const char *url, const char *token, m40_http_buf *out, char *err, size_t errlen)
{
    struct curl_slist *h;
    out->data = NULL;
    out->len = 0;
    CURL *c = m40_http_handle(url, token, &h);
    if (!c) {
        snprintf(err, errlen, "cannot start libcurl");
        return -1;
    }
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, to_buf);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 120L);
    CURLcode rc = curl_easy_perform(c);
    long status = -1;
    if (rc == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    else
        snprintf(err, errlen, "%s: %s", url, curl_easy_strerror(rc));
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    if (!out->data)
        out->data = calloc(1, 1);
    return status;
}
