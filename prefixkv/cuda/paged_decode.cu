// Paged decode attention: one query token per sequence, GQA-aware, optional split-K.
//
// One CTA per (sequence, kv head, chunk of up to GROUP query heads of that kv head[, partition]).
// The CTA reads its kv head's blocks once for all its query heads. Each warp takes 32-token
// chunks of the context in turn:
//
//   QK:  lane i scores token (chunk + i) against all GROUP query heads (q in shared memory, fp32,
//        pre-scaled by scale * log2(e)); no shuffles per dot product.
//   softmax: per-warp online softmax in fp32 (running max per head is warp-uniform).
//   PV:  the warp walks the chunk's tokens; lane i owns VPL consecutive output dims of every head
//        (VPL = head_dim/32 rounded up to a power of two: head_dim 80 and 96 leave lanes 20.. / 24..
//        without dims).
//
// At the end the NUM_WARPS partial (max, sum, acc) triples are merged through shared memory.
//
// Sliding window (window > 0: Mistral, Gemma, Qwen windowed layers): the query at position
// seq_len - 1 sees keys seq_len - window .. seq_len - 1 only; keys before are never read (their
// blocks may be gone). Soft-capping (softcap_log2 > 0: Gemma 2): a score s, in log2 units, becomes
// softcap_log2 * tanh(s / softcap_log2), i.e. cap * tanh(x / cap) of the natural-unit score x.
//
// Split-K (PARTITIONED): blockIdx.z picks a DECODE_PARTITION_SIZE-token partition of the context;
// the CTA writes its normalized partial output plus (max, sum) and paged_decode_reduce_kernel
// combines the partitions. Partitions past a sequence's end exit at once, so the grid may be
// sized by any upper bound of the context lengths (e.g. for CUDA graphs).
#include "common.cuh"

