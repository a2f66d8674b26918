// dflash's own CPU kernels for bf16 decoding on x86 CPUs with AVX-512 BF16 or AVX2 (native.py loads them):
// dflash::bf16_linear (a dense bf16 weight times rows), dflash::int4_linear and int8_linear (4- and 8-bit weights
// times rows quantized to int8), dflash::attention (each row's block of queries over its
// own K/V) and dflash::argmax (each row's largest logit).
//
// A decode step multiplies one to a few dozen rows by every weight once, so its time is the weights' bytes over
// the memory bandwidth: bf16_linear reads each weight from memory once per call for all its rows (a tile of rows
// shares each load) and parallelizes over fixed blocks of outputs. A prefill's hundreds of rows are arithmetic-bound:
// there tiles take two outputs too, and each block of 16 outputs sums its lanes in one transposing tree. attention
// reads a row's keys in place, where a batched matrix product first copies them transposed.
//
// Every output is computed in one fixed order that depends on neither the row count, the row's place in a tile,
// nor the thread count: a row's result is bit-equal whether it runs alone or inside a verify block, which is what
// keeps bf16 speculative decoding lossless (engine/kernels/layers.py says why batch invariance matters).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Two tiers build every op: AVX-512 (BF16 and VNNI) and AVX2 (with FMA and F16C), the same operations in the same
// order, 16 and 8 lanes an instruction (engine/kernels/native.py picks the tier).
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define DFLASH_AVX512 1
#else
#define DFLASH_AVX512 0
#endif

namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

constexpr int kTask = 16;  // outputs per parallel task: fixed, so the split never depends on the threads

// The inputs past the last whole 64, in order, then bf16.
inline uint16_t finish(float s, const uint16_t* row, const uint16_t* weight, int64_t whole, int64_t K) {
  for (int64_t k = whole; k < K; ++k) s = std::fma(bf16_to_float(row[k]), bf16_to_float(weight[k]), s);
  return float_to_bf16(s);
}

#if DFLASH_AVX512
inline __m512 widen_bf16x16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

inline __m512 load_bf16x16(const uint16_t* p) {
  return widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// ---- bf16_linear: out [M, N] = x [M, K] . w [N, K]^T, bf16 in and out ---------------------------------------------
// Per output and row: VDPBF16PS over the row and weight as they are (each lane adds two exact products per
// instruction, in a fixed order, denormals flushed), 32 inputs a chunk, two accumulators over alternating chunks,
// added, then summed across lanes by one fixed halving tree (sum16); the inputs past the last whole 64 added after,
// in order; rounded to bf16 once.

// The lane sums of 16 vectors at once: lane 4k+m of the result is the sum of v[k+4m]'s lanes. Each vector is summed by
// the same halving tree (lane i with i+8, then i+4, i+2, i+1) whatever its neighbours, so a sum's bits depend on its
// own vector alone; a transposing tree costs about a third of 16 separate horizontal sums.
inline __m512 sum16(const __m512* v) {
  __m512 half[8], quarter[4], eighth[2];
  for (int p = 0; p < 8; ++p)  // [A 0-7 | B 0-7] + [A 8-15 | B 8-15]
    half[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                            _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
  for (int p = 0; p < 4; ++p)  // four vectors' lanes 0-3 + their lanes 4-7, one vector a 128-bit quarter
    quarter[p] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * p], half[2 * p + 1], 0x88),
                               _mm512_shuffle_f32x4(half[2 * p], half[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p)  // within each quarter: lanes 0, 1 + lanes 2, 3
    eighth[p] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * p], quarter[2 * p + 1], 0x44),
                              _mm512_shuffle_ps(quarter[2 * p], quarter[2 * p + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], 0x88), _mm512_shuffle_ps(eighth[0], eighth[1], 0xDD));
}

// One vector's lane sum by the same halving tree (what sum16 does for each of its 16).
inline float sum_lanes(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v), hi);                                    // i + (i+8)
  const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));      // + (i+4)
  const __m128 eighth = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));                          // + (i+2)
  return _mm_cvtss_f32(_mm_add_ss(eighth, _mm_movehdup_ps(eighth)));                                    // + (i+1)
}

constexpr int64_t kPairedRows = 8;  // from this many rows on, the many-row layout (measured: slower below)

