// specdec::q4_mm: y = x @ W^T for weights in 4-bit blocks of 32 (GGUF Q4_1's shape: w = d * q + m,
// q in 0..15, d and m in float16), with x quantized per row and block of 32 to int8 (as llama.cpp
// quantizes activations against its Q4 weights), so each block's dot product is integer arithmetic:
// y = sum over blocks of d * s * sum(q * a) + m * sum(x), with s the activation block's scale.
//
// One pass over the weights serves every row of x (a verify pass's K + 1 rows cost little more
// than one), and each row's output is computed by the same operations whatever the number of rows
// or threads: a row's result does not depend on what it is batched with.
//
// Weights (model_service/int4.py packs them: q4_tiles): outputs in tiles of 16 (the last padded with
// zero weights), each tile's blocks in order, each block 320 bytes: d [16] and m [16] float16 (one
// per output), then 4 chunks of 64 bytes in which byte 4 i + j of chunk c holds q[i][4 c + j] in its
// low nibble and q[i][16 + 4 c + j] in its high one (output i of the tile, input of the block). A
// 64-byte chunk's nibbles are then 16 outputs x 4 inputs, the shape of one vpdpbusd against four
// activations broadcast: no horizontal sums, no shuffles.
//
// Threads: torch's (at::parallel_for over tiles, and over the attention's tasks: (row, head) pairs on
// AVX-512, elsewhere a sequence's kv head with the rows and heads that read it), which split the work
// only when this file is compiled with OpenMP (model_service/q4_kernel.py builds it so where the
// compiler can).
//
// Paths, chosen when compiled (-march=native, for the machine that builds it): AVX-512 VNNI, AVX-512
// without VNNI (vpmaddubsw + vpmaddwd for vpdpbusd), AVX2 + FMA + F16C (likewise), plain C++.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace {

constexpr int64_t QK = 32;   // weights a block
// how far ahead of the product a tile's blocks are prefetched, in bytes (4 kB, ~13 blocks): on a
// 2-core Xeon whose L3 holds the weights, a SmolLM2 int4 pass of one token 4.1-4.4 -> 2.8-2.9 ms,
// five 6.9-7.1 -> 4.4-4.7 (the 5 lines of a block, each issued once; within noise on an AMD EPYC)
constexpr int64_t Q4_AHEAD = 4096;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q4_AVX512 1
const char* const kPath = "avx512_vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
// AVX-512 without VNNI (Skylake-SP): the AVX-512 path, its vpdpbusd's sums made as the AVX2 path's
// (vpmaddubsw summed in 16 bits over the block, widened once by vpmaddwd: tile()), bit for bit alike
#define Q4_AVX512 1
#define Q4_NO_VNNI 1
const char* const kPath = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_AVX2 1
const char* const kPath = "avx2";
#else
const char* const kPath = "scalar";
#endif
// rows a tile (the row loop's accumulators); more rows take more tiles. 9: a K = 8 verify's rows
// unpack each block once, not for 5 + 4 rows (2-core Xeon, AVX-512 VNNI, its weights in L3: a 9-token
// pass 1.91-2.03x a one-token pass against 1.99-2.13x with 8, five alternating runs in one process each).
// 16 had run slower on an AMD EPYC with AVX-512 and level on the Xeon (then with the 5 + 4 split's
// per-row float steps of the time)
#if defined(Q4_AVX2)
// AVX2: the rows that read each of a block's nibble vectors before the next is loaded (tile(), group()):
// their 2 x 6 sums, two nibble vectors and a broadcast fill the 16 registers. A 576 x 1024 product of 5
// rows on one core of an AMD EPYC (Zen 3), the weights in L2: 50.6-52.5 us with the nibbles held in
// registers for every row (a broadcast per vpmaddubsw, the rest spilled), 40.0 in groups of 6, 42.5-56.3
// in groups of 3, 4 or 8. A tile holds one such group: tiles of 7..9 rows had run two groups (4 + 3,
// 4 + 4, 5 + 4) over each unpacked block, and the same product (one core, L2, medians of 9 x 300 calls)
// of 7 / 8 / 9 / 17 / 20 rows took 63.6 / 69.8 / 77.8 / 146.3 / 163.1 us against 56.7 / 62.2 / 69.1 /
// 117.9 / 147.4 in tiles of up to 6 (a second tile unpacks each block again, from L1); <= 6 rows alike
constexpr int MAX_ROWS = 6;
#else
constexpr int MAX_ROWS = 9;
#endif
// 8-wide float32 vectors with FMA and float16 conversion (F16C): the AVX2 path's, and the AVX-512
// one's where they serve both (a float16 cache's stores and reads)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_V8 1
#endif

// 4 activations (int8) as one int32, and a float16's bits, read without aliasing another type
inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint16_t load_half(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// A KV cache's element: float32, or float16's bits (--kv-dtype float16: half the bytes each pass
// reads at long contexts). A float is stored rounded to nearest even, as torch's .half() rounds.
using half_bits = uint16_t;

inline half_bits float_to_half(float v) {
#if defined(__F16C__)
  return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
#else
  return c10::detail::fp16_ieee_from_fp32_value(v);
#endif
}

constexpr int64_t TILE = 16;          // outputs a tile
constexpr int64_t BLOCK_BYTES = 320;
  // one block of a tile: d, m (16 float16 each), 4 x 64 bytes of q

#if defined(Q4_AVX2)
// the sum of v's 8 lanes: (0 + 4) + (2 + 6), plus (1 + 5) + (3 + 7)
inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

// x quantized: a = round(x / s) per block of 32 (int8, in order), s = max|x| / 127 (0 for a block of
// zeros), and each block's float sum of x (the m term's).
struct Rows {
  int64_t M, K, nb;
  std::vector<int8_t> a;     // [M, K]
  std::vector<float> scale;  // [M, nb]
  std::vector<float> sum;    // [M, nb]
};

Rows quantize(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  Rows rows{M, K, nb, std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * QK;
      int8_t* a = rows.a.data() + r * K + b * QK;
#if defined(Q4_AVX512)
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float total = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
      const float s = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(s > 0.f ? 1.f / s : 0.f);
      constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // half to even, as torch.round
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x0, inv), nearest));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x1, inv), nearest));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16), _mm512_cvtsepi32_epi8(q1));
#elif defined(Q4_AVX2)
      // the AVX-512 path's steps 8 wide (the sum in its own order: a row's, whatever the batch)
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 sign = _mm256_set1_ps(-0.f);
      const __m256 most = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const float total = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
      const float s = amax / 127.f;
      const __m256 inv = _mm256_set1_ps(s > 0.f ? 1.f / s : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i)  // half to even, as torch.round; |q| <= 127, so the packs never saturate
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // packs work within 128-bit lanes: the dwords come out as 0 4 1 5 2 6 3 7 of the wanted order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
      float amax = 0.f, total = 0.f;
      for (int j = 0; j < QK; ++j) {
        amax = std::max(amax, std::fabs(xb[j]));
        total += xb[j];
      }
      const float s = amax / 127.f;
      const float inv = s > 0.f ? 1.f / s : 0.f;
      for (int j = 0; j < QK; ++j) a[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
#endif
      rows.scale[r * nb + b] = s;
      rows.sum[r * nb + b] = total;
    }
  }
  return rows;
}

#if defined(Q4_AVX2)
// rows r .. r + R of one block of a tile (AVX2): nib holds the block's unpacked nibbles (tile()),
// acc [R][2] the rows' sums of the 16 outputs. vpmaddubsw's pairs are summed in 16 bits across the
// block and widened once by vpmaddwd: a pair is at most 2 * 15 * 127 = 3810 in magnitude (|a| <= 127:
// quantize), a half's 8 pairs per lane at most 30480 < 32767, so no partial sum saturates and the
// sums are vpdpbusd's exactly; the float steps are the AVX-512 path's, in its order.
template <int R>
inline void group(const __m256i (*nib)[2], const __m256* dm, const Rows& x, int64_t r, int64_t b, __m256 (*acc)[2]) {
  const int8_t* a = x.a.data() + r * x.K + b * QK;
  __m256i s[R][2];
  for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m256i n0 = _mm256_load_si256(&nib[j][0]), n1 = _mm256_load_si256(&nib[j][1]);
    const int64_t at = (j & 1) * 16 + (j >> 1) * 4;
    for (int i = 0; i < R; ++i) {
      const __m256i quad = _mm256_set1_epi32(load4(a + i * x.K + at));
      s[i][0] = _mm256_add_epi16(s[i][0], _mm256_maddubs_epi16(n0, quad));
      s[i][1] = _mm256_add_epi16(s[i][1], _mm256_maddubs_epi16(n1, quad));
    }
    // the sums stay in registers step by step: GCC otherwise reassociates the integer sums and
    // spills every product before adding them
    for (int i = 0; i < R; ++i) asm("" : "+x"(s[i][0]), "+x"(s[i][1]));
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < R; ++i) {
    const int64_t rb = (r + i) * x.nb + b;
    const __m256 scale = _mm256_set1_ps(x.scale[rb]), sum = _mm256_set1_ps(x.sum[rb]);
    for (int h = 0; h < 2; ++h) {
      acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[i][h], ones)), _mm256_mul_ps(dm[h], scale), acc[i][h]);
      acc[i][h] = _mm256_fmadd_ps(dm[2 + h], sum, acc[i][h]);
    }
  }
}
#endif

// rows r0..r0+MR of one tile's 16 outputs -> out [MR][16]
template <int MR>
void tile(const uint8_t* W, const Rows& x, int64_t r0, float* out) {
  const int64_t nb = x.nb;
#if defined(Q4_AVX512)
  const int64_t K = x.K;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = W + b * BLOCK_BYTES;
    for (int l = 0; l < 5; ++l) _mm_prefetch(reinterpret_cast<const char*>(blk + Q4_AHEAD + 64 * l), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(blk + 64 + 64 * c);
      lo[c] = _mm512_and_si512(raw, low4);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    for (int r = 0; r < MR; ++r) {
      const int8_t* a4 = x.a.data() + (r0 + r) * K + b * QK;
#if defined(Q4_NO_VNNI)
      // a 16-bit lane sums 2 products per vpmaddubsw, 8 of them over the block: at most
      // 8 * 2 * 15 * 127 = 30480 in magnitude (|a| <= 127: quantize), so no partial sum wraps and
      // vpmaddwd's 32-bit sums are the block's exactly (vpdpbusd's s0 + s1)
      __m512i t = _mm512_add_epi16(_mm512_maddubs_epi16(lo[0], _mm512_set1_epi32(load4(a4))),
                                   _mm512_maddubs_epi16(hi[0], _mm512_set1_epi32(load4(a4 + 16))));
      for (int c = 1; c < 4; ++c) {
        t = _mm512_add_epi16(t, _mm512_maddubs_epi16(lo[c], _mm512_set1_epi32(load4(a4 + 4 * c))));
        t = _mm512_add_epi16(t, _mm512_maddubs_epi16(hi[c], _mm512_set1_epi32(load4(a4 + 16 + 4 * c))));
      }
      const __m512i sums = _mm512_madd_epi16(t, _mm512_set1_epi16(1));
#else
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], _mm512_set1_epi32(load4(a4)));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], _mm512_set1_epi32(load4(a4 + 16)));
      for (int c = 1; c < 4; ++c) {
        s0 = _mm512_dpbusd_epi32(s0, lo[c], _mm512_set1_epi32(load4(a4 + 4 * c)));
        s1 = _mm512_dpbusd_epi32(s1, hi[c], _mm512_set1_epi32(load4(a4 + 16 + 4 * c)));
      }
      const __m512i sums = _mm512_add_epi32(s0, s1);
#endif
      const int64_t rb = (r0 + r) * nb + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[rb])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[rb]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * TILE, acc[r]);
#elif defined(Q4_AVX2)
  // The block's 16 x 32 nibbles are unpacked once into `nib` (L1), [k-step][half]: step 2 c is
  // chunk c's low nibbles (inputs 4 c .. 4 c + 3), step 2 c + 1 its high ones (16 + 4 c ..), half h
  // outputs 8 h .. 8 h + 7; d and m into `dm`. The tile's rows (at most MAX_ROWS) go through
  // them together (group<MR>): each step's two nibble vectors are loaded once for them all, and each
  // broadcast activation quad meets both halves.
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i nib[8][2];
  __m256 dm[4];
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  static_assert(MR <= MAX_ROWS, "an AVX2 tile's rows are one group");
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = W + b * BLOCK_BYTES;
    for (int l = 0; l < 5; ++l) _mm_prefetch(reinterpret_cast<const char*>(blk + Q4_AHEAD + 64 * l), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 64 * c + 32 * h));
        nib[2 * c][h] = _mm256_and_si256(raw, low4);
        nib[2 * c + 1][h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      }
    for (int v = 0; v < 4; ++v)  // d (outputs 0..7, 8..15), then m
      dm[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * v)));
    group<MR>(nib, dm, x, r0, b, acc);
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(out + r * TILE, acc[r][0]);
    _mm256_storeu_ps(out + r * TILE + 8, acc[r][1]);
  }
#else
  const int64_t K = x.K;
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < TILE; ++i) out[r * TILE + i] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = W + b * BLOCK_BYTES;
    for (int r = 0; r < MR; ++r) {
      const int8_t* a = x.a.data() + (r0 + r) * K + b * QK;
      const int64_t rb = (r0 + r) * nb + b;
      for (int i = 0; i < TILE; ++i) {
        int32_t dot = 0;
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = blk[64 + 64 * c + 4 * i + j];
            dot += static_cast<int32_t>(byte & 15) * a[4 * c + j] + static_cast<int32_t>(byte >> 4) * a[16 + 4 * c + j];
          }
        float& o = out[r * TILE + i];
        o = static_cast<float>(dot) * (half_to_float(load_half(blk + 2 * i)) * x.scale[rb]) + o;
        o = half_to_float(load_half(blk + 2 * (TILE + i))) * x.sum[rb] + o;
      }
    }
  }
