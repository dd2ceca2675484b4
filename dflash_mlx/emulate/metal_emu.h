// metal_emu.h: run Metal Shading Language kernel bodies, as mx.fast.metal_kernel
// takes them, as C++17 on the CPU.
//
// Written for dflash-mlx (no code copied from other projects). What it follows:
//  - Apple, "Metal Shading Language Specification" (version 3.2):
//      sec. 2.1-2.2  scalar and vector types (half, bfloat, uint3, float4 ...)
//      sec. 4        address spaces (device, constant, thread, threadgroup)
//      sec. 5.2.3.6  kernel function input attributes (thread_position_in_grid ...)
//      sec. 6.5      math functions (metal::, metal::fast::, metal::precise::)
//      sec. 6.9      threadgroup_barrier / simdgroup_barrier and mem_flags
//      sec. 6.9.2    SIMD-group functions (simd_sum, simd_shuffle_down ...)
//      sec. 6.15     atomic functions (atomic_fetch_min_explicit ...)
//      sec. 2.4 and the SIMD-group matrix functions: simdgroup_matrix 8x8
//                    load / store / multiply_accumulate (section near the end)
//  - MLX (ml-explore/mlx): mlx/fast.cpp `write_signature` builds the kernel
//    signature this header is used with; mlx/backend/metal/custom_kernel.cpp
//    dispatches it with dispatchThreads(grid, min(threadgroup, grid)), so the
//    last threadgroup along an axis may be partial.
//
// Execution model. Threadgroups run one after another on each worker OS thread
// (several workers split the grid). Inside a threadgroup every thread is a
// fiber (ucontext); a fiber runs until it reaches threadgroup_barrier, a
// SIMD-group function or its end. A barrier releases when every thread of the
// group waits at it; a SIMD-group function resolves when every still-running
// lane of its 32-lane SIMD-group waits at it (lanes that returned are inactive,
// as on the GPU). Lanes of one SIMD-group that wait at different SIMD-group
// functions are resolved as separate active sets, like divergent SIMT code.
// Between synchronisation points fibers run in a chosen order (forward,
// reverse, or shuffled per round), so a missing barrier shows up as a wrong
// answer. Errors (a barrier some threads skipped, deadlock, too much
// threadgroup memory) abort the launch with a message.
//
// What it cannot show: Metal compile rules, speed, memory-model subtleties
// beyond barrier placement, and lockstep-only behaviour of real SIMD-groups.
// Deliberate simplifications are marked "EMU:".
#pragma once

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>

namespace emu {

// ---------------------------------------------------------------- half, bfloat
// IEEE binary16 and bfloat16 stored as 16 bits; conversions round to nearest
// even (as Metal and MLX do).

inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mant = x & 0x007FFFFFu;
  int32_t exp = int32_t((x >> 23) & 0xFFu);
  if (exp == 0xFF) return uint16_t(sign | 0x7C00u | (mant ? (0x200u | (mant >> 13)) : 0u));
  int32_t e = exp - 127 + 15;
  if (e >= 0x1F) return uint16_t(sign | 0x7C00u);
  if (e <= 0) {
    if (e < -10) return uint16_t(sign);
    mant |= 0x00800000u;
    uint32_t shift = uint32_t(14 - e);
    uint32_t h = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (h & 1u))) h++;
    return uint16_t(sign | h);
  }
  uint32_t h = sign | (uint32_t(e) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return uint16_t(h);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x3FFu;
  float f;
  if (e == 0) {
    f = std::ldexp(float(m), -24);
    uint32_t x;
    std::memcpy(&x, &f, 4);
    x |= sign;
    std::memcpy(&f, &x, 4);
    return f;
  }
  uint32_t x = (e == 31) ? (sign | 0x7F800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
  std::memcpy(&f, &x, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x40u);
  x += 0x7FFFu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

inline float bf16_to_f32(uint16_t b) {
  uint32_t x = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

template <int KIND>  // 0: half, 1: bfloat
struct sfloat {
  uint16_t bits;
  sfloat() = default;
  sfloat(float f) : bits(KIND == 0 ? f32_to_f16(f) : f32_to_bf16(f)) {}
  sfloat(double d) : sfloat(float(d)) {}
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
  sfloat(I i) : sfloat(float(i)) {}
  template <int K2>
  explicit sfloat(sfloat<K2> o) : sfloat(float(o)) {}
  operator float() const { return KIND == 0 ? f16_to_f32(bits) : bf16_to_f32(bits); }
};

// Same-type arithmetic stays in the type (rounded once, as native half does);
// mixed with float it is float; with an integer it stays in the type.
#define EMU_SF_BINOP(op)                                                                   \
  template <int K>                                                                         \
  inline sfloat<K> operator op(sfloat<K> a, sfloat<K> b) { return sfloat<K>(float(a) op float(b)); } \
  template <int K>                                                                         \
  inline float operator op(sfloat<K> a, float b) { return float(a) op b; }                 \
  template <int K>                                                                         \
  inline float operator op(float a, sfloat<K> b) { return a op float(b); }                 \
  template <int K, class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>         \
  inline sfloat<K> operator op(sfloat<K> a, I b) { return sfloat<K>(float(a) op float(b)); } \
  template <int K, class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>         \
  inline sfloat<K> operator op(I a, sfloat<K> b) { return sfloat<K>(float(a) op float(b)); }
EMU_SF_BINOP(+)
EMU_SF_BINOP(-)
EMU_SF_BINOP(*)
EMU_SF_BINOP(/)
#undef EMU_SF_BINOP

#define EMU_SF_CMP(op)                                                                     \
  template <int K>                                                                         \
  inline bool operator op(sfloat<K> a, sfloat<K> b) { return float(a) op float(b); }       \
  template <int K>                                                                         \
  inline bool operator op(sfloat<K> a, float b) { return float(a) op b; }                  \
  template <int K>                                                                         \
  inline bool operator op(float a, sfloat<K> b) { return a op float(b); }                  \
  template <int K, class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>         \
  inline bool operator op(sfloat<K> a, I b) { return float(a) op float(b); }               \
  template <int K, class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>         \
  inline bool operator op(I a, sfloat<K> b) { return float(a) op float(b); }
EMU_SF_CMP(<)
EMU_SF_CMP(>)
EMU_SF_CMP(<=)
EMU_SF_CMP(>=)
EMU_SF_CMP(==)
EMU_SF_CMP(!=)
#undef EMU_SF_CMP

#define EMU_SF_ASSIGN(op, bop)                                                             \
  template <int K, class U>                                                                \
  inline sfloat<K>& operator op(sfloat<K>& a, U b) {                                       \
    a = sfloat<K>(float(a) bop float(b));                                                  \
    return a;                                                                              \
  }
EMU_SF_ASSIGN(+=, +)
EMU_SF_ASSIGN(-=, -)
EMU_SF_ASSIGN(*=, *)
EMU_SF_ASSIGN(/=, /)
#undef EMU_SF_ASSIGN

template <int K>
inline sfloat<K> operator-(sfloat<K> a) {
  sfloat<K> r;
  r.bits = uint16_t(a.bits ^ 0x8000u);
  return r;
}
template <int K>
inline sfloat<K> operator+(sfloat<K> a) { return a; }

// ---------------------------------------------------------------- vectors
template <class T>
struct same { using type = T; };

template <class T, int N>
struct vec;

#define EMU_VEC_COMMON(N)                                                                  \
  T& operator[](int i) { return (&x)[i]; }                                                 \
  const T& operator[](int i) const { return (&x)[i]; }

template <class T>
struct vec<T, 2> {
  T x, y;
  vec() = default;
  vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  template <class U>
  explicit vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  EMU_VEC_COMMON(2)
};
template <class T>
struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  template <class U>
  explicit vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  EMU_VEC_COMMON(3)
};
template <class T>
struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  template <class U>
  explicit vec(const vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  EMU_VEC_COMMON(4)
};
#undef EMU_VEC_COMMON

#define EMU_VEC_BINOP(op)                                                                  \
  template <class T, int N>                                                                \
  inline vec<T, N> operator op(vec<T, N> a, vec<T, N> b) {                                 \
    vec<T, N> r;                                                                           \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] op b[i]);                                    \
    return r;                                                                              \
  }                                                                                        \
  template <class T, int N>                                                                \
  inline vec<T, N> operator op(vec<T, N> a, typename same<T>::type s) {                    \
    vec<T, N> r;                                                                           \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] op s);                                       \
    return r;                                                                              \
  }                                                                                        \
  template <class T, int N>                                                                \
  inline vec<T, N> operator op(typename same<T>::type s, vec<T, N> a) {                    \
    vec<T, N> r;                                                                           \
    for (int i = 0; i < N; ++i) r[i] = T(s op a[i]);                                       \
    return r;                                                                              \
  }                                                                                        \
  template <class T, int N, class U>                                                       \
  inline vec<T, N>& operator op##=(vec<T, N>& a, U b) {                                    \
    a = a op b;                                                                            \
    return a;                                                                              \
  }
