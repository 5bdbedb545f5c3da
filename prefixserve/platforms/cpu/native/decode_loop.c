/* The layer loop of a bfloat16 or float32 decode step (platforms/cpu/decode_program.py): every layer's kernel
 * calls, one after the other, from C.
 *
 * The program used to make these calls from Python: nine ctypes calls and two torch copies a layer,
 * their arguments laid out once a step. At 16 sequences of the 0.6B model that was still ~2 ms of a
 * ~55 ms step outside the kernels (71 us a layer: converting a dozen integer arguments per call, the
 * copies' dispatch), and the same ~2 ms at one sequence, where the step is ~25 ms (2-core Zen 5 EPYC).
 * Here one call runs them all. The kernels are the program's own, reached through the addresses the
 * caller hands over (the libraries are built and checked separately), called in the same order with
 * the same arguments, so the hidden states keep their bits.
 *
 * A bfloat16 step's attention reads the bfloat16 queries and writes its output in bfloat16 itself
 * (paged_decode_attention.c): the loop used to widen the one and narrow the other here, serially,
 * between the kernels, 0.6-0.7 ms of a 34 ms 16-sequence step.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

typedef void (*NormFn)(uint16_t* residual, const uint16_t* delta, const uint16_t* weight, float eps, uint16_t* out,
                       long rows, long n, int threads);
typedef void (*GemmFn)(const uint16_t* x, const uint16_t* wp, const float* bias, uint16_t* y, long m, long n, long k,
                       int threads);
typedef void (*QkFn)(const uint16_t* qkv, long row_stride, long q_heads, long k_heads, long d, const uint16_t* q_weight,
                     const uint16_t* k_weight, float eps, const uint16_t* cos, const uint16_t* sin, uint16_t* q_out,
                     uint16_t* k_out, uint16_t* v_out, const long* slots, long rows, long block_size, int layout,
                     int threads);
typedef void (*SiluFn)(const uint16_t* gate_up, uint16_t* out, long rows, long n, int threads);
typedef void (*AttentionFn)(const void* q, const void* pool, int pool_bf16, const long* tables, const long* lens,
                            long batch, long kv_heads, long rows, long head_dim, long num_blocks, long block_size,
                            long table_width, float scale, float* out, float* lse, float* state_m, float* state_l,
                            int carry_in, int finalize, const long* members, long group, int body, int layout,
                            int q_bf16, uint16_t* out_bf16, int threads);

/* Pointers to model data are uint16_t for bfloat16; a float32 model's are passed as they are (the kernels
 * reached through them are the float32 ones). */

/* One layer's operands (decode_loop.py's DecodeLayer mirrors it): weights packed for the GEMM, biases
 * float32 or NULL, the q/k norm weights NULL where the model has none, the layer's pool and its K and V
 * row views. */
typedef struct {
    const uint16_t *input_norm, *qkv;
    const float* qkv_bias;
    const uint16_t *q_norm, *k_norm, *o;
    const float* o_bias;
    const uint16_t *post_norm, *gate_up, *down;
    const void* pool;
    uint16_t *k_rows, *v_rows;
} DecodeLayer;

/* One attention call of the step, every argument but the pool (each layer's own) */
typedef struct {
    const void* q;
    const long *tables, *lens;
    long batch, kv_heads, rows, head_dim, num_blocks, block_size, table_width;
    float scale;
    float *out, *lse, *state_m, *state_l;
    const long* members;
    long group;
    int pool_bf16, carry_in, finalize, body, layout, q_bf16;
    uint16_t* out_bf16;
} AttentionCall;

/* The step: its kernels, shapes, buffers (rows x width each), attention calls, and the state the calls
 * start from each layer where they do not write all of it first (fill_*: NULL when they do) */
typedef struct {
    NormFn norm;
    GemmFn gemm;
    QkFn qk;
    SiluFn silu;
    AttentionFn attention;
    long rows, hidden, q_size, qkv_size, intermediate, heads, kv_heads, head_dim;
    long block_size;             /* the pools' (for the K/V writes into a pool of panels) */
    int layout;                  /* the pools' layout (kv_layout.py's code) */
    float eps, qk_eps;
    uint16_t *residual, *h, *mlp_out, *qkv, *q, *attn, *o, *gate_up, *act;
    const uint16_t *cos, *sin;
    const long* slots;
    float *fill_acc, *fill_m, *fill_l;
    const AttentionCall* calls;
    long num_calls;
    int threads;
} DecodeStep;

void decode_layers(const DecodeStep* s, const DecodeLayer* layers, long count) {
    const long n = s->rows, width = s->heads * s->head_dim, state_rows = n * s->heads;
    for (long i = 0; i < count; i++) {
        const DecodeLayer* L = layers + i;
        /* the first layer norms the embedding; the others add the last MLP output into the residual first */
        s->norm(s->residual, i ? s->mlp_out : NULL, L->input_norm, s->eps, s->h, n, s->hidden, s->threads);
        s->gemm(s->h, L->qkv, L->qkv_bias, s->qkv, n, s->qkv_size, s->hidden, s->threads);
        /* the step's K/V rows go straight into the layer's pools */
        s->qk(s->qkv, s->qkv_size, s->heads, s->kv_heads, s->head_dim, L->q_norm, L->k_norm, s->qk_eps, s->cos, s->sin,
              s->q, L->k_rows, L->v_rows, s->slots, n, s->block_size, s->layout, s->threads);
        if (s->fill_acc) {
            memset(s->fill_acc, 0, sizeof(float) * n * width);
            for (long r = 0; r < state_rows; r++) s->fill_m[r] = -INFINITY;
            memset(s->fill_l, 0, sizeof(float) * state_rows);
        }
        for (long c = 0; c < s->num_calls; c++) {
            const AttentionCall* a = s->calls + c;
            s->attention(a->q, L->pool, a->pool_bf16, a->tables, a->lens, a->batch, a->kv_heads, a->rows, a->head_dim,
                         a->num_blocks, a->block_size, a->table_width, a->scale, a->out, a->lse, a->state_m, a->state_l,
                         a->carry_in, a->finalize, a->members, a->group, a->body, a->layout, a->q_bf16, a->out_bf16,
                         s->threads);
        }
        s->gemm(s->attn, L->o, L->o_bias, s->o, n, s->hidden, s->q_size, s->threads);
        s->norm(s->residual, s->o, L->post_norm, s->eps, s->h, n, s->hidden, s->threads);
        s->gemm(s->h, L->gate_up, NULL, s->gate_up, n, 2 * s->intermediate, s->hidden, s->threads);
        s->silu(s->gate_up, s->act, n, s->intermediate, s->threads);
        s->gemm(s->act, L->down, NULL, s->mlp_out, n, s->hidden, s->intermediate, s->threads);
    }
}
