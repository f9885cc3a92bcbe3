// Paged prefill attention for chunked prefill with prefix hits (FlashAttention-style tiling).
//
// A sequence's query tokens are its last q_len tokens: query token i sits at position
// ctx + i, ctx = seq_len - q_len, and attends to keys 0 .. ctx + i (read through the block table):
//
//     keys:   0 ........................ ctx-1 | ctx ............. seq_len-1
//             [ cached prefix / earlier chunks ] [ this chunk's queries  ]
//     query i sees keys [0, ctx + i]           ^ causal diagonal
//
// Sliding window (window > 0): query i sees keys ctx + i - window < j <= ctx + i only, and a CTA
// starts at the first key tile its earliest row's window reaches. Soft-capping (softcap_log2 > 0):
// a score s (log2 units) becomes softcap_log2 * tanh(s / softcap_log2), before the mask.
//
// GQA: one CTA serves heads_per_cta query heads of one kv head, packing (token, head) pairs as
// its BLOCK_M rows: row r = (token tok0 + r / heads_per_cta, head head0 + r % heads_per_cta). Each
// K/V tile read from the cache is reused by all BLOCK_M rows.
//
// Grid: (ceil(max_query_len / tokens_per_cta), num_kv_heads * ceil(qpk / heads_per_cta),
//        num_prefill_seqs), tokens_per_cta = BLOCK_M / heads_per_cta; blockIdx.x runs from the last
// (most keys) tile to the first. Block: PREFILL_NUM_THREADS. Static shared memory < 48 KiB.
//
// Two kernels with the same arguments and grid (apart from BLOCK_M):
//   paged_prefill_kernel      SIMT fp32 math, any T; BLOCK_M = 64 (32 if HEAD_DIM*sizeof(T) > 256).
//   paged_prefill_mma_kernel  tensor cores (mma.sync m16n8k16, fp32 accumulate), half_t/bf16_t,
//                             HEAD_DIM <= 128; BLOCK_M = 64. P is rounded to T before the PV
//                             product (as FlashAttention-2 and eager PyTorch do). Picked on sm_80+
//                             (below that, common.cuh's portable fragment code is slow).
#include "common.cuh"

namespace prefixkv {

inline constexpr int PREFILL_NUM_THREADS = 128;

struct PrefillTile {
  const int* block_table;  // this sequence's row of block_tables
  int q_begin;             // index of the sequence's first query token in the batch
  int ctx;                 // positions before the first query token
  int tok0;                // first query token (within the sequence) of this CTA
  int num_tok;             // query tokens of this CTA
  int kv_begin;            // keys [kv_begin, kv_end) are visible to some row of this CTA
  int kv_end;
  int kv_head;
  int head0;               // first query head of this CTA
  int num_heads;           // query heads of this CTA (<= heads_per_cta)
  int heads_per_cta;

  // Row r of the tile is real (not padding) iff row_valid(r).
  __device__ __forceinline__ bool row_valid(int r) const {
    return r / heads_per_cta < num_tok && r % heads_per_cta < num_heads;
  }
  // Row r's query token: its index in the batch, and its position in the sequence.
  __device__ __forceinline__ int token(int r) const { return q_begin + tok0 + r / heads_per_cta; }
  __device__ __forceinline__ int pos(int r) const { return ctx + tok0 + r / heads_per_cta; }
  // Row r's query head.
  __device__ __forceinline__ int head(int r) const { return head0 + r % heads_per_cta; }
};

// Fills `t` for this CTA; false if the CTA has no query token.
template <int BLOCK_M>
__device__ __forceinline__ bool prefill_tile(PrefillTile& t, const int* block_tables, const int* seq_lens,
                                             const int* query_start_loc, int first_seq, int num_heads,
                                             int num_kv_heads, int max_blocks_per_seq, int heads_per_cta,
                                             int window) {
  const int seq = first_seq + blockIdx.z;
  t.q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - t.q_begin;
  const int tokens_per_cta = BLOCK_M / heads_per_cta;
  t.tok0 = (gridDim.x - 1 - blockIdx.x) * tokens_per_cta;
  if (t.tok0 >= q_len) return false;
  t.num_tok = min(tokens_per_cta, q_len - t.tok0);
  t.ctx = seq_lens[seq] - q_len;
  t.kv_end = t.ctx + t.tok0 + t.num_tok;
  t.kv_begin = window > 0 ? max(0, t.ctx + t.tok0 - window + 1) : 0;
  const int qpk = num_heads / num_kv_heads;
  const int num_chunks = (qpk + heads_per_cta - 1) / heads_per_cta;
  t.kv_head = blockIdx.y / num_chunks;
  const int first = (blockIdx.y % num_chunks) * heads_per_cta;  // within the kv head's group
  t.head0 = t.kv_head * qpk + first;
  t.num_heads = min(heads_per_cta, qpk - first);
  t.heads_per_cta = heads_per_cta;
  t.block_table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;
  return true;
}

// Starts async copies of the Q tile (ROWS x HEAD_DIM) into dst; padding rows become zeros.
template <typename T, int HEAD_DIM, int ROWS, int SROW>
__device__ __forceinline__ void load_q_tile(T (*dst)[SROW], const T* q, const PrefillTile& t,
                                            long long q_stride) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CPR = HEAD_DIM / VEC;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < ROWS * CPR; i += PREFILL_NUM_THREADS) {
    const int r = i / CPR;
    const int c = (i % CPR) * VEC;
    const bool valid = t.row_valid(r);
    const T* src = q;
    if (valid) {
      const int token = t.token(r);
      const int head = t.head(r);
      src = q + token * q_stride + static_cast<long long>(head) * HEAD_DIM + c;
    }
    cp_async16(&dst[r][c], src, valid);
  }
}

