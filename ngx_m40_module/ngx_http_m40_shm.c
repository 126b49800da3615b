/* The metrics zone: the counters and states of every worker's engines in shared
 * memory, so that /metrics, /health and /v1/models describe the whole server whichever
 * worker answers, the way nginx's own modules share counters (a zone of
 * ngx_shared_memory_add, its slab pool's mutex).
 *
 * Each engine of each worker owns a slot, claimed at the worker's start under the
 * mutex and written by its owner alone: a copy of the engine's statistics after every
 * batch of engine events and every submission (the engine counts a request when it is
 * submitted and its tokens before it hands out their events, so a client that has its
 * answer finds it counted). A sequence number, odd while the owner writes, lets readers
 * copy a slot without stopping the writer. When a worker exits (a reload, a shutdown)
 * its slots' counters are added to the model's retired sum and the slots freed, in one
 * step under the mutex, so that a sum taken under the mutex counts every request once:
 * in a live slot or in the retired sum. A worker that died without exiting is found by
 * its pid and retired the same way by the next reader.
 *
 * The zone keeps its contents over a reload (same name, size and tag), so the counters
 * run on across reloads; gauges (queue, running, KV) are those of live engines. */
#include "ngx_http_m40_module.h"

#include <signal.h>


struct ngx_http_m40_shm_slot_s {
    ngx_atomic_t         seq;         /* odd while the owner writes */
    ngx_pid_t            pid;         /* 0: free (changed under the mutex) */
    size_t               name_len;
    u_char               name[NGX_HTTP_M40_NAME_MAX];
    ngx_int_t            state;       /* -1: pending, 3: unloaded, else m40_engine_state */
    m40_engine_stats     s;
    ngx_http_m40_mcounters_t  mc;
};

typedef struct {
    size_t               name_len;    /* 0: free */
    u_char               name[NGX_HTTP_M40_NAME_MAX];
    m40_engine_stats     s;           /* counters only */
    ngx_http_m40_mcounters_t  mc;
} ngx_http_m40_shm_retired_t;

typedef struct {
    ngx_atomic_t                 http_requests;
    ngx_http_m40_shm_slot_t      slots[NGX_HTTP_M40_SHM_SLOTS];
    ngx_http_m40_shm_retired_t   retired[NGX_HTTP_M40_SHM_NAMES];
} ngx_http_m40_shm_t;


static ngx_str_t  ngx_http_m40_shm_name = ngx_string("m40_metrics");

static ngx_uint_t  ngx_http_m40_shm_full_logged;


static ngx_int_t
ngx_http_m40_shm_init(ngx_shm_zone_t *zone, void *data)
{
    ngx_slab_pool_t     *shpool;
    ngx_http_m40_shm_t  *sh;

    if (data) {                 /* a reload: the old cycle's zone, counters and all */
        zone->data = data;
        return NGX_OK;
    }

    shpool = (ngx_slab_pool_t *) zone->shm.addr;

    if (zone->shm.exists) {
        zone->data = shpool->data;
        return NGX_OK;
    }

    sh = ngx_slab_calloc(shpool, sizeof(ngx_http_m40_shm_t));
    if (sh == NULL) {
        return NGX_ERROR;
    }

    shpool->data = sh;
    zone->data = sh;

    return NGX_OK;
}


ngx_int_t
ngx_http_m40_shm_add(ngx_conf_t *cf, ngx_http_m40_main_conf_t *mcf)
{
    size_t           size;
    ngx_shm_zone_t  *zone;

    /* the slab pool's bookkeeping (a page descriptor per page, its own header)
     * takes a little of the zone: an eighth more and 8 pages cover it */
    size = ngx_align(sizeof(ngx_http_m40_shm_t), ngx_pagesize);
    size += size / 8 + 8 * ngx_pagesize;

    zone = ngx_shared_memory_add(cf, &ngx_http_m40_shm_name, size,
                                 &ngx_http_m40_module);
    if (zone == NULL) {
        return NGX_ERROR;
    }

    zone->init = ngx_http_m40_shm_init;
    mcf->shm_zone = zone;

    return NGX_OK;
}


static ngx_http_m40_shm_t *
ngx_http_m40_shm_get(ngx_http_m40_main_conf_t *mcf, ngx_slab_pool_t **shpool)
{
    if (mcf->shm_zone == NULL || mcf->shm_zone->data == NULL) {
        return NULL;
    }

    *shpool = (ngx_slab_pool_t *) mcf->shm_zone->shm.addr;

    return mcf->shm_zone->data;
}


