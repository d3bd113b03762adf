// Paged attention for one layer of one forward pass, in one call: write the pass's new keys and values
// into their cache slots, then, for every query token and head, softmax(q . k * scale) . v over the keys
// the token may see, read in place through its sequence's block table (no gathered copy of the cache).
//
// Layouts (row-major, element strides):
//   q      [num_tokens, num_heads, head_dim]     token stride q_stride, head stride head_dim
//   k_new  [num_tokens, num_kv_heads, head_dim]  token stride k_stride
//   v_new  [num_tokens, num_kv_heads, head_dim]  token stride v_stride
//   caches [num_blocks, block_size, num_kv_heads, head_dim], contiguous
//   out    [num_tokens, num_heads, head_dim], contiguous
//   slot_mapping [num_tokens]: flat slot (block * block_size + offset) each new token's K/V goes to
//   block_tables [num_seqs, max_blocks]: each sequence's blocks
//   token_seq [num_tokens]: the sequence of each query token
//   key_start, key_end [num_tokens]: the token sees its sequence's key positions [key_start, key_end)
//   tree_base, tree_bits [num_tokens]: and, for a token-tree query, position tree_base + j wherever bit j of
//     tree_bits is set (a tree of at most 64 nodes; 0 bits for every other token)
//
// Arithmetic: float accumulation for float32 and bfloat16 (bfloat16 results rounded to nearest even, as
// torch does), double for float64. The softmax subtracts the row maximum; exp in float is a range-reduced
// polynomial (relative error ~1e-7, what a vectorised loop can call; ATen's CPU attention approximates exp
// too), in double it is std::exp. Each query token's result depends only on its own keys: the same token
// gets the same bits whether it is decoded alone or verified inside a longer pass.
//
// Built by workers/models/native_attention.py with the host's compiler for the host's CPU (-march=native).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define SPECFLEET_AVX2_SUMS 1  // the 16-wide sums, broadcasts and value sums in 8-wide halves (hsum and below)
#endif

namespace {

inline float load(const float* p) { return *p; }
inline double load(const double* p) { return *p; }
inline float load(const uint16_t* p) {  // bfloat16: the high half of a float
  uint32_t bits = uint32_t(*p) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline void store(float* p, float x) { *p = x; }
inline void store(double* p, double x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, NaN kept NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *p = uint16_t((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = uint16_t(bits >> 16);
}

template <typename T>
struct Accum {
  using type = float;
};
template <>
struct Accum<double> {
  using type = double;
};

// Whether this thread runs in a parallel region already: the one a model's layers run in (decode_layers.cpp),
// every thread of it calling each step of a layer in turn. The loops below then share out their items among
// that region's threads (an orphaned `omp for`, which ends with them waiting for each other) instead of opening
// a region of their own: on two threads a region costs ~2 us to open and close, a barrier inside one ~0.7 us.
inline bool in_region() {
#ifdef _OPENMP
  return omp_in_parallel() != 0;
#else
  return false;
#endif
}

// fn() once: by one thread of the region this thread runs in, the others waiting until it is done
template <typename Fn>
inline void once(Fn fn) {
  if (!in_region()) {
    fn();
    return;
  }
#pragma omp single
  fn();
}

// fn(i) for every i in [0, n), spread over num_threads (OpenMP), or in this thread where there is one thread or
// one item, without entering OpenMP at all: a region costs ~0.4 us even where its `if` clause keeps it serial,
// and a decode step would enter ~130. Items must not depend on each other (nor their results on the thread).
template <typename Fn>
inline void parallel_for(int64_t n, int64_t num_threads, Fn fn) {
  if (in_region()) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  if (num_threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) fn(i);
}

// fn(state, i) likewise, the items handed out one at a time, `state` what state_of() gives the thread that runs
// them (asked once a thread, before its first item)
template <typename StateOf, typename Fn>
inline void parallel_items(int64_t n, int64_t num_threads, StateOf state_of, Fn fn) {
  if (in_region()) {
    auto&& state = state_of();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) fn(state, i);
    return;
  }
  if (num_threads <= 1 || n <= 1) {
    auto&& state = state_of();
    for (int64_t i = 0; i < n; ++i) fn(state, i);
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    auto&& state = state_of();
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < n; ++i) fn(state, i);
  }
}

// exp(x) for x <= 0: 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its degree-6 Taylor
// polynomial. Branch-free, so the loop that calls it vectorises.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t exponent_bits = (int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &exponent_bits, sizeof two_n);
  return p * two_n;
}
inline double exp_nonpositive(double x) { return std::exp(x); }

// Sums run in kLanes partial sums folded pairwise: a fixed order the compiler can vectorise without being
// allowed to reassociate.
constexpr int64_t kLanes = 16;

template <typename A>
inline A fold(A* part) {  // part [kLanes] -> its sum
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t i = 0; i < width; ++i) part[i] += part[i + width];
  }
  return part[0];
}

