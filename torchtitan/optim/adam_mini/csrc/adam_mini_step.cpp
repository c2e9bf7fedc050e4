// Adam-mini's whole local step for every tensor of one dtype in one OpenMP parallel region (CPU).
//
// Each parameter p (gradient g, momentum m, all contiguous, numel N) has a second moment v of K entries. Without
// given block means, v's K entries are K runs of W = N / K consecutive entries of p (a row, a head's rows, the whole
// tensor, or one entry for per-element blocks): the kernel takes mean(g^2) of each run itself. With given means
// (blocks partial on this rank, completed over the mesh beforehand) v is updated from them and each row of p reads
// its block's scale: row r of width N / R takes block row_blocks[r] when given, else block r (R = K).
//
// Work is cut into segments of whole blocks (about kChunk entries) handed out to the threads of one parallel
// region. Within a segment, the loop that updates block k also sums the squares of block k + 1's gradient, so the
// gradient is read from memory once: p and m read and written, g read (20 bytes an entry in float32).
// Blocks too long for one segment, and blocks with given means, have their scale computed first (partial sums in
// chunks, then one value per block), after which their entries are updated in chunks like any other.
//
// The arithmetic follows the foreach back end's order of operations, so that the two agree to a few ulp:
//   v = v * beta2 + (1 - beta2) * mean      scale = lr * (1 / ((sqrt(v / bc2) + eps) * bc1))
//   m = lerp(m, g, 1 - beta1)               p = p * decay - m * scale   (decay only where the weight decays)

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kChunk = 1 << 16;      // entries per segment of work (256 KiB of float32)
constexpr int64_t kLongBlock = 1 << 18;  // a block longer than this is summed by several threads

template <typename T>
struct Coefficients {
  T beta2, one_minus_beta2, weight, lr, bc1, bc2, eps, decay;
  bool small_weight;  // lerp's two forms, as torch picks them
};

template <typename T>
inline T scale_of(T v, const Coefficients<T>& c) {
  T s = v / c.bc2;
  s = std::sqrt(s);
  s = s + c.eps;
  s = s * c.bc1;
  s = T(1) / s;
  return s * c.lr;
}

template <typename T>
inline T sum_of_squares(const T* g, int64_t n) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += g[j] * g[j];
  return acc;
}

// The update of n entries of p and m sharing one scale, summing the squares of ``next`` (the next block's
// gradient) on the way when Sum. The coefficients are copied to locals first: the loop's stores could otherwise
// alias them and make the compiler reload them at every entry. lerp takes torch's form for the weight's size.
template <typename T, bool Decays, bool Sum>
inline T update_run(T* p, const T* g, T* m, const T* next, int64_t n, T scale, const Coefficients<T>& c) {
  const T weight = c.weight, complement = T(1) - c.weight, decay = c.decay;
  T acc = 0;
  if (c.small_weight) {
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < n; ++j) {
      if (Sum) acc += next[j] * next[j];
      const T momentum = m[j] + weight * (g[j] - m[j]);
      m[j] = momentum;
      p[j] = (Decays ? p[j] * decay : p[j]) - momentum * scale;
    }
  } else {
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < n; ++j) {
      if (Sum) acc += next[j] * next[j];
      const T momentum = g[j] - (g[j] - m[j]) * complement;
      m[j] = momentum;
      p[j] = (Decays ? p[j] * decay : p[j]) - momentum * scale;
    }
  }
  return acc;
}

template <typename T>
struct Param {
  T* p;
  const T* g;
  T* m;
  T* v;
  const T* mean;             // given block means (K), or null
  const int64_t* row_blocks;  // given block of each row (R), or null
  int64_t numel, blocks, rows, width;  // N, K, R and a row's (or block's) entries
  bool decays;
  bool scaled;          // scale per block computed before the updates (given means, or long blocks)
  int64_t scale_offset;  // where its K scales sit in the scale buffer
  int64_t partial_offset, partial_count;  // long blocks: partial sums, partial_count per block
};

enum Kind : int { kBlocks, kElements, kScaledRun, kPartialSum };

struct Segment {
  int kind;
  int64_t param, begin, end;  // blocks (kBlocks), entries (kElements, kScaledRun) or a chunk of one long block
};

template <typename T, bool Decays>
void run_blocks(const Param<T>& t, int64_t k0, int64_t k1, const Coefficients<T>& c) {
  const int64_t w = t.width;
  T next = sum_of_squares(t.g + k0 * w, w);
  for (int64_t k = k0; k < k1; ++k) {
    T v = t.v[k] * c.beta2 + c.one_minus_beta2 * (next / T(w));
    t.v[k] = v;
    const T scale = scale_of(v, c);
    const int64_t at = k * w;
    if (k + 1 < k1) {
      next = update_run<T, Decays, true>(t.p + at, t.g + at, t.m + at, t.g + at + w, w, scale, c);
    } else {
      update_run<T, Decays, false>(t.p + at, t.g + at, t.m + at, nullptr, w, scale, c);
    }
  }
}

