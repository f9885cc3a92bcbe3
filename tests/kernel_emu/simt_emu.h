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
//
// Schedules (emu_set_schedule): the grid's CTAs and a CTA's threads run in index order (the
// default), in reverse, or in a seeded random order (a fresh permutation of the threads at every
// round of the scheduler); with `interleave`, the thread that completes a barrier or shuffle yields
// too, so every collective is a point where any waiting thread may run next. A correct kernel gives
// bitwise the same output under every schedule (kernel_emu compares them).
//
// Race check (built with PREFIXKV_EMU_RACE: g++ -fsanitize=thread instruments every load and store,
// and the __tsan_* hooks below, not the TSan runtime, receive them): a happens-before check of
// shared memory in 2-byte granules. Two accesses by different threads, one a write, conflict unless
// a __syncthreads lies between them, or a __syncwarp when both threads are in one warp (shuffles
// order nothing). A cp.async destination is written at the issue and again when it lands (at the
// issuing thread's wait); any access by another thread in between is a race, and so is a read of
// a granule no thread wrote in this CTA. The first conflict fails the launch, naming the array,
// the byte, both threads and the kernel code address of the access.
#pragma once

#include <dlfcn.h>
#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(PREFIXKV_EMU_RACE)
#define EMU_UNCHECKED __attribute__((no_sanitize_thread, noinline))
#else
#define EMU_UNCHECKED
#endif

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

enum Order { INDEX = 0, REVERSE = 1, RANDOM = 2 };

struct Schedule {
  int order = INDEX;
  unsigned long long seed = 0;
  bool interleave = false;
};
inline Schedule schedule;
inline unsigned long long rng = 0;