EMU_VEC_BINOP(+)
EMU_VEC_BINOP(-)
EMU_VEC_BINOP(*)
EMU_VEC_BINOP(/)
#undef EMU_VEC_BINOP

template <class T, int N>
inline vec<T, N> operator-(vec<T, N> a) {
  for (int i = 0; i < N; ++i) a[i] = T(-a[i]);
  return a;
}

// ---------------------------------------------------------------- runtime
enum State { READY = 0, AT_BARRIER = 1, AT_SIMD = 2, DONE = 3 };
enum Order { FORWARD = 0, REVERSE = 1, SHUFFLE = 2, SIMDGROUP = 3 };
// SIMDGROUP: the SIMD-groups of a threadgroup take turns (in a shuffled order
// each round), and each runs as far as it can alone: its SIMD-group functions
// and matrix operations resolve at once, so it stops only at a threadgroup
// barrier or its end. Without it every SIMD-group reaches its next SIMD-group
// function before any resolves, which hides a missing threadgroup barrier
// between SIMD-groups that exchange data through threadgroup memory.
constexpr int SIMD_WIDTH = 32;
constexpr size_t SLOT = 64;               // bytes per lane operand of a SIMD-group function
constexpr size_t TG_MEMORY_LIMIT = 32768;  // Apple GPUs: 32 KiB threadgroup memory
constexpr size_t MAX_THREADS = 1024;       // maxTotalThreadsPerThreadgroup of MLX kernels

struct Group;
using Resolver = void (*)(Group&, const int* lanes, int count);

struct Lane {
  alignas(16) unsigned char in[SLOT];
  alignas(16) unsigned char out[SLOT];
  int arg;
  Resolver resolve;
};

struct Attrs;

struct Group {
  int n = 0;  // threads in this threadgroup
  std::vector<ucontext_t> ctx;
  std::vector<int> state;
  std::vector<Lane> lane;
  ucontext_t sched;
  int cur = -1;
  std::vector<std::pair<int, void*>> tg_mem;
  size_t tg_bytes = 0;
  std::string err;
  char* stacks = nullptr;
  size_t stack_size = 0;
  size_t stack_count = 0;
  const std::function<void(int)>* body = nullptr;
  ~Group() {
    free_tg();
    if (stacks) munmap(stacks, stack_size * stack_count);
  }
  void free_tg() {
    for (auto& p : tg_mem) std::free(p.second);
    tg_mem.clear();
    tg_bytes = 0;
  }
};

// The runtime (scheduler, launch) is compiled once into its own shared object
// (this header with EMU_RUNTIME_IMPL defined); kernels link against it.
extern thread_local Group* g_cur;
[[noreturn]] void fail(const std::string& msg);
void barrier();
struct Attrs;
int launch(const long long* grid, const long long* tgroup, int order, unsigned long long seed,
           int workers, char* err, int errlen, const std::function<void(const Attrs&)>& thread_fn);

// threadgroup memory: the harness rewrites `threadgroup T name[N];` in a kernel
// body to `auto& name = ::emu::tg_alloc<T[N]>(id);`. One allocation per
// declaration and threadgroup, shared by its threads, filled with 0xFF bytes
// (NaN for floats) so that reading memory no thread wrote shows.
template <class A>
inline A& tg_alloc(int id) {
  Group& g = *g_cur;
  for (auto& p : g.tg_mem)
    if (p.first == id) return *reinterpret_cast<A*>(p.second);
  size_t bytes = (sizeof(A) + 63) / 64 * 64;
  g.tg_bytes += sizeof(A);
  if (g.tg_bytes > TG_MEMORY_LIMIT)
    fail("threadgroup memory of " + std::to_string(g.tg_bytes) + " bytes exceeds 32 KiB");
  void* mem = std::aligned_alloc(64, bytes);
  std::memset(mem, 0xFF, bytes);
  g.tg_mem.push_back({id, mem});
  return *reinterpret_cast<A*>(mem);
}

enum Op {
  OP_SUM, OP_PRODUCT, OP_MAX, OP_MIN, OP_AND, OP_OR, OP_XOR,
  OP_SHUFFLE, OP_SHUFFLE_DOWN, OP_SHUFFLE_UP, OP_SHUFFLE_XOR,
  OP_ROTATE_DOWN, OP_ROTATE_UP, OP_BROADCAST, OP_BROADCAST_FIRST,
  OP_PREFIX_EXCL_SUM, OP_PREFIX_INCL_SUM, OP_PREFIX_EXCL_PRODUCT, OP_PREFIX_INCL_PRODUCT,
  OP_ALL, OP_ANY, OP_IS_FIRST, OP_SIMD_BARRIER
};