// C outputs for R rows, before the lane sum: each weight chunk is shared by the R rows and each row chunk by the C
// outputs (fewer loads per product); every (row, output) keeps its own two accumulators, so the tile's shape
// changes no bits.
template <int R, int C>
void dot_tile(const uint16_t* x, int64_t K, const uint16_t* w, __m512* lanes /* [R][kTask], C consecutive */) {
  __m512 a[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c][0] = a[r][c][1] = _mm512_setzero_ps();
  const int64_t whole = K / 64 * 64;
  for (int64_t k = 0; k < whole; k += 64) {
    for (int half = 0; half < 2; ++half) {
      __m512bh wv[C];
      for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * K + k + half * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k + half * 32);
        for (int c = 0; c < C; ++c) a[r][c][half] = _mm512_dpbf16_ps(a[r][c][half], xv, wv[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) lanes[r * kTask + c] = _mm512_add_ps(a[r][c][0], a[r][c][1]);
}

// The task's outputs for R of many rows, two at a time (the weights are read from cache: a block of many rows).
template <int R>
void dot_rows(const uint16_t* x, int64_t K, const uint16_t* w, int count, __m512* lanes) {
  int j = 0;
  for (; j + 2 <= count; j += 2) dot_tile<R, 2>(x, K, w + j * K, lanes + j);
  for (; j < count; ++j) dot_tile<R, 1>(x, K, w + j * K, lanes + j);
  for (; j < kTask; ++j)
    for (int r = 0; r < R; ++r) lanes[r * kTask + j] = _mm512_setzero_ps();
}

// Outputs n0 .. n0+count-1 (count <= kTask) for every row. Under 8 rows (decode steps, short verify blocks): output by
// output, each weight row streamed once from memory for all rows, in tiles of two rows. Many rows (a prefill chunk):
// tiles of four rows run the task's weight rows in order (read again from cache by the next tile), two outputs at a
// time, then sum their lanes at once. Either way each output is the same sum (sum_lanes is sum16's tree).
void dot_task(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int count, uint16_t* out,
              int64_t N) {
  __m512 lanes[4][kTask];
  const int64_t whole = K / 64 * 64;
  const uint16_t* weights = w + n0 * K;
  if (M < kPairedRows) {
    for (int j = 0; j < count; ++j) {
      const uint16_t* weight = weights + j * K;
      int64_t r = 0;
      for (; r + 2 <= M; r += 2) {
        dot_tile<2, 1>(x + r * K, K, weight, &lanes[0][0]);
        for (int t = 0; t < 2; ++t)
          out[(r + t) * N + n0 + j] = finish(sum_lanes(lanes[t][0]), x + (r + t) * K, weight, whole, K);
      }
      if (r < M) {
        dot_tile<1, 1>(x + r * K, K, weight, &lanes[0][0]);
        out[r * N + n0 + j] = finish(sum_lanes(lanes[0][0]), x + r * K, weight, whole, K);
      }
    }
    return;
  }
  alignas(64) float sums[kTask];
  for (int64_t r = 0; r < M;) {
    const int rows = M - r >= 4 ? 4 : M - r >= 2 ? 2 : 1;
    if (rows == 4) dot_rows<4>(x + r * K, K, weights, count, &lanes[0][0]);
    else if (rows == 2) dot_rows<2>(x + r * K, K, weights, count, &lanes[0][0]);
    else dot_rows<1>(x + r * K, K, weights, count, &lanes[0][0]);
    for (int t = 0; t < rows; ++t) {
      _mm512_store_ps(sums, sum16(lanes[t]));
      for (int j = 0; j < count; ++j)
        out[(r + t) * N + n0 + j] = finish(sums[4 * (j % 4) + j / 4], x + (r + t) * K, weights + j * K, whole, K);
    }
    r += rows;
  }
}

// out [M, N] = x . w^T: tasks of kTask outputs (parallel), each dot_task.
void bf16_products(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, uint16_t* out) {
  at::parallel_for(0, (N + kTask - 1) / kTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * kTask;
      dot_task(x, M, K, w, n0, static_cast<int>(std::min<int64_t>(kTask, N - n0)), out, N);
    }
  });
}

#else  // the AVX2 tier of bf16_linear
// Per output and row the AVX-512 tier's two accumulators of 16 lanes (here two vectors each), VDPBF16PS's two
// products a lane as two FMAs (each product exact in float, so each sum rounds as VDPBF16PS's does), added and summed
// by sum_lanes' tree, then finish. Denormals are kept where VDPBF16PS flushes them: bits can differ from the AVX-512
// tier's below 2^-126 only. The rows are widened to float once per call, each 16 inputs as their 8 odd then 8 even.

// 16 bf16 at p as VDPBF16PS pairs them: each pair's odd (upper) and even (lower) input, widened to float.
inline void widen_pairs(const uint16_t* p, __m256& odd, __m256& even) {
  const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  odd = _mm256_castsi256_ps(_mm256_and_si256(y, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(y, 16));
}

inline float sum_lanes(__m256 lo, __m256 hi) {  // the AVX-512 tier's sum_lanes of the 16 lanes [lo | hi]
  const __m256 half = _mm256_add_ps(lo, hi);                                                       // i + (i+8)
  const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));  // + (i+4)
  const __m128 eighth = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));                      // + (i+2)
  return _mm_cvtss_f32(_mm_add_ss(eighth, _mm_movehdup_ps(eighth)));                                // + (i+1)
}

// The lane sums of R widened rows (`rows`, `whole` floats apart) times one weight row, over its whole 64s.
template <int R>
void dot_rows(const float* rows, int64_t whole, const uint16_t* weight, float* sums) {
  __m256 acc[R][4];  // chunk c of each 64: VDPBF16PS's accumulator c / 2, its lanes 0-7 (c even) or 8-15
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < whole; k += 64) {
    for (int c = 0; c < 4; ++c) {
      __m256 odd, even;
      widen_pairs(weight + k + 16 * c, odd, even);
      for (int r = 0; r < R; ++r) {
        const float* x = rows + r * whole + k + 16 * c;
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x), odd, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), even, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    sums[r] = sum_lanes(_mm256_add_ps(acc[r][0], acc[r][2]), _mm256_add_ps(acc[r][1], acc[r][3]));
}