#endif
}

// tiles t0..t1 for every row, into Y [M, N] (a padded tile's extra outputs are dropped)
void tiles(const uint8_t* W, const Rows& x, float* Y, int64_t N, int64_t t0, int64_t t1) {
  float out[MAX_ROWS * TILE];
  const int64_t tile_bytes = x.nb * BLOCK_BYTES;
  // the rows in even tiles of at most MAX_ROWS (10 rows: 5 + 5, not 9 + 1 or, on AVX2, 6 + 4: a tile of
  // one row pays a block's unpacking for one row's products)
  const int64_t groups = (x.M + MAX_ROWS - 1) / MAX_ROWS, each = (x.M + groups - 1) / groups;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t width = std::min<int64_t>(TILE, N - t * TILE);
    for (int64_t r0 = 0; r0 < x.M; r0 += each) {
      const int rows = static_cast<int>(std::min<int64_t>(each, x.M - r0));
      const uint8_t* w = W + t * tile_bytes;
      switch (rows) {
        case 1: tile<1>(w, x, r0, out); break;
        case 2: tile<2>(w, x, r0, out); break;
        case 3: tile<3>(w, x, r0, out); break;
        case 4: tile<4>(w, x, r0, out); break;
        case 5: tile<5>(w, x, r0, out); break;
#if defined(Q4_AVX2)
        default: tile<6>(w, x, r0, out); break;
#else
        case 6: tile<6>(w, x, r0, out); break;
        case 7: tile<7>(w, x, r0, out); break;
        case 8: tile<8>(w, x, r0, out); break;
        default: tile<9>(w, x, r0, out); break;
#endif
      }
      for (int r = 0; r < rows; ++r) std::memcpy(Y + (r0 + r) * N + t * TILE, out + r * TILE, width * sizeof(float));
    }
  }
}

// y [M, N] = x [M, K] @ the weights of W ([ceil(N / 16)] tiles of K / 32 blocks), float32
void q4_matmul(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t N, float* Y) {
  if (M == 0 || N == 0) return;
  const Rows rows = quantize(x, M, K);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (K * TILE));  // >= 64 k weights a task
  at::parallel_for(0, (N + TILE - 1) / TILE, grain, [&](int64_t t0, int64_t t1) { tiles(W, rows, Y, N, t0, t1); });
}

void check_tiles(const at::Tensor& blocks, int64_t K, int64_t N) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "q4_mm: blocks must be contiguous uint8 [tiles, in / 32 * 320] on CPU");
  TORCH_CHECK(K > 0 && K % QK == 0, "q4_mm: in (", K, ") must be a positive multiple of 32");
  TORCH_CHECK(blocks.size(0) == (N + TILE - 1) / TILE && blocks.size(1) == K / QK * BLOCK_BYTES, "q4_mm: blocks are ",
              blocks.sizes(), "; ", N, " outputs of ", K, " inputs need [", (N + TILE - 1) / TILE, ", ",
              K / QK * BLOCK_BYTES, "]");
}

// x [M, K] (any float dtype) @ the weights of `blocks` ([ceil(N / 16), K / 32 * 320] uint8) -> [M, N]
at::Tensor q4_mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2, "q4_mm: x must be [rows, in], not ", x_in.sizes());
  TORCH_CHECK(x_in.device().is_cpu(), "q4_mm runs on CPU");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte, "q4_mm: blocks must be uint8 [tiles, in / 32 * 320]");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  check_tiles(blocks.contiguous(), K, N);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor w = blocks.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  q4_matmul(x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N, y.data_ptr<float>());
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// ----------------------------------------------------------------------------- float32 panels
// specdec::f32_mm: y = x @ w for float32 weights laid out in panels (model_service/q4_kernel.py: panel()
// packs them): outputs in panels of 16 (the last padded with zero weights), each panel its K
// inputs in order, 16 floats an input (w[k][16 p ... 16 p + 15]): one vector an input on AVX-512,
// two on AVX2. The weights stream through once for a group of up to PANEL_ROWS rows, one
// multiply-add a row and input, so a verify pass's few rows cost what one row costs while the
// weights' reads bound the pass (oneDNN's packed product re-read them, and MKL's sgemm per row).
// On AVX-512 a call of at most PAIR_ROWS rows takes two panels at a time (panel_pair), so that each
// broadcast input serves two multiply-adds, as the AVX2 path's two halves of a panel do.
//
// A row's sums are made by the same operations whatever the rows or threads of the call (each
// output lane's chain over the inputs, on AVX-512 the even and the odd inputs in two chains added
// at the end): a row's result does not depend on what it is batched with, so a verify pass scores
// a token exactly as a one-token pass would.

constexpr int64_t PANEL = 16;
// how far ahead of the product the weights are prefetched, in floats (4 kB): the hardware's
// prefetcher alone kept too few lines in flight once a line took several rows' multiply-adds
// (one core, 5 rows: 33 -> 22 ms for SmolLM2's 540 MB, 1 row 21 -> 19-22)
constexpr int64_t PANEL_AHEAD = 1024;
#if defined(Q4_AVX512)
constexpr int PANEL_ROWS = 12;  // 24 accumulators (two chains a row) of 32 registers
#else
constexpr int PANEL_ROWS = 6;  // 12 accumulators (two halves a row) of 16 registers
#endif

// rows r0..r0+R of x [., K] against one panel P [K][16] -> out [R][16]
template <int R>
void panel(const float* P, const float* x, int64_t K, int64_t r0, float* out) {
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (r0 + r) * K;
#if defined(Q4_AVX512)
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(P + k * PANEL + PANEL_AHEAD), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(P + (k + 1) * PANEL + PANEL_AHEAD), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(P + k * PANEL), w1 = _mm512_loadu_ps(P + (k + 1) * PANEL);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k]), w0, even[r]);
      odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k + 1]), w1, odd[r]);
    }
  }
  if (k < K) {
    const __m512 w0 = _mm512_loadu_ps(P + k * PANEL);
    for (int r = 0; r < R; ++r) even[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k]), w0, even[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * PANEL, _mm512_add_ps(even[r], odd[r]));
#elif defined(Q4_AVX2)
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(P + k * PANEL + PANEL_AHEAD), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(P + k * PANEL), w1 = _mm256_loadu_ps(P + k * PANEL + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(xr[r][k]);
      lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * PANEL, lo[r]);
    _mm256_storeu_ps(out + r * PANEL + 8, hi[r]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < PANEL; ++i) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(xr[r][k], P[k * PANEL + i], acc);
      out[r * PANEL + i] = acc;
    }
#endif
}

#if defined(Q4_AVX512)
// rows r0..r0+R of x [., K] against two panels, P0 and the next (P0 + K * 16) -> out0, out1 [R][16]:
// panel<R>'s sums for each, in its order (the same numbers), with each row's broadcast input meeting
// both panels' weights (a pass of a few rows waits less on its loads: one broadcast a row and input
// for two multiply-adds, not one; SmolLM2's 540 MB of products on 2 Xeon cores, 5 rows 24.2-25.1 ->
// 22.1-22.7 ms, 1 row 19.5-20.1 -> 19.0-19.9, 9 rows (two groups) level, so more rows keep panel<R>)
constexpr int PAIR_ROWS = 6;  // 24 accumulators of 32 registers
// Whether calls of up to PAIR_ROWS rows take panels in pairs: on Intel's cores, not on AMD's. On 2 cores
// of an AMD EPYC (Zen 4) one panel at a time ran the float32 passes faster (one process alternating the
// two, 1 session on 128 cached tokens, two processes, ms at 1 / 2 / 5 tokens: pairs 17.71 / 17.57 /
// 20.07 and 12.69 / 13.83 / 18.09, one at a time 17.15 / 16.89 / 17.78 and 11.93 / 12.03 / 14.69):
// each thread then streams one panel, not two 4 kB-aligned ones side by side. f32_pairs() sets it.
bool pairs_by_default() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return ebx != 0x68747541;  // "Auth" of "AuthenticAMD"
#endif
  return true;
}
std::atomic<bool> pairs{pairs_by_default()};
template <int R>
void panel_pair(const float* P0, const float* x, int64_t K, int64_t r0, float* out0, float* out1) {
  const float* P1 = P0 + K * PANEL;
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (r0 + r) * K;
  __m512 even0[R], odd0[R], even1[R], odd1[R];
  for (int r = 0; r < R; ++r) even0[r] = odd0[r] = even1[r] = odd1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    for (const float* P : {P0, P1}) {
      _mm_prefetch(reinterpret_cast<const char*>(P + k * PANEL + PANEL_AHEAD), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(P + (k + 1) * PANEL + PANEL_AHEAD), _MM_HINT_T0);
    }
    const __m512 w00 = _mm512_loadu_ps(P0 + k * PANEL), w01 = _mm512_loadu_ps(P0 + (k + 1) * PANEL);
    const __m512 w10 = _mm512_loadu_ps(P1 + k * PANEL), w11 = _mm512_loadu_ps(P1 + (k + 1) * PANEL);
    for (int r = 0; r < R; ++r) {
      const __m512 a0 = _mm512_set1_ps(xr[r][k]), a1 = _mm512_set1_ps(xr[r][k + 1]);
      even0[r] = _mm512_fmadd_ps(a0, w00, even0[r]);
      odd0[r] = _mm512_fmadd_ps(a1, w01, odd0[r]);
      even1[r] = _mm512_fmadd_ps(a0, w10, even1[r]);
      odd1[r] = _mm512_fmadd_ps(a1, w11, odd1[r]);
    }
  }
  if (k < K) {
    const __m512 w00 = _mm512_loadu_ps(P0 + k * PANEL), w10 = _mm512_loadu_ps(P1 + k * PANEL);
    for (int r = 0; r < R; ++r) {
      const __m512 a0 = _mm512_set1_ps(xr[r][k]);
      even0[r] = _mm512_fmadd_ps(a0, w00, even0[r]);
      even1[r] = _mm512_fmadd_ps(a0, w10, even1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out0 + r * PANEL, _mm512_add_ps(even0[r], odd0[r]));
    _mm512_storeu_ps(out1 + r * PANEL, _mm512_add_ps(even1[r], odd1[r]));
  }
}
#endif

// panels p0..p1 for every row, into Y [M, N] (a padded panel's extra outputs are dropped)
void panels(const float* W, const float* x, int64_t M, int64_t K, float* Y, int64_t N, int64_t p0, int64_t p1) {
  float out[PANEL_ROWS * PANEL];
#if defined(Q4_AVX512)
  if (M <= PAIR_ROWS && pairs.load(std::memory_order_relaxed)) {  // two panels at a time, the odd one left below
    float out1[PAIR_ROWS * PANEL];
    for (; p0 + 2 <= p1; p0 += 2) {
      const float* w = W + p0 * K * PANEL;
      switch (M) {
        case 1: panel_pair<1>(w, x, K, 0, out, out1); break;
        case 2: panel_pair<2>(w, x, K, 0, out, out1); break;
        case 3: panel_pair<3>(w, x, K, 0, out, out1); break;
        case 4: panel_pair<4>(w, x, K, 0, out, out1); break;
        case 5: panel_pair<5>(w, x, K, 0, out, out1); break;
        default: panel_pair<6>(w, x, K, 0, out, out1); break;
      }
      const int64_t width = std::min<int64_t>(PANEL, N - (p0 + 1) * PANEL);  // the second may be padded
      for (int64_t r = 0; r < M; ++r) {
        std::memcpy(Y + r * N + p0 * PANEL, out + r * PANEL, PANEL * sizeof(float));
        std::memcpy(Y + r * N + (p0 + 1) * PANEL, out1 + r * PANEL, width * sizeof(float));
      }
    }
  }
#endif
  const int64_t groups = (M + PANEL_ROWS - 1) / PANEL_ROWS, each = (M + groups - 1) / groups;  // even groups
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t width = std::min<int64_t>(PANEL, N - p * PANEL);
    const float* w = W + p * K * PANEL;
    for (int64_t r0 = 0; r0 < M; r0 += each) {
      const int rows = static_cast<int>(std::min<int64_t>(each, M - r0));
      switch (rows) {
        case 1: panel<1>(w, x, K, r0, out); break;
        case 2: panel<2>(w, x, K, r0, out); break;
        case 3: panel<3>(w, x, K, r0, out); break;
        case 4: panel<4>(w, x, K, r0, out); break;
        case 5: panel<5>(w, x, K, r0, out); break;
#if defined(Q4_AVX512)
        case 6: panel<6>(w, x, K, r0, out); break;
        case 7: panel<7>(w, x, K, r0, out); break;
        case 8: panel<8>(w, x, K, r0, out); break;
        case 9: panel<9>(w, x, K, r0, out); break;
        case 10: panel<10>(w, x, K, r0, out); break;
        case 11: panel<11>(w, x, K, r0, out); break;
        default: panel<12>(w, x, K, r0, out); break;
#else
        default: panel<6>(w, x, K, r0, out); break;
#endif
      }
      for (int r = 0; r < rows; ++r) std::memcpy(Y + (r0 + r) * N + p * PANEL, out + r * PANEL, width * sizeof(float));
    }
  }
}

// y [M, N] = x [M, K] @ the weights of W ([ceil(N / 16)] panels of K x 16), float32
void f32_matmul(const float* x, int64_t M, int64_t K, const float* W, int64_t N, float* Y) {
  if (M == 0 || N == 0) return;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (K * PANEL));  // >= 64 k weights a task
  at::parallel_for(0, (N + PANEL - 1) / PANEL, grain,
                   [&](int64_t p0, int64_t p1) { panels(W, x, M, K, Y, N, p0, p1); });
}

