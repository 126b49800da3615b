/* A paged KV-cache layout for the attention tests (tests/gpu/test_*.cu): sequences of
 * the given lengths on physical blocks shuffled over a pool with `spares` blocks no
 * sequence uses (so a kernel that reads past its table reads garbage, not zeros).
 * Include after gpu_check.h (rnd32) and kernels.h (M40K_PAGE). */
#ifndef M40_PAGED_FIXTURE_H
#define M40_PAGED_FIXTURE_H

#include <algorithm>
#include <vector>

struct Paged {
    int n_seqs, n_blocks;
    std::vector<int32_t> indptr, indices, lpl, lens;
};

static Paged make_paged(const std::vector<int> &lens, int spares = 5)
{
    Paged p;
    p.n_seqs = (int)lens.size();
    p.lens = lens;
    p.indptr.push_back(0);
    int total = 0;
    for (int l : lens) {
        int pages = (l + M40K_PAGE - 1) / M40K_PAGE;
        total += pages;
        p.indptr.push_back(total);
        p.lpl.push_back(l - (pages - 1) * M40K_PAGE);
    }
    p.n_blocks = total + spares;
    std::vector<int32_t> perm(p.n_blocks);
    for (int i = 0; i < p.n_blocks; i++)
        perm[i] = i;
    for (int i = p.n_blocks - 1; i > 0; i--)
        std::swap(perm[i], perm[rnd32() % (i + 1)]);
    p.indices.assign(perm.begin(), perm.begin() + total);
    return p;
}

#endif