static ngx_int_t
ngx_http_m40_shm_state(ngx_http_m40_model_t *model)
{
    switch (model->engine_status) {

    case NGX_HTTP_M40_ENGINE_PENDING:
        return -1;

    case NGX_HTTP_M40_ENGINE_STARTED:
        return m40_engine_get_state(model->engine, NULL, 0);

    case NGX_HTTP_M40_ENGINE_UNLOADED:
        return 3;

    default:
        return M40_ENGINE_FAILED;
    }
}


void
ngx_http_m40_mc_add(ngx_http_m40_mcounters_t *to,
    const ngx_http_m40_mcounters_t *mc)
{
    to->loads += mc->loads;
    to->unloads += mc->unloads;
    to->load_waits += mc->load_waits;
    to->load_wait_seconds += mc->load_wait_seconds;
}


void
ngx_http_m40_shm_attach(ngx_cycle_t *cycle, ngx_http_m40_main_conf_t *mcf)
{
    ngx_uint_t                i, j;
    ngx_slab_pool_t          *shpool;
    ngx_http_m40_shm_t       *sh;
    ngx_http_m40_model_t     *models;
    ngx_http_m40_shm_slot_t  *slot;

    sh = ngx_http_m40_shm_get(mcf, &shpool);
    if (sh == NULL) {
        return;
    }

    models = mcf->models.elts;
    j = 0;

    ngx_shmtx_lock(&shpool->mutex);

    for (i = 0; i < mcf->models.nelts; i++) {
        for ( /* void */ ; j < NGX_HTTP_M40_SHM_SLOTS; j++) {
            if (sh->slots[j].pid == 0) {
                break;
            }
        }

        if (j == NGX_HTTP_M40_SHM_SLOTS) {
            break;
        }

        slot = &sh->slots[j];
        ngx_memzero(&slot->s, sizeof(m40_engine_stats));
        ngx_memzero(&slot->mc, sizeof(ngx_http_m40_mcounters_t));
        slot->name_len = models[i].model_name.len;
        ngx_memcpy(slot->name, models[i].model_name.data, slot->name_len);
        slot->state = ngx_http_m40_shm_state(&models[i]);
        slot->pid = ngx_pid;
        models[i].slot = slot;
    }

    ngx_shmtx_unlock(&shpool->mutex);

    if (i < mcf->models.nelts && !ngx_http_m40_shm_full_logged) {
        ngx_http_m40_shm_full_logged = 1;
        ngx_log_error(NGX_LOG_WARN, cycle->log, 0,
                      "m40: the metrics zone's %d engine slots are taken: "
                      "/metrics and /health leave out the engines of this "
                      "worker that have none",
                      NGX_HTTP_M40_SHM_SLOTS);
    }
}


void
ngx_http_m40_shm_publish(ngx_http_m40_model_t *model)
{
    ngx_http_m40_shm_slot_t  *slot;

    slot = model->slot;
    if (slot == NULL) {
        return;
    }

    /* the sequence is odd while the copy is made: readers try again */
    (void) ngx_atomic_fetch_add(&slot->seq, 1);
    ngx_memory_barrier();

    slot->state = ngx_http_m40_shm_state(model);
    ngx_http_m40_model_stats(model, &slot->s);
    slot->mc = model->mc;

    ngx_memory_barrier();
    (void) ngx_atomic_fetch_add(&slot->seq, 1);
}


/* A consistent copy of a slot (its owner may be writing it). */
static void
ngx_http_m40_shm_read(ngx_http_m40_shm_slot_t *slot, m40_engine_stats *s,
    ngx_http_m40_mcounters_t *mc, ngx_int_t *state)
{
    ngx_uint_t    tries;
    ngx_atomic_t  seq;

    for (tries = 0; /* void */ ; tries++) {
        seq = slot->seq;
        ngx_memory_barrier();
        ngx_memcpy(s, &slot->s, sizeof(m40_engine_stats));
        *mc = slot->mc;
        *state = slot->state;
        ngx_memory_barrier();

        /* a writer that died in the middle leaves the number odd: its copy is
         * taken as it is after a while (the writer cannot come back) */
        if ((seq == slot->seq && !(seq & 1)) || tries > 100000) {
            return;
        }

        ngx_cpu_pause();
    }
}


