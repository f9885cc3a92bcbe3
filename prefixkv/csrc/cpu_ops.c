/* CPU kernels of the decode step, called through ctypes (prefixkv/attention/cpu_ops.py).
 *
 * Built at first use with the system C compiler (-O3 -march=native -fopenmp); OpenMP resolves to
 * the libgomp torch has already loaded, so these loops share torch's thread pool.
 *
 * KV layout (prefixkv/attention/base.py), one layer:
 *     kv_layer: [2, num_blocks + 1, KVH, BS, D]   half 0 = keys, half 1 = values
 *
 * Every function exists for float (suffix _f32) and double (suffix _f64); arithmetic is in the
 * element type (float32 accumulation for float32: "accumulated in at least fp32").
 */
#define _GNU_SOURCE  /* pthreads, syscall, sched_yield under -std=c11 */
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

/* Decode attention: one query token per sequence, at its last position (seq_lens[b] - 1),
 * attending to positions 0 .. seq_lens[b] - 1 read through its block table.
 *
 *   q            [B, H, D]            (rows ldq elements apart: a view into the qkv output)
 *   kv_layer     [2, NB1, KVH, BS, D] (contiguous; NB1 = num_blocks + 1)
 *   block_tables [B, max_blocks]      int32, row stride max_blocks
 *   seq_lens     [B]                  int32
 *   out          [B, H, D]            (contiguous)
 *
 * One work item per sequence. It walks its blocks in order; a block's keys (and values) for all
 * KVH heads are one contiguous [KVH, BS, D] run, read once for the G = H / KVH query heads of
 * each kv head, with the next block prefetched. Online softmax a block at a time (running max m,
 * sum l, rescaled accumulator). Every reduction's order depends on that sequence's own length
 * only, never on the batch it runs in.
 */
/* exp(x) for x <= 0 (softmax terms), branch-free so that loops over it vectorize (glibc's expf
 * has vector variants only under -ffast-math): Cephes' range reduction and degree-6 polynomial,
 * within 2 ulp of expf on [-87, 0]; below -87 it returns ~1.6e-38 where expf underflows (a term
 * that small changes no float32 sum it is added to). Tested against torch.exp. */
static inline float softmax_expf(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float fx = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)fx + 127) << 23;
    float scale2n;
    memcpy(&scale2n, &bits, sizeof scale2n);  /* 2^fx; a register move, and it vectorizes */
    return y * scale2n;
}

float softmax_expf_scalar(float x) { return softmax_expf(x); }  /* for the tests */

#define MAXH 64
#define MAXBS 64
#define MAXD 256
/* The decode kernels take their rows in an order (a permutation of 0 .. B - 1, or none: in turn);
 * each row's result is the same bits in any order. The caller puts the rows that share a cached
 * prefix next to one another, so that a thread's next row finds that prefix's blocks in its L2. */
#define DECODE_ROW(order, i) ((order) ? (order)[i] : (i))
/* window > 0: the query (at position len - 1) sees keys len - window .. len - 1 only, and blocks
 * before the window are never read; softcap > 0: scores -> softcap * tanh(score / softcap). */