inline unsigned long long next_random() {  // splitmix64
  unsigned long long z = (rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Indices 0 .. n-1 in the schedule's order.
inline void ordered(std::vector<unsigned>& out, unsigned n) {
  out.resize(n);
  for (unsigned i = 0; i < n; ++i) out[i] = schedule.order == REVERSE ? n - 1 - i : i;
  if (schedule.order == RANDOM)
    for (unsigned i = n; i > 1; --i) std::swap(out[i - 1], out[next_random() % i]);
}

inline std::string last_error;
inline unsigned long long cta_epoch = 0;  // advanced for every CTA
inline std::map<const void*, unsigned long long> poisoned;  // shared array -> epoch it was poisoned in
inline jmp_buf fail_jb;  // set by emu_launch; emu::fail jumps back there

[[noreturn]] inline void fail(const char* fmt, ...) {
  char buf[768];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  last_error = std::string(buf) + " [block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) +
               ", " + std::to_string(blockIdx.z) + "), thread " + std::to_string(threadIdx.x) + "]";
  _longjmp(fail_jb, 1);
}

inline constexpr std::size_t STACK_BYTES = 256 << 10;

struct Fiber {
  ucontext_t ctx;
  jmp_buf jb;
  bool started = false;
  bool done = false;
};

struct Barrier {
  int count = 0;
  unsigned long gen = 0;
  int site = 0;  // source line of this generation's first arrival
};

enum class Sync { SHUFFLE, WARP, BLOCK };

struct PendingCopy {
  unsigned char* dst;
  unsigned char data[16];
};

struct Cta {
  std::vector<Fiber> fibers;
  std::unique_ptr<char[]> stacks;  // STACK_BYTES per thread, kept from CTA to CTA (never zeroed)
  std::size_t stack_threads = 0;
  Barrier block_bar;
  std::vector<Barrier> warp_bar;
  std::vector<int> parity;                    // [thread] which half of `slots` its next shuffle uses
  std::vector<unsigned long long> slots;      // [warp][2][32] shuffle values
  std::vector<std::vector<std::vector<PendingCopy>>> groups;  // [thread][committed group][copy]
  std::vector<std::vector<PendingCopy>> open;                 // [thread] not yet committed
  std::vector<unsigned> block_syncs;  // [thread] __syncthreads it has passed (race check)
  std::vector<unsigned> warp_syncs;   // [thread] __syncwarp it has passed (race check)
  std::vector<unsigned> order;        // this round's order of the threads
  int current = -1;
  unsigned long long progress = 0;  // barrier arrivals + completions + exits
  jmp_buf sched_jb;
  void (*body)(void**) = nullptr;
  void** args = nullptr;
};
inline Cta cta;

EMU_UNCHECKED inline void yield() {
  if (!_setjmp(cta.fibers[cta.current].jb)) _longjmp(cta.sched_jb, 1);
}

// `site` (the caller's source line) must be the same for every thread of one barrier generation:
// threads meeting at different shuffles / barriers is a divergence bug on a GPU.
EMU_UNCHECKED inline void barrier_wait(Barrier& b, int n, int site, Sync kind) {
  const unsigned long gen = b.gen;
  ++cta.progress;
  if (b.count == 0)
    b.site = site;
  else if (b.site != site)
    fail("divergent collective: threads meet at line %d and at line %d in the same barrier / shuffle", b.site, site);
  if (++b.count == n) {
    b.count = 0;
    ++b.gen;
    if (schedule.interleave) yield();  // the others may run first
  } else {
    while (b.gen == gen) yield();
  }
  const int tid = cta.current;
  if (kind == Sync::BLOCK) ++cta.block_syncs[tid];
  if (kind == Sync::WARP) ++cta.warp_syncs[tid];
}

EMU_UNCHECKED inline void fiber_entry() {
  cta.body(cta.args);
  cta.fibers[cta.current].done = true;
  ++cta.progress;
  _longjmp(cta.sched_jb, 1);
}

inline void race_begin_cta(unsigned num_threads);

EMU_UNCHECKED inline void run_cta(unsigned int num_threads) {
  if (num_threads == 0 || num_threads % 32) fail("block size %u is not a positive multiple of 32", num_threads);
  const unsigned int num_warps = num_threads / 32;
  if (cta.stack_threads < num_threads) {
    cta.stacks.reset(new char[num_threads * STACK_BYTES]);
    cta.stack_threads = num_threads;
  }
  cta.fibers.assign(num_threads, Fiber{});
  cta.block_bar = Barrier{};
  cta.warp_bar.assign(num_warps, Barrier{});
  cta.parity.assign(num_threads, 0);
  cta.slots.assign(num_warps * 64, 0);
  cta.groups.assign(num_threads, {});
  cta.open.assign(num_threads, {});
  cta.block_syncs.assign(num_threads, 0);
  cta.warp_syncs.assign(num_threads, 0);
  race_begin_cta(num_threads);
  for (unsigned int i = 0; i < num_threads; ++i) {
    Fiber& f = cta.fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = cta.stacks.get() + i * STACK_BYTES;
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  for (;;) {
    bool any = false;
    const unsigned long long before = cta.progress;
    ordered(cta.order, num_threads);
    for (const unsigned int i : cta.order) {
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
  cta.current = -1;
  for (unsigned int w = 0; w < num_warps; ++w)
    if (cta.warp_bar[w].count) fail("warp %u: %d lanes left waiting in a shuffle / __syncwarp", w, cta.warp_bar[w].count);
  for (unsigned int t = 0; t < num_threads; ++t) {
    if (!cta.open[t].empty()) fail("thread %u exited with uncommitted cp.async copies", t);
    for (auto& g : cta.groups[t])
      if (!g.empty()) fail("thread %u exited with cp.async copies never waited for", t);
  }
}

template <typename T>
EMU_UNCHECKED T shfl(T v, int src_lane, int site) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  int& p = cta.parity[tid];
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  cta.slots[(warp * 2 + p) * 32 + tid % 32] = bits;
  barrier_wait(cta.warp_bar[warp], 32, site, Sync::SHUFFLE);
  const unsigned long long r = cta.slots[(warp * 2 + p) * 32 + (src_lane & 31)];
  p ^= 1;
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}

// ---- race check (PREFIXKV_EMU_RACE builds) ---------------------------------------------------------

struct SharedArray {
  unsigned char* base = nullptr;
  std::size_t bytes = 0;
  const char* name = "";
  std::size_t first = 0;  // its first granule in `granules`
};

struct Granule {                 // 2 bytes of one shared array
  unsigned long long epoch = 0;  // the CTA these fields belong to (older: as if never touched)
  int writer = -1;               // the last write: thread, and its __syncthreads / __syncwarp counts
  unsigned write_block = 0, write_warp = 0;
  int in_flight = -1;            // the thread whose cp.async to it has not landed yet
  unsigned read_block = UINT_MAX;  // the __syncthreads interval of the reads recorded
};

struct RaceState {
  bool on = false;
  std::map<const void*, SharedArray> arrays;  // every shared array seen, by base address
  std::vector<const SharedArray*> live;       // this CTA's
  std::uintptr_t lo = UINTPTR_MAX, hi = 0;    // their extent
  std::vector<Granule> granules;
  // [granule * MAX_WARPS + warp]: the latest __syncwarp interval in which lanes of the warp read the
  // granule (in read_block), and those lanes
  std::vector<unsigned> read_warp, read_lanes;
  unsigned num_warps = 0;
};
inline constexpr unsigned MAX_WARPS = 32;
inline RaceState race;

inline void race_begin_cta(unsigned num_threads) {
  race.live.clear();
  race.lo = UINTPTR_MAX;
  race.hi = 0;
  race.num_warps = num_threads / 32;
}

EMU_UNCHECKED inline void race_register(void* array, std::size_t bytes, const char* name) {
  auto it = race.arrays.find(array);
  if (it == race.arrays.end()) {
    SharedArray a;
    a.base = static_cast<unsigned char*>(array);
    a.bytes = bytes;
    a.name = name;
    a.first = race.granules.size();
    const std::size_t n = (bytes + 1) / 2;
    race.granules.resize(a.first + n);
    race.read_warp.resize((a.first + n) * MAX_WARPS);
    race.read_lanes.resize((a.first + n) * MAX_WARPS);
    it = race.arrays.emplace(array, a).first;
  }
  race.live.push_back(&it->second);
  const auto lo = reinterpret_cast<std::uintptr_t>(array);
  race.lo = std::min(race.lo, lo);
  race.hi = std::max(race.hi, lo + bytes);
}

inline const char* what(bool write) { return write ? "writes" : "reads"; }

[[noreturn]] EMU_UNCHECKED inline void race_fail(const SharedArray& a, std::size_t offset, bool write, int other,
                                                 bool other_write, const char* why, const void* pc) {
  const int tid = cta.current;
  Dl_info info;
  std::uintptr_t rel = reinterpret_cast<std::uintptr_t>(pc);
  if (dladdr(pc, &info) && info.dli_fbase) rel -= reinterpret_cast<std::uintptr_t>(info.dli_fbase);
  if (other < 0)
    fail("shared-memory race: thread %d (warp %d) %s %s[byte %zu], %s [pc %#zx]", tid, tid / 32, what(write),
         a.name, offset, why, static_cast<std::size_t>(rel));
  fail("shared-memory race: thread %d (warp %d) %s %s[byte %zu], which thread %d (warp %d) %s, %s [pc %#zx]", tid,
       tid / 32, what(write), a.name, offset, other, other / 32, other_write ? "wrote" : "read", why,
       static_cast<std::size_t>(rel));
}

// Whether an access by `other` at (block, warp) sync counts is unordered with one by the current thread.
EMU_UNCHECKED inline bool concurrent(int other, unsigned block, unsigned warp) {
  const int tid = cta.current;
  if (other == tid || block != cta.block_syncs[tid]) return false;
  return other / 32 != tid / 32 || warp == cta.warp_syncs[tid];
}

inline const char* no_barrier(int other) {
  return other / 32 == cta.current / 32 ? "with no __syncwarp or __syncthreads between"
                                        : "with no __syncthreads between";
}

enum class Access { READ, WRITE, ISSUE, LAND };

EMU_UNCHECKED inline void race_access(const void* p, std::size_t n, Access kind, const void* pc) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!race.on || cta.current < 0 || a >= race.hi || a + n <= race.lo) return;
  const SharedArray* arr = nullptr;
  for (const SharedArray* s : race.live)
    if (a >= reinterpret_cast<std::uintptr_t>(s->base) && a < reinterpret_cast<std::uintptr_t>(s->base) + s->bytes) {
      arr = s;
      break;
    }
  if (arr == nullptr) return;
  const int tid = cta.current;
  const unsigned warp = static_cast<unsigned>(tid / 32);
  const unsigned lane_bit = 1u << (tid % 32);
  const unsigned block_now = cta.block_syncs[tid], warp_now = cta.warp_syncs[tid];
  const std::size_t off0 = a - reinterpret_cast<std::uintptr_t>(arr->base);
  const std::size_t end = std::min(off0 + n, arr->bytes);
  for (std::size_t off = off0 & ~std::size_t{1}; off < end; off += 2) {
    const std::size_t gi = arr->first + off / 2;
    Granule& g = race.granules[gi];
    unsigned* rw = &race.read_warp[gi * MAX_WARPS];
    unsigned* rl = &race.read_lanes[gi * MAX_WARPS];
    if (g.epoch != cta_epoch) {
      g = Granule{};
      g.epoch = cta_epoch;
      std::fill(rl, rl + race.num_warps, 0u);
    }
    const bool write = kind != Access::READ;
    if (kind == Access::LAND) {  // the issuing thread's own copy, retired by its wait
      g.in_flight = -1;
    } else {
      if (g.in_flight >= 0)
        race_fail(*arr, off, write, g.in_flight, true,
                  g.in_flight == tid ? "its own cp.async to it not waited for" : "by a cp.async still in flight", pc);
      if (g.writer >= 0 && concurrent(g.writer, g.write_block, g.write_warp))
        race_fail(*arr, off, write, g.writer, true, no_barrier(g.writer), pc);
      if (!write && g.writer < 0)
        race_fail(*arr, off, false, -1, false,
                  "before any thread of this CTA wrote it (a barrier missing before the read, or memory never written)",
                  pc);
      if (write && g.read_block == block_now)
        for (unsigned w = 0; w < race.num_warps; ++w) {
          const unsigned others = w == warp ? (rw[w] == warp_now ? rl[w] & ~lane_bit : 0u) : rl[w];
          if (others) race_fail(*arr, off, true, static_cast<int>(w * 32 + __builtin_ctz(others)), false,
                                no_barrier(static_cast<int>(w * 32)), pc);
        }
    }
    if (write) {
      g.writer = tid;
      g.write_block = block_now;
      g.write_warp = warp_now;
      if (kind == Access::ISSUE) g.in_flight = tid;
      g.read_block = UINT_MAX;
      std::fill(rl, rl + race.num_warps, 0u);
    } else {
      if (g.read_block != block_now) {
        g.read_block = block_now;
        std::fill(rl, rl + race.num_warps, 0u);
      }
      if (rl[warp] == 0 || rw[warp] != warp_now) {
        rw[warp] = warp_now;
        rl[warp] = 0;
      }
      rl[warp] |= lane_bit;
    }
  }
}

}  // namespace emu

#if defined(PREFIXKV_EMU_RACE)
// The hooks g++ -fsanitize=thread calls before every load and store (no TSan runtime is linked).
#define EMU_PC __builtin_return_address(0)
extern "C" {
EMU_UNCHECKED void __tsan_init() {}
#define EMU_TSAN_RW(N)                                                                                 \
  EMU_UNCHECKED void __tsan_read##N(void* p) { emu::race_access(p, N, emu::Access::READ, EMU_PC); }            \
  EMU_UNCHECKED void __tsan_write##N(void* p) { emu::race_access(p, N, emu::Access::WRITE, EMU_PC); }          \
  EMU_UNCHECKED void __tsan_unaligned_read##N(void* p) { emu::race_access(p, N, emu::Access::READ, EMU_PC); }  \
  EMU_UNCHECKED void __tsan_unaligned_write##N(void* p) { emu::race_access(p, N, emu::Access::WRITE, EMU_PC); } \
  EMU_UNCHECKED void __tsan_volatile_read##N(void* p) { emu::race_access(p, N, emu::Access::READ, EMU_PC); }   \
  EMU_UNCHECKED void __tsan_volatile_write##N(void* p) { emu::race_access(p, N, emu::Access::WRITE, EMU_PC); }
EMU_TSAN_RW(1)
EMU_TSAN_RW(2)
EMU_TSAN_RW(4)
EMU_TSAN_RW(8)
EMU_TSAN_RW(16)
#undef EMU_TSAN_RW
EMU_UNCHECKED void __tsan_read_range(void* p, unsigned long n) { emu::race_access(p, n, emu::Access::READ, EMU_PC); }
EMU_UNCHECKED void __tsan_write_range(void* p, unsigned long n) { emu::race_access(p, n, emu::Access::WRITE, EMU_PC); }
// (a function-local static's guard; the kernels themselves use no atomics)
EMU_UNCHECKED char __tsan_atomic8_load(const volatile char* a, int) { return __atomic_load_n(a, __ATOMIC_ACQUIRE); }
EMU_UNCHECKED void __tsan_func_entry(void*) {}
EMU_UNCHECKED void __tsan_func_exit() {}
EMU_UNCHECKED void __tsan_vptr_update(void**, void*) {}
EMU_UNCHECKED void __tsan_vptr_read(void**) {}
}
#endif

// Called right after each __shared__ declaration: the first thread of a CTA to get there fills
// the array with NaN bytes (before any thread of the CTA can have written it).
EMU_UNCHECKED inline void emu_poison_shared(void* array, std::size_t bytes, const char* name) {
  unsigned long long& epoch = emu::poisoned[array];
  if (epoch != emu::cta_epoch) {
    std::memset(array, 0xff, bytes);
    epoch = emu::cta_epoch;
    if (emu::race.on) emu::race_register(array, bytes, name);
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
  emu::barrier_wait(emu::cta.warp_bar[threadIdx.x / 32], 32, site, emu::Sync::WARP);
}
inline void __syncthreads(int site = __builtin_LINE()) {
  emu::barrier_wait(emu::cta.block_bar, static_cast<int>(blockDim.x), site, emu::Sync::BLOCK);
}

// cp.async: the source is read at issue (global memory does not change during a kernel); the
// destination reads as NaN until the wait that retires the copy's group.
EMU_UNCHECKED inline void emu_cp_async16(void* smem, const void* gmem, bool valid) {
  emu_check_align(reinterpret_cast<unsigned long long>(smem), 16);
  if (valid) emu_check_align(reinterpret_cast<unsigned long long>(gmem), 16);
  emu::race_access(smem, 16, emu::Access::ISSUE, __builtin_return_address(0));
  emu::PendingCopy c;
  c.dst = static_cast<unsigned char*>(smem);
  if (valid)
    std::memcpy(c.data, gmem, 16);
  else
    std::memset(c.data, 0, 16);
  std::memset(smem, 0xff, 16);
  emu::cta.open[threadIdx.x].push_back(c);
}

EMU_UNCHECKED inline void emu_cp_async_commit() {
  auto& open = emu::cta.open[threadIdx.x];
  emu::cta.groups[threadIdx.x].push_back(std::move(open));
  open.clear();
}

EMU_UNCHECKED inline void emu_cp_async_wait(int n) {
  auto& groups = emu::cta.groups[threadIdx.x];
  while (static_cast<int>(groups.size()) > n) {
    for (auto& c : groups.front()) {
      emu::race_access(c.dst, 16, emu::Access::LAND, __builtin_return_address(0));
      std::memcpy(c.dst, c.data, 16);
    }
    groups.erase(groups.begin());
  }
}
