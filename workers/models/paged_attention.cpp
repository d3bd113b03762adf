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
#include <vector>

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

struct Shape {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_stride, k_stride, v_stride;
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

template <typename T>
void attend(const T* q, const T* k_new, const T* v_new, T* k_cache, T* v_cache, const int64_t* slot_mapping,
            const int64_t* block_tables, const int64_t* token_seq, const int64_t* key_start,
            const int64_t* key_end, T* out, const Shape& s, double scale) {
  using A = typename Accum<T>::type;
  write_kv(k_new, v_new, k_cache, v_cache, slot_mapping, s);
  const int64_t dim = s.head_dim, group = s.num_heads / s.num_kv_heads, row = s.num_kv_heads * dim;
  std::vector<A> q_row(dim), acc(dim), scores;
  std::vector<int64_t> key_rows;  // [keys]: element offset of each visible key's slot in the cache
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const int64_t* table = block_tables + token_seq[t] * s.max_blocks;
    const int64_t first = key_start[t], num_keys = key_end[t] - key_start[t];
    key_rows.resize(num_keys);
    scores.resize(num_keys);
    for (int64_t j = 0; j < num_keys; ++j) {
      const int64_t pos = first + j;
      key_rows[j] = (table[pos / s.block_size] * s.block_size + pos % s.block_size) * row;
    }
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const int64_t head_offset = (h / group) * dim;
      const T* q_head = q + t * s.q_stride + h * dim;
      for (int64_t d = 0; d < dim; ++d) q_row[d] = A(load(q_head + d));
      A max_score = -std::numeric_limits<A>::infinity();
      for (int64_t j = 0; j < num_keys; ++j) {
        scores[j] = dot(q_row.data(), k_cache + key_rows[j] + head_offset, dim) * A(scale);
        max_score = std::max(max_score, scores[j]);
      }
      for (int64_t j = 0; j < num_keys; ++j) scores[j] = exp_nonpositive(scores[j] - max_score);
      const A total = sum(scores.data(), num_keys);
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t j = 0; j < num_keys; ++j) {
        const T* v_head = v_cache + key_rows[j] + head_offset;
        const A p = scores[j];
        for (int64_t d = 0; d < dim; ++d) acc[d] += p * A(load(v_head + d));
      }
      T* out_head = out + (t * s.num_heads + h) * dim;
      const A inv_total = num_keys > 0 ? A(1) / total : A(0);
      for (int64_t d = 0; d < dim; ++d) store(out_head + d, acc[d] * inv_total);
    }
  }
}

}  // namespace

#define SPECFLEET_ATTENTION_ENTRY(NAME, T)                                                                   \
  extern "C" void NAME(const void* q, const void* k_new, const void* v_new, void* k_cache, void* v_cache,   \
                       const int64_t* slot_mapping, const int64_t* block_tables, const int64_t* token_seq,   \
                       const int64_t* key_start, const int64_t* key_end, void* out, const int64_t* dims,    \
                       double scale) {                                                                        \
    const Shape s{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8]};         \
    attend(static_cast<const T*>(q), static_cast<const T*>(k_new), static_cast<const T*>(v_new),             \
           static_cast<T*>(k_cache), static_cast<T*>(v_cache), slot_mapping, block_tables, token_seq,        \
           key_start, key_end, static_cast<T*>(out), s, scale);                                               \
  }

// dims: num_tokens, num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride, k_stride, v_stride
SPECFLEET_ATTENTION_ENTRY(specfleet_paged_attention_f32, float)
SPECFLEET_ATTENTION_ENTRY(specfleet_paged_attention_f64, double)
SPECFLEET_ATTENTION_ENTRY(specfleet_paged_attention_bf16, uint16_t)
