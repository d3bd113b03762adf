// A Llama-family model's decoder layers for a pass of a few tokens, in one native call: for each layer,
// RMSNorm -> qkv -> rotary -> paged attention (paged_attention.cpp's kernel, in this same library) -> o-proj ->
// residual -> RMSNorm -> gate/up -> SiLU * up -> down -> residual. At one token a layer's ~25 tensor ops cost
// ~25 us each to dispatch from Python, more than the arithmetic; here a layer is a few loops over its weights.
//
// Layouts (row-major): h [T, hidden], the residual stream, read and overwritten; every weight [out, in] as
// nn.Linear holds it (qkv rows: q heads, then k heads, then v heads; gate_up rows: gate, then up); cos/sin
// tables [max_len, head_dim]; caches and the attention metadata as in paged_attention.cpp.
//
// Arithmetic mirrors the eager path (workers/models/llama.py) op by op: float32 stays float32 throughout; for
// bfloat16 every op's result is rounded to bfloat16 where the eager op's output tensor would be (a norm
// normalises in float32, rounds, then scales; rotary rounds x*cos and rotated*sin, then their sum; SiLU rounds
// before the product with up). Linear layers accumulate in float32 and round once, bias included, as oneDNN's
// product does. Sums run in another order than ATen's, so results match the eager path to rounding, not bit
// for bit.

#include "paged_attention.cpp"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPECFLEET_BF16_DOT 1
#endif

namespace {

constexpr int64_t kWeightRows = 4;  // weight rows per block: each x chunk loaded once for four dot products
constexpr int64_t kInputRows = 4;  // input rows per block: each weight chunk loaded once for four rows

// sums[r][j] = x[r] . w[j] for r < kRows input rows (row stride x_stride) and kWeightRows weight rows of K
template <typename T, int kRows>
void dot_block(const T* x, int64_t x_stride, const T* const* w, int64_t k_size, float (*sums)[kWeightRows]) {
  f32x16 acc[kRows][kWeightRows] = {};
  int64_t k = 0;
  for (; k + 16 <= k_size; k += 16) {
    f32x16 wv[kWeightRows];
    for (int64_t j = 0; j < kWeightRows; ++j) wv[j] = load16(w[j] + k);
    for (int r = 0; r < kRows; ++r) {
      const f32x16 xv = load16(x + r * x_stride + k);
      for (int64_t j = 0; j < kWeightRows; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kWeightRows; ++j) {
      float s = hsum(acc[r][j]);
      for (int64_t kk = k; kk < k_size; ++kk) s += load(x + r * x_stride + kk) * load(w[j] + kk);
      sums[r][j] = s;
    }
  }
}

#ifdef SPECFLEET_BF16_DOT
// bfloat16 pairs multiplied and summed into float32 lanes by the CPU's dot instruction (AVX512-BF16)
template <int kRows>
void dot_block_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* const* w, int64_t k_size,
                    float (*sums)[kWeightRows]) {
  __m512 acc[kRows][kWeightRows];
  for (int r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kWeightRows; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; k += 32) {
    const __mmask32 mask = k_size - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k_size - k)) - 1;
    __m512bh wv[kWeightRows];
    for (int64_t j = 0; j < kWeightRows; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[j] + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * x_stride + k);
      for (int64_t j = 0; j < kWeightRows; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kWeightRows; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}
#endif

template <typename T, int kRows>
void dot_rows(const T* x, int64_t x_stride, const T* const* w, int64_t k_size, float (*sums)[kWeightRows]) {
#ifdef SPECFLEET_BF16_DOT
  if constexpr (std::is_same_v<T, uint16_t>) {
    dot_block_bf16<kRows>(x, x_stride, w, k_size, sums);
    return;
  }
#endif
  dot_block<T, kRows>(x, x_stride, w, k_size, sums);
}

// out [M, N] = x [M, K] . w [N, K]^T (+ bias [N]), accumulated in float, rounded once
template <typename T>
void linear(const T* x, int64_t x_stride, int64_t m_size, const T* w, const T* bias, int64_t n_size,
            int64_t k_size, T* out) {
  float sums[kInputRows][kWeightRows];
  for (int64_t m0 = 0; m0 < m_size; m0 += kInputRows) {
    const int64_t rows = std::min(kInputRows, m_size - m0);
    const T* x_block = x + m0 * x_stride;
    for (int64_t n0 = 0; n0 < n_size; n0 += kWeightRows) {
      const T* w_rows[kWeightRows];  // past the last row: the last row again, its sums dropped
      for (int64_t j = 0; j < kWeightRows; ++j) w_rows[j] = w + std::min(n0 + j, n_size - 1) * k_size;
      switch (rows) {
        case 1: dot_rows<T, 1>(x_block, x_stride, w_rows, k_size, sums); break;
        case 2: dot_rows<T, 2>(x_block, x_stride, w_rows, k_size, sums); break;
        case 3: dot_rows<T, 3>(x_block, x_stride, w_rows, k_size, sums); break;
        default: dot_rows<T, 4>(x_block, x_stride, w_rows, k_size, sums); break;
      }
      const int64_t cols = std::min(kWeightRows, n_size - n0);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < cols; ++j) {
          const float value = bias != nullptr ? sums[r][j] + load(bias + n0 + j) : sums[r][j];
          store(out + (m0 + r) * n_size + n0 + j, value);
        }
      }
    }
  }
}

