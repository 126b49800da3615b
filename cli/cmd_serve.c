/* m40 serve: run the OpenAI-compatible server on one model without writing an
 * nginx.conf by hand.
 *
 * Writes a small nginx.conf into a fresh temporary directory (pid file, temp paths
 * and the config live there; the error log goes to stderr) and runs nginx in the
 * foreground as a child: the signals m40 gets (Ctrl-C, SIGTERM, SIGHUP for a reload...)
 * are passed on to nginx's master, and once it exits the directory is removed, so that
 * servers started and stopped leave nothing in /tmp. The module is
 * build/ngx_http_m40_module.so beside this binary unless --module says otherwise.
 * MODEL is a path or a name of the model store (m40 list). The chat page (m40_ui) is
 * on at "/" beside the API unless --no-ui. */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli.h"
#include "m40_engine.h" /* M40_MAX_PREFILL_TOKENS */
#include "store.h"

#define SERVE_DEFAULT_NGINX "/usr/sbin/nginx"

static void serve_usage(FILE *f)
{
    fprintf(f,
            "usage: m40 serve MODEL [options]\n"
            "  --port N        TCP port (default 8080)\n"
            "  --host ADDR     listen address (default 127.0.0.1)\n"
            "  --device D      cpu or a GPU index (default cpu)\n"
            "  --gpus N        N worker processes on GPUs D .. D+N-1, one model copy each\n"
            "                  (data parallel; default 1; GPU devices only)\n"
            "  --tp N          each worker's model split over N GPUs by tensor parallelism (NCCL):\n"
            "                  worker k takes GPUs D+k*N .. D+k*N+N-1 (default 1)\n"
            "  --name NAME     model name in the API (default: file name without .gguf)\n"
            "  --also [NAME=]MODEL\n"
            "                  one more model in the same server (repeatable, up to 7): requests\n"
            "                  choose it by its name (default: the file name); MODEL stays the\n"
            "                  default. They share the device (m40_model ... kv_share)\n"
            "  --threads N     CPU threads (default: all)\n"
            "  --ctx-size N    context per sequence (default: the model's)\n"
            "  --max-seqs N    concurrent sequences (default: 4 on the cpu, on a GPU what\n"
            "                  the KV cache holds, up to 256)\n"
            "  --max-queue N   requests waiting before 429 (default 1024)\n"
            "  --gpu-memory-fraction F\n"
            "                  share of the GPU's memory to fill, KV cache included (default 0.90)\n"
            "  --prefill-budget N\n"
            "                  prompt tokens a step, all sequences (default: the chunk)\n"
            "  --prefill-chunk N\n"
            "                  prompt tokens a step, one sequence (default 512)\n"
            "  --itl-guard F|off\n"
            "                  while sequences decode, a step with prompt tokens takes at\n"
            "                  most F times a decode-only step (default off)\n"
            "  --no-ui         no chat page at / (the API alone)\n"
            "  --exact         CPU: the exact F32 reference products (m40_cpu_exact on) instead\n"
            "                  of the fast int16 path\n"
            "  --batch-invariant\n"
            "                  GPU: every request computed as if it ran alone (m40_batch_invariant\n"
            "                  on): greedy output does not depend on the load; slower. Not with\n"
            "                  --tp; no change on the cpu\n"
            "  --module PATH   ngx_http_m40_module.so (default: beside the m40 binary)\n"
            "  --nginx PATH    nginx binary (default " SERVE_DEFAULT_NGINX ")\n"
            "  --user USER     user of the worker process when started as root\n"
            "                  (default: the owner of the model file)\n");
}

static void put_escaped(FILE *f, const char *s)
{
    for (; *s; s++) {
        if (*s == '"' || *s == '\\' || *s == '$')
            fputc('\\', f);
        fputc(*s, f);
    }
}

/* Writes a then b as one double-quoted nginx configuration string. */
static void put_quoted2(FILE *f, const char *a, const char *b)
{
    fputc('"', f);
    put_escaped(f, a);
    put_escaped(f, b);
    fputc('"', f);
}

static void put_quoted(FILE *f, const char *s)
{
    put_quoted2(f, s, "");
}

static int is_number(const char *s, long lo, long hi)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    return *s && !*end && errno == 0 && v >= lo && v <= hi;
}

static volatile sig_atomic_t nginx_pid;