void bf16_products(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, uint16_t* out) {
  const int64_t whole = K / 64 * 64;
  std::vector<float> rows(M * whole);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < whole; k += 16) {
      __m256 odd, even;
      widen_pairs(x + r * K + k, odd, even);
      _mm256_storeu_ps(rows.data() + r * whole + k, odd);
      _mm256_storeu_ps(rows.data() + r * whole + k + 8, even);
    }
  at::parallel_for(0, (N + kTask - 1) / kTask, 1, [&](int64_t begin, int64_t end) {
    float sums[2];
    for (int64_t n = begin * kTask; n < std::min(end * kTask, N); ++n) {  // each weight row once for all rows
      const uint16_t* weight = w + n * K;
      int64_t r = 0;
      for (; r + 2 <= M; r += 2) {
        dot_rows<2>(rows.data() + r * whole, whole, weight, sums);
        for (int t = 0; t < 2; ++t) out[(r + t) * N + n] = finish(sums[t], x + (r + t) * K, weight, whole, K);
      }
      if (r < M) {
        dot_rows<1>(rows.data() + r * whole, whole, weight, sums);
        out[r * N + n] = finish(sums[0], x + r * K, weight, whole, K);
      }
    }
  });
}
#endif  // DFLASH_AVX512

at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& weight_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "bf16_linear: x must be [rows, in] bf16");
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kBFloat16 && weight_in.size(1) == x_in.size(1),
              "bf16_linear: weight must be [out, in] bf16");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  bf16_products(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), M, K,
                reinterpret_cast<const uint16_t*>(weight.const_data_ptr()), N, reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// ---- int4_linear: out [M, N] = x [M, K] . dequant(w)^T, int4 weights and int8 activations, bf16 in and out ------
// w = q * d + m per output and group of 32 inputs (GGUF's Q4_1: codes q in 0..15, a float16 scale d and min m). Each
// row's activations are quantized per group to int8 (a = q_a * d_a, d_a = max|a| / 127, as llama.cpp's Q8_1), so a
// group's product is d * d_a * (q . q_a) + m * d_a * sum(q_a), the integer dot product exact.
// Layout (engine.kernels.quantized.Int4Linear): outputs in blocks of 16, one per vector lane, so no lane sums: per
// block and group, four 64-byte vectors whose lane j holds output j's codes of inputs 4i..4i+3 (low nibbles) and
// 16+4i..16+4i+3 (high nibbles) in vector i; VPDPBUSD multiplies them by the row's four activations of those inputs,
// broadcast (64 products an instruction); scales and mins [blocks, groups, 16] float16. Per output the groups are
// added in order: a row's result does not depend on the rows or threads beside it (bf16_linear's invariance), and
// one weight load serves a tile of up to kRowTile rows.
constexpr int kGroup = 32;  // inputs per activation (and Q4_1) scale group
constexpr int kRowTile = 4;  // rows that share one load of a block's weights
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of the weights a group reads (memory is the bound)

struct Int8Rows {  // the activations as int8, and per group their scale, sum of codes, and scale * sum
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum;  // [M, groups]
  std::vector<int32_t> sum;              // [M, groups]

  void keep(int64_t at, float amax, int32_t codes_sum) {  // a group's scale and sums, as either tier quantized it
    const float d = amax / 127.0f;
    scale[at] = d;
    sum[at] = codes_sum;
    scaled_sum[at] = d * static_cast<float>(codes_sum);
  }
};

#if DFLASH_AVX512
Int8Rows quantize_rows(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  Int8Rows rows{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups),
                std::vector<int32_t>(M * groups)};
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* a = x + r * K + g * kGroup;
      const __m512 lo = load_bf16x16(a), hi = load_bf16x16(a + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // (nearest even)
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      int8_t* out = rows.q.data() + r * K + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qhi));
      rows.keep(r * groups + g, amax, _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    }
  }
  return rows;
}

void int4_block(const Int8Rows& a, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
                const uint16_t* mins, int64_t block, uint16_t* out, int64_t N) {
  const int64_t groups = K / kGroup;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const int lanes = static_cast<int>(std::min<int64_t>(16, N - block * 16));
  const __mmask16 valid = static_cast<__mmask16>((1u << lanes) - 1);
  for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - r0));
    __m512 acc[kRowTile], macc[kRowTile];
    for (int t = 0; t < kRowTile; ++t) acc[t] = macc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* v = codes + (block * groups + g) * 256;
      for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(v + kPrefetchBytes + 64 * i), _MM_HINT_T0);
      __m512i w[8];
      for (int i = 0; i < 4; ++i) {
        const __m512i packed = _mm512_loadu_si512(v + 64 * i);
        w[i] = _mm512_and_si512(packed, low_nibbles);
        w[4 + i] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (block * groups + g) * 16)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + (block * groups + g) * 16)));
      for (int t = 0; t < rows; ++t) {
        const int64_t r = r0 + t;
        const int32_t* q = reinterpret_cast<const int32_t*>(a.q.data() + r * K + g * kGroup);
        __m512i low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(q[0]));
        __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], _mm512_set1_epi32(q[4]));
        for (int i = 1; i < 4; ++i) {
          low = _mm512_dpbusd_epi32(low, w[i], _mm512_set1_epi32(q[i]));
          high = _mm512_dpbusd_epi32(high, w[4 + i], _mm512_set1_epi32(q[4 + i]));
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(low, high));
        acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a.scale[r * groups + g])), acc[t]);
        macc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.scaled_sum[r * groups + g]), macc[t]);
      }
    }
    for (int t = 0; t < rows; ++t) {
      const __m256i result = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(acc[t], macc[t])));
      _mm256_mask_storeu_epi16(out + (r0 + t) * N + block * 16, valid, result);
    }
  }
}