void
ngx_http_m40_stats_add(m40_engine_stats *to, const m40_engine_stats *s,
    ngx_flag_t gauges)
{
    int  i;

    to->requests_total += s->requests_total;
    to->requests_rejected += s->requests_rejected;
    to->requests_cancelled += s->requests_cancelled;
    to->prompt_tokens_total += s->prompt_tokens_total;
    to->prompt_tokens_computed += s->prompt_tokens_computed;
    to->completion_tokens_total += s->completion_tokens_total;

    for (i = 0; i < M40_HIST_BUCKETS; i++) {
        if (s->hist_bounds[i] != 0.0) {
            to->hist_bounds[i] = s->hist_bounds[i];
        }
        to->ttft_counts[i] += s->ttft_counts[i];
        to->itl_counts[i] += s->itl_counts[i];
    }

    to->ttft_sum += s->ttft_sum;
    to->itl_sum += s->itl_sum;
    to->prefix_cache_queries += s->prefix_cache_queries;
    to->prefix_cache_query_tokens += s->prefix_cache_query_tokens;
    to->prefix_cache_hit_tokens += s->prefix_cache_hit_tokens;
    to->steps_total += s->steps_total;
    to->step_tokens_total += s->step_tokens_total;
    to->forward_seconds += s->forward_seconds;
    to->sample_seconds += s->sample_seconds;
    to->grammar_wait_seconds += s->grammar_wait_seconds;
    to->pick_seconds += s->pick_seconds;
    to->schedule_seconds += s->schedule_seconds;
    to->guard_limited_steps += s->guard_limited_steps;
    to->guard_probe_steps += s->guard_probe_steps;

    if (!gauges) {
        return;
    }

    to->queue_depth += s->queue_depth;
    to->running += s->running;
    to->kv_tokens_used += s->kv_tokens_used;
    to->kv_tokens_total += s->kv_tokens_total;
    /* the slowest engine's estimate: a sum of step times would mean nothing */
    if (s->decode_step_estimate > to->decode_step_estimate) {
        to->decode_step_estimate = s->decode_step_estimate;
    }
}


static void
ngx_http_m40_agg_state(ngx_http_m40_agg_t *agg, ngx_int_t state)
{
    agg->engines++;

    switch (state) {
    case -1:
        agg->pending++;
        break;
    case M40_ENGINE_LOADING:
        agg->loading++;
        break;
    case M40_ENGINE_READY:
        agg->ready++;
        break;
    case 3:
        agg->unloaded++;
        break;
    default:
        agg->failed++;
        break;
    }
}


/* Under the mutex: the slot's counters go to its model's retired sum and the slot is
 * free. Without room for another name the counters are lost (logged). */
static void
ngx_http_m40_shm_retire(ngx_http_m40_shm_t *sh, ngx_http_m40_shm_slot_t *slot,
    const m40_engine_stats *s, const ngx_http_m40_mcounters_t *mc, ngx_log_t *log)
{
    ngx_uint_t                   i;
    ngx_http_m40_shm_retired_t  *r, *free_r;

    free_r = NULL;

    for (i = 0; i < NGX_HTTP_M40_SHM_NAMES; i++) {
        r = &sh->retired[i];

        if (r->name_len == 0) {
            if (free_r == NULL) {
                free_r = r;
            }
            continue;
        }

        if (r->name_len == slot->name_len
            && ngx_memcmp(r->name, slot->name, r->name_len) == 0)
        {
            goto found;
        }
    }

    r = free_r;
    if (r == NULL) {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "m40: the metrics zone holds the counters of %d model "
                      "names, \"%*s\" is not kept",
                      NGX_HTTP_M40_SHM_NAMES, slot->name_len, slot->name);
        slot->pid = 0;
        return;
    }

    ngx_memzero(&r->s, sizeof(m40_engine_stats));
    ngx_memzero(&r->mc, sizeof(ngx_http_m40_mcounters_t));
    ngx_memcpy(r->name, slot->name, slot->name_len);
    r->name_len = slot->name_len;

found:

    ngx_http_m40_stats_add(&r->s, s, 0);
    ngx_http_m40_mc_add(&r->mc, mc);
    slot->pid = 0;
}


