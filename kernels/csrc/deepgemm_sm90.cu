// Host launcher for DeepGEMM's SM90 FP8 GEMM (1x128 activation scales x 128x128 weight scales).
//
// Why this file exists: the sgl-deep-gemm wheel's Python binding (_C.so) is built against another
// torch and rejects torch 2.11 tensors, but the wheel also ships DeepGEMM's kernels as headers.
// We instantiate `deep_gemm::sm90_fp8_gemm_1d2d_impl` here, build its TMA descriptors with the
// driver API and launch it; Python loads this as a plain shared library (ctypes, raw pointers),
// so no torch ABI is involved. kernels/deepgemm_sm90.py compiles it once per tile configuration.
//
// The configuration comes from -D flags: TD_BLOCK_M, TD_BLOCK_N, TD_STAGES, TD_MCAST (1 or 2),
// TD_MCAST_ON_A, TD_NUM_SMS, TD_GEMM_TYPE (0 normal, 1 M-grouped contiguous), TD_NUM_GROUPS,
// TD_SWIZZLE_D (bytes), and optionally TD_SHAPE_N / TD_SHAPE_K: N and K compiled in (0: runtime).
// DeepGEMM's own JIT compiles N and K in by default: the k-block loop's trip count and the B-scale
// loads become constants (and the kernel picks a deeper unroll for 256x128 tiles).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>

#ifndef TD_SHAPE_N
#define TD_SHAPE_N 0
#endif
#ifndef TD_SHAPE_K
#define TD_SHAPE_K 0
#endif

namespace {

constexpr uint32_t kBlockK = 128;
constexpr uint32_t kTmaThreads = 128;
constexpr uint32_t kMathThreads = TD_BLOCK_M <= 64 ? 128 : 256;
constexpr auto kGemmType = static_cast<deep_gemm::GemmType>(TD_GEMM_TYPE);

// Every template argument of the kernel, in its order; M stays runtime (0).
constexpr auto kKernel = &deep_gemm::sm90_fp8_gemm_1d2d_impl<
    cute::UMMA::Major::K, 0, TD_SHAPE_N, TD_SHAPE_K, TD_NUM_GROUPS, TD_BLOCK_M, TD_BLOCK_N, kBlockK,
    128, 128, TD_SWIZZLE_D, TD_STAGES, kTmaThreads, kMathThreads, TD_MCAST, (TD_MCAST_ON_A != 0),
    TD_NUM_SMS, kGemmType, cutlass::bfloat16_t, deep_gemm::epilogue::transform::EpilogueIdentity>;

// The driver's TMA encoder through the runtime's entry-point lookup, so that this library needs no
// link against libcuda (build machines may have no driver).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(char* err, int err_len) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (fn == nullptr) {
        cudaDriverEntryPointQueryResult q;
        void* p = nullptr;
        cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                         cudaEnableDefault, &q);
        if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr) {
            snprintf(err, err_len, "cuTensorMapEncodeTiled not found: %s", cudaGetErrorString(e));
            return nullptr;
        }
        fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
    return fn;
}

uint32_t align_up(uint32_t a, uint32_t b) { return (a + b - 1) / b * b; }

// Dynamic shared memory, laid out as the kernel carves it (D tile, stages of A/B/SFA, B scales,
// barriers); the B-scale part depends on K.
uint32_t smem_bytes(uint32_t k) {
    const bool uniform_sfb = kBlockK % TD_BLOCK_N == 0;
    const uint32_t d = align_up(TD_BLOCK_M * TD_BLOCK_N * 2, 1024);
    const uint32_t a = TD_BLOCK_M * kBlockK, b = TD_BLOCK_N * kBlockK;
    const uint32_t sfa = align_up(TD_BLOCK_M * 4, 128);
    const uint32_t k_scales = (k + kBlockK - 1) / kBlockK;
    const uint32_t sfb = align_up(k_scales * (uniform_sfb ? 1 : 2) * 4, 8);
    return d + TD_STAGES * (a + b + sfa) + sfb + TD_STAGES * 2 * 8;
}