// Starts async copies of keys (or values) [kv0, kv0 + ROWS) of the CTA's kv head into dst;
// positions at or past kv_end become zeros.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int ROWS, int SROW>
__device__ __forceinline__ void load_kv_tile(T (*dst)[SROW], const T* cache, const PrefillTile& t,
                                             int num_kv_heads, int kv0) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CPR = HEAD_DIM / VEC;
  for (int i = threadIdx.x; i < ROWS * CPR; i += PREFILL_NUM_THREADS) {
    const int n = i / CPR;
    const int c = (i % CPR) * VEC;
    const int pos = kv0 + n;
    const bool valid = pos >= t.kv_begin && pos < t.kv_end;  // zeros outside (a window's past included)
    const T* src = cache;
    if (valid) {
      const long long block = t.block_table[pos / BLOCK_SIZE];
      src = cache + ((block * num_kv_heads + t.kv_head) * BLOCK_SIZE + pos % BLOCK_SIZE) * HEAD_DIM + c;
    }
    cp_async16(&dst[n][c], src, valid);
  }
}

// ---- SIMT kernel ----------------------------------------------------------------------------------

// Threads form a TR x TC grid: thread (tr, tc) owns rows tr*RM .. tr*RM+RM-1 of the tile, score
// columns tc + TC*j (j < RN), and output dims (kk*TC + tc)*CH .. +CH-1 (kk < NCH). Shared rows
// are padded by 16 bytes, which makes every access pattern below bank-conflict free.
template <typename T, int HEAD_DIM>
struct PrefillSimtConfig {
  static constexpr int ROW_BYTES = HEAD_DIM * static_cast<int>(sizeof(T));
  static constexpr bool WIDE = ROW_BYTES > 256;
  static constexpr int BLOCK_M = WIDE ? 32 : 64;
  static constexpr int BLOCK_N = WIDE ? 16 : 32;
  static constexpr int TR = 16;
  static constexpr int TC = 8;
  static constexpr int RM = BLOCK_M / TR;
  static constexpr int RN = BLOCK_N / TC;
  // elements per shared-memory read: 8 bytes, or 4 where TC 8-byte columns do not tile the row
  // (head_dim 80 in fp16 / bf16)
  static constexpr int CH = HEAD_DIM % (TC * (8 / static_cast<int>(sizeof(T)))) == 0 ? 8 / sizeof(T) : 4 / sizeof(T);
  static constexpr int NCH = HEAD_DIM / (TC * CH);
  static constexpr int SROW = HEAD_DIM + 16 / sizeof(T);
  static_assert(TR * TC == PREFILL_NUM_THREADS, "thread grid");
  static_assert(ROW_BYTES <= 512, "HEAD_DIM * sizeof(T) must be <= 512 bytes");
  static_assert(NCH >= 1 && HEAD_DIM % (TC * CH) == 0, "HEAD_DIM too small");
};