#else  // the AVX2 tier: the same layouts, integer sums and float operations, 8 lanes at a time
// (VPMADDUBSW then VPMADDWD stand for VPDPBUSD: with 4-bit codes a group's pairs of products add up in 16 bits)

inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float max_lanes(__m256 v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
}

// Each lane rounded to bf16 in its upper 16 bits, as VCVTNEPS2BF16 rounds: nearest even, a denormal to a zero of its
// sign, a NaN kept and made quiet.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i tiny = _mm256_cmpeq_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
  rounded = _mm256_blendv_epi8(rounded, _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN)), tiny);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), nan);
}

inline void store_bf16x8(uint16_t* p, __m256 v, int lanes) {
  const __m256i packed = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_srli_epi32(bf16_bits8(v), 16), _mm256_setzero_si256()), 0x08);
  if (lanes == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  } else {
    alignas(16) uint16_t tail[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tail), _mm256_castsi256_si128(packed));
    std::memcpy(p, tail, sizeof(uint16_t) * lanes);
  }
}

Int8Rows quantize_rows(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  Int8Rows rows{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups),
                std::vector<int32_t>(M * groups)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* a = x + r * K + g * kGroup;
      __m256 v[4], top = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = load_bf16x8(a + 8 * i);
        top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
      }
      const float amax = max_lanes(top);
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      alignas(32) int32_t q[kGroup];
      for (int i = 0; i < 4; ++i)  // (nearest even)
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
      int8_t* out = rows.q.data() + r * K + g * kGroup;
      int32_t sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        const int32_t c = std::clamp(q[i], -128, 127);  // (saturating, as VPMOVSDB)
        out[i] = static_cast<int8_t>(c);
        sum += c;
      }
      rows.keep(r * groups + g, amax, sum);
    }
  }
  return rows;
}

void int4_block(const Int8Rows& a, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
                const uint16_t* mins, int64_t block, uint16_t* out, int64_t N) {
  const int64_t groups = K / kGroup;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const int lanes = static_cast<int>(std::min<int64_t>(16, N - block * 16));
  for (int half = 0; half * 8 < lanes; ++half) {  // outputs 8 * half .. + 7 of the block
    const int half_lanes = std::min(8, lanes - 8 * half);
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - r0));
      __m256 acc[kRowTile], macc[kRowTile];
      for (int t = 0; t < kRowTile; ++t) acc[t] = macc[t] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* v = codes + (block * groups + g) * 256 + 32 * half;
        for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(v + kPrefetchBytes + 64 * i), _MM_HINT_T0);
        __m256i w[8];
        for (int i = 0; i < 4; ++i) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 64 * i));
          w[i] = _mm256_and_si256(packed, low_nibbles);
          w[4 + i] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
        }
        const int64_t at = (block * groups + g) * 16 + 8 * half;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + at)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + at)));
        for (int t = 0; t < rows; ++t) {
          const int64_t r = r0 + t;
          const int32_t* q = reinterpret_cast<const int32_t*>(a.q.data() + r * K + g * kGroup);
          __m256i pairs = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(q[0]));  // (|a pair| <= 2 * 15 * 127: eight
          for (int i = 1; i < 8; ++i)                                             // of them fit 16 bits)
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(q[i])));
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
          acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(a.scale[r * groups + g])), acc[t]);
          macc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.scaled_sum[r * groups + g]), macc[t]);
        }
      }
      for (int t = 0; t < rows; ++t)
        store_bf16x8(out + (r0 + t) * N + block * 16 + 8 * half, _mm256_add_ps(acc[t], macc[t]), half_lanes);
    }
  }
}
#endif  // DFLASH_AVX512

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& codes_in, const at::Tensor& scales_in,
                       const at::Tensor& mins_in, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.size(1) % kGroup == 0,
              "int4_linear: x must be [rows, in] bf16, in a multiple of 32");
  const int64_t M = x_in.size(0), K = x_in.size(1), blocks = (N + 15) / 16, groups = K / kGroup;
  TORCH_CHECK(codes_in.scalar_type() == at::kByte && codes_in.numel() == blocks * groups * 256,
              "int4_linear: codes must be [out / 16, in / 32, 256] uint8");
  for (const at::Tensor* t : {&scales_in, &mins_in})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->numel() == blocks * groups * 16,
                "int4_linear: scales and mins must be [out / 16, in / 32, 16] float16");
  const at::Tensor x = x_in.contiguous(), codes = codes_in.contiguous();
  const at::Tensor scales = scales_in.contiguous(), mins = mins_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Int8Rows rows = quantize_rows(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), M, K);
  const auto* c = codes.const_data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr());
  const auto* m = reinterpret_cast<const uint16_t*>(mins.const_data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) int4_block(rows, M, K, c, s, m, block, o, N);
  });
  return out;
}