void check_panels(const at::Tensor& w, int64_t K, int64_t N) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "f32_mm: panels must be contiguous float32 [panels, in * 16] on CPU");
  TORCH_CHECK(K > 0 && N > 0, "f32_mm: in (", K, ") and out (", N, ") must be positive");
  TORCH_CHECK(w.size(0) == (N + PANEL - 1) / PANEL && w.size(1) == K * PANEL, "f32_mm: panels are ", w.sizes(), "; ", N,
              " outputs of ", K, " inputs need [", (N + PANEL - 1) / PANEL, ", ", K * PANEL, "]");
}

// x [M, K] (any float dtype) @ the weights of `panels` ([ceil(N / 16), K * 16] float32) -> [M, N]
at::Tensor f32_mm(const at::Tensor& x_in, const at::Tensor& panels_in, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2, "f32_mm: x must be [rows, in], not ", x_in.sizes());
  TORCH_CHECK(x_in.device().is_cpu(), "f32_mm runs on CPU");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const at::Tensor w = panels_in.contiguous();
  check_panels(w, K, N);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  f32_matmul(x.data_ptr<float>(), M, K, w.data_ptr<float>(), N, y.data_ptr<float>());
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// the layer loop's products: weights in int4 tiles (uint8) or float32 panels
void check_weights(const at::Tensor& w, int64_t K, int64_t N) {
  if (w.scalar_type() == at::kFloat) check_panels(w, K, N);
  else check_tiles(w, K, N);
}

void matmul(const at::Tensor& w, const float* x, int64_t M, int64_t K, int64_t N, float* Y) {
  if (w.scalar_type() == at::kFloat) f32_matmul(x, M, K, w.data_ptr<float>(), N, Y);
  else q4_matmul(x, M, K, w.data_ptr<uint8_t>(), N, Y);
}

// ----------------------------------------------------------------------------- the layer loop
// FastForward's layers for one sequence (scripted._layers' arithmetic) with every linear in
// these tiles: RMSNorm, q/k/v, RoPE, the cache write, causal attention, o, RMSNorm, gate/up, SiLU,
// down and the residual adds as plain loops between the kernel's products, so a pass makes ~5
// calls a layer instead of TorchScript's ~40 dispatched ones (each of which cost more than its
// arithmetic at these sizes).

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if defined(Q4_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  total = _mm512_reduce_add_ps(acc);
#elif defined(Q4_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  total = hsum8(acc);
#endif
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a x
  int64_t i = 0;
#if defined(Q4_AVX512)
  const __m512 av = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(Q4_AVX2)
  const __m256 av = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

#if defined(Q4_AVX512)
// exp of 16 floats: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial (~1 ulp)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-103.972077f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#elif defined(Q4_AVX2)
// exp16's arithmetic on 8 floats (within 2 ulp of exp where exp is a normal float); 2^n (n in
// -150..128) as the product of two powers of two, each a normal float made from its exponent bits,
// since AVX2 has no vscalefps. std::exp takes 3.9 ns a float, this 1.0 (AMD EPYC, Zen 3); SmolLM2's
// SiLU and softmax take ~115 k of them a row of a pass at 256 cached positions.
inline __m256 pow2i(__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); }

inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-103.972077f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i k = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(k, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2i(half)), pow2i(_mm256_sub_epi32(k, half)));
}
#endif

// v[i] = exp(v[i] - shift) for i < n; -> their sum
inline float exp_sum(float* v, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#if defined(Q4_AVX512)
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(v + i), sh));
    _mm512_storeu_ps(v + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(Q4_AVX2)
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), sh));
    _mm256_storeu_ps(v + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = hsum8(acc);
#endif
  for (; i < n; ++i) {
    v[i] = std::exp(v[i] - shift);
    total += v[i];
  }
  return total;
}

// out[j] = SiLU(gate[j]) * up[j] = gate / (1 + exp(-gate)) * up, j < n
inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t j = 0;
#if defined(Q4_AVX512)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; j + 16 <= n; j += 16) {
    const __m512 g = _mm512_loadu_ps(gate + j);
    const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(sig, _mm512_loadu_ps(up + j)));
  }
#elif defined(Q4_AVX2)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(sig, _mm256_loadu_ps(up + j)));
  }
#endif
  for (; j < n; ++j) out[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
}

// the largest of v[0 .. n - 1] (-inf for none): a max is exact, so 8 lanes give the one-at-a-time
// result (where a score is NaN the row's softmax is NaN either way)
inline float max_of(const float* v, int64_t n) {
  float top = -INFINITY;
  int64_t j = 0;
#if defined(Q4_V8)
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(v);
    for (j = 8; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(v + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (const float x : lanes) top = std::max(top, x);
  }
#endif
  for (; j < n; ++j) top = std::max(top, v[j]);
  return top;
}

// One query head's attention over `seen` cached positions: scores q . k_j * scale, softmax,
// out = sum_j p_j v_j (keys and values `stride` floats apart, head_dim `hd`). `scores` holds seen
// floats. Where head_dim is 64 or 128 (NC = hd / 16 vectors) the AVX-512 path scores 16 keys at a
// time, their 16 dot products' horizontal sums in one transposing tree (sum16) instead of one
// reduction each, and sums the values in registers (two sets of accumulators, even and odd keys)
// instead of reading and writing the output once per key; otherwise dot / axpy a key at a time.
#if defined(Q4_AVX512)
// lane k of the result = the sum of the 16 lanes of v[k]
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v[4 i .. 4 i + 3]
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// attend_head's and attend_shared's steps 16 lanes wide (AVX-512, head_dim 16 NC): one query's scores
// for keys j0 .. end - 1 (key j at keys + (j - j0) * stride), 16 keys at a time, their sums transposed
// by sum16, the rest by dot
template <int NC>
inline void scores16(const float* q, const float* keys, int64_t stride, int64_t j0, int64_t end, float scale,
                     float* s) {
  __m512 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  int64_t j = j0;
  for (; j + 16 <= end; j += 16) {
    __m512 part[16];
    for (int k = 0; k < 16; ++k) {
      const float* kr = keys + (j - j0 + k) * stride;
      __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
      for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), a);
      part[k] = a;
    }
    _mm512_storeu_ps(s + j, _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
  }
  for (; j < end; ++j) s[j] = dot(q, keys + (j - j0) * stride, 16 * NC) * scale;
}

// out += p[j] * inv * v_j for keys j0 .. j1 - 1 (value j at values + (j - j0) * stride): even and odd
// keys in two sets of registers, added into out at the end
template <int NC>
inline void accumulate16(const float* p, float inv, const float* values, int64_t stride, int64_t j0, int64_t j1,
                         float* out) {
  __m512 even[NC], odd[NC];
  for (int c = 0; c < NC; ++c) {
    even[c] = _mm512_loadu_ps(out + 16 * c);
    odd[c] = _mm512_setzero_ps();
  }
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2) {
    const float* v0 = values + (j - j0) * stride;
    const float* v1 = v0 + stride;
    const __m512 p0 = _mm512_set1_ps(p[j] * inv), p1 = _mm512_set1_ps(p[j + 1] * inv);
    for (int c = 0; c < NC; ++c) {
      even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
      odd[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), odd[c]);
    }
  }
  if (j < j1) {
    const __m512 p0 = _mm512_set1_ps(p[j] * inv);
    for (int c = 0; c < NC; ++c)
      even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(values + (j - j0) * stride + 16 * c), even[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_add_ps(even[c], odd[c]));
}

template <int NC>
void attend_head(const float* q, const float* keys, const float* values, int64_t stride, int64_t seen, float scale,
                 float* scores, float* out) {
  scores16<NC>(q, keys, stride, 0, seen, scale, scores);
  const float inv = 1.f / exp_sum(scores, seen, max_of(scores, seen));
  std::fill(out, out + 16 * NC, 0.f);
  accumulate16<NC>(scores, inv, values, stride, 0, seen, out);
}

void attend(const float* q, const float* keys, const float* values, int64_t stride, int64_t seen, int64_t hd,
            float scale, float* scores, float* out) {
  if (hd == 64) return attend_head<4>(q, keys, values, stride, seen, scale, scores, out);
  if (hd == 128) return attend_head<8>(q, keys, values, stride, seen, scale, scores, out);
  float top = -INFINITY;
  for (int64_t j = 0; j < seen; ++j) {
    scores[j] = dot(q, keys + j * stride, hd) * scale;
    top = std::max(top, scores[j]);
  }
  const float inv = 1.f / exp_sum(scores, seen, top);
  std::fill(out, out + hd, 0.f);
  for (int64_t j = 0; j < seen; ++j) axpy(scores[j] * inv, values + j * stride, out, hd);
}
#endif

// attend_shared and attend_rows: every build's attention over float16 caches, and the AVX2 and plain
// C++ builds' over float32 ones (the AVX-512 build's float32 attention is attend's, above).

// The first key a query at `position` sees: 0, or under a sliding window (window > 0) the first of the last
// `window` keys up to its own (transformers': key > position - window)
inline int64_t first_key(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0;
}

// One query of attend_shared: hd floats of q and of out, and the keys it sees (first .. seen - 1: 0 .. its
// position, or the last `window` of them under a sliding window: first_key)
struct Query {
  const float* q;
  float* out;
  int64_t seen;
  int64_t first;
};

// One kv head of a sequence's cache: its keys and values (float or half_bits), positions `stride` apart
template <class C>
struct KvHead {
  const C* keys;
  const C* values;
  int64_t stride;
};

#if defined(Q4_V8)
// lane k = the sum of a[k]'s 8 lanes, by the AVX2 build's hsum8's additions in its order, eight vectors at once
inline __m256 hsum8x8(const __m256* a) {
  __m256 f[4];  // f[k]: lanes 0-3 a[k]'s low half + high half, lanes 4-7 a[k + 4]'s
  for (int k = 0; k < 4; ++k)
    f[k] = _mm256_add_ps(_mm256_permute2f128_ps(a[k], a[k + 4], 0x20), _mm256_permute2f128_ps(a[k], a[k + 4], 0x31));
  // per 128-bit lane: [y0 + y2 of f[0], of f[1], y1 + y3 of f[0], of f[1]]
  const __m256 w01 = _mm256_add_ps(_mm256_unpacklo_ps(f[0], f[1]), _mm256_unpackhi_ps(f[0], f[1]));
  const __m256 w23 = _mm256_add_ps(_mm256_unpacklo_ps(f[2], f[3]), _mm256_unpackhi_ps(f[2], f[3]));
  const __m256d a01 = _mm256_castps_pd(w01), a23 = _mm256_castps_pd(w23);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a01, a23)), _mm256_castpd_ps(_mm256_unpackhi_pd(a01, a23)));
}

// lane k = q . (keys + k * stride) over 8 NC floats: eight keys' products at once (on AVX2 each key's sum
// dot's; on AVX-512, whose dot sums 16 lanes, not bit for bit dot's)
template <int NC>
inline __m256 dots8(const float* q, const float* keys, int64_t stride) {
  __m256 a[8];
  for (int k = 0; k < 8; ++k) a[k] = _mm256_setzero_ps();
  for (int c = 0; c < NC; ++c) {
    const __m256 qc = _mm256_loadu_ps(q + 8 * c);
    for (int k = 0; k < 8; ++k) a[k] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + k * stride + 8 * c), a[k]);
  }
  return hsum8x8(a);
}

// out += p[j] * inv * v_j for keys j0 .. j1 - 1 in order: axpy's operations, the output held in registers
template <int NC>
inline void accumulate(const float* p, float inv, const float* values, int64_t stride, int64_t j0, int64_t j1,
                       float* out) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(out + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j] * inv);
    const float* v = values + (j - j0) * stride;
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * c), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}
#endif

