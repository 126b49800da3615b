/* m40 rm NAME...: removes models from the store (store.h): every shard, its .sha256 and
 * any .partial left of it, then the folders that became empty. Only what is inside the
 * store: an ordinary path is refused, so a typo cannot delete a file elsewhere. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "store.h"

static int unlink_quiet(const char *path, int *removed)
{
    if (unlink(path) == 0) {
        (*removed)++;
        return 0;
    }
    if (errno == ENOENT)
        return 0;
    fprintf(stderr, "m40 rm: %s: %s\n", path, strerror(errno));
    return -1;
}

static int remove_file_set(const char *gguf, int *removed)
{
    char p[PATH_MAX + 16];
    int bad = 0;
    snprintf(p, sizeof p, "%s.sha256", gguf); /* first: the file stops counting at once */
    bad |= unlink_quiet(p, removed);
    bad |= unlink_quiet(gguf, removed);
    snprintf(p, sizeof p, "%s.partial", gguf);
    bad |= unlink_quiet(p, removed);
    return bad;
}

int m40_cmd_rm(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fprintf(argc < 2 ? stderr : stdout, "usage: m40 rm NAME...   remove models from the store (names as m40 list shows them)\n");
        return argc < 2 ? 2 : 0;
    }
    char root[PATH_MAX];
    if (m40_store_dir(root, sizeof root) != 0) {
        fprintf(stderr, "m40 rm: no model store: set M40_MODELS or HOME\n");
        return 1;
    }
    char real_root[PATH_MAX];
    if (!realpath(root, real_root)) {
        fprintf(stderr, "m40 rm: the model store %s: %s\n", root, strerror(errno));
        return 1;
    }
    int rc = 0;
    for (int i = 1; i < argc; i++) {
        char path[PATH_MAX], err[1024], real[PATH_MAX];
        if (m40_store_resolve(argv[i], path, sizeof path, err, sizeof err) != 0) {
            fprintf(stderr, "m40 rm: %s\n", err);
            rc = 1;
            continue;
        }
        size_t rl = strlen(real_root);
        if (!realpath(path, real) || strncmp(real, real_root, rl) || real[rl] != '/') {
            fprintf(stderr, "m40 rm: %s is not in the model store %s; m40 rm deletes only models of the store\n",
                    argv[i], root);
            rc = 1;
            continue;
        }
        int idx, count, removed = 0, bad = 0;
        size_t plen;
        if (m40_split_name(real, &idx, &count, &plen)) {
            for (int k = 1; k <= count; k++) {
                char shard[PATH_MAX + 32];
                snprintf(shard, sizeof shard, "%.*s-%05d-of-%05d.gguf", (int)plen, real, k, count);
                bad |= remove_file_set(shard, &removed);
            }
        } else {
            bad |= remove_file_set(real, &removed);
        }
        /* the folders it leaves empty, up to the store (rmdir fails on a non-empty one) */
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s", real);
        for (char *s; (s = strrchr(dir, '/')) && (size_t)(s - dir) > rl;) {
            *s = '\0';
            if (rmdir(dir) != 0)
                break;
        }
        if (bad)
            rc = 1;
        else
            printf("removed %s\n", real + rl + 1);
    }
    return rc;
}