// ---- int8_linear: out [M, N] = x [M, K] . (w * scale)^T, int8 weights (one scale per output) and int8 rows -------
// The rows quantized per group of 32 as int4_linear's. VPDPBUSD wants one unsigned operand: the weights are held
// shifted by 128 (w + 128 in 1..255), and (w + 128) . q_a less 128 * sum(q_a) is the exact w . q_a. Layout
// (Int8Linear): outputs in blocks of 16 lanes, per block and four inputs one 64-byte vector (lane j: output j's
// shifted weights of those inputs); scales [blocks, 16] in the compute dtype, or, as GGUF's Q8_0 stores them, one
// float16 scale per output and group of 32 inputs [blocks, groups, 16] (each group's dot product scaled by it
// before the sum). Groups added in order per output: rows independent.
#if DFLASH_AVX512
void int8_block(const Int8Rows& a, int64_t M, int64_t K, const uint8_t* codes, const void* scales, bool bf16_scales,
                const uint16_t* group_scales, int64_t block, uint16_t* out, int64_t N) {
  const int64_t groups = K / kGroup;
  const int lanes = static_cast<int>(std::min<int64_t>(16, N - block * 16));
  const __mmask16 valid = static_cast<__mmask16>((1u << lanes) - 1);
  for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - r0));
    __m512 acc[kRowTile];
    for (int t = 0; t < kRowTile; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* v = codes + (block * groups + g) * 512;
      for (int i = 0; i < 8; ++i) _mm_prefetch(reinterpret_cast<const char*>(v + kPrefetchBytes + 64 * i), _MM_HINT_T0);
      __m512i w[8];
      for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(v + 64 * i);
      for (int t = 0; t < rows; ++t) {
        const int64_t r = r0 + t;
        const int32_t* q = reinterpret_cast<const int32_t*>(a.q.data() + r * K + g * kGroup);
        __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(q[0]));
        __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(q[1]));
        for (int i = 2; i < 8; i += 2) {
          even = _mm512_dpbusd_epi32(even, w[i], _mm512_set1_epi32(q[i]));
          odd = _mm512_dpbusd_epi32(odd, w[i + 1], _mm512_set1_epi32(q[i + 1]));
        }
        const __m512i shift = _mm512_set1_epi32(128 * a.sum[r * groups + g]);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(even, odd), shift));
        __m512 scale = _mm512_set1_ps(a.scale[r * groups + g]);
        if (group_scales != nullptr)  // (GGUF's Q8_0: a weight scale per output and group, float16)
          scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(group_scales + (block * groups + g) * 16))),
                                scale);
        acc[t] = _mm512_fmadd_ps(dot, scale, acc[t]);
      }
    }
    const __m512 scale = group_scales != nullptr ? _mm512_set1_ps(1.0f)
                         : bf16_scales ? load_bf16x16(static_cast<const uint16_t*>(scales) + block * 16)
                                       : _mm512_loadu_ps(static_cast<const float*>(scales) + block * 16);
    for (int t = 0; t < rows; ++t) {
      const __m256i result = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(acc[t], scale)));
      _mm256_mask_storeu_epi16(out + (r0 + t) * N + block * 16, valid, result);
    }
  }
}

#else
// The shifted weights' pairs of products would overflow VPMADDUBSW's 16 bits: it takes |q_a| and the weights
// (w + 128 less 128) with q_a's signs instead (VPSIGNB), so the exact w . q_a comes out with no shift to take off.
void int8_block(const Int8Rows& a, int64_t M, int64_t K, const uint8_t* codes, const void* scales, bool bf16_scales,
                const uint16_t* group_scales, int64_t block, uint16_t* out, int64_t N) {
  const int64_t groups = K / kGroup;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  const int lanes = static_cast<int>(std::min<int64_t>(16, N - block * 16));
  for (int half = 0; half * 8 < lanes; ++half) {
    const int half_lanes = std::min(8, lanes - 8 * half);
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - r0));
      __m256 acc[kRowTile];
      for (int t = 0; t < kRowTile; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* v = codes + (block * groups + g) * 512 + 32 * half;
        for (int i = 0; i < 8; ++i) _mm_prefetch(reinterpret_cast<const char*>(v + kPrefetchBytes + 64 * i), _MM_HINT_T0);
        __m256i w[8];
        for (int i = 0; i < 8; ++i)
          w[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 64 * i)), bias);
        for (int t = 0; t < rows; ++t) {
          const int64_t r = r0 + t;
          const int32_t* q = reinterpret_cast<const int32_t*>(a.q.data() + r * K + g * kGroup);
          __m256i sum = _mm256_setzero_si256();
          for (int i = 0; i < 8; ++i) {
            const __m256i qb = _mm256_set1_epi32(q[i]);
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(qb), _mm256_sign_epi8(w[i], qb)), ones));
          }
          const __m256 dot = _mm256_cvtepi32_ps(sum);
          __m256 scale = _mm256_set1_ps(a.scale[r * groups + g]);
          if (group_scales != nullptr)
            scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                      group_scales + (block * groups + g) * 16 + 8 * half))),
                                  scale);
          acc[t] = _mm256_fmadd_ps(dot, scale, acc[t]);
        }
      }
      const __m256 scale = group_scales != nullptr ? _mm256_set1_ps(1.0f)
                           : bf16_scales ? load_bf16x8(static_cast<const uint16_t*>(scales) + block * 16 + 8 * half)
                                         : _mm256_loadu_ps(static_cast<const float*>(scales) + block * 16 + 8 * half);
      for (int t = 0; t < rows; ++t)
        store_bf16x8(out + (r0 + t) * N + block * 16 + 8 * half, _mm256_mul_ps(acc[t], scale), half_lanes);
    }
  }
}
#endif  // DFLASH_AVX512

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.size(1) % kGroup == 0,
              "int8_linear: x must be [rows, in] bf16, in a multiple of 32");
  const int64_t M = x_in.size(0), K = x_in.size(1), blocks = (N + 15) / 16;
  TORCH_CHECK(codes_in.scalar_type() == at::kByte && codes_in.numel() == blocks * K * 16,
              "int8_linear: codes must be [out / 16, in / 4, 16, 4] uint8 (the weights + 128)");
  const bool grouped = scales_in.dim() == 3;
  TORCH_CHECK(grouped ? scales_in.scalar_type() == at::kHalf && scales_in.numel() == blocks * (K / kGroup) * 16
                      : (scales_in.scalar_type() == at::kFloat || scales_in.scalar_type() == at::kBFloat16) &&
                            scales_in.numel() == blocks * 16,
              "int8_linear: scales must be [out / 16, 16] float32 or bf16, or [out / 16, in / 32, 16] float16");
  const at::Tensor x = x_in.contiguous(), codes = codes_in.contiguous(), scales = scales_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Int8Rows rows = quantize_rows(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), M, K);
  const auto* c = codes.const_data_ptr<uint8_t>();
  const void* s = scales.const_data_ptr();
  const bool bf16 = scales.scalar_type() == at::kBFloat16;
  const auto* g = grouped ? static_cast<const uint16_t*>(s) : nullptr;
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) int8_block(rows, M, K, c, s, bf16, g, block, o, N);
  });
  return out;
}

