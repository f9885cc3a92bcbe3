// A host-C++ SIMT emulator for the kernels in cuda/ (CPU tests only; built by kernel_emu/__init__.py).
//
// The kernel sources compile unchanged as host C++ (their #else branches: shuffles instead of
// ldmatrix / mma.sync) with PREFIXKV_EMULATOR defined. One CTA runs at a time; each CUDA thread is
// a fiber on its own stack, switched cooperatively at __syncthreads, __syncwarp and shuffles, so
// block- and warp-level synchronization behave as on a GPU:
//   - a shuffle or __syncwarp must be reached by all 32 lanes, __syncthreads by every thread; a
//     barrier that can never complete is reported as a deadlock, a thread that exits while others
//     wait at __syncthreads as an error;
//   - cp.async copies land only at the cp.async.wait_group that retires their group; until then the
//     destination holds NaN bytes, so reading it early (a missing wait or __syncthreads) shows up;
//   - __shared__ arrays are refilled with NaN bytes in every CTA (the builder appends an
//     emu_poison_shared call to each declaration), so reads of shared memory nobody wrote show up;
//   - every vector cast (reinterpret_cast, rewritten to emu_aligned_cast by the builder), cp.async
//     address and ldmatrix row address is checked for alignment.
// Errors do not abort the process: emu_launch returns -1 and emu_last_error() says why.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct EmuDim3 {
  unsigned int x = 0, y = 0, z = 0;
};
inline EmuDim3 threadIdx, blockIdx, blockDim, gridDim;

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace emu {

inline std::string last_error;
inline unsigned long long cta_epoch = 0;  // advanced for every CTA
inline std::map<const void*, unsigned long long> poisoned;  // shared array -> epoch it was poisoned in
inline jmp_buf fail_jb;  // set by emu_launch; emu::fail jumps back there

[[noreturn]] inline void fail(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  last_error = std::string(buf) + " [block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) +
               ", " + std::to_string(blockIdx.z) + "), thread " + std::to_string(threadIdx.x) + "]";
  _longjmp(fail_jb, 1);
}

struct Fiber {
  ucontext_t ctx;
  jmp_buf jb;
  std::vector<char> stack;
  bool started = false;
  bool done = false;
};

struct Barrier {
  int count = 0;
  unsigned long gen = 0;
  int site = 0;  // source line of this generation's first arrival
};

struct PendingCopy {
  unsigned char* dst;
  unsigned char data[16];
};

struct Cta {
  std::vector<Fiber> fibers;
  Barrier block_bar;
  std::vector<Barrier> warp_bar;
  std::vector<int> parity;                    // [thread] which half of `slots` its next shuffle uses
  std::vector<unsigned long long> slots;      // [warp][2][32] shuffle values
  std::vector<std::vector<std::vector<PendingCopy>>> groups;  // [thread][committed group][copy]
  std::vector<std::vector<PendingCopy>> open;                 // [thread] not yet committed
  int current = -1;
  unsigned long long progress = 0;  // barrier arrivals + completions + exits
  jmp_buf sched_jb;
  void (*body)(void**) = nullptr;
  void** args = nullptr;
};
inline Cta cta;

inline void yield() {
  if (!_setjmp(cta.fibers[cta.current].jb)) _longjmp(cta.sched_jb, 1);
}

// `site` (the caller's source line) must be the same for every thread of one barrier generation:
// threads meeting at different shuffles / barriers is a divergence bug on a GPU.
inline void barrier_wait(Barrier& b, int n, int site) {
  const unsigned long gen = b.gen;
  ++cta.progress;
  if (b.count == 0)
    b.site = site;
  else if (b.site != site)
    fail("divergent collective: threads meet at line %d and at line %d in the same barrier / shuffle", b.site, site);
  if (++b.count == n) {
    b.count = 0;
    ++b.gen;
    return;
  }
  while (b.gen == gen) yield();
}

inline void fiber_entry() {
  cta.body(cta.args);
  cta.fibers[cta.current].done = true;
  ++cta.progress;
  _longjmp(cta.sched_jb, 1);
}

inline void run_cta(unsigned int num_threads) {
  if (num_threads == 0 || num_threads % 32) fail("block size %u is not a positive multiple of 32", num_threads);
  const unsigned int num_warps = num_threads / 32;
  cta.fibers.clear();
  cta.fibers.resize(num_threads);
  cta.block_bar = Barrier{};
  cta.warp_bar.assign(num_warps, Barrier{});
  cta.parity.assign(num_threads, 0);
  cta.slots.assign(num_warps * 64, 0);
  cta.groups.assign(num_threads, {});
  cta.open.assign(num_threads, {});
  for (auto& f : cta.fibers) {
    f.stack.resize(256 << 10);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  for (;;) {
    bool any = false;
    const unsigned long long before = cta.progress;
    for (unsigned int i = 0; i < num_threads; ++i) {
      Fiber& f = cta.fibers[i];
      if (f.done) continue;
      any = true;
      cta.current = static_cast<int>(i);
      threadIdx = EmuDim3{i, 0, 0};
      if (!_setjmp(cta.sched_jb)) {
        if (!f.started) {
          f.started = true;
          setcontext(&f.ctx);
        }
        _longjmp(f.jb, 1);
      }
      if (f.done && cta.block_bar.count != 0)
        fail("thread exited while %d threads wait at __syncthreads", cta.block_bar.count);
    }
    if (!any) break;
    if (cta.progress == before) fail("deadlock: every live thread waits at a barrier that cannot complete");
  }
  for (unsigned int w = 0; w < num_warps; ++w)
    if (cta.warp_bar[w].count) fail("warp %u: %d lanes left waiting in a shuffle / __syncwarp", w, cta.warp_bar[w].count);
  for (unsigned int t = 0; t < num_threads; ++t) {
    if (!cta.open[t].empty()) fail("thread %u exited with uncommitted cp.async copies", t);
    for (auto& g : cta.groups[t])
      if (!g.empty()) fail("thread %u exited with cp.async copies never waited for", t);
  }
}

template <typename T>
T shfl(T v, int src_lane, int site) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  int& p = cta.parity[tid];
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  cta.slots[(warp * 2 + p) * 32 + tid % 32] = bits;
  barrier_wait(cta.warp_bar[warp], 32, site);
  const unsigned long long r = cta.slots[(warp * 2 + p) * 32 + (src_lane & 31)];
  p ^= 1;
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}

}  // namespace emu

