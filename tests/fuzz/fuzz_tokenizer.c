/* libFuzzer harness: the tokenizers and the streaming detokenizer on arbitrary bytes
 * (user text: invalid UTF-8, control-token strings, long runs) and arbitrary token ids.
 * The vocabulary: $M40_FUZZ_VOCAB (a GGUF file: an SPM or a byte-level BPE one), else
 * the synthetic one of `m40 mkmodel --shape tiny`, written once at start. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf/gguf.h"
#include "gguf/mkmodel.h"
#include "tokenizer/tokenizer.h"

static m40_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    char err[256], path[256];
    const char *vocab = getenv("M40_FUZZ_VOCAB");
    if (!vocab || !*vocab) {
        snprintf(path, sizeof path, "/tmp/m40-fuzz-vocab-%d.gguf", (int)getpid());
        m40_mkmodel_opts o = {0};
        o.shape = m40_mkmodel_find_shape("tiny");
        o.ftype = M40_MK_F32;
        o.seed = 1;
        o.n_threads = 1;
        if (!o.shape || m40_mkmodel_write(&o, path, NULL, err, sizeof err) != 0) {
            fprintf(stderr, "fuzz_tokenizer: cannot write the vocabulary: %s\n", err);
            exit(1);
        }
        vocab = path;
    }
    m40_gguf *g = NULL;
    if (m40_gguf_open(vocab, &g, err, sizeof err) != 0 || m40_tokenizer_from_gguf(g, &tok, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_tokenizer: %s: %s\n", vocab, err);
        exit(1);
    }
    m40_gguf_close(g);
    if (vocab == path)
        unlink(path);
    return 0;
}

/* Each execution costs about 2.4 us per input byte under ASan (SentencePiece's encoder
 * with a protobuf message per piece, then the detokenizer per token), so run.sh keeps
 * inputs to 512 bytes (-max_len): at 64 KB the fuzzer drifted to 2-7 KB inputs and 340
 * executions a second, for no code of ours that only long texts reach. What long texts
 * did reach, a text of more ids than the caller's buffer (m40_tokenize writes cap ids
 * and returns the full count), is kept reachable by a small buffer: 128 ids. */
#define IDS_CAP 128

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    int32_t ids[IDS_CAP];
    /* the text, with and without control-token parsing */
    for (int special = 0; special < 2; special++) {
        const int64_t n = m40_tokenize(tok, (const char *)data, size, special, special, ids, IDS_CAP, err, sizeof err);
        if (n < 0)
            continue;
        /* the ids written (all of them, or the first IDS_CAP of a longer text) decode */
        m40_detok *d = m40_detok_new(tok);
        for (int64_t i = 0; d && i < n && i < IDS_CAP; i++) {
            size_t k;
            (void)m40_detok_push(d, ids[i], &k);
        }
        if (d) {
            size_t k;
            (void)m40_detok_flush(d, &k);
            m40_detok_free(d);
        }
    }
    /* the bytes as token ids (in range or not): decoding must hold whatever comes */
    m40_detok *d = m40_detok_new(tok);
    for (size_t i = 0; d && i + 4 <= size; i += 4) {
        int32_t id;
        memcpy(&id, data + i, 4);
        size_t k;
        char buf[64];
        (void)m40_token_to_bytes(tok, id, (int)(i & 1), buf, sizeof buf);
        (void)m40_detok_push(d, id, &k);
    }
    if (d) {
        size_t k;
        (void)m40_detok_flush(d, &k);
        m40_detok_free(d);
    }
    return 0;
}
