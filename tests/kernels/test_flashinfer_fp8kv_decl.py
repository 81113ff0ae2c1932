"""Our FP8-KV variant of FlashInfer's fa2 AttentionSink declaration, on the CPU: the text edit
(kernels/flashinfer_fp8kv.py) and a host C++ compile of its result against stand-ins of FlashInfer's
REGISTER_* macros, which catches a declaration nvcc would reject (FlashInfer 0.6.6 on the H200 failed
on every kernel of the module: the constructor kept the name AttentionSink inside the renamed struct).

The declaration is FlashInfer 0.6.6's text (copied below; the installed one too when flashinfer is
importable). The full module is compiled for sm_90a by `python -m benchmarks.flashinfer_cache
--prebuild` on a machine with nvcc.
"""

import re
import shutil
import subprocess

import pytest

from common.errors import ConfigError
from kernels.flashinfer_fp8kv import FP8_VARIANT, fp8_variant_decl

# flashinfer/jit/attention/variants.py, attention_sink_fa2_decl, FlashInfer 0.6.6
FA2_DECL_066 = r"""
struct AttentionSink : AttentionVariantBase {
  static constexpr bool use_softmax = true;

  uint32_t window_left, qo_len, kv_len;
  float sm_scale_log2;

  // Create closure
  template <typename Params>
  __device__ __host__ AttentionSink(const Params& params, uint32_t batch_idx,
                                   uint8_t* smem_ptr) {
    qo_len = params.get_qo_len(batch_idx);
    kv_len = params.get_kv_len(batch_idx);
    window_left = (params.window_left >= 0) ? params.window_left : kv_len;
    sm_scale_log2 = params.sm_scale * math::log2e;
  }

  REGISTER_LOGITS_MASK(params, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    return (kv_idx + qo_len + window_left >= kv_len + qo_idx);
  })

  REGISTER_M_D_UPDATE(params, kv_tile_idx, qo_head_idx, m, d, scale, {
    float log_sink = (kv_tile_idx == 0 && qo_head_idx < params.num_qo_heads) ? params.sink[qo_head_idx] * math::log2e : -math::inf;
    float m_new = (log_sink > m) ? log_sink : m;
    scale = math::ptx_exp2(m - m_new);
    float d_new = math::ptx_exp2(log_sink - m_new) + d * scale;
    // Update m and d
    m = m_new;
    d = d_new;
  })

  REGISTER_OUTPUT_TRANSFORM(params, output, batch_idx, qo_idx, qo_head_idx, m, d, scale, {
    float d_rcp = (m != -math::inf) ? math::ptx_rcp(d) : 0.f;
    return output * scale * d_rcp;
  });
};
"""

# Host stand-ins for what FlashInfer's generated batch_prefill_config.inc sees: the REGISTER_* macros
# with variant_helper.cuh's signatures, math::, and a Params with the members the variant reads
# (our additional tensors sink/k_scale/v_scale are float pointers there, group_size a fast divisor).
_PRELUDE = r"""
#include <cstdint>
#include <cmath>
#define __device__
#define __host__
#define __forceinline__ inline
namespace math {
constexpr float log2e = 1.44269504088896340736f;
constexpr float inf = INFINITY;
inline float ptx_exp2(float x) { return std::exp2(x); }
inline float ptx_rcp(float x) { return 1.f / x; }
}
struct AttentionVariantBase {};
#define REGISTER_LOGITS_TRANSFORM(params, logits, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, ...) \
  template <typename Params, typename T> \
  __device__ __forceinline__ T LogitsTransform(const Params& params, T logits, uint32_t batch_idx, \
      uint32_t qo_idx, uint32_t kv_idx, uint32_t qo_head_idx, uint32_t kv_head_idx) { __VA_ARGS__ }
#define REGISTER_LOGITS_MASK(params, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, ...) \
  template <typename Params> \
  __device__ __forceinline__ bool LogitsMask(const Params& params, uint32_t batch_idx, uint32_t qo_idx, \
      uint32_t kv_idx, uint32_t qo_head_idx, uint32_t kv_head_idx) { __VA_ARGS__ }
#define REGISTER_M_D_UPDATE(params, kv_tile_idx, qo_head_idx, m, d, scale, ...) \
  template <typename Params, typename T_M> \
  __device__ __forceinline__ void update_m_d(const Params& params, uint32_t kv_tile_idx, \
      uint32_t qo_head_idx, T_M& m, float& d, float& scale) { __VA_ARGS__ }
#define REGISTER_OUTPUT_TRANSFORM(params, output, batch_idx, qo_idx, qo_head_idx, m, d, scale, ...) \
  template <typename Params, typename T, typename T_M> \
  __device__ __forceinline__ T OutputTransform(const Params& params, T output, uint32_t batch_idx, \
      uint32_t qo_idx, uint32_t qo_head_idx, T_M& m, float& d, float scale) { __VA_ARGS__ }
struct FastDiv { uint32_t d; };
inline uint32_t operator/(uint32_t n, FastDiv f) { return n / f.d; }
struct Params {
  float *sink, *k_scale, *v_scale;
  double sm_scale;
  int32_t window_left;
  uint32_t num_qo_heads;
  FastDiv group_size;
  uint32_t get_qo_len(uint32_t) const { return 1; }
  uint32_t get_kv_len(uint32_t) const { return 8; }
};
"""

