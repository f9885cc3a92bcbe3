// Device functions the prefixkv kernels share.
//
// Self-contained on purpose: no host headers and no cuda_fp16.h / cuda_bf16.h, so the same text
// compiles under nvcc (offline check) and under NVRTC through CuPy without depending on which
// copy of the fp16/bf16 headers NVRTC finds (those headers are version-coupled; a mismatch breaks
// the build). 16-bit values are stored as raw bits and converted with single PTX instructions.
// Every PTX primitive (cvt, cp.async, ldmatrix, mma) has a portable equivalent in its #else branch
// (plain loads, shuffles), used below sm_80 and when the kernels are compiled as host C++ against
// the SIMT emulator in tests/kernel_emu (PREFIXKV_EMULATOR: cp.async then lands only at its
// wait, so a missing wait shows up in the CPU tests); the two must compute the same thing.
//
// KV layout (defined in prefixkv/attention/base.py, read here):
//   kv_cache_layer: [2, num_blocks + 1, num_kv_heads, block_size, head_dim]
//   k_cache = kv_cache_layer[0], v_cache = kv_cache_layer[1]:
//       element (block b, kv head h, offset o, dim d) at ((b * num_kv_heads + h) * block_size + o) * head_dim + d
#pragma once

namespace prefixkv {

inline constexpr int WARP_SIZE = 32;
inline constexpr unsigned FULL_MASK = 0xffffffffu;

// IEEE fp16 and bf16 storage types (raw bits).
struct alignas(2) half_t {
  unsigned short bits;
};
struct alignas(2) bf16_t {
  unsigned short bits;
};

template <typename A, typename B>
struct IsSame {
  static constexpr bool value = false;
};
template <typename A>
struct IsSame<A, A> {
  static constexpr bool value = true;
};

// N elements of T, aligned to their total size so one load/store moves them all.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// ---- scalar conversions -------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }

// Portable fp16 <-> fp32 (round to nearest even), used where PTX is unavailable (CPU emulation).
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
  const unsigned int sign = static_cast<unsigned int>(h & 0x8000u) << 16;
  const unsigned int exp = (h >> 10) & 0x1fu;
  const unsigned int mant = h & 0x3ffu;
  if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0u) {                                                              // zero / subnormal
    const float f = static_cast<float>(mant) * 5.9604644775390625e-08f;       // mant * 2^-24
    return sign ? -f : f;
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ unsigned short float_to_half_bits(float x) {
  const unsigned int u = __float_as_uint(x);
  const unsigned short sign = static_cast<unsigned short>((u >> 16) & 0x8000u);
  const unsigned int a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<unsigned short>(sign | 0x7e00u);  // nan
  if (a >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u); // rounds to inf
  if (a < 0x38800000u) {                                                   // subnormal or zero
    // value / 2^-24, rounded to nearest even by the fp32 adder's own rounding
    const float scaled = __uint_as_float(a) * 16777216.0f;
    const float big = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (RNE)
    const unsigned int m = __float_as_uint(scaled + big) - __float_as_uint(big);
    return static_cast<unsigned short>(sign | m);
  }
  const unsigned int rounded = a + 0xfffu + ((a >> 13) & 1u);  // RNE at bit 13
  return static_cast<unsigned short>(sign | ((rounded - 0x38000000u) >> 13));
}

__device__ __forceinline__ float to_float(half_t x) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
#else
  return half_bits_to_float(x.bits);
#endif
}

__device__ __forceinline__ float to_float(bf16_t x) {
  return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);

template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}

template <>
__device__ __forceinline__ half_t from_float<half_t>(float x) {
  half_t h;
#if defined(__CUDA_ARCH__)
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#else
  h.bits = float_to_half_bits(x);
#endif
  return h;
}

template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  bf16_t b;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(x));
#else
  // Round to nearest even by hand (no bf16 cvt before sm_80); NaN stays a quiet NaN.
  unsigned int u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = static_cast<unsigned short>((u >> 16) | 0x40u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    b.bits = static_cast<unsigned short>(u >> 16);
  }
#endif
  return b;
}

// Two values as one 32-bit register, `lo` in the low half (the lower index in mma fragments).
template <typename T>
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
  return static_cast<unsigned int>(from_float<T>(lo).bits) |
         (static_cast<unsigned int>(from_float<T>(hi).bits) << 16);
}

// ---- vector loads and stores --------------------------------------------------------------------

// Loads N elements of T from `p` (aligned to N * sizeof(T)) as floats.
template <typename T, int N>
__device__ __forceinline__ void load_float(const T* p, float (&f)[N]) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = to_float(v.v[i]);
}

// Stores N floats as T to `p` (aligned to N * sizeof(T)).
template <typename T, int N>
__device__ __forceinline__ void store_float(T* p, const float (&f)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.v[i] = from_float<T>(f[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

using Bytes16 = Vec<unsigned int, 4>;

// ---- warp reductions ----------------------------------------------------------------------------

template <int WIDTH>
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, o));
  return x;
}

template <int WIDTH>
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) x += __shfl_xor_sync(FULL_MASK, x, o);
  return x;
}

