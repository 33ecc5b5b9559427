// The CPU stand-in for cuBLASLt: the descriptors strata builds (kernels/cuda/matmul.cu) and
// cublasLtMatmul as D = alpha op(A) op(B) + beta C (+ bias), fp32 accumulation in k order, run on
// the stream's worker. Test-only. Arguments are checked as strictly as the documentation states:
// layouts against the transposes and leading dimensions, every operand inside device memory,
// C and D the same, the pointers' alignment at least what the algorithm was chosen for.
#include <cublasLt.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "strata/dtype.h"
#include "tests/cuda_emu/control.h"

struct cublasLtContext {
  int magic = 0x4c54;
};
struct cublasLtMatmulDescOpaque_t {
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  int32_t bias_type = -1;  // -1: D's type
  void* aux = nullptr;     // the GELU epilogue's input, stored; DGELU's, read (D's type)
  int64_t aux_ld = 0;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
struct cublasLtMatmulPreferenceOpaque_t {
  size_t workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D
};

namespace {

using strata::emu::is_device_memory;

size_t type_size(cudaDataType t) {
  switch (t) {
    case CUDA_R_32F:
      return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF:
      return 2;
    default:
      return 0;
  }
}
float load(const void* p, cudaDataType t, size_t i) {
  switch (t) {
    case CUDA_R_32F:
      return static_cast<const float*>(p)[i];
    case CUDA_R_16BF:
      return strata::bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default:
      return strata::f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}
void store(void* p, cudaDataType t, size_t i, float v) {
  switch (t) {
    case CUDA_R_32F:
      static_cast<float*>(p)[i] = v;
      break;
    case CUDA_R_16BF:
      static_cast<uint16_t*>(p)[i] = strata::f32_to_bf16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = strata::f32_to_f16(v);
      break;
  }
}
uint32_t alignment_of(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}
// Bytes a column-major rows x cols matrix with leading dimension ld spans.
size_t span(const cublasLtMatrixLayoutOpaque_t& l) {
  return (l.cols == 0 || l.rows == 0) ? 0
                                      : ((l.cols - 1) * size_t(l.ld) + l.rows) * type_size(l.type);
}

}  // namespace

namespace {
std::atomic<uint64_t> g_heuristic_queries{0};
}  // namespace

uint64_t strata::emu::cublaslt_heuristic_queries() { return g_heuristic_queries.load(); }

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  *handle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasLtGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
  }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  *desc = new cublasLtMatmulDescOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t size) {
  auto take = [&](auto* field) {
    if (size != sizeof(*field)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(field, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  };
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      return take(&d->ta);
    case CUBLASLT_MATMUL_DESC_TRANSB:
      return take(&d->tb);
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      return take(&d->epilogue);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      return take(&d->bias);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      return take(&d->bias_type);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      return take(&d->aux);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
      return take(&d->aux_ld);
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;  // not emulated: strata sets no other attribute
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  if (type_size(type) == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (ld < int64_t(rows) || ld < 1) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  *pref = new cublasLtMatmulPreferenceOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (size != sizeof(size_t)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&p->workspace, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  const int i = attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES;
  if (i < 0 || i > 3 || size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&p->align[i], buf, size);
  return CUBLAS_STATUS_SUCCESS;
}

// One "algorithm": it remembers the alignments it was chosen for (data[0..3]), which every
// cublasLtMatmul with it must honour.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t* out, int* returned) {
  if (!handle || !op || !a || !b || !c || !d || !pref || requested < 1) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  ++g_heuristic_queries;
  *returned = 0;
  if (a->type != b->type || (d->type != a->type && d->type != CUDA_R_32F)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  *out = {};
  for (int i = 0; i < 4; ++i) {
    if (pref->align[i] < type_size(i < 2 ? (i == 0 ? a->type : b->type) : d->type)) {
      return CUBLAS_STATUS_SUCCESS;  // no algorithm for operands below their element size
    }
    out->algo.data[i] = pref->align[i];
  }
  out->state = CUBLAS_STATUS_SUCCESS;
  out->wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t op, const void* alpha_p,
                              const void* A, cublasLtMatrixLayout_t a, const void* B,
                              cublasLtMatrixLayout_t b, const void* beta_p, const void* C,
                              cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  if (!handle || !op || !a || !b || !c || !d || !algo || !alpha_p || !beta_p) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool a_n = op->ta == CUBLAS_OP_N, b_n = op->tb == CUBLAS_OP_N;
  const uint64_t m = d->rows, n = d->cols;
  const uint64_t k = a_n ? a->cols : a->rows;
  if ((a_n ? a->rows : a->cols) != m || (b_n ? b->rows : b->cols) != k ||
      (b_n ? b->cols : b->rows) != n || c->rows != m || c->cols != n) {
    return CUBLAS_STATUS_INVALID_VALUE;  // the layouts do not multiply
  }
  if (C != D || c->ld != d->ld || c->type != d->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (a->type != b->type || (d->type != a->type && d->type != CUDA_R_32F)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const void* ptrs[4] = {A, B, C, D};
  for (int i = 0; i < 4; ++i) {
    if (alignment_of(ptrs[i]) < algo->data[i]) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if ((span(*a) && !is_device_memory(A, span(*a))) ||
      (span(*b) && !is_device_memory(B, span(*b))) ||
      (span(*d) && !is_device_memory(D, span(*d)))) {
    return CUBLAS_STATUS_INVALID_VALUE;  // an operand reaches outside device memory
  }
  if (workspace_bytes > 0 && !is_device_memory(workspace, workspace_bytes)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // Epilogues: BIAS, GELU_AUX(_BIAS): D = gelu(alpha AB + beta C + bias) with the GELU's input
  // stored to the aux matrix (ld a multiple of 8, at least m; D's type), and DGELU: D =
  // (alpha AB + beta C) * gelu'(aux), the aux matrix read, as cuBLASLt.
  const bool with_bias =
      op->epilogue == CUBLASLT_EPILOGUE_BIAS || op->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  const bool dgelu = op->epilogue == CUBLASLT_EPILOGUE_DGELU;
  const bool gelu = op->epilogue == CUBLASLT_EPILOGUE_GELU_AUX ||
                    op->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || dgelu;
  if (op->epilogue != CUBLASLT_EPILOGUE_DEFAULT && !with_bias && !gelu) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (gelu && (op->aux_ld % 8 != 0 || op->aux_ld < int64_t(m) || !op->aux ||
               !is_device_memory(op->aux, ((n - 1) * op->aux_ld + m) * type_size(d->type)))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const cudaDataType bias_t = op->bias_type < 0 ? d->type : cudaDataType(op->bias_type);
  if (with_bias && (!op->bias || !is_device_memory(op->bias, m * type_size(bias_t)))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const float alpha = *static_cast<const float*>(alpha_p),
              beta = *static_cast<const float*>(beta_p);
  const auto la = *a, lb = *b, ld = *d;
  const void* bias = with_bias ? op->bias : nullptr;
  void* aux = gelu ? op->aux : nullptr;
  const int64_t aux_ld = op->aux_ld;
  strata::emu::enqueue(stream, "cublasLtMatmul", [=] {
    if (!strata::emu::failure().empty()) return;
    // op(A) as m x k rows, op(B) as n columns of k: both read contiguously below.
    std::vector<float> ar(m * k), bc(n * k);
    for (uint64_t i = 0; i < m; ++i) {
      for (uint64_t kk = 0; kk < k; ++kk) {
        ar[i * k + kk] = load(A, la.type, a_n ? kk * la.ld + i : i * la.ld + kk);
      }
    }
    for (uint64_t j = 0; j < n; ++j) {
      for (uint64_t kk = 0; kk < k; ++kk) {
        bc[j * k + kk] = load(B, lb.type, b_n ? j * lb.ld + kk : kk * lb.ld + j);
      }
    }
    for (uint64_t j = 0; j < n; ++j) {
      for (uint64_t i = 0; i < m; ++i) {
        float acc = 0.0f;
        const float* x = &ar[i * k];
        const float* y = &bc[j * k];
        for (uint64_t kk = 0; kk < k; ++kk) acc += x[kk] * y[kk];
        const size_t at = j * ld.ld + i;
        float v = alpha * acc;
        if (beta != 0.0f) v += beta * load(D, ld.type, at);
        if (bias) v += load(bias, bias_t, i);
        if (aux && dgelu) {  // the tanh approximation's derivative at the stored input
          const float x = load(aux, ld.type, j * aux_ld + i);
          const float th = std::tanh(0.7978845608f * (x + 0.044715f * x * x * x));
          v *= 0.5f * (1.0f + th) +
               0.5f * x * (1.0f - th * th) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
        } else if (aux) {  // the tanh approximation, on the fp32 value; its input rounded to aux
          store(aux, ld.type, j * aux_ld + i, v);
          v = 0.5f * v * (1.0f + std::tanh(0.7978845608f * (v + 0.044715f * v * v * v)));
        }
        store(D, ld.type, at, v);
      }
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