template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(PREFILL_NUM_THREADS, 2) paged_prefill_kernel(
    T* __restrict__ out,                    // [num_tokens, num_heads, HEAD_DIM], token stride out_stride
    const T* __restrict__ q,                // [num_tokens, num_heads, HEAD_DIM], token stride q_stride
    const T* __restrict__ k_cache,          // [num_blocks + 1, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
    const T* __restrict__ v_cache,          // [num_blocks + 1, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
    const int* __restrict__ block_tables,   // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,       // [num_seqs]
    const int* __restrict__ query_start_loc, // [num_seqs + 1]
    const int first_seq,                    // sequences before it (decodes) are not touched
    const int num_heads, const int num_kv_heads, const int max_blocks_per_seq, const int heads_per_cta,
    const long long q_stride, const long long out_stride, const float scale_log2, const int window,
    const float softcap_log2) {
  using C = PrefillSimtConfig<T, HEAD_DIM>;
  constexpr int RM = C::RM;
  constexpr int RN = C::RN;
  constexpr int TC = C::TC;
  constexpr int CH = C::CH;
  constexpr int NCH = C::NCH;
  constexpr int BLOCK_N = C::BLOCK_N;

  alignas(16) __shared__ T q_s[C::BLOCK_M][C::SROW];
  alignas(16) __shared__ T k_s[BLOCK_N][C::SROW];
  alignas(16) __shared__ T v_s[BLOCK_N][C::SROW];
  alignas(16) __shared__ float p_s[C::BLOCK_M][BLOCK_N];

  PrefillTile t;
  if (!prefill_tile<C::BLOCK_M>(t, block_tables, seq_lens, query_start_loc, first_seq, num_heads,
                                num_kv_heads, max_blocks_per_seq, heads_per_cta, window))
    return;
  const int tr = threadIdx.x / TC;
  const int tc = threadIdx.x % TC;
  const int row0 = tr * RM;
  int qpos[RM];  // position of each row's query token
#pragma unroll
  for (int i = 0; i < RM; ++i) qpos[i] = t.pos(row0 + i);

  load_q_tile<T, HEAD_DIM, C::BLOCK_M, C::SROW>(q_s, q, t, q_stride);
  cp_async_commit();
  const int first_tile = t.kv_begin / BLOCK_N;
  load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, BLOCK_N, C::SROW>(k_s, k_cache, t, num_kv_heads, first_tile * BLOCK_N);
  cp_async_commit();

  float m[RM];  // running row max (log2 units), equal across the row's TC threads
  float l[RM];  // this thread's share of the running row sum
  float acc[RM][NCH * CH];
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    m[i] = neg_inf();
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < NCH * CH; ++j) acc[i][j] = 0.f;
  }

  const int num_tiles = (t.kv_end + BLOCK_N - 1) / BLOCK_N;
  for (int it = first_tile; it < num_tiles; ++it) {
    const int kv0 = it * BLOCK_N;
    load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, BLOCK_N, C::SROW>(v_s, v_cache, t, num_kv_heads, kv0);
    cp_async_commit();
    cp_async_wait<1>();  // Q and K(it) have landed (V(it) may still be in flight)
    __syncthreads();

    float s[RM][RN];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RN; ++j) s[i][j] = 0.f;
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; d += CH) {
      float qf[RM][CH];
      float kf[RN][CH];
#pragma unroll
      for (int i = 0; i < RM; ++i) load_float<T, CH>(&q_s[row0 + i][d], qf[i]);
#pragma unroll
      for (int j = 0; j < RN; ++j) load_float<T, CH>(&k_s[tc + TC * j][d], kf[j]);
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j)
#pragma unroll
          for (int e = 0; e < CH; ++e) s[i][j] = fmaf(qf[i][e], kf[j][e], s[i][j]);
    }

#pragma unroll
    for (int i = 0; i < RM; ++i) {
      float row_max = neg_inf();
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        const int pos = kv0 + tc + TC * j;
        float x = s[i][j] * scale_log2;
        if (softcap_log2 > 0.f) x = softcap_log2 * tanhf(x / softcap_log2);
        const bool seen = pos <= qpos[i] && (window <= 0 || pos > qpos[i] - window);
        s[i][j] = seen ? x : neg_inf();
        row_max = fmaxf(row_max, s[i][j]);
      }
      const float m_new = fmaxf(m[i], warp_max<TC>(row_max));
      const float m_use = m_new == neg_inf() ? 0.f : m_new;  // row with no visible key yet
      const float corr = exp2f(m[i] - m_use);
      float p_sum = 0.f;
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        const float p = exp2f(s[i][j] - m_use);
        p_s[row0 + i][tc + TC * j] = p;
        p_sum += p;
      }
      l[i] = l[i] * corr + p_sum;
