"""kernels/gemv.py (few-token split-K linear) in the Triton CPU interpreter, bf16 as on the GPU (the
kernel rounds its fp32 result itself there: the interpreter's bf16 cast truncates), and its routing
(Fusion.FEW_TOKEN_LINEAR) in the model. GPU twin at 20b shapes: tests/kernels/test_gemv_gpu.py.

  * parity with an fp32 reference (one rounding: within half a bf16 ulp + fp32 slack) for M 1, 3, 16,
    N and K off the block sizes, with and without bias, one split (one launch) and several;
  * every split gives the same answer up to fp32 order, and one config gives the same bits on every call;
  * the split heuristic at the real shapes and its invariants;
  * the model: few-token steps take the kernel when the switch is on (and nothing else does), greedy
    tokens equal with it off.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.gemv import DEFAULT_CONFIG, GemvConfig, few_token_linear, split_k  # noqa: E402

SMALL = GemvConfig(block_n=32, block_k=32)  # tiny tiles: several N tiles and K tiles on tiny shapes


def _case(m: int, n: int, k: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    ref = x.float() @ w.float().T + (b.float() if bias else 0.0)  # [M, N] fp32
    return x, w, b, ref


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    # one rounding of an fp32 sum: half a bf16 ulp (2^-8 relative at worst) + the fp32 order's slack
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-4)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split", [1, 3, None])
def test_parity_with_fp32_reference(m, bias, split):
    x, w, b, ref = _case(m, 72, 200, bias, seed=m)  # N = 2.25 x 32, K = 6.25 x 32
    cfg = GemvConfig(block_n=32, block_k=32, split=split)
    y = few_token_linear(x, w, b, cfg)
    _close(y, ref)
    assert torch.equal(y, few_token_linear(x, w, b, cfg))  # deterministic: the same bits on every call


@pytest.mark.parametrize("rows,block_k", [(1, 16), (4, 32), (16, 64), (0, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_one_token_whole_rows(rows, block_k, bias):
    """One token on _gemv_rows_kernel (rows_t1 whole rows per program; 0: the MMA path): fp32 reference parity with a
    partial last K step and N tile, the same bits on every call, a strided x row."""
    x, w, b, ref = _case(1, 72, 200, bias, seed=rows + 1)  # K = 200: 12.5 x 16, 6.25 x 32, 3.125 x 64
    cfg = GemvConfig(block_n=32, block_k=32, rows_t1=rows, block_k_t1=block_k)
    y = few_token_linear(x, w, b, cfg)
    _close(y, ref)
    assert torch.equal(y, few_token_linear(x, w, b, cfg))
    wide = torch.zeros(2, 230, dtype=torch.bfloat16)
    wide[1, 17:217] = x[0]
    assert torch.equal(few_token_linear(wide[1:, 17:217], w, b, cfg), y)


def test_splits_and_strided_x_agree():
    """Every split count (1 = the one-launch path, up to one K tile per split) and a strided x row."""
    x, w, b, ref = _case(5, 40, 112, True, seed=7)
    ys = [few_token_linear(x, w, b, GemvConfig(block_n=16, block_k=16, split=s)) for s in (1, 2, 4, 7, 50)]
    for y in ys:
        _close(y, ref)
    wide = torch.zeros(5, 130, dtype=torch.bfloat16)
    wide[:, 9:121] = x
    xs = wide[:, 9:121]  # stride(0) = 130
    assert torch.equal(few_token_linear(xs, w, b, GemvConfig(block_n=16, block_k=16, split=4)), ys[2])


def test_default_config_and_edges():
    x, w, b, ref = _case(2, 24, 40, True, seed=3)
    _close(few_token_linear(x, w, b), ref)  # the default tiles (64 x 128) over a smaller W
    assert few_token_linear(x[:0], w, b).shape == (0, 24)
    with pytest.raises(AssertionError):
        few_token_linear(torch.zeros(17, 40, dtype=torch.bfloat16), w, b)
    with pytest.raises(AssertionError):
        few_token_linear(x.float(), w.float(), None)


def test_split_heuristic():
    sms = 132
    # 20b's QKV [5120, 2880] and O [2880, 4096] with the default 64 x 128 tiles: 80 and 45 N tiles
    assert split_k(5120, 2880, DEFAULT_CONFIG, sms) == (8, 3)  # 640 programs: 4.8 per SM
    assert split_k(2880, 4096, DEFAULT_CONFIG, sms) == (16, 2)  # 720: 5.5 per SM
    assert split_k(5120, 2880, DEFAULT_CONFIG, 1) == (1, 23)  # the interpreter: one program per N tile
    for n, k in [(5120, 2880), (2880, 4096), (640, 2880), (2880, 512), (100, 100), (1 << 16, 128)]:
        for cfg in (DEFAULT_CONFIG, SMALL, GemvConfig(waves=8)):
            s, per = split_k(n, k, cfg, sms)
            k_tiles = -(-k // cfg.block_k)
            assert 1 <= s <= k_tiles and (s - 1) * per < k_tiles <= s * per  # none empty, all covered
            n_tiles = -(-n // cfg.block_n)
            assert n_tiles * s >= cfg.waves * sms or s == k_tiles  # the SMs filled, or K cannot split further
    assert split_k(100, 1000, GemvConfig(block_k=100, split=3), sms) == (3, 4)  # explicit: 4 + 4 + 2 tiles
    assert split_k(100, 1000, GemvConfig(block_k=100, split=40), sms) == (10, 1)  # never an empty split


# ---- the model: routing and greedy tokens ------------------------------------------------------------
def test_model_routes_few_token_steps(ckpt_factory, one_torch_thread, monkeypatch):
    """tiny-a in bf16 (torch attention, norms and MoE: the interpreter's bf16 arithmetic is not exact, and
    the kernel upcasts before any), the kernel in the interpreter standing for the GPU: a 20-token prefill
    (too many tokens: addmm), then greedy decodes, with the switch off and on. On, each decode's 4 layers
    x (QKV, O) take the kernel; the tokens are the same."""
    from kernels import gemv
    from kernels.registry import Backends, make_attention, make_linear, make_moe, parse_fusions
    from model.context import SeqStep, build_step_meta
    from model.gpt_oss import GptOss
    from model.kv_cache import KVManager, KVPool, SeqPages, plan_kv_cache
    from model.loader import load_weights
    from model.weights import SafetensorsSource

    calls = []
    real = gemv.few_token_linear
    monkeypatch.setattr(gemv, "few_token_linear", lambda x, w, b=None, cfg=gemv.DEFAULT_CONFIG:
                        calls.append(x.shape[0]) or real(x, w, b, cfg))
    src = SafetensorsSource(ckpt_factory("tiny-a"))
    be = Backends(make_attention("torch"), make_linear("torch"), make_moe("torch"))
    model = GptOss(src.config, be, dtype=torch.bfloat16)
    load_weights(model, src, progress=False)
    spec = plan_kv_cache(model.cfg, 1 << 20, page_size=4, max_num_seqs=1, dtype=torch.bfloat16)
    prompt = torch.randint(0, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    tokens, counts = {}, {}
    for setting in ("rope_store", "rope_store+gemv"):
        be.fusions = parse_fusions(setting)
        calls.clear()
        mgr, pool, pages = KVManager(spec), KVPool(spec), SeqPages()
        ids, pos, out = prompt, 0, []
        for _ in range(5):
            mgr.grow(pages, pos + len(ids))
            hidden = model(ids, build_step_meta([SeqStep(pages, pos, len(ids))], spec), pool)
            pos += len(ids)
            ids = model.compute_logits(hidden[-1:]).argmax(-1)  # [1]
            out.append(int(ids))
        tokens[setting], counts[setting] = out, list(calls)
    assert counts["rope_store"] == []
    assert counts["rope_store+gemv"] == [1] * (4 * 2 * 4)  # 4 decodes x 4 layers x (QKV, O); not the prefill
    assert tokens["rope_store+gemv"] == tokens["rope_store"], tokens


def test_routing_decision():
    from kernels.registry import Backends, Fusion, parse_fusions

    from kernels import gemv

    assert gemv.INTERPRETED  # this file set TRITON_INTERPRET before importing the kernels
    be = Backends(None, None, None, fusions=parse_fusions("gemv"))
    assert Fusion.FEW_TOKEN_LINEAR in parse_fusions("rope_store+gemv")
    assert Fusion.FEW_TOKEN_LINEAR in parse_fusions("on")
    assert be.few_token_linear(1, True, True)
    assert not be.few_token_linear(2, True, True)  # larger steps: the linear backend's GEMM (the MMA path lost)
    assert not be.few_token_linear(17, True, True)
    assert not be.few_token_linear(1, False, True)  # FP8 (or fp32) weights: the linear backend
    assert not be.few_token_linear(1, True, False)  # CPU tensors without the interpreter
    be.fusions = parse_fusions("rope_store")
    assert not be.few_token_linear(1, True, True)  # off: everything as before