#define DEFINE_DECODE(T, SUFFIX, EXP, EXPV, TANH)                                                      \
void paged_decode_attention_##SUFFIX(const T *q, int64_t ldq, const T *kv_layer,               \
                                     const int32_t *block_tables, const int32_t *seq_lens,       \
                                     const int32_t *order, T *out,                               \
                                     int B, int H, int KVH, int D, int BS, int max_blocks,       \
                                     int64_t nb1, T scale, int window, T softcap) {              \
    const int G = H / KVH;                                                                       \
    const int64_t half = nb1 * (int64_t)KVH * BS * D; /* elements in the K (or V) half */        \
    const int64_t blk_elems = (int64_t)KVH * BS * D;                                             \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                             \
    for (int i = 0; i < B; i++) {                                                                \
        const int b = DECODE_ROW(order, i);                                                      \
        T m[MAXH], l[MAXH], s[MAXH * MAXBS];                                                     \
        T acc[MAXH * MAXD];                                                                      \
        const T *qb = q + (int64_t)b * ldq;                                                      \
        const int32_t *table = block_tables + (int64_t)b * max_blocks;                           \
        const int len = seq_lens[b];                                                             \
        const int nblocks = (len + BS - 1) / BS;                                                 \
        const int lo = window > 0 && len > window ? len - window : 0; /* first key it sees */    \
        for (int h = 0; h < H; h++) { m[h] = -INFINITY; l[h] = 0; }                              \
        memset(acc, 0, sizeof(T) * H * D);                                                       \
        for (int j = lo / BS; j < nblocks; j++) {                                                \
            const T *kb = kv_layer + (int64_t)table[j] * blk_elems;                              \
            const T *vb = kb + half;                                                             \
            if (j + 1 < nblocks) {                                                               \
                const char *nk = (const char *)(kv_layer + (int64_t)table[j + 1] * blk_elems);   \
                const char *nv = nk + half * (int64_t)sizeof(T);                                 \
                for (int64_t o = 0; o < blk_elems * (int64_t)sizeof(T); o += 64) {               \
                    __builtin_prefetch(nk + o, 0, 3);                                            \
                    __builtin_prefetch(nv + o, 0, 3);                                            \
                }                                                                                \
            }                                                                                    \
            const int n = len - j * BS < BS ? len - j * BS : BS;                                 \
            const int t0 = lo > j * BS ? lo - j * BS : 0; /* keys before the window: skipped */  \
            for (int kh = 0; kh < KVH; kh++) {                                                   \
                const T *kh_k = kb + (int64_t)kh * BS * D;                                       \
                for (int t = t0; t < n; t++) {                                                   \
                    const T *kt = kh_k + (int64_t)t * D;                                         \
                    for (int g = 0; g < G; g++) {                                                \
                        const T *qh = qb + (int64_t)(kh * G + g) * D;                            \
                        T dot = 0;                                                               \
                        _Pragma("omp simd reduction(+:dot)")                                     \
                        for (int d = 0; d < D; d++) dot += qh[d] * kt[d];                        \
                        T x = dot * scale;                                                       \
                        if (softcap > 0) x = softcap * TANH(x / softcap);                        \
                        s[(kh * G + g) * MAXBS + t] = x;                                         \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
            for (int h = 0; h < H; h++) {                                                        \
                T *sh = s + h * MAXBS;                                                           \
                T bm = m[h];                                                                     \
                _Pragma("omp simd reduction(max:bm)")                                            \
                for (int t = t0; t < n; t++) bm = sh[t] > bm ? sh[t] : bm;                       \
                const T alpha = EXP(m[h] - bm); /* 0 on the first block (m = -inf) */            \
                T lsum = 0;                                                                      \
                _Pragma("omp simd")                                                              \
                for (int t = t0; t < n; t++) sh[t] = EXPV(sh[t] - bm);                           \
                for (int t = t0; t < n; t++) lsum += sh[t];                                      \
                T *ah = acc + (int64_t)h * D;                                                    \
                _Pragma("omp simd")                                                              \
                for (int d = 0; d < D; d++) ah[d] *= alpha;                                      \
                l[h] = l[h] * alpha + lsum;                                                      \
                m[h] = bm;                                                                       \
            }                                                                                    \
            for (int kh = 0; kh < KVH; kh++) {                                                   \
                const T *kh_v = vb + (int64_t)kh * BS * D;                                       \
                for (int t = t0; t < n; t++) {                                                   \
                    const T *vt = kh_v + (int64_t)t * D;                                         \
                    for (int g = 0; g < G; g++) {                                                \
                        const int h = kh * G + g;                                                \
                        const T p = s[h * MAXBS + t];                                            \
                        T *ah = acc + (int64_t)h * D;                                            \
                        _Pragma("omp simd")                                                      \
                        for (int d = 0; d < D; d++) ah[d] += p * vt[d];                          \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        T *ob = out + (int64_t)b * H * D;                                                        \
        for (int h = 0; h < H; h++) {                                                            \
            const T inv = (T)1 / l[h];                                                           \
            for (int d = 0; d < D; d++) ob[(int64_t)h * D + d] = acc[(int64_t)h * D + d] * inv;  \
        }                                                                                        \
    }                                                                                            \
}

DEFINE_DECODE(float, generic_f32, expf, softmax_expf, tanhf)
DEFINE_DECODE(double, f64, exp, exp, tanh)

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* The vector kernels below are written once over a vector of VW floats: 16 (AVX-512) or 8
 * (AVX2 + FMA). These wrappers are the only ISA-specific code they use, besides the decode
 * kernel's block step (decode_block) and the horizontal sums it needs. */
#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vmask;
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm512_load_ps(p); }
static inline vf v_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm512_store_ps(p, x); }
static inline void v_storeu(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_floor(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf v_pow2i(vf n) {  /* 2^n for integral n in float range */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vi vi_loadu(const int32_t *p) { return _mm512_loadu_si512(p); }
static inline vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vf v_sel(vmask m, vf if_false, vf if_true) { return _mm512_mask_blend_ps(m, if_false, if_true); }
static inline vf v_keep(vmask m, vf x) { return _mm512_maskz_mov_ps(m, x); }  /* x where m, else 0 */
static inline vmask v_live(vf x) { return _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ); }
/* lanes whose query (at vpos) sees key: key <= pos, and pos - window < key when window > 0 */
static inline __attribute__((always_inline)) vmask v_visible(vi vpos, vi vlow, int key, int window) {
    const vi k = _mm512_set1_epi32(key);
    vmask vis = _mm512_cmpge_epi32_mask(vpos, k);
    if (window > 0) vis &= _mm512_cmplt_epi32_mask(vlow, k);
    return vis;
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
typedef __m256 vf;
typedef __m256i vi;
typedef __m256 vmask;  /* all-ones / all-zeros lanes */
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm256_load_ps(p); }
static inline vf v_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm256_store_ps(p, x); }
static inline void v_storeu(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf v_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_floor(vf x) { return _mm256_floor_ps(x); }
static inline vf v_pow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vi vi_loadu(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
static inline vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline vf v_sel(vmask m, vf if_false, vf if_true) { return _mm256_blendv_ps(if_false, if_true, m); }
static inline vf v_keep(vmask m, vf x) { return _mm256_and_ps(m, x); }
static inline vmask v_live(vf x) { return _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ); }
static inline __attribute__((always_inline)) vmask v_visible(vi vpos, vi vlow, int key, int window) {
    const vi k = _mm256_set1_epi32(key);
    __m256i vis = _mm256_andnot_si256(_mm256_cmpgt_epi32(k, vpos), _mm256_set1_epi32(-1));  /* key <= pos */
    if (window > 0) vis = _mm256_and_si256(vis, _mm256_cmpgt_epi32(k, vlow));              /* key > pos - window */
    return _mm256_castsi256_ps(vis);
}
#endif

#if defined(VW)
/* softmax_expf on VW lanes (the same operations, so the same results lane by lane). */
static inline vf v_exp(vf x) {
    x = v_max(x, v_set1(-87.0f));
    const vf fx = v_floor(v_add(v_mul(x, v_set1(1.44269504088896341f)), v_set1(0.5f)));
    const vf r = v_add(v_sub(x, v_mul(fx, v_set1(0.693359375f))), v_mul(fx, v_set1(2.12194440e-4f)));
    vf y = v_set1(1.9875691500e-4f);
    y = v_add(v_mul(y, r), v_set1(1.3981999507e-3f));
    y = v_add(v_mul(y, r), v_set1(8.3334519073e-3f));
    y = v_add(v_mul(y, r), v_set1(4.1665795894e-2f));
    y = v_add(v_mul(y, r), v_set1(1.6666665459e-1f));
    y = v_add(v_mul(y, r), v_set1(5.0000001201e-1f));
    y = v_add(v_add(v_mul(y, v_mul(r, r)), r), v_set1(1.0f));
    return v_mul(y, v_pow2i(fx));
}

/* softcap * tanh(x / softcap), lane by lane (scalar tanhf: the same value in any lane) */
static inline __attribute__((always_inline)) vf v_softcap(vf x, float softcap) {
    float v[VW] __attribute__((aligned(64)));
    v_store(v, x);
    for (int i = 0; i < VW; i++) v[i] = softcap * tanhf(v[i] / softcap);
    return v_load(v);
}
#endif

#if defined(VW) && !defined(__AVX512F__)
/* (The AVX2 decode kernel's.) The next block's keys and values of kv head kh (elems floats each;
 * next: its K, or 0 at the last block) towards L1, issued before this block's kv head kh is
 * computed: the requests spread over the block's kv heads, each a head's computation ahead of use.
 * (All of the next block's lines at once, at the block's start, measured 1.17x slower on a Zen 5
 * VM with 12 of 16 blocks shared, as in the shared-prefix benchmark; the same bits.) */
static inline __attribute__((always_inline)) void prefetch_kv_head(const float *next, int64_t half, int kh,
                                                                   int elems) {
    if (!next) return;
    const char *nk = (const char *)(next + (int64_t)kh * elems), *nv = (const char *)(next + half + (int64_t)kh * elems);
    for (int o = 0; o < elems * (int)sizeof(float); o += 64) {
        _mm_prefetch(nk + o, _MM_HINT_T0);
        _mm_prefetch(nv + o, _MM_HINT_T0);
    }
}
#endif

#if defined(__AVX512F__)
/* r[t] = sum of the 16 lanes of v[t], t = 0..15: pairs of vectors folded 512 -> 256 -> 128 bits
 * (shuffle_f32x4), then within 128-bit lanes (unpack, shuffle_ps). The folds leave lane 4L + e
 * holding the sum of input 4e + L, so the inputs are taken in that order. */
static inline __m512 hsum16(const __m512 *v) {
    __m512 w[8], u[4], z[2];
    for (int i = 0; i < 8; i++) {  /* input slot s holds v[4 * (s % 4) + s / 4] */
        const __m512 a = v[4 * ((2 * i) % 4) + (2 * i) / 4], b = v[4 * ((2 * i + 1) % 4) + (2 * i + 1) / 4];
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]), _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
    return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

/* The AVX-512 decode kernel takes the keys DECODE_CHUNK positions at a time, in chunks at fixed
 * positions 0, CH, 2 CH, ... (where they fall depends on the sequence's length only). For each kv
 * head: the scores of the chunk's keys for each of its query heads (16 keys a vector, their dot
 * products summed across lanes at once by hsum16), then each head's online-softmax step over the
 * whole chunk as vector loops (its max, the exponentials and their sum: one horizontal max and one
 * horizontal sum a chunk), then P.V of DECODE_GB heads together (each V row loaded once for them,
 * GB * ND accumulator chains side by side; a head's own chain order is key after key).
 * A softmax step a block of 16 keys (the kernel before) made its chain of horizontal reductions
 * and exponentials, per 16 keys and head, ~40 % of the kernel's time with its K and V in cache
 * (the FMAs, hsum16 and P.V removed in turn); a chunk of 128 takes it over 128 keys. On a 2-core
 * Zen 4 VM: attention alone 1.10-1.12x with 12 of a sequence's 15 blocks shared (1.2-1.25x with all
 * in cache), the fused layer stack at batch 16 1.03x (bench/RESULTS.md, 2026-12-04, `a1041a6`). */
#define DECODE_CHUNK 128
#define DECODE_GB 3

/* the lanes t of the 16 keys from position t0 that the query sees: k0 <= t0 + t < k1 */
static inline __mmask16 keys_seen(int t0, int k0, int k1) {
    const int a = k0 > t0 ? k0 - t0 : 0, b = k1 - t0 < 16 ? k1 - t0 : 16;
    return b <= a ? 0 : (__mmask16)(((1u << b) - 1u) & ~((1u << a) - 1u));
}

/* acc[h0 + g] += p[h0 + g][t] * (V row t), g < GB, for the keys t_lo <= t < t_hi of the chunk in
 * order (row t at vbase + off[t]). */
static inline __attribute__((always_inline)) void decode_pv(
        const int GB, const int ND, float (*p)[DECODE_CHUNK], int h0, const float *vbase, const int64_t *off,
        int t_lo, int t_hi, float *acc) {
    const int D = 16 * ND;
    __m512 av[DECODE_GB][ND];
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < ND; c++) av[g][c] = _mm512_load_ps(acc + (int64_t)(h0 + g) * D + 16 * c);
    for (int t = t_lo; t < t_hi; t++) {
        const float *vt = vbase + off[t];
        for (int c = 0; c < ND; c++) {
            const __m512 v = _mm512_loadu_ps(vt + 16 * c);
            for (int g = 0; g < GB; g++) av[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h0 + g][t]), v, av[g][c]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < ND; c++) _mm512_store_ps(acc + (int64_t)(h0 + g) * D + 16 * c, av[g][c]);
}

/* the rows t_lo <= t < t_hi (at base + off[t], D floats each) towards L1 */
static inline __attribute__((always_inline)) void prefetch_rows(const float *base, const int64_t *off, int t_lo,
                                                                int t_hi, int D) {
    for (int t = t_lo; t < t_hi; t++)
        for (int o = 0; o < D; o += 16) _mm_prefetch((const char *)(base + off[t] + o), _MM_HINT_T0);
}

/* The query tokens of a group (up to DECODE_TG rows that share a block table: consecutive tokens of
 * one sequence prefilled as decode rows in the batch-invariant mode, see decode_rows_f32), token i at
 * qb + i * ldq with context length lens[i], its output at ob + i * H * D. Each token's arithmetic is
 * exactly a decode of that token alone (its own chunks, score chains, hsum16 trees, softmax steps
 * and P.V chains, key after key); only the order in which the tokens' operations interleave
 * changes: a chunk's scores are taken 16 keys at a time for every token (the group's K rows from L1
 * after the first token) and its P.V 32 keys at a time for every token (the V rows from L1; a
 * head's accumulators stored and reloaded between the 32-key runs, which rounds nothing). One token
 * alone reads its whole context from memory or L3 once per layer (1.4 MB a layer for SmolLM2 at
 * 900 tokens, more than L2); a group reads it once for all its tokens. NT = 1 is a decode row. */
#define DECODE_TG 8
#define DECODE_PV_RUN 32
/* The blocks of tbl from index j0 on that hold positions before end, less those that `read` (a table
 * whose blocks up to position read_len are in cache; 0: none) has at the same index, into out.
 * Returns their number. */
static inline int blocks_not_read(const int32_t *tbl, int j0, int end, int BS, const int32_t *read, int read_len,
                                  int *out) {
    int n = 0;
    for (int j = j0; j * BS < end; j++)
        if (!read || j * BS >= read_len || read[j] != tbl[j]) out[n++] = tbl[j];
    return n;
}

static inline __attribute__((always_inline)) void decode_group(
        const float *qb, int64_t ldq, const float *kv_layer, const int32_t *table, const int32_t *lens, const int NT,
        float *ob, int H, int KVH, int BS, int64_t half, float scale, int window, float softcap, const int ND,
        const int32_t *ahead_table, int ahead_lo, int ahead_len, const int32_t *prev_table, int prev_len) {
    const int D = 16 * ND, G = H / KVH;
    const int64_t blk_elems = (int64_t)KVH * BS * D, head_elems = (int64_t)BS * D;
    float m[NT][H], l[NT][H];
    float acc_raw[NT * H * D + 16], p_raw[NT * H * DECODE_CHUNK + 16];  /* aligned to 64 bytes below */
    float *acc0 = (float *)(((uintptr_t)acc_raw + 63) & ~(uintptr_t)63);
    float (*p0)[DECODE_CHUNK] = (float (*)[DECODE_CHUNK])(((uintptr_t)p_raw + 63) & ~(uintptr_t)63);
    int64_t off[DECODE_CHUNK];  /* key c0 + t's row: its offset from kv head 0's K rows in block 0 */
    int lo[NT];  /* the first key each token sees */
    int lo_min = 1 << 30, len_max = 0;
    for (int i = 0; i < NT; i++) {
        for (int h = 0; h < H; h++) { m[i][h] = -INFINITY; l[i][h] = 0; }
        lo[i] = window > 0 && lens[i] > window ? lens[i] - window : 0;
        lo_min = lo[i] < lo_min ? lo[i] : lo_min;
        len_max = lens[i] > len_max ? lens[i] : len_max;
    }
    memset(acc0, 0, sizeof(float) * NT * H * D);
    /* Read ahead: while a chunk is computed, the blocks of the chunk after it (every kv head, K and
     * V) go towards L2, a share at each 16-key step; after the last chunk comes the first of the
     * group this thread takes next (ahead_table: its table, 0 if none), less the blocks this group
     * reads (in cache already); a block the group before it on this thread read (prev_table, prev_len)
     * is not asked for again. Without it a block's K rows were asked for one 16-key step before
     * their use and its V rows not at all, too late for memory: the blocks a sequence wrote in
     * earlier steps are out of the caches by its next step (the weights stream through them). One
     * chunk ahead (3 x 64 KB for SmolLM2) keeps the two chunks in L2 together. On a 2-core Zen 4
     * VM, SmolLM2's layers at batch 16: -4 % at 230-290 tokens of context, -10 % at 380-440; where
     * the blocks are in L3 already the extra instructions cost (bench/RESULTS.md, 2026-12-05,
     * `26f3f5e`). Prefetches change which cache holds a line, never a value: the same bits. */
    const int64_t blk_lines = blk_elems * (int64_t)sizeof(float) / 64;
    for (int c0 = lo_min / DECODE_CHUNK * DECODE_CHUNK; c0 < len_max; c0 += DECODE_CHUNK) {
        int ahead[DECODE_CHUNK], n_ahead = 0;  /* the blocks read ahead during this chunk */
        const int c1 = c0 + DECODE_CHUNK, n1 = ahead_lo / DECODE_CHUNK * DECODE_CHUNK + DECODE_CHUNK;
        if (c1 < len_max)  /* this group's next chunk */
            n_ahead = blocks_not_read(table, c1 / BS, c1 + DECODE_CHUNK < len_max ? c1 + DECODE_CHUNK : len_max, BS,
                                      prev_table, prev_len, ahead);
        else if (ahead_table)  /* the next group's first chunk, from its window's start */
            n_ahead = blocks_not_read(ahead_table, ahead_lo / BS, n1 < ahead_len ? n1 : ahead_len, BS, table, len_max,
                                      ahead);
        const int steps = KVH * (DECODE_CHUNK / 16);  /* a chunk's 16-key steps (with keys or not) */
        const int64_t ahead_lines = 2 * blk_lines * n_ahead, quota = (ahead_lines + steps - 1) / steps;
        int64_t ax = 0, ar = 0;  /* lines read ahead so far; the next: line ar of block ahead[ab] */
        int ab = 0;
        /* token i's keys in this chunk: k0[i] .. k1[i] - 1, lanes t_lo[i] .. t_hi[i] - 1 of ng[i] 16-key
         * groups from c0; a token whose context ends before the chunk, or whose window starts after
         * it, skips it (as its own decode does) */
        int k0[NT], k1[NT], t_lo[NT], t_hi[NT], ng[NT];
        int a_min = DECODE_CHUNK, b_max = 0, ng_max = 0;
        for (int i = 0; i < NT; i++) {
            const int in = c0 >= lo[i] / DECODE_CHUNK * DECODE_CHUNK && c0 < lens[i];
            k0[i] = lo[i] > c0 ? lo[i] : c0;
            k1[i] = lens[i] - c0 < DECODE_CHUNK ? lens[i] : c0 + DECODE_CHUNK;
            ng[i] = in ? (k1[i] - c0 + 15) / 16 : 0;
            t_lo[i] = k0[i] - c0;
            t_hi[i] = in ? k1[i] - c0 : t_lo[i];
            if (in) {
                a_min = t_lo[i] < a_min ? t_lo[i] : a_min;
                b_max = t_hi[i] > b_max ? t_hi[i] : b_max;
                ng_max = ng[i] > ng_max ? ng[i] : ng_max;
            }
        }
        for (int t = c0 + a_min, j = t / BS, r = t % BS; t < c0 + b_max; t++) {
            off[t - c0] = (int64_t)table[j] * blk_elems + (int64_t)r * D;
            if (++r == BS) { r = 0; j++; }
        }
        for (int kh = 0; kh < KVH; kh++) {
            const float *kbase = kv_layer + (int64_t)kh * head_elems, *vbase = kbase + half;
            for (int gi = 0; gi < DECODE_CHUNK / 16; gi++) {
                for (const int64_t x1 = ax + quota < ahead_lines ? ax + quota : ahead_lines; ax < x1; ax++) {
                    _mm_prefetch((const char *)(kv_layer + (int64_t)ahead[ab] * blk_elems + (ar >= blk_lines ? half : 0))
                                 + (ar >= blk_lines ? ar - blk_lines : ar) * 64, _MM_HINT_T1);
                    if (++ar == 2 * blk_lines) { ar = 0; ab++; }
                }
                if (gi >= ng_max) continue;
                /* scores, 16 keys at a time for every token */
                const int ga = 16 * gi > a_min ? 16 * gi : a_min, gb = 16 * gi + 16 < b_max ? 16 * gi + 16 : b_max;
                if (ga < gb) prefetch_rows(kbase, off, gb, gb + 16 < b_max ? gb + 16 : b_max, D);  /* the next K rows */
                for (int i = 0; i < NT; i++) {
                    if (gi >= ng[i]) continue;
                    const float *qi = qb + (int64_t)i * ldq;
                    const __mmask16 seen = keys_seen(c0 + 16 * gi, k0[i], k1[i]);
                    const int a = 16 * gi > t_lo[i] ? 16 * gi : t_lo[i], b = 16 * gi + 16 < t_hi[i] ? 16 * gi + 16 : t_hi[i];
                    for (int h = kh * G; h < (kh + 1) * G; h++) {
                        float *ph = p0[(int64_t)i * H + h] + 16 * gi;
                        if (a >= b) {  /* a group before the window */
                            _mm512_store_ps(ph, _mm512_set1_ps(-INFINITY));
                            continue;
                        }
                        __m512 qv[ND];
                        for (int c = 0; c < ND; c++) qv[c] = _mm512_loadu_ps(qi + (int64_t)h * D + 16 * c);
                        __m512 dot[16];
                        for (int t = 0; t < 16; t++) {
                            if (seen >> t & 1) {
                                const float *kt = kbase + off[16 * gi + t];
                                dot[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
                                for (int c = 1; c < ND; c++)
                                    dot[t] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + 16 * c), dot[t]);
                            } else {
                                dot[t] = _mm512_setzero_ps();
                            }
                        }
                        __m512 raw = _mm512_mul_ps(hsum16(dot), _mm512_set1_ps(scale));
                        if (softcap > 0) raw = v_softcap(raw, softcap);
                        _mm512_store_ps(ph, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, raw));
                    }
                }
            }
            for (int i = 0; i < NT; i++) {  /* each token's softmax step over the chunk */
                if (!ng[i]) continue;
                float (*p)[DECODE_CHUNK] = p0 + (int64_t)i * H;
                float *acc = acc0 + (int64_t)i * H * D;
                for (int h = kh * G; h < (kh + 1) * G; h++) {
                    __m512 vmax = _mm512_load_ps(p[h]);
                    for (int g = 1; g < ng[i]; g++) vmax = _mm512_max_ps(vmax, _mm512_load_ps(p[h] + 16 * g));
                    const float bm = fmaxf(m[i][h], _mm512_reduce_max_ps(vmax));
                    const float a = expf(m[i][h] - bm);  /* 0 on the first chunk (m = -inf) */
                    const __m512 vbm = _mm512_set1_ps(bm);
                    __m512 vsum = _mm512_setzero_ps();
                    for (int g = 0; g < ng[i]; g++) {
                        const __m512 e = _mm512_maskz_mov_ps(keys_seen(c0 + 16 * g, k0[i], k1[i]),
                                                             v_exp(_mm512_sub_ps(_mm512_load_ps(p[h] + 16 * g), vbm)));
                        _mm512_store_ps(p[h] + 16 * g, e);
                        vsum = _mm512_add_ps(vsum, e);
                    }
                    l[i][h] = l[i][h] * a + _mm512_reduce_add_ps(vsum);
                    m[i][h] = bm;
                    const __m512 alpha = _mm512_set1_ps(a);
                    for (int c = 0; c < ND; c++) {
                        float *ac = acc + (int64_t)h * D + 16 * c;
                        _mm512_store_ps(ac, _mm512_mul_ps(_mm512_load_ps(ac), alpha));
                    }
                }
            }
            /* P.V, DECODE_PV_RUN keys at a time for every token (one run when NT = 1) */
            const int run = NT == 1 ? DECODE_CHUNK : DECODE_PV_RUN;
            for (int r0 = a_min / run * run; r0 < b_max; r0 += run) {
                for (int i = 0; i < NT; i++) {
                    const int ta = t_lo[i] > r0 ? t_lo[i] : r0, tb = t_hi[i] < r0 + run ? t_hi[i] : r0 + run;
                    if (ta >= tb) continue;
                    float (*p)[DECODE_CHUNK] = p0 + (int64_t)i * H;
                    float *acc = acc0 + (int64_t)i * H * D;
                    for (int h0 = kh * G; h0 < (kh + 1) * G; h0 += DECODE_GB) {
                        switch ((kh + 1) * G - h0 < DECODE_GB ? (kh + 1) * G - h0 : DECODE_GB) {
                        case 1: decode_pv(1, ND, p, h0, vbase, off, ta, tb, acc); break;
                        case 2: decode_pv(2, ND, p, h0, vbase, off, ta, tb, acc); break;
                        default: decode_pv(3, ND, p, h0, vbase, off, ta, tb, acc); break;
                        }
                    }
                }
            }
        }
    }
    for (int i = 0; i < NT; i++) {
        const float *acc = acc0 + (int64_t)i * H * D;
        float *o = ob + (int64_t)i * H * D;
        for (int h = 0; h < H; h++) {
            const __m512 inv = _mm512_set1_ps(1.0f / l[i][h]);
            for (int c = 0; c < ND; c++)
                _mm512_storeu_ps(o + (int64_t)h * D + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc + (int64_t)h * D + 16 * c), inv));
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX2 decode block step: a softmax step a block of up to 16 keys, one query head at a time. */

/* r[t] = sum of the 8 lanes of v[t], t = 0..7 (a fixed tree: pairs, quads, then the two halves). */
static inline __m256 hsum8(const __m256 *v) {
    const __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a01, a23), b1 = _mm256_hadd_ps(a45, a67);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

static inline float hadd8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

/* 8 keys' scores for one head: dot[t] accumulates q . k_t over D = 8 * ND in 8 lanes (ND long
 * FMA chains, 8 of them side by side), then hsum8. Keys t >= n are not read (score 0, masked). */
static inline __attribute__((always_inline)) __m256 scores8(const float *qh, const float *kt, int n, const int ND) {
    const int D = 8 * ND;
    __m256 dot[8];
    for (int t = 0; t < 8; t++) dot[t] = _mm256_setzero_ps();
    if (n >= 8) {
        for (int c = 0; c < ND; c++) {
            const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
            for (int t = 0; t < 8; t++)
                dot[t] = c == 0 ? _mm256_mul_ps(qc, _mm256_loadu_ps(kt + (int64_t)t * D))
                                : _mm256_fmadd_ps(qc, _mm256_loadu_ps(kt + (int64_t)t * D + 8 * c), dot[t]);
        }
    } else {
        for (int t = 0; t < n; t++) {
            dot[t] = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(kt + (int64_t)t * D));
            for (int c = 1; c < ND; c++)
                dot[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), _mm256_loadu_ps(kt + (int64_t)t * D + 8 * c), dot[t]);
        }
    }
    return hsum8(dot);
}

/* A block of up to 16 keys, all query heads (decode_seq below): two 8-key score vectors a head. */
static inline __attribute__((always_inline)) void decode_block(
        const float *qb, const float *kb, const float *vb, int n, int skip, int H, int KVH, int BS,
        float scale, float softcap, float *m, float *l, float *acc, const int ND, const float *next,
        int64_t half) {
    const int D = 8 * ND, G = H / KVH;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    float p[16] __attribute__((aligned(32)));
    /* key t is seen when skip <= t < n */
    const __m256i t_lo = lane, t_hi = _mm256_add_epi32(lane, _mm256_set1_epi32(8));
    const __m256i vn = _mm256_set1_epi32(n), vskip = _mm256_set1_epi32(skip - 1);
    const __m256 valid_lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(vn, t_lo), _mm256_cmpgt_epi32(t_lo, vskip)));
    const __m256 valid_hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(vn, t_hi), _mm256_cmpgt_epi32(t_hi, vskip)));
    for (int kh = 0; kh < KVH; kh++) {
        const float *kt = kb + (int64_t)kh * BS * D, *vt = vb + (int64_t)kh * BS * D;
        prefetch_kv_head(next, half, kh, BS * D);
        for (int h = kh * G; h < (kh + 1) * G; h++) {
            const float *qh = qb + (int64_t)h * D;
            const __m256 sc = _mm256_set1_ps(scale);
            __m256 s0 = _mm256_mul_ps(scores8(qh, kt, n, ND), sc);
            __m256 s1 = n > 8 ? _mm256_mul_ps(scores8(qh, kt + 8 * (int64_t)D, n - 8, ND), sc) : ninf;
            if (softcap > 0) { s0 = v_softcap(s0, softcap); s1 = v_softcap(s1, softcap); }
            s0 = _mm256_blendv_ps(ninf, s0, valid_lo);
            s1 = _mm256_blendv_ps(ninf, s1, valid_hi);
            const float bm = fmaxf(m[h], hmax8(_mm256_max_ps(s0, s1)));
            const float a = expf(m[h] - bm);  /* 0 on the first block (m = -inf) */
            const __m256 vbm = _mm256_set1_ps(bm);
            const __m256 p0 = _mm256_and_ps(valid_lo, v_exp(_mm256_sub_ps(s0, vbm)));
            const __m256 p1 = _mm256_and_ps(valid_hi, v_exp(_mm256_sub_ps(s1, vbm)));
            l[h] = l[h] * a + hadd8(_mm256_add_ps(p0, p1));
            m[h] = bm;
            _mm256_store_ps(p, p0);
            _mm256_store_ps(p + 8, p1);
            const __m256 alpha = _mm256_set1_ps(a);
            float *ah = acc + (int64_t)h * D;
            for (int c0 = 0; c0 < ND; c0 += 8) {  /* 8 accumulator vectors at a time */
                const int nc = ND - c0 < 8 ? ND - c0 : 8;
                __m256 av[8];
                for (int c = 0; c < nc; c++) av[c] = _mm256_mul_ps(_mm256_load_ps(ah + 8 * (c0 + c)), alpha);
                for (int t = skip; t < n; t++) {
                    const __m256 pt = _mm256_set1_ps(p[t]);
                    for (int c = 0; c < nc; c++)
                        av[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + (int64_t)t * D + 8 * (c0 + c)), av[c]);
                }
                for (int c = 0; c < nc; c++) _mm256_store_ps(ah + 8 * (c0 + c), av[c]);
            }
        }
    }
}
#endif

