// Linear layers through cuBLASLt, fp32 compute and accumulation. CPU twin: kernels/cpu/matmul.cc.
//
// strata's matrices are row-major; cuBLASLt's are column-major. A row-major [R,K] matrix is the
// column-major [K,R] matrix with the same bytes, so each product below is written for the
// transposes (m x n = k-contraction, all column-major):
//   forward   out[N,OC] = inp[N,C] @ W[OC,C]^T + bias  <=>  D(OCxN) = op_T(W: CxOC) * inp(CxN),
//             bias[OC] added by the BIAS epilogue.
//   forward with GELU (matmul_gelu_forward): the same product with the GELU_AUX_BIAS epilogue
//             (GELU_AUX without a bias): D = gelu(product + bias), the aux matrix (ld OC, the
//             output's dtype) = product + bias.
//   dinp      dinp[N,C] += dout[N,OC] @ W[OC,C]        <=>  D(CxN) = W(CxOC) * dout(OCxN), beta 1
//             (beta 0 when written: matmul_backward's `accumulate` false).
//   dinp with GELU's gradient (matmul_backward_gelu): dpre[N,C] = gelu'(pre) * (dout @ W), the
//             same product, beta 0, with the DGELU epilogue reading pre as its aux input (ld C).
//   dweight   dweight[OC,C] += dout^T @ inp[N,C]       <=>  D(CxOC) = inp(CxN) * op_T(dout: OCxN),
//             D in fp32 with beta 1: low-precision operands accumulate straight into fp32.
//   dbias     column sums of dout, by a kernel (fp32 +=; column_sums.cuh: the same bits in any
//             block order).
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

cudaDataType_t cuda_type(DType dt) {
  switch (dt) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_16F;
  }
}

// Largest power of two (<= 256) dividing the address: what cuBLASLt may assume about it.
uint32_t alignment_of(const void* p) {
  uint32_t a = 256;
  while (a > 1 && (reinterpret_cast<uintptr_t>(p) % a) != 0) a /= 2;
  return a;
}

// Descriptors live for one call; destroyed on every path out. The algorithm is asked of
// cuBLASLt's heuristic the first time a problem is seen and kept in blas.algos.
struct LtCall {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// cuBLASLt's heuristic for the call described by c's descriptors: its first choice under the
// workspace and operand alignments (D's for C), in *heur when *found is 1.
Status ask_heuristic(const CudaBlas& blas, LtCall& c, const uint32_t (&align)[4], size_t ws,
                     cublasLtMatmulHeuristicResult_t* heur, int* found) {
  STRATA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&c.pref), "creating the preference");
  STRATA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
                          c.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
                      "setting the workspace size");
  const cublasLtMatmulPreferenceAttributes_t align_attr[3] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 3; ++i) {
    STRATA_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(c.pref, align_attr[i], &align[i], sizeof(uint32_t)),
        "setting the operand alignment");
  }
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(c.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                           &align[2], sizeof(uint32_t)),
      "setting the C alignment");
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulAlgoGetHeuristic(blas.handle, c.op, c.a, c.b, c.d, c.d, c.pref, 1, heur, found),
      "asking cuBLASLt for an algorithm");
  return Status::ok();
}