// n float16 values as floats
inline void to_floats(const half_bits* h, float* out, int64_t n) {
  int64_t i = 0;
#if defined(Q4_AVX512)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
#endif
#if defined(Q4_V8)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}

// n queries that read one kv head (rows of one sequence, each with the q heads of the head's group),
// each given the operations it had when attended alone, bit for bit: scores (with AVX2, on every
// build but the plain C++ one, and head_dim 64 or 128: dots8 for whole groups of eight keys, their
// sums transposed by hsum8x8; dot for the rest), exp_sum, then the values in key order, summed in
// registers (accumulate) instead of read and written once per key (axpy: a store-to-load chain).
// The keys and values are read a block at a time for all of them (one (row, head) at a time read
// them once per q head and per row): SmolLM2's int4 pass on 1,024 cached tokens had spent ~2 ms a
// row in attention (docs/performance.md). The AVX-512 build had left the eight-key paths to dot and
// axpy: on a 2-core Xeon (AVX-512 VNNI) its int4 pass of 9 tokens on 128 cached ones took 9.2 ms
// against 8.2 with them (medians, one session); its scores are summed in another order since
// (another last bit: its int4 model's greedy output may part from the earlier build's, as two int4
// kernels' do). A query's operations are the same whatever it is batched with, so a row's result
// does not depend on the rows, heads or threads it shares a task with. scores: n x width floats, width >= every seen.
// A float16 cache's block is converted to floats once for all the queries, which then run the
// float32 operations on it: the result is float32 attention over the rounded keys and values.
// AVX-512 builds (head_dim 64 or 128) take sixteen keys at a time (scores16: attend_head's scoring)
// and sum the values 16 lanes wide (accumulate16): on the Xeon an int4 pass of one token over 600
// cached tokens in float16 1.08x its float32-cache pass with the eight-key paths, 1.03-1.04x with these
// (level at 128; another last bit again).
template <class C>
void attend_shared(const Query* qs, int64_t n, const KvHead<C>& kv, int64_t hd, float scale, float* scores,
                   int64_t width) {
  constexpr bool converts = !std::is_same<C, float>::value;
  const int64_t block = std::max<int64_t>(8, 4096 / hd);  // keys a block: 16 kB of floats, in L1 for every query
  int64_t most = 0, least = INT64_MAX;
  for (int64_t i = 0; i < n; ++i) {
    most = std::max(most, qs[i].seen);
    least = std::min(least, qs[i].first);
  }
  const int64_t from = least / block * block;  // (blocks at multiples of `block` whatever the batch)
  std::vector<float> inv(n), buffer(converts ? block * hd : 0);
  // positions j0 .. j1 - 1 of `base` (the keys or the values) as floats, `stride` apart
  int64_t stride = kv.stride;
  const auto floats = [&](const C* base, int64_t j0, int64_t j1) -> const float* {
    if constexpr (converts) {
      for (int64_t j = j0; j < j1; ++j) to_floats(base + j * kv.stride, buffer.data() + (j - j0) * hd, hd);
      stride = hd;
      return buffer.data();
    } else {
      (void)j1;
      return base + j0 * kv.stride;
    }
  };
  for (int64_t j0 = from; j0 < most; j0 += block) {
    const int64_t j1 = std::min(most, j0 + block);
    const float* block_keys = floats(kv.keys, j0, j1);  // key j at block_keys + (j - j0) * stride
    for (int64_t i = 0; i < n; ++i) {
      float* s = scores + i * width;
      const int64_t begin = std::max(j0, qs[i].first), end = std::min(j1, qs[i].seen);
      if (end <= begin) continue;
      const float* keys = block_keys + (begin - j0) * stride;  // key j at keys + (j - begin) * stride
#if defined(Q4_AVX512)
      if (hd == 64 || hd == 128) {
        (hd == 64 ? scores16<4> : scores16<8>)(qs[i].q, keys, stride, begin, end, scale, s);
        continue;
      }
#endif
      int64_t j = begin;
#if defined(Q4_V8)
      const __m256 sv = _mm256_set1_ps(scale);
      for (; j + 8 <= end && (hd == 64 || hd == 128); j += 8) {
        const float* k = keys + (j - begin) * stride;
        const __m256 d = hd == 64 ? dots8<8>(qs[i].q, k, stride) : dots8<16>(qs[i].q, k, stride);
        _mm256_storeu_ps(s + j, _mm256_mul_ps(d, sv));
      }
#endif
      for (; j < end; ++j) s[j] = dot(qs[i].q, keys + (j - begin) * stride, hd) * scale;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    float* s = scores + i * width + qs[i].first;
    const int64_t count = qs[i].seen - qs[i].first;
    inv[i] = 1.f / exp_sum(s, count, max_of(s, count));
    std::fill(qs[i].out, qs[i].out + hd, 0.f);
  }
  for (int64_t j0 = from; j0 < most; j0 += block) {
    const int64_t j1 = std::min(most, j0 + block);
    const float* block_values = floats(kv.values, j0, j1);  // value j at block_values + (j - j0) * stride
    for (int64_t i = 0; i < n; ++i) {
      const float* s = scores + i * width;
      const int64_t begin = std::max(j0, qs[i].first), end = std::min(j1, qs[i].seen);
      if (end <= begin) continue;
      const float* values = block_values + (begin - j0) * stride;  // value j at values + (j - begin) * stride
#if defined(Q4_AVX512)
      if (hd == 64 || hd == 128) {
        (hd == 64 ? accumulate16<4> : accumulate16<8>)(s, inv[i], values, stride, begin, end, qs[i].out);
        continue;
      }
#endif
#if defined(Q4_V8)
      if (hd == 64) {
        accumulate<8>(s, inv[i], values, stride, begin, end, qs[i].out);
        continue;
      }
      if (hd == 128) {
        accumulate<16>(s, inv[i], values, stride, begin, end, qs[i].out);
        continue;
      }
#endif
      for (int64_t j = begin; j < end; ++j) axpy(s[j] * inv[i], values + (j - begin) * stride, qs[i].out, hd);
    }
  }
}

// Causal attention of a pass's rows through attend_shared: output row r is q row rows[r] (its
// sequence seq[t], position pos[t]: it sees keys 0 .. pos[t], the last `window` of them where window > 0),
// its H heads' results into att row r.
// A task is one (sequence, kv head) and its queries (the sequence's rows x the group's heads), split
// into parts only so that every thread has work and a part's scores stay small (each part reads the
// keys again); threads split the tasks where their scores hold >= ~128 k multiply-adds.
template <class Heads>  // Heads(s, g) -> KvHead<C>: sequence s's kv head g
void attend_rows(const float* qkv, int64_t qkv_n, float* att, int64_t qdim, const std::vector<int64_t>& rows,
                 const std::vector<int64_t>& seq, const std::vector<int64_t>& pos, int64_t S, int64_t H, int64_t Hkv,
                 int64_t hd, float scale, int64_t window, const Heads& heads) {
  const int64_t group = H / Hkv, R = static_cast<int64_t>(rows.size());
  std::vector<std::vector<int64_t>> of(S);  // each sequence's output rows
  for (int64_t r = 0; r < R; ++r) of[seq[rows[r]]].push_back(r);
  int64_t live = 0, width = 0;
  for (int64_t s = 0; s < S; ++s) live += !of[s].empty();
  for (int64_t r = 0; r < R; ++r) width = std::max(width, pos[rows[r]] + 1);
  if (live == 0) return;
  struct Task {
    int64_t s, g, first, n;
  };
  std::vector<Query> queries;
  std::vector<Task> tasks;
  queries.reserve(R * H);
  const int64_t threads = at::get_num_threads();
  const int64_t most_queries = std::max<int64_t>(1, std::min<int64_t>(64, (int64_t(1) << 16) / width));
  int64_t work = 0, largest = 1;
  for (int64_t s = 0; s < S; ++s) {
    if (of[s].empty()) continue;
    const int64_t n = static_cast<int64_t>(of[s].size()) * group;
    const int64_t spread = (2 * threads + live * Hkv - 1) / (live * Hkv);  // ~2 tasks a thread
    const int64_t parts = std::min(n, std::max(spread, (n + most_queries - 1) / most_queries));
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t first = static_cast<int64_t>(queries.size());
      for (const int64_t r : of[s]) {
        const int64_t t = rows[r];
        for (int64_t head = g * group; head < (g + 1) * group; ++head) {
          queries.push_back({qkv + t * qkv_n + head * hd, att + r * qdim + head * hd, pos[t] + 1,
                             first_key(pos[t], window)});
          work += (pos[t] + 1) * hd;
        }
      }
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t begin = first + n * p / parts, end = first + n * (p + 1) / parts;
        tasks.push_back({s, g, begin, end - begin});
        largest = std::max(largest, end - begin);
      }
    }
  }
  const int64_t count = static_cast<int64_t>(tasks.size());
  // split from ~16 k multiply-adds on (a query's scores; its values' as many again): a decode step's
  // attention, one token on 128 cached ones (SmolLM2: 74 k a layer), had run on one thread while the other
  // waited, and split, the one-token int4 pass took 7.97 ms against 8.74 (medians of six alternating
  // runs, 2 cores of an AMD EPYC, Zen 3); a tiny one (a short prompt's) still runs on the calling thread
  at::parallel_for(0, count, work < (int64_t(1) << 14) ? count : 1, [&](int64_t k0, int64_t k1) {
    std::vector<float> scores(largest * width);
    for (int64_t k = k0; k < k1; ++k) {
      const Task& task = tasks[k];
      attend_shared(queries.data() + task.first, task.n, heads(task.s, task.g), hd, scale, scores.data(), width);
    }
  });
}

// RoPE on the first `heads` heads of one row of q/k/v (x cos + rotate_half(x) sin; cos, sin [hd])
inline void rope_row(float* row, const float* c, const float* sn, int64_t heads, int64_t hd) {
  const int64_t rot = hd / 2;
  for (int64_t head = 0; head < heads; ++head) {
    float* v = row + head * hd;
    for (int64_t j = 0; j < rot; ++j) {
      const float a = v[j], b = v[j + rot];
      v[j] = a * c[j] + (-b) * sn[j];
      v[j + rot] = b * c[j + rot] + a * sn[j + rot];
    }
  }
}

// n floats into a cache: as they are, or rounded to float16 (nearest even)
inline void store_row(const float* x, float* out, int64_t n) { std::memcpy(out, x, n * sizeof(float)); }
inline void store_row(const float* x, half_bits* out, int64_t n) {
  int64_t i = 0;
#if defined(Q4_V8)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) out[i] = float_to_half(x[i]);
}

// One row's Hkv key and value heads (hd floats each, from k and v) into a cache's position:
// kv head g at keys / values + g * head_stride
template <class C>
inline void store_kv(const float* k, const float* v, C* keys, C* values, int64_t head_stride, int64_t Hkv, int64_t hd) {
  for (int64_t g = 0; g < Hkv; ++g) {
    store_row(k + g * hd, keys + g * head_stride, hd);
    store_row(v + g * hd, values + g * head_stride, hd);
  }
}

// a float32 cache's floats, or a float16 one's bits
template <class C>
C* cache_ptr(const at::Tensor& t);
template <>
float* cache_ptr<float>(const at::Tensor& t) { return t.data_ptr<float>(); }
template <>
half_bits* cache_ptr<half_bits>(const at::Tensor& t) { return reinterpret_cast<half_bits*>(t.data_ptr<at::Half>()); }

// out = x / sqrt(mean(x^2) + eps) * w, row by row (float32, as F.rms_norm)
void rms_norm(const float* x, const float* w, float* out, int64_t T, int64_t D, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * D;
    const float inv = 1.f / std::sqrt(dot(xr, xr, D) / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) out[t * D + i] = xr[i] * inv * w[i];
  }
}

// One pass of S sequences: x holds their new rows one sequence after another (lengths[s] rows
// each, at positions starts[s]...), kv[s] is sequence s's cache [L, 2, 1, H_kv, capacity, head_dim]
// (its own storage or a pool slot's view; elements E: float32, or float16 for every cache of the
// pass); the last layer carries on only each sequence's last keeps[s] rows (the rows whose logits
// are asked for; keeps[s] = lengths[s]: all of them). Every
// linear runs once over all the rows of all the sequences; attention reads each row's own sequence.
// -> the kept rows [R, D].
// capture: layers whose input (every row's) is copied into `states` [T, capture.size(), D], in that order.
template <class E>
at::Tensor layers_loop(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, at::TensorList kv,
                       at::IntArrayRef starts, at::IntArrayRef lengths, at::IntArrayRef keeps, int64_t H, int64_t Hkv,
                       int64_t hd, double eps_in, at::ArrayRef<double> scaling, at::TensorList in_norm,
                       at::TensorList post_norm, at::IntArrayRef half, const c10::List<std::optional<at::Tensor>>& qkv_bias,
                       at::TensorList weights, at::IntArrayRef outs, at::IntArrayRef capture, at::Tensor* states,
                       const std::optional<at::Tensor>& qk_norm, int64_t window, at::OptionalIntArrayRef rope) {
  const int64_t L = static_cast<int64_t>(in_norm.size()), S = static_cast<int64_t>(kv.size());
  TORCH_CHECK(window >= 0, "q4_layers: a sliding window of ", window, " keys");
  TORCH_CHECK(!rope.has_value() || static_cast<int64_t>(rope->size()) == L,
              "q4_layers: rope must say for each layer whether RoPE rotates its q and k");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "q4_layers: float32 x [T, D]");
  TORCH_CHECK(S > 0 && static_cast<int64_t>(starts.size()) == S && static_cast<int64_t>(lengths.size()) == S &&
              static_cast<int64_t>(keeps.size()) == S, "q4_layers: one cache, start, length and keep per sequence");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * L && static_cast<int64_t>(outs.size()) == 4 * L &&
              static_cast<int64_t>(post_norm.size()) == L && static_cast<int64_t>(half.size()) == L &&
              static_cast<int64_t>(scaling.size()) == L && static_cast<int64_t>(qkv_bias.size()) == L,
              "q4_layers: per-layer lists must match the layers");
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && hd > 0 && hd % 2 == 0,
              "q4_layers: heads a multiple of kv heads, an even head_dim");
  const bool qk_normed = qk_norm.has_value() && qk_norm->defined();
  TORCH_CHECK(!qk_normed || (qk_norm->dim() == 3 && qk_norm->size(0) == L && qk_norm->size(1) == 2 &&
                             qk_norm->size(2) == hd), "q4_layers: qk_norm must be [layers, 2, head_dim]");
  const at::Tensor qk_w_all = qk_normed ? qk_norm->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t T = x_in.size(0), D = x_in.size(1);
  std::vector<int64_t> seq(T), pos(T);  // each row's sequence and position
  int64_t row = 0;
  for (int64_t s = 0; s < S; ++s) {
    const at::Tensor& c = kv[s];
    TORCH_CHECK(c.dim() == 6 && c.size(0) >= L && c.size(1) == 2 && c.size(2) == 1 && c.size(3) == Hkv &&
                c.size(5) == hd && c.stride(5) == 1, "q4_layers: a cache must be [L, 2, 1, H_kv, capacity, head_dim]");
    TORCH_CHECK(starts[s] >= 0 && lengths[s] > 0 && keeps[s] >= 0 && keeps[s] <= lengths[s],
                "q4_layers: start >= 0, length > 0, 0 <= keep <= length");
    TORCH_CHECK(starts[s] + lengths[s] <= c.size(4), "q4_layers: the cache holds ", c.size(4),
                " positions, the pass needs ", starts[s] + lengths[s]);
    TORCH_CHECK(row + lengths[s] <= T, "q4_layers: the sequences' lengths exceed x's ", T, " rows");
    for (int64_t j = 0; j < lengths[s]; ++j, ++row) {
      seq[row] = s;
      pos[row] = starts[s] + j;
    }
  }
  TORCH_CHECK(row == T, "q4_layers: the sequences' lengths sum to ", row, ", x has ", T, " rows");
  std::vector<int64_t> kept;  // the rows the last layer keeps, in order
  for (int64_t r = 0; r < T; ++r) {
    const int64_t s = seq[r];
    if (pos[r] >= starts[s] + lengths[s] - keeps[s]) kept.push_back(r);
  }
  const bool narrows = static_cast<int64_t>(kept.size()) < T;
  std::vector<int64_t> all_rows(T);  // every row, as attend_rows takes them (the last layer may keep fewer)
  for (int64_t r = 0; r < T; ++r) all_rows[r] = r;
  const at::Tensor cos = cos_in.reshape({T, hd}).contiguous(), sin = sin_in.reshape({T, hd}).contiguous();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float eps = static_cast<float>(eps_in);
  const int64_t qdim = H * hd, kdim = Hkv * hd, qkv_n = qdim + 2 * kdim;
  at::Tensor x = x_in.contiguous().clone();