#pragma unroll
      for (int j = 0; j < NCH * CH; ++j) acc[i][j] *= corr;
      m[i] = m_new;
    }
    __syncthreads();  // p_s complete; k_s free

    if (it + 1 < num_tiles)
      load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, BLOCK_N, C::SROW>(k_s, k_cache, t, num_kv_heads, kv0 + BLOCK_N);
    cp_async_commit();   // possibly empty: keeps the wait<1> arithmetic uniform
    cp_async_wait<1>();  // V(it) has landed
    __syncthreads();

#pragma unroll
    for (int c = 0; c < BLOCK_N; c += 4) {
      float pr[RM][4];
#pragma unroll
      for (int i = 0; i < RM; ++i) load_float<float, 4>(&p_s[row0 + i][c], pr[i]);
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) {
#pragma unroll
        for (int kk = 0; kk < NCH; ++kk) {
          float vf[CH];
          load_float<T, CH>(&v_s[c + cc][(kk * TC + tc) * CH], vf);
#pragma unroll
          for (int i = 0; i < RM; ++i)
#pragma unroll
            for (int e = 0; e < CH; ++e) acc[i][kk * CH + e] = fmaf(pr[i][cc], vf[e], acc[i][kk * CH + e]);
        }
      }
    }
    __syncthreads();  // v_s and p_s free
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const float l_row = warp_sum<TC>(l[i]);
    const int r = row0 + i;
    if (!t.row_valid(r)) continue;
    const float inv = l_row > 0.f ? 1.f / l_row : 0.f;
    T* dst = out + t.token(r) * out_stride + static_cast<long long>(t.head(r)) * HEAD_DIM;
#pragma unroll
    for (int kk = 0; kk < NCH; ++kk) {
      float o[CH];
#pragma unroll
      for (int e = 0; e < CH; ++e) o[e] = acc[i][kk * CH + e] * inv;
      store_float<T, CH>(dst + (kk * TC + tc) * CH, o);
    }
  }
}

// ---- tensor-core kernel (fp16 / bf16, sm_80+) -----------------------------------------------------

inline constexpr int PREFILL_MMA_BLOCK_M = 64;  // 4 warps x 16 rows
inline constexpr int PREFILL_MMA_BLOCK_N = 64;

// Warp w owns tile rows 16w .. 16w+15; lane (g = lane/4, q = lane%4) holds rows 16w+g and 16w+g+8.
// S = Q K^T lives in registers (NTILE n8 tiles), is turned into P in place, and feeds the PV mma
// as its A operand (the C layout of two adjacent n8 tiles is the A layout of one k16 block).
template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(PREFILL_NUM_THREADS) paged_prefill_mma_kernel(
    T* __restrict__ out,                    // [num_tokens, num_heads, HEAD_DIM], token stride out_stride
    const T* __restrict__ q,                // [num_tokens, num_heads, HEAD_DIM], token stride q_stride
    const T* __restrict__ k_cache,          // [num_blocks + 1, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
    const T* __restrict__ v_cache,          // [num_blocks + 1, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
    const int* __restrict__ block_tables,   // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,       // [num_seqs]
    const int* __restrict__ query_start_loc, // [num_seqs + 1]
    const int first_seq,                    // sequences before it (decodes) are not touched
    const int num_heads, const int num_kv_heads, const int max_blocks_per_seq, const int heads_per_cta,
    const long long q_stride, const long long out_stride, const float scale_log2, const int window,
    const float softcap_log2) {
  static_assert(sizeof(T) == 2, "tensor-core path is for half_t / bf16_t");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 128, "HEAD_DIM must be a multiple of 16, <= 128");
  constexpr int BM = PREFILL_MMA_BLOCK_M;
  constexpr int BN = PREFILL_MMA_BLOCK_N;
  static_assert(BM == BN, "the K buffer stages the Q tile");
  constexpr int SROW = HEAD_DIM + 8;  // 16-byte pad: ldmatrix and fragment loads conflict free
  constexpr int KB = HEAD_DIM / 16;   // k16 blocks of QK^T
  constexpr int NTILE = BN / 8;       // n8 tiles of S
  constexpr int DTILE = HEAD_DIM / 8; // n8 tiles of O
  alignas(16) __shared__ T k_s[BN][SROW];
  alignas(16) __shared__ T v_s[BN][SROW];

  PrefillTile t;
  if (!prefill_tile<BM>(t, block_tables, seq_lens, query_start_loc, first_seq, num_heads, num_kv_heads,
                        max_blocks_per_seq, heads_per_cta, window))
    return;
  const int lane = threadIdx.x % WARP_SIZE;
  const int warp = threadIdx.x / WARP_SIZE;
  const int g = lane / 4;
  const int qd = lane % 4;
  const int row0 = warp * 16 + g;  // this lane's rows: row0 and row0 + 8
  const int qpos[2] = {t.pos(row0), t.pos(row0 + 8)};
  const int mat = lane / 8;  // ldmatrix: this lane addresses row (lane % 8) of matrix `mat`
  const int mat_row = lane % 8;

  load_q_tile<T, HEAD_DIM, BM, SROW>(k_s, q, t, q_stride);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  unsigned int qf[KB][4];
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    qf[kb][0] = *reinterpret_cast<const unsigned int*>(&k_s[row0][kb * 16 + 2 * qd]);
    qf[kb][1] = *reinterpret_cast<const unsigned int*>(&k_s[row0 + 8][kb * 16 + 2 * qd]);
    qf[kb][2] = *reinterpret_cast<const unsigned int*>(&k_s[row0][kb * 16 + 8 + 2 * qd]);
    qf[kb][3] = *reinterpret_cast<const unsigned int*>(&k_s[row0 + 8][kb * 16 + 8 + 2 * qd]);
  }
  __syncthreads();  // Q fragments are in registers; k_s is free for K
  const int first_tile = t.kv_begin / BN;
  load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, BN, SROW>(k_s, k_cache, t, num_kv_heads, first_tile * BN);
  cp_async_commit();

  float m[2] = {neg_inf(), neg_inf()};  // running max of rows row0, row0 + 8 (log2 units)
  float l[2] = {0.f, 0.f};              // this lane's share of the running sums
  float o[DTILE][4];