template <typename T, bool Decays>
void run_elements(const Param<T>& t, int64_t e0, int64_t e1, const Coefficients<T>& c) {
  T* p = t.p;
  T* m = t.m;
  T* v = t.v;
  const T* g = t.g;
  const T beta2 = c.beta2, one_minus_beta2 = c.one_minus_beta2, bc1 = c.bc1, bc2 = c.bc2, eps = c.eps, lr = c.lr;
  const T weight = c.weight, complement = T(1) - c.weight, decay = c.decay;
  const bool small_weight = c.small_weight;
#pragma omp simd
  for (int64_t j = e0; j < e1; ++j) {
    T second = v[j] * beta2;
    second = second + one_minus_beta2 * (g[j] * g[j]);
    v[j] = second;
    T scale = second / bc2;
    scale = std::sqrt(scale);
    scale = scale + eps;
    scale = scale * bc1;
    scale = T(1) / scale;
    scale = scale * lr;
    const T momentum = small_weight ? m[j] + weight * (g[j] - m[j]) : g[j] - (g[j] - m[j]) * complement;
    m[j] = momentum;
    p[j] = (Decays ? p[j] * decay : p[j]) - momentum * scale;
  }
}

template <typename T, bool Decays>
void run_scaled(const Param<T>& t, const T* scales, int64_t e0, int64_t e1, const Coefficients<T>& c) {
  int64_t at = e0;
  while (at < e1) {
    const int64_t row = at / t.width;
    const int64_t end = std::min(e1, (row + 1) * t.width);
    const int64_t block = t.row_blocks ? t.row_blocks[row] : row;
    update_run<T, Decays, false>(t.p + at, t.g + at, t.m + at, nullptr, end - at, scales[block], c);
    at = end;
  }
}

template <typename T>
void step(std::vector<Param<T>>& params, const Coefficients<T>& c) {
  // Plan the work: segments of whole blocks, and what must be known before them.
  std::vector<Segment> partial_sums, updates;
  std::vector<int64_t> scaled;  // params whose scales are computed first
  int64_t n_scales = 0, n_partials = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(params.size()); ++i) {
    Param<T>& t = params[i];
    if (t.mean == nullptr && t.numel == 0) continue;
    if (t.mean == nullptr && t.width == 1) {
      for (int64_t e = 0; e < t.numel; e += kChunk) updates.push_back({kElements, i, e, std::min(t.numel, e + kChunk)});
      continue;
    }
    if (t.mean == nullptr && t.width <= kLongBlock) {
      const int64_t per = std::max<int64_t>(1, kChunk / t.width);
      for (int64_t k = 0; k < t.blocks; k += per) updates.push_back({kBlocks, i, k, std::min(t.blocks, k + per)});
      continue;
    }
    t.scaled = true;
    t.scale_offset = n_scales;
    n_scales += t.blocks;
    scaled.push_back(i);
    if (t.mean == nullptr) {
      t.partial_count = (t.width + kChunk - 1) / kChunk;
      t.partial_offset = n_partials;
      n_partials += t.blocks * t.partial_count;
      for (int64_t k = 0; k < t.blocks; ++k)
        for (int64_t part = 0; part < t.partial_count; ++part)
          partial_sums.push_back({kPartialSum, i, k, part});
    }
    for (int64_t e = 0; e < t.numel; e += kChunk) updates.push_back({kScaledRun, i, e, std::min(t.numel, e + kChunk)});
  }
  std::vector<T> scales(n_scales), partials(n_partials);
  const int64_t n_partial_sums = partial_sums.size(), n_scaled = scaled.size(), n_updates = updates.size();

#pragma omp parallel num_threads(at::get_num_threads())
  {
    if (n_partial_sums) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t s = 0; s < n_partial_sums; ++s) {
        const Segment& seg = partial_sums[s];
        const Param<T>& t = params[seg.param];
        const int64_t begin = seg.begin * t.width + seg.end * kChunk;
        const int64_t n = std::min(kChunk, (seg.begin + 1) * t.width - begin);
        partials[t.partial_offset + seg.begin * t.partial_count + seg.end] = sum_of_squares(t.g + begin, n);
      }
    }
    if (n_scaled) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t s = 0; s < n_scaled; ++s) {
        const Param<T>& t = params[scaled[s]];
        for (int64_t k = 0; k < t.blocks; ++k) {
          T mean;
          if (t.mean != nullptr) {
            mean = t.mean[k];
          } else {
            T sum = 0;
            for (int64_t part = 0; part < t.partial_count; ++part)
              sum += partials[t.partial_offset + k * t.partial_count + part];
            mean = sum / T(t.width);
          }
          T v = t.v[k] * c.beta2 + c.one_minus_beta2 * mean;
          t.v[k] = v;
          scales[t.scale_offset + k] = scale_of(v, c);
        }
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t s = 0; s < n_updates; ++s) {
      const Segment& seg = updates[s];
      const Param<T>& t = params[seg.param];
      if (seg.kind == kBlocks) {
        t.decays ? run_blocks<T, true>(t, seg.begin, seg.end, c) : run_blocks<T, false>(t, seg.begin, seg.end, c);
      } else if (seg.kind == kElements) {
        t.decays ? run_elements<T, true>(t, seg.begin, seg.end, c) : run_elements<T, false>(t, seg.begin, seg.end, c);
      } else {
        const T* s_t = scales.data() + t.scale_offset;
        t.decays ? run_scaled<T, true>(t, s_t, seg.begin, seg.end, c) : run_scaled<T, false>(t, s_t, seg.begin, seg.end, c);
      }
    }
  }
}