template <typename A, typename T>
inline A dot(const A* q, const T* k, int64_t dim) {
  A part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int64_t i = 0; i < kLanes; ++i) part[i] += q[d + i] * A(load(k + d + i));
  }
  for (; d < dim; ++d) part[d % kLanes] += q[d] * A(load(k + d));
  return fold(part);
}

template <typename A>
inline A sum(const A* x, int64_t n) {
  A part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t i = 0; i < kLanes; ++i) part[i] += x[j + i];
  }
  for (; j < n; ++j) part[j % kLanes] += x[j];
  return fold(part);
}

// Which key positions a query token sees: a range, plus the tree slots its bits name.
struct Visibility {
  int64_t start, end, tree_base;
  uint64_t tree_bits;

  bool sees(int64_t pos) const {
    if (pos >= start && pos < end) return true;
    const uint64_t offset = uint64_t(pos - tree_base);  // wraps to >= 64 below tree_base
    return offset < 64 && ((tree_bits >> offset) & 1u);
  }
  int64_t last() const {  // one past the last position it sees
    return tree_bits ? std::max(end, tree_base + 64 - __builtin_clzll(tree_bits)) : end;
  }
};

// ---- one (query token, head): the scalar path (float64, and head sizes that are not a multiple of 16) ----
template <typename T>
void head_scalar(const T* q_head, const T* k_cache, const T* v_cache, const int64_t* key_rows, int64_t num_keys,
                 int64_t dim, double scale, typename Accum<T>::type* scores, T* out_head) {
  using A = typename Accum<T>::type;
  std::vector<A> q_row(dim), acc(dim, A(0));
  for (int64_t d = 0; d < dim; ++d) q_row[d] = A(load(q_head + d));
  A max_score = -std::numeric_limits<A>::infinity();
  for (int64_t j = 0; j < num_keys; ++j) {
    scores[j] = dot(q_row.data(), k_cache + key_rows[j], dim) * A(scale);
    max_score = std::max(max_score, scores[j]);
  }
  for (int64_t j = 0; j < num_keys; ++j) scores[j] = exp_nonpositive(scores[j] - max_score);
  const A inv_total = A(1) / sum(scores, num_keys);
  for (int64_t j = 0; j < num_keys; ++j) {
    const T* v_head = v_cache + key_rows[j];
    for (int64_t d = 0; d < dim; ++d) acc[d] += scores[j] * A(load(v_head + d));
  }
  for (int64_t d = 0; d < dim; ++d) store(out_head + d, acc[d] * inv_total);
}

