// A Llama-family model's decoder layers for one forward pass, in one native call: for each layer,
// RMSNorm -> qkv -> rotary -> paged attention (paged_attention.cpp's kernel, in this same library) -> o-proj ->
// residual -> RMSNorm -> gate/up -> SiLU * up -> down -> residual. At one token a layer's ~25 tensor ops cost
// ~25 us each to dispatch from Python, more than the arithmetic; here a layer is a few loops over its weights.
//
// Layouts (row-major): h [T, hidden], the residual stream, read and overwritten; every linear weight packed as
// described at linear() below from nn.Linear's [out, in] (qkv outputs: q heads, then k heads, then v heads;
// gate_up outputs: gate, then up); norm weights and biases as the model holds them; cos/sin tables [max_len,
// head_dim]; caches and the attention metadata as in paged_attention.cpp.
//
// Arithmetic mirrors the eager path (workers/models/llama.py) op by op: float32 stays float32 throughout; for
// bfloat16 every op's result is rounded to bfloat16 where the eager op's output tensor would be (a norm
// normalises in float32, rounds, then scales; rotary rounds x*cos and rotated*sin, then their sum; SiLU rounds
// before the product with up). Linear layers accumulate in float32 and round once, bias included, as oneDNN's
// product does. Sums run in another order than ATen's, so results match the eager path to rounding, not bit
// for bit.

#include "paged_attention.cpp"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SPECFLEET_AVX2_COLUMNS 1  // float32 products in blocks sized for 16 vector registers (linear_avx2)
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPECFLEET_BF16_DOT 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define SPECFLEET_AMX 1
#endif
#endif

namespace {

// ---- linear layers over weights packed once at bind time (fused_decode.py), so that a vector of 16 outputs
// accumulates with no horizontal sums: x [M, K] . W [N, K]^T, N padded with zero rows to a multiple of 64 and
// stored a tile of 64 outputs after another, each tile one contiguous stream (what a decode step reads once):
//   pairs layout (bfloat16 where the CPU has AVX512-BF16): [N_pad / 64, K2, 64, 2]; element (t, k2, n, i) is
//     W[64 t + n, 2 k2 + i] (0 past K), K2 = ceil(K / 2) rounded up to a multiple of pair_multiple() (16 for AMX
//     tiles): one dot instruction multiplies 16 outputs' pairs by a broadcast pair of x
//   columns layout (float32, and bfloat16 elsewhere): [N_pad / 64, K, 64]; element (t, k, n) is W[64 t + n, k]
constexpr int64_t kOutputs = 16;  // outputs per vector
constexpr int kMaxRows = 4;  // input rows per tile: each weight vector loaded once for them all
constexpr int kMaxVectors = 4;  // output vectors per tile: independent sums in flight (the dot's latency)
constexpr int64_t kTileOutputs = kOutputs * kMaxVectors;

inline int64_t padded_outputs(int64_t n_size) { return (n_size + kTileOutputs - 1) / kTileOutputs * kTileOutputs; }

#if defined(__AVX2__) || defined(__AVX512F__)
// requests every cache line of a weight tile's row `rows_ahead` rows (k) past w_k: a pass of several rows reads
// a tile a block of rows at a time, which the hardware prefetchers follow poorly from memory (linear_avx2,
// linear_wide)
template <typename T>
inline void prefetch_tile_row(const T* w_k, int64_t rows_ahead) {
  const char* ahead = reinterpret_cast<const char*>(w_k + rows_ahead * kTileOutputs);
  for (int64_t line = 0; line < kTileOutputs * int64_t(sizeof(T)); line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}
#endif

// acc[r][b] += x[r] . W[n0 + 16 b .. +16], the columns layout
template <typename T, int kRows>
void tile_columns(const T* x, int64_t x_stride, const T* w_tile, int64_t k_size, f32x16 (*acc)[kMaxVectors]) {
  constexpr int kVectors = kMaxVectors;
  f32x16 sums[kRows][kVectors] = {};  // in registers: acc may alias x or w as far as the compiler knows
  for (int64_t k = 0; k < k_size; ++k) {
    f32x16 wv[kVectors];
    for (int b = 0; b < kVectors; ++b) wv[b] = load16(w_tile + k * kTileOutputs + kOutputs * b);
    for (int r = 0; r < kRows; ++r) {
      const float xk = load(x + r * x_stride + k);
      for (int b = 0; b < kVectors; ++b) sums[r][b] += xk * wv[b];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < kVectors; ++b) acc[r][b] = sums[r][b];
  }
}

#ifdef SPECFLEET_BF16_DOT
// the pairs layout: bfloat16 pairs multiplied and summed into float32 lanes by the CPU's dot instruction
template <int kRows>
void tile_pairs(const uint16_t* x, int64_t x_stride, const uint16_t* w_tile, int64_t k_size,
                f32x16 (*acc)[kMaxVectors]) {
  constexpr int kVectors = kMaxVectors;
  __m512 sums[kRows][kVectors];
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < kVectors; ++b) sums[r][b] = _mm512_setzero_ps();
  }
  // a pair of x is the 32 bits at x + 2 k2: broadcast straight from memory (a load-port broadcast, no ALU work
  // beside the dot instructions); an odd K's last pair is built with a zero past K
  auto step = [&](int64_t k2, auto pair_of) {
    __m512bh wv[kVectors];
    for (int b = 0; b < kVectors; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w_tile + (k2 * kTileOutputs + kOutputs * b) * 2);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair_of(x + r * x_stride + 2 * k2));
      for (int b = 0; b < kVectors; ++b) sums[r][b] = _mm512_dpbf16_ps(sums[r][b], xv, wv[b]);
    }
  };
  const int64_t num_whole = k_size / 2;
  for (int64_t k2 = 0; k2 < num_whole; ++k2) {
    step(k2, [](const uint16_t* xr) {
      int32_t pair;
      std::memcpy(&pair, xr, sizeof pair);
      return pair;
    });
  }
  if (k_size % 2) step(num_whole, [](const uint16_t* xr) { return int32_t(xr[0]); });  // 0 past K
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < kVectors; ++b) _mm512_storeu_ps(reinterpret_cast<float*>(&acc[r][b]), sums[r][b]);
  }
}
#endif

