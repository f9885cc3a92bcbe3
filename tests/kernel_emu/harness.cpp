// The emulated kernels behind a C entry point: emu_launch(name expression, argument pointers, grid,
// block size) runs every CTA of the grid in turn. instances.inc (written by the builder) lists the
// template instantiations to compile, as the CUDA wrapper names them.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "simt_emu.h"

#include "cache_ops.cu"
#include "paged_decode.cu"
#include "paged_prefill.cu"

namespace {

using Launcher = void (*)(void**);
std::map<std::string, Launcher>& registry() {
  static std::map<std::string, Launcher> r;
  return r;
}

std::string normalize(const char* s) {
  std::string out;
  for (; *s; ++s)
    if (*s != ' ') out += *s;
  return out;
}

template <auto Kernel, typename... A, std::size_t... I>
void call_with(void** args, void (*)(A...), std::index_sequence<I...>) {
  Kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <auto Kernel, typename... A>
void register_kernel(const char* name, void (*)(A...)) {
  registry()[normalize(name)] = [](void** args) {
    call_with<Kernel>(args, static_cast<void (*)(A...)>(nullptr), std::index_sequence_for<A...>{});
  };
}

#define EMU_REG(...) register_kernel<&__VA_ARGS__>(#__VA_ARGS__, &__VA_ARGS__)

void register_all() {
#include "instances.inc"
}

}  // namespace

extern "C" const char* emu_last_error() { return emu::last_error.c_str(); }

extern "C" int emu_has_kernel(const char* name) {
  if (registry().empty()) register_all();
  return registry().count(normalize(name)) ? 1 : 0;
}

// The schedule of the launches that follow (see simt_emu.h): order 0 index, 1 reverse, 2 random
// (seeded); interleave: the thread completing a collective yields too.
extern "C" void emu_set_schedule(int order, unsigned long long seed, int interleave) {
  emu::schedule = emu::Schedule{order, seed, interleave != 0};
  emu::rng = seed;
}

// Whether launches check shared memory for races (only in a PREFIXKV_EMU_RACE build).
extern "C" int emu_set_race_check(int on) {
#if defined(PREFIXKV_EMU_RACE)
  emu::race.on = on != 0;
  return 1;
#else
  return on ? 0 : 1;
#endif
}

extern "C" int emu_launch(const char* name, void** args, int grid_x, int grid_y, int grid_z, int block_x) {
  if (registry().empty()) register_all();
  emu::last_error.clear();
  const auto it = registry().find(normalize(name));
  if (it == registry().end()) {
    emu::last_error = std::string("no emulated instance of ") + name;
    return -1;
  }
  if (_setjmp(emu::fail_jb)) {
    emu::cta.current = -1;
    return -1;
  }
  gridDim = EmuDim3{static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y), static_cast<unsigned>(grid_z)};
  blockDim = EmuDim3{static_cast<unsigned>(block_x), 1, 1};
  emu::cta.body = it->second;
  emu::cta.args = args;
  // the CTAs in the schedule's order (index order: x fastest, then y, then z)
  static std::vector<unsigned> order;
  const unsigned num_ctas = static_cast<unsigned>(grid_x) * grid_y * grid_z;
  emu::ordered(order, num_ctas);
  for (const unsigned c : order) {
    blockIdx = EmuDim3{c % grid_x, c / grid_x % grid_y, c / grid_x / grid_y};
    ++emu::cta_epoch;
    emu::run_cta(static_cast<unsigned>(block_x));
  }
  return 0;
}