// Called right after each __shared__ declaration: the first thread of a CTA to get there fills
// the array with NaN bytes (before any thread of the CTA can have written it).
inline void emu_poison_shared(void* array, std::size_t bytes) {
  unsigned long long& epoch = emu::poisoned[array];
  if (epoch != emu::cta_epoch) {
    std::memset(array, 0xff, bytes);
    epoch = emu::cta_epoch;
  }
}

inline void emu_check_align(unsigned long long address, unsigned long long alignment) {
  if (address % alignment) emu::fail("misaligned address %#llx (needs %llu-byte alignment)", address, alignment);
}

// reinterpret_cast with an alignment check of the pointee (the builder rewrites the kernels' casts).
template <class To, class From>
inline To emu_aligned_cast(From p) {
  if constexpr (std::is_pointer_v<To> && std::is_pointer_v<From>) {
    using Pointee = std::remove_cv_t<std::remove_pointer_t<To>>;
    if constexpr (!std::is_void_v<Pointee>)
      emu_check_align(reinterpret_cast<unsigned long long>(p), alignof(Pointee));
  }
  return reinterpret_cast<To>(p);
}

// The trailing `site` defaults to the caller's line (a GCC builtin), so a shuffle in a device function
// such as warp_max is identified by that function's line: divergence between two calls of one function is
// not caught, divergence between different collectives is.
template <typename T>
T __shfl_sync(unsigned int mask, T v, int src_lane, int width = 32, int site = __builtin_LINE()) {
  if (mask != 0xffffffffu || width != 32) emu::fail("only full-warp shuffles are emulated");
  return emu::shfl(v, src_lane, site);
}
template <typename T>
T __shfl_xor_sync(unsigned int mask, T v, int lane_mask, int width = 32, int site = __builtin_LINE()) {
  if (mask != 0xffffffffu || width != 32) emu::fail("only full-warp shuffles are emulated");
  return emu::shfl(v, static_cast<int>(threadIdx.x % 32) ^ lane_mask, site);
}
inline void __syncwarp(unsigned int mask = 0xffffffffu, int site = __builtin_LINE()) {
  if (mask != 0xffffffffu) emu::fail("only full-warp __syncwarp is emulated");
  emu::barrier_wait(emu::cta.warp_bar[threadIdx.x / 32], 32, site);
}
inline void __syncthreads(int site = __builtin_LINE()) {
  emu::barrier_wait(emu::cta.block_bar, static_cast<int>(blockDim.x), site);
}

// cp.async: the source is read at issue (global memory does not change during a kernel); the
// destination reads as NaN until the wait that retires the copy's group.
inline void emu_cp_async16(void* smem, const void* gmem, bool valid) {
  emu_check_align(reinterpret_cast<unsigned long long>(smem), 16);
  if (valid) emu_check_align(reinterpret_cast<unsigned long long>(gmem), 16);
  emu::PendingCopy c;
  c.dst = static_cast<unsigned char*>(smem);
  if (valid)
    std::memcpy(c.data, gmem, 16);
  else
    std::memset(c.data, 0, 16);
  std::memset(smem, 0xff, 16);
  emu::cta.open[threadIdx.x].push_back(c);
}

inline void emu_cp_async_commit() {
  auto& open = emu::cta.open[threadIdx.x];
  emu::cta.groups[threadIdx.x].push_back(std::move(open));
  open.clear();
}

inline void emu_cp_async_wait(int n) {
  auto& groups = emu::cta.groups[threadIdx.x];
  while (static_cast<int>(groups.size()) > n) {
    for (auto& c : groups.front()) std::memcpy(c.dst, c.data, 16);
    groups.erase(groups.begin());
  }
}