#ifdef SPECFLEET_AMX
// ---- the pairs layout through AMX tiles (a 16 x 16 float tile += 16 rows x 32 bfloat16 . 16 pairs x 16
// outputs per instruction), for every pass, one row included: each row's sums then run in the same order
// whatever the pass's size, so a token gets the same bits decoded alone, in a batch or in a prefill. The pairs
// layout's pair count is padded to a multiple of kAmxPairs (pack_weight) so whole tiles load. Linux hands a
// process the tile state only on request.
constexpr int64_t kAmxRows = 16;  // rows of x per tile
constexpr int64_t kAmxPairs = 16;  // pairs of K per tile step (32 elements)

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;  // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPermission, kTileData) == 0;
  }();
  return permitted;
}

// this thread's tile shapes for tile_amx over `rows` rows of x: tiles 0-3 the sums, 4 the x rows, 5 the
// weights. A product loads them once per thread, and again only where the row count changes: loaded per
// 64-output tile, they cost ~6 % of a one-row pass.
void configure_tiles(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = uint8_t(rows);
    config.colsb[t] = 64;
  }
  config.rows[5] = kAmxPairs;
  config.colsb[5] = 64;
  _tile_loadconfig(&config);
}

// rows x 64 outputs of x [rows, K_pad] (zero-padded, row stride k_pad) . one weight tile [K2, 64, 2] (K2 =
// K_pad / 2), with the tiles configured for `rows` (configure_tiles)
void tile_amx(const uint16_t* x, int64_t k_pad, const uint16_t* w_tile, float* sums /* [rows, 64] */) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr int64_t kPairRowBytes = kTileOutputs * 2 * int64_t(sizeof(uint16_t));
  constexpr int64_t kStepBytes = kAmxPairs * kPairRowBytes;  // the weights one step reads: 4 KB, contiguous
  for (int64_t k2 = 0; k2 < k_pad / 2; k2 += kAmxPairs) {
    _tile_loadd(4, x + 2 * k2, k_pad * int64_t(sizeof(uint16_t)));
    const uint16_t* w_step = w_tile + k2 * kTileOutputs * 2;
    // each weight load below takes a 64-byte column of all 16 pair rows, so the four together walk the step's
    // block across its width; requesting the block's lines first puts them all in flight at once. The window
    // (from the block's ninth line through the next block's eighth) measured best of those tried (0.5-4 KB
    // ahead, 1 or 4 KB long). Bits unchanged; one-row passes 0-14 % faster, most when memory is contended
    const char* ahead = reinterpret_cast<const char*>(w_step) + kStepBytes / 8;
    for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(5, w_step, kPairRowBytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, w_step + 2 * kOutputs, kPairRowBytes);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, w_step + 4 * kOutputs, kPairRowBytes);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, w_step + 6 * kOutputs, kPairRowBytes);
    _tile_dpbf16ps(3, 4, 5);
  }
  constexpr int64_t kSumStride = kTileOutputs * int64_t(sizeof(float));
  _tile_stored(0, sums, kSumStride);
  _tile_stored(1, sums + kOutputs, kSumStride);
  _tile_stored(2, sums + 2 * kOutputs, kSumStride);
  _tile_stored(3, sums + 3 * kOutputs, kSumStride);
}