// ---- attention of each row's block of queries over that row's K/V, bf16 ------------------------------------------
// rows [R, kv heads, n, head dim]: in row b, query row i is the query at positions[b, i % q] (the query heads of a KV
// head folded into rows, as engine.target.standard folds them); keys / values [R, kv heads, capacity, head dim].
// Rounded where the eager graph rounds (its sums, exp and conversions are its own, so bits may differ from it):
// scores = bf16(q . k) then bf16(score * scaling); softmax in float32 over the keys at or before the query's
// position, weights rounded to bf16; out = bf16(sum of weight * value, keys in order).
// Each query reads only its own keys, in groups of 16 from its first: its result does not depend on the block or the
// rows around it. (Per group: 16 dot products summed by one transposing tree, the scores rounded and scaled, and their
// exponentials, 16 lanes at once: a prefill's queries over thousands of keys each are arithmetic-bound.) The AVX2
// tier does the same operations in the same order, 8 keys at a time: VDPBF16PS's two products a lane as two FMAs,
// which round as it does (a product of two bf16 is exact in float), but with denormal inputs and sums kept where
// VDPBF16PS flushes them: its bits can differ from the AVX-512 tier's only below 2^-126.

struct AttentionCall {  // one call's checked tensors, as a tier's loop reads them
  const uint16_t *rows, *keys, *values;
  const int64_t* positions;  // [R, q]
  uint16_t* out;
  int64_t heads, n, dim, q, capacity, batch_stride, head_stride, key_stride;
  float scaling;
};

#if DFLASH_AVX512
inline __m512 round_bf16x16(__m512 v) {  // to bf16 and back (nearest even; denormals flushed, as VDPBF16PS)
  return widen_bf16x16(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// e^x for x <= 0 (a score minus the largest), 16 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p of degree 6
// (relative error about 3e-7; the weights are rounded to bf16 after); under -87.3 (below float's normal range) 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 small = _mm512_set1_ps(-87.3f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, small, _CMP_LT_OQ);
  x = _mm512_max_ps(small, x);  // (a NaN stays NaN: max returns its second operand then)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~zero), p, _mm512_castsi512_ps(scale));
}

// Tasks begin..stop of a call (a task: one query row of one KV head of one row).
void attend(const AttentionCall& c, int64_t begin, int64_t stop) {
  const __m512 scale = _mm512_set1_ps(c.scaling);
  // lane 4k+m of sum16 holds vector k+4m: this gathers key j's score into lane j
  const __m512i key_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  std::vector<float> weights((c.capacity + 15) / 16 * 16);
  std::vector<__m512> acc(c.dim / 16);
  __m512 lanes[16];
  for (int64_t task = begin; task < stop; ++task) {
    const int64_t b = task / (c.heads * c.n), h = task / c.n % c.heads, row = task % c.n;
    const int64_t visible = c.positions[b * c.q + row % c.q] + 1;
    const uint16_t* query = c.rows + task * c.dim;
    const uint16_t* kh = c.keys + b * c.batch_stride + h * c.head_stride;
    const uint16_t* vh = c.values + b * c.batch_stride + h * c.head_stride;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t g = 0; g < visible; g += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, visible - g));
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_setzero_ps();
        if (j < count)
          for (int64_t d = 0; d < c.dim; d += 32)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(query + d),
                                 (__m512bh)_mm512_loadu_si512(kh + (g + j) * c.key_stride + d));
        lanes[j] = a;
      }
      const __mmask16 real = static_cast<__mmask16>((1u << count) - 1);
      const __m512 score = _mm512_mask_blend_ps(  // (lanes past the last key: -inf, so their weight is 0)
          real, _mm512_set1_ps(-INFINITY),
          round_bf16x16(_mm512_mul_ps(round_bf16x16(_mm512_permutexvar_ps(key_order, sum16(lanes))), scale)));
      _mm512_storeu_ps(weights.data() + g, score);
      top = _mm512_max_ps(top, score);
    }
    const __m512 largest = _mm512_set1_ps(_mm512_reduce_max_ps(top));  // (a max is exact in any order)
    float total = 0.f;
    for (int64_t g = 0; g < visible; g += 16) {
      _mm512_storeu_ps(weights.data() + g, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(weights.data() + g), largest)));
      for (int64_t j = g; j < std::min<int64_t>(g + 16, visible); ++j) total += weights[j];  // keys in order
    }
    for (auto& v : acc) v = _mm512_setzero_ps();
    const __m512 totals = _mm512_set1_ps(total);
    for (int64_t g = 0; g < visible; g += 16) {
      _mm512_storeu_ps(weights.data() + g, round_bf16x16(_mm512_div_ps(_mm512_loadu_ps(weights.data() + g), totals)));
      for (int64_t j = g; j < std::min<int64_t>(g + 16, visible); ++j) {
        const __m512 w = _mm512_set1_ps(weights[j]);
        for (int64_t k = 0; k < c.dim / 16; ++k)
          acc[k] = _mm512_fmadd_ps(w, load_bf16x16(vh + j * c.key_stride + k * 16), acc[k]);
      }
    }
    for (int64_t k = 0; k < c.dim / 16; ++k) store_bf16x16(c.out + task * c.dim + k * 16, acc[k]);
  }
}