#pragma unroll
  for (int j = 0; j < DTILE; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

  const int num_tiles = (t.kv_end + BN - 1) / BN;
  for (int it = first_tile; it < num_tiles; ++it) {
    const int kv0 = it * BN;
    load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, BN, SROW>(v_s, v_cache, t, num_kv_heads, kv0);
    cp_async_commit();
    cp_async_wait<1>();  // K(it) has landed
    __syncthreads();

    float s[NTILE][4];
#pragma unroll
    for (int j = 0; j < NTILE; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
      for (int jj = 0; jj < NTILE / 2; ++jj) {
        // matrices: (keys 16jj.., dims lo), (16jj.., hi), (16jj+8.., lo), (16jj+8.., hi)
        unsigned int b[4];
        ldmatrix_x4<false>(b, &k_s[(2 * jj + mat / 2) * 8 + mat_row][kb * 16 + (mat % 2) * 8]);
        mma_16816<T>(s[2 * jj], qf[kb], b[0], b[1]);
        mma_16816<T>(s[2 * jj + 1], qf[kb], b[2], b[3]);
      }
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h = 0: row row0 (s[.][0..1]); h = 1: row row0 + 8 (s[.][2..3])
      float row_max = neg_inf();
#pragma unroll
      for (int j = 0; j < NTILE; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int pos = kv0 + j * 8 + 2 * qd + e;
          float& x = s[j][2 * h + e];
          float y = x * scale_log2;
          if (softcap_log2 > 0.f) y = softcap_log2 * tanhf(y / softcap_log2);
          x = pos <= qpos[h] && (window <= 0 || pos > qpos[h] - window) ? y : neg_inf();
          row_max = fmaxf(row_max, x);
        }
      const float m_new = fmaxf(m[h], warp_max<4>(row_max));
      const float m_use = m_new == neg_inf() ? 0.f : m_new;
      const float corr = exp2f(m[h] - m_use);
      float p_sum = 0.f;
#pragma unroll
      for (int j = 0; j < NTILE; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * h + e];
          x = exp2f(x - m_use);
          p_sum += x;
        }
      l[h] = l[h] * corr + p_sum;
#pragma unroll
      for (int j = 0; j < DTILE; ++j) {
        o[j][2 * h] *= corr;
        o[j][2 * h + 1] *= corr;
      }
      m[h] = m_new;
    }
    __syncthreads();  // every warp is done with k_s

    if (it + 1 < num_tiles)
      load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, BN, SROW>(k_s, k_cache, t, num_kv_heads, kv0 + BN);
    cp_async_commit();   // possibly empty: keeps the wait<1> arithmetic uniform
    cp_async_wait<1>();  // V(it) has landed
    __syncthreads();

#pragma unroll
    for (int kb = 0; kb < BN / 16; ++kb) {
      const unsigned int a[4] = {pack2<T>(s[2 * kb][0], s[2 * kb][1]), pack2<T>(s[2 * kb][2], s[2 * kb][3]),
                                 pack2<T>(s[2 * kb + 1][0], s[2 * kb + 1][1]),
                                 pack2<T>(s[2 * kb + 1][2], s[2 * kb + 1][3])};
#pragma unroll
      for (int jd = 0; jd < DTILE / 2; ++jd) {
        // transposed matrices: (keys lo, dims 16jd..), (keys hi, 16jd..), (lo, 16jd+8..), (hi, 16jd+8..)
        unsigned int b[4];
        ldmatrix_x4<true>(b, &v_s[kb * 16 + (mat % 2) * 8 + mat_row][(2 * jd + mat / 2) * 8]);
        mma_16816<T>(o[2 * jd], a, b[0], b[1]);
        mma_16816<T>(o[2 * jd + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with v_s
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l_row = warp_sum<4>(l[h]);
    const int r = row0 + 8 * h;
    if (!t.row_valid(r)) continue;
    const float inv = l_row > 0.f ? 1.f / l_row : 0.f;
    T* dst = out + t.token(r) * out_stride + static_cast<long long>(t.head(r)) * HEAD_DIM + 2 * qd;
#pragma unroll
    for (int j = 0; j < DTILE; ++j)
      *reinterpret_cast<unsigned int*>(dst + j * 8) = pack2<T>(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
  }
}

}  // namespace prefixkv

#ifdef PREFIXKV_INSTANTIATE
#define PREFIXKV_PREFILL_PARAMS(T)                                                                    \
  (T*, const T*, const T*, const T*, const int*, const int*, const int*, int, int, int, int, int, \
   long long, long long, float, int, float)
#define PREFIXKV_INST_PREFILL(T, D, BS) \
  template __global__ void prefixkv::paged_prefill_kernel<T, D, BS> PREFIXKV_PREFILL_PARAMS(T);
#define PREFIXKV_INST_PREFILL_MMA(T, D, BS) \
  template __global__ void prefixkv::paged_prefill_mma_kernel<T, D, BS> PREFIXKV_PREFILL_PARAMS(T);
// The offline compile check (tools/kernel_check) builds these: every dtype x head_dim {64, 128} x
// block size {16, 32} (tensor-core kernel: fp16 / bf16), head_dim 80 and 96 at block size 16, plus
// head_dim 256 (32-row SIMT tiles). At run time CuPy instantiates exactly what a model needs.
#define PREFIXKV_INST_PREFILL_BS(T, D) PREFIXKV_INST_PREFILL(T, D, 16) PREFIXKV_INST_PREFILL(T, D, 32)
#define PREFIXKV_INST_PREFILL_MMA_BS(T, D) PREFIXKV_INST_PREFILL_MMA(T, D, 16) PREFIXKV_INST_PREFILL_MMA(T, D, 32)
PREFIXKV_INST_PREFILL_BS(prefixkv::half_t, 64)
PREFIXKV_INST_PREFILL_BS(prefixkv::half_t, 128)
PREFIXKV_INST_PREFILL_BS(prefixkv::bf16_t, 64)
PREFIXKV_INST_PREFILL_BS(prefixkv::bf16_t, 128)
PREFIXKV_INST_PREFILL_BS(float, 64)
PREFIXKV_INST_PREFILL_BS(float, 128)
PREFIXKV_INST_PREFILL(prefixkv::half_t, 80, 16)
PREFIXKV_INST_PREFILL(prefixkv::bf16_t, 96, 16)
PREFIXKV_INST_PREFILL(float, 80, 16)
PREFIXKV_INST_PREFILL(float, 96, 16)
PREFIXKV_INST_PREFILL(prefixkv::bf16_t, 256, 16)
PREFIXKV_INST_PREFILL_MMA(prefixkv::bf16_t, 80, 16)
PREFIXKV_INST_PREFILL_MMA(prefixkv::half_t, 96, 16)
PREFIXKV_INST_PREFILL_MMA_BS(prefixkv::half_t, 64)
PREFIXKV_INST_PREFILL_MMA_BS(prefixkv::half_t, 128)
PREFIXKV_INST_PREFILL_MMA_BS(prefixkv::bf16_t, 64)
PREFIXKV_INST_PREFILL_MMA_BS(prefixkv::bf16_t, 128)
#endif