// the whole product through tiles; false (nothing written) where the process may not use them
bool linear_amx(const uint16_t* x, int64_t x_stride, int64_t m_size, const uint16_t* w_packed, const uint16_t* bias,
                int64_t n_size, int64_t k_size, uint16_t* out, int64_t num_threads) {
  if (!amx_permitted()) return false;
  const int64_t k_pad = (k_size + 2 * kAmxPairs - 1) / (2 * kAmxPairs) * (2 * kAmxPairs);
  std::vector<uint16_t> x_padded(m_size * k_pad, 0);  // [M, K_pad]: whole tiles of x, zeros past K
  for (int64_t m = 0; m < m_size; ++m) std::memcpy(&x_padded[m * k_pad], x + m * x_stride, k_size * sizeof(uint16_t));
  const int64_t num_tiles = padded_outputs(n_size) / kTileOutputs;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_tiles > 1)
  {
    alignas(64) float sums[kAmxRows * kTileOutputs];
    int64_t configured_rows = 0;  // none yet in this thread
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t n0 = t * kTileOutputs, cols = std::min(kTileOutputs, n_size - n0);
      for (int64_t m0 = 0; m0 < m_size; m0 += kAmxRows) {
        const int64_t rows = std::min(kAmxRows, m_size - m0);
        if (rows != configured_rows) {
          configure_tiles(rows);
          configured_rows = rows;
        }
        tile_amx(&x_padded[m0 * k_pad], k_pad, w_packed + t * (k_pad / 2) * kTileOutputs * 2, sums);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < cols; ++j) {
            const float value = sums[r * kTileOutputs + j];
            store(out + (m0 + r) * n_size + n0 + j, bias != nullptr ? value + load(bias + n0 + j) : value);
          }
        }
      }
    }
    _tile_release();
  }
  return true;
}
#endif

#ifdef SPECFLEET_AVX2_COLUMNS
// ---- float32 columns on AVX2. With 16 vector registers the 16-wide tiles above spill (a 4-row tile holds 32
// registers of sums): measured 3.7x slower than oneDNN at one row and 13x at 512. Here a block of kRows rows x
// kVecs * 8 outputs of a weight tile sums in registers: the rows' x broadcast once a k, then each weight vector
// loaded once into a register and multiplied into every row (kRows * kVecs sums + kRows broadcasts + 1 weight
// vector = 16 registers). Each output is still one FMA chain over k in order, as in tile_columns: a row's bits do
// not depend on the block it falls in, nor on the pass's size.
// 3 rows x 32 outputs, not 6 x 16 (as until 2026-12-07): the same 12 sums, but a tile is read in two passes of
// half its width instead of four of a quarter (the first from memory, the others from cache, each touching a
// strided part of every row), and a k takes 7 loads for 12 multiply-adds instead of 8. A layer stack's products
// (the demo target's 12 layers, float32) on a 2-core AVX2 EPYC, one thread / two: 2 rows 1.29x / 1.23x faster,
// 3-6 rows 1.14-1.33x / 1.08-1.21x, 8-16 rows 1.12-1.21x / 1.13-1.16x, 33 rows 1.10x / 1.09x, one row the same
// (its own block); the same bits.
constexpr int kAvx2Rows = 3;  // rows per block of a pass of several rows
constexpr int kAvx2Vecs = 4;  // vectors of 8 outputs per block: a tile (64 outputs) in two column groups
static_assert(kAvx2Rows * kAvx2Vecs + kAvx2Rows + 1 <= 16,
              "a block's sums, its rows' broadcasts and one weight vector fit the 16 registers");

// a pass of several rows reads a tile a column group at a time (then 64 bytes of each 256-byte row, now 128),
// which the hardware prefetchers follow poorly from memory: the first block over a tile requests each whole
// weight row this many rows (k) ahead (6 x 16 blocks, 16 rows of a layer's products from memory: 25 % faster; 4,
// 8 and 16 ahead within 10 % of each other; 3 x 32 blocks on the AVX2 EPYC: 0, 4, 16 and 64 ahead the same). One
// row's pass reads the rows whole and in order, and requesting them ahead made it slower (by 15 %)
constexpr int64_t kAvx2PrefetchRows = 4;