// ---- argmax: each row's index of its largest value, bf16 in, int64 out ----------------------------------------
// As torch.argmax: the first of equal maxima (-0 equals +0), and a NaN counts as the largest (the first NaN's
// index). bf16 widens to float exactly, so the index is the one argmax over the float32 logits gives; torch's own
// kernel reads a 49,152-token row in about 85 us on the 2-core VM (widened first: 40 more), this in about 9
// (its maximum near the row's end: both passes whole).
int64_t row_argmax(const uint16_t* row, int64_t n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load_bf16x16(row + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  float top = _mm512_reduce_max_ps(best);
  bool nan = unordered != 0;
  for (int64_t j = i; j < n; ++j) {
    const float f = bf16_to_float(row[j]);
    nan = nan || std::isnan(f);
    top = f > top ? f : top;
  }
  const __m512 wanted = _mm512_set1_ps(top);
  for (int64_t j = 0; j < i; j += 16) {  // the first index holding it (a NaN: the first NaN)
    const __m512 v = load_bf16x16(row + j);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, wanted, _CMP_EQ_OQ);
    if (hit != 0) return j + __builtin_ctz(hit);
  }
  for (int64_t j = i; j < n; ++j) {
    const float f = bf16_to_float(row[j]);
    if (nan ? std::isnan(f) : f == top) return j;
  }
  return 0;  // (unreached: some index holds the maximum)
}

#else  // the AVX2 tier

inline __m256 round_bf16x8(__m256 v) {  // to bf16 and back, as VCVTNEPS2BF16
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits8(v), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// exp_nonpositive of the AVX-512 tier, 8 lanes: the same operations.
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 small = _mm256_set1_ps(-87.3f);
  const __m256 kept = _mm256_cmp_ps(x, small, _CMP_NLT_UQ);  // (a NaN stays NaN)
  x = _mm256_max_ps(small, x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), kept);
}

// The lane sums of 8 vectors, lane j of the result v[j]'s: each by the halving tree of sum16 past its first step
// (lane i with i+4, then i+2, i+1).
inline __m256 sum8(const __m256* v) {
  __m256 half[4], quarter[2];
  for (int p = 0; p < 4; ++p)  // [A 0-3 | B 0-3] + [A 4-7 | B 4-7]
    half[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                            _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
  for (int p = 0; p < 2; ++p)  // lanes 0, 1 + lanes 2, 3 of each quarter
    quarter[p] = _mm256_add_ps(_mm256_shuffle_ps(half[2 * p], half[2 * p + 1], 0x44),
                               _mm256_shuffle_ps(half[2 * p], half[2 * p + 1], 0xEE));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(quarter[0], quarter[1], 0x88),
                                    _mm256_shuffle_ps(quarter[0], quarter[1], 0xDD));  // vectors 0 2 4 6 | 1 3 5 7
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

void attend(const AttentionCall& c, int64_t begin, int64_t stop) {
  const __m256 scale = _mm256_set1_ps(c.scaling);
  const int64_t chunks = c.dim / 16;  // 16 inputs a chunk: VDPBF16PS's lanes 0-7 take even chunks, lanes 8-15 odd
  std::vector<float> weights((c.capacity + 7) / 8 * 8);
  std::vector<__m256> acc(c.dim / 8), odd(chunks), even(chunks);
  __m256 lanes[8];
  for (int64_t task = begin; task < stop; ++task) {
    const int64_t b = task / (c.heads * c.n), h = task / c.n % c.heads, row = task % c.n;
    const int64_t visible = c.positions[b * c.q + row % c.q] + 1;
    const uint16_t* query = c.rows + task * c.dim;
    const uint16_t* kh = c.keys + b * c.batch_stride + h * c.head_stride;
    const uint16_t* vh = c.values + b * c.batch_stride + h * c.head_stride;
    for (int64_t k = 0; k < chunks; ++k) widen_pairs(query + 16 * k, odd[k], even[k]);
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t g = 0; g < visible; g += 8) {
      const int count = static_cast<int>(std::min<int64_t>(8, visible - g));
      for (int j = 0; j < 8; ++j) {
        __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // VDPBF16PS's lanes 0-7, 8-15
        if (j < count)
          for (int64_t k = 0; k < chunks; ++k) {  // per lane: the odd input's product, then the even one's
            __m256 key_odd, key_even;
            widen_pairs(kh + (g + j) * c.key_stride + 16 * k, key_odd, key_even);
            sums[k & 1] = _mm256_fmadd_ps(odd[k], key_odd, sums[k & 1]);
            sums[k & 1] = _mm256_fmadd_ps(even[k], key_even, sums[k & 1]);
          }
        lanes[j] = _mm256_add_ps(sums[0], sums[1]);  // (sum16's first step: lane i with i+8)
      }
      const __m256 real = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      const __m256 score = _mm256_blendv_ps(  // (lanes past the last key: -inf, so their weight is 0)
          _mm256_set1_ps(-INFINITY), round_bf16x8(_mm256_mul_ps(round_bf16x8(sum8(lanes)), scale)), real);
      _mm256_storeu_ps(weights.data() + g, score);
      top = _mm256_max_ps(top, score);
    }
    const __m256 largest = _mm256_set1_ps(max_lanes(top));  // (a max is exact in any order)
    float total = 0.f;
    for (int64_t g = 0; g < visible; g += 8) {
      _mm256_storeu_ps(weights.data() + g, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(weights.data() + g), largest)));
      for (int64_t j = g; j < std::min<int64_t>(g + 8, visible); ++j) total += weights[j];  // keys in order
    }
    for (auto& v : acc) v = _mm256_setzero_ps();
    const __m256 totals = _mm256_set1_ps(total);
    for (int64_t g = 0; g < visible; g += 8) {
      _mm256_storeu_ps(weights.data() + g, round_bf16x8(_mm256_div_ps(_mm256_loadu_ps(weights.data() + g), totals)));
      for (int64_t j = g; j < std::min<int64_t>(g + 8, visible); ++j) {
        const __m256 w = _mm256_set1_ps(weights[j]);
        for (int64_t k = 0; k < c.dim / 8; ++k)
          acc[k] = _mm256_fmadd_ps(w, load_bf16x8(vh + j * c.key_stride + k * 8), acc[k]);
      }
    }
    for (int64_t k = 0; k < c.dim / 8; ++k) store_bf16x8(c.out + task * c.dim + k * 8, acc[k], 8);
  }
}

