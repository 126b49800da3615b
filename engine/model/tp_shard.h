/* Tensor parallelism's partition of a dense model over n ranks (Megatron style): each
 * rank holds a contiguous run of the attention heads (its rows of Wq, Wk, Wv and their
 * biases, its columns of Wo, its attention sinks), a contiguous run of the FFN's hidden
 * units (rows of Wgate and Wup, columns of Wdown) and a contiguous run of the head's
 * vocabulary rows; everything of width dim (embeddings, norms) is whole on every rank.
 * The products that end a block (Wo, Wdown) give each rank a partial sum: one all-reduce
 * after each, and the head's logits are gathered (model_tp.c on the CPU, gpu/tp.c over
 * NCCL). Biases of those row-parallel products stay on rank 0 only, so that the sum adds
 * them once.
 *
 * A shard is views into the model's weights, never copies: a rank's rows are the
 * matrix's own rows from an offset; a rank's columns are each row's bytes from an
 * offset, so the view keeps the file's row_bytes as its stride and takes cols of the
 * rank (a column run must start and end on the weight type's blocks: m40_tp_check says
 * which split a model cannot take and why). The GPU upload packs such strided views. */
#ifndef M40_TP_SHARD_H
#define M40_TP_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "gpu/model_gpu.h"
#include "model.h"

typedef struct {
    int rank, n;
    /* this rank's share: heads, KV heads, FFN width, and so q_dim and kv_dim */
    int32_t n_heads, n_kv_heads, ffn_dim, q_dim, kv_dim;
    /* the head's rows of this rank: [vocab0, vocab0 + vocab_rows); every rank's logits
     * buffer is vocab_stride wide (the largest share), so a gather takes equal pieces */
    int64_t vocab0, vocab_rows, vocab_stride;
    m40_matrix output;
    m40_layer *layers; /* owned array of views (norms and kept biases point into the model's) */
} m40_tp_shard;

/* 0 when the model splits over n ranks; -1 with err naming what does not divide or
 * align (heads, KV heads, FFN width, vocabulary; Wo's and Wdown's column runs against
 * their block size) or what has no split yet (mixtures of experts). */
int m40_tp_check(const m40_model_params *p, const m40_layer *layers, int n, char *err, size_t errlen);

/* Rank `rank` of n: views into layers/output (which must pass m40_tp_check). -1 with err
 * when out of memory. */
int m40_tp_shard_make(const m40_model_params *p, const m40_matrix *output, const m40_layer *layers, int rank, int n,
                      m40_tp_shard *out, char *err, size_t errlen);
void m40_tp_shard_free(m40_tp_shard *s);

/* The rank's model parameters: p with its heads and FFN width (n_vocab stays whole:
 * tokens, embeddings and the gathered logits are the model's). */
void m40_tp_shard_params(const m40_tp_shard *s, const m40_model_params *p, m40_model_params *out);

#endif