template <int kRows, int kVecs, bool kPrefetch = false>
inline void block_avx2(const float* x, int64_t x_stride, const float* w /* [K, 64] from a column */, int64_t k_size,
                       float* sums /* [kRows, kTileOutputs] from the same column */) {
  __m256 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; ++k) {
    const float* w_k = w + k * kTileOutputs;
    if constexpr (kPrefetch) prefetch_tile_row(w_k, kAvx2PrefetchRows);
    __m256 xr[kRows];
    for (int r = 0; r < kRows; ++r) xr[r] = _mm256_broadcast_ss(x + r * x_stride + k);
    for (int v = 0; v < kVecs; ++v) {
      __m256 wv = _mm256_loadu_ps(w_k + 8 * v);
      // in a register, so each row's multiply-add reads it there: with the sums using 12 of the 16 registers,
      // GCC otherwise folds the load into every multiply-add (kRows loads of the same vector)
      asm("" : "+x"(wv));
      for (int r = 0; r < kRows; ++r) acc[r][v] = _mm256_fmadd_ps(xr[r], wv, acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(sums + r * kTileOutputs + 8 * v, acc[r][v]);
  }
}

// rows x (kAvx2Vecs * 8) outputs from the column of w / sums they start at
template <bool kPrefetch>
inline void rows_avx2(int64_t rows, const float* x, int64_t x_stride, const float* w, int64_t k_size, float* sums) {
  switch (rows) {
    case 1: block_avx2<1, kAvx2Vecs, kPrefetch>(x, x_stride, w, k_size, sums); break;
    case 2: block_avx2<2, kAvx2Vecs, kPrefetch>(x, x_stride, w, k_size, sums); break;
    default: block_avx2<kAvx2Rows, kAvx2Vecs, kPrefetch>(x, x_stride, w, k_size, sums); break;
  }
}

// out [M, N] = x [M, K] . W^T (+ bias), W in the columns layout. One or two rows read each tile whole (8 vectors
// of sums a row, the weights streamed in order); more rows take a tile a column group at a time, every block of
// rows over the group's weights while they are in cache
void linear_avx2(const float* x, int64_t x_stride, int64_t m_size, const float* w_packed, const float* bias,
                 int64_t n_size, int64_t k_size, float* out, int64_t num_threads) {
  constexpr int64_t kGroup = 8 * kAvx2Vecs;  // outputs per column group
  const int64_t num_tiles = padded_outputs(n_size) / kTileOutputs;
  parallel_for(num_tiles, num_threads, [&](int64_t t) {
    alignas(32) float sums[kAvx2Rows * kTileOutputs];
    const float* w_tile = w_packed + t * k_size * kTileOutputs;
    const int64_t n0 = t * kTileOutputs, cols = std::min(kTileOutputs, n_size - n0);
    auto write = [&](int64_t m0, int64_t rows, int64_t c0, int64_t c1) {  // sums' rows x columns [c0, c1)
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = c0; j < c1; ++j) {
          const float value = sums[r * kTileOutputs + j];
          out[(m0 + r) * n_size + n0 + j] = bias != nullptr ? value + bias[n0 + j] : value;
        }
      }
    };
    if (m_size == 1) {
      block_avx2<1, kTileOutputs / 8>(x, x_stride, w_tile, k_size, sums);
      write(0, 1, 0, cols);
      return;
    }
    if (m_size == 2) {  // a verify of one draft token: the whole tile in one pass as well, as one row's is
      // 16 sums + 2 broadcasts + 1 weight vector: GCC keeps 3 sums on the stack (L1), which costs less than a
      // second pass over the tile. A 2-row pass costs about what a 1-row one does: the memory stream, not the
      // multiply-adds, bounds both. The 12-layer stack's products, both libraries in one process on the AVX2
      // EPYC: 1.35x / 1.26x faster than two 3 x 32 column groups (one thread / two); 3-6 rows the same way, in
      // full-tile passes of two rows, 1.02-1.11x, and in one pass of all rows slower (0.62-0.93x): not taken
      block_avx2<2, kTileOutputs / 8>(x, x_stride, w_tile, k_size, sums);
      write(0, 2, 0, cols);
      return;
    }
    for (int64_t c0 = 0; c0 < cols; c0 += kGroup) {
      for (int64_t m0 = 0; m0 < m_size; m0 += kAvx2Rows) {
        const int64_t rows = std::min<int64_t>(kAvx2Rows, m_size - m0);
        if (c0 == 0 && m0 == 0) {  // the tile's first block: it requests the whole tile
          rows_avx2<true>(rows, x, x_stride, w_tile, k_size, sums);
        } else {
          rows_avx2<false>(rows, x + m0 * x_stride, x_stride, w_tile + c0, k_size, sums + c0);
        }
        write(m0, rows, c0, std::min(c0 + kGroup, cols));
      }
    }
  });
}
#endif

#if defined(__AVX512F__)
// ---- the columns layout on AVX-512 (float32, and bfloat16 without the dot instruction), passes of several
// rows. tile_columns (above) takes 4 rows at a time and widens every x element and weight vector through
// generic vector code, which the compiler splits into 256-bit halves: ~60 instructions for 16 multiply-adds
// (perf, 16 decode rows of the demo target). Here a block of up to kWideRows rows x 64 outputs sums in 24
// registers, each weight row widened once for all its rows (load_row), x widened to float32 once a call by each
// thread (exact), the sums rounded and stored 16 at a time (write_outputs). Each output is the same FMA chain over
// k in order as tile_columns' (a one-row float32 pass still goes there): a row's bits do not depend on the path,
// the block it falls in, nor the pass's size. Against widening each vector with widen16, x once a tile and a
// scalar epilogue, bfloat16 products of the demo target's shapes ran 1.10-1.23x faster on one thread (1, 4 and
// 16 rows), 1.01-1.16x on two, the same bits (a Xeon with AVX-512, 2026-12-07).
constexpr int kWideRows = 6;  // 6 x 4 registers of sums, 4 of weights, 1 broadcast: 29 of the 32
constexpr int64_t kWidePrefetchRows = 4;  // the first block over a tile requests weight rows (k) this far ahead

// a weight row's 64 outputs as four float32 vectors of sums' lanes. float32: in output order. bfloat16: two
// 512-bit loads of 32 outputs each, a lane holding an even output in its low half and the next odd one in its high
// half; a shift gives the even outputs and a mask the odd ones, so the vectors are (even of 0..31, odd of 0..31,
// even of 32..63, odd of 32..63). Two vector operations a row instead of widen16's eight (a vpmovzxwd and a shift
// a vector), on the ports the multiply-adds use; store_lanes puts the sums back in output order
inline void load_row(const float* w_k, __m512 (&wv)[kMaxVectors]) {
  for (int b = 0; b < kMaxVectors; ++b) wv[b] = _mm512_loadu_ps(w_k + kOutputs * b);
}
inline void load_row(const uint16_t* w_k, __m512 (&wv)[kMaxVectors]) {
  const __m512i high_halves = _mm512_set1_epi32(int(0xffff0000u));
  for (int h = 0; h < 2; ++h) {
    const __m512i pairs = _mm512_loadu_si512(w_k + 2 * kOutputs * h);
    wv[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    wv[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_halves));
  }
}