template <class T>
inline T poison() {
  T t;
  std::memset(static_cast<void*>(&t), 0xFF, sizeof(T));
  return t;
}

// Resolve one active set of a SIMD-group: `lanes` are thread indices in the
// threadgroup, all in the same SIMD-group, ascending.
template <class T, int OP>
void resolve(Group& g, const int* lanes, int count) {
  const int base = lanes[0] / SIMD_WIDTH * SIMD_WIDTH;
  T in[SIMD_WIDTH];
  bool active[SIMD_WIDTH] = {};
  for (int k = 0; k < count; ++k) {
    std::memcpy(static_cast<void*>(&in[lanes[k] - base]), g.lane[lanes[k]].in, sizeof(T));
    active[lanes[k] - base] = true;
  }
  const int first = lanes[0] - base;
  auto from = [&](int src, T own) -> T {
    (void)own;
    if (src < 0 || src >= SIMD_WIDTH || !active[src]) return poison<T>();
    return in[src];
  };
  for (int k = 0; k < count; ++k) {
    const int l = lanes[k] - base;
    const int arg = g.lane[lanes[k]].arg;
    T r = in[l];
    if constexpr (OP == OP_SUM || OP == OP_PRODUCT || OP == OP_MAX || OP == OP_MIN ||
                  OP == OP_AND || OP == OP_OR || OP == OP_XOR) {
      r = in[first];
      for (int s = first + 1; s < SIMD_WIDTH; ++s) {
        if (!active[s]) continue;
        if constexpr (OP == OP_SUM) r = T(r + in[s]);
        if constexpr (OP == OP_PRODUCT) r = T(r * in[s]);
        if constexpr (OP == OP_MAX) r = in[s] > r ? in[s] : r;
        if constexpr (OP == OP_MIN) r = in[s] < r ? in[s] : r;
        if constexpr (OP == OP_AND) r = T(r & in[s]);
        if constexpr (OP == OP_OR) r = T(r | in[s]);
        if constexpr (OP == OP_XOR) r = T(r ^ in[s]);
      }
    } else if constexpr (OP == OP_SHUFFLE || OP == OP_BROADCAST) {
      r = from(arg, in[l]);
    } else if constexpr (OP == OP_SHUFFLE_DOWN) {
      // MSL: the upper `delta` lanes keep their own value (no wrap-around)
      r = (l + arg < SIMD_WIDTH) ? from(l + arg, in[l]) : in[l];
    } else if constexpr (OP == OP_SHUFFLE_UP) {
      r = (l - arg >= 0) ? from(l - arg, in[l]) : in[l];
    } else if constexpr (OP == OP_SHUFFLE_XOR) {
      r = from(l ^ arg, in[l]);
    } else if constexpr (OP == OP_ROTATE_DOWN) {
      r = from((l + arg) % SIMD_WIDTH, in[l]);
    } else if constexpr (OP == OP_ROTATE_UP) {
      r = from(((l - arg) % SIMD_WIDTH + SIMD_WIDTH) % SIMD_WIDTH, in[l]);
    } else if constexpr (OP == OP_BROADCAST_FIRST) {
      r = in[first];
    } else if constexpr (OP == OP_PREFIX_EXCL_SUM || OP == OP_PREFIX_INCL_SUM) {
      r = T(0);
      for (int s = 0; s < l + (OP == OP_PREFIX_INCL_SUM ? 1 : 0); ++s)
        if (active[s]) r = T(r + in[s]);
    } else if constexpr (OP == OP_PREFIX_EXCL_PRODUCT || OP == OP_PREFIX_INCL_PRODUCT) {
      r = T(1);
      for (int s = 0; s < l + (OP == OP_PREFIX_INCL_PRODUCT ? 1 : 0); ++s)
        if (active[s]) r = T(r * in[s]);
    } else if constexpr (OP == OP_ALL || OP == OP_ANY) {
      bool acc = OP == OP_ALL;
      for (int s = 0; s < SIMD_WIDTH; ++s) {
        if (!active[s]) continue;
        if (OP == OP_ALL) acc = acc && bool(in[s]);
        else acc = acc || bool(in[s]);
      }
      r = T(acc);
    } else if constexpr (OP == OP_IS_FIRST) {
      r = T(l == first);
    }
    std::memcpy(g.lane[lanes[k]].out, static_cast<const void*>(&r), sizeof(T));
  }
}

template <class T, int OP>
inline T collective(T x, int arg) {
  static_assert(sizeof(T) <= SLOT, "SIMD-group operand too large");
  Group& g = *g_cur;
  const int i = g.cur;
  Lane& L = g.lane[i];
  std::memcpy(L.in, static_cast<const void*>(&x), sizeof(T));
  L.arg = arg;
  L.resolve = &resolve<T, OP>;
  g.state[i] = AT_SIMD;
  swapcontext(&g.ctx[i], &g.sched);
  T r;
  std::memcpy(static_cast<void*>(&r), g_cur->lane[i].out, sizeof(T));
  return r;
}

// ---------------------------------------------------------------- attributes
template <class T>
using v3 = vec<T, 3>;

struct Attrs {
  v3<unsigned> thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  v3<unsigned> threads_per_threadgroup, dispatch_threads_per_threadgroup, threads_per_grid;
  v3<unsigned> threadgroups_per_grid, grid_origin, grid_size;
  unsigned thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  unsigned simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup;
  unsigned thread_index_in_quadgroup, quadgroup_index_in_threadgroup, quadgroups_per_threadgroup;
  unsigned dispatch_quadgroups_per_threadgroup, thread_execution_width, threads_per_simdgroup;
};