void
ngx_http_m40_shm_detach(ngx_http_m40_main_conf_t *mcf)
{
    ngx_uint_t             i;
    ngx_slab_pool_t       *shpool;
    ngx_http_m40_shm_t    *sh;
    ngx_http_m40_model_t  *models;

    sh = ngx_http_m40_shm_get(mcf, &shpool);
    if (sh == NULL) {
        return;
    }

    models = mcf->models.elts;

    ngx_shmtx_lock(&shpool->mutex);

    for (i = 0; i < mcf->models.nelts; i++) {
        if (models[i].slot == NULL) {
            continue;
        }

        /* the last copy, then into the retired sum: only this process writes
         * the slot, so its own copy is the current one */
        ngx_http_m40_shm_publish(&models[i]);
        ngx_http_m40_shm_retire(sh, models[i].slot, &models[i].slot->s,
                                &models[i].slot->mc, ngx_cycle->log);
        models[i].slot = NULL;
    }

    ngx_shmtx_unlock(&shpool->mutex);
}


void
ngx_http_m40_shm_count_http(ngx_http_m40_main_conf_t *mcf)
{
    ngx_slab_pool_t     *shpool;
    ngx_http_m40_shm_t  *sh;

    sh = ngx_http_m40_shm_get(mcf, &shpool);
    if (sh) {
        (void) ngx_atomic_fetch_add(&sh->http_requests, 1);
    }
}


uint64_t
ngx_http_m40_shm_http_requests(ngx_http_m40_main_conf_t *mcf)
{
    ngx_slab_pool_t     *shpool;
    ngx_http_m40_shm_t  *sh;

    sh = ngx_http_m40_shm_get(mcf, &shpool);

    return sh ? (uint64_t) sh->http_requests : 0;
}


/* Under the mutex: slots of workers that died without exiting (a crash) are retired,
 * so that their counters stay and their gauges go. */
static void
ngx_http_m40_shm_reap(ngx_http_m40_shm_t *sh)
{
    ngx_int_t                 state;
    ngx_uint_t                i;
    m40_engine_stats          s;
    ngx_http_m40_shm_slot_t  *slot;
    ngx_http_m40_mcounters_t  mc;

    for (i = 0; i < NGX_HTTP_M40_SHM_SLOTS; i++) {
        slot = &sh->slots[i];

        if (slot->pid == 0 || slot->pid == ngx_pid) {
            continue;
        }

        if (kill(slot->pid, 0) == -1 && ngx_errno == NGX_ESRCH) {
            ngx_http_m40_shm_read(slot, &s, &mc, &state);
            ngx_http_m40_shm_retire(sh, slot, &s, &mc, ngx_cycle->log);
        }
    }
}


/* Under the mutex: the sum for one name over the live slots and the retired sum. */
static void
ngx_http_m40_shm_sum(ngx_http_m40_shm_t *sh, const u_char *name, size_t len,
    ngx_http_m40_agg_t *agg)
{
    ngx_int_t                    state;
    ngx_uint_t                   i;
    m40_engine_stats             s;
    ngx_http_m40_shm_slot_t     *slot;
    ngx_http_m40_mcounters_t     mc;
    ngx_http_m40_shm_retired_t  *r;

    for (i = 0; i < NGX_HTTP_M40_SHM_SLOTS; i++) {
        slot = &sh->slots[i];

        if (slot->pid == 0 || slot->name_len != len
            || ngx_memcmp(slot->name, name, len) != 0)
        {
            continue;
        }

        ngx_http_m40_shm_read(slot, &s, &mc, &state);
        ngx_http_m40_stats_add(&agg->s, &s, 1);
        ngx_http_m40_mc_add(&agg->mc, &mc);
        ngx_http_m40_agg_state(agg, state);
    }

    for (i = 0; i < NGX_HTTP_M40_SHM_NAMES; i++) {
        r = &sh->retired[i];

        if (r->name_len == len && ngx_memcmp(r->name, name, len) == 0) {
            ngx_http_m40_stats_add(&agg->s, &r->s, 0);
            ngx_http_m40_mc_add(&agg->mc, &r->mc);
        }
    }
}


/* This worker's engine when it has no slot (the zone was full, or there is no zone):
 * counted from itself. */
static void
ngx_http_m40_local_sum(ngx_http_m40_model_t *model, ngx_http_m40_agg_t *agg)
{
    m40_engine_stats  s;

    if (model->slot) {
        return;
    }

    ngx_http_m40_model_stats(model, &s);
    ngx_http_m40_stats_add(&agg->s, &s, 1);
    ngx_http_m40_mc_add(&agg->mc, &model->mc);
    ngx_http_m40_agg_state(agg, ngx_http_m40_shm_state(model));
}