inline float rounded(float x, const float*) { return x; }  // float32: every result is already a float32
inline float rounded(float x, const uint16_t*) {  // bfloat16: x as the bfloat16 an eager op would hold
  uint16_t half;
  store(&half, x);
  return load(&half);
}

// out [T, n] = RMSNorm(x) * weight
template <typename T>
void rms_norm(const T* x, const T* weight, int64_t num_tokens, int64_t n, float eps, T* out) {
  const T* tag = nullptr;
  std::vector<float> row(n);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < n; ++i) row[i] = load(x + t * n + i) * load(x + t * n + i);
    const float inv_rms = 1.0f / std::sqrt(sum(row.data(), n) / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      const float normed = rounded(load(x + t * n + i) * inv_rms, tag);
      store(out + t * n + i, load(weight + i) * normed);
    }
  }
}

// q and k heads of each token's qkv row rotated in place: x * cos + rotate_half(x) * sin
template <typename T>
void rotate(T* qkv, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim, const T* cos_table,
            const T* sin_table, const int64_t* positions) {
  const T* tag = nullptr;
  const int64_t half = head_dim / 2;
  std::vector<float> x(head_dim);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* cos = cos_table + positions[t] * head_dim;
    const T* sin = sin_table + positions[t] * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
      T* head = qkv + t * row_stride + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) x[d] = load(head + d);
      for (int64_t d = 0; d < head_dim; ++d) {
        const float other = d < half ? -x[d + half] : x[d - half];
        store(head + d, rounded(x[d] * load(cos + d), tag) + rounded(other * load(sin + d), tag));
      }
    }
  }
}

// h += update, element by element, rounded as the eager add
template <typename T>
void add_into(T* h, const T* update, int64_t count) {
  for (int64_t i = 0; i < count; ++i) store(h + i, load(h + i) + load(update + i));
}

// act [T, I] = SiLU(gate) * up, from gate_up [T, 2 I]
template <typename T>
void silu_mul(const T* gate_up, int64_t num_tokens, int64_t inter, T* act) {
  const T* tag = nullptr;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < inter; ++i) {
      const float gate = load(gate_up + t * 2 * inter + i);
      const float silu = rounded(gate / (1.0f + std::exp(-gate)), tag);
      store(act + t * inter + i, silu * load(gate_up + t * 2 * inter + inter + i));
    }
  }
}

// one layer's tensors, as data pointers in this order (0 for an absent bias)
enum LayerTensor : int64_t {
  kInputNorm, kQkvWeight, kQkvBias, kOWeight, kOBias, kPostNorm, kGateUpWeight, kGateUpBias, kDownWeight,
  kDownBias, kKCache, kVCache, kNumLayerTensors
};

struct DecodeShape {
  int64_t num_tokens, hidden, num_heads, num_kv_heads, head_dim, inter, num_layers, block_size, max_blocks;
  int64_t num_threads;  // for attention's runs (OpenMP)
};