#ifdef EMU_RUNTIME_IMPL
}  // namespace emu
#include <atomic>
#include <random>
#include <thread>
namespace emu {

thread_local Group* g_cur = nullptr;

void fail(const std::string& msg) {
  Group& g = *g_cur;
  if (g.err.empty()) g.err = msg;
  // park this fiber for good; the scheduler sees the error and stops
  g.state[g.cur] = AT_BARRIER;
  swapcontext(&g.ctx[g.cur], &g.sched);
  std::abort();  // never resumed
}

void barrier() {
  Group& g = *g_cur;
  g.state[g.cur] = AT_BARRIER;
  swapcontext(&g.ctx[g.cur], &g.sched);
}

inline void fiber_entry(int i) {
  Group& g = *g_cur;
  (*g.body)(i);
  g.state[i] = DONE;
  // returning resumes g.sched through uc_link
}

inline std::string describe(const Group& g) {
  int c[4] = {0, 0, 0, 0};
  for (int s : g.state) c[s]++;
  return std::to_string(c[AT_BARRIER]) + " at threadgroup_barrier, " + std::to_string(c[AT_SIMD]) +
         " at a SIMD-group function, " + std::to_string(c[DONE]) + " finished, of " +
         std::to_string(g.n) + " threads";
}

// Run one threadgroup of n threads to completion; false (and g.err) on error.
inline bool run_group(Group& g, int n, int order, std::mt19937_64& rng) {
  g.n = n;
  g.err.clear();
  g.free_tg();
  g.state.assign(n, READY);
  for (int i = 0; i < n; ++i) {
    getcontext(&g.ctx[i]);
    g.ctx[i].uc_stack.ss_sp = g.stacks + size_t(i) * g.stack_size;
    g.ctx[i].uc_stack.ss_size = g.stack_size;
    g.ctx[i].uc_link = &g.sched;
    makecontext(&g.ctx[i], reinterpret_cast<void (*)()>(&fiber_entry), 1, i);
  }
  std::vector<int> runnable;
  std::vector<int> lanes;
  lanes.reserve(SIMD_WIDTH);
  std::vector<int> simd_order;
  while (true) {
    if (order == SIMDGROUP) {
      simd_order.clear();
      for (int base = 0; base < n; base += SIMD_WIDTH) simd_order.push_back(base);
      std::shuffle(simd_order.begin(), simd_order.end(), rng);
      for (int base : simd_order) {
        const int end = std::min(n, base + SIMD_WIDTH);
        while (true) {
          runnable.clear();
          for (int i = base; i < end; ++i)
            if (g.state[i] == READY) runnable.push_back(i);
          std::shuffle(runnable.begin(), runnable.end(), rng);
          for (int i : runnable) {
            g.cur = i;
            swapcontext(&g.sched, &g.ctx[i]);
            if (!g.err.empty()) return false;
          }
          // resolve this SIMD-group's functions if all its running lanes wait at one
          bool any = false, all = true;
          for (int i = base; i < end; ++i) {
            if (g.state[i] == DONE) continue;
            any = true;
            all = all && g.state[i] == AT_SIMD;
          }
          if (!any || !all) break;
          std::vector<bool> taken(SIMD_WIDTH, false);
          for (int i = base; i < end; ++i) {
            if (g.state[i] != AT_SIMD || taken[i - base]) continue;
            lanes.clear();
            for (int j = i; j < end; ++j)
              if (g.state[j] == AT_SIMD && !taken[j - base] && g.lane[j].resolve == g.lane[i].resolve) {
                lanes.push_back(j);
                taken[j - base] = true;
              }
            g.lane[i].resolve(g, lanes.data(), int(lanes.size()));
            for (int j : lanes) g.state[j] = READY;
          }
        }
      }
    }
    runnable.clear();
    for (int i = 0; i < n; ++i)
      if (g.state[i] == READY) runnable.push_back(i);
    if (order == REVERSE) std::reverse(runnable.begin(), runnable.end());
    if (order == SHUFFLE) std::shuffle(runnable.begin(), runnable.end(), rng);
    for (int i : runnable) {
      g.cur = i;
      swapcontext(&g.sched, &g.ctx[i]);
      if (!g.err.empty()) return false;
    }
    bool all_done = true;
    for (int s : g.state) all_done = all_done && s == DONE;
    if (all_done) return true;
    bool progressed = false;
    // SIMD-group functions whose whole SIMD-group (its running lanes) waits
    for (int base = 0; base < n; base += SIMD_WIDTH) {
      const int end = std::min(n, base + SIMD_WIDTH);
      bool any = false, all = true;
      for (int i = base; i < end; ++i) {
        if (g.state[i] == DONE) continue;
        any = true;
        all = all && g.state[i] == AT_SIMD;
      }
      if (!any || !all) continue;
      // group lanes by the function they wait at
      std::vector<bool> taken(SIMD_WIDTH, false);
      for (int i = base; i < end; ++i) {
        if (g.state[i] != AT_SIMD || taken[i - base]) continue;
        lanes.clear();
        for (int j = i; j < end; ++j)
          if (g.state[j] == AT_SIMD && !taken[j - base] && g.lane[j].resolve == g.lane[i].resolve) {
            lanes.push_back(j);
            taken[j - base] = true;
          }
        g.lane[i].resolve(g, lanes.data(), int(lanes.size()));
        for (int j : lanes) g.state[j] = READY;
      }
      progressed = true;
    }
    if (progressed) continue;
    // a barrier every thread reached
    int at_barrier = 0, done = 0, at_simd = 0;
    for (int s : g.state) {
      at_barrier += s == AT_BARRIER;
      done += s == DONE;
      at_simd += s == AT_SIMD;
    }
    if (at_barrier > 0 && at_simd == 0) {
      if (done > 0) {
        g.err = "threadgroup_barrier reached by " + std::to_string(at_barrier) + " of " +
                std::to_string(n) + " threads (" + std::to_string(done) +
                " returned before it); undefined on Metal";
        return false;
      }
      for (int& s : g.state) s = READY;
      continue;
    }
    // divergent lanes: resolve the lanes waiting at a SIMD-group function as
    // the active set while their siblings wait elsewhere (SIMT divergence)
    for (int base = 0; base < n && !progressed; base += SIMD_WIDTH) {
      const int end = std::min(n, base + SIMD_WIDTH);
      for (int i = base; i < end; ++i) {
        if (g.state[i] != AT_SIMD) continue;
        lanes.clear();
        for (int j = i; j < end; ++j)
          if (g.state[j] == AT_SIMD && g.lane[j].resolve == g.lane[i].resolve) lanes.push_back(j);
        g.lane[i].resolve(g, lanes.data(), int(lanes.size()));
        for (int j : lanes) g.state[j] = READY;
        progressed = true;
        break;
      }
    }
    if (progressed) continue;
    g.err = "deadlock: " + describe(g);
    return false;
  }
}

inline size_t stack_bytes() {
  const char* env = std::getenv("DFLASH_MLX_EMULATE_STACK_KB");
  size_t kb = env ? size_t(std::atoll(env)) : 128;
  return std::max<size_t>(kb, 16) * 1024;
}

// Run a whole grid as mx.fast.metal_kernel would dispatch it.
int launch(const long long* grid, const long long* tgroup, int order, unsigned long long seed,
                  int workers, char* err, int errlen, const std::function<void(const Attrs&)>& thread_fn) {
  unsigned gd[3], td[3], ng[3];
  for (int d = 0; d < 3; ++d) {
    if (grid[d] <= 0 || tgroup[d] <= 0) {
      std::snprintf(err, size_t(errlen), "grid and threadgroup sizes must be positive");
      return 1;
    }
    gd[d] = unsigned(grid[d]);
    td[d] = unsigned(std::min(tgroup[d], grid[d]));  // as MLX: min(threadgroup, grid)
    ng[d] = (gd[d] + td[d] - 1) / td[d];
  }
  const size_t tg_total = size_t(td[0]) * td[1] * td[2];
  if (tg_total > MAX_THREADS) {
    std::snprintf(err, size_t(errlen), "threadgroup of %zu threads exceeds %zu", tg_total, MAX_THREADS);
    return 1;
  }
  const size_t n_groups = size_t(ng[0]) * ng[1] * ng[2];
  workers = std::max(1, std::min<int>(workers, int(n_groups)));
  std::vector<std::string> errors(static_cast<size_t>(workers));
  std::atomic<bool> stop{false};
  auto work = [&](int w) {
    Group g;
    g.stack_size = stack_bytes();
    g.stack_count = tg_total;
    void* mem = mmap(nullptr, g.stack_size * g.stack_count, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
      errors[size_t(w)] = "cannot map fiber stacks";
      stop = true;
      return;
    }
    g.stacks = static_cast<char*>(mem);
    g.ctx.resize(tg_total);
    g.lane.resize(tg_total);
    g_cur = &g;
    for (size_t gi = size_t(w); gi < n_groups && !stop; gi += size_t(workers)) {
      const unsigned bx = unsigned(gi % ng[0]);
      const unsigned by = unsigned(gi / ng[0] % ng[1]);
      const unsigned bz = unsigned(gi / (size_t(ng[0]) * ng[1]));
      // EMU: a partial edge threadgroup has fewer threads; threads_per_threadgroup
      // is its actual size and linear indices count within that size.
      const unsigned ax = std::min(td[0], gd[0] - bx * td[0]);
      const unsigned ay = std::min(td[1], gd[1] - by * td[1]);
      const unsigned az = std::min(td[2], gd[2] - bz * td[2]);
      const int n = int(ax * ay * az);
      const unsigned n_simd = (unsigned(n) + SIMD_WIDTH - 1) / SIMD_WIDTH;
      const unsigned d_simd = unsigned((tg_total + SIMD_WIDTH - 1) / SIMD_WIDTH);
      std::function<void(int)> body = [&](int i) {
        Attrs a;
        const unsigned lx = unsigned(i) % ax, ly = unsigned(i) / ax % ay, lz = unsigned(i) / (ax * ay);
        a.thread_position_in_threadgroup = v3<unsigned>(lx, ly, lz);
        a.threadgroup_position_in_grid = v3<unsigned>(bx, by, bz);
        a.thread_position_in_grid = v3<unsigned>(bx * td[0] + lx, by * td[1] + ly, bz * td[2] + lz);
        a.threads_per_threadgroup = v3<unsigned>(ax, ay, az);
        a.dispatch_threads_per_threadgroup = v3<unsigned>(td[0], td[1], td[2]);
        a.threads_per_grid = v3<unsigned>(gd[0], gd[1], gd[2]);
        a.grid_size = a.threads_per_grid;
        a.grid_origin = v3<unsigned>(0u, 0u, 0u);
        a.threadgroups_per_grid = v3<unsigned>(ng[0], ng[1], ng[2]);
        a.thread_index_in_threadgroup = unsigned(i);
        a.thread_index_in_simdgroup = unsigned(i) % SIMD_WIDTH;
        a.simdgroup_index_in_threadgroup = unsigned(i) / SIMD_WIDTH;
        a.simdgroups_per_threadgroup = n_simd;
        a.dispatch_simdgroups_per_threadgroup = d_simd;
        a.thread_index_in_quadgroup = unsigned(i) % 4;
        a.quadgroup_index_in_threadgroup = unsigned(i) / 4;
        a.quadgroups_per_threadgroup = (unsigned(n) + 3) / 4;
        a.dispatch_quadgroups_per_threadgroup = unsigned((tg_total + 3) / 4);
        a.thread_execution_width = SIMD_WIDTH;
        a.threads_per_simdgroup = SIMD_WIDTH;
        thread_fn(a);
      };
      g.body = &body;
      std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + gi);
      if (!run_group(g, n, order, rng)) {
        errors[size_t(w)] = "threadgroup (" + std::to_string(bx) + ", " + std::to_string(by) + ", " +
                            std::to_string(bz) + "): " + g.err;
        stop = true;
        break;
      }
    }
    g_cur = nullptr;
  };
  if (workers == 1) {
    work(0);
  } else {
    std::vector<std::thread> pool;
    for (int w = 0; w < workers; ++w) pool.emplace_back(work, w);
    for (auto& t : pool) t.join();
  }
  for (auto& e : errors) {
    if (!e.empty()) {
      std::snprintf(err, size_t(errlen), "%s", e.c_str());
      return 2;
    }
  }
  return 0;
}