// ---- asynchronous global -> shared copies (sm_80+, synchronous fallback below) -------------------

// Copies 16 bytes from `gmem` to `smem`, or writes 16 zero bytes when `valid` is false (then
// `gmem` is not read, but must still be a valid address).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#if defined(PREFIXKV_EMULATOR)
  emu_cp_async16(smem, gmem, valid);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
               : "memory");
#else
  Bytes16 v;
  v.v[0] = v.v[1] = v.v[2] = v.v[3] = 0u;
  if (valid) v = *reinterpret_cast<const Bytes16*>(gmem);
  *reinterpret_cast<Bytes16*>(smem) = v;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(PREFIXKV_EMULATOR)
  emu_cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(PREFIXKV_EMULATOR)
  emu_cp_async_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ---- tensor-core fragments (sm_80+; portable shuffle-based equivalents elsewhere) -----------------
//
// mma.sync m16n8k16, row.col, fp32 accumulate. With g = lane / 4 and q = lane % 4, each 32-bit
// register holds two 16-bit values, the lower index in the low half:
//   a = {A[g][2q..2q+1], A[g+8][2q..2q+1], A[g][2q+8..2q+9], A[g+8][2q+8..2q+9]}   (A: 16 x 16)
//   b = {B[2q..2q+1][g], B[2q+8..2q+9][g]}                                         (B: 16 x 8)
//   d = {D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1]}                           (D: 16 x 8)

template <typename T>
__device__ __forceinline__ float half_lo(unsigned int r) {
  T x;
  x.bits = static_cast<unsigned short>(r & 0xffffu);
  return to_float(x);
}

template <typename T>
__device__ __forceinline__ float half_hi(unsigned int r) {
  T x;
  x.bits = static_cast<unsigned short>(r >> 16);
  return to_float(x);
}

// d += a * b (one m16n8k16 tile). T is half_t or bf16_t.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                          unsigned int b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (IsSame<T, half_t>::value) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  // Gather the needed A rows / B columns from the lanes that hold them (k = 2kq + i (+8)).
  const int lane = threadIdx.x % WARP_SIZE;
  const int g = lane / 4;
  const int q = lane % 4;
  for (int kq = 0; kq < 4; ++kq) {
    unsigned int aa[4];
    for (int i = 0; i < 4; ++i) aa[i] = __shfl_sync(FULL_MASK, a[i], 4 * g + kq);
    unsigned int bb[2][2];  // [column 2q + e][k half]
    for (int e = 0; e < 2; ++e) {
      bb[e][0] = __shfl_sync(FULL_MASK, b0, 4 * (2 * q + e) + kq);
      bb[e][1] = __shfl_sync(FULL_MASK, b1, 4 * (2 * q + e) + kq);
    }
    for (int e = 0; e < 2; ++e)
      for (int kh = 0; kh < 2; ++kh) {
        const float b_lo = half_lo<T>(bb[e][kh]);
        const float b_hi = half_hi<T>(bb[e][kh]);
        d[e] = fmaf(half_lo<T>(aa[2 * kh]), b_lo, d[e]);
        d[e] = fmaf(half_hi<T>(aa[2 * kh]), b_hi, d[e]);
        d[2 + e] = fmaf(half_lo<T>(aa[2 * kh + 1]), b_lo, d[2 + e]);
        d[2 + e] = fmaf(half_hi<T>(aa[2 * kh + 1]), b_hi, d[2 + e]);
      }
  }
#endif
}

// ldmatrix .x4 (.trans): lanes 8i .. 8i+7 pass the row addresses of 8x8 matrix i (16 bytes each,
// 16-byte aligned, shared memory); r[i] receives (row g, cols 2q..2q+1) of matrix i, or of its
// transpose with TRANS (= stored rows 2q, 2q+1 of column g).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const void* row_addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(row_addr));
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
  }
#else
  const int lane = threadIdx.x % WARP_SIZE;
  const int g = lane / 4;
  const int q = lane % 4;
  const unsigned long long addr = reinterpret_cast<unsigned long long>(row_addr);
#if defined(PREFIXKV_EMULATOR)
  emu_check_align(addr, 16);  // ldmatrix row addresses must be 16-byte aligned
#endif
  for (int i = 0; i < 4; ++i) {
    if constexpr (TRANS) {
      const unsigned short* r0 = reinterpret_cast<const unsigned short*>(__shfl_sync(FULL_MASK, addr, 8 * i + 2 * q));
      const unsigned short* r1 =
          reinterpret_cast<const unsigned short*>(__shfl_sync(FULL_MASK, addr, 8 * i + 2 * q + 1));
      r[i] = static_cast<unsigned int>(r0[g]) | (static_cast<unsigned int>(r1[g]) << 16);
    } else {
      const unsigned short* row = reinterpret_cast<const unsigned short*>(__shfl_sync(FULL_MASK, addr, 8 * i + g));
      r[i] = static_cast<unsigned int>(row[2 * q]) | (static_cast<unsigned int>(row[2 * q + 1]) << 16);
    }
  }
#endif
}

}  // namespace prefixkv