#if defined(VW) && !defined(__AVX512F__)
/* The AVX2 build's decode attention of a group of NT query tokens that share a block table (the
 * consecutive tokens of a prefill as decode rows, see decode_rows_f32; NT = 1 is a decode row),
 * token i at qb + i * ldq with context length lens[i], D = VW * ND, block size <= 16: the blocks in
 * order (the next one prefetched), each through decode_block for every token that sees it, so a
 * block's K and V rows come from memory or L2 once for the group and from L1 for its other tokens.
 * A token's arithmetic is its decode alone (its own blocks, each a softmax step, in order): only
 * the order in which the tokens' operations interleave changes, so the bits are those of the
 * kernel that took one token at a time. Two 512-token prompts' rows through 30 layers on a 2-core
 * Zen 3 VM: 1.22-1.28x against one token at a time; 2 or 4 tokens a group slower than 8, 16 the
 * same (bench/RESULTS.md, 2026-12-06, a prompt's rows in groups in the AVX2 attention). */
#define DECODE_TG 8
static inline __attribute__((always_inline)) void decode_seq(
        const float *qb, int64_t ldq, const float *kv_layer, const int32_t *table, const int32_t *lens,
        const int NT, float *ob, int H, int KVH, int BS, int64_t half, float scale, int window, float softcap,
        const int ND) {
    const int D = VW * ND;
    const int64_t blk_elems = (int64_t)KVH * BS * D;
    float m[DECODE_TG * MAXH], l[DECODE_TG * MAXH];
    float acc[MAXH * MAXD] __attribute__((aligned(64)));  /* NT * H * D fit (decode_rows_f32) */
    int lo[DECODE_TG], lo_min = 1 << 30, len_max = 0;
    for (int i = 0; i < NT; i++) {
        lo[i] = window > 0 && lens[i] > window ? lens[i] - window : 0;  /* the first key token i sees */
        lo_min = lo[i] < lo_min ? lo[i] : lo_min;
        len_max = lens[i] > len_max ? lens[i] : len_max;
    }
    for (int h = 0; h < NT * H; h++) { m[h] = -INFINITY; l[h] = 0; }
    memset(acc, 0, sizeof(float) * NT * H * D);
    const int nblocks = (len_max + BS - 1) / BS;
    for (int j = lo_min / BS; j < nblocks; j++) {
        const float *kb = kv_layer + (int64_t)table[j] * blk_elems;
        const float *vb = kb + half;
        const float *next = j + 1 < nblocks ? kv_layer + (int64_t)table[j + 1] * blk_elems : 0;
        for (int i = 0; i < NT; i++) {
            if (j * BS >= lens[i] || (j + 1) * BS <= lo[i]) continue;  /* past its context, or before its window */
            const int n = lens[i] - j * BS < BS ? lens[i] - j * BS : BS;
            const int skip = lo[i] > j * BS ? lo[i] - j * BS : 0;  /* keys of the block before the window */
            decode_block(qb + (int64_t)i * ldq, kb, vb, n, skip, H, KVH, BS, scale, softcap, m + i * H, l + i * H,
                         acc + (int64_t)i * H * D, ND, next, half);
            next = 0;  /* prefetched by the group's first token */
        }
    }
    for (int i = 0; i < NT; i++)
        for (int h = 0; h < H; h++) {
            const vf inv = v_set1(1.0f / l[i * H + h]);
            const float *ah = acc + ((int64_t)i * H + h) * D;
            for (int c = 0; c < ND; c++) v_storeu(ob + ((int64_t)i * H + h) * D + VW * c, v_mul(v_load(ah + VW * c), inv));
        }
}
#endif

#if defined(VW)
/* Prefill attention (float32, D = 64 or 128, block size <= 64): the query tokens of each
 * prefill sequence, query i of sequence s at position ctx + i (ctx = seq_len - query_len), causal.
 *
 *   q               [T, H, D]   rows ldq apart (all prefill sequences' query tokens, flattened)
 *   block_tables    [S, max_blocks] int32;  seq_lens [S] int32;  query_start_loc [S + 1] int32
 *   out             [T, H, D]   contiguous
 *
 * One work item per (sequence, tile of VW queries, kv head). Per query head the tile's queries are
 * the VW lanes of a vector: with Q transposed once ([D][VW]), a key's VW scores are D FMAs, and
 * the online softmax (running max, sum, rescale) is lane-wise, no horizontal reductions. A lane's
 * arithmetic depends only on its own query and keys: keys past its position are -inf (p = 0, the
 * running max unchanged, alpha exactly 1), so a query's result is the same in any tile or chunk. */