#endif  // EMU_RUNTIME_IMPL

}  // namespace emu

// ================================================================ Metal names
namespace metal {

using half = emu::sfloat<0>;
using bfloat = emu::sfloat<1>;

#define EMU_VEC_TYPES(T, name)     \
  using name##2 = emu::vec<T, 2>; \
  using name##3 = emu::vec<T, 3>; \
  using name##4 = emu::vec<T, 4>;
EMU_VEC_TYPES(float, float)
EMU_VEC_TYPES(half, half)
EMU_VEC_TYPES(bfloat, bfloat)
EMU_VEC_TYPES(int, int)
EMU_VEC_TYPES(unsigned int, uint)
EMU_VEC_TYPES(short, short)
EMU_VEC_TYPES(unsigned short, ushort)
EMU_VEC_TYPES(signed char, char)
EMU_VEC_TYPES(unsigned char, uchar)
EMU_VEC_TYPES(bool, bool)
EMU_VEC_TYPES(long, long)
EMU_VEC_TYPES(unsigned long, ulong)
#undef EMU_VEC_TYPES

// ---- math (sec. 6.5): float in, float out; half/bfloat through float; vectors elementwise
#define EMU_UNARY(name, expr)                                                    \
  inline float name(float x) { return expr; }                                    \
  inline half name(half x) { return half(name(float(x))); }                      \
  inline bfloat name(bfloat x) { return bfloat(name(float(x))); }                \
  template <class T, int N>                                                      \
  inline emu::vec<T, N> name(emu::vec<T, N> v) {                                 \
    for (int i = 0; i < N; ++i) v[i] = name(v[i]);                               \
    return v;                                                                    \
  }
EMU_UNARY(exp, std::exp(x))
EMU_UNARY(exp2, std::exp2(x))
EMU_UNARY(exp10, std::pow(10.0f, x))
EMU_UNARY(log, std::log(x))
EMU_UNARY(log2, std::log2(x))
EMU_UNARY(log10, std::log10(x))
EMU_UNARY(sqrt, std::sqrt(x))
EMU_UNARY(rsqrt, 1.0f / std::sqrt(x))
EMU_UNARY(sin, std::sin(x))
EMU_UNARY(cos, std::cos(x))
EMU_UNARY(tan, std::tan(x))
EMU_UNARY(asin, std::asin(x))
EMU_UNARY(acos, std::acos(x))
EMU_UNARY(atan, std::atan(x))
EMU_UNARY(sinh, std::sinh(x))
EMU_UNARY(cosh, std::cosh(x))
EMU_UNARY(tanh, std::tanh(x))
EMU_UNARY(floor, std::floor(x))
EMU_UNARY(ceil, std::ceil(x))
EMU_UNARY(round, std::round(x))
EMU_UNARY(rint, std::nearbyint(x))
EMU_UNARY(trunc, std::trunc(x))
EMU_UNARY(fabs, std::fabs(x))
EMU_UNARY(fract, x - std::floor(x))
#undef EMU_UNARY

template <class T>
inline T abs(T x) { return x < T(0) ? T(-x) : x; }
template <class T>
inline T max(T a, T b) { return a < b ? b : a; }
template <class T>
inline T min(T a, T b) { return b < a ? b : a; }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
inline float pow(float a, float b) { return std::pow(a, b); }
inline float powr(float a, float b) { return std::pow(a, b); }
inline float fmod(float a, float b) { return std::fmod(a, b); }
inline float copysign(float a, float b) { return std::copysign(a, b); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float atan2(float a, float b) { return std::atan2(a, b); }
template <class T>
inline T mix(T a, T b, T t) { return a + (b - a) * t; }
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T>
inline T sign(T x) { return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0)); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
inline bool signbit(float x) { return std::signbit(x); }
template <class T, int N>
inline T dot(emu::vec<T, N> a, emu::vec<T, N> b) {
  T r = T(0);
  for (int i = 0; i < N; ++i) r = T(r + a[i] * b[i]);
  return r;
}

namespace fast { using namespace ::metal; }
namespace precise { using namespace ::metal; }

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
#define EMU_SF_LIMITS(T, maxbits, lowbits, minbits, epsbits, infbits, nanbits) \
  template <>                                                                 \
  struct numeric_limits<T> {                                                   \
    static constexpr bool is_specialized = true;                               \
    static T make(uint16_t b) { T t; t.bits = b; return t; }                   \
    static T max() { return make(maxbits); }                                   \
    static T lowest() { return make(lowbits); }                                \
    static T min() { return make(minbits); }                                   \
    static T epsilon() { return make(epsbits); }                               \
    static T infinity() { return make(infbits); }                              \
    static T quiet_NaN() { return make(nanbits); }                             \
  };
EMU_SF_LIMITS(half, 0x7BFF, 0xFBFF, 0x0400, 0x1400, 0x7C00, 0x7E00)
EMU_SF_LIMITS(bfloat, 0x7F7F, 0xFF7F, 0x0080, 0x3C00, 0x7F80, 0x7FC0)
#undef EMU_SF_LIMITS

template <class T, class U>
inline T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of the same size");
  T t;
  std::memcpy(static_cast<void*>(&t), static_cast<const void*>(&u), sizeof(T));
  return t;
}