namespace prefixkv {

inline constexpr int DECODE_NUM_WARPS = 4;
inline constexpr int DECODE_NUM_THREADS = DECODE_NUM_WARPS * WARP_SIZE;
inline constexpr int DECODE_PARTITION_SIZE = 512;

// CTAs per SM the register budget is cut for: 3, or 2 where a thread's accumulators alone take 64
// registers (fp32, GROUP 8, HEAD_DIM 256: 3 spilled 156 bytes on sm_90; tools/kernel_check).
template <typename T, int HEAD_DIM, int GROUP>
inline constexpr int DECODE_MIN_BLOCKS = GROUP * HEAD_DIM * static_cast<int>(sizeof(T)) >= 8192 ? 2 : 3;

// Grid: (num_kv_heads * ceil(qpk / GROUP), num_seqs, PARTITIONED ? num_partitions : 1), where
// qpk = num_heads / num_kv_heads. Block: DECODE_NUM_THREADS. Static shared memory only
// (at most 45 KiB for GROUP = 8, HEAD_DIM = 256).
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GROUP, bool PARTITIONED>
__global__ void __launch_bounds__(DECODE_NUM_THREADS, (DECODE_MIN_BLOCKS<T, HEAD_DIM, GROUP>)) paged_decode_kernel(
    T* __restrict__ out,                   // [num_seqs, num_heads, HEAD_DIM], token stride out_stride (!PARTITIONED)
    float* __restrict__ part_max,          // [num_seqs, num_heads, max_parts] max logit (log2 units) (PARTITIONED)
    float* __restrict__ part_sum,          // [num_seqs, num_heads, max_parts] sum of exp2 (PARTITIONED)
    float* __restrict__ part_out,          // [num_seqs, num_heads, max_parts, HEAD_DIM] normalized partial out
    const T* __restrict__ q,               // [num_seqs, num_heads, HEAD_DIM], token stride q_stride
    const T* __restrict__ k_cache,         // [num_blocks + 1, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
    const T* __restrict__ v_cache,         // [num_blocks + 1, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,      // [num_seqs], context length incl. the query token
    const int num_heads, const int num_kv_heads, const int max_blocks_per_seq, const int max_parts,
    const long long q_stride, const long long out_stride, const float scale_log2, const int window,
    const float softcap_log2) {
  static_assert(HEAD_DIM == 32 || HEAD_DIM == 64 || HEAD_DIM == 80 || HEAD_DIM == 96 || HEAD_DIM == 128 ||
                    HEAD_DIM == 256,
                "HEAD_DIM must be 32, 64, 80, 96, 128 or 256");
  static_assert(GROUP >= 1 && GROUP <= 8, "GROUP must be in [1, 8]");
  constexpr int NW = DECODE_NUM_WARPS;
  constexpr int NT = DECODE_NUM_THREADS;
  constexpr int VPL = HEAD_DIM <= 32 ? 1 : HEAD_DIM <= 64 ? 2 : HEAD_DIM <= 128 ? 4 : 8;  // V dims per lane
  constexpr int DIM_LANES = HEAD_DIM / VPL;  // lanes that own output dims
  static_assert(HEAD_DIM % VPL == 0 && DIM_LANES <= WARP_SIZE, "V rows must split into VPL-element loads");
  constexpr int KVEC = 16 / sizeof(T);       // K elements per 16-byte load
  static_assert(HEAD_DIM % KVEC == 0 && KVEC % 4 == 0, "K rows must split into 16-byte loads");

  // p_s rows padded to an odd number of words: lane i's stores hit bank (i * P_STRIDE + g) % 32, all
  // distinct (a stride of GROUP = 8 put 8 lanes on one bank); the reads are broadcasts
  constexpr int P_STRIDE = GROUP | 1;
  alignas(16) __shared__ float q_s[GROUP][HEAD_DIM];
  alignas(16) __shared__ float p_s[NW][WARP_SIZE][P_STRIDE];
  alignas(16) __shared__ float red_acc[NW][GROUP][HEAD_DIM];
  __shared__ float red_m[NW][GROUP];
  __shared__ float red_l[NW][GROUP];

  const int tid = threadIdx.x;
  const int lane = tid % WARP_SIZE;
  const int warp = tid / WARP_SIZE;
  const int qpk = num_heads / num_kv_heads;
  const int num_chunks = (qpk + GROUP - 1) / GROUP;
  const int kv_head = blockIdx.x / num_chunks;
  const int head0 = kv_head * qpk + (blockIdx.x % num_chunks) * GROUP;  // first query head of the CTA
  const int num_active = min(GROUP, kv_head * qpk + qpk - head0);       // query heads of the CTA
  const int seq = blockIdx.y;
  const int seq_len = seq_lens[seq];

  const int lo = window > 0 ? max(0, seq_len - window) : 0;  // the first key the query sees
  int start = lo;
  int end = seq_len;
  if constexpr (PARTITIONED) {
    start = blockIdx.z * DECODE_PARTITION_SIZE;
    // nothing to do past the end or wholly before the window; the reduce kernel ignores it
    if (start >= seq_len || start + DECODE_PARTITION_SIZE <= lo) return;
    end = min(seq_len, start + DECODE_PARTITION_SIZE);
    start = max(start, lo);
  } else if (seq_len <= 0) {
    for (int i = tid; i < num_active * HEAD_DIM; i += NT)
      out[seq * out_stride + static_cast<long long>(head0) * HEAD_DIM + i] = from_float<T>(0.f);
    return;
  }

  for (int i = tid; i < GROUP * HEAD_DIM; i += NT) {
    const int g = i / HEAD_DIM;
    float x = 0.f;
    if (g < num_active) x = to_float(q[seq * q_stride + static_cast<long long>(head0) * HEAD_DIM + i]) * scale_log2;
    q_s[g][i % HEAD_DIM] = x;
  }
  __syncthreads();

  const int* block_table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;
  const long long block_stride = static_cast<long long>(num_kv_heads) * BLOCK_SIZE * HEAD_DIM;
  const long long head_offset = static_cast<long long>(kv_head) * BLOCK_SIZE * HEAD_DIM;

  float m[GROUP];    // running max (log2 units), warp-uniform
  float l[GROUP];    // this lane's share of the running sum
  float acc[GROUP][VPL];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < VPL; ++j) acc[g][j] = 0.f;
  }

  for (int chunk = start + warp * WARP_SIZE; chunk < end; chunk += NW * WARP_SIZE) {
    const int token = chunk + lane;
    const bool valid = token < end;
    long long row = 0;  // element offset of this lane's token row in k_cache / v_cache
    float score[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) score[g] = 0.f;
    if (valid) {
      const long long block = block_table[token / BLOCK_SIZE];
      row = block * block_stride + head_offset + static_cast<long long>(token % BLOCK_SIZE) * HEAD_DIM;
      const T* k_row = k_cache + row;
#pragma unroll
      for (int c = 0; c < HEAD_DIM; c += KVEC) {
        float kf[KVEC];
        load_float<T, KVEC>(k_row + c, kf);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
          for (int e = 0; e < KVEC; e += 4) {
            const Vec<float, 4> qv = *reinterpret_cast<const Vec<float, 4>*>(&q_s[g][c + e]);
            score[g] = fmaf(qv.v[0], kf[e], score[g]);
            score[g] = fmaf(qv.v[1], kf[e + 1], score[g]);
            score[g] = fmaf(qv.v[2], kf[e + 2], score[g]);
            score[g] = fmaf(qv.v[3], kf[e + 3], score[g]);
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float s = score[g];
      if (softcap_log2 > 0.f) s = softcap_log2 * tanhf(s / softcap_log2);
      s = valid ? s : neg_inf();
      const float m_new = fmaxf(m[g], warp_max<WARP_SIZE>(s));  // finite: lane 0 is always valid
      const float corr = exp2f(m[g] - m_new);
      const float p = valid ? exp2f(s - m_new) : 0.f;
      l[g] = l[g] * corr + p;
#pragma unroll
      for (int j = 0; j < VPL; ++j) acc[g][j] *= corr;
      m[g] = m_new;
      p_s[warp][lane][g] = p;
    }
    __syncwarp();
    const int num_valid = min(WARP_SIZE, end - chunk);
#pragma unroll 4
    for (int t = 0; t < num_valid; ++t) {
      const long long v_row = __shfl_sync(FULL_MASK, row, t);
      float vf[VPL] = {};
      if (DIM_LANES == WARP_SIZE || lane < DIM_LANES) load_float<T, VPL>(v_cache + v_row + lane * VPL, vf);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float p = p_s[warp][t][g];
#pragma unroll
        for (int j = 0; j < VPL; ++j) acc[g][j] = fmaf(p, vf[j], acc[g][j]);
      }
    }
    __syncwarp();
  }

  // Merge the NW warps' partial results.
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const float lsum = warp_sum<WARP_SIZE>(l[g]);
    if (lane == 0) {
      red_m[warp][g] = m[g];
      red_l[warp][g] = lsum;
    }
    if (DIM_LANES == WARP_SIZE || lane < DIM_LANES) {
      // 8- / 16-byte stores: a half (quarter) warp writes 128 contiguous bytes, no bank conflict
      // (scalar stores at a stride of VPL words put VPL lanes on one bank); head_dim 256: two
      // 16-byte stores 32 bytes apart, 2-way
      constexpr int SV = VPL < 4 ? VPL : 4;
#pragma unroll
      for (int j = 0; j < VPL; j += SV) {
        Vec<float, SV> v;
#pragma unroll
        for (int e = 0; e < SV; ++e) v.v[e] = acc[g][j + e];
        *reinterpret_cast<Vec<float, SV>*>(&red_acc[warp][g][lane * VPL + j]) = v;
      }
    }
  }
  __syncthreads();

  for (int i = tid; i < num_active * HEAD_DIM; i += NT) {
    const int g = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    float m_all = neg_inf();
#pragma unroll
    for (int w = 0; w < NW; ++w) m_all = fmaxf(m_all, red_m[w][g]);
    float l_all = 0.f;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      // A warp that saw no token has m = -inf, l = 0, acc = 0: weight 0, and no inf - inf.
      const float f = red_m[w][g] == neg_inf() ? 0.f : exp2f(red_m[w][g] - m_all);
      l_all = fmaf(red_l[w][g], f, l_all);
      o = fmaf(red_acc[w][g][d], f, o);
    }
    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
    if constexpr (PARTITIONED) {
      const long long p = (static_cast<long long>(seq) * num_heads + head0 + g) * max_parts + blockIdx.z;
      part_out[p * HEAD_DIM + d] = o * inv;
      if (d == 0) {
        part_max[p] = m_all;
        part_sum[p] = l_all;
      }
    } else {
      out[seq * out_stride + static_cast<long long>(head0 + g) * HEAD_DIM + d] = from_float<T>(o * inv);
    }
  }
}