#define PV_LANES (VW == 16 ? 2 : 1)  /* queries whose P.V update runs together: 2 * ND accumulators (AVX-512) */
static inline __attribute__((always_inline)) void prefill_tile(
        const float *q, int64_t ldq, const float *kv_layer, const int32_t *table, int ctx, int qlen, int i0,
        float *out, int H, int KVH, int kh, int BS, int64_t half, float scale, int window, float softcap,
        const int ND) {
    const int D = VW * ND, G = H / KVH;
    const int64_t blk_elems = (int64_t)KVH * BS * D;
    const int nq = qlen - i0 < VW ? qlen - i0 : VW;
    const int last_pos = ctx + i0 + nq - 1;
    const int nblocks = last_pos / BS + 1;
    float qt[MAXD * VW] __attribute__((aligned(64)));
    float pbuf[MAXBS * VW] __attribute__((aligned(64)));
    float acc[VW * MAXD] __attribute__((aligned(64)));
    int32_t qpos[VW];
    for (int lane = 0; lane < VW; lane++) qpos[lane] = lane < nq ? ctx + i0 + lane : -1;  /* -1: padding */
    const vi vpos = vi_loadu(qpos);
    /* window: lane i sees keys qpos - window < j <= qpos; the tile starts at its first lane's window */
    const vi vlow = vi_sub(vpos, vi_set1(window > 0 ? window : 1 << 30));
    const int first_key = window > 0 && ctx + i0 - window + 1 > 0 ? ctx + i0 - window + 1 : 0;
    const vf ninf = v_set1(-INFINITY), zero = v_set1(0.0f);
    for (int g = 0; g < G; g++) {
        const int h = kh * G + g;
        for (int d = 0; d < D; d++)
            for (int lane = 0; lane < VW; lane++)
                qt[d * VW + lane] = lane < nq ? q[(int64_t)(i0 + lane) * ldq + (int64_t)h * D + d] : 0.0f;
        vf m = ninf, l = zero;
        memset(acc, 0, sizeof(float) * VW * D);
        for (int j = first_key / BS; j < nblocks; j++) {
            const float *kt = kv_layer + (int64_t)table[j] * blk_elems + (int64_t)kh * BS * D;
            const float *vt = kt + half;
            const int n = last_pos - j * BS + 1 < BS ? last_pos - j * BS + 1 : BS;
            vf bmax = ninf;
            for (int t = 0; t < n; t++) {
                const float *krow = kt + (int64_t)t * D;
                /* four partial sums over d (d mod 4): independent FMA chains, not one 64 long */
                vf s0 = v_mul(v_set1(krow[0]), v_load(qt));
                vf s1 = v_mul(v_set1(krow[1]), v_load(qt + VW));
                vf s2 = v_mul(v_set1(krow[2]), v_load(qt + 2 * VW));
                vf s3 = v_mul(v_set1(krow[3]), v_load(qt + 3 * VW));
                for (int d = 4; d < D; d += 4) {
                    s0 = v_fmadd(v_set1(krow[d]), v_load(qt + d * VW), s0);
                    s1 = v_fmadd(v_set1(krow[d + 1]), v_load(qt + (d + 1) * VW), s1);
                    s2 = v_fmadd(v_set1(krow[d + 2]), v_load(qt + (d + 2) * VW), s2);
                    s3 = v_fmadd(v_set1(krow[d + 3]), v_load(qt + (d + 3) * VW), s3);
                }
                vf sc = v_mul(v_add(v_add(s0, s1), v_add(s2, s3)), v_set1(scale));
                if (softcap > 0) sc = v_softcap(sc, softcap);
                sc = v_sel(v_visible(vpos, vlow, j * BS + t, window), ninf, sc);
                v_store(pbuf + t * VW, sc);
                bmax = v_max(bmax, sc);
            }
            const vf mnew = v_max(m, bmax);
            const vmask live = v_live(mnew);  /* lanes with a key so far */
            const vf base = v_keep(live, mnew);
            const vf alpha = v_keep(live, v_exp(v_sub(m, base)));
            vf lsum = zero;
            for (int t = 0; t < n; t++) {
                const vf pt = v_keep(live, v_exp(v_sub(v_load(pbuf + t * VW), base)));
                const vf p = v_keep(v_visible(vpos, vlow, j * BS + t, window), pt);  /* masked keys: exactly 0 */
                v_store(pbuf + t * VW, p);
                lsum = v_add(lsum, p);
            }
            l = v_add(v_mul(l, alpha), lsum);
            m = mnew;
            float al[VW] __attribute__((aligned(64)));
            v_store(al, alpha);
            /* P.V: PV_LANES queries at a time, 8 accumulator vectors of each (a query past nq
             * repeats the first one and is not stored) */
            for (int lane = 0; lane < nq; lane += PV_LANES) {
                int ln[PV_LANES];
                for (int u = 0; u < PV_LANES; u++) ln[u] = lane + u < nq ? lane + u : lane;
                for (int c0 = 0; c0 < ND; c0 += 8) {
                    const int nc = ND - c0 < 8 ? ND - c0 : 8;
                    vf av[PV_LANES][8];
                    for (int u = 0; u < PV_LANES; u++) {
                        const vf sa = v_set1(al[ln[u]]);
                        for (int c = 0; c < nc; c++) av[u][c] = v_mul(v_load(acc + ln[u] * D + VW * (c0 + c)), sa);
                    }
                    for (int t = 0; t < n; t++) {
                        vf pu[PV_LANES];
                        for (int u = 0; u < PV_LANES; u++) pu[u] = v_set1(pbuf[t * VW + ln[u]]);
                        for (int c = 0; c < nc; c++) {
                            const vf vv = v_loadu(vt + (int64_t)t * D + VW * (c0 + c));
                            for (int u = 0; u < PV_LANES; u++) av[u][c] = v_fmadd(pu[u], vv, av[u][c]);
                        }
                    }
                    for (int u = PV_LANES - 1; u >= 0; u--)
                        if (u == 0 || lane + u < nq)
                            for (int c = 0; c < nc; c++) v_store(acc + ln[u] * D + VW * (c0 + c), av[u][c]);
                }
            }
        }
        float lv[VW] __attribute__((aligned(64)));
        v_store(lv, l);
        for (int lane = 0; lane < nq; lane++) {
            const vf inv = v_set1(1.0f / lv[lane]);
            float *o = out + (int64_t)(i0 + lane) * H * D + (int64_t)h * D;
            for (int c = 0; c < ND; c++) v_storeu(o + VW * c, v_mul(v_load(acc + lane * D + VW * c), inv));
        }
    }
}
#endif

/* Returns 0 when these shapes have no kernel here (the caller keeps the torch path). */
int paged_prefill_attention_f32(const float *q, int64_t ldq, const float *kv_layer, const int32_t *block_tables,
                                const int32_t *seq_lens, const int32_t *query_start_loc, float *out, int S,
                                int H, int KVH, int D, int BS, int max_blocks, int64_t nb1, float scale,
                                int window, float softcap) {
#if defined(VW)
    if (!(D == 64 || D == 128) || BS > MAXBS || H > MAXH) return 0;
    const int64_t half = nb1 * (int64_t)KVH * BS * D;
    int num_items = 0;
    for (int s = 0; s < S; s++)
        num_items += (query_start_loc[s + 1] - query_start_loc[s] + VW - 1) / VW * KVH;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < num_items; item++) {
        int s = 0, rest = item, tiles = 0;
        for (;; s++) {  /* find this item's sequence (S is small) */
            tiles = (query_start_loc[s + 1] - query_start_loc[s] + VW - 1) / VW * KVH;
            if (rest < tiles) break;
            rest -= tiles;
        }
        const int qlen = query_start_loc[s + 1] - query_start_loc[s];
        const int tile = rest / KVH, kh = rest % KVH;
        const float *qs = q + (int64_t)query_start_loc[s] * ldq;
        float *os = out + (int64_t)query_start_loc[s] * H * D;
        const int ctx = seq_lens[s] - qlen;
        if (D == 64)
            prefill_tile(qs, ldq, kv_layer, block_tables + (int64_t)s * max_blocks, ctx, qlen, VW * tile, os,
                         H, KVH, kh, BS, half, scale, window, softcap, 64 / VW);
        else
            prefill_tile(qs, ldq, kv_layer, block_tables + (int64_t)s * max_blocks, ctx, qlen, VW * tile, os,
                         H, KVH, kh, BS, half, scale, window, softcap, 128 / VW);
    }
    return 1;
#else
    (void)q; (void)ldq; (void)kv_layer; (void)block_tables; (void)seq_lens; (void)query_start_loc; (void)out;
    (void)S; (void)H; (void)KVH; (void)D; (void)BS; (void)max_blocks; (void)nb1; (void)scale;
    (void)window; (void)softcap;
    return 0;
#endif
}

#if defined(VW)
#if !defined(__AVX512F__)
/* decode_seq for one row (a decode) and for a group, each a function of its own: the two inlined
 * into decode_rows_f32 made a decode row 2-5 % slower (16 rows, attention alone). */
static void decode_row(const float *qb, int64_t ldq, const float *kv_layer, const int32_t *table, const int32_t *lens,
                       float *ob, int H, int KVH, int D, int BS, int64_t half, float scale, int window, float softcap) {
    if (D == 64) decode_seq(qb, ldq, kv_layer, table, lens, 1, ob, H, KVH, BS, half, scale, window, softcap, 64 / VW);
    else decode_seq(qb, ldq, kv_layer, table, lens, 1, ob, H, KVH, BS, half, scale, window, softcap, 128 / VW);
}
static void decode_rows_of_group(const float *qb, int64_t ldq, const float *kv_layer, const int32_t *table,
                                 const int32_t *lens, int n, float *ob, int H, int KVH, int D, int BS, int64_t half,
                                 float scale, int window, float softcap) {
    if (D == 64) decode_seq(qb, ldq, kv_layer, table, lens, n, ob, H, KVH, BS, half, scale, window, softcap, 64 / VW);
    else decode_seq(qb, ldq, kv_layer, table, lens, n, ob, H, KVH, BS, half, scale, window, softcap, 128 / VW);
}
#endif
/* Row a + 1 takes the position after row a's under a block table that agrees with row a's on every
 * block row a reads: the two can share a group (decode_group; the group reads the last row's table). */
static inline int decode_rows_continue(const int32_t *block_tables, int max_blocks, const int32_t *seq_lens, int a,
                                       int BS) {
    if (seq_lens[a + 1] != seq_lens[a] + 1) return 0;
    const int nb = (seq_lens[a] + BS - 1) / BS;
    return memcmp(block_tables + (int64_t)a * max_blocks, block_tables + (int64_t)(a + 1) * max_blocks,
                  (size_t)nb * sizeof(int32_t)) == 0;
}

/* The row at position i of the order (DECODE_ROW) is in the group of the row at position i - 1, which
 * must then be the row before it in the batch (groups start where (length - 1) % tg == 0). */
static inline int decode_rows_joins(const int32_t *block_tables, int max_blocks, const int32_t *seq_lens,
                                    const int32_t *order, int i, int BS, int tg) {
    if (i == 0) return 0;
    const int r = DECODE_ROW(order, i);
    return r > 0 && DECODE_ROW(order, i - 1) == r - 1 && (seq_lens[r] - 1) % tg
           && decode_rows_continue(block_tables, max_blocks, seq_lens, r - 1, BS);
}

/* The rows of the group that starts at position i of the order (rows DECODE_ROW(order, i) on). */
static inline int decode_rows_group(const int32_t *block_tables, int max_blocks, const int32_t *seq_lens,
                                    const int32_t *order, int i, int B, int BS, int tg) {
    int n = 1;
    while (n < tg && i + n < B && decode_rows_joins(block_tables, max_blocks, seq_lens, order, i + n, BS, tg)) n++;
    return n;
}

/* The next position of the order whose row starts a group, claimed from the counter the threads
 * share (B: none left). A row in the group of the row before it is passed over: that row's thread
 * computes it. */
static inline int decode_rows_claim(int *next, const int32_t *block_tables, int max_blocks, const int32_t *seq_lens,
                                    const int32_t *order, int B, int BS, int tg) {
    for (;;) {
        const int i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i >= B) return B;
        if (!decode_rows_joins(block_tables, max_blocks, seq_lens, order, i, BS, tg)) return i;
    }
}

/* The vector decode kernel's rows (BS <= 16, D 64 or 128) shared among the threads of the
 * enclosing parallel region (one thread outside any). Consecutive rows that continue one another
 * (the tokens of a prefill in the batch-invariant mode) go in groups of up to DECODE_TG, a group
 * starting at every token position (in its sequence) that is a multiple of DECODE_TG (fewer where
 * the model's heads would make the group's scratch exceed 64 KB); a row's result is the same bits
 * in any group, alone, or computed by any thread. Each thread claims its next group from the
 * counter *next (0 at the start) while it computes one (while more groups are left than threads):
 * the AVX-512 kernel reads that group's blocks ahead under this one's arithmetic. The rows are
 * claimed in the order `order` gives (DECODE_ROW). nt: the threads that claim (no barrier here: the
 * caller's parallel region or team phase ends after the rows). */
static void decode_rows_f32(const float *q, int64_t ldq, const float *kv_layer, const int32_t *block_tables,
                            const int32_t *seq_lens, const int32_t *order, float *out, int B, int H, int KVH, int D,
                            int BS, int max_blocks, int64_t nb1, float scale, int window, float softcap, int *next,
                            int nt) {
    const int64_t half = nb1 * (int64_t)KVH * BS * D;
#if defined(__AVX512F__)
    const int fit = 16384 / (H * (D + DECODE_CHUNK));  /* a row's accumulators and a chunk's p */
#else
    const int fit = MAXH * MAXD / (H * D);  /* rows whose accumulators fill decode_seq's acc */
#endif
    const int tg = fit < 1 ? 1 : fit < DECODE_TG ? fit : DECODE_TG;
    int i = decode_rows_claim(next, block_tables, max_blocks, seq_lens, order, B, BS, tg);
#if defined(__AVX512F__)
    const int32_t *prev = 0;  /* the table of the group this thread computed before, and its length */
    int prev_len = 0;
#endif
    while (i < B) {
        const int n = decode_rows_group(block_tables, max_blocks, seq_lens, order, i, B, BS, tg);
        const int b = DECODE_ROW(order, i);  /* the group's rows: b .. b + n - 1 */
        /* the next group claimed now only while more are left than there are threads: with fewer, a
         * thread that claimed early would leave another idle (at batch 2 on 2 threads, one thread
         * took both rows); then it is claimed after this one, with nothing read ahead for it */
        const int early = B - __atomic_load_n(next, __ATOMIC_RELAXED) > nt;
        const int i2 = early ? decode_rows_claim(next, block_tables, max_blocks, seq_lens, order, B, BS, tg) : B;
        const float *qb = q + (int64_t)b * ldq;
        const int32_t *table = block_tables + (int64_t)(b + n - 1) * max_blocks;
        float *ob = out + (int64_t)b * H * D;
#if defined(__AVX512F__)
        const int32_t *ahead = 0;  /* the next group's table (its last row's), window start and length */
        int ahead_lo = 0, ahead_len = 0;
        if (i2 < B) {
            const int b2 = DECODE_ROW(order, i2);
            const int last = b2 + decode_rows_group(block_tables, max_blocks, seq_lens, order, i2, B, BS, tg) - 1;
            ahead = block_tables + (int64_t)last * max_blocks;
            ahead_lo = window > 0 && seq_lens[b2] > window ? seq_lens[b2] - window : 0;
            ahead_len = seq_lens[last];
        }
        /* a row alone (a decode) gets the kernel specialised for one token */
#define DECODE_GROUP(NT) (D == 64 \
        ? decode_group(qb, ldq, kv_layer, table, seq_lens + b, NT, ob, H, KVH, BS, half, scale, window, softcap, 4, \
                       ahead, ahead_lo, ahead_len, prev, prev_len) \
        : decode_group(qb, ldq, kv_layer, table, seq_lens + b, NT, ob, H, KVH, BS, half, scale, window, softcap, 8, \
                       ahead, ahead_lo, ahead_len, prev, prev_len))
        if (n == 1) DECODE_GROUP(1);
        else DECODE_GROUP(n);
#undef DECODE_GROUP
        prev = table;
        prev_len = seq_lens[b + n - 1];
#else
        if (n == 1) decode_row(qb, ldq, kv_layer, table, seq_lens + b, ob, H, KVH, D, BS, half, scale, window, softcap);
        else decode_rows_of_group(qb, ldq, kv_layer, table, seq_lens + b, n, ob, H, KVH, D, BS, half, scale, window, softcap);
#endif
        i = early ? i2 : decode_rows_claim(next, block_tables, max_blocks, seq_lens, order, B, BS, tg);
    }
}
#endif