// ---- synchronisation (sec. 6.9)
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
inline void threadgroup_barrier(mem_flags) { emu::barrier(); }
inline void simdgroup_barrier(mem_flags) { emu::collective<int, emu::OP_SIMD_BARRIER>(0, 0); }

// ---- SIMD-group functions (sec. 6.9.2)
template <class T>
struct no_bool { static_assert(!std::is_same<T, bool>::value, "Metal cannot shuffle or broadcast bool"); };
#define EMU_SIMD_REDUCE(name, op) \
  template <class T>              \
  inline T name(T x) { return emu::collective<T, emu::op>(x, 0); }
EMU_SIMD_REDUCE(simd_sum, OP_SUM)
EMU_SIMD_REDUCE(simd_product, OP_PRODUCT)
EMU_SIMD_REDUCE(simd_max, OP_MAX)
EMU_SIMD_REDUCE(simd_min, OP_MIN)
EMU_SIMD_REDUCE(simd_and, OP_AND)
EMU_SIMD_REDUCE(simd_or, OP_OR)
EMU_SIMD_REDUCE(simd_xor, OP_XOR)
EMU_SIMD_REDUCE(simd_prefix_exclusive_sum, OP_PREFIX_EXCL_SUM)
EMU_SIMD_REDUCE(simd_prefix_inclusive_sum, OP_PREFIX_INCL_SUM)
EMU_SIMD_REDUCE(simd_prefix_exclusive_product, OP_PREFIX_EXCL_PRODUCT)
EMU_SIMD_REDUCE(simd_prefix_inclusive_product, OP_PREFIX_INCL_PRODUCT)
#undef EMU_SIMD_REDUCE
#define EMU_SIMD_MOVE(name, op)                                           \
  template <class T>                                                      \
  inline T name(T x, unsigned short arg) {                                \
    (void)no_bool<T>{};                                                   \
    return emu::collective<T, emu::op>(x, int(arg));                      \
  }
EMU_SIMD_MOVE(simd_shuffle, OP_SHUFFLE)
EMU_SIMD_MOVE(simd_shuffle_down, OP_SHUFFLE_DOWN)
EMU_SIMD_MOVE(simd_shuffle_up, OP_SHUFFLE_UP)
EMU_SIMD_MOVE(simd_shuffle_xor, OP_SHUFFLE_XOR)
EMU_SIMD_MOVE(simd_shuffle_rotate_down, OP_ROTATE_DOWN)
EMU_SIMD_MOVE(simd_shuffle_rotate_up, OP_ROTATE_UP)
EMU_SIMD_MOVE(simd_broadcast, OP_BROADCAST)
#undef EMU_SIMD_MOVE
template <class T>
inline T simd_broadcast_first(T x) {
  (void)no_bool<T>{};
  return emu::collective<T, emu::OP_BROADCAST_FIRST>(x, 0);
}
inline bool simd_all(bool x) { return emu::collective<bool, emu::OP_ALL>(x, 0); }
inline bool simd_any(bool x) { return emu::collective<bool, emu::OP_ANY>(x, 0); }
inline bool simd_is_first() { return emu::collective<bool, emu::OP_IS_FIRST>(true, 0); }