// 2-D tiled TMA descriptor: dims/strides innermost first, strides in bytes (outer dim only).
bool encode(CUtensorMap* map, CUtensorMapDataType dtype, void* base, uint64_t inner, uint64_t outer,
            uint64_t outer_stride_bytes, uint32_t box_inner, uint32_t box_outer,
            CUtensorMapSwizzle swizzle, char* err, int err_len) {
    const cuuint64_t dims[2] = {inner, outer};
    const cuuint64_t strides[1] = {outer_stride_bytes};
    const cuuint32_t box[2] = {box_inner, box_outer};
    const cuuint32_t elem_strides[2] = {1, 1};
    auto encode_tiled = tensor_map_encoder(err, err_len);
    if (encode_tiled == nullptr)
        return false;
    CUresult r = encode_tiled(map, dtype, 2, base, dims, strides, box, elem_strides,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        snprintf(err, err_len, "cuTensorMapEncodeTiled(inner=%llu outer=%llu stride=%llu box=%ux%u): CUresult %d",
                 (unsigned long long)inner, (unsigned long long)outer,
                 (unsigned long long)outer_stride_bytes, box_inner, box_outer, int(r));
        return false;
    }
    return true;
}

CUtensorMapSwizzle swizzle_of(uint32_t bytes) {
    switch (bytes) {
        case 32: return CU_TENSOR_MAP_SWIZZLE_32B;
        case 64: return CU_TENSOR_MAP_SWIZZLE_64B;
        case 128: return CU_TENSOR_MAP_SWIZZLE_128B;
        default: return CU_TENSOR_MAP_SWIZZLE_NONE;
    }
}

}  // namespace

extern "C" {

// D [m, n] bf16 (row stride ldd elements) = A [m, k] e4m3 (row stride lda bytes) x B^T, where B is
// e4m3 [groups * n, k] (row stride ldb bytes); A's scales are fp32 [ceil(k/128), m_al] (M-major,
// m_al % 4 == 0), B's fp32 [groups, ceil(n/128), ceil(k/128)]. K need not be a multiple of 128: TMA
// fills the last block's missing columns with zeros. Grouped (TD_GEMM_TYPE 1): row r of A belongs
// to group grouped_layout[r] (-1: padding), each group's rows contiguous and BLOCK_M aligned.
// Returns 0, or -1 with a message in err.
int tandem_dg_gemm(void* a, void* sfa, void* b, float* sfb, void* d, int* grouped_layout,
                   uint32_t m, uint32_t n, uint32_t k, uint32_t m_al, uint64_t lda, uint64_t ldb,
                   uint64_t ldd, uint32_t groups, void* stream, char* err, int err_len) {
    // The kernel replaces runtime N/K by compiled ones: a mismatch would compute garbage silently.
    if ((TD_SHAPE_N != 0 && n != TD_SHAPE_N) || (TD_SHAPE_K != 0 && k != TD_SHAPE_K)) {
        snprintf(err, err_len, "launcher compiled for N=%u K=%u, called with N=%u K=%u",
                 unsigned(TD_SHAPE_N), unsigned(TD_SHAPE_K), n, k);
        return -1;
    }
    constexpr uint32_t kSwizzleD = TD_SWIZZLE_D;
    constexpr uint32_t kStoreN = kSwizzleD == 0 ? TD_BLOCK_N : kSwizzleD / 2;
    CUtensorMap map_a, map_b, map_d, map_sfa;
    if (!encode(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, a, k, m, lda, 128, TD_BLOCK_M,
                CU_TENSOR_MAP_SWIZZLE_128B, err, err_len) ||
        !encode(&map_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, b, k, uint64_t(n) * groups, ldb, 128, TD_BLOCK_N,
                CU_TENSOR_MAP_SWIZZLE_128B, err, err_len) ||
        !encode(&map_d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, d, n, m, ldd * 2, kStoreN, TD_BLOCK_M,
                swizzle_of(kSwizzleD), err, err_len) ||
        !encode(&map_sfa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, sfa, m_al, (k + kBlockK - 1) / kBlockK,
                uint64_t(m_al) * 4, TD_BLOCK_M, 1, CU_TENSOR_MAP_SWIZZLE_NONE, err, err_len))
        return -1;

    const uint32_t smem = smem_bytes(k);
    static uint32_t smem_set = 0;  // the attribute is per function; raise it once per size
    if (smem > smem_set) {
        cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) {
            snprintf(err, err_len, "cudaFuncSetAttribute(smem=%u): %s", smem, cudaGetErrorString(e));
            return -1;
        }
        smem_set = smem;
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(TD_NUM_SMS, 1, 1);  // persistent: the scheduler strides by kNumSMs
    config.blockDim = dim3(kTmaThreads + kMathThreads, 1, 1);
    config.dynamicSmemBytes = smem;
    config.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = TD_MCAST;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    cudaError_t e = cudaLaunchKernelEx(&config, kKernel, sfb, grouped_layout, m, n, k,
                                       map_a, map_b, map_d, map_sfa);
    if (e != cudaSuccess) {
        snprintf(err, err_len, "cudaLaunchKernelEx: %s", cudaGetErrorString(e));
        return -1;
    }
    return 0;
}

}  // extern "C"