void
ngx_http_m40_shm_model(ngx_http_m40_model_t *model, ngx_http_m40_agg_t *agg)
{
    ngx_slab_pool_t     *shpool;
    ngx_http_m40_shm_t  *sh;

    ngx_memzero(agg, sizeof(ngx_http_m40_agg_t));

    /* this worker's own slots are brought up to date first */
    ngx_http_m40_shm_publish(model);

    sh = ngx_http_m40_shm_get(model->mcf, &shpool);
    if (sh) {
        ngx_shmtx_lock(&shpool->mutex);
        ngx_http_m40_shm_reap(sh);
        ngx_http_m40_shm_sum(sh, model->model_name.data, model->model_name.len,
                             agg);
        ngx_shmtx_unlock(&shpool->mutex);
    }

    ngx_http_m40_local_sum(model, agg);
}


static ngx_flag_t
ngx_http_m40_name_seen(ngx_http_m40_main_conf_t *mcf, ngx_http_m40_shm_t *sh,
    const u_char *name, size_t len, ngx_uint_t slot_before,
    ngx_uint_t retired_before)
{
    ngx_uint_t  i;

    if (ngx_http_m40_model_find(mcf, name, len) != NULL) {
        return 1;
    }

    for (i = 0; i < slot_before; i++) {
        if (sh->slots[i].pid && sh->slots[i].name_len == len
            && ngx_memcmp(sh->slots[i].name, name, len) == 0)
        {
            return 1;
        }
    }

    for (i = 0; i < retired_before; i++) {
        if (sh->retired[i].name_len == len
            && ngx_memcmp(sh->retired[i].name, name, len) == 0)
        {
            return 1;
        }
    }

    return 0;
}


#define NGX_HTTP_M40_OLD_NAMES  16

void
ngx_http_m40_shm_collect(ngx_http_m40_main_conf_t *mcf, ngx_http_m40_agg_cb cb,
    void *data)
{
    size_t                 len;
    u_char                *name;
    ngx_uint_t             i, k, n;
    ngx_slab_pool_t       *shpool;
    ngx_http_m40_shm_t    *sh;
    ngx_http_m40_agg_t     agg;
    ngx_http_m40_model_t  *models;

    /* names of an older configuration: engines of workers still finishing their
     * requests after a reload, or counters retired before it */
    struct {
        size_t              len;
        u_char              name[NGX_HTTP_M40_NAME_MAX];
        ngx_http_m40_agg_t  agg;
    } old[NGX_HTTP_M40_OLD_NAMES];

    models = mcf->models.elts;

    for (i = 0; i < mcf->models.nelts; i++) {
        ngx_http_m40_shm_model(&models[i], &agg);
        cb(data, models[i].model_name.data, models[i].model_name.len, &agg);
    }

    sh = ngx_http_m40_shm_get(mcf, &shpool);
    if (sh == NULL) {
        return;
    }

    n = 0;

    ngx_shmtx_lock(&shpool->mutex);

    for (k = 0; k < NGX_HTTP_M40_SHM_SLOTS + NGX_HTTP_M40_SHM_NAMES; k++) {
        if (n == NGX_HTTP_M40_OLD_NAMES) {
            break;      /* more would take a reload a second: not worth a heap */
        }

        if (k < NGX_HTTP_M40_SHM_SLOTS) {
            if (sh->slots[k].pid == 0) {
                continue;
            }
            name = sh->slots[k].name;
            len = sh->slots[k].name_len;
            if (ngx_http_m40_name_seen(mcf, sh, name, len, k, 0)) {
                continue;
            }

        } else {
            i = k - NGX_HTTP_M40_SHM_SLOTS;
            name = sh->retired[i].name;
            len = sh->retired[i].name_len;
            if (len == 0
                || ngx_http_m40_name_seen(mcf, sh, name, len,
                                          NGX_HTTP_M40_SHM_SLOTS, i))
            {
                continue;
            }
        }

        old[n].len = len;
        ngx_memcpy(old[n].name, name, len);
        ngx_memzero(&old[n].agg, sizeof(ngx_http_m40_agg_t));
        ngx_http_m40_shm_sum(sh, name, len, &old[n].agg);
        n++;
    }

    ngx_shmtx_unlock(&shpool->mutex);

    for (i = 0; i < n; i++) {
        cb(data, old[i].name, old[i].len, &old[i].agg);
    }
}