void check(bool ok, const char* what, int64_t i) { TORCH_CHECK(ok, "adam_mini_step_: tensor ", i, ": ", what); }

template <typename T>
void typed_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList second_moments,
                const c10::List<std::optional<at::Tensor>>& means, const c10::List<std::optional<at::Tensor>>& row_blocks,
                c10::IntArrayRef decays, const at::Tensor& scalars, double beta1, double beta2, double eps) {
  const at::Tensor host = scalars.to(at::kDouble).contiguous();
  const double* s = host.data_ptr<double>();  // lr, 1 - beta1^t, 1 - beta2^t, 1 - lr * weight_decay
  Coefficients<T> c;
  c.beta2 = T(beta2);
  c.one_minus_beta2 = T(1 - beta2);
  c.weight = T(1 - beta1);
  c.small_weight = std::abs(1 - beta1) < 0.5;
  c.lr = T(s[0]);
  c.bc1 = T(s[1]);
  c.bc2 = T(s[2]);
  c.decay = T(s[3]);
  c.eps = T(eps);

  const auto dtype = params[0].scalar_type();
  std::vector<Param<T>> list;
  list.reserve(params.size());
  for (int64_t i = 0; i < static_cast<int64_t>(params.size()); ++i) {
    const at::Tensor &p = params[i], &g = grads[i], &m = exp_avgs[i], &v = second_moments[i];
    for (const at::Tensor* t : {&p, &g, &m, &v}) {
      check(t->device().is_cpu(), "not on the CPU", i);
      check(t->scalar_type() == dtype, "dtypes differ", i);
      check(t->is_contiguous(), "not contiguous", i);
    }
    check(g.numel() == p.numel() && m.numel() == p.numel(), "gradient or momentum differs from the parameter", i);
    Param<T> t{};
    t.p = p.data_ptr<T>();
    t.g = g.data_ptr<T>();
    t.m = m.data_ptr<T>();
    t.v = v.data_ptr<T>();
    t.numel = p.numel();
    t.blocks = v.numel();
    t.decays = decays[i] != 0;
    const std::optional<at::Tensor> mean = means.get(i), index = row_blocks.get(i);
    if (mean.has_value()) {
      check(mean->scalar_type() == dtype && mean->is_contiguous() && mean->numel() == t.blocks, "bad block means", i);
      t.mean = mean->data_ptr<T>();
    }
    if (index.has_value()) {
      check(t.mean != nullptr, "row blocks need given means", i);
      check(index->scalar_type() == at::kLong && index->is_contiguous(), "row blocks must be contiguous int64", i);
      t.row_blocks = index->data_ptr<int64_t>();
      t.rows = index->numel();
    } else {
      t.rows = t.blocks;
    }
    check(t.numel == 0 || (t.rows > 0 && t.numel % t.rows == 0), "rows do not divide the parameter", i);
    t.width = t.rows ? t.numel / t.rows : 0;
    list.push_back(t);
  }
  step(list, c);
}

void adam_mini_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList second_moments, const c10::List<std::optional<at::Tensor>>& means,
                        const c10::List<std::optional<at::Tensor>>& row_blocks, c10::IntArrayRef decays,
                        const at::Tensor& scalars, double beta1, double beta2, double eps) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && second_moments.size() == n && means.size() == n &&
                  row_blocks.size() == n && decays.size() == n,
              "adam_mini_step_: lists of different lengths");
  TORCH_CHECK(scalars.numel() == 4, "adam_mini_step_: scalars are lr, 1 - beta1^t, 1 - beta2^t, 1 - lr * wd");
  if (n == 0) return;
  switch (params[0].scalar_type()) {
    case at::kFloat:
      typed_step<float>(params, grads, exp_avgs, second_moments, means, row_blocks, decays, scalars, beta1, beta2, eps);
      break;
    case at::kDouble:
      typed_step<double>(params, grads, exp_avgs, second_moments, means, row_blocks, decays, scalars, beta1, beta2, eps);
      break;
    default:
      TORCH_CHECK(false, "adam_mini_step_: float32 and float64 only, not ", params[0].scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torchtitan, CPU, m) { m.impl("adam_mini_step_", &adam_mini_step_cpu); }