// Combines the split-K partitions of paged_decode_kernel<..., PARTITIONED = true>.
// Grid: (num_heads, num_seqs). Block: HEAD_DIM threads rounded up to a multiple of 32, one output
// element each (the rest exit at once). A sequence longer than the max_parts partitions of the
// grid (max_seq_len below its length: a caller's error) comes out as NaN, not as the attention of
// its first max_parts * DECODE_PARTITION_SIZE tokens.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__((HEAD_DIM + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE) paged_decode_reduce_kernel(
    T* __restrict__ out,                   // [num_seqs, num_heads, HEAD_DIM], token stride out_stride
    const float* __restrict__ part_max,    // [num_seqs, num_heads, max_parts]
    const float* __restrict__ part_sum,    // [num_seqs, num_heads, max_parts]
    const float* __restrict__ part_out,    // [num_seqs, num_heads, max_parts, HEAD_DIM]
    const int* __restrict__ seq_lens,      // [num_seqs]
    const int num_heads, const int max_parts, const long long out_stride, const int window) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int d = threadIdx.x;
  if (d >= HEAD_DIM) return;
  const int seq_len = seq_lens[seq];
  const int num_parts = seq_len > 0 ? (seq_len + DECODE_PARTITION_SIZE - 1) / DECODE_PARTITION_SIZE : 0;
  if (num_parts > max_parts) {
    out[seq * out_stride + static_cast<long long>(head) * HEAD_DIM + d] = from_float<T>(quiet_nan());
    return;
  }
  // partitions wholly before the window were not written
  const int first = window > 0 && seq_len > 0 ? max(0, seq_len - window) / DECODE_PARTITION_SIZE : 0;
  const long long base = (static_cast<long long>(seq) * num_heads + head) * max_parts;
  float m_all = neg_inf();
  for (int p = first; p < num_parts; ++p) m_all = fmaxf(m_all, part_max[base + p]);
  float l_all = 0.f;
  float o = 0.f;
  for (int p = first; p < num_parts; ++p) {
    const float w = part_sum[base + p] * exp2f(part_max[base + p] - m_all);
    l_all += w;
    o = fmaf(w, part_out[(base + p) * HEAD_DIM + d], o);
  }
  const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
  out[seq * out_stride + static_cast<long long>(head) * HEAD_DIM + d] = from_float<T>(o * inv);
}

}  // namespace prefixkv

