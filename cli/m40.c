/* m40 command line: one binary, subcommands dispatched from a table. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *usage;
} commands[] = {
    {"run", m40_cmd_run, "run MODEL -p PROMPT [-n N] [--temp T] [--top-p P] [--top-k K] [--seed S]   generate text"},
    {"info", m40_cmd_info, "info MODEL                         architecture, hyperparameters, tokenizer, tensors"},
    {"tokenize", m40_cmd_tokenize, "tokenize [--no-bos] MODEL TEXT|-     token ids as a JSON array"},
    {"eval", m40_cmd_eval, "eval [--tol X] MODEL REF.json      teacher-forced comparison with reference logprobs"},
    {"serve", m40_cmd_serve, "serve MODEL [--port N] [--device D] [--name NAME]   OpenAI-compatible HTTP server (nginx)"},
    {"bench", m40_cmd_bench, "bench MODEL [--prompt-len N] [--gen N] [--batch B] [--reps N]   prefill/decode tokens/s and roofline"},
    {"pull", m40_cmd_pull, "pull ORG/REPO[:QUANT] | ORG/REPO/FILE.gguf [--revision REV]   fetch a GGUF model from the hub into the store"},
    {"list", m40_cmd_list, "list                               the models of the store: name, size, architecture, quantization, context"},
    {"rm", m40_cmd_rm, "rm NAME...                         remove models from the store"},
    {"ps", m40_cmd_ps, "ps [URL]                           what a running server holds: device, memory, sequences"},
    {"mkmodel", m40_cmd_mkmodel, "mkmodel --shape NAME --type TYPE [--seed S] [--layers N] OUT.gguf   synthetic model with random weights"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: m40 COMMAND [ARGS]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (commands[i].fn)
            fprintf(f, "  m40 %s\n", commands[i].usage);
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (commands[i].fn && !strcmp(argv[1], commands[i].name))
            return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "m40: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
