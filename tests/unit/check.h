/* Minimal unit-test harness: CHECK counts, failures print where and why, and the
 * binary ends with the plain line "N passed, N failed" (tests/run.sh adds them up).
 * Exit status: 0 all passed, 1 some failed. SKIP_ALL prints why and exits 0 with a
 * "0 passed, 0 failed, 1 skipped" line. */
#ifndef M40_TEST_CHECK_H
#define M40_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int check_passed, check_failed, check_skipped;

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        if (cond) {                                                           \
            check_passed++;                                                   \
        } else {                                                              \
            check_failed++;                                                   \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);   \
            fprintf(stderr, __VA_ARGS__);                                     \
            fputc('\n', stderr);                                              \
        }                                                                     \
    } while (0)

#define SKIP(...)                                                             \
    do {                                                                      \
        check_skipped++;                                                      \
        fprintf(stderr, "SKIP %s:%d: ", __FILE__, __LINE__);                  \
        fprintf(stderr, __VA_ARGS__);                                         \
        fputc('\n', stderr);                                                  \
    } while (0)

static inline int check_done(void)
{
    printf("%d passed, %d failed, %d skipped\n", check_passed, check_failed, check_skipped);
    return check_failed ? 1 : 0;
}

/* Directory of the shared fixtures: $M40_SHARED, else ../shared relative to the
 * project root (tests run from the root). NULL when absent. */
static inline const char *check_shared_dir(void)
{
    static char buf[2048];
    const char *env = getenv("M40_SHARED");
    snprintf(buf, sizeof buf, "%s", env && *env ? env : "../shared");
    struct stat st;
    if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode))
        return NULL;
    return buf;
}

/* Path of a shared fixture ("models/stories260K.gguf"); NULL when it is absent. */
static inline const char *check_shared_file(const char *rel, char *buf, size_t cap)
{
    const char *d = check_shared_dir();
    struct stat st;
    if (!d)
        return NULL;
    snprintf(buf, cap, "%s/%s", d, rel);
    return stat(buf, &st) == 0 ? buf : NULL;
}

#endif