#ifdef PREFIXKV_INSTANTIATE
#define PREFIXKV_INST_DECODE(T, D, BS, G, P)                                                       \
  template __global__ void prefixkv::paged_decode_kernel<T, D, BS, G, P>(                          \
      T*, float*, float*, float*, const T*, const T*, const T*, const int*, const int*, int, int, \
      int, int, long long, long long, float, int, float);
#define PREFIXKV_INST_DECODE_REDUCE(T, D)                                                      \
  template __global__ void prefixkv::paged_decode_reduce_kernel<T, D>(                         \
      T*, const float*, const float*, const float*, const int*, int, int, long long, int);
// The offline compile check (tools/kernel_check) builds these: every dtype x head_dim {64, 128} x
// block size {16, 32}, the plain kernel for a GQA group of 4 and split-K for 8, head_dim 80 and 96
// (lanes without V dims) at block size 16, plus the extremes (head_dim 256, GROUP 1). At run time
// CuPy instantiates exactly what a model needs.
#define PREFIXKV_INST_DECODE_DIMS(T, D)      \
  PREFIXKV_INST_DECODE(T, D, 16, 4, false)   \
  PREFIXKV_INST_DECODE(T, D, 32, 4, false)   \
  PREFIXKV_INST_DECODE(T, D, 16, 8, true)    \
  PREFIXKV_INST_DECODE(T, D, 32, 8, true)    \
  PREFIXKV_INST_DECODE_REDUCE(T, D)
#define PREFIXKV_INST_DECODE_PARTIAL_LANES(T, D) \
  PREFIXKV_INST_DECODE(T, D, 16, 4, false)        \
  PREFIXKV_INST_DECODE(T, D, 16, 8, true)         \
  PREFIXKV_INST_DECODE_REDUCE(T, D)
#define PREFIXKV_INST_DECODE_TYPE(T)   \
  PREFIXKV_INST_DECODE_DIMS(T, 64)     \
  PREFIXKV_INST_DECODE_DIMS(T, 128)    \
  PREFIXKV_INST_DECODE_PARTIAL_LANES(T, 80) \
  PREFIXKV_INST_DECODE_PARTIAL_LANES(T, 96) \
  PREFIXKV_INST_DECODE(T, 256, 16, 8, true) \
  PREFIXKV_INST_DECODE(T, 128, 16, 1, false) \
  PREFIXKV_INST_DECODE_REDUCE(T, 256)
PREFIXKV_INST_DECODE_TYPE(prefixkv::half_t)
PREFIXKV_INST_DECODE_TYPE(prefixkv::bf16_t)
PREFIXKV_INST_DECODE_TYPE(float)
#endif