// D(m x n, ld ldd) = alpha * op(A) * op(B) + beta * D (+ bias[m] if non-null), column-major,
// fp32 compute. A is stored m x k (ta = N) or k x m (ta = T); B k x n (tb = N) or n x k (T).
// With gelu_aux: D = gelu(that), and gelu_aux (m x n, ld ldd, D's type) = that; with dgelu
// too (no bias): D = that * gelu'(gelu_aux), gelu_aux read (DGELU epilogue).
Status lt_matmul(const CudaBlas& blas, cudaStream_t s, cublasOperation_t ta, cublasOperation_t tb,
                 int m, int n, int k, const void* A, cudaDataType_t at, int lda, const void* B,
                 cudaDataType_t bt, int ldb, void* D, cudaDataType_t dtp, int ldd, float beta,
                 const void* bias, void* gelu_aux = nullptr, bool dgelu = false) {
  LtCall c;
  STRATA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&c.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                      "creating the matmul descriptor");
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(c.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
      "setting TRANSA");
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(c.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
      "setting TRANSB");
  if (bias && dgelu) {
    return invalid_argument("the DGELU epilogue takes no bias (matmul_backward_gelu)");
  }
  const cublasLtEpilogue_t epi = gelu_aux ? (dgelu  ? CUBLASLT_EPILOGUE_DGELU
                                             : bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                                    : CUBLASLT_EPILOGUE_GELU_AUX)
                                 : bias   ? CUBLASLT_EPILOGUE_BIAS
                                          : CUBLASLT_EPILOGUE_DEFAULT;
  if (epi != CUBLASLT_EPILOGUE_DEFAULT) {
    STRATA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(c.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)),
        "setting the epilogue");
  }
  if (gelu_aux) {
    STRATA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(c.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &gelu_aux,
                                       sizeof(gelu_aux)),
        "setting the GELU epilogue's aux pointer");
    const int64_t aux_ld = ldd;
    STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(c.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                       &aux_ld, sizeof(aux_ld)),
                        "setting the GELU epilogue's aux leading dimension");
  }
  if (bias) {
    STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(c.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &bias, sizeof(bias)),
                        "setting the bias pointer");
    const int32_t bias_type = dtp;  // the bias has the output's dtype
    STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(c.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                       &bias_type, sizeof(bias_type)),
                        "setting the bias type");
  }
  const bool a_n = ta == CUBLAS_OP_N, b_n = tb == CUBLAS_OP_N;
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c.a, at, a_n ? m : k, a_n ? k : m, lda),
                      "creating the A layout");
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c.b, bt, b_n ? k : n, b_n ? n : k, ldb),
                      "creating the B layout");
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c.d, dtp, m, n, ldd), "creating the D layout");
  const size_t ws = blas.workspace_bytes;
  const uint32_t align[4] = {alignment_of(A), alignment_of(B), alignment_of(D),
                             bias ? alignment_of(bias) : 256u};
  // The epilogue's pointers are in the descriptor the heuristic reads: their alignments too.
  const int64_t aux_align = gelu_aux ? alignment_of(gelu_aux) : 256;
  const CublasLtAlgos::Key key = {ta,       tb,       m,        n,        k,         at,
                                  bt,       lda,      ldb,      dtp,      ldd,       int64_t(epi),
                                  align[0], align[1], align[2], align[3], aux_align, int64_t(ws)};
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  if (blas.algos != nullptr && blas.algos->find(key, &heur.algo)) {
    found = 1;
  } else {
    STRATA_RETURN_IF_ERROR(ask_heuristic(blas, c, align, ws, &heur, &found),
                           "choosing cuBLASLt's algorithm");
    if (found != 0 && blas.algos != nullptr) blas.algos->put(key, heur.algo);
  }
  if (found == 0) {
    return internal_error("cuBLASLt has no algorithm for this matmul (m=" + std::to_string(m) +
                          " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                          ", A/B/D alignment " + std::to_string(align[0]) + "/" +
                          std::to_string(align[1]) + "/" + std::to_string(align[2]) +
                          " bytes); check the shapes and the buffers' alignment");
  }
  const float alpha = 1.0f;
  STRATA_CUBLAS_CHECK(cublasLtMatmul(blas.handle, c.op, &alpha, A, c.a, B, c.b, &beta, D, c.d, D,
                                     c.d, &heur.algo, blas.workspace, ws, s),
                      "enqueuing cublasLtMatmul");
  return Status::ok();
}

// dbias[c] += sum_r dout[r,c], by column_sums.cuh (the same bits whichever order the blocks
// run in, and K columns a thread, a 16-byte pack where the rows go in packs, or one: the same
// sums column by column).
template <typename T, int K>
__global__ void column_sum_kernel(float* dbias, const T* dout, int N, int OC, int rows_per_chunk,
                                  int chunks, CudaReduceScratch rs) {
  __shared__ float sh[1][K][kColumnRowLanes][33];
  __shared__ int last;
  const int c = (blockIdx.x * 32 + threadIdx.x) * K;
  int r0, r1;
  column_sum_rows(N, rows_per_chunk, &r0, &r1);
  float v[1][K];
  for (int k = 0; k < K; ++k) v[0][k] = 0.0f;
  if (c < OC) {
    for (int r = r0 + threadIdx.y; r < r1; r += kColumnRowLanes) {
      const Elems<T, K> e = load_elems<K>(dout + size_t(r) * OC + c);
      for (int k = 0; k < K; ++k) v[0][k] += to_f32(e.v[k]);
    }
  }
  float* const out[1] = {dbias};
  finish_column_sums<1, K>(v, out, OC, chunks, rs, sh, last);
}

}  // namespace

Status cuda_matmul_forward(cudaStream_t s, const CudaBlas& blas, DType dt, void* out,
                           const void* inp, const void* weight, const void* bias, int N, int C,
                           int OC) {
  if (N == 0 || OC == 0) return Status::ok();
  const cudaDataType_t t = cuda_type(dt);
  return lt_matmul(blas, s, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, t, C, inp, t, C, out, t, OC,
                   0.0f, bias)
      .with_context("matmul_forward");
}

bool cuda_matmul_gelu_supported(int OC) { return OC > 0 && OC % 8 == 0; }

Status cuda_matmul_gelu_forward(cudaStream_t s, const CudaBlas& blas, DType dt, void* out,
                                void* pre, const void* inp, const void* weight, const void* bias,
                                int N, int C, int OC) {
  if (N == 0 || OC == 0) return Status::ok();
  if (!cuda_matmul_gelu_supported(OC)) {
    return invalid_argument("matmul_gelu_forward: OC=" + std::to_string(OC) +
                            " is not a multiple of 8 (cuBLASLt's GELU epilogue); check "
                            "supports(kMatmulGelu) and use matmul_forward + gelu_forward");
  }
  const cudaDataType_t t = cuda_type(dt);
  return lt_matmul(blas, s, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, t, C, inp, t, C, out, t, OC,
                   0.0f, bias, pre)
      .with_context("matmul_gelu_forward");
}