#if defined(Q4_AVX512)
  const int64_t group = H / Hkv;
  int64_t longest = 0;  // the most keys a row sees
  for (int64_t s = 0; s < S; ++s) longest = std::max(longest, starts[s] + lengths[s]);
#endif
  const int64_t widest = half.empty() ? 0 : *std::max_element(half.begin(), half.end());  // MLP buffers, made once for every layer
  std::vector<float> h(T * D), qkv(T * qkv_n), att(T * qdim), y(T * D), gu(T * 2 * widest), hidden(T * widest);
  const int64_t C = static_cast<int64_t>(capture.size());
  for (int64_t j = 0; j < C; ++j)
    TORCH_CHECK(capture[j] >= 0 && capture[j] < L, "q4_layers: capture layers must lie in [0, ", L - 1, "]");
  if (states != nullptr) *states = at::empty({T, C, D}, x_in.options().dtype(at::kFloat));
  for (int64_t i = 0; i < L; ++i) {
    TORCH_CHECK(in_norm[i].numel() == D && post_norm[i].numel() == D, "q4_layers: layer ", i, "'s norms must have ", D,
                " weights");
    for (int64_t j = 0; j < C; ++j) {  // layer i's input, every row (before the last layer narrows them)
      if (capture[j] != i) continue;
      const float* xs = x.data_ptr<float>();
      float* sp_out = states->data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) std::memcpy(sp_out + (t * C + j) * D, xs + t * D, D * sizeof(float));
    }
    const at::Tensor& w_qkv = weights[4 * i];
    TORCH_CHECK(outs[4 * i] == qkv_n, "q4_layers: layer ", i, "'s q/k/v has ", outs[4 * i], " outputs, not ", qkv_n);
    check_weights(w_qkv, D, qkv_n);
    float* xp = x.data_ptr<float>();
    rms_norm(xp, in_norm[i].contiguous().data_ptr<float>(), h.data(), T, D, eps);
    matmul(w_qkv, h.data(), T, D, qkv_n, qkv.data());
    const std::optional<at::Tensor> bias = qkv_bias.get(i);
    if (bias.has_value() && bias->defined()) {
      const at::Tensor b = bias->contiguous();
      TORCH_CHECK(b.numel() == qkv_n, "q4_layers: layer ", i, "'s q/k/v bias must have ", qkv_n, " values");
      const float* bp = b.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < qkv_n; ++j) qkv[t * qkv_n + j] += bp[j];
    }
    // (Qwen3) each q and k head's RMSNorm over head_dim, before RoPE
    const float* qk_w = qk_normed ? qk_w_all.data_ptr<float>() + i * 2 * hd : nullptr;
    // RoPE on the q and k heads (not in a layer without it: SmolLM3's every fourth), then k and v into the row's cache
    const bool rotates = !rope.has_value() || (*rope)[i] != 0;
    for (int64_t t = 0; t < T; ++t) {
      float* row = qkv.data() + t * qkv_n;
      if (qk_w != nullptr) {
        for (int64_t head = 0; head < H + Hkv; ++head)
          rms_norm(row + head * hd, qk_w + (head < H ? 0 : hd), row + head * hd, 1, hd, eps);
      }
      if (rotates) rope_row(row, cp + t * hd, sp + t * hd, H + Hkv, hd);
      const at::Tensor& cache = kv[seq[t]];
      E* keys = cache_ptr<E>(cache) + i * cache.stride(0) + pos[t] * cache.stride(4);
      store_kv(row + qdim, row + qdim + kdim, keys, keys + cache.stride(1), cache.stride(3), Hkv, hd);
    }
    // the rows carried on: at the last layer only the kept ones (their keys and values are cached above)
    const bool last = i == L - 1 && narrows;
    const int64_t rows = last ? static_cast<int64_t>(kept.size()) : T;
    // causal attention: row t (position pos[t] of its sequence) sees that sequence's keys 0..pos[t];
    // each (row, head) given the same operations however the rows, heads and threads are split
    // (AVX-512's float32 caches: a (row, head) a task; elsewhere attend_rows: a kv head and its queries a task)
    const float scale = static_cast<float>(scaling[i]);
    const auto kv_head = [&](int64_t s, int64_t g) {
      const at::Tensor& cache = kv[s];
      const E* keys = cache_ptr<E>(cache) + i * cache.stride(0) + g * cache.stride(3);
      return KvHead<E>{keys, keys + cache.stride(1), cache.stride(4)};
    };
#if defined(Q4_AVX512)
    if constexpr (std::is_same<E, float>::value) {
      const int64_t tasks = rows * H;
      const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / ((longest + 1) * hd));  // >= ~32 k multiply-adds a thread
      at::parallel_for(0, tasks, grain, [&](int64_t k0, int64_t k1) {
        std::vector<float> scores(longest);
        for (int64_t k = k0; k < k1; ++k) {
          const int64_t out_row = k / H, t = last ? kept[out_row] : out_row, head = k % H;
          const KvHead<float> h = kv_head(seq[t], head / group);
          const int64_t first = first_key(pos[t], window);
          attend(qkv.data() + t * qkv_n + head * hd, h.keys + first * h.stride, h.values + first * h.stride, h.stride,
                 pos[t] + 1 - first, hd, scale, scores.data(), att.data() + out_row * qdim + head * hd);
        }
      });
    } else {
      attend_rows(qkv.data(), qkv_n, att.data(), qdim, last ? kept : all_rows, seq, pos, S, H, Hkv, hd, scale, window,
                  kv_head);
    }
#else
    attend_rows(qkv.data(), qkv_n, att.data(), qdim, last ? kept : all_rows, seq, pos, S, H, Hkv, hd, scale, window,
                kv_head);
#endif
    if (last) x = x.index_select(0, at::tensor(kept, at::kLong));
    xp = x.data_ptr<float>();
    // o, residual
    const at::Tensor& w_o = weights[4 * i + 1];
    check_weights(w_o, qdim, D);
    matmul(w_o, att.data(), rows, qdim, D, y.data());
    for (int64_t j = 0; j < rows * D; ++j) xp[j] += y[j];
    // RMSNorm, gate/up, SiLU(gate) * up, down, residual
    const int64_t hh = half[i];
    const at::Tensor& w_gu = weights[4 * i + 2];
    const at::Tensor& w_down = weights[4 * i + 3];
    check_weights(w_gu, D, 2 * hh);
    check_weights(w_down, hh, D);
    rms_norm(xp, post_norm[i].contiguous().data_ptr<float>(), h.data(), rows, D, eps);
    matmul(w_gu, h.data(), rows, D, 2 * hh, gu.data());
    for (int64_t t = 0; t < rows; ++t) silu_mul(gu.data() + t * 2 * hh, gu.data() + t * 2 * hh + hh, hidden.data() + t * hh, hh);
    matmul(w_down, hidden.data(), rows, hh, D, y.data());
    for (int64_t j = 0; j < rows * D; ++j) xp[j] += y[j];
  }
  return x;
}

// layers_loop for the caches' element type: float32, or float16 (the same for every cache of the pass)
at::Tensor layers_loop_any(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, at::TensorList kv,
                           at::IntArrayRef starts, at::IntArrayRef lengths, at::IntArrayRef keeps, int64_t H, int64_t Hkv,
                           int64_t hd, double eps, at::ArrayRef<double> scaling, at::TensorList in_norm,
                           at::TensorList post_norm, at::IntArrayRef half, const c10::List<std::optional<at::Tensor>>& qkv_bias,
                           at::TensorList weights, at::IntArrayRef outs, at::IntArrayRef capture, at::Tensor* states,
                           const std::optional<at::Tensor>& qk_norm, int64_t window, at::OptionalIntArrayRef rope) {
  const at::ScalarType kind = kv.empty() ? at::kFloat : kv[0].scalar_type();
  for (const at::Tensor& c : kv)
    TORCH_CHECK(c.scalar_type() == kind, "q4_layers: every cache of a pass must have the same dtype");
  TORCH_CHECK(kind == at::kFloat || kind == at::kHalf, "q4_layers: a cache must be float32 or float16");
  if (kind == at::kHalf)
    return layers_loop<half_bits>(x_in, cos_in, sin_in, kv, starts, lengths, keeps, H, Hkv, hd, eps, scaling, in_norm,
                                  post_norm, half, qkv_bias, weights, outs, capture, states, qk_norm, window, rope);
  return layers_loop<float>(x_in, cos_in, sin_in, kv, starts, lengths, keeps, H, Hkv, hd, eps, scaling, in_norm,
                            post_norm, half, qkv_bias, weights, outs, capture, states, qk_norm, window, rope);
}

// The output layer where the caller hands it to the loop: the kept rows x [R, D] -> RMSNorm (final_norm)
// -> head (int4 tiles or float32 panels, head_out outputs) -> logits [R, head_out]; x itself without a
// head. One call instead of the caller's two dispatched ones (a torch RMSNorm on one row cost ~0.1 ms,
// a decode step's ~3%, on a 2-core Xeon).
at::Tensor output_layer(const at::Tensor& x, const std::optional<at::Tensor>& final_norm,
                        const std::optional<at::Tensor>& head, int64_t head_out, double eps) {
  if (!head.has_value() || !head->defined()) return x;
  TORCH_CHECK(final_norm.has_value() && final_norm->defined(), "q4_layers: a head needs its final_norm");
  const int64_t R = x.size(0), D = x.size(1);
  const at::Tensor w = final_norm->to(at::kFloat).contiguous();
  TORCH_CHECK(w.numel() == D, "q4_layers: final_norm must have ", D, " weights, not ", w.numel());
  const at::Tensor tiles = head->contiguous();
  check_weights(tiles, D, head_out);
  std::vector<float> h(R * D);
  rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), h.data(), R, D, static_cast<float>(eps));
  at::Tensor logits = at::empty({R, head_out}, x.options());
  if (R > 0) matmul(tiles, h.data(), R, D, head_out, logits.data_ptr<float>());
  return logits;
}

// The loop's input rows where the caller gives token ids: x is then the embedding table [V, D] and cos
// and sin the RoPE tables [positions, head_dim], and the rows are the ids' embeddings and their
// positions' cos and sin (sequence s's at starts[s]...): the lookups the caller would otherwise
// dispatch (an embedding, a tensor of ids, positions and two indexings), each ~10-60 us on the
// pass's cold caches. -> (x [T, D], cos [T, head_dim], sin [T, head_dim]); the inputs as they are without ids.
std::tuple<at::Tensor, at::Tensor, at::Tensor> looked_up(const at::Tensor& x_in, const at::Tensor& cos_in,
                                                         const at::Tensor& sin_in, at::IntArrayRef starts,
                                                         at::IntArrayRef lengths, at::OptionalIntArrayRef ids) {
  if (!ids.has_value()) return {x_in, cos_in, sin_in};
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "q4_layers: with ids, x is the float32 embedding table [V, D]");
  TORCH_CHECK(cos_in.dim() == 2 && sin_in.sizes() == cos_in.sizes() && cos_in.scalar_type() == at::kFloat &&
              sin_in.scalar_type() == at::kFloat, "q4_layers: with ids, cos and sin are float32 tables [positions, head_dim]");
  TORCH_CHECK(starts.size() == lengths.size(), "q4_layers: one cache, start, length and keep per sequence");
  const int64_t T = static_cast<int64_t>(ids->size()), V = x_in.size(0), D = x_in.size(1), P = cos_in.size(0);
  const int64_t hd = cos_in.size(1);
  // the table as it is (a tied model's is the output layer's transposed: not contiguous), read by its strides
  const float* table = x_in.data_ptr<float>();
  const int64_t by_id = x_in.stride(0), by_dim = x_in.stride(1);
  const at::Tensor c = cos_in.contiguous(), sn = sin_in.contiguous();
  at::Tensor x = at::empty({T, D}, x_in.options()), cos = at::empty({T, hd}, c.options()), sin = at::empty({T, hd}, c.options());
  int64_t row = 0;
  for (size_t s = 0; s < starts.size(); ++s) {
    TORCH_CHECK(lengths[s] >= 0 && row + lengths[s] <= T, "q4_layers: the sequences' lengths exceed the ", T, " ids");
    for (int64_t j = 0; j < lengths[s]; ++j, ++row) {
      const int64_t id = (*ids)[row], position = starts[s] + j;
      TORCH_CHECK(id >= 0 && id < V, "q4_layers: token id ", id, " is outside the embedding table's ", V, " rows");
      TORCH_CHECK(position >= 0 && position < P, "q4_layers: position ", position, " is outside the RoPE table's ", P, " rows");
      float* out = x.data_ptr<float>() + row * D;
      const float* from = table + id * by_id;
      if (by_dim == 1) std::memcpy(out, from, D * sizeof(float));
      else for (int64_t i = 0; i < D; ++i) out[i] = from[i * by_dim];
      std::memcpy(cos.data_ptr<float>() + row * hd, c.data_ptr<float>() + position * hd, hd * sizeof(float));
      std::memcpy(sin.data_ptr<float>() + row * hd, sn.data_ptr<float>() + position * hd, hd * sizeof(float));
    }
  }
  TORCH_CHECK(row == T, "q4_layers: the sequences' lengths sum to ", row, ", not the ", T, " ids");
  return {x, cos, sin};
}

