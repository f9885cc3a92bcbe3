// KV-cache writes by slot_mapping, and block copies for copy-on-write.
//
// Both kernels move 16-byte vectors, so they need head_dim * sizeof(T) % 16 == 0 and 16-byte
// aligned rows (checked by the Python wrapper). T only fixes the element size.
#include "common.cuh"

namespace prefixkv {

inline constexpr int CACHE_OPS_THREADS = 128;

// Writes this step's K/V rows into the layer's cache at their slots.
// Grid: (num_tokens). Block: CACHE_OPS_THREADS. A negative slot is skipped, and so is one at or
// past num_slots (memory safety; the Python wrapper cannot check slots without a host sync).
template <typename T>
__global__ void __launch_bounds__(CACHE_OPS_THREADS) write_kv_kernel(
    T* __restrict__ k_cache,                    // [num_blocks + 1, num_kv_heads, block_size, head_dim]
    T* __restrict__ v_cache,                    // [num_blocks + 1, num_kv_heads, block_size, head_dim]
    const T* __restrict__ k,                    // [num_tokens, num_kv_heads, head_dim], token stride k_stride
    const T* __restrict__ v,                    // [num_tokens, num_kv_heads, head_dim], token stride v_stride
    const long long* __restrict__ slot_mapping, // [num_tokens], slot = block_id * block_size + offset
    const int num_kv_heads, const int head_dim, const int block_size, const long long num_slots,
    const long long k_stride, const long long v_stride) {
  constexpr int VEC = 16 / sizeof(T);
  const int token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  const long long block = slot / block_size;
  const int offset = static_cast<int>(slot - block * block_size);
  const int chunks_per_head = head_dim / VEC;
  const int chunks = num_kv_heads * chunks_per_head;
  for (int i = threadIdx.x; i < 2 * chunks; i += CACHE_OPS_THREADS) {
    const bool is_v = i >= chunks;
    const int c = is_v ? i - chunks : i;
    const int head = c / chunks_per_head;
    const int d = (c - head * chunks_per_head) * VEC;
    const T* src = is_v ? v + token * v_stride : k + token * k_stride;
    T* dst = is_v ? v_cache : k_cache;
    const long long dst_off = ((block * num_kv_heads + head) * block_size + offset) * head_dim + d;
    *reinterpret_cast<Bytes16*>(dst + dst_off) =
        *reinterpret_cast<const Bytes16*>(src + static_cast<long long>(head) * head_dim + d);
  }
}

// Copies whole blocks (every layer, K and V) for copy-on-write, in one launch.
// Grid: (num_copies, num_layers * 2). Block: CACHE_OPS_THREADS. Pairs naming a block outside
// [0, num_blocks_total) are skipped. A dst must not also be a src, nor the dst of two pairs, in the
// same call (CTAs run in any order; the Python wrapper checks). kv_cache is both read and written,
// so it is not __restrict__, and contiguous: every (layer, k/v) plane is addressed from its base.
template <typename T>
__global__ void __launch_bounds__(CACHE_OPS_THREADS) copy_blocks_kernel(
    T* kv_cache,                            // [num_layers, 2, num_blocks + 1, num_kv_heads, block_size, head_dim]
    const long long* __restrict__ src_dst,  // [num_copies, 2] block ids (src, dst)
    const long long num_blocks_total,       // num_blocks + 1 (the dummy block included)
    const long long block_numel) {          // num_kv_heads * block_size * head_dim
  const long long src = src_dst[2 * blockIdx.x];
  const long long dst = src_dst[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks_total || dst < 0 || dst >= num_blocks_total) return;
  T* base = kv_cache + blockIdx.y * num_blocks_total * block_numel;  // (layer, k/v) plane
  const Bytes16* from = reinterpret_cast<const Bytes16*>(base + src * block_numel);
  Bytes16* to = reinterpret_cast<Bytes16*>(base + dst * block_numel);
  const long long n = block_numel * static_cast<long long>(sizeof(T)) / 16;
  for (long long i = threadIdx.x; i < n; i += CACHE_OPS_THREADS) to[i] = from[i];
}

}  // namespace prefixkv

#ifdef PREFIXKV_INSTANTIATE
#define PREFIXKV_INST_CACHE_OPS(T)                                                                   \
  template __global__ void prefixkv::write_kv_kernel<T>(T*, T*, const T*, const T*, const long long*, \
                                                        int, int, int, long long, long long,         \
                                                        long long);                                  \
  template __global__ void prefixkv::copy_blocks_kernel<T>(T*, const long long*, long long, long long);
PREFIXKV_INST_CACHE_OPS(prefixkv::half_t)
PREFIXKV_INST_CACHE_OPS(prefixkv::bf16_t)
PREFIXKV_INST_CACHE_OPS(float)
#endif