// sums [64] in output order from a row's four vectors of lanes (load_row's order)
inline void store_lanes(const __m512 (&acc)[kMaxVectors], float* sums, const float*) {
  for (int b = 0; b < kMaxVectors; ++b) _mm512_storeu_ps(sums + kOutputs * b, acc[b]);
}
inline void store_lanes(const __m512 (&acc)[kMaxVectors], float* sums, const uint16_t*) {
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int h = 0; h < 2; ++h) {
    _mm512_storeu_ps(sums + 2 * kOutputs * h, _mm512_permutex2var_ps(acc[2 * h], first, acc[2 * h + 1]));
    _mm512_storeu_ps(sums + 2 * kOutputs * h + kOutputs, _mm512_permutex2var_ps(acc[2 * h], second, acc[2 * h + 1]));
  }
}

// sums [kRows, 64] = x [kRows, K] (float32, row stride x_stride) . the 64 outputs of a weight tile [K, 64]
template <typename T, int kRows, bool kPrefetch>
inline void block_wide(const float* x, int64_t x_stride, const T* w_tile, int64_t k_size, float* sums) {
  __m512 acc[kRows][kMaxVectors];
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < kMaxVectors; ++b) acc[r][b] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; ++k) {
    const T* w_k = w_tile + k * kTileOutputs;
    if constexpr (kPrefetch) prefetch_tile_row(w_k, kWidePrefetchRows);
    __m512 wv[kMaxVectors];
    load_row(w_k, wv);
    for (int r = 0; r < kRows; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + k]);
      for (int b = 0; b < kMaxVectors; ++b) acc[r][b] = _mm512_fmadd_ps(xr, wv[b], acc[r][b]);
    }
  }
  for (int r = 0; r < kRows; ++r) store_lanes(acc[r], sums + r * kTileOutputs, w_tile);
}

