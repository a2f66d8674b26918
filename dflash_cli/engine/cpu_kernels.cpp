// dflash's own CPU kernels for decoding in bf16 on AVX-512 BF16 CPUs (engine/cpu_kernels.py loads them):
// dflash::bf16_linear (a dense bf16 weight times a few rows) and dflash::attention (each row's block of queries over
// its own K/V).
//
// A decode step multiplies one to a few dozen rows by every weight once, so its time is the weights' bytes over
// the memory bandwidth: bf16_linear reads each weight once per call for all its rows (a tile of rows shares each
// load) and parallelizes over fixed blocks of outputs. attention reads a row's keys in place, where a batched
// matrix product first copies them transposed.
//
// Every output is computed in one fixed order that depends on neither the row count, the row's place in a tile,
// nor the thread count: a row's result is bit-equal whether it runs alone or inside a verify block, which is what
// keeps bf16 speculative decoding lossless (engine/kernels.py says why batch invariance matters).
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

inline __m512 load_bf16x16(const uint16_t* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// ---- bf16_linear: out [M, N] = x [M, K] . w [N, K]^T, bf16 in and out ---------------------------------------------
// Per output and row: VDPBF16PS over the row and weight as they are (each lane adds two exact products per
// instruction, in a fixed order, denormals flushed), 32 inputs a chunk, two accumulators over alternating chunks,
// reduced across lanes in one fixed sequence; the inputs past the last whole 64 added after, in order; rounded to
// bf16 once.

// One output for R rows: the weight row streams once (one sequential stream per thread: measured faster than
// tiles of 2-8 weight rows, whose short interleaved streams the hardware prefetcher follows worse), each of its
// chunks shared by the R rows.
template <int R>
void dot_rows(const uint16_t* x, int64_t K, const uint16_t* w, float* result /* [R] */) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  const int64_t whole = K / 64 * 64;
  for (int64_t k = 0; k < whole; k += 64) {
    for (int half = 0; half < 2; ++half) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + half * 32);
      for (int r = 0; r < R; ++r)
        a[r][half] = _mm512_dpbf16_ps(a[r][half], (__m512bh)_mm512_loadu_si512(x + r * K + k + half * 32), wv);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
    for (int64_t k = whole; k < K; ++k) s = std::fma(bf16_to_float(x[r * K + k]), bf16_to_float(w[k]), s);
    result[r] = s;
  }
}

// Output n for every row, in tiles of two rows (the last one alone).
void dot_output(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n, uint16_t* out, int64_t N) {
  float result[2];
  const uint16_t* row = w + n * K;
  int64_t r = 0;
  for (; r + 2 <= M; r += 2) {
    dot_rows<2>(x + r * K, K, row, result);
    out[r * N + n] = float_to_bf16(result[0]);
    out[(r + 1) * N + n] = float_to_bf16(result[1]);
  }
  if (r < M) {
    dot_rows<1>(x + r * K, K, row, result);
    out[r * N + n] = float_to_bf16(result[0]);
  }
}

at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& weight_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "bf16_linear: x must be [rows, in] bf16");
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kBFloat16 && weight_in.size(1) == x_in.size(1),
              "bf16_linear: weight must be [out, in] bf16");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.const_data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  constexpr int64_t per_task = 16;  // outputs per parallel task: fixed, so the split never depends on the threads
  at::parallel_for(0, (N + per_task - 1) / per_task, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * per_task; n < std::min(N, end * per_task); ++n) dot_output(xp, M, K, w, n, o, N);
  });
  return out;
}

// ---- attention of each row's block of queries over that row's K/V, bf16 ------------------------------------------
// rows [R, kv heads, n, head dim]: in row b, query row i is the query at positions[b, i % q] (the query heads of a KV
// head folded into rows, as engine.target.standard folds them); keys / values [R, kv heads, capacity, head dim].
// Rounded where the eager graph rounds (its sums, exp and conversions are its own, so bits may differ from it):
// scores = bf16(q . k) then bf16(score * scaling); softmax in float32 over the keys at or before the query's
// position, weights rounded to bf16; out = bf16(sum of weight * value, keys in order).
// Each query reads only its own keys, so its result does not depend on the block or the rows around it.

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
  const auto* r = reinterpret_cast<const uint16_t*>(rows.const_data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(keys.const_data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(values.const_data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t batch_stride = keys.stride(0), head_stride = keys.stride(1), key_stride = keys.stride(2);
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, batch * heads * n, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> weights(capacity);
    std::vector<__m512> acc(dim / 16);
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t b = task / (heads * n), h = task / n % heads, row = task % n;
      const int64_t visible = pos[b * q + row % q] + 1;
      const uint16_t* query = r + task * dim;
      const uint16_t* kh = kp + b * batch_stride + h * head_stride;
      const uint16_t* vh = vp + b * batch_stride + h * head_stride;
      float top = -INFINITY;
      for (int64_t j = 0; j < visible; ++j) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 32)
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(query + d),
                               (__m512bh)_mm512_loadu_si512(kh + j * key_stride + d));
        const float score = bf16_to_float(float_to_bf16(bf16_to_float(float_to_bf16(_mm512_reduce_add_ps(a))) * scale));
        weights[j] = score;
        top = std::max(top, score);
      }
      float total = 0.f;
      for (int64_t j = 0; j < visible; ++j) total += (weights[j] = std::exp(weights[j] - top));
      for (auto& v : acc) v = _mm512_setzero_ps();
      for (int64_t j = 0; j < visible; ++j) {
        const __m512 w = _mm512_set1_ps(bf16_to_float(float_to_bf16(weights[j] / total)));
        for (int64_t c = 0; c < dim / 16; ++c)
          acc[c] = _mm512_fmadd_ps(w, load_bf16x16(vh + j * key_stride + c * 16), acc[c]);
      }
      for (int64_t c = 0; c < dim / 16; ++c) store_bf16x16(o + task * dim + c * 16, acc[c]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(dflash, m) {
  m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("attention(Tensor rows, Tensor keys, Tensor values, Tensor positions, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("attention", &attention);
}