void paged_decode_attention_f32(const float *q, int64_t ldq, const float *kv_layer, const int32_t *block_tables,
                                const int32_t *seq_lens, const int32_t *order, float *out, int B, int H, int KVH,
                                int D, int BS, int max_blocks, int64_t nb1, float scale, int window, float softcap) {
#if defined(VW)
    if (BS <= 16 && (D == 64 || D == 128)) {
        int next = 0;
        #pragma omp parallel
        decode_rows_f32(q, ldq, kv_layer, block_tables, seq_lens, order, out, B, H, KVH, D, BS, max_blocks, nb1,
                        scale, window, softcap, &next, omp_get_num_threads());
        return;
    }
#endif
    paged_decode_attention_generic_f32(q, ldq, kv_layer, block_tables, seq_lens, order, out, B, H, KVH, D, BS,
                                       max_blocks, nb1, scale, window, softcap);
}

/* The limits the fixed-size scratch above assumes (checked by the Python wrapper too). */
int paged_decode_max_heads(void) { return MAXH; }
int paged_decode_max_block(void) { return MAXBS; }
int paged_decode_max_head_dim(void) { return MAXD; }
/* The decode kernels take a row order (DECODE_ROW): bench/kernel_ab.py calls an older source without one. */
int paged_decode_takes_order(void) { return 1; }

/* ----------------------------------------------------------------------------------------------
 * Elementwise pieces of a decoder layer, fused (each replaces 2 to 14 torch ops per call).
 * ---------------------------------------------------------------------------------------------- */

/* RMSNorm as transformers computes it for a float32 model, with the residual add before it:
 *     h = x + residual (if residual);  residual_out = h;  out = weight * (h * rsqrt(mean(h^2) + eps))
 * x, residual, residual_out, out: [rows, n] (row strides ld_*); weight [n]. The mean is a float32
 * sum in index order divided by n (torch sums in another order: values agree to float32 rounding). */
/* Row r (add_rmsnorm_rows: the rows shared among the threads of the enclosing parallel region, one
 * thread outside any; implicit barrier at the end. Likewise rope_rows_*, silu_mul_rows,
 * kv_write_rows_* below, each with its row on its own for the team's shares further down). One
 * body for every caller (noinline): the compiler may vectorize the sum of squares differently where
 * it inlines it, and the fused layer stack must give the separate kernel's bits. */
static __attribute__((noinline)) void add_rmsnorm_row(const float *x, int64_t ld_x, const float *residual,
                                                      int64_t ld_res, float *residual_out, int64_t ld_res_out,
                                                      const float *weight, float *out, int64_t ld_out, int r, int n,
                                                      float eps) {
    {
        const float *xr = x + r * ld_x;
        float *hr = residual_out ? residual_out + r * ld_res_out : out + r * ld_out;
        if (residual) {
            const float *rr = residual + r * ld_res;
            #pragma omp simd
            for (int i = 0; i < n; i++) hr[i] = xr[i] + rr[i];
        } else if (hr != xr) {
            memcpy(hr, xr, sizeof(float) * n);
        }
        float ss = 0;
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < n; i++) ss += hr[i] * hr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        float *o = out + r * ld_out;
        #pragma omp simd
        for (int i = 0; i < n; i++) o[i] = weight[i] * (hr[i] * inv);
    }
}

static void add_rmsnorm_rows(const float *x, int64_t ld_x, const float *residual, int64_t ld_res,
                             float *residual_out, int64_t ld_res_out, const float *weight, float *out,
                             int64_t ld_out, int rows, int n, float eps) {
    #pragma omp for schedule(static)
    for (int r = 0; r < rows; r++)
        add_rmsnorm_row(x, ld_x, residual, ld_res, residual_out, ld_res_out, weight, out, ld_out, r, n, eps);
}

void add_rmsnorm_f32(const float *x, int64_t ld_x, const float *residual, int64_t ld_res, float *residual_out,
                     int64_t ld_res_out, const float *weight, float *out, int64_t ld_out, int rows, int n,
                     float eps) {
    #pragma omp parallel if (rows >= 32)
    add_rmsnorm_rows(x, ld_x, residual, ld_res, residual_out, ld_res_out, weight, out, ld_out, rows, n, eps);
}

/* Rotary embedding in place, exactly transformers' ``x * cos + rotate_half(x) * sin`` (each product
 * and the sum rounded on its own: -ffp-contract=off, so the same bits as torch's three ops):
 *     out[i] = x[i] * cos[i] + (-x[i + D/2]) * sin[i],   out[i + D/2] = x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
 * x: [rows, heads, D] with row stride ld_x (a view into the fused qkv output), cos/sin: [rows, D]. */
#define DEFINE_ROPE(T, SUFFIX)                                                                   \
static inline void rope_row_##SUFFIX(T *x, int64_t ld_x, const T *cos, const T *sin, int r, int heads, int D) { \
    const int half = D / 2;                                                                      \
    {                                                                                            \
        const T *c = cos + (int64_t)r * D, *s = sin + (int64_t)r * D;                            \
        for (int h = 0; h < heads; h++) {                                                        \
            T *v = x + r * ld_x + (int64_t)h * D;                                                \
            _Pragma("omp simd")                                                                  \
            for (int i = 0; i < half; i++) {                                                     \
                const T x1 = v[i], x2 = v[i + half];                                             \
                const T a = x1 * c[i], b = (-x2) * s[i];                                         \
                const T a2 = x2 * c[i + half], b2 = x1 * s[i + half];                            \
                v[i] = a + b;                                                                    \
                v[i + half] = a2 + b2;                                                           \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
}                                                                                                \
static void rope_rows_##SUFFIX(T *x, int64_t ld_x, const T *cos, const T *sin, int rows, int heads, int D) { \
    _Pragma("omp for schedule(static)")                                                          \
    for (int r = 0; r < rows; r++) rope_row_##SUFFIX(x, ld_x, cos, sin, r, heads, D);            \
}                                                                                                \
void rope_##SUFFIX(T *x, int64_t ld_x, const T *cos, const T *sin, int rows, int heads, int D) {   \
    _Pragma("omp parallel if (rows >= 32)")                                                      \
    rope_rows_##SUFFIX(x, ld_x, cos, sin, rows, heads, D);                                       \
}
DEFINE_ROPE(float, f32)
DEFINE_ROPE(double, f64)

/* SiLU-and-mul: out = silu(gate) * up, gate_up [rows, 2 * n] (gate first, then up), out [rows, n].
 * silu(g) = g / (1 + exp(-g)) with exp(-g) from the vectorizable softmax_expf for g >= 0 and a
 * range-extended form for g < 0 (exp(-g) = 1 / exp(g)); within a few ulp of torch.nn.functional.silu. */
static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int n) {
    for (int i = 0; i < n; i++) {
        const float e = softmax_expf(-fabsf(g[i]));       /* exp(-|g|), >= ~1.6e-38 */
        const float exp_neg_g = g[i] >= 0 ? e : 1.0f / e;  /* exp(-g), <= ~6e37 */
        o[i] = g[i] / (1.0f + exp_neg_g) * u[i];
    }
}

static void silu_mul_rows(const float *gate_up, int64_t ld_in, float *out, int64_t ld_out, int rows, int n) {
    #pragma omp for schedule(static)
    for (int r = 0; r < rows; r++)
        silu_mul_row(gate_up + r * ld_in, gate_up + r * ld_in + n, out + r * ld_out, n);
}

void silu_mul_f32(const float *gate_up, int64_t ld_in, float *out, int64_t ld_out, int rows, int n) {
    #pragma omp parallel if (rows >= 8)
    silu_mul_rows(gate_up, ld_in, out, ld_out, rows, n);
}

/* GeGLU (Gemma): gelu_tanh(gate) * up, each element on its own (scalar tanhf: the same result at
 * any position, unlike a vectorized body with a scalar tail), as F.gelu(approximate="tanh"):
 *     0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g^3)))                                  */
void gelu_tanh_mul_f32(const float *gate_up, int64_t ld_in, float *out, int64_t ld_out, int rows, int n) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    #pragma omp parallel for schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + r * ld_in, *u = g + n;
        float *o = out + r * ld_out;
        for (int i = 0; i < n; i++) {
            const float x = g[i];
            o[i] = 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x))) * u[i];
        }
    }
}

/* In place: x = cap * tanh(x / cap) (Gemma 2's final logits), element by element. */
void softcap_f32(float *x, int64_t n, float cap) {
    #pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) x[i] = cap * tanhf(x[i] / cap);
}

/* KV write: this step's keys and values into the layer's cache, token t at slot slots[t]
 * (block slots[t] / BS, offset slots[t] % BS); k, v: [T, KVH, D] with rows ld_k / ld_v apart and
 * heads contiguous (views into the fused qkv output: no copy first). Slots < 0 or >= nslots are
 * skipped, as the CUDA kernel does. The copy is exact, so any order gives the same cache. */
#define DEFINE_KV_WRITE(T, SUFFIX)                                                               \
static inline void kv_write_row_##SUFFIX(const T *k, int64_t ld_k, const T *v, int64_t ld_v, T *kv_layer, \
                                         int64_t half, const int64_t *slots, int t, int KVH, int BS, int D, \
                                         int64_t nslots) {                                       \
    {                                                                                            \
        const int64_t s = slots[t];                                                              \
        if (s < 0 || s >= nslots) return;                                                        \
        const int64_t blk = s / BS, off = s % BS;                                                \
        for (int h = 0; h < KVH; h++) {                                                          \
            T *dst = kv_layer + ((blk * KVH + h) * BS + off) * D;                                \
            memcpy(dst, k + t * ld_k + (int64_t)h * D, sizeof(T) * D);                           \
            memcpy(dst + half, v + t * ld_v + (int64_t)h * D, sizeof(T) * D);                    \
        }                                                                                        \
    }                                                                                            \
}                                                                                                \
static void kv_write_rows_##SUFFIX(const T *k, int64_t ld_k, const T *v, int64_t ld_v, T *kv_layer,     \
                                  int64_t half, const int64_t *slots, int ntok, int KVH, int BS, int D,  \
                                  int64_t nslots) {                                              \
    _Pragma("omp for schedule(static)")                                                          \
    for (int t = 0; t < ntok; t++)                                                               \
        kv_write_row_##SUFFIX(k, ld_k, v, ld_v, kv_layer, half, slots, t, KVH, BS, D, nslots);   \
}                                                                                                \
void kv_write_##SUFFIX(const T *k, int64_t ld_k, const T *v, int64_t ld_v, T *kv_layer, int64_t half, \
                       const int64_t *slots, int ntok, int KVH, int BS, int D, int64_t nslots) { \
    _Pragma("omp parallel if (ntok >= 256)")                                                     \
    kv_write_rows_##SUFFIX(k, ld_k, v, ld_v, kv_layer, half, slots, ntok, KVH, BS, D, nslots);   \
}
DEFINE_KV_WRITE(float, f32)
DEFINE_KV_WRITE(double, f64)

/* Whole KV blocks from one cache tensor to another (the host and disk tiers' copies): block b of
 * outer slice o (outer = layers x 2) starts at byte o * outer_stride + b * block_stride of its tensor
 * and is block_bytes long; pairs [n, 2] (src block, dst block). Straight into the destination, both
 * threads: torch's index_select + index_copy_ went through a fresh temporary (its page faults
 * included) at ~2 GB/s. */
void copy_kv_blocks(const char *src, int64_t src_outer_stride, int64_t src_block_stride, char *dst,
                    int64_t dst_outer_stride, int64_t dst_block_stride, const int64_t *pairs, int n, int64_t outer,
                    int64_t block_bytes) {
    #pragma omp parallel for schedule(static) if ((int64_t)n * outer * block_bytes >= (1 << 20))
    for (int64_t j = 0; j < (int64_t)n * outer; j++) {
        const int64_t o = j / n, i = j % n;
        memcpy(dst + o * dst_outer_stride + pairs[2 * i + 1] * dst_block_stride,
               src + o * src_outer_stride + pairs[2 * i] * src_block_stride, (size_t)block_bytes);
    }
}

/* Row m's running argmax over the values v[0 .. n - 1] (columns j0 .. j0 + n - 1, after those
 * before j0 in order): *best and *idx (-1: no value yet) become those of the row's first largest
 * value so far, or of its first NaN once one is seen (torch.argmax's rule);
 * the max and the NaN test of the n values vectorised, a scan only where they change the best. */
static inline void argmax_update(const float *v, int n, int64_t j0, float *best, int64_t *idx) {
    if (*idx >= 0 && *best != *best) return;  /* a NaN already: the first NaN stays */
    float mx = -INFINITY;
    int nan_seen = 0;
    #pragma omp simd reduction(max:mx) reduction(|:nan_seen)
    for (int j = 0; j < n; j++) {
        mx = v[j] > mx ? v[j] : mx;
        nan_seen |= v[j] != v[j];
    }
    if (!nan_seen && *idx >= 0 && !(mx > *best)) return;
    for (int j = 0; j < n; j++)
        if (nan_seen ? v[j] != v[j] : v[j] == mx) {
            *best = v[j];
            *idx = j0 + j;
            return;
        }
}

/* Greedy sampling's argmax, row by row: x [rows, n] (rows ld apart) -> out[r], the index of the
 * first largest value, or of the first NaN where the row has one (as torch.argmax). */
void argmax_rows_f32(const float *x, int64_t ld, int rows, int n, int64_t *out) {
    #pragma omp parallel for schedule(static) if (rows >= 2)
    for (int r = 0; r < rows; r++) {
        float best = -INFINITY;
        int64_t idx = -1;
        argmax_update(x + r * ld, n, 0, &best, &idx);
        out[r] = idx < 0 ? 0 : idx;
    }
}