/* Passed on to nginx's master, which decides what each means (nginx's own signals). */
static void forward_signal(int sig)
{
    if (nginx_pid > 0)
        kill((pid_t)nginx_pid, sig);
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    if ((type == FTW_DP ? rmdir(path) : unlink(path)) != 0 && errno != ENOENT)
        fprintf(stderr, "m40 serve: removing %s: %s\n", path, strerror(errno));
    return 0;
}

/* Runs nginx with nargv until it exits, then removes dir. Returns nginx's exit status
 * (128 + N when a signal N ended it). */
static int run_nginx(const char *nginx, char *const nargv[], const char *dir)
{
    sigset_t block, old;
    static const int forwarded[] = {SIGINT, SIGTERM, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2, SIGWINCH};
    sigemptyset(&block);
    for (size_t i = 0; i < sizeof forwarded / sizeof forwarded[0]; i++)
        sigaddset(&block, forwarded[i]);
    /* no signal between fork and the handlers may end m40 before nginx has its pid */
    sigprocmask(SIG_BLOCK, &block, &old);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "m40 serve: fork: %s\n", strerror(errno));
        sigprocmask(SIG_SETMASK, &old, NULL);
        nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
        return 1;
    }
    if (pid == 0) {
        /* m40 killed outright (SIGKILL) must not leave nginx serving on: its master then
         * gets SIGTERM (the temporary directory stays, as nothing is left to remove it) */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(1); /* it died before prctl */
        sigprocmask(SIG_SETMASK, &old, NULL);
        execv(nginx, nargv);
        fprintf(stderr, "m40 serve: exec %s: %s\n", nginx, strerror(errno));
        _exit(127);
    }
    nginx_pid = pid;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = forward_signal;
    sa.sa_flags = SA_RESTART;
    for (size_t i = 0; i < sizeof forwarded / sizeof forwarded[0]; i++)
        sigaction(forwarded[i], &sa, NULL);
    sigprocmask(SIG_SETMASK, &old, NULL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    if (WIFSIGNALED(status)) {
        fprintf(stderr, "m40 serve: nginx exited on signal %d\n", WTERMSIG(status));
        return 128 + WTERMSIG(status);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

static int module_beside_binary(char *out, size_t outlen)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return -1;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash)
        return -1;
    *slash = '\0';
    int w = snprintf(out, outlen, "%s/ngx_http_m40_module.so", exe);
    return w > 0 && (size_t)w < outlen ? 0 : -1;
}