// out[j] = sums[j] (+ bias[j]) for j < cols, rounded to T as store() does, 16 at a time
inline __m512 vector_of(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 vector_of(const uint16_t* p, __mmask16 lanes) {
  if (lanes == 0xffff) return widen16(p);
  alignas(64) float part[kOutputs] = {};  // a tile's last outputs (N not a multiple of 64)
  for (int j = 0; j < kOutputs && ((lanes >> j) & 1); ++j) part[j] = load(p + j);
  return _mm512_load_ps(part);
}
inline void store_vector(float* p, __m512 v, __mmask16 lanes) { _mm512_mask_storeu_ps(p, lanes, v); }
inline void store_vector(uint16_t* p, __m512 v, __mmask16 lanes) {  // store()'s rounding: nearest even, NaN kept
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  _mm512_mask_cvtepi32_storeu_epi16(p, lanes, _mm512_mask_mov_epi32(rounded, nan, quiet));
}

template <typename T>
inline void write_outputs(const float* sums, const T* bias, int64_t cols, T* out) {
  for (int64_t j = 0; j < cols; j += kOutputs) {
    const __mmask16 lanes = cols - j >= kOutputs ? __mmask16(0xffff) : __mmask16((1u << (cols - j)) - 1);
    __m512 v = _mm512_loadu_ps(sums + j);
    if (bias != nullptr) v = _mm512_add_ps(v, vector_of(bias + j, lanes));
    store_vector(out + j, v, lanes);
  }
}

template <typename T, bool kPrefetch>
inline void rows_wide(int64_t rows, const float* x, int64_t x_stride, const T* w_tile, int64_t k_size, float* sums) {
  switch (rows) {
    case 1: block_wide<T, 1, kPrefetch>(x, x_stride, w_tile, k_size, sums); break;
    case 2: block_wide<T, 2, kPrefetch>(x, x_stride, w_tile, k_size, sums); break;
    case 3: block_wide<T, 3, kPrefetch>(x, x_stride, w_tile, k_size, sums); break;
    case 4: block_wide<T, 4, kPrefetch>(x, x_stride, w_tile, k_size, sums); break;
    case 5: block_wide<T, 5, kPrefetch>(x, x_stride, w_tile, k_size, sums); break;
    default: block_wide<T, kWideRows, kPrefetch>(x, x_stride, w_tile, k_size, sums); break;
  }
}

// linear_wide's work, in the calling thread, or shared out among the threads of the region it runs in (a region
// of one thread, where the runtime gave no more: each parallel_for then opens its own)
template <typename T>
void linear_wide_tiles(const T* x, int64_t x_stride, int64_t m_size, const T* w_packed, const T* bias,
                       int64_t n_size, int64_t k_size, T* out, int64_t num_threads) {
  const int64_t num_tiles = padded_outputs(n_size) / kTileOutputs;
  const float* x_rows = nullptr;  // x as float32 [M, x_rows_stride] (bfloat16: widened once, exact)
  int64_t x_rows_stride = x_stride;
  if constexpr (std::is_same_v<T, float>) {
    x_rows = x;
  } else {
    // each thread widens all of x for itself, once a call (the cost of one tile's), into its own cache: where
    // one thread did it for the others, a 16-row pass's products of 4 tiles on two threads ran ~15 % slower
    thread_local std::vector<float> widened;
    widened.resize(m_size * k_size);
    for (int64_t r = 0; r < m_size; ++r) {
      const T* row = x + r * x_stride;
      float* dst = widened.data() + r * k_size;
      int64_t k = 0;
      for (; k + kOutputs <= k_size; k += kOutputs) _mm512_storeu_ps(dst + k, widen16(row + k));
      for (; k < k_size; ++k) dst[k] = load(row + k);
    }
    x_rows = widened.data();
    x_rows_stride = k_size;
  }
  parallel_for(num_tiles, num_threads, [&](int64_t t) {
    alignas(64) float sums[kWideRows * kTileOutputs];
    const T* w_tile = w_packed + t * k_size * kTileOutputs;
    const int64_t n0 = t * kTileOutputs, cols = std::min(kTileOutputs, n_size - n0);
    for (int64_t m0 = 0; m0 < m_size; m0 += kWideRows) {
      const int64_t rows = std::min<int64_t>(kWideRows, m_size - m0);
      const float* block = x_rows + m0 * x_rows_stride;
      if (m0 == 0) {
        rows_wide<T, true>(rows, block, x_rows_stride, w_tile, k_size, sums);
      } else {
        rows_wide<T, false>(rows, block, x_rows_stride, w_tile, k_size, sums);
      }
      for (int64_t r = 0; r < rows; ++r) {
        write_outputs(sums + r * kTileOutputs, bias != nullptr ? bias + n0 : nullptr, cols, out + (m0 + r) * n_size + n0);
      }
    }
  });
}

// out [M, N] = x [M, K] . W^T (+ bias), W in the columns layout (float32: M > 1): each tile's rows in blocks of
// kWideRows
template <typename T>
void linear_wide(const T* x, int64_t x_stride, int64_t m_size, const T* w_packed, const T* bias, int64_t n_size,
                 int64_t k_size, T* out, int64_t num_threads) {
#ifdef _OPENMP
  // bfloat16 on several threads outside a region: one of its own, so that each thread widens x for itself
  if (!std::is_same_v<T, float> && num_threads > 1 && padded_outputs(n_size) > kTileOutputs && !in_region()) {
#pragma omp parallel num_threads(num_threads)
    linear_wide_tiles(x, x_stride, m_size, w_packed, bias, n_size, k_size, out, num_threads);
    return;
  }
#endif
  linear_wide_tiles(x, x_stride, m_size, w_packed, bias, n_size, k_size, out, num_threads);
}
#endif

template <typename T>
constexpr bool uses_pairs() {
#ifdef SPECFLEET_BF16_DOT
  return std::is_same_v<T, uint16_t>;
#else
  return false;
#endif
}

// whether this host's bfloat16 products go through AMX tiles (linear_amx, with a parallel region of its own)
template <typename T>
bool uses_amx() {
#ifdef SPECFLEET_AMX
  return std::is_same_v<T, uint16_t> && amx_permitted();
#else
  return false;
#endif
}

// the pair count K2 of a packed weight of K inputs (the pairs layout)
inline int64_t packed_pairs(int64_t k_size) {
#ifdef SPECFLEET_AMX
  return (k_size + 2 * kAmxPairs - 1) / (2 * kAmxPairs) * kAmxPairs;
#else
  return (k_size + 1) / 2;
#endif
}

// acc[r][b] = x[r] . the 64 outputs of weight tile t
template <typename T, int kRows>
void tile(const T* x, int64_t x_stride, const T* w_packed, int64_t t, int64_t k_size, f32x16 (*acc)[kMaxVectors]) {
#ifdef SPECFLEET_BF16_DOT
  if constexpr (uses_pairs<T>()) {
    tile_pairs<kRows>(x, x_stride, w_packed + t * packed_pairs(k_size) * kTileOutputs * 2, k_size, acc);
    return;
  }
#endif
  tile_columns<T, kRows>(x, x_stride, w_packed + t * k_size * kTileOutputs, k_size, acc);
}

// out [M, N] = x [M, K] . W^T (+ bias [N]) from W packed as above, accumulated in float, rounded once; output
// tiles spread over num_threads (OpenMP) when there are several
template <typename T>
void linear(const T* x, int64_t x_stride, int64_t m_size, const T* w_packed, const T* bias, int64_t n_size,
            int64_t k_size, T* out, int64_t num_threads) {
#ifdef SPECFLEET_AMX
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (linear_amx(x, x_stride, m_size, w_packed, bias, n_size, k_size, out, num_threads)) {
      return;
    }
  }
#endif
#if defined(__AVX512F__)
  // float32 rows go there from two rows on; bfloat16 rows from one (tile_columns widens each weight vector
  // through generic vector code: one-row products of the demo target's shapes ran 1.07-1.21x faster here, one
  // thread, on a Xeon with AVX-512; float32 ones 0.92-0.95x, so they stay). The same FMA chain either way
  if (!uses_pairs<T>() && (m_size > 1 || std::is_same_v<T, uint16_t>)) {
    linear_wide(x, x_stride, m_size, w_packed, bias, n_size, k_size, out, num_threads);
    return;
  }
#endif
#ifdef SPECFLEET_AVX2_COLUMNS
  if constexpr (std::is_same_v<T, float>) {
    linear_avx2(x, x_stride, m_size, w_packed, bias, n_size, k_size, out, num_threads);
    return;
  }
#endif
  const int64_t num_tiles = padded_outputs(n_size) / kTileOutputs;
  parallel_for(num_tiles, num_threads, [&](int64_t t) {
    const int64_t n0 = t * kTileOutputs, cols = std::min(kTileOutputs, n_size - n0);
    for (int64_t m0 = 0; m0 < m_size; m0 += kMaxRows) {
      f32x16 acc[kMaxRows][kMaxVectors] = {};
      const T* x_rows = x + m0 * x_stride;
      switch (std::min<int64_t>(kMaxRows, m_size - m0)) {
        case 1: tile<T, 1>(x_rows, x_stride, w_packed, t, k_size, acc); break;
        case 2: tile<T, 2>(x_rows, x_stride, w_packed, t, k_size, acc); break;
        case 3: tile<T, 3>(x_rows, x_stride, w_packed, t, k_size, acc); break;
        default: tile<T, 4>(x_rows, x_stride, w_packed, t, k_size, acc); break;
      }
      const int64_t rows = std::min<int64_t>(kMaxRows, m_size - m0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* sums = reinterpret_cast<const float*>(acc[r]);  // [64], output order
        for (int64_t j = 0; j < cols; ++j) {
          const float value = bias != nullptr ? sums[j] + load(bias + n0 + j) : sums[j];
          store(out + (m0 + r) * n_size + n0 + j, value);
        }
      }
    }
  });
}