// output_layer on its own: rows x [R, D] -> their logits [R, head_out] (an EAGLE head's first draft
// from the last row it took in: one call instead of a torch RMSNorm and product)
at::Tensor q4_output(const at::Tensor& x_in, const at::Tensor& final_norm, const at::Tensor& head, int64_t head_out,
                     double eps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "q4_output: x must be float32 [rows, in] on CPU, not ", x_in.sizes());
  return output_layer(x_in.contiguous(), final_norm, head, head_out, eps);
}

at::Tensor q4_layers(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, at::TensorList kv,
                     at::IntArrayRef starts, at::IntArrayRef lengths, at::IntArrayRef keeps, int64_t H, int64_t Hkv,
                     int64_t hd, double eps, at::ArrayRef<double> scaling, at::TensorList in_norm,
                     at::TensorList post_norm, at::IntArrayRef half, const c10::List<std::optional<at::Tensor>>& qkv_bias,
                     at::TensorList weights, at::IntArrayRef outs, const std::optional<at::Tensor>& final_norm,
                     const std::optional<at::Tensor>& head, int64_t head_out, at::OptionalIntArrayRef ids,
                     const std::optional<at::Tensor>& qk_norm, int64_t window, at::OptionalIntArrayRef rope) {
  const auto [x0, cos, sin] = looked_up(x_in, cos_in, sin_in, starts, lengths, ids);
  const at::Tensor x = layers_loop_any(x0, cos, sin, kv, starts, lengths, keeps, H, Hkv, hd, eps, scaling, in_norm,
                                       post_norm, half, qkv_bias, weights, outs, {}, nullptr, qk_norm, window, rope);
  return output_layer(x, final_norm, head, head_out, eps);
}

// q4_layers, and the inputs of the `capture` layers for every row: -> (the kept rows [R, D] or their
// logits, states [T, C, D])
std::tuple<at::Tensor, at::Tensor> q4_layers_capturing(
    const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, at::TensorList kv, at::IntArrayRef starts,
    at::IntArrayRef lengths, at::IntArrayRef keeps, int64_t H, int64_t Hkv, int64_t hd, double eps,
    at::ArrayRef<double> scaling, at::TensorList in_norm, at::TensorList post_norm, at::IntArrayRef half,
    const c10::List<std::optional<at::Tensor>>& qkv_bias, at::TensorList weights, at::IntArrayRef outs,
    at::IntArrayRef capture, const std::optional<at::Tensor>& final_norm, const std::optional<at::Tensor>& head,
    int64_t head_out, at::OptionalIntArrayRef ids, const std::optional<at::Tensor>& qk_norm, int64_t window,
    at::OptionalIntArrayRef rope) {
  at::Tensor states;
  const auto [x0, cos, sin] = looked_up(x_in, cos_in, sin_in, starts, lengths, ids);
  const at::Tensor x = layers_loop_any(x0, cos, sin, kv, starts, lengths, keeps, H, Hkv, hd, eps, scaling, in_norm,
                                       post_norm, half, qkv_bias, weights, outs, capture, &states, qk_norm, window, rope);
  return {output_layer(x, final_norm, head, head_out, eps), states};
}

// ----------------------------------------------------------------------------- an EAGLE-3 head's step
// One step of an EAGLE-3 head's decoder layer (model_service/eagle_head.py: Eagle3Layer and the
// final norm and lm_head) with every linear in these tiles, for S sequences at once: x holds their
// new rows one sequence after another (lengths[s] rows each, at positions pasts[s]...), keys[s] and
// values[s] are sequence s's cache [H_kv, capacity, head_dim]; each row attends to its sequence's
// cached rows and causally to the rows given with it, whose keys and values are written at
// pasts[s]... (the caller grows the caches first and counts the rows after).
//   x = cat(rms(embeds) * w_in, rms(hidden) * w_hidden)      [T, 2D] into q/k/v (no bias)
//   h = residual + o(attention(x))    (residual = the normed hidden where norm_before_residual, else hidden)
//   out = h + down(SiLU(gate(rms(h) * w_post)) * up(...))
//   logits = lm_head(rms(out) * w_final)                    (where `logits`; else an empty tensor)
// norms: w_in, w_hidden, w_post, w_final; tiles and outs: q/k/v, o, gate/up, down, lm_head.
// -> (out [T, D], logits [T, V] or [0]); H: attention heads, Hkv: key/value heads.
std::tuple<at::Tensor, at::Tensor> q4_eagle_step(const at::Tensor& embeds_in, const at::Tensor& hidden_in,
                                                 const at::Tensor& cos_in, const at::Tensor& sin_in, at::TensorList keys,
                                                 at::TensorList values, at::IntArrayRef pasts, at::IntArrayRef lengths,
                                                 int64_t H, int64_t Hkv, int64_t hd, double eps_in, double scale_in,
                                                 bool norm_before_residual, at::TensorList norms, at::TensorList weights,
                                                 at::IntArrayRef outs, bool logits) {
  const int64_t S = static_cast<int64_t>(keys.size());
  TORCH_CHECK(embeds_in.dim() == 2 && hidden_in.dim() == 2 && embeds_in.sizes() == hidden_in.sizes() &&
              embeds_in.scalar_type() == at::kFloat && hidden_in.scalar_type() == at::kFloat,
              "q4_eagle_step: float32 embeds and hidden [T, D]");
  TORCH_CHECK(S > 0 && static_cast<int64_t>(values.size()) == S && static_cast<int64_t>(pasts.size()) == S &&
              static_cast<int64_t>(lengths.size()) == S, "q4_eagle_step: keys, values, a past and a length per sequence");
  TORCH_CHECK(norms.size() == 4 && weights.size() == 5 && outs.size() == 5,
              "q4_eagle_step: 4 norms (in, hidden, post, final), 5 tiles and outs (qkv, o, gate/up, down, lm_head)");
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && hd > 0 && hd % 2 == 0,
              "q4_eagle_step: heads a multiple of kv heads, an even head_dim");
  const int64_t T = embeds_in.size(0), D = embeds_in.size(1);
  std::vector<int64_t> seq(T), pos(T);
  int64_t row = 0, longest = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (const at::Tensor* c : {&keys[s], &values[s]})
      TORCH_CHECK(c->scalar_type() == at::kFloat && c->dim() == 3 && c->size(0) == Hkv && c->size(2) == hd &&
                  c->stride(2) == 1, "q4_eagle_step: a cache must be float32 [H_kv, capacity, head_dim]");
    TORCH_CHECK(keys[s].stride(0) == values[s].stride(0) && keys[s].stride(1) == values[s].stride(1),
                "q4_eagle_step: keys and values must share a layout");
    TORCH_CHECK(pasts[s] >= 0 && lengths[s] > 0 && pasts[s] + lengths[s] <= keys[s].size(1) &&
                pasts[s] + lengths[s] <= values[s].size(1), "q4_eagle_step: sequence ", s, "'s cache holds ",
                keys[s].size(1), " rows, the step needs ", pasts[s] + lengths[s]);
    TORCH_CHECK(row + lengths[s] <= T, "q4_eagle_step: the sequences' lengths exceed the ", T, " rows");
    for (int64_t j = 0; j < lengths[s]; ++j, ++row) {
      seq[row] = s;
      pos[row] = pasts[s] + j;
    }
    longest = std::max(longest, pasts[s] + lengths[s]);
  }
  TORCH_CHECK(row == T, "q4_eagle_step: the sequences' lengths sum to ", row, ", there are ", T, " rows");
  for (const at::Tensor& w : norms) TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == D,
                                                "q4_eagle_step: norms must be float32 [", D, "]");
  const int64_t qdim = H * hd, kdim = Hkv * hd, qkv_n = qdim + 2 * kdim, ff = outs[2] / 2, V = outs[4];
  TORCH_CHECK(outs[0] == qkv_n && outs[1] == D && outs[2] % 2 == 0 && outs[3] == D,
              "q4_eagle_step: outs must be q/k/v ", qkv_n, ", o ", D, ", gate/up 2 F, down ", D);
  check_weights(weights[0], 2 * D, qkv_n);
  check_weights(weights[1], qdim, D);
  check_weights(weights[2], D, 2 * ff);
  check_weights(weights[3], ff, D);
  if (logits) check_weights(weights[4], D, V);
  const at::Tensor cos = cos_in.to(at::kFloat).reshape({T, hd}).contiguous();
  const at::Tensor sin = sin_in.to(at::kFloat).reshape({T, hd}).contiguous();
  const at::Tensor embeds = embeds_in.contiguous(), hidden = hidden_in.contiguous();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>(), *ep = embeds.data_ptr<float>(),
              *hp = hidden.data_ptr<float>();
  std::vector<at::Tensor> w_norm;
  for (const at::Tensor& w : norms) w_norm.push_back(w.contiguous());
  const float eps = static_cast<float>(eps_in), scale = static_cast<float>(scale_in);
  std::vector<float> normed(T * D), x(T * 2 * D), qkv(T * qkv_n), att(T * qdim), y(T * D), gu(T * 2 * ff), mid(T * ff);
  rms_norm(ep, w_norm[0].data_ptr<float>(), normed.data(), T, D, eps);
  for (int64_t t = 0; t < T; ++t) std::memcpy(x.data() + t * 2 * D, normed.data() + t * D, D * sizeof(float));
  rms_norm(hp, w_norm[1].data_ptr<float>(), normed.data(), T, D, eps);
  for (int64_t t = 0; t < T; ++t) std::memcpy(x.data() + t * 2 * D + D, normed.data() + t * D, D * sizeof(float));
  at::Tensor out = norm_before_residual ? at::from_blob(normed.data(), {T, D}, at::kFloat).clone() : hidden.clone();
  float* op = out.data_ptr<float>();
  matmul(weights[0], x.data(), T, 2 * D, qkv_n, qkv.data());
  // RoPE on the q and k heads, then k and v into the row's cache (keys and values share a layout: checked above)
  for (int64_t t = 0; t < T; ++t) {
    float* row = qkv.data() + t * qkv_n;
    rope_row(row, cp + t * hd, sp + t * hd, H + Hkv, hd);
    const at::Tensor &k_cache = keys[seq[t]], &v_cache = values[seq[t]];
    store_kv(row + qdim, row + qdim + kdim, k_cache.data_ptr<float>() + pos[t] * k_cache.stride(1),
             v_cache.data_ptr<float>() + pos[t] * v_cache.stride(1), k_cache.stride(0), Hkv, hd);
  }
#if defined(Q4_AVX512)
  const int64_t group = H / Hkv;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / ((longest + 1) * hd));
  at::parallel_for(0, T * H, grain, [&](int64_t k0, int64_t k1) {
    std::vector<float> scores(longest);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t t = k / H, head = k % H;
      const at::Tensor &k_cache = keys[seq[t]], &v_cache = values[seq[t]];
      attend(qkv.data() + t * qkv_n + head * hd, k_cache.data_ptr<float>() + (head / group) * k_cache.stride(0),
             v_cache.data_ptr<float>() + (head / group) * v_cache.stride(0), k_cache.stride(1), pos[t] + 1, hd, scale,
             scores.data(), att.data() + t * qdim + head * hd);
    }
  });
#else
  std::vector<int64_t> all_rows(T);
  for (int64_t r = 0; r < T; ++r) all_rows[r] = r;
  attend_rows(qkv.data(), qkv_n, att.data(), qdim, all_rows, seq, pos, S, H, Hkv, hd, scale, 0, [&](int64_t s, int64_t g) {
    const at::Tensor &k_cache = keys[s], &v_cache = values[s];
    return KvHead<float>{k_cache.data_ptr<float>() + g * k_cache.stride(0), v_cache.data_ptr<float>() + g * v_cache.stride(0),
                         k_cache.stride(1)};
  });
#endif
  matmul(weights[1], att.data(), T, qdim, D, y.data());
  for (int64_t j = 0; j < T * D; ++j) op[j] += y[j];
  rms_norm(op, w_norm[2].data_ptr<float>(), normed.data(), T, D, eps);
  matmul(weights[2], normed.data(), T, D, 2 * ff, gu.data());
  for (int64_t t = 0; t < T; ++t) silu_mul(gu.data() + t * 2 * ff, gu.data() + t * 2 * ff + ff, mid.data() + t * ff, ff);
  matmul(weights[3], mid.data(), T, ff, D, y.data());
  for (int64_t j = 0; j < T * D; ++j) op[j] += y[j];
  if (!logits) return {out, at::empty({0}, out.options())};
  at::Tensor scores = at::empty({T, V}, out.options());
  rms_norm(op, w_norm[3].data_ptr<float>(), normed.data(), T, D, eps);
  matmul(weights[4], normed.data(), T, D, V, scores.data_ptr<float>());
  return {out, scores};
}

// min-p's least kept (x - the largest) / temperature: log(min_p) as a float (speculative.sampling.min_p_floor);
// min_p 0 (off): -inf, which every value clears
inline float min_p_floor(double min_p) {
  return min_p > 0 ? static_cast<float>(std::log(min_p)) : -INFINITY;
}