// row_argmax of the AVX-512 tier, 8 lanes.
int64_t row_argmax(const uint16_t* row, int64_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  int unordered = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load_bf16x8(row + i);
    unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, v);
  }
  float top = max_lanes(best);
  bool nan = unordered != 0;
  for (int64_t j = i; j < n; ++j) {
    const float f = bf16_to_float(row[j]);
    nan = nan || std::isnan(f);
    top = f > top ? f : top;
  }
  const __m256 wanted = _mm256_set1_ps(top);
  for (int64_t j = 0; j < i; j += 8) {  // the first index holding it (a NaN: the first NaN)
    const __m256 v = load_bf16x8(row + j);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, wanted, _CMP_EQ_OQ));
    if (hit != 0) return j + __builtin_ctz(hit);
  }
  for (int64_t j = i; j < n; ++j) {
    const float f = bf16_to_float(row[j]);
    if (nan ? std::isnan(f) : f == top) return j;
  }
  return 0;  // (unreached: some index holds the maximum)
}
#endif  // DFLASH_AVX512

at::Tensor attention(const at::Tensor& rows_in, const at::Tensor& keys, const at::Tensor& values,
                     const at::Tensor& positions_in, double scaling) {
  TORCH_CHECK(rows_in.dim() == 4 && rows_in.scalar_type() == at::kBFloat16, "attention: rows must be bf16 [R, h, n, d]");
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && values.scalar_type() == at::kBFloat16, "attention: bf16 K/V");
  TORCH_CHECK(positions_in.dim() == 2 && positions_in.scalar_type() == at::kLong, "attention: positions [R, q] int64");
  const at::Tensor rows = rows_in.contiguous(), positions = positions_in.contiguous();
  const int64_t batch = rows.size(0), heads = rows.size(1), n = rows.size(2), dim = rows.size(3);
  TORCH_CHECK(keys.dim() == 4, "attention: shapes");
  const int64_t q = positions.size(1), capacity = keys.size(2);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == batch && keys.size(1) == heads &&
                  keys.size(3) == dim && positions.size(0) == batch && q > 0 && n % q == 0,
              "attention: shapes");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.strides() == values.strides(), "attention: K/V layout");
  TORCH_CHECK(dim % 32 == 0, "attention: head dim must be a multiple of 32");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < batch * q; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < capacity, "attention: a position past the buffer");
  at::Tensor out = at::empty({batch, heads, n, dim}, rows.options());
  const AttentionCall call{reinterpret_cast<const uint16_t*>(rows.const_data_ptr()),
                           reinterpret_cast<const uint16_t*>(keys.const_data_ptr()),
                           reinterpret_cast<const uint16_t*>(values.const_data_ptr()),
                           pos,
                           reinterpret_cast<uint16_t*>(out.data_ptr()),
                           heads, n, dim, q, capacity, keys.stride(0), keys.stride(1), keys.stride(2),
                           static_cast<float>(scaling)};
  at::parallel_for(0, batch * heads * n, 1, [&](int64_t begin, int64_t stop) { attend(call, begin, stop); });
  return out;
}

at::Tensor argmax(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.size(1) > 0,
              "argmax: x must be [rows, n] bf16, n > 0");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const auto* data = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  auto* index = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) index[r] = row_argmax(data + r * n, n);
  return out;
}

}  // namespace

TORCH_LIBRARY(dflash, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int out_features) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor");
  m.def("attention(Tensor rows, Tensor keys, Tensor values, Tensor positions, float scaling) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("attention", &attention);
  m.impl("argmax", &argmax);
  m.impl("bf16_linear", &bf16_linear);
}