inline float rounded(float x, const float*) { return x; }  // float32: every result is already a float32
inline float rounded(float x, const uint16_t*) {  // bfloat16: x as the bfloat16 an eager op would hold
  uint16_t half;
  store(&half, x);
  return load(&half);
}

// The elementwise ops below run their rows through parallel_for (paged_attention.cpp), spread over the threads
// where there are several: a row's arithmetic is the same whichever thread runs it, so its bits do not depend on
// the split. Serial, a 512-token prefill's norms, rotary, SiLU and residual adds were about a quarter of its
// native layers' time, one thread busy and the other waiting

// out [T, n] = RMSNorm(x) * weight
template <typename T>
void rms_norm(const T* x, const T* weight, int64_t num_tokens, int64_t n, float eps, T* out, int64_t num_threads) {
  parallel_for(num_tokens, num_threads, [&](int64_t t) {
    const T* tag = nullptr;
    thread_local std::vector<float> row;
    row.resize(n);
    for (int64_t i = 0; i < n; ++i) row[i] = load(x + t * n + i) * load(x + t * n + i);
    const float inv_rms = 1.0f / std::sqrt(sum(row.data(), n) / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      const float normed = rounded(load(x + t * n + i) * inv_rms, tag);
      store(out + t * n + i, load(weight + i) * normed);
    }
  });
}

// q and k heads of each token's qkv row rotated in place: x * cos + rotate_half(x) * sin
template <typename T>
void rotate(T* qkv, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim, const T* cos_table,
            const T* sin_table, const int64_t* positions, int64_t num_threads) {
  const int64_t half = head_dim / 2;
  parallel_for(num_tokens, num_threads, [&](int64_t t) {
    const T* tag = nullptr;
    thread_local std::vector<float> x;
    x.resize(head_dim);
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
  });
}

// h [T, n] += update [T, n], element by element, rounded as the eager add
template <typename T>
void add_into(T* h, const T* update, int64_t num_tokens, int64_t n, int64_t num_threads) {
  parallel_for(num_tokens, num_threads, [&](int64_t t) {
    T* out = h + t * n;
    const T* in = update + t * n;
    for (int64_t i = 0; i < n; ++i) store(out + i, load(out + i) + load(in + i));
  });
}

// SiLU(x) = x / (1 + e^-x), written with e = e^-|x| (the vectorisable exp of paged_attention.cpp, which takes
// arguments <= 0): x / (1 + e) for x >= 0, x e / (1 + e) below
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