template <typename T>
void decode_layers(T* h, const int64_t* layer_tensors, const T* cos_table, const T* sin_table,
                   const int64_t* positions, const int64_t* slot_mapping, const int64_t* block_tables,
                   const int64_t* token_seq, const int64_t* key_start, const int64_t* key_end,
                   const int64_t* tree_base, const int64_t* tree_bits, const DecodeShape& s, double eps,
                   double scale) {
  const int64_t num_tokens = s.num_tokens, q_size = s.num_heads * s.head_dim;
  const int64_t kv_size = s.num_kv_heads * s.head_dim, qkv_size = q_size + 2 * kv_size;
  std::vector<T> normed(num_tokens * s.hidden), qkv(num_tokens * qkv_size), attn(num_tokens * q_size);
  std::vector<T> update(num_tokens * s.hidden), gate_up(num_tokens * 2 * s.inter), act(num_tokens * s.inter);
  const Shape attention{num_tokens, s.num_heads, s.num_kv_heads, s.head_dim, s.block_size, s.max_blocks,
                        qkv_size, qkv_size, qkv_size, s.num_threads};
  const float eps_f = float(eps);
  for (int64_t layer = 0; layer < s.num_layers; ++layer) {
    const int64_t* tensors = layer_tensors + layer * kNumLayerTensors;
    auto weight = [&](LayerTensor which) { return reinterpret_cast<const T*>(tensors[which]); };
    rms_norm(h, weight(kInputNorm), num_tokens, s.hidden, eps_f, normed.data());
    linear(normed.data(), s.hidden, num_tokens, weight(kQkvWeight), weight(kQkvBias), qkv_size, s.hidden, qkv.data());
    rotate(qkv.data(), qkv_size, num_tokens, s.num_heads + s.num_kv_heads, s.head_dim, cos_table, sin_table, positions);
    attend(qkv.data(), qkv.data() + q_size, qkv.data() + q_size + kv_size, reinterpret_cast<T*>(tensors[kKCache]),
           reinterpret_cast<T*>(tensors[kVCache]), slot_mapping, block_tables, token_seq, key_start, key_end,
           tree_base, tree_bits, attn.data(), attention, scale);
    linear(attn.data(), q_size, num_tokens, weight(kOWeight), weight(kOBias), s.hidden, q_size, update.data());
    add_into(h, update.data(), num_tokens * s.hidden);
    rms_norm(h, weight(kPostNorm), num_tokens, s.hidden, eps_f, normed.data());
    linear(normed.data(), s.hidden, num_tokens, weight(kGateUpWeight), weight(kGateUpBias), 2 * s.inter, s.hidden,
           gate_up.data());
    silu_mul(gate_up.data(), num_tokens, s.inter, act.data());
    linear(act.data(), s.inter, num_tokens, weight(kDownWeight), weight(kDownBias), s.hidden, s.inter, update.data());
    add_into(h, update.data(), num_tokens * s.hidden);
  }
}

}  // namespace

#define SPECFLEET_DECODE_ENTRY(NAME, T)                                                                       \
  extern "C" void NAME(void* h, const int64_t* layer_tensors, const void* cos_table, const void* sin_table,   \
                       const int64_t* positions, const int64_t* slot_mapping, const int64_t* block_tables,    \
                       const int64_t* token_seq, const int64_t* key_start, const int64_t* key_end,           \
                       const int64_t* tree_base, const int64_t* tree_bits, const int64_t* dims, double eps,  \
                       double scale) {                                                                       \
    const DecodeShape s{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8], dims[9]}; \
    decode_layers(static_cast<T*>(h), layer_tensors, static_cast<const T*>(cos_table),                     \
                  static_cast<const T*>(sin_table), positions, slot_mapping, block_tables, token_seq,         \
                  key_start, key_end, tree_base, tree_bits, s, eps, scale);                                  \
  }

// dims: num_tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate, num_layers, block_size,
// max_blocks, num_threads
SPECFLEET_DECODE_ENTRY(specfleet_decode_layers_f32, float)
SPECFLEET_DECODE_ENTRY(specfleet_decode_layers_bf16, uint16_t)

// out [M, N] = x [M, K] . w [N, K]^T (+ bias [N]): the layers' product on its own (tests, benchmarks)
#define SPECFLEET_LINEAR_ENTRY(NAME, T)                                                                      \
  extern "C" void NAME(const void* x, const void* w, const void* bias, void* out, int64_t m_size,            \
                       int64_t n_size, int64_t k_size) {                                                     \
    linear(static_cast<const T*>(x), k_size, m_size, static_cast<const T*>(w), static_cast<const T*>(bias),  \
           n_size, k_size, static_cast<T*>(out));                                                            \
  }

SPECFLEET_LINEAR_ENTRY(specfleet_linear_f32, float)
SPECFLEET_LINEAR_ENTRY(specfleet_linear_bf16, uint16_t)