/* ----------------------------------------------------------------------------------------------
 * Dense GEMM of the decoder's projections, float32:  y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]).
 *
 * W is packed once (gemm_pack_f32) into panels of GEMM_NR output features, each [K][GEMM_NR]
 * (zero-padded past N), so that a panel streams through memory once per call. Each thread takes a
 * contiguous range of panels; the rows of x go in groups of GEMM_RG, and in a panel the group's
 * tiles of up to GEMM_MR rows take each block of GEMM_KB values of k in turn, GEMM_MR x GEMM_NR
 * accumulators in registers, while that block's slice of the panel is in L1 (the first tile
 * brings it from memory, prefetched ahead); the block sums go to a running total in a buffer.
 *
 * Every output element is summed in two levels: for each block of GEMM_KB values of k in order, a
 * fresh FMA chain fma(x[m, k], W[n, k], acc) from 0; the block sums added in order to a running
 * total; then + bias[n]. (One chain over all of K, at the same speed, has a float32 error 3-5x
 * larger, above MKL's and oneDNN's; tests/test_linear.py prints the errors.) Nothing else enters it:
 * a row's outputs are bitwise the same whatever M, the row's
 * position, the tile it falls in or the number of threads (tested).
 * ---------------------------------------------------------------------------------------------- */
#if defined(__AVX512F__)
#define GEMM_NR 48  /* 3 zmm per row of a tile; 8 x 3 = 24 accumulators of 32 registers */
#define GEMM_MR 8
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMM_NR 16  /* 2 ymm per row of a tile; 6 x 2 = 12 accumulators of 16 registers, the 2 panel */
#define GEMM_MR 6   /* vectors and a broadcast: 8 loads per 12 FMAs (4 x 24 spills the panel's) */
#else
#define GEMM_NR 48
#define GEMM_MR 8
#endif
#define GEMM_KB 64

int gemm_panel_width(void) { return GEMM_NR; }

/* The panels of GEMM_NR columns that n output columns take (the last one padded). */
static inline int gemm_panels(int n) { return (n + GEMM_NR - 1) / GEMM_NR; }

/* w [N, K] (rows ld_w apart) -> packed [ceil(N / GEMM_NR), K, GEMM_NR]. */
void gemm_pack_f32(const float *w, int64_t ld_w, int N, int K, float *packed) {
    const int P = gemm_panels(N);
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < P; p++) {
        float *dst = packed + (int64_t)p * K * GEMM_NR;
        for (int j = 0; j < GEMM_NR; j++) {
            const int n = p * GEMM_NR + j;
            for (int k = 0; k < K; k++) dst[(int64_t)k * GEMM_NR + j] = n < N ? w[(int64_t)n * ld_w + k] : 0.0f;
        }
    }
}

#if defined(__AVX512F__)
#define GEMM_NV (GEMM_NR / 16)
#define GEMM_RG 32  /* rows that take a block of k in turn */
#define GEMM_PF_L2_BLOCKS 2  /* the second prefetch stream's lead, in blocks of k, into L2 */
_Static_assert(GEMM_MR == 8 && GEMM_RG % GEMM_MR == 0, "gemm_f32's switch covers tiles of 1 to 8 rows");
/* MR rows x one panel at one block of k: a fresh FMA chain per output from 0, added to the running
 * totals. MR is a constant at every call site, so each instance is unrolled with its accumulators
 * in registers. The row tiles of a group take each block of k in turn while that block's
 * GEMM_KB x GEMM_NR slice of the panel (12 KB) is in L1, and the group's tiles prefetch the next
 * block (the next panel's first after the last) between them: tile `tile` of `ntiles` takes its
 * share of the lines, spread over its iterations, so the panel streams from memory once, in order,
 * with requests in flight under every tile's FMAs. (When each tile prefetched the whole next block,
 * the second tile's requests found their lines already asked for: the memory was busy during the
 * first tile and idle during the others. Spread, on this kernel at 16 rows, 2 threads, weights
 * beyond L3: 13.4 -> 16.1 GB/s; 32 rows +27-35 %: bench/RESULTS.md, 2026-12-03, `244e716`.)
 * The same lines GEMM_PF_L2_BLOCKS blocks further on are asked into L2 too: the one-block lead into
 * L1 alone left a 16-row GEMM waiting on memory (a Zen 4 VM: SmolLM2's layers at 16 rows 143 ->
 * 171-179 GFLOP/s, 18 -> 21-22 GB/s; 8 rows 1.1x; 32 rows and more, where 4+ tiles use each panel
 * block, the same: 2026-12-04, `52799b4`). Measured on a 2-core Zen 5 VM (2026-12-02, `60fcb04`; the same
 * bits): SmolLM2's layers and head at 16 rows 1.3x, 512 rows ~1.08x the earlier kernel (one pass of
 * the first tile over all of K, then the next tiles from L2). */