_USE = r"""
float use(const Params& p) {
  VARIANT v(p, 0, nullptr);
  float m = 0.f, d = 1.f, scale = 1.f;
  v.update_m_d(p, 0, 0, m, d, scale);
  bool keep = v.LogitsMask(p, 0, 0, 0, 0, 0);
  return v.LogitsTransform(p, 1.f, 0, 0, 0, 0, 0) + v.OutputTransform(p, 1.f, 0, 0, 0, m, d, scale) + keep;
}
"""


def _decls():
    yield pytest.param(FA2_DECL_066, id="flashinfer-0.6.6-text")
    try:
        from flashinfer.jit.attention.variants import attention_sink_decl
    except ImportError:
        return
    yield pytest.param(attention_sink_decl["fa2"], id="installed-flashinfer")


def _host_compile(decl: str, variant: str, tmp_path) -> subprocess.CompletedProcess:
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = tmp_path / "variant.cc"
    src.write_text(_PRELUDE + decl + _USE.replace("VARIANT", variant))
    return subprocess.run([cxx, "-std=c++17", "-fsyntax-only", str(src)], capture_output=True, text=True)


@pytest.mark.parametrize("decl", list(_decls()))
def test_fp8_kv_variant_renames_the_struct_and_its_constructor(decl):
    out = fp8_variant_decl(decl)
    assert not re.search(r"\bAttentionSink\b", out)
    assert f"struct {FP8_VARIANT} : AttentionVariantBase" in out
    assert re.search(rf"__device__ __host__ {FP8_VARIANT}\(const Params& params, uint32_t batch_idx", out)
    # K's scale on the raw logits of its KV head, before the mask (and the softmax's sm_scale);
    # V's on the output, by the KV head of the q head (qo_head_idx / group_size)
    assert out.index("params.k_scale[kv_head_idx]") < out.index("REGISTER_LOGITS_MASK(")
    assert "return output * scale * d_rcp * params.v_scale[qo_head_idx / params.group_size];" in out


@pytest.mark.parametrize("decl", list(_decls()))
def test_fp8_kv_variant_compiles_as_cxx(decl, tmp_path):
    r = _host_compile(fp8_variant_decl(decl), FP8_VARIANT, tmp_path)
    assert r.returncode == 0, r.stderr


def test_fp8_kv_host_compile_rejects_a_constructor_left_with_the_old_name(tmp_path):
    """The check above would have caught the H200's nvcc error ("explicit type is missing")."""
    broken = fp8_variant_decl(FA2_DECL_066).replace(f"__host__ {FP8_VARIANT}(", "__host__ AttentionSink(")
    r = _host_compile(broken, FP8_VARIANT, tmp_path)
    assert r.returncode != 0 and "AttentionSink" in r.stderr


def test_fp8_kv_variant_refuses_a_declaration_without_the_constructor():
    with pytest.raises(ConfigError, match="declaration changed"):
        fp8_variant_decl(FA2_DECL_066.replace("AttentionSink(const Params& params", "Init(const Params& params"))


def test_fp8_kv_copied_declaration_is_flashinfer_066s():
    fi = pytest.importorskip("flashinfer")
    if fi.__version__ != "0.6.6":
        pytest.skip(f"flashinfer {fi.__version__} installed")
    from flashinfer.jit.attention.variants import attention_sink_decl
    assert attention_sink_decl["fa2"] == FA2_DECL_066