int m40_cmd_serve(int argc, char **argv)
{
    const char *model = NULL, *port = "8080", *host = "127.0.0.1", *device = "cpu";
    const char *name = NULL, *threads = NULL, *ctx_size = NULL, *max_seqs = NULL, *max_queue = NULL;
    const char *mem_fraction = NULL, *prefill_budget = NULL, *prefill_chunk = NULL, *itl_guard = NULL;
    const char *module = NULL, *nginx = SERVE_DEFAULT_NGINX, *user = NULL, *gpus = "1", *tp = "1";
    int ui = 1, exact = 0, batch_invariant = 0;
    enum { MAX_ALSO = 7 };
    const char *also[MAX_ALSO];
    int n_also = 0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            serve_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--no-ui")) {
            ui = 0;
            continue;
        }
        if (!strcmp(a, "--exact")) {
            exact = 1;
            continue;
        }
        if (!strcmp(a, "--batch-invariant")) {
            batch_invariant = 1;
            continue;
        }
        if (a[0] == '-' && a[1] == '-') {
            if (i + 1 >= argc) {
                fprintf(stderr, "m40 serve: %s needs a value\n", a);
                return 2;
            }
            const char *v = argv[++i];
            if (!strcmp(a, "--port"))
                port = v;
            else if (!strcmp(a, "--host"))
                host = v;
            else if (!strcmp(a, "--device"))
                device = v;
            else if (!strcmp(a, "--gpus"))
                gpus = v;
            else if (!strcmp(a, "--tp"))
                tp = v;
            else if (!strcmp(a, "--name"))
                name = v;
            else if (!strcmp(a, "--also")) {
                if (n_also == MAX_ALSO) {
                    fprintf(stderr, "m40 serve: at most %d --also models\n", MAX_ALSO);
                    return 2;
                }
                also[n_also++] = v;
            }
            else if (!strcmp(a, "--threads"))
                threads = v;
            else if (!strcmp(a, "--ctx-size"))
                ctx_size = v;
            else if (!strcmp(a, "--max-seqs"))
                max_seqs = v;
            else if (!strcmp(a, "--max-queue"))
                max_queue = v;
            else if (!strcmp(a, "--gpu-memory-fraction"))
                mem_fraction = v;
            else if (!strcmp(a, "--prefill-budget"))
                prefill_budget = v;
            else if (!strcmp(a, "--prefill-chunk"))
                prefill_chunk = v;
            else if (!strcmp(a, "--itl-guard"))
                itl_guard = v;
            else if (!strcmp(a, "--module"))
                module = v;
            else if (!strcmp(a, "--nginx"))
                nginx = v;
            else if (!strcmp(a, "--user"))
                user = v;
            else {
                fprintf(stderr, "m40 serve: unknown option %s\n", a);
                serve_usage(stderr);
                return 2;
            }
            continue;
        }
        if (model) {
            fprintf(stderr, "m40 serve: more than one model given\n");
            return 2;
        }
        model = a;
    }

    if (!model) {
        serve_usage(stderr);
        return 2;
    }
    if (!is_number(port, 1, 65535)) {
        fprintf(stderr, "m40 serve: --port must be 1..65535\n");
        return 2;
    }
    if (strcmp(device, "cpu") && !is_number(device, 0, 1024)) {
        fprintf(stderr, "m40 serve: --device must be cpu or a GPU index\n");
        return 2;
    }
    if (!is_number(gpus, 1, 64)) {
        fprintf(stderr, "m40 serve: --gpus must be 1..64\n");
        return 2;
    }
    const int n_gpus = atoi(gpus);
    if (!is_number(tp, 1, 64) || (atoi(tp) > 1 && !strcmp(device, "cpu"))) {
        fprintf(stderr, "m40 serve: --tp must be 1..64 and needs a GPU device (--device D)\n");
        return 2;
    }
    if (batch_invariant && atoi(tp) > 1) {
        fprintf(stderr, "m40 serve: --batch-invariant does not work with --tp %d\n", atoi(tp));
        return 2;
    }
    if (n_gpus > 1 && !strcmp(device, "cpu")) {
        /* every worker holds its own engine and model copy: on one CPU they would only
         * split its cores */
        fprintf(stderr, "m40 serve: --gpus needs a GPU device (--device D: worker k drives GPU D+k)\n");
        return 2;
    }
    if ((threads && !is_number(threads, 0, 1024)) || (ctx_size && !is_number(ctx_size, 0, 1 << 24))
        || (max_seqs && !is_number(max_seqs, 1, 4096))) {
        fprintf(stderr, "m40 serve: --threads, --ctx-size and --max-seqs take non-negative numbers\n");
        return 2;
    }
    if (max_queue && !is_number(max_queue, 1, 1 << 30)) {
        fprintf(stderr, "m40 serve: --max-queue takes a positive number\n");
        return 2;
    }
    if (mem_fraction) {
        /* nginx checks it again; a clear message here beats a failed start */
        char *end;
        errno = 0;
        double f = strtod(mem_fraction, &end);
        if (!*mem_fraction || *end || errno || !(f > 0.0 && f <= 1.0)) {
            fprintf(stderr, "m40 serve: --gpu-memory-fraction takes a number greater than 0 and at most 1\n");
            return 2;
        }
    }
    if ((prefill_budget && !is_number(prefill_budget, 1, M40_MAX_PREFILL_TOKENS))
        || (prefill_chunk && !is_number(prefill_chunk, 1, M40_MAX_PREFILL_TOKENS))) {
        fprintf(stderr, "m40 serve: --prefill-budget and --prefill-chunk take a number from 1 to %d\n",
                M40_MAX_PREFILL_TOKENS);
        return 2;
    }
    if (itl_guard && strcmp(itl_guard, "off")) {
        char *end;
        errno = 0;
        double g = strtod(itl_guard, &end);
        if (!*itl_guard || *end || errno || !(g >= 1.0 && g <= 100.0)) {
            fprintf(stderr, "m40 serve: --itl-guard takes a number from 1 to 100 or off\n");
            return 2;
        }
    }
    if (strpbrk(host, " \t;{}\"'") || (name && strpbrk(name, "\"\\$\n"))) {
        fprintf(stderr, "m40 serve: invalid --host or --name\n");
        return 2;
    }

    char model_abs[PATH_MAX], stored[PATH_MAX];
    struct stat st;
    model = m40_model_arg("serve", model, stored, sizeof stored);
    if (!realpath(model, model_abs) || stat(model_abs, &st) != 0 || !S_ISREG(st.st_mode)) {
        fprintf(stderr, "m40 serve: %s: %s\n", model, errno ? strerror(errno) : "not a regular file");
        return 1;
    }
    /* --also [NAME=]MODEL: a name (the part before '=', when it holds no '/') and a file
     * or store name, resolved like MODEL */
    char also_abs[MAX_ALSO][PATH_MAX], also_name[MAX_ALSO][128];
    for (int k = 0; k < n_also; k++) {
        const char *eq = strchr(also[k], '='), *path = also[k];
        also_name[k][0] = '\0';
        if (eq && !memchr(also[k], '/', (size_t)(eq - also[k]))) {
            size_t nl = (size_t)(eq - also[k]);
            if (nl == 0 || nl >= sizeof also_name[k] || memchr(also[k], '"', nl) || memchr(also[k], '\\', nl) ||
                memchr(also[k], '$', nl)) {
                fprintf(stderr, "m40 serve: --also %s: invalid name\n", also[k]);
                return 2;
            }
            memcpy(also_name[k], also[k], nl);
            also_name[k][nl] = '\0';
            path = eq + 1;
        }
        char st_k[PATH_MAX];
        struct stat sk;
        path = m40_model_arg("serve", path, st_k, sizeof st_k);
        if (!realpath(path, also_abs[k]) || stat(also_abs[k], &sk) != 0 || !S_ISREG(sk.st_mode)) {
            fprintf(stderr, "m40 serve: %s: %s\n", path, errno ? strerror(errno) : "not a regular file");
            return 1;
        }
    }

    char module_path[PATH_MAX];
    if (module) {
        if (!realpath(module, module_path)) {
            fprintf(stderr, "m40 serve: %s: %s\n", module, strerror(errno));
            return 1;
        }
    } else if (module_beside_binary(module_path, sizeof module_path) != 0 || access(module_path, R_OK) != 0) {
        fprintf(stderr, "m40 serve: the nginx module is not beside the m40 binary (%s);"
                        " build it with 'make module' or pass --module PATH\n", module_path);
        return 1;
    }
    if (access(nginx, X_OK) != 0) {
        fprintf(stderr, "m40 serve: %s: %s (install nginx or pass --nginx PATH)\n", nginx, strerror(errno));
        return 1;
    }

    /* Started as root, nginx runs its worker as an unprivileged user, which must
     * be able to read the model: by default, its owner. */
    char user_buf[256] = "";
    if (geteuid() == 0) {
        if (!user) {
            struct passwd *pw = getpwuid(st.st_uid);
            if (pw)
                snprintf(user_buf, sizeof user_buf, "%s", pw->pw_name);
        } else {
            snprintf(user_buf, sizeof user_buf, "%s", user);
        }
    }

    const char *tmp_root = getenv("TMPDIR");
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/m40-serve-XXXXXX", tmp_root && *tmp_root ? tmp_root : "/tmp");
    if (!mkdtemp(dir)) {
        fprintf(stderr, "m40 serve: mkdtemp %s: %s\n", dir, strerror(errno));
        return 1;
    }
    /* The worker (possibly another user) creates its temp folders in here. */
    chmod(dir, 0755);

    char conf[PATH_MAX + 16];
    snprintf(conf, sizeof conf, "%s/nginx.conf", dir);
    FILE *f = fopen(conf, "w");
    if (!f) {
        fprintf(stderr, "m40 serve: %s: %s\n", conf, strerror(errno));
        nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
        return 1;
    }

    fprintf(f, "# written by m40 serve\nload_module ");
    put_quoted(f, module_path);
    /* worker k drives GPU device + k (the module's m40_device) */
    fprintf(f, ";\ndaemon off;\nworker_processes %d;\npid ", n_gpus);
    put_quoted2(f, dir, "/nginx.pid");
    fprintf(f, ";\nerror_log stderr notice;\n");
    /* nginx hands its workers an empty environment (TZ aside): the engine's tuning
     * switches (every M40_* variable, engine/util/tuning.c) and CUDA_VISIBLE_DEVICES
     * reach the worker only through env directives. Names of other characters than
     * [A-Z0-9_] are not passed (they could not be switches, and would need quoting). */
    for (char **e = environ; e && *e; e++) {
        const char *eq = strchr(*e, '=');
        size_t n = eq ? (size_t)(eq - *e) : 0;
        /* NCCL_*: tensor parallelism's settings (NCCL_NVLS_ENABLE=0 on hosts that keep
         * NVLink multicast off) */
        int ok = n > 0 && n < 128 &&
                 (!strncmp(*e, "M40_", 4) || !strncmp(*e, "NCCL_", 5) ||
                  (n == 20 && !strncmp(*e, "CUDA_VISIBLE_DEVICES", 20)));
        for (size_t i = 0; ok && i < n; i++)
            ok = ((*e)[i] >= 'A' && (*e)[i] <= 'Z') || ((*e)[i] >= '0' && (*e)[i] <= '9') || (*e)[i] == '_';
        if (ok)
            fprintf(f, "env %.*s;\n", (int)n, *e);
    }
    if (user_buf[0]) {
        fprintf(f, "user ");
        put_quoted(f, user_buf);
        fprintf(f, ";\n");
    }
    fprintf(f, "events { worker_connections 1024; }\n\nhttp {\n");
    static const char *const temps[] = {"client_body", "proxy", "fastcgi", "uwsgi", "scgi"};
    for (size_t i = 0; i < sizeof temps / sizeof temps[0]; i++) {
        char sub[32];
        snprintf(sub, sizeof sub, "/%s", temps[i]);
        fprintf(f, "    %s_temp_path ", temps[i]);
        put_quoted2(f, dir, sub);
        fprintf(f, ";\n");
    }
    fprintf(f, "    access_log off;\n    client_max_body_size 16m;\n\n    m40_model ");
    put_quoted(f, model_abs);
    if (atoi(tp) > 1)
        fprintf(f, " tp=%d", atoi(tp));
    if (name) {
        fprintf(f, " ");
        char nm[512];
        snprintf(nm, sizeof nm, "name=%s", name);
        put_quoted(f, nm);
    }
    fprintf(f, ";\n");
    for (int k = 0; k < n_also; k++) {
        fprintf(f, "    m40_model ");
        put_quoted(f, also_abs[k]);
        if (also_name[k][0]) {
            char nm[160];
            snprintf(nm, sizeof nm, "name=%.127s", also_name[k]);
            fprintf(f, " ");
            put_quoted(f, nm);
        }
        fprintf(f, ";\n");
    }
    fprintf(f, "    m40_device %s;\n", device);
    if (exact)
        fprintf(f, "    m40_cpu_exact on;\n");
    if (batch_invariant)
        fprintf(f, "    m40_batch_invariant on;\n");
    /* the options given, as their directives */
    const struct {
        const char *directive, *value;
    } given[] = {{"m40_threads", threads},
                 {"m40_ctx_size", ctx_size},
                 {"m40_max_seqs", max_seqs},
                 {"m40_max_queue", max_queue},
                 {"m40_gpu_memory_fraction", mem_fraction},
                 {"m40_prefill_budget", prefill_budget},
                 {"m40_prefill_chunk", prefill_chunk},
                 {"m40_itl_guard", itl_guard}};
    for (size_t i = 0; i < sizeof given / sizeof given[0]; i++)
        if (given[i].value)
            fprintf(f, "    %s %s;\n", given[i].directive, given[i].value);
    /* reuseport: the kernel spreads the connections over the workers (their GPUs) */
    fprintf(f, "\n    server {\n        listen %s%s%s:%s%s;\n        location / {\n            m40_api;\n%s"
               "        }\n    }\n}\n",
            strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "", port, n_gpus > 1 ? " reuseport" : "",
            ui ? "            m40_ui on;\n" : "");
    if (fclose(f) != 0) {
        fprintf(stderr, "m40 serve: writing %s: %s\n", conf, strerror(errno));
        nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
        return 1;
    }

    fprintf(stderr, "m40 serve: http://%s%s%s:%s/v1 (config %s)\n", strchr(host, ':') ? "[" : "", host,
            strchr(host, ':') ? "]" : "", port, conf);
    if (ui)
        fprintf(stderr, "m40 serve: chat page at http://%s%s%s:%s/\n", strchr(host, ':') ? "[" : "", host,
                strchr(host, ':') ? "]" : "", port);
    fflush(stderr);

    char *const nargv[] = {(char *)nginx, "-p", dir, "-c", conf, "-e", "stderr", NULL};
    return run_nginx(nginx, nargv, dir);
}