// ---- atomics (sec. 6.15): relaxed order only, as Metal supports
enum memory_order { memory_order_relaxed = 0 };
template <class T>
struct atomic {
  T v;
};
using atomic_int = atomic<int>;
using atomic_uint = atomic<unsigned int>;
using atomic_float = atomic<float>;
template <class T>
inline void atomic_store_explicit(atomic<T>* o, T x, memory_order) { __atomic_store(&o->v, &x, __ATOMIC_RELAXED); }
template <class T>
inline T atomic_load_explicit(const atomic<T>* o, memory_order) {
  T r;
  __atomic_load(&o->v, &r, __ATOMIC_RELAXED);
  return r;
}
template <class T>
inline T atomic_exchange_explicit(atomic<T>* o, T x, memory_order) {
  T r;
  __atomic_exchange(&o->v, &x, &r, __ATOMIC_RELAXED);
  return r;
}
template <class T, class F>
inline T atomic_update(atomic<T>* o, F f) {
  T old;
  __atomic_load(&o->v, &old, __ATOMIC_RELAXED);
  T next = f(old);
  while (!__atomic_compare_exchange(&o->v, &old, &next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) next = f(old);
  return old;
}
template <class T>
inline T atomic_fetch_add_explicit(atomic<T>* o, T x, memory_order) { return atomic_update(o, [x](T a) { return T(a + x); }); }
template <class T>
inline T atomic_fetch_sub_explicit(atomic<T>* o, T x, memory_order) { return atomic_update(o, [x](T a) { return T(a - x); }); }
template <class T>
inline T atomic_fetch_min_explicit(atomic<T>* o, T x, memory_order) { return atomic_update(o, [x](T a) { return x < a ? x : a; }); }
template <class T>
inline T atomic_fetch_max_explicit(atomic<T>* o, T x, memory_order) { return atomic_update(o, [x](T a) { return a < x ? x : a; }); }
template <class T>
inline T atomic_fetch_and_explicit(atomic<T>* o, T x, memory_order) { return atomic_update(o, [x](T a) { return T(a & x); }); }
template <class T>
inline T atomic_fetch_or_explicit(atomic<T>* o, T x, memory_order) { return atomic_update(o, [x](T a) { return T(a | x); }); }
template <class T>
inline T atomic_fetch_xor_explicit(atomic<T>* o, T x, memory_order) { return atomic_update(o, [x](T a) { return T(a ^ x); }); }
template <class T>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* o, T* expected, T desired, memory_order, memory_order) {
  return __atomic_compare_exchange(&o->v, expected, &desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

}  // namespace metal

// ================================================================ SIMD-group matrices
// Apple, "Metal Shading Language Specification": sec. 2.4 (simdgroup_matrix
// types: T is half, bfloat or float, Cols = Rows = 8) and the "SIMD-group
// matrix functions" (diagonal constructor, make_filled_simdgroup_matrix,
// simdgroup_load / simdgroup_store with elements_per_row, matrix_origin and
// transpose_matrix, simdgroup_multiply and simdgroup_multiply_accumulate
// d = a * b + c with one element type T for every operand). The spec runs these
// cooperatively over one SIMD-group in uniform control flow and leaves the
// mapping of elements to threads unspecified (a kernel cannot address single
// elements), so here:
//  - a matrix is spread over the 32 lanes, two elements each (EMU: element
//    (r, c) sits in lane (8r + c) / 2; any fixed mapping behaves the same);
//  - every load, store and multiply is a SIMD-group collective: it resolves
//    when the lanes of the SIMD-group arrive, and it is an error unless all 32
//    lanes arrive together with the same arguments;
//  - matrix_origin is (column, row) of the tile's first element in the memory
//    layout, elements_per_row the row stride in memory; transpose_matrix loads
//    (stores) the tile's transpose: d[r][c] = mem[(origin.y + c) * stride +
//    origin.x + r]. The kernels here pass origin 0 and offset the pointer;
//  - a default-constructed matrix is NaN (uninitialised on the GPU), so an
//    accumulator that was never filled shows;
//  - multiply-accumulate sums each d[i][j] = c[i][j] + sum_k a[i][k] b[k][j]
//    in float, k ascending, and rounds once to T. EMU: the GPU's summation
//    order and intermediate precision are not specified, so results agree to
//    rounding, not bitwise.
namespace emu {

constexpr int SGM_DIM = 8;

inline int sgm_lane(int r, int c) { return (r * SGM_DIM + c) / 2; }
inline int sgm_slot(int r, int c) { return (r * SGM_DIM + c) % 2; }

// All 32 lanes of a full SIMD-group must take part; returns false (and sets the
// launch error) otherwise.
inline bool sgm_uniform(Group& g, const int* lanes, int count, const char* what) {
  if (count == SIMD_WIDTH) return true;
  if (g.err.empty())
    g.err = std::string(what) + " reached by " + std::to_string(count) +
            " of the 32 lanes of a SIMD-group; SIMD-group matrix functions need uniform control "
            "flow over a full SIMD-group";
  return false;
}

template <class Args>
inline bool sgm_same_args(Group& g, const int* lanes, int count, const char* what) {
  for (int k = 1; k < count; ++k) {
    if (std::memcmp(g.lane[lanes[k]].in, g.lane[lanes[0]].in, sizeof(Args)) != 0) {
      if (g.err.empty())
        g.err = std::string(what) + ": lanes " + std::to_string(lanes[0] % SIMD_WIDTH) + " and " +
                std::to_string(lanes[k] % SIMD_WIDTH) + " passed different arguments";
      return false;
    }
  }
  return true;
}

template <class T>
struct SgmAddress {
  T* ptr;
  unsigned long stride, ox, oy;
  unsigned long transpose;  // a full word: no padding bytes to compare
  size_t index(int r, int c) const {
    return transpose ? (oy + size_t(c)) * stride + ox + size_t(r) : (oy + size_t(r)) * stride + ox + size_t(c);
  }
};

template <class T>
struct SgmStoreArgs {
  SgmAddress<T> at;
  T mine[2];
};

template <class T>
struct SgmPair {
  T e[2];
};

template <class T>
struct SgmTriple {
  T a[2], b[2], c[2];
};

template <class T>
void sgm_load_resolve(Group& g, const int* lanes, int count) {
  SgmPair<T> out;
  std::memset(static_cast<void*>(&out), 0xFF, sizeof(out));
  bool ok = sgm_uniform(g, lanes, count, "simdgroup_load") &&
            sgm_same_args<SgmAddress<const T>>(g, lanes, count, "simdgroup_load");
  SgmAddress<const T> at;
  std::memcpy(static_cast<void*>(&at), g.lane[lanes[0]].in, sizeof(at));
  for (int k = 0; k < count; ++k) {
    const int l = lanes[k] % SIMD_WIDTH;
    if (ok)
      for (int s = 0; s < 2; ++s) {
        const int e = 2 * l + s;
        out.e[s] = at.ptr[at.index(e / SGM_DIM, e % SGM_DIM)];
      }
    std::memcpy(g.lane[lanes[k]].out, static_cast<const void*>(&out), sizeof(out));
  }
}

template <class T>
void sgm_store_resolve(Group& g, const int* lanes, int count) {
  if (!sgm_uniform(g, lanes, count, "simdgroup_store")) return;
  // the address must agree; each lane brings its own elements
  SgmStoreArgs<T> first;
  std::memcpy(static_cast<void*>(&first), g.lane[lanes[0]].in, sizeof(first));
  for (int k = 1; k < count; ++k) {
    SgmStoreArgs<T> other;
    std::memcpy(static_cast<void*>(&other), g.lane[lanes[k]].in, sizeof(other));
    if (std::memcmp(&other.at, &first.at, sizeof(first.at)) != 0) {
      if (g.err.empty()) g.err = "simdgroup_store: lanes passed different arguments";
      return;
    }
  }
  for (int k = 0; k < count; ++k) {
    SgmStoreArgs<T> a;
    std::memcpy(static_cast<void*>(&a), g.lane[lanes[k]].in, sizeof(a));
    const int l = lanes[k] % SIMD_WIDTH;
    for (int s = 0; s < 2; ++s) {
      const int e = 2 * l + s;
      first.at.ptr[first.at.index(e / SGM_DIM, e % SGM_DIM)] = a.mine[s];
    }
  }
}

template <class T>
void sgm_mma_resolve(Group& g, const int* lanes, int count) {
  SgmPair<T> out;
  std::memset(static_cast<void*>(&out), 0xFF, sizeof(out));
  if (!sgm_uniform(g, lanes, count, "simdgroup_multiply_accumulate")) {
    for (int k = 0; k < count; ++k) std::memcpy(g.lane[lanes[k]].out, static_cast<const void*>(&out), sizeof(out));
    return;
  }
  T a[64], b[64], c[64];
  for (int k = 0; k < count; ++k) {
    SgmTriple<T> t;
    std::memcpy(static_cast<void*>(&t), g.lane[lanes[k]].in, sizeof(t));
    const int l = lanes[k] % SIMD_WIDTH;
    for (int s = 0; s < 2; ++s) {
      a[2 * l + s] = t.a[s];
      b[2 * l + s] = t.b[s];
      c[2 * l + s] = t.c[s];
    }
  }
  for (int k = 0; k < count; ++k) {
    const int l = lanes[k] % SIMD_WIDTH;
    for (int s = 0; s < 2; ++s) {
      const int e = 2 * l + s, i = e / SGM_DIM, j = e % SGM_DIM;
      float acc = float(c[e]);
      for (int q = 0; q < SGM_DIM; ++q) acc += float(a[i * SGM_DIM + q]) * float(b[q * SGM_DIM + j]);
      out.e[s] = T(acc);
    }
    std::memcpy(g.lane[lanes[k]].out, static_cast<const void*>(&out), sizeof(out));
  }
}

// One lane's side of a SIMD-group matrix function: hand in `in`, wait for the
// SIMD-group, take this lane's result.
template <class In, class Out>
inline Out sgm_call(const In& in, Resolver resolver) {
  static_assert(sizeof(In) <= SLOT && sizeof(Out) <= SLOT, "SIMD-group matrix operand too large");
  Group& g = *g_cur;
  const int i = g.cur;
  Lane& L = g.lane[i];
  std::memcpy(L.in, static_cast<const void*>(&in), sizeof(In));
  L.arg = 0;
  L.resolve = resolver;
  g.state[i] = AT_SIMD;
  swapcontext(&g.ctx[i], &g.sched);
  Out r;
  std::memcpy(static_cast<void*>(&r), g_cur->lane[i].out, sizeof(Out));
  return r;
}

}  // namespace emu

namespace metal {

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "Metal's SIMD-group matrices are 8 x 8");
  static_assert(std::is_same<T, float>::value || std::is_same<T, half>::value || std::is_same<T, bfloat>::value,
                "simdgroup_matrix element types are half, bfloat and float");
  T e[2];  // this lane's two elements
  simdgroup_matrix() { std::memset(static_cast<void*>(e), 0xFF, sizeof(e)); }
  // the spec: "a diagonal matrix with the given value"
  simdgroup_matrix(T dval) {
    const int l = emu::g_cur->cur % emu::SIMD_WIDTH;
    for (int s = 0; s < 2; ++s) {
      const int idx = 2 * l + s;
      e[s] = (idx / 8 == idx % 8) ? dval : T(0.0f);
    }
  }
};
using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;

