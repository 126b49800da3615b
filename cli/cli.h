/* Subcommands of the m40 CLI. Each gets argv starting at the command name and
 * returns the process exit status (0 ok, 1 failure, 2 usage error). */
#ifndef M40_CLI_H
#define M40_CLI_H

/* Weak until every command is in; the dispatcher skips missing ones. */
int m40_cmd_run(int argc, char **argv) __attribute__((weak));
int m40_cmd_info(int argc, char **argv) __attribute__((weak));
int m40_cmd_tokenize(int argc, char **argv) __attribute__((weak));
int m40_cmd_eval(int argc, char **argv) __attribute__((weak));
int m40_cmd_serve(int argc, char **argv) __attribute__((weak));
int m40_cmd_bench(int argc, char **argv) __attribute__((weak));

int m40_cmd_mkmodel(int argc, char **argv) __attribute__((weak));
int m40_cmd_pull(int argc, char **argv) __attribute__((weak));
int m40_cmd_list(int argc, char **argv) __attribute__((weak));
int m40_cmd_rm(int argc, char **argv) __attribute__((weak));
int m40_cmd_ps(int argc, char **argv) __attribute__((weak));
#endif