static inline __attribute__((always_inline)) void gemm_tile_kblock(const int MR, const float *x, int64_t ld_x,
                                                                   const float *panel, int k0, int k1,
                                                                   const float *ahead, float *total,
                                                                   const int tile, const int ntiles) {
    __m512 acc[GEMM_MR][GEMM_NV];
    const float *xr[GEMM_MR];
    for (int m = 0; m < MR; m++) xr[m] = x + m * ld_x;
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < GEMM_NV; v++) acc[m][v] = _mm512_setzero_ps();
    const float *pk = panel + (int64_t)k0 * GEMM_NR;
    /* the next block (at ahead: this panel's next, or the first of the panel taken next) is k1 - k0
     * rows of GEMM_NV lines: each tile L lines an iteration */
    const int L = (GEMM_NV + ntiles - 1) / ntiles;
    const float *pf = ahead + (int64_t)tile * (k1 - k0) * L * 16;
    #pragma GCC unroll 2
    for (int k = k0; k < k1; k++, pk += GEMM_NR, pf += L * 16) {
        __m512 w[GEMM_NV];
        for (int l = 0; l < L; l++) {
            _mm_prefetch((const char *)(pf + 16 * l), _MM_HINT_T0);
            _mm_prefetch((const char *)(pf + GEMM_PF_L2_BLOCKS * GEMM_KB * GEMM_NR + 16 * l), _MM_HINT_T1);
        }
        for (int v = 0; v < GEMM_NV; v++) w[v] = _mm512_loadu_ps(pk + 16 * v);
        for (int m = 0; m < MR; m++) {
            const __m512 xv = _mm512_set1_ps(xr[m][k]);
            for (int v = 0; v < GEMM_NV; v++) acc[m][v] = _mm512_fmadd_ps(xv, w[v], acc[m][v]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < GEMM_NV; v++)
            _mm512_store_ps(total + m * GEMM_NR + 16 * v,
                            _mm512_add_ps(_mm512_load_ps(total + m * GEMM_NR + 16 * v), acc[m][v]));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMM_NV (GEMM_NR / 8)
#define GEMM_RG 24  /* rows that take a block of k in turn */
#define GEMM_PF_ROWS 128  /* software prefetch distance, in panel rows */
_Static_assert(GEMM_MR == 6 && GEMM_RG % GEMM_MR == 0, "gemm_f32's switch covers tiles of 1 to 6 rows");
/* The AVX2 GEMM: the same sums as the AVX-512 one (each output element's FMA chains over k in
 * blocks of GEMM_KB, added in order, then + bias), 8 lanes wide, so a row's results are bitwise the
 * same on either build. 6 x 16 tiles (4 x 24 has the same 12 accumulators, but the compiler then
 * re-loads the panel's vectors for every row: 16 loads per 12 FMAs, load-bound). The row tiles of a
 * group take each block of k in turn while that block's GEMM_KB x GEMM_NR slice of the panel is in
 * L1, and the first tile prefetches the panel ahead, so it streams from memory once, in order,
 * partly under the computation. Measured on a 2-core Zen 3 VM (bench/RESULTS.md,
 * 2026-12-01 and 2026-12-02, `9ba041c` and `1ff7546`): SmolLM2's layers at 16 rows ~1.5x faster than oneDNN; at 512 rows
 * ~0.9x oneDNN since the unrolled k loop (~0.75x before). */
static inline __attribute__((always_inline)) void gemm_tile_kblock(const int MR, const float *x, int64_t ld_x,
                                                                   const float *panel, int k0, int k1,
                                                                   float *total, const int pf) {
    __m256 acc[GEMM_MR][GEMM_NV];
    const float *xr[GEMM_MR];
    for (int m = 0; m < MR; m++) xr[m] = x + m * ld_x;
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < GEMM_NV; v++) acc[m][v] = _mm256_setzero_ps();
    const float *pk = panel + (int64_t)k0 * GEMM_NR;
    /* unrolled by 4, with pf a constant at each call site (no test in the loop): the loop's
     * bookkeeping otherwise crowds the 12 FMAs out of the dispatch width (python -m bench gemm
     * --c-baseline: 16 / 64 / 512 rows 1.14x / 1.26x / 1.15x; the same sums, so the same bits) */
    #pragma GCC unroll 4
    for (int k = k0; k < k1; k++, pk += GEMM_NR) {
        __m256 w[GEMM_NV];
        if (pf)  /* the first tile of a block: the panel GEMM_PF_ROWS rows (a line each) ahead */
            _mm_prefetch((const char *)(pk + GEMM_PF_ROWS * GEMM_NR), _MM_HINT_T0);
        for (int v = 0; v < GEMM_NV; v++) w[v] = _mm256_loadu_ps(pk + 8 * v);
        for (int m = 0; m < MR; m++) {
            const __m256 xv = _mm256_broadcast_ss(xr[m] + k);
            for (int v = 0; v < GEMM_NV; v++) acc[m][v] = _mm256_fmadd_ps(xv, w[v], acc[m][v]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < GEMM_NV; v++)
            _mm256_store_ps(total + m * GEMM_NR + 8 * v,
                            _mm256_add_ps(_mm256_load_ps(total + m * GEMM_NR + 8 * v), acc[m][v]));
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* MR rows of a row group at a block of k: the AVX-512 build's tiles share the prefetch of the next
 * block; in the AVX2 build the first tile (m0 == 0, pf a constant at each call site) prefetches */
#if defined(__AVX512F__)
#define GEMM_TILE(MR_) gemm_tile_kblock(MR_, xt, ld_x, panel, k0, k1, ahead, tt, m0 / GEMM_MR, ntiles)
#else
#define GEMM_TILE(MR_)                                                                       \
    do {                                                                                     \
        if (m0 == 0) gemm_tile_kblock(MR_, xt, ld_x, panel, k0, k1, tt, 1);                  \
        else gemm_tile_kblock(MR_, xt, ld_x, panel, k0, k1, tt, 0);                          \
    } while (0)
#endif

/* One row group's rows (rows <= GEMM_RG, from x) times one panel: their sums into total
 * [rows][GEMM_NR] (set here), no bias. next: the panel this thread takes after this one, whose
 * first block the last block's tiles prefetch. */
static inline __attribute__((always_inline)) void gemm_group_panel(const float *x, int64_t ld_x,
                                                                   const float *panel, const float *next,
                                                                   int rows, int K, float *total) {
    const int ntiles = (rows + GEMM_MR - 1) / GEMM_MR;
    (void)ntiles;
    memset(total, 0, sizeof(float) * rows * GEMM_NR);
    for (int k0 = 0; k0 < K; k0 += GEMM_KB) {
        const int k1 = k0 + GEMM_KB < K ? k0 + GEMM_KB : K;
        const float *ahead = k1 < K ? panel + (int64_t)k1 * GEMM_NR : next;
        (void)ahead;
        for (int m0 = 0; m0 < rows; m0 += GEMM_MR) {
            const float *xt = x + m0 * ld_x;
            float *tt = total + m0 * GEMM_NR;
            switch (rows - m0 < GEMM_MR ? rows - m0 : GEMM_MR) {
            case 1: GEMM_TILE(1); break;
            case 2: GEMM_TILE(2); break;
            case 3: GEMM_TILE(3); break;
            case 4: GEMM_TILE(4); break;
            case 5: GEMM_TILE(5); break;
#if GEMM_MR == 8
            case 6: GEMM_TILE(6); break;
            case 7: GEMM_TILE(7); break;
            default: GEMM_TILE(8); break;
#else
            default: GEMM_TILE(6); break;
#endif
            }
        }
    }
}

/* Items (rows, panels) lo .. hi - 1 of n: share s of nt. */
#define SHARE_RANGE(n, s, nt, lo, hi) \
    const int lo = (int)((int64_t)(n) * (s) / (nt)), hi = (int)((int64_t)(n) * ((s) + 1) / (nt))

/* Share t of nt of the GEMM (thread t of a parallel region of nt threads, or a team's share): a
 * contiguous range of panels; the row groups outside the panels, so a group's GEMM_RG rows of x
 * stay in L2 while the share's panels go by (from memory for the first group, then from L3). No
 * barrier at the end. With am_best (y unused): y is not written; row m's argmax over the share's
 * columns (in order) goes to am_best[m], am_idx[m] (argmax_update). */
static void gemm_share_to(const float *x, int64_t ld_x, const float *packed, const float *bias, float *y,
                          int64_t ld_y, int M, int N, int K, float *am_best, int64_t *am_idx, int t, int nt);
static void gemm_share(const float *x, int64_t ld_x, const float *packed, const float *bias, float *y,
                       int64_t ld_y, int M, int N, int K, int t, int nt) {
    gemm_share_to(x, ld_x, packed, bias, y, ld_y, M, N, K, 0, 0, t, nt);
}
static void gemm_share_to(const float *x, int64_t ld_x, const float *packed, const float *bias, float *y,
                          int64_t ld_y, int M, int N, int K, float *am_best, int64_t *am_idx, int t, int nt) {
    const int P = gemm_panels(N);
    {
        SHARE_RANGE(P, t, nt, p0, p1);
        float total[GEMM_RG * GEMM_NR] __attribute__((aligned(64)));
        for (int g0 = 0; g0 < M; g0 += GEMM_RG) {
            const int rows = M - g0 < GEMM_RG ? M - g0 : GEMM_RG;
            for (int p = p0; p < p1; p++) {
                const float *panel = packed + (int64_t)p * K * GEMM_NR;
                const float *b = bias ? bias + p * GEMM_NR : 0;
                const int ncols = N - p * GEMM_NR < GEMM_NR ? N - p * GEMM_NR : GEMM_NR;
                gemm_group_panel(x + g0 * ld_x, ld_x, panel, panel + (int64_t)K * GEMM_NR, rows, K, total);
                for (int m = 0; m < rows; m++) {
                    float *tr = total + m * GEMM_NR;
                    if (am_best) {  /* the values y would hold, in place */
                        if (b) for (int c = 0; c < ncols; c++) tr[c] += b[c];
                        argmax_update(tr, ncols, (int64_t)p * GEMM_NR, am_best + g0 + m, am_idx + g0 + m);
                        continue;
                    }
                    float *yr = y + (g0 + m) * ld_y + p * GEMM_NR;
                    if (b) for (int c = 0; c < ncols; c++) yr[c] = tr[c] + b[c];
                    else memcpy(yr, tr, sizeof(float) * ncols);
                }
            }
        }
    }
}

/* Share t of nt of act = silu_mul(x @ Wgate_up^T) (silu_mul_rows' arithmetic on what gemm_share
 * would write, never written), for a gate_up packed from [2 I, K] with I a multiple of GEMM_NR: gate
 * panels 0 .. Q - 1, then up panels Q .. 2 Q - 1. Each thread takes a contiguous range of panel
 * pairs (q, Q + q); a group's rows go through the gate panel, then the up panel, and each row's
 * GEMM_NR outputs are silu_mul_row of the two totals. The [M, 2 I] buffer between the GEMM and
 * silu_mul_rows, written and read back through L3 at a prefill's row counts, is not needed. */
static void gemm_silu_share(const float *x, int64_t ld_x, const float *packed, float *act, int64_t ld_act,
                            int M, int I, int K, int t, int nt) {
    const int Q = I / GEMM_NR;
    SHARE_RANGE(Q, t, nt, q0, q1);
    const int64_t stride = (int64_t)K * GEMM_NR;
    float gate[GEMM_RG * GEMM_NR] __attribute__((aligned(64)));
    float up[GEMM_RG * GEMM_NR] __attribute__((aligned(64)));
    for (int g0 = 0; g0 < M; g0 += GEMM_RG) {
        const int rows = M - g0 < GEMM_RG ? M - g0 : GEMM_RG;
        for (int q = q0; q < q1; q++) {
            const float *gp = packed + q * stride, *upp = packed + (Q + q) * stride;
            gemm_group_panel(x + g0 * ld_x, ld_x, gp, upp, rows, K, gate);
            gemm_group_panel(x + g0 * ld_x, ld_x, upp, q + 1 < q1 ? gp + stride : packed + q0 * stride, rows, K, up);
            for (int m = 0; m < rows; m++)
                silu_mul_row(gate + m * GEMM_NR, up + m * GEMM_NR, act + (g0 + m) * ld_act + q * GEMM_NR, GEMM_NR);
        }
    }
}

/* Returns 1 (done), or 0 where this build has no kernel (neither AVX-512 nor AVX2: the caller keeps oneDNN). */
int gemm_f32(const float *x, int64_t ld_x, const float *packed, const float *bias, float *y, int64_t ld_y,
             int M, int N, int K) {
    #pragma omp parallel
    gemm_share(x, ld_x, packed, bias, y, ld_y, M, N, K, omp_get_thread_num(), omp_get_num_threads());
    return 1;
}

/* ----------------------------------------------------------------------------------------------
 * The team: the threads of the LM head (lm_head_argmax_f32) and of the fused layer stack
 * (decoder_layers_f32). A call is a sequence of phases, each split into shares (nt, one a thread,
 * or for a GEMM up to TEAM_MAX_SHARES: team_gemm_shares); each row, panel or element of a share is
 * computed as in the kernel's own call, so the bits are the same whoever computes it and however
 * the phase is split. A thread takes its own shares of a phase first (the lowest unclaimed of its
 * range), then the highest unclaimed one of the others'; a phase is over when all its shares are
 * done, whoever did them. The calling thread takes part and never waits for a thread that has not
 * started. With OpenMP's barriers it did: a worker the OS left queued behind another process (the
 * HTTP front end, its client) held the step while the caller's CPU idled (bench/RESULTS.md,
 * 2026-12-07: the served ceiling's idle CPU). A worker the OS preempts in the middle of a share
 * still holds the phase until it runs again: a GEMM's small shares leave it holding little, the
 * rest taken by the others.
 *
 * The workers are pthreads, started at first use: omp_get_max_threads() - 1 of them (what
 * torch.set_num_threads set), at most TEAM_MAX_THREADS in all. Between calls, and at a phase's
 * end, a thread spins briefly, then sleeps on a futex. Each claim word and done word carries its
 * call's generation: a worker that arrives after its call is over (or reads a later call's state
 * half-written) claims nothing, so it never touches a call's data, and goes back to waiting. One
 * call at a time (a mutex); a forked child starts its own workers.
 * ---------------------------------------------------------------------------------------------- */
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TEAM_MAX_SHARES 32    /* a claim word's share bits */
#define TEAM_MAX_THREADS TEAM_MAX_SHARES  /* (a share a thread at least) */
#define TEAM_MAX_PHASES 8192
#define TEAM_SPIN 1000        /* pause iterations before a waiting thread sleeps on a futex */

static uint64_t team_claims[TEAM_MAX_PHASES];  /* (gen << 32) | a bit a share claimed (from its shares on: set) */
static uint64_t team_dones[TEAM_MAX_PHASES];   /* (gen << 32) | (gen & 255) << 24 | shares << 8 | shares done */
static uint8_t team_shares[TEAM_MAX_PHASES];   /* the next call's shares of each phase (its caller writes them) */
static uint32_t team_gen;                      /* the current call's generation: the workers' futex word */
static int team_sleepers;                      /* workers asleep on it (or about to be) */
static int team_waiters;                       /* threads asleep on a phase's done word (or about to be) */
static void (*team_body)(uint32_t gen, int self);
static int team_nt;                            /* the current call's threads */
static int team_workers;                       /* worker threads started */
static int team_worker_delay_us;               /* tests: each worker joins each call this late */
static pthread_mutex_t team_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void team_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Share s of phase p for a thread of call gen, and the phase's shares in *n: the lowest unclaimed
 * of self's range (shares n self / nt .. n (self + 1) / nt - 1), else the highest unclaimed (the end
 * of another thread's range, which that thread reaches last); -1 when none is left, -2 when the
 * call is over. */
static inline int team_claim(uint32_t gen, int p, int self, int *n) {
    const uint64_t d = __atomic_load_n(&team_dones[p], __ATOMIC_ACQUIRE);
    if ((uint32_t)(d >> 32) != gen) return -2;
    *n = (int)(d >> 8 & 0xff);
    const int nt = __atomic_load_n(&team_nt, __ATOMIC_RELAXED);  /* (only where to look first) */
    uint32_t own = 0;
    if (self < nt) {
        const int lo = *n * self / nt, hi = *n * (self + 1) / nt;
        own = (uint32_t)(((hi >= 32 ? 0ull : 1ull << hi) - (1ull << lo)) & 0xffffffffu);
    }
    uint64_t w = __atomic_load_n(&team_claims[p], __ATOMIC_ACQUIRE);
    for (;;) {
        if ((uint32_t)(w >> 32) != gen) return -2;
        const uint32_t open = ~(uint32_t)w;
        if (!open) return -1;
        const int s = open & own ? __builtin_ctz(open & own) : 31 - __builtin_clz(open);
        if (__atomic_compare_exchange_n(&team_claims[p], &w, w | (1ull << s), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return s;
    }
}

/* The low half of phase p's done word (the count, nt and the generation's low byte: what a share's
 * end and the next call change), a futex. */
static inline uint32_t *team_done_futex(int p) {
    return (uint32_t *)&team_dones[p] + (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__);
}

/* Until all shares of phase p are done: 1, or 0 when call gen is over (a late worker). After a
 * short spin the thread sleeps (a share's thread was preempted: its CPU goes to whatever else
 * waits for one) until a share's end wakes it. */
static inline int team_wait(uint32_t gen, int p) {
    for (int i = 0;; i++) {
        const uint64_t w = __atomic_load_n(&team_dones[p], __ATOMIC_ACQUIRE);
        if ((uint32_t)(w >> 32) != gen) return 0;
        if ((w & 0xff) >= (w >> 8 & 0xff)) return 1;
        if (i < TEAM_SPIN) {
            team_relax();
            continue;
        }
        __atomic_add_fetch(&team_waiters, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, team_done_futex(p), FUTEX_WAIT_PRIVATE, (uint32_t)w, NULL, NULL, 0);
        __atomic_sub_fetch(&team_waiters, 1, __ATOMIC_SEQ_CST);
    }
}

/* A share of phase p done: its count up, and whoever sleeps on a phase woken. */
static inline void team_share_done(int p) {
    __atomic_add_fetch(&team_dones[p], 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&team_waiters, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, team_done_futex(p), FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

/* Phase p of call gen: the phase's body (the macro's last arguments) once for each share s of n
 * claimed (s and n in scope), then the wait for the others; the calling function returns when the
 * call is over for this thread. A phase's body reads the call's parameters: a claim is proof that
 * the call is current. Every phase of a call runs, so that a call once over has nothing left to
 * claim. */
#define TEAM_PHASE(gen, p, self, ...)                                                          \
    do {                                                                                     \
        int s, n;                                                                            \
        while ((s = team_claim(gen, p, self, &n)) >= 0) {                                    \
            __VA_ARGS__;                                                                     \
            team_share_done(p);                                                              \
        }                                                                                    \
        if (s == -2 || !team_wait(gen, p)) return;                                           \
    } while (0)

static void *team_worker(void *arg) {
    const int self = (int)(intptr_t)arg;
    uint32_t seen = __atomic_load_n(&team_gen, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t gen;
        for (int i = 0;; i++) {
            gen = __atomic_load_n(&team_gen, __ATOMIC_ACQUIRE);
            if (gen != seen) break;
            if (i < TEAM_SPIN) {
                team_relax();
                continue;
            }
            __atomic_add_fetch(&team_sleepers, 1, __ATOMIC_SEQ_CST);
            syscall(SYS_futex, &team_gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            __atomic_sub_fetch(&team_sleepers, 1, __ATOMIC_SEQ_CST);
            i = 0;
        }
        seen = gen;
        const int delay = __atomic_load_n(&team_worker_delay_us, __ATOMIC_RELAXED);
        if (delay > 0) usleep((useconds_t)delay);
        void (*body)(uint32_t, int) = team_body;  /* (a later call's, if it was written meanwhile: its claims fail) */
        if (self < __atomic_load_n(&team_nt, __ATOMIC_RELAXED) && body) body(gen, self);
    }
    return NULL;
}

static void team_after_fork(void) {
    team_workers = 0;
    team_sleepers = 0;
    team_waiters = 0;
    pthread_mutex_init(&team_lock, NULL);
}

/* Run body(gen, 0) on this thread, nt - 1 workers taking part; its nphases phases of
 * team_shares[p] shares each (1 .. TEAM_MAX_SHARES). The caller holds team_lock and has written the
 * call's parameters and shares. Returns when every phase is done. */
static void team_run(void (*body)(uint32_t, int), int nphases, int nt) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, team_after_fork);
        registered = 1;
    }
    while (team_workers < nt - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&th, &attr, team_worker, (void *)(intptr_t)(team_workers + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;  /* the shares stay nt: the threads there are take them all */
        pthread_setname_np(th, "prefixkv-team");
        team_workers++;
    }
    const uint32_t gen = team_gen + 1;
    for (int p = 0; p < nphases; p++) {
        const int n = team_shares[p];
        const uint32_t absent = n >= 32 ? 0 : ~((1u << n) - 1);  /* shares n .. 31: never claimable */
        __atomic_store_n(&team_claims[p], (uint64_t)gen << 32 | absent, __ATOMIC_RELAXED);
        __atomic_store_n(&team_dones[p], (uint64_t)gen << 32 | (uint64_t)(gen & 255) << 24 | (uint64_t)n << 8,
                         __ATOMIC_RELAXED);
    }
    __atomic_store_n(&team_nt, nt, __ATOMIC_RELAXED);
    __atomic_store_n(&team_body, body, __ATOMIC_RELAXED);
    __atomic_store_n(&team_gen, gen, __ATOMIC_SEQ_CST);
    if (nt > 1 && __atomic_load_n(&team_sleepers, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, &team_gen, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    body(gen, 0);
}

/* Tests: every worker starts on each call us microseconds after it is posted (0: at once), so that
 * the caller takes some or all of the workers' shares, and workers arrive after their call is over. */
void team_set_worker_delay_us(int us) { __atomic_store_n(&team_worker_delay_us, us < 0 ? 0 : us, __ATOMIC_RELAXED); }

/* The threads of a team call: omp_get_max_threads() (torch's), at most TEAM_MAX_THREADS. */
static int team_threads(void) {
    const int nt = omp_get_max_threads();
    return nt < 1 ? 1 : nt > TEAM_MAX_THREADS ? TEAM_MAX_THREADS : nt;
}

/* The shares of a GEMM phase of P panels on nt threads: a panel or more each, as many as a claim
 * word holds (a multiple of nt), at least nt. */
static int team_gemm_shares(int P, int nt) {
    if (nt <= 1) return 1;
    const int most = TEAM_MAX_SHARES / nt * nt;
    return P < nt ? nt : P < most ? P : most;
}

/* lm_head_argmax_f32's call, for the team's threads */
static struct {
    const float *x, *residual, *norm_w, *packed, *bias;
    float *normed, *best;
    int64_t *idx;
    int64_t ld_x, ld_res;
    float eps;
    int M, N, K;
} lm_call;

static void lm_head_norm(int s, int n) {
    SHARE_RANGE(lm_call.M, s, n, lo, hi);
    for (int r = lo; r < hi; r++)
        add_rmsnorm_row(lm_call.x, lm_call.ld_x, lm_call.residual, lm_call.ld_res, 0, 0, lm_call.norm_w,
                        lm_call.normed, lm_call.K, r, lm_call.K, lm_call.eps);
}

/* Share s of n; *prev: the share this thread did before in this phase (-1: none). A share after a lower
 * one starts from that one's running maxima: its result is then the argmax over both, which the
 * combination in share order (lm_head_argmax_f32) takes the same way, and a row meets a new maximum
 * about ln(panels) + 1 times in a thread's whole range instead of in every share (each one a
 * mispredicted branch and a search of the panel). */
static void lm_head_gemm(int s, int n, int *prev) {
    const int M = lm_call.M;
    float *best = lm_call.best + (int64_t)s * M;
    int64_t *idx = lm_call.idx + (int64_t)s * M;
    if (*prev >= 0 && *prev < s) {
        memcpy(best, lm_call.best + (int64_t)*prev * M, sizeof(float) * M);
        memcpy(idx, lm_call.idx + (int64_t)*prev * M, sizeof(int64_t) * M);
    }
    gemm_share_to(lm_call.normed, lm_call.K, lm_call.packed, lm_call.bias, 0, 0, M, lm_call.N, lm_call.K, best, idx,
                  s, n);
    *prev = s;
}

static void lm_head_body(uint32_t gen, int self) {
    int prev = -1;
    TEAM_PHASE(gen, 0, self, lm_head_norm(s, n));
    TEAM_PHASE(gen, 1, self, lm_head_gemm(s, n, &prev));
}

/* Greedy decoding's last step, M rows of float32: h = x + residual, normed = rmsnorm(h) * norm_w
 * (add_rmsnorm_f32's arithmetic, into the workspace normed [M, K]), logits = normed @ W^T (+ bias)
 * as gemm_f32 computes them, never written: out[m] = the first index of row m's largest logit (its
 * first NaN if any), argmax_rows_f32 of the logits gemm_f32 would write. Each share's columns in
 * order, then the shares in order; on the team's threads. Returns 1, or 0 (nothing done) as
 * gemm_f32 or where its scratch cannot be allocated. */
int lm_head_argmax_f32(const float *x, int64_t ld_x, const float *residual, int64_t ld_res, const float *norm_w,
                       float eps, float *normed, const float *packed, const float *bias, int M, int N, int K,
                       int64_t *out) {
    if (M <= 0) return 1;
    const int nt = team_threads(), ns = team_gemm_shares(gemm_panels(N), nt);
    float *best = malloc(sizeof(float) * (size_t)ns * M);
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)ns * M);
    if (!best || !idx) {
        free(best);
        free(idx);
        return 0;
    }
    for (int64_t i = 0; i < (int64_t)ns * M; i++) idx[i] = -1;  /* (a share without columns keeps -1) */
    pthread_mutex_lock(&team_lock);
    team_shares[0] = (uint8_t)nt, team_shares[1] = (uint8_t)ns;
    lm_call.x = x, lm_call.residual = residual, lm_call.norm_w = norm_w, lm_call.packed = packed;
    lm_call.bias = bias, lm_call.normed = normed, lm_call.best = best, lm_call.idx = idx;
    lm_call.ld_x = ld_x, lm_call.ld_res = ld_res, lm_call.eps = eps;
    lm_call.M = M, lm_call.N = N, lm_call.K = K;
    team_run(lm_head_body, 2, nt);
    pthread_mutex_unlock(&team_lock);
    for (int m = 0; m < M; m++) {  /* the shares' results in order, by the same rule as one value each */
        float b = -INFINITY;
        int64_t j = -1;
        for (int t = 0; t < ns; t++)
            if (idx[(int64_t)t * M + m] >= 0) argmax_update(best + (int64_t)t * M + m, 1, idx[(int64_t)t * M + m], &b, &j);
        out[m] = j < 0 ? 0 : j;
    }
    free(best);
    free(idx);
    return 1;
}
#else
int gemm_f32(const float *x, int64_t ld_x, const float *packed, const float *bias, float *y, int64_t ld_y,
             int M, int N, int K) {
    (void)x; (void)ld_x; (void)packed; (void)bias; (void)y; (void)ld_y; (void)M; (void)N; (void)K;
    return 0;
}
int lm_head_argmax_f32(const float *x, int64_t ld_x, const float *residual, int64_t ld_res, const float *norm_w,
                       float eps, float *normed, const float *packed, const float *bias, int M, int N, int K,
                       int64_t *out) {
    (void)x; (void)ld_x; (void)residual; (void)ld_res; (void)norm_w; (void)eps; (void)normed; (void)packed;
    (void)bias; (void)M; (void)N; (void)K; (void)out;
    return 0;
}
#endif

/* ----------------------------------------------------------------------------------------------
 * The decoder layers of a Llama-shaped float32 model in one call (prefixkv/model/fused_stack.py):
 * per layer, the same kernels in the same order as the Python path of prefixkv/model/llama.py,
 *     normed, residual = add_rmsnorm(h, residual)         (layer 0: residual = h)
 *     qkv = normed @ Wqkv^T (+ b);  rope(q), rope(k) in place;  k, v -> the cache at slots
 *     attn = decode attention of every row (a token with its own block-table row and length)
 *     normed, residual = add_rmsnorm(attn @ Wo^T (+ b), residual)
 *     h = silu_mul(normed @ Wgate_up^T) @ Wdown^T
 in one call on the team's threads (a phase a step, STACK_PHASES a layer) instead of ~11 calls a
 * layer through ctypes, each with its Python wrapper, allocations and a parallel region of its own.
 * Each kernel's rows are computed exactly as in its own call (each row, panel or element on its
 * own: the same bits whichever thread computes it), so the results are bitwise the Python path's
 * (tests/test_fused_stack.py). On return h holds the last layer's MLP output and
 * residual the stream before it, as LlamaModel.forward's loop leaves them.
 * ---------------------------------------------------------------------------------------------- */
typedef struct {
    const float *input_norm, *post_attention_norm;  /* [hidden] */
    const float *qkv, *qkv_bias;                    /* packed [(H + 2 KVH) D, hidden]; bias or 0 */
    const float *o, *o_bias;                        /* packed [hidden, H D] */
    const float *gate_up, *down;                    /* packed [2 I, hidden], [hidden, I] */
    float *kv_layer;                                /* [2, nb1, KVH, BS, D] */
} decoder_layer_f32;

typedef struct {
    int T, hidden, H, KVH, D, BS, inter, max_blocks;
    int64_t nb1;
    float eps, scale;
    float *h, *residual, *normed, *qkv, *attn, *o_out, *gate_up, *act;  /* workspaces, [T, ...] */
    const float *cos, *sin;          /* [T, D] */
    const int64_t *slots;            /* [T] */
    const int32_t *block_tables;     /* [T, max_blocks]: each row's (token's) table */
    const int32_t *seq_lens;         /* [T]: each row's context length, itself included */
    const int32_t *row_order;        /* [T]: the order the attention takes the rows in (DECODE_ROW), or 0 */
} decoder_step_f32;

#if defined(VW)
/* A layer's phases on the team: each depends on the one before. */
enum { STACK_NORM, STACK_QKV, STACK_ROPE_KV, STACK_ATTN, STACK_O, STACK_NORM2, STACK_GATE_UP, STACK_SILU, STACK_DOWN,
       STACK_PHASES };

static struct {
    const decoder_layer_f32 *layers;
    const decoder_step_f32 *s;
    int num_layers;
    int silu_in_gemm;  /* SiLU·mul inside the gate/up GEMM (STACK_SILU empty) */
} stack_call;
#define STACK_MAX_LAYERS (TEAM_MAX_PHASES / STACK_PHASES)
static int stack_next_row[STACK_MAX_LAYERS];  /* each layer's attention: the next row to claim */

/* Share s of nt of phase k of layer i, the call's parameters read here (a claim is made). */
static void stack_phase(int i, int k, int s, int nt) {
    const decoder_layer_f32 *w = stack_call.layers + i;
    const decoder_step_f32 *st = stack_call.s;
    const int silu_in_gemm = stack_call.silu_in_gemm;
    const int T = st->T, hid = st->hidden, H = st->H, KVH = st->KVH, D = st->D, I = st->inter;
    const int nqkv = (H + 2 * KVH) * D;
    const int64_t half = st->nb1 * (int64_t)KVH * st->BS * D;
    SHARE_RANGE(T, s, nt, lo, hi);
    switch (k) {
    case STACK_NORM:  /* layer 0: residual = h */
        for (int r = lo; r < hi; r++)
            add_rmsnorm_row(st->h, hid, i ? st->residual : 0, hid, st->residual, hid, w->input_norm, st->normed, hid,
                            r, hid, st->eps);
        break;
    case STACK_QKV:
        gemm_share(st->normed, hid, w->qkv, w->qkv_bias, st->qkv, nqkv, T, nqkv, hid, s, nt);
        break;
    case STACK_ROPE_KV:  /* a row's q and k rotated (adjacent heads), then its k and v into the cache */
        for (int r = lo; r < hi; r++) {
            rope_row_f32(st->qkv, nqkv, st->cos, st->sin, r, H + KVH, D);
            kv_write_row_f32(st->qkv + (int64_t)H * D, nqkv, st->qkv + (int64_t)(H + KVH) * D, nqkv, w->kv_layer,
                             half, st->slots, r, KVH, st->BS, D, st->nb1 * st->BS);
        }
        break;
    case STACK_ATTN:  /* every share's thread claims groups of rows until none is left */
        decode_rows_f32(st->qkv, nqkv, w->kv_layer, st->block_tables, st->seq_lens, st->row_order, st->attn, T, H,
                        KVH, D, st->BS, st->max_blocks, st->nb1, st->scale, 0, 0.0f, stack_next_row + i, team_nt);
        break;
    case STACK_O:
        gemm_share(st->attn, (int64_t)H * D, w->o, w->o_bias, st->o_out, hid, T, hid, H * D, s, nt);
        break;
    case STACK_NORM2:
        for (int r = lo; r < hi; r++)
            add_rmsnorm_row(st->o_out, hid, st->residual, hid, st->residual, hid, w->post_attention_norm, st->normed,
                            hid, r, hid, st->eps);
        break;
    case STACK_GATE_UP:
        if (silu_in_gemm) gemm_silu_share(st->normed, hid, w->gate_up, st->act, I, T, I, hid, s, nt);
        else gemm_share(st->normed, hid, w->gate_up, 0, st->gate_up, 2 * I, T, 2 * I, hid, s, nt);
        break;
    case STACK_SILU:  /* (nothing where it ran inside the gate/up GEMM) */
        if (!silu_in_gemm)
            for (int r = lo; r < hi; r++)
                silu_mul_row(st->gate_up + (int64_t)r * 2 * I, st->gate_up + (int64_t)r * 2 * I + I,
                             st->act + (int64_t)r * I, I);
        break;
    case STACK_DOWN:
        gemm_share(st->act, I, w->down, 0, st->h, hid, T, hid, I, s, nt);
        break;
    }
}

static void stack_body(uint32_t gen, int self) {
    const int L = stack_call.num_layers;  /* (a later call's, if it was written meanwhile: its claims fail) */
    for (int i = 0; i < L && i < STACK_MAX_LAYERS; i++)
        for (int k = 0; k < STACK_PHASES; k++)
            TEAM_PHASE(gen, i * STACK_PHASES + k, self, stack_phase(i, k, s, n));
}
#endif

/* The most layers decoder_layers_f32 takes (its team's phases). */
int decoder_layers_max(void) {
#if defined(VW)
    return STACK_MAX_LAYERS;
#else
    return 0;
#endif
}

/* Returns 1, or 0 (nothing done) where this build or these shapes have no kernel for it. */
int decoder_layers_f32(const decoder_layer_f32 *layers, int num_layers, const decoder_step_f32 *s) {
#if defined(VW)
    if (!(s->D == 64 || s->D == 128) || s->BS > 16 || s->H > MAXH || s->H % s->KVH) return 0;
    if (num_layers <= 0) return 1;
    if (num_layers > STACK_MAX_LAYERS) return 0;
    const int T = s->T, I = s->inter;
    /* SiLU·mul in the gate/up GEMM (gemm_silu_share) where its panels pair up, from two row groups
     * on (a prefill's rows): the same bits, without the [T, 2 I] buffer's round trip through L3
     * (offline cold traffic at 64 sequences +5 %: bench/RESULTS.md, 2026-12-07, `26e2bad`) */
    const int silu_in_gemm = I % GEMM_NR == 0 && T > GEMM_RG;
    const int nt = team_threads(), nqkv = (s->H + 2 * s->KVH) * s->D;
    uint8_t shares[STACK_PHASES];  /* a layer's: the GEMMs' by their panels (gate/up's: its pairs where fused) */
    for (int k = 0; k < STACK_PHASES; k++) shares[k] = (uint8_t)nt;
    shares[STACK_QKV] = (uint8_t)team_gemm_shares(gemm_panels(nqkv), nt);
    shares[STACK_O] = (uint8_t)team_gemm_shares(gemm_panels(s->hidden), nt);
    shares[STACK_GATE_UP] = (uint8_t)team_gemm_shares(silu_in_gemm ? I / GEMM_NR : gemm_panels(2 * I), nt);
    shares[STACK_DOWN] = shares[STACK_O];
    pthread_mutex_lock(&team_lock);
    stack_call.layers = layers, stack_call.s = s, stack_call.num_layers = num_layers;
    stack_call.silu_in_gemm = silu_in_gemm;
    memset(stack_next_row, 0, sizeof(int) * num_layers);
    for (int i = 0; i < num_layers; i++) memcpy(team_shares + i * STACK_PHASES, shares, sizeof(shares));
    team_run(stack_body, num_layers * STACK_PHASES, nt);
    pthread_mutex_unlock(&team_lock);
    return 1;
#else
    (void)layers; (void)num_layers; (void)s;
    return 0;
#endif
}

/* The vector width the kernels above were built for: 512 (AVX-512), 256 (AVX2 + FMA), 0 (neither:
 * the generic decode kernel and the elementwise ops only; gemm_f32 and the prefill kernel return 0). */
int kernels_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}
