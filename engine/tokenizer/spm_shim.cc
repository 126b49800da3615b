// C API of spm.h over sentencepiece::SentencePieceProcessor. The only C++ in the
// project: it exists so that the rest of the engine stays C11. Every entry point
// catches everything (allocation failures in the library or in std::vector), so no
// exception ever crosses into C; failures come back as NULL / -1 with a message.
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include <sentencepiece_processor.h>

extern "C" {
#include "spm.h"
}

struct m40_spm {
    sentencepiece::SentencePieceProcessor proc;
    int32_t n_pieces;
};

static void spm_set_err(char *err, size_t errlen, const char *what, const char *detail)
{
    if (err && errlen)
        snprintf(err, errlen, "%s%s%s", what, detail && *detail ? ": " : "", detail ? detail : "");
}

// Finishes a load: a processor whose status is not ok is useless, so it is freed here.
static m40_spm *spm_finish_load(m40_spm *s, const sentencepiece::util::Status &st, const char *what, char *err,
                                size_t errlen)
{
    if (!st.ok()) {
        spm_set_err(err, errlen, what, st.error_message());
        delete s;
        return nullptr;
    }
    s->n_pieces = s->proc.GetPieceSize();
    if (s->n_pieces <= 0) {
        spm_set_err(err, errlen, what, "model has no pieces");
        delete s;
        return nullptr;
    }
    return s;
}

extern "C" m40_spm *m40_spm_load_proto(const void *proto, size_t len, char *err, size_t errlen)
{
    m40_spm *s = nullptr;
    if (!proto && len) {
        spm_set_err(err, errlen, "sentencepiece: NULL model proto", nullptr);
        return nullptr;
    }
    try {
        s = new m40_spm();
        auto st = s->proc.LoadFromSerializedProto(
            absl::string_view(static_cast<const char *>(proto ? proto : ""), len));
        return spm_finish_load(s, st, "sentencepiece: cannot load model proto", err, errlen);
    } catch (const std::exception &e) {
        delete s;
        spm_set_err(err, errlen, "sentencepiece: cannot load model proto", e.what());
    } catch (...) {
        delete s;
        spm_set_err(err, errlen, "sentencepiece: cannot load model proto", "unknown exception");
    }
    return nullptr;
}

extern "C" m40_spm *m40_spm_load_file(const char *path, char *err, size_t errlen)
{
    m40_spm *s = nullptr;
    if (!path) {
        spm_set_err(err, errlen, "sentencepiece: NULL path", nullptr);
        return nullptr;
    }
    try {
        std::string what = std::string("sentencepiece: cannot load ") + path;
        s = new m40_spm();
        auto st = s->proc.Load(absl::string_view(path));
        return spm_finish_load(s, st, what.c_str(), err, errlen);
    } catch (const std::exception &e) {
        delete s;
        spm_set_err(err, errlen, "sentencepiece: cannot load model file", e.what());
    } catch (...) {
        delete s;
        spm_set_err(err, errlen, "sentencepiece: cannot load model file", "unknown exception");
    }
    return nullptr;
}

extern "C" void m40_spm_free(m40_spm *s)
{
    delete s;
}

extern "C" int32_t m40_spm_n_pieces(const m40_spm *s)
{
    return s ? s->n_pieces : 0;
}

extern "C" const char *m40_spm_piece(const m40_spm *s, int32_t id)
{
    if (!s || id < 0 || id >= s->n_pieces)
        return nullptr;
    try {
        // The reference points into the processor's ModelProto: stable for s's lifetime.
        return s->proc.IdToPiece(id).c_str();
    } catch (...) {
        return nullptr;
    }
}

extern "C" float m40_spm_score(const m40_spm *s, int32_t id)
{
    if (!s || id < 0 || id >= s->n_pieces)
        return 0.0f;
    try {
        return s->proc.GetScore(id);
    } catch (...) {
        return 0.0f;
    }
}

extern "C" int64_t m40_spm_encode(const m40_spm *s, const char *text, size_t len, int32_t *ids, int64_t cap,
                                  char *err, size_t errlen)
{
    if (!s || (!text && len) || cap < 0 || (!ids && cap > 0)) {
        spm_set_err(err, errlen, "sentencepiece: bad arguments to encode", nullptr);
        return -1;
    }
    try {
        std::vector<int> out;
        auto st = s->proc.Encode(absl::string_view(text ? text : "", len), &out);
        if (!st.ok()) {
            spm_set_err(err, errlen, "sentencepiece: encode failed", st.error_message());
            return -1;
        }
        int64_t n = static_cast<int64_t>(out.size());
        for (int64_t i = 0; i < n && i < cap; i++)
            ids[i] = out[static_cast<size_t>(i)];
        return n;
    } catch (const std::exception &e) {
        spm_set_err(err, errlen, "sentencepiece: encode failed", e.what());
    } catch (...) {
        spm_set_err(err, errlen, "sentencepiece: encode failed", "unknown exception");
    }
    return -1;
}