// A sampled draft token's q from one row of logits [V] (speculative.sampling.draft_token's sampled
// branch, over the ids `allowed` lets it draw, none where null): temperature, min-p, top-k (0: off) and
// top-p keep the logits' order, so q's support is the row's top min(max_support, kept) ids, p there their
// softmax over the ids top-k and min-p keep (at temperature; min-p: (x - the largest) / temperature at
// least min_p_floor(min_p), 0: off), cut where the mass before a token reaches top_p; q
// is p renormalised over what is left. Ties between logits go to the lower id. -> whether the draft draws
// (false: p's top under p_min, or no id with probability); ids and q get the support (q > 0, descending).
bool sampled_support(const float* row, int64_t V, const bool* allowed, double temperature, int64_t top_k,
                     double top_p, double min_p, int64_t max_support, double p_min, std::vector<int64_t>& ids,
                     std::vector<float>& q) {
  ids.clear();
  q.clear();
  std::vector<float> x(V);  // the logits, -inf where it may not draw
  int64_t n_ok = 0;
  for (int64_t v = 0; v < V; ++v) {
    const bool ok = (allowed == nullptr || allowed[v]) && !std::isnan(row[v]) && row[v] > -INFINITY;
    x[v] = ok ? row[v] : -INFINITY;
    n_ok += ok;
  }
  if (n_ok == 0) return false;
  const int64_t kept = std::min<int64_t>(top_k > 0 && top_k < V ? top_k : V, n_ok);
  const int64_t m = std::min<int64_t>(std::max<int64_t>(max_support, 1), kept);
  // the top m (value, id), best first: one pass keeping a heap of them whose front is the worst (an id
  // later than an equal value's is not taken: ties go to the lower id)
  using Entry = std::pair<float, int64_t>;
  const auto better = [](const Entry& a, const Entry& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<Entry> top;
  top.reserve(m);
  for (int64_t v = 0; v < V; ++v) {
    if (!(x[v] > -INFINITY)) continue;
    if (static_cast<int64_t>(top.size()) < m) {
      top.emplace_back(x[v], v);
      std::push_heap(top.begin(), top.end(), better);
    } else if (x[v] > top.front().first) {
      std::pop_heap(top.begin(), top.end(), better);
      top.back() = {x[v], v};
      std::push_heap(top.begin(), top.end(), better);
    }
  }
  std::sort(top.begin(), top.end(), better);
  // p = exp((x - the largest) / temperature), over its sum for the ids top-k keeps (as draft_token
  // computes it: a tiny temperature tends to the argmax)
  const float shift = top[0].first, t = static_cast<float>(temperature), floor = min_p_floor(min_p);
  double mass = 0;
  if (kept == m) {
    for (const Entry& entry : top)
      if ((entry.first - shift) / t >= floor) mass += std::exp((entry.first - shift) / t);
  } else {
    std::vector<float> e;
    if (kept == n_ok) {
      e = x;  // (an id it may not draw adds exp(-inf) = 0, or under 1e-44 where exp is vectorised)
    } else {
      e.reserve(n_ok);
      for (const float value : x)
        if (value > -INFINITY) e.push_back(value);
      std::nth_element(e.begin(), e.begin() + (kept - 1), e.end(), std::greater<float>());
      e.resize(kept);
    }
    for (float& value : e) {
      value = (value - shift) / t;
      if (value < floor) value = -INFINITY;
    }
    mass = exp_sum(e.data(), static_cast<int64_t>(e.size()), 0.f);
  }
  std::vector<float> p(m);
  for (int64_t i = 0; i < m; ++i) {
    const float z = (top[i].first - shift) / t;
    p[i] = z >= floor ? static_cast<float>(std::exp(z) / mass) : 0.f;
  }
  if (p_min > 0 && !(p[0] >= p_min)) return false;
  double before_mass = 0, total = 0;
  for (int64_t i = 0; i < m; ++i) {
    const float pi = p[i];
    if (top_p < 1.0 && before_mass >= top_p) break;  // the cut: everything from here on is past it
    before_mass += pi;
    if (pi > 0) {
      ids.push_back(top[i].second);
      q.push_back(pi);
      total += pi;
    }
  }
  if (ids.empty() || !(total > 0)) return false;
  for (float& qi : q) qi = static_cast<float>(qi / total);
  return true;
}

// A draw from q (sampled_support's) with the uniform u in [0, 1): the first id whose cumulative q
// (double) exceeds u times q's total, as speculative.sampling.sample draws.
int64_t draw_from(const std::vector<int64_t>& ids, const std::vector<float>& q, double u) {
  double total = 0;
  for (const float qi : q) total += qi;
  const double target = u * total;
  double cdf = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    cdf += q[i];
    if (cdf > target) return ids[i];
  }
  for (size_t i = q.size(); i-- > 0;)  // u * total rounded up to the total: the last id with mass
    if (q[i] > 0) return ids[i];
  return -1;
}

// sampled_support for one row [V] of float32 logits as tensors: (ids int64, q float32), both empty
// where the draft stops; `allowed` (bool [V]) the ids it may draw, all where none
std::tuple<at::Tensor, at::Tensor> q4_draft_support(const at::Tensor& row_in, double temperature, int64_t top_k,
                                                    double top_p, double min_p, int64_t max_support, double p_min,
                                                    const std::optional<at::Tensor>& allowed_in) {
  TORCH_CHECK(row_in.dim() == 1 && row_in.scalar_type() == at::kFloat, "q4_draft_support: a float32 row [V]");
  TORCH_CHECK(temperature > 0 && top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1 && max_support >= 1,
              "q4_draft_support: temperature > 0, top_p in (0, 1], min_p in [0, 1], max_support >= 1");
  const at::Tensor row = row_in.contiguous();
  const int64_t V = row.size(0);
  at::Tensor allowed;
  if (allowed_in.has_value() && allowed_in->defined()) {
    allowed = allowed_in->to(at::kBool).contiguous();
    TORCH_CHECK(allowed.dim() == 1 && allowed.size(0) == V, "q4_draft_support: allowed must have ", V, " entries");
  }
  std::vector<int64_t> ids;
  std::vector<float> q;
  if (!sampled_support(row.data_ptr<float>(), V, allowed.defined() ? allowed.data_ptr<bool>() : nullptr, temperature,
                       top_k, top_p, min_p, max_support, p_min, ids, q)) {
    ids.clear();
    q.clear();
  }
  at::Tensor ids_out = at::empty({static_cast<int64_t>(ids.size())}, row.options().dtype(at::kLong));
  at::Tensor q_out = at::empty({static_cast<int64_t>(q.size())}, row.options());
  std::copy(ids.begin(), ids.end(), ids_out.data_ptr<int64_t>());
  std::copy(q.begin(), q.end(), q_out.data_ptr<float>());
  return {ids_out, q_out};
}

// (value, id) of each value of p [V] at or above `at`, in id order: 16 compared at a time where AVX-512 is
// (most blocks hold none)
inline void at_least(const float* p, int64_t V, float at, std::vector<std::pair<float, int64_t>>& out) {
  int64_t v = 0;
#if defined(Q4_AVX512)
  const __m512 bound = _mm512_set1_ps(at);
  for (; v + 16 <= V; v += 16) {
    __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + v), bound, _CMP_GE_OQ);
    while (hit) {
      const int i = __builtin_ctz(hit);
      out.emplace_back(p[v + i], v + i);
      hit &= hit - 1;
    }
  }
#endif
  for (; v < V; ++v)
    if (p[v] >= at) out.emplace_back(p[v], v);
}