template <class T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e[0] = m.e[1] = value;
  return m;
}

template <class T, int C, int R>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const T* src, unsigned long elements_per_row = C,
                           ulong2 matrix_origin = ulong2(0ul), bool transpose_matrix = false) {
  emu::SgmAddress<const T> at;
  std::memset(static_cast<void*>(&at), 0, sizeof(at));
  at.ptr = src;
  at.stride = elements_per_row;
  at.ox = matrix_origin.x;
  at.oy = matrix_origin.y;
  at.transpose = transpose_matrix ? 1ul : 0ul;
  auto got = emu::sgm_call<emu::SgmAddress<const T>, emu::SgmPair<T>>(at, &emu::sgm_load_resolve<T>);
  d.e[0] = got.e[0];
  d.e[1] = got.e[1];
}

template <class T, int C, int R>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& a, T* dst, unsigned long elements_per_row = C,
                            ulong2 matrix_origin = ulong2(0ul), bool transpose_matrix = false) {
  emu::SgmStoreArgs<T> args;
  std::memset(static_cast<void*>(&args), 0, sizeof(args));
  args.at.ptr = dst;
  args.at.stride = elements_per_row;
  args.at.ox = matrix_origin.x;
  args.at.oy = matrix_origin.y;
  args.at.transpose = transpose_matrix ? 1ul : 0ul;
  args.mine[0] = a.e[0];
  args.mine[1] = a.e[1];
  (void)emu::sgm_call<emu::SgmStoreArgs<T>, int>(args, &emu::sgm_store_resolve<T>);
}

template <class T, int C, int R, int K>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, C, R>& d, const simdgroup_matrix<T, K, R>& a,
                                          const simdgroup_matrix<T, C, K>& b, const simdgroup_matrix<T, C, R>& c) {
  emu::SgmTriple<T> in;
  for (int s = 0; s < 2; ++s) {
    in.a[s] = a.e[s];
    in.b[s] = b.e[s];
    in.c[s] = c.e[s];
  }
  auto got = emu::sgm_call<emu::SgmTriple<T>, emu::SgmPair<T>>(in, &emu::sgm_mma_resolve<T>);
  d.e[0] = got.e[0];
  d.e[1] = got.e[1];
}

template <class T, int C, int R, int K>
inline void simdgroup_multiply(simdgroup_matrix<T, C, R>& d, const simdgroup_matrix<T, K, R>& a,
                               const simdgroup_matrix<T, C, K>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, C, R>(T(0.0f)));
}

}  // namespace metal

using namespace metal;

// scalar names Metal and MLX's utils provide
using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = unsigned long;
using float16_t = metal::half;
using bfloat16_t = metal::bfloat;
#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif
#define METAL_FUNC inline

// address spaces (sec. 4): all memory is host memory here. `threadgroup`
// declarations were already rewritten to tg_alloc by the harness; the word
// that is left qualifies pointers and references only.
#define device
#define constant
#define threadgroup
#define thread