// ---- the vector path: float32 / bfloat16 heads of kChunks * 16 elements, accumulators in registers ----
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#if defined(__AVX512F__)
// 16 bfloat16 -> float in one vpmovzxwd and a shift: GCC lowers the generic conversion (load16 without AVX-512)
// in 256-bit halves where it tunes for 256-bit vectors (a vpmovzxwd, vextracti128 and vinserti64x4 a vector in
// the demo target's layers, perf on an AVX-512 host without AVX512-BF16)
inline __m512 widen16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif
inline f32x16 load16(const uint16_t* p) {  // 16 bfloat16 -> float
#if defined(__AVX512F__)
  const __m512 wide = widen16(p);
  f32x16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
#else
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
inline void store16(uint16_t* p, f32x16 v) {  // round to nearest even, NaN kept NaN (as store() above)
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u32x16 quiet_nan = (bits >> 16) | 0x40u;
  const u32x16 out = ((bits & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded;
  const u16x16 half = __builtin_convertvector(out, u16x16);
  std::memcpy(p, &half, sizeof half);
}

// the largest of x[0..n), -inf for none: the float std::max gives taken in order (a NaN is passed over either way;
// among equal values the order only decides the sign of a zero maximum, which exp_nonpositive(s - max) does not
// tell apart), 16 lanes at a time. In order, each std::max waited for the one before: perf put a softmax's max
// loop at 8 % of the attention kernel's samples at 16 decoding sequences of ~160 keys, more with longer contexts
inline float max_of(const float* x, int64_t n) {
  f32x16 lanes;
  for (int l = 0; l < 16; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 v = load16(x + i);
    lanes = v > lanes ? v : lanes;  // a lane's std::max(lane, v): NaN never replaces it
  }
  float best = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < 16; ++l) best = std::max(best, lanes[l]);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x2 __attribute__((vector_size(8)));

#ifdef SPECFLEET_AVX2_SUMS
// Without AVX-512 a 16-wide vector is two 8-wide registers, and GCC lowers the 16-wide shuffles below through
// the stack (on an AVX2 host, perf put the attention's hottest instructions there at 16 decoding sequences).
// The same sums, in the same order, from the two halves: each result is the same float.
inline __m256 half_sum(f32x16 v) {  // v's halves added: lanes 0-7 + lanes 8-15
  __m256 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return _mm256_add_ps(lo, hi);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> float
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float hsum(f32x16 v) {  // halves, then quarters, then pairs, as fold()
  const __m256 h8 = half_sum(v);
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));  // lanes 0, 1: h4[0] + h4[2], h4[1] + h4[3]
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

inline void hsum4(const f32x16* v, float* out) {  // hsum of each of four vectors
  const __m256 a8 = half_sum(v[0]), b8 = half_sum(v[1]), c8 = half_sum(v[2]), d8 = half_sum(v[3]);
  // quarters: [a's four | b's four] and [c's | d's]
  const __m256 ab4 = _mm256_add_ps(_mm256_permute2f128_ps(a8, b8, 0x20), _mm256_permute2f128_ps(a8, b8, 0x31));
  const __m256 cd4 = _mm256_add_ps(_mm256_permute2f128_ps(c8, d8, 0x20), _mm256_permute2f128_ps(c8, d8, 0x31));
  // pairs: [a0+a2, a1+a3, c0+c2, c1+c3 | b.., d..]
  const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(ab4, cd4, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(ab4, cd4, _MM_SHUFFLE(3, 2, 3, 2)));
  // each vector's two pair sums added: [a, c, a, c | b, d, b, d]
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  out[0] = lanes[0];
  out[1] = lanes[4];
  out[2] = lanes[1];
  out[3] = lanes[5];
}
#else
inline float hsum(f32x16 v) {  // pairwise in registers: the same order as fold() (halves, then quarters, ...)
  const f32x8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  const f32x2 h2 = __builtin_shufflevector(h4, h4, 0, 1) + __builtin_shufflevector(h4, h4, 2, 3);
  return h2[0] + h2[1];
}

// hsum of four vectors at once, in hsum's order for each (halves, then quarters, ...): their pairs of halves
// side by side in one register at each step, so the four share one chain of shuffles instead of four
inline void hsum4(const f32x16* v, float* out) {
  const f32x16 ab = __builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(v[0], v[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const f32x16 cd = __builtin_shufflevector(v[2], v[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(v[2], v[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // ab: v0's halves summed (lanes 0-7), v1's (8-15); cd likewise for v2, v3
  const f32x16 quarters = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                          __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const f32x8 pairs = __builtin_shufflevector(quarters, quarters, 0, 1, 4, 5, 8, 9, 12, 13) +
                      __builtin_shufflevector(quarters, quarters, 2, 3, 6, 7, 10, 11, 14, 15);
  const f32x4 sums = __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6) + __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7);
  std::memcpy(out, &sums, sizeof sums);
}
#endif

// x in every lane. Written out: GCC lowers `float * f32x16` on AVX2 by storing x to the stack sixteen times and
// loading it back as two vectors, a stalled store-to-load forward per use
inline f32x16 splat16(float x) {
#ifdef SPECFLEET_AVX2_SUMS
  const __m256 half = _mm256_set1_ps(x);
  f32x16 v;
  std::memcpy(&v, &half, sizeof half);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof half, &half, sizeof half);
  return v;
#else
  return f32x16{} + x;
#endif
}

// acc[c] += p * v[16 c ..] for each chunk c of a head: the value loop's step. On AVX2 in 8-wide halves: GCC
// stores a 16-wide sum back to memory on AVX2 through 64-bit pieces (a stalled forward per chunk); the same
// FMAs either way
template <typename T, int kChunks>
inline void add_scaled(f32x16* acc, float p, const T* v) {
#ifdef SPECFLEET_AVX2_SUMS
  const __m256 pv = _mm256_set1_ps(p);
  float* sums = reinterpret_cast<float*>(acc);
  for (int h = 0; h < 2 * kChunks; ++h) {
    _mm256_storeu_ps(sums + 8 * h, _mm256_fmadd_ps(pv, load8(v + 8 * h), _mm256_loadu_ps(sums + 8 * h)));
  }
#else
  for (int c = 0; c < kChunks; ++c) acc[c] += p * load16(v + 16 * c);
#endif
}

template <typename T, int kChunks>
inline f32x16 dot_lanes(const f32x16* q, const T* k) {  // q . k as 16 partial sums
  f32x16 acc = {};
  for (int c = 0; c < kChunks; ++c) acc += q[c] * load16(k + 16 * c);
  return acc;
}

template <typename T, int kChunks>
inline float dot_chunks(const f32x16* q, const T* k) {
  return hsum(dot_lanes<T, kChunks>(q, k));
}

// A run: consecutive query tokens of one sequence (a decode token, a chain to verify, a piece of a prefill
// chunk), attended together. Each visible slot row (all KV heads, contiguous) is read once, in sequence order,
// for the scores of every token and head of the run, and once more for the values: streaming reads of whole
// blocks, and a chain of k tokens reads its keys once, not k times. Every token's scores, softmax and value
// sum are computed exactly as they would be for that token alone.
constexpr int64_t kMaxRun = 16;  // tokens per run; longer runs (prefill) are split
constexpr int64_t kPrefetchKeys = 4;  // rows ahead
constexpr int64_t kTileKeys = 32;  // keys whose values a run with reused rows sums at a time (run_vector)

template <typename T>
inline void prefetch_row(const T* slot_row, int64_t row_bytes) {  // every cache line of a slot row
  const char* bytes = reinterpret_cast<const char*>(slot_row);
  for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(bytes + b);
}

// Every (key j, token r) of a run where token r sees key j, in key order: the slot row of key j is prefetched
// kPrefetchKeys ahead and read once for all of them. visit(r, j, key j's slot row).
template <typename T, typename Visit>
inline void for_each_seen_row(const T* cache, const int64_t* key_rows, int64_t lo, int64_t num_keys,
                              const Visibility* seen, int64_t run_len, int64_t row_bytes, Visit visit) {
  for (int64_t j = 0; j < num_keys; ++j) {
    if (j + kPrefetchKeys < num_keys) prefetch_row(cache + key_rows[j + kPrefetchKeys], row_bytes);
    const T* slot_row = cache + key_rows[j];
    const int64_t pos = lo + j;
    for (int64_t r = 0; r < run_len; ++r) {
      if (seen[r].sees(pos)) visit(r, j, slot_row);
    }
  }
}

// q, the caches and out may start at a head other than the first (a part of the heads, attend below): q, k and v
// rows hold num_heads query heads here, out's token stride is out_stride
template <typename T, int kChunks>
void run_vector(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* key_rows,
                int64_t lo, int64_t num_keys, const Visibility* seen, int64_t run_len, int64_t num_heads,
                int64_t group, double scale, float* scores, f32x16* acc, T* out, int64_t out_stride) {
  constexpr int64_t dim = 16 * kChunks;
  const float scale_f = float(scale);
  const int64_t rows = run_len * num_heads;  // (token, head) pairs, token-major
  // this thread's, kept from call to call (a decode step calls this for every layer and sequence)
  thread_local std::vector<f32x16> qv;
  thread_local std::vector<int64_t> kv_offset;  // [H]: element offset of each head's KV head in a slot row
  qv.resize(rows * kChunks);
  kv_offset.resize(num_heads);
  for (int64_t h = 0; h < num_heads; ++h) kv_offset[h] = (h / group) * dim;
  for (int64_t r = 0; r < run_len; ++r) {
    for (int64_t h = 0; h < num_heads; ++h) {
      for (int c = 0; c < kChunks; ++c) qv[(r * num_heads + h) * kChunks + c] = load16(q + r * q_stride + h * dim + 16 * c);
    }
  }
  const int64_t row_bytes = num_heads / group * dim * int64_t(sizeof(T));
  // Where several (token, head) pairs read each slot row (a run of several tokens, or query heads sharing a KV
  // head), a bfloat16 row is widened to floats once per key and read from there: the same floats, products and
  // sums as widening it again for every pair, which a chain of 9 tokens did 9 times per key and head
  const bool widens_once = !std::is_same_v<T, float> && run_len * group > 1;
  const int64_t row_vectors = num_heads / group * kChunks;
  thread_local std::vector<f32x16> wide;  // [row_vectors]: the slot row of key `widened`, as floats
  if (widens_once) wide.resize(row_vectors);
  int64_t widened = -1;
  auto widen = [&](int64_t j, const T* slot_row) -> const float* {
    if (j != widened) {
      for (int64_t c = 0; c < row_vectors; ++c) wide[c] = load16(slot_row + 16 * c);
      widened = j;
    }
    return reinterpret_cast<const float*>(wide.data());
  };
  auto score = [&](int64_t r, int64_t j, const auto* row) {  // scores [rows, keys] of key j's row (T or widened)
    using R = std::remove_cv_t<std::remove_pointer_t<decltype(row)>>;
    const int64_t i0 = r * num_heads;
    int64_t h = 0;
    for (; h + 4 <= num_heads; h += 4) {  // four heads' sums reduced together: the same bits as one by one
      f32x16 lanes[4];
      float dots[4];
      for (int g = 0; g < 4; ++g) lanes[g] = dot_lanes<R, kChunks>(&qv[(i0 + h + g) * kChunks], row + kv_offset[h + g]);
      hsum4(lanes, dots);
      for (int g = 0; g < 4; ++g) scores[(i0 + h + g) * num_keys + j] = dots[g] * scale_f;
    }
    for (; h < num_heads; ++h) {
      scores[(i0 + h) * num_keys + j] = dot_chunks<R, kChunks>(&qv[(i0 + h) * kChunks], row + kv_offset[h]) * scale_f;
    }
  };
  for_each_seen_row(k_cache, key_rows, lo, num_keys, seen, run_len, row_bytes,
                    [&](int64_t r, int64_t j, const T* slot_row) {
                      if (widens_once) {
                        score(r, j, widen(j, slot_row));
                      } else {
                        score(r, j, slot_row);
                      }
                    });
  for (int64_t r = 0; r < run_len; ++r) {  // softmax numerators over each token's own keys (0 for the
    const int64_t first = seen[r].start - lo, count = seen[r].last() - seen[r].start;  // tree slots it skips)
    const bool is_tree = seen[r].tree_bits != 0;
    for (int64_t h = 0; h < num_heads; ++h) {
      float* row_scores = scores + (r * num_heads + h) * num_keys + first;
      float max_score = -std::numeric_limits<float>::infinity();
      if (!is_tree) {
        max_score = max_of(row_scores, count);
        for (int64_t i = 0; i < count; ++i) row_scores[i] = exp_nonpositive(row_scores[i] - max_score);
        continue;
      }
      for (int64_t i = 0; i < count; ++i) {
        if (seen[r].sees(seen[r].start + i)) max_score = std::max(max_score, row_scores[i]);
      }
      for (int64_t i = 0; i < count; ++i) {
        row_scores[i] = seen[r].sees(seen[r].start + i) ? exp_nonpositive(row_scores[i] - max_score) : 0.0f;
      }
    }
  }
  std::fill(acc, acc + rows * kChunks, f32x16{});
  auto add_values = [&](int64_t r, int64_t j, const T* row) {  // key j's values, weighted, into each head's sums
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t i = r * num_heads + h;
      add_scaled<T, kChunks>(acc + i * kChunks, scores[i * num_keys + j], row + kv_offset[h]);
    }
  };
  // Where rows are read several times (widens_once), the values go kTileKeys keys at a time: the tile's rows are
  // widened once into `tile`, then each (token, head) adds the keys it sees to its sums, held in registers over
  // the tile rather than loaded and stored for every key. Each sum still takes its keys in order: the same bits.
  auto add_value_tiles = [&] {
    thread_local std::vector<f32x16> tile;  // [kTileKeys, row_vectors]
    tile.resize(kTileKeys * row_vectors);
    for (int64_t j0 = 0; j0 < num_keys; j0 += kTileKeys) {
      const int64_t j1 = std::min(num_keys, j0 + kTileKeys);
      for (int64_t j = j0; j < j1; ++j) {
        if (j + kPrefetchKeys < num_keys) prefetch_row(v_cache + key_rows[j + kPrefetchKeys], row_bytes);
        for (int64_t c = 0; c < row_vectors; ++c) tile[(j - j0) * row_vectors + c] = load16(v_cache + key_rows[j] + 16 * c);
      }
      for (int64_t r = 0; r < run_len; ++r) {
        for (int64_t h = 0; h < num_heads; ++h) {
          const int64_t i = r * num_heads + h;
          f32x16 sums[kChunks];
          for (int c = 0; c < kChunks; ++c) sums[c] = acc[i * kChunks + c];
          for (int64_t j = j0; j < j1; ++j) {
            if (!seen[r].sees(lo + j)) continue;
            const float* row = reinterpret_cast<const float*>(&tile[(j - j0) * row_vectors]);
            add_scaled<float, kChunks>(sums, scores[i * num_keys + j], row + kv_offset[h]);
          }
          for (int c = 0; c < kChunks; ++c) acc[i * kChunks + c] = sums[c];
        }
      }
    }
  };
  // Where each (token, head) pair reads its own columns of the rows (one token, a KV head for each query head: a
  // decode step of such a model), the rows once each in key order as add_values, a few heads' sums held in
  // registers over all the keys (kGroupHeads at a time): the same products in the same order as add_values,
  // which loaded and stored every pair's sums at every key
  auto add_values_by_pair = [&] {
    // heads h0 .. h0 + G - 1 (G: a compile-time count, so their G x kChunks sums stay in registers)
    auto sum_heads = [&](auto num_group_heads, int64_t h0) {
      constexpr int64_t G = decltype(num_group_heads)::value;
      const int64_t group_bytes = G * dim * int64_t(sizeof(T));
      f32x16 sums[G][kChunks] = {};
      for (int64_t j = 0; j < num_keys; ++j) {
        if (j + kPrefetchKeys < num_keys) prefetch_row(v_cache + key_rows[j + kPrefetchKeys] + kv_offset[h0], group_bytes);
        if (!seen[0].sees(lo + j)) continue;
        const T* row = v_cache + key_rows[j];
        for (int64_t g = 0; g < G; ++g) {
          add_scaled<T, kChunks>(sums[g], scores[(h0 + g) * num_keys + j], row + kv_offset[h0 + g]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int c = 0; c < kChunks; ++c) acc[(h0 + g) * kChunks + c] = sums[g][c];
      }
    };
    constexpr int64_t kGroupHeads = kChunks <= 4 ? 16 / kChunks : 1;  // 16 vectors of sums (AVX2: they spill)
    int64_t h0 = 0;
    for (; h0 + kGroupHeads <= num_heads; h0 += kGroupHeads) {
      sum_heads(std::integral_constant<int64_t, kGroupHeads>{}, h0);
    }
    for (; h0 < num_heads; ++h0) sum_heads(std::integral_constant<int64_t, 1>{}, h0);
  };
  if (widens_once) {  // a tile of keys at a time: their rows widened once, each (token, head)'s sums in registers
    add_value_tiles();
  } else if (run_len == 1 && group == 1) {
    add_values_by_pair();
  } else {
    for_each_seen_row(v_cache, key_rows, lo, num_keys, seen, run_len, row_bytes, add_values);
  }
  for (int64_t r = 0; r < run_len; ++r) {
    const int64_t first = seen[r].start - lo, count = seen[r].last() - seen[r].start;
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t i = r * num_heads + h;
      const f32x16 inv_total = splat16(1.0f / sum(scores + i * num_keys + first, count));
      T* out_head = out + r * out_stride + h * dim;
      for (int c = 0; c < kChunks; ++c) store16(out_head + 16 * c, acc[i * kChunks + c] * inv_total);
    }
  }
}

template <typename T>
using RunFn = void (*)(const T*, int64_t, const T*, const T*, const int64_t*, int64_t, int64_t, const Visibility*,
                       int64_t, int64_t, int64_t, double, float*, f32x16*, T*, int64_t);

template <typename T, int kChunks>
RunFn<T> vector_run_for(int64_t dim) {
  if constexpr (kChunks > 16) {
    return nullptr;
  } else {
    return dim == 16 * kChunks ? run_vector<T, kChunks> : vector_run_for<T, kChunks + 1>(dim);
  }
}

template <typename T>
RunFn<T> run_fn(int64_t dim) {  // head sizes 16 .. 256 in steps of 16 in float32 / bfloat16, else none
  if constexpr (std::is_same_v<typename Accum<T>::type, float>) {
    return vector_run_for<T, 1>(dim);
  } else {
    return nullptr;
  }
}

struct Shape {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_stride, k_stride, v_stride;
  int64_t num_threads;  // OpenMP threads for the runs (the build may have no OpenMP: then one)
};

template <typename T>
void write_kv(const T* k_new, const T* v_new, T* k_cache, T* v_cache, const int64_t* slot_mapping,
              const Shape& s) {
  const int64_t row = s.num_kv_heads * s.head_dim;  // one slot's elements
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    std::memcpy(k_cache + slot * row, k_new + t * s.k_stride, row * sizeof(T));
    std::memcpy(v_cache + slot * row, v_new + t * s.v_stride, row * sizeof(T));
  }
}

// [first token of each run, ..., num_tokens]: a run ends where the sequence changes or at kMaxRun tokens
inline std::vector<int64_t> split_runs(const int64_t* token_seq, int64_t num_tokens) {
  std::vector<int64_t> bounds{0};
  for (int64_t t = 1; t < num_tokens; ++t) {
    if (token_seq[t] != token_seq[t - 1] || t - bounds.back() == kMaxRun) bounds.push_back(t);
  }
  bounds.push_back(num_tokens);
  return bounds;
}

// How many parts a run's heads are split into, whole KV heads each: one where the runs alone keep every thread
// busy, else the fewest that give each thread an item (a decode step of one sequence: its heads over the threads,
// each reading its own columns of the slot rows)
inline int64_t head_parts(int64_t num_runs, int64_t num_kv_heads, int64_t num_threads) {
  int64_t parts = 1;
  while (num_runs * parts < num_threads && parts < num_kv_heads) {
    ++parts;
    while (num_kv_heads % parts != 0) ++parts;
  }
  return parts;
}

template <typename T>
void attend(const T* q, const T* k_new, const T* v_new, T* k_cache, T* v_cache, const int64_t* slot_mapping,
            const int64_t* block_tables, const int64_t* token_seq, const int64_t* key_start,
            const int64_t* key_end, const int64_t* tree_base, const int64_t* tree_bits, T* out, const Shape& s,
            double scale) {
  if (s.num_tokens == 0) return;
  once([&] { write_kv(k_new, v_new, k_cache, v_cache, slot_mapping, s); });
  const int64_t dim = s.head_dim, group = s.num_heads / s.num_kv_heads, row = s.num_kv_heads * dim;
  const RunFn<T> run_vector_fn = run_fn<T>(dim);
  const std::vector<int64_t> bounds = split_runs(token_seq, s.num_tokens);
  const int64_t num_runs = int64_t(bounds.size()) - 1;
  const int64_t num_parts = run_vector_fn != nullptr ? head_parts(num_runs, s.num_kv_heads, s.num_threads) : 1;
  const int64_t part_kv_heads = s.num_kv_heads / num_parts, part_heads = part_kv_heads * group;
  const int64_t num_items = num_runs * num_parts;
  struct Scratch {  // a thread's, kept from call to call: their buffers are allocated once, not every layer
    std::vector<typename Accum<T>::type> scores;
    std::vector<f32x16> acc;
    std::vector<int64_t> key_rows;  // [keys]: element offset of each key's slot row in the cache
    std::vector<int64_t> token_rows;  // the scalar path: the rows one token sees
    std::vector<Visibility> seen;
  };
  // runs, and parts of their heads, are independent once the K/V are written: spread over the threads (each
  // on one thread; a head's bits depend neither on its run nor on its part), with scratch per thread
  auto scratch_of = []() -> Scratch& {
    thread_local Scratch scratch;
    return scratch;
  };
  parallel_items(num_items, s.num_threads, scratch_of, [&](Scratch& scratch, int64_t item) {
    auto& [scores, acc, key_rows, token_rows, seen] = scratch;
    const int64_t run = item / num_parts, part = item % num_parts;
    const int64_t first_token = bounds[run], run_len = bounds[run + 1] - first_token;
    const int64_t* table = block_tables + token_seq[first_token] * s.max_blocks;
    seen.resize(run_len);
    int64_t lo = key_start[first_token], hi = 0;
    for (int64_t r = 0; r < run_len; ++r) {
      const int64_t t = first_token + r;
      seen[r] = Visibility{key_start[t], key_end[t], tree_base[t], uint64_t(tree_bits[t])};
      lo = std::min(lo, seen[r].start);
      hi = std::max(hi, seen[r].last());
    }
    const int64_t num_keys = hi - lo;
    key_rows.resize(num_keys);
    int64_t block = lo / s.block_size, offset = lo % s.block_size;  // walked, not divided, per key
    for (int64_t j = 0; j < num_keys; ++j) {
      key_rows[j] = (table[block] * s.block_size + offset) * row;
      if (++offset == s.block_size) {
        offset = 0;
        ++block;
      }
    }
    if constexpr (std::is_same_v<typename Accum<T>::type, float>) {
      if (run_vector_fn != nullptr) {
        const int64_t head0 = part * part_heads, kv_column = part * part_kv_heads * dim;
        scores.resize(run_len * part_heads * num_keys);
        acc.resize(run_len * part_heads * (dim / 16));
        run_vector_fn(q + first_token * s.q_stride + head0 * dim, s.q_stride, k_cache + kv_column,
                      v_cache + kv_column, key_rows.data(), lo, num_keys, seen.data(), run_len, part_heads, group,
                      scale, scores.data(), acc.data(), out + first_token * s.num_heads * dim + head0 * dim,
                      s.num_heads * dim);
        return;
      }
    }
    scores.resize(num_keys);
    for (int64_t r = 0; r < run_len; ++r) {  // the scalar path, a token at a time over the keys it sees
      const int64_t t = first_token + r;
      token_rows.clear();
      for (int64_t pos = seen[r].start; pos < seen[r].last(); ++pos) {
        if (seen[r].sees(pos)) token_rows.push_back(key_rows[pos - lo]);
      }
      for (int64_t h = 0; h < s.num_heads; ++h) {
        const int64_t head_offset = (h / group) * dim;
        head_scalar(q + t * s.q_stride + h * dim, k_cache + head_offset, v_cache + head_offset, token_rows.data(),
                    int64_t(token_rows.size()), dim, scale, scores.data(), out + (t * s.num_heads + h) * dim);
      }
    }
  });
}

}  // namespace

#define SPECFLEET_ATTENTION_ENTRY(NAME, T)                                                                   \
  extern "C" void NAME(const void* q, const void* k_new, const void* v_new, void* k_cache, void* v_cache,   \
                       const int64_t* slot_mapping, const int64_t* block_tables, const int64_t* token_seq,   \
                       const int64_t* key_start, const int64_t* key_end, const int64_t* tree_base,          \
                       const int64_t* tree_bits, void* out, const int64_t* dims, double scale) {              \
    const Shape s{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8], dims[9]};\
    attend(static_cast<const T*>(q), static_cast<const T*>(k_new), static_cast<const T*>(v_new),             \
           static_cast<T*>(k_cache), static_cast<T*>(v_cache), slot_mapping, block_tables, token_seq,        \
           key_start, key_end, tree_base, tree_bits, static_cast<T*>(out), s, scale);                         \
  }

// dims: num_tokens, num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride, k_stride, v_stride,
// num_threads
SPECFLEET_ATTENTION_ENTRY(specfleet_paged_attention_f32, float)
SPECFLEET_ATTENTION_ENTRY(specfleet_paged_attention_f64, double)
SPECFLEET_ATTENTION_ENTRY(specfleet_paged_attention_bf16, uint16_t)