// The target's p for one row of float32 logits x [V] into p [V] (speculative.sampling.logits_to_probs, not
// greedy): (x - the largest) / temperature; min-p (0: off) keeps the values at or above min_p_floor(min_p)
// (a probability at least min_p times the largest's); top-k (0 < top_k < V) keeps the values at or above the k-th
// largest; the softmax; top-p (< 1) keeps, in descending order, each token whose mass before it is under
// top_p, renormalised. The cut's tokens are sought among those of probability >= 1e-3 first (at most a
// thousand), lower while their mass falls short of top_p or the cut lies past them; at (1 - top_p) / V,
// where the rest's mass cannot reach 1 - top_p, they hold it; past that (rounding), every token of nonzero
// probability. Ties in the cut go to the lower id; a probability under ~1e-30 is 0 (LOW below). A row with
// a NaN or no finite largest value comes out NaN, as torch's arithmetic gives; a temperature under float's
// least is its limit, one-hot at the first largest (where torch's division gives NaN).
void target_probs_row(const float* x, int64_t V, double temperature, int64_t top_k, double top_p, double min_p,
                      float* p) {
  const float largest = max_of(x, V);
  if (!std::isfinite(largest)) {  // no finite value: NaN, as torch's arithmetic gives
    std::fill(p, p + V, NAN);
    return;
  }
  const float t = static_cast<float>(temperature), scale = 1.f / t;
  if (t == 0.f) {  // a temperature under float's least (~1.4e-45): its limit, all mass on the first largest
    std::fill(p, p + V, 0.f);
    p[std::find(x, x + V, largest) - x] = 1.f;
    return;
  }
  // (x - the largest) / temperature, at least LOW: exp(LOW) ~ 1e-30 is a normal float, and a token whose
  // exponential falls under it gets probability 0 (torch's softmax gives it a subnormal or 0: a total under
  // V * 1e-30). No subnormal is then made: each would cost a microcode assist (~100 cycles here).
  constexpr float LOW = -69.f, ZERO_UNDER = 1.1e-30f;
  if (std::isfinite(scale)) {
    for (int64_t v = 0; v < V; ++v) p[v] = std::max((x[v] - largest) * scale, LOW);
  } else {  // a temperature under ~3e-39: 0 / t stays 0 for the largest, as torch divides
    for (int64_t v = 0; v < V; ++v) p[v] = std::max((x[v] - largest) / t, LOW);
  }
  // a NaN logit: a NaN row, as torch's arithmetic gives (looked for here, in a sum of the values, finite
  // but for a NaN: the vectorised max above and exp below pass a NaN over, their min / max taking the other
  // operand; sixteen chains, so that the sum is vectorised)
  float lanes[16] = {};
  int64_t v16 = 0;
  for (; v16 + 16 <= V; v16 += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += p[v16 + j];
  float probe = 0.f;
  for (; v16 < V; ++v16) probe += p[v16];
  for (const float lane : lanes) probe += lane;
  if (std::isnan(probe)) {
    std::fill(p, p + V, NAN);
    return;
  }
  if (min_p > 0) {  // (x - the largest) / t divided, as torch's div_ makes it: p's * (1 / t) may round to the
    // other side of the floor
    const float floor = min_p_floor(min_p);
    for (int64_t v = 0; v < V; ++v) p[v] = (x[v] - largest) / t < floor ? LOW : p[v];
  }
  if (top_k > 0 && top_k < V) {  // the k-th largest: one pass keeping a heap of the top k, the least in front
    std::vector<float> top(p, p + top_k);
    std::make_heap(top.begin(), top.end(), std::greater<float>());
    for (int64_t v = top_k; v < V; ++v)
      if (p[v] > top.front()) {
        std::pop_heap(top.begin(), top.end(), std::greater<float>());
        top.back() = p[v];
        std::push_heap(top.begin(), top.end(), std::greater<float>());
      }
    const float kth = top.front();
    for (int64_t v = 0; v < V; ++v) p[v] = p[v] < kth ? LOW : p[v];
  }
  exp_sum(p, V, 0.f);
  // their sum in double, in eight chains (the largest is 0: its exp is 1, the sum >= 1): exp_sum's float
  // total, one chain without AVX-512, drifts ~1e-4 over 49,152 ids
  double chains[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t v8 = 0;
  for (; v8 + 8 <= V; v8 += 8)
    for (int j = 0; j < 8; ++j) chains[j] += p[v8 + j];
  for (; v8 < V; ++v8) chains[0] += p[v8];
  const double sum =
      ((chains[0] + chains[4]) + (chains[2] + chains[6])) + ((chains[1] + chains[5]) + (chains[3] + chains[7]));
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t v = 0; v < V; ++v) p[v] = p[v] < ZERO_UNDER ? 0.f : p[v] * inv;
  if (!(top_p < 1.0)) return;
  // the cut: sorted by probability (ties to the lower id), a token stays while the mass before it, as
  // nucleus() computes it (torch's cumsum: double sums, as floats, less the token), is under top_p as a
  // float. Sought among the candidates at or above a threshold; where their mass falls short of top_p, or
  // every one of them stays and their mass is within the threshold of it (the cut may lie past them), among
  // those at a lower one, down to every token of nonzero probability.
  using Entry = std::pair<float, int64_t>;
  std::vector<Entry> kept;
  const double floor = (1.0 - top_p) / static_cast<double>(V);
  const float cut = static_cast<float>(top_p);
  double total = 0;
  size_t n = 0;
  for (double threshold = std::max(1e-3, floor);;
       threshold = threshold > floor ? std::max(threshold / 64, floor) : 0) {
    kept.clear();
    if (threshold > 0) {
      at_least(p, V, static_cast<float>(threshold), kept);
    } else {
      for (int64_t v = 0; v < V; ++v)
        if (p[v] > 0) kept.emplace_back(p[v], v);
    }
    double mass = 0;
    for (const Entry& entry : kept) mass += entry.first;
    if (mass < top_p && threshold > 0) continue;
    std::sort(kept.begin(), kept.end(), [](const Entry& a, const Entry& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    double before = 0;
    for (total = 0, n = 0; n < kept.size(); ++n) {
      const float cum = static_cast<float>(before + kept[n].first);
      if (cum - kept[n].first >= cut) break;
      before += kept[n].first;
      total += kept[n].first;
    }
    // every candidate stays: the cut lies right after them where their mass clears top_p by more than any
    // other token's probability (each under the threshold), else perhaps past them
    if (n < kept.size() || threshold == 0 || total - threshold >= cut) break;
  }
  std::fill(p, p + V, 0.f);
  const float kept_mass = static_cast<float>(total);
  for (size_t i = 0; i < n; ++i) p[kept[i].second] = kept[i].first / kept_mass;
}

// p (target_probs_row) for each row of float32 logits [R, V] or [V]
at::Tensor q4_target_probs(const at::Tensor& logits_in, double temperature, int64_t top_k, double top_p,
                           double min_p) {
  TORCH_CHECK(logits_in.dim() >= 1 && logits_in.scalar_type() == at::kFloat,
              "q4_target_probs: float32 logits [..., V]");
  TORCH_CHECK(temperature > 0 && top_p > 0 && top_p <= 1 && top_k >= 0 && min_p >= 0 && min_p <= 1,
              "q4_target_probs: temperature > 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1]");
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor probs = at::empty_like(logits);
  const int64_t V = logits.size(-1), R = V ? logits.numel() / V : 0;
  for (int64_t r = 0; r < R; ++r)
    target_probs_row(logits.data_ptr<float>() + r * V, V, temperature, top_k, top_p, min_p,
                     probs.data_ptr<float>() + r * V);
  return probs;
}

// A draw from p [V] (float32, non-negative) with the uniform u in [0, 1) (speculative.sampling.sample): the
// first id whose cumulative mass (double) exceeds u times the total, the sums taken 16 ids at a time to
// find the block it lies in, then id by id; the last id of nonzero mass where u times the total rounds up
// to it. -> the id, or -1 where the total is not a positive finite number.
int64_t q4_sample(const at::Tensor& probs_in, double u) {
  TORCH_CHECK(probs_in.dim() == 1 && probs_in.scalar_type() == at::kFloat, "q4_sample: a float32 row [V]");
  const at::Tensor probs = probs_in.contiguous();
  const float* p = probs.data_ptr<float>();
  const int64_t V = probs.size(0), blocks = V / 16;
  std::vector<double> sums(blocks);
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) {  // (eight independent pairs, then a tree: no chain of 16 adds)
    const float* x = p + 16 * b;
    double pair[8];
    for (int i = 0; i < 8; ++i) pair[i] = static_cast<double>(x[i]) + static_cast<double>(x[i + 8]);
    sums[b] = ((pair[0] + pair[4]) + (pair[2] + pair[6])) + ((pair[1] + pair[5]) + (pair[3] + pair[7]));
    total += sums[b];
  }
  for (int64_t v = 16 * blocks; v < V; ++v) total += p[v];
  if (!(total > 0 && total < INFINITY)) return -1;
  const double target = u * total;
  double cdf = 0;
  int64_t v = 0;
  for (int64_t b = 0; b < blocks && cdf + sums[b] <= target; ++b, v += 16) cdf += sums[b];
  for (; v < V; ++v) {  // (past the block where rounding puts the crossing a block on, into the next)
    cdf += p[v];
    if (cdf > target) return v;
  }
  for (v = V; v-- > 0;)
    if (p[v] > 0) return v;
  return -1;
}

// A draft of up to ks[s] tokens for each of S sequences, each token a q4_eagle_step: from the last
// row's out_hidden (hidden [S, D]) its logits (output_layer); where temperatures[s] is 0 the argmax over
// the draft ids `known` allows (all where none; the first maximum on ties), stopping where its
// probability is under p_mins[s] (the softmax over those ids), else a draw (sampled_support and draw_from:
// at that temperature, top_ks[s], top_ps[s], min_ps[s], q over at most max_support ids, the uniform uniforms[s, t],
// float64
// [S, max k]); mapped to the target's vocabulary by target_ids; then, while
// a sequence wants more, one step of all of them (token's embedding from `table` [V, D], the row's
// position's cos and sin from the RoPE tables, the caches' next row at pasts[s] + t, position
// positions[s] + t) gives the next row and logits. EagleDraft's draft loop (model_service/eagle.py) in
// one call, without its Python between the steps (SmolLM2's int4 head at K = 4 on 2 Xeon cores: a draft
// call 1.70 -> 1.49 ms). The caller reserves ks[s] - 1 rows in each cache and counts those steps[s] made after.
// -> (tokens [S, max k] (target ids, -1 past a sequence's last), rows [S, max(1, max k - 1), D] (the
// out_hidden of the rows the steps appended), steps [S], and each sampled token's q: its support's target
// ids [S, max k, M] (-1 past its last; M max_support where a sequence samples, else 0) and q there).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> q4_eagle_draft(
    const at::Tensor& hidden_in, const at::Tensor& table, const at::Tensor& cos_table, const at::Tensor& sin_table,
    at::TensorList keys, at::TensorList values, at::IntArrayRef pasts, at::IntArrayRef positions, at::IntArrayRef ks,
    at::ArrayRef<double> p_mins, const std::optional<at::Tensor>& known_in, const at::Tensor& target_ids_in, int64_t H,
    int64_t Hkv, int64_t hd, double eps, double scale, bool norm_before_residual, at::TensorList norms,
    at::TensorList weights, at::IntArrayRef outs, at::ArrayRef<double> temperatures, at::IntArrayRef top_ks,
    at::ArrayRef<double> top_ps, at::ArrayRef<double> min_ps, int64_t max_support,
    const std::optional<at::Tensor>& uniforms_in) {
  const int64_t S = static_cast<int64_t>(keys.size());
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.size(0) == S && hidden_in.scalar_type() == at::kFloat,
              "q4_eagle_draft: float32 hidden [S, D], a row per cache");
  TORCH_CHECK(static_cast<int64_t>(values.size()) == S && static_cast<int64_t>(pasts.size()) == S &&
              static_cast<int64_t>(positions.size()) == S && static_cast<int64_t>(ks.size()) == S &&
              static_cast<int64_t>(p_mins.size()) == S, "q4_eagle_draft: a cache, past, position, k and p_min per row");
  TORCH_CHECK(norms.size() == 4 && weights.size() == 5 && outs.size() == 5,
              "q4_eagle_draft: q4_eagle_step's norms and tiles");
  TORCH_CHECK(static_cast<int64_t>(temperatures.size()) == S && static_cast<int64_t>(top_ks.size()) == S &&
              static_cast<int64_t>(top_ps.size()) == S && static_cast<int64_t>(min_ps.size()) == S,
              "q4_eagle_draft: a temperature, top_k, top_p and min_p per row");
  bool sampled = false;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(temperatures[s] >= 0 && top_ps[s] > 0 && top_ps[s] <= 1 && min_ps[s] >= 0 && min_ps[s] <= 1,
                "q4_eagle_draft: temperatures must be >= 0, top_ps in (0, 1] and min_ps in [0, 1]");
    sampled = sampled || temperatures[s] > 0;
  }
  const int64_t D = hidden_in.size(1), V = outs[4], P = cos_table.size(0);
  TORCH_CHECK(table.dim() == 2 && table.size(1) == D && table.scalar_type() == at::kFloat,
              "q4_eagle_draft: a float32 embedding table [V, ", D, "]");
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == hd && sin_table.sizes() == cos_table.sizes() &&
              cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat,
              "q4_eagle_draft: float32 RoPE tables [positions, head_dim]");
  const at::Tensor target_ids = target_ids_in.to(at::kLong).contiguous();
  TORCH_CHECK(target_ids.dim() == 1 && target_ids.size(0) == V, "q4_eagle_draft: target_ids must map the ", V,
              " draft ids");
  const int64_t* to_target = target_ids.data_ptr<int64_t>();
  at::Tensor known;
  if (known_in.has_value() && known_in->defined()) {
    known = known_in->to(at::kBool).contiguous();
    TORCH_CHECK(known.dim() == 1 && known.size(0) == V, "q4_eagle_draft: known must have ", V, " entries");
  }
  const bool* allowed = known.defined() ? known.data_ptr<bool>() : nullptr;
  int64_t kmax = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ks[s] >= 0 && pasts[s] >= 0 && positions[s] >= 0,
                "q4_eagle_draft: ks, pasts and positions must be >= 0");
    TORCH_CHECK(positions[s] + std::max<int64_t>(ks[s] - 1, 0) <= P, "q4_eagle_draft: the RoPE tables hold ", P,
                " positions, the draft needs ", positions[s] + ks[s] - 1);
    kmax = std::max(kmax, ks[s]);
  }
  at::Tensor uniforms;
  if (sampled) {
    TORCH_CHECK(max_support >= 1, "q4_eagle_draft: max_support must be >= 1");
    TORCH_CHECK(uniforms_in.has_value() && uniforms_in->defined(), "q4_eagle_draft: sampled rows need uniforms");
    uniforms = uniforms_in->to(at::kDouble).contiguous();
    TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == S && uniforms.size(1) >= kmax,
                "q4_eagle_draft: uniforms must be [S, max k]");
  }
  const int64_t M = sampled ? std::min(max_support, V) : 0;
  at::Tensor support = at::full({S, kmax, M}, -1, target_ids.options());
  at::Tensor q_out = at::zeros({S, kmax, M}, hidden_in.options());
  std::vector<int64_t> drawn_ids;
  std::vector<float> drawn_q;
  at::Tensor tokens = at::full({S, kmax}, -1, target_ids.options());
  at::Tensor rows = at::zeros({S, std::max<int64_t>(1, kmax - 1), D}, hidden_in.options());
  at::Tensor steps = at::zeros({S}, target_ids.options());
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* st = steps.data_ptr<int64_t>();
  std::vector<int64_t> active;  // the sequences drafting, in order; logits row i is active[i]'s
  for (int64_t s = 0; s < S; ++s)
    if (ks[s] > 0) active.push_back(s);
  if (active.empty()) return {tokens, rows, steps, support, q_out};
  const at::Tensor hidden = hidden_in.contiguous();
  at::Tensor logits = output_layer(hidden.index_select(0, at::tensor(active, at::kLong)), norms[3], weights[4], V, eps);
  for (int64_t t = 0; !active.empty(); ++t) {
    std::vector<int64_t> next;
    const float* lp = logits.data_ptr<float>();
    for (size_t i = 0; i < active.size(); ++i) {
      const int64_t s = active[i];
      const float* row = lp + static_cast<int64_t>(i) * V;
      if (temperatures[s] > 0) {
        if (!sampled_support(row, V, allowed, temperatures[s], top_ks[s], top_ps[s], min_ps[s], M, p_mins[s],
                             drawn_ids, drawn_q))
          continue;
        const int64_t drawn = draw_from(drawn_ids, drawn_q, uniforms.data_ptr<double>()[s * uniforms.size(1) + t]);
        if (drawn < 0) continue;
        int64_t* sp = support.data_ptr<int64_t>() + (s * kmax + t) * M;
        float* qp = q_out.data_ptr<float>() + (s * kmax + t) * M;
        for (size_t j = 0; j < drawn_ids.size(); ++j) {
          sp[j] = to_target[drawn_ids[j]];
          qp[j] = drawn_q[j];
        }
        tp[s * kmax + t] = to_target[drawn];
        if (t + 1 < ks[s]) next.push_back(s);
        continue;
      }
      int64_t pick = -1;
      float top = -INFINITY;
      for (int64_t v = 0; v < V; ++v)
        if ((allowed == nullptr || allowed[v]) && (pick < 0 || row[v] > top)) {
          pick = v;
          top = row[v];
        }
      if (pick < 0 || std::isnan(top)) continue;  // nothing it may draw
      if (p_mins[s] > 0) {  // the pick's probability: 1 / the sum of exp(l - top) over the ids it may draw
        double total = 0;
        for (int64_t v = 0; v < V; ++v)
          if (allowed == nullptr || allowed[v]) total += std::exp(static_cast<double>(row[v]) - top);
        if (1.0 / total < p_mins[s]) continue;
      }
      tp[s * kmax + t] = to_target[pick];
      if (t + 1 < ks[s]) next.push_back(s);
    }
    if (next.empty()) break;
    const int64_t n = static_cast<int64_t>(next.size());
    at::Tensor hid = at::empty({n, D}, hidden.options());
    std::vector<at::Tensor> k_sub, v_sub;
    std::vector<int64_t> past_sub, position_sub, id_sub, ones(n, 1);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = next[i];
      std::memcpy(hid.data_ptr<float>() + i * D,
                  t == 0 ? hidden.data_ptr<float>() + s * D : rows.data_ptr<float>() + (s * rows.size(1) + t - 1) * D,
                  D * sizeof(float));
      k_sub.push_back(keys[s]);
      v_sub.push_back(values[s]);
      past_sub.push_back(pasts[s] + t);
      position_sub.push_back(positions[s] + t);
      id_sub.push_back(tp[s * kmax + t]);
    }
    // the tokens' embeddings and their positions' cos and sin, as the layer loop looks them up
    const auto [embeds, cos, sin] = looked_up(table, cos_table, sin_table, position_sub, ones, id_sub);
    auto [out, next_logits] = q4_eagle_step(embeds, hid, cos, sin, k_sub, v_sub, past_sub, ones, H, Hkv, hd, eps, scale,
                                            norm_before_residual, norms, weights, outs, true);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = next[i];
      std::memcpy(rows.data_ptr<float>() + (s * rows.size(1) + t) * D, out.data_ptr<float>() + i * D,
                  D * sizeof(float));
      st[s] = t + 1;
    }
    logits = next_logits;
    active = next;
  }
  return {tokens, rows, steps, support, q_out};
}

std::string q4_path() { return kPath; }

// float32 calls of a few rows: panels in pairs (1), one at a time (0), or as they are (-1) -> the
// setting now; the same numbers either way (tests run both). Only AVX-512 builds have pairs.
bool f32_pairs(int64_t mode) {
#if defined(Q4_AVX512)
  if (mode >= 0) pairs.store(mode > 0);
  return pairs.load();
#else
  (void)mode;
  return false;
#endif
}

// whether at::parallel_for splits work across torch's threads here: it is a header template that
// runs the whole range on the calling thread unless this file is compiled with OpenMP
bool q4_threaded() {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

}  // namespace

// q4_mm's schema is defined by model_service/q4_kernel.py (so TorchScript code naming it compiles
// before this library is loaded, or where it cannot be built); this adds its CPU kernel
TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("q4_path() -> str", &q4_path);
  m.def("q4_threaded() -> bool", &q4_threaded);
  m.def("f32_pairs(int mode) -> bool", &f32_pairs);
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("q4_mm", &q4_mm);
  m.impl("f32_mm", &f32_mm);
  m.impl("q4_layers", &q4_layers);
  m.impl("q4_output", &q4_output);
  m.impl("q4_layers_capturing", &q4_layers_capturing);
  m.impl("q4_eagle_step", &q4_eagle_step);
  m.impl("q4_eagle_draft", &q4_eagle_draft);
  m.impl("q4_draft_support", &q4_draft_support);
  m.impl("q4_target_probs", &q4_target_probs);
  m.impl("q4_sample", &q4_sample);
}