namespace {

// The weight and bias gradients of matmul_backward and matmul_backward_gelu.
Status matmul_backward_params(cudaStream_t s, const CudaBlas& blas, const CudaReduceScratch& rs,
                              DType dt, float* dweight, float* dbias, const void* dout,
                              const void* inp, int N, int C, int OC, bool packed) {
  const cudaDataType_t t = cuda_type(dt);
  if (dweight) {
    STRATA_RETURN_IF_ERROR(lt_matmul(blas, s, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, t, C, dout,
                                     t, OC, dweight, CUDA_R_32F, C, 1.0f, nullptr),
                           "matmul_backward: dweight += dout^T @ inp");
  }
  if (dbias) {
    STRATA_DISPATCH_DT(dt, {
      const auto* g = static_cast<const scalar_t*>(dout);
      if (rows_packed<scalar_t>(packed, OC, {dout})) {
        constexpr int K = kPack<scalar_t>;
        const ColumnSumPlan plan = plan_column_sums(rs, N, OC, 1, K);
        column_sum_kernel<scalar_t, K><<<plan.grid, column_sum_block(), 0, s>>>(
            dbias, g, N, OC, plan.rows_per_chunk, plan.chunks, rs);
      } else {
        const ColumnSumPlan plan = plan_column_sums(rs, N, OC, 1);
        column_sum_kernel<scalar_t, 1><<<plan.grid, column_sum_block(), 0, s>>>(
            dbias, g, N, OC, plan.rows_per_chunk, plan.chunks, rs);
      }
    });
    STRATA_CUDA_LAUNCH_CHECK("launching matmul_backward's dbias column sum");
  }
  return Status::ok();
}

}  // namespace

Status cuda_matmul_backward(cudaStream_t s, const CudaBlas& blas, const CudaReduceScratch& rs,
                            DType dt, void* dinp, float* dweight, float* dbias, const void* dout,
                            const void* inp, const void* weight, int N, int C, int OC,
                            bool accumulate, bool packed) {
  if (N == 0 || C == 0) return Status::ok();
  if (OC == 0) {  // an empty product: a written dinp is zeros
    if (dinp && !accumulate) {
      STRATA_CUDA_CHECK(cudaMemsetAsync(dinp, 0, size_t(N) * C * dtype_size(dt), s),
                        "matmul_backward: dinp = 0 (OC = 0)");
    }
    return Status::ok();
  }
  const cudaDataType_t t = cuda_type(dt);
  if (dinp) {
    STRATA_RETURN_IF_ERROR(lt_matmul(blas, s, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, t, C,
                                     dout, t, OC, dinp, t, C, accumulate ? 1.0f : 0.0f, nullptr),
                           accumulate ? "matmul_backward: dinp += dout @ weight"
                                      : "matmul_backward: dinp = dout @ weight");
  }
  return matmul_backward_params(s, blas, rs, dt, dweight, dbias, dout, inp, N, C, OC, packed);
}

bool cuda_matmul_backward_gelu_supported(int C) { return C > 0 && C % 8 == 0; }

Status cuda_matmul_backward_gelu(cudaStream_t s, const CudaBlas& blas, const CudaReduceScratch& rs,
                                 DType dt, void* dpre, float* dweight, float* dbias,
                                 const void* dout, const void* inp, const void* weight,
                                 const void* pre, int N, int C, int OC, bool packed) {
  if (N == 0 || C == 0) return Status::ok();
  if (!cuda_matmul_backward_gelu_supported(C)) {
    return invalid_argument("matmul_backward_gelu: C=" + std::to_string(C) +
                            " is not a multiple of 8 (cuBLASLt's DGELU epilogue); check "
                            "supports(kMatmulBackwardGelu) and use matmul_backward + "
                            "gelu_backward");
  }
  const cudaDataType_t t = cuda_type(dt);
  if (OC == 0) {  // an empty product: the gradient is gelu'(pre) * 0
    STRATA_CUDA_CHECK(cudaMemsetAsync(dpre, 0, size_t(N) * C * dtype_size(dt), s),
                      "matmul_backward_gelu: zeroing dpre (OC = 0)");
    return Status::ok();
  }
  STRATA_RETURN_IF_ERROR(lt_matmul(blas, s, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, t, C, dout,
                                   t, OC, dpre, t, C, 0.0f, nullptr, const_cast<void*>(pre),
                                   /*dgelu=*/true),
                         "matmul_backward_gelu: dpre = gelu'(pre) * (dout @ weight)");
  return matmul_backward_params(s, blas, rs, dt, dweight, dbias, dout, inp, N, C, OC, packed);
}

}  // namespace strata