// act [T, I] = SiLU(gate) * up, from gate_up [T, 2 I]
template <typename T>
void silu_mul(const T* gate_up, int64_t num_tokens, int64_t inter, T* act, int64_t num_threads) {
  parallel_for(num_tokens, num_threads, [&](int64_t t) {
    const T* tag = nullptr;
    const T* gate = gate_up + t * 2 * inter;
    const T* up = gate + inter;
    for (int64_t i = 0; i < inter; ++i) store(act + t * inter + i, rounded(silu(load(gate + i)), tag) * load(up + i));
  });
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
  // every layer in one parallel region where there are several threads: each step's loop shares out its items
  // among the region's threads (paged_attention.cpp, in_region), which wait for each other after it; two threads
  // then pay a barrier (~0.7 us) a step of a layer instead of opening and closing a region (~2 us), ~130 times a
  // pass. AMX products keep their own regions (linear_amx)
  auto every_layer = [&] {
    for (int64_t layer = 0; layer < s.num_layers; ++layer) {
      const int64_t* tensors = layer_tensors + layer * kNumLayerTensors;
      auto weight = [&](LayerTensor which) { return reinterpret_cast<const T*>(tensors[which]); };
      rms_norm(h, weight(kInputNorm), num_tokens, s.hidden, eps_f, normed.data(), s.num_threads);
      linear(normed.data(), s.hidden, num_tokens, weight(kQkvWeight), weight(kQkvBias), qkv_size, s.hidden, qkv.data(), s.num_threads);
      rotate(qkv.data(), qkv_size, num_tokens, s.num_heads + s.num_kv_heads, s.head_dim, cos_table, sin_table, positions,
             s.num_threads);
      attend(qkv.data(), qkv.data() + q_size, qkv.data() + q_size + kv_size, reinterpret_cast<T*>(tensors[kKCache]),
             reinterpret_cast<T*>(tensors[kVCache]), slot_mapping, block_tables, token_seq, key_start, key_end,
             tree_base, tree_bits, attn.data(), attention, scale);
      linear(attn.data(), q_size, num_tokens, weight(kOWeight), weight(kOBias), s.hidden, q_size, update.data(), s.num_threads);
      add_into(h, update.data(), num_tokens, s.hidden, s.num_threads);
      rms_norm(h, weight(kPostNorm), num_tokens, s.hidden, eps_f, normed.data(), s.num_threads);
      linear(normed.data(), s.hidden, num_tokens, weight(kGateUpWeight), weight(kGateUpBias), 2 * s.inter, s.hidden,
             gate_up.data(), s.num_threads);
      silu_mul(gate_up.data(), num_tokens, s.inter, act.data(), s.num_threads);
      linear(act.data(), s.inter, num_tokens, weight(kDownWeight), weight(kDownBias), s.hidden, s.inter, update.data(), s.num_threads);
      add_into(h, update.data(), num_tokens, s.hidden, s.num_threads);
    }
  };
  if (s.num_threads > 1 && !uses_amx<T>()) {
#pragma omp parallel num_threads(s.num_threads)
    every_layer();
  } else {
    every_layer();
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

namespace {

// out [S, N] float32 = LMHead(RMSNorm(h[rows])): the final norm and LM head over the pass's logits rows, the
// eager path's arithmetic (the head's product rounded to T, as the eager F.linear's output, then widened)
template <typename T>
void final_logits(const T* h, const int64_t* rows, int64_t num_rows, int64_t hidden, const T* norm_weight,
                  const T* w_packed, int64_t n_size, float eps, float* out, int64_t num_threads) {
  std::vector<T> picked(num_rows * hidden), normed(num_rows * hidden), logits(num_rows * n_size);
  for (int64_t r = 0; r < num_rows; ++r) {
    std::memcpy(picked.data() + r * hidden, h + rows[r] * hidden, hidden * sizeof(T));
  }
  rms_norm(picked.data(), norm_weight, num_rows, hidden, eps, normed.data(), num_threads);
  linear(normed.data(), hidden, num_rows, w_packed, static_cast<const T*>(nullptr), n_size, hidden, logits.data(),
         num_threads);
  for (int64_t i = 0; i < num_rows * n_size; ++i) out[i] = load(logits.data() + i);
}

}  // namespace

#define SPECFLEET_LOGITS_ENTRY(NAME, T)                                                                        \
  extern "C" void NAME(const void* h, const int64_t* rows, const void* norm_weight, const void* w_packed,     \
                       float* out, int64_t num_rows, int64_t hidden, int64_t n_size, double eps,             \
                       int64_t num_threads) {                                                                \
    final_logits(static_cast<const T*>(h), rows, num_rows, hidden, static_cast<const T*>(norm_weight),       \
                 static_cast<const T*>(w_packed), n_size, static_cast<float>(eps), out, num_threads);        \
  }

SPECFLEET_LOGITS_ENTRY(specfleet_final_logits_f32, float)
SPECFLEET_LOGITS_ENTRY(specfleet_final_logits_bf16, uint16_t)

// out [M, N] = x [M, K] . W^T (+ bias [N]), W packed: the layers' product on its own (tests, benchmarks)
#define SPECFLEET_LINEAR_ENTRY(NAME, T)                                                                      \
  extern "C" void NAME(const void* x, const void* w_packed, const void* bias, void* out, int64_t m_size,     \
                       int64_t n_size, int64_t k_size, int64_t num_threads) {                                \
    linear(static_cast<const T*>(x), k_size, m_size, static_cast<const T*>(w_packed),                       \
           static_cast<const T*>(bias), n_size, k_size, static_cast<T*>(out), num_threads);                 \
  }

SPECFLEET_LINEAR_ENTRY(specfleet_linear_f32, float)
SPECFLEET_LINEAR_ENTRY(specfleet_linear_bf16, uint16_t)

// how linear() reads a bfloat16 weight (fused_decode.py packs): 0 = the columns layout; else the pairs layout,
// its pair count padded to a multiple of this
extern "C" int64_t specfleet_linear_pairs_bf16() {
#ifdef SPECFLEET_AMX
  return kAmxPairs;
#else
  return uses_pairs<uint16_t>() ? 1 : 0;
#endif
}

#include "row_max.cpp"
