"""The results report's target verdicts (benchmarks/report_targets.py) on small synthetic JSON: every
recorded target finds its row, one goal per GEMM shape / MoE size is met when any backend meets it,
and the committed result folders render without a 'row not found'."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.report import load, render
from benchmarks.report_targets import kernel_targets, missed_goals

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _gemm_doc() -> dict:
    rows = [{"shape": s, "M": 8192, "backend": b, "TFLOPs": v}
            for s, b, v in [("qkv", "scaled_mm", 950.0), ("qkv", "deepgemm gemm+bias (fp8 in)", 1160.0),
                            ("o", "scaled_mm", 980.0), ("o", "deepgemm gemm+bias (fp8 in)", 998.0)]]
    return {"rows": rows, "targets": {f"dense_fp8_bias_M8192_{r['shape']}_{r['backend']}_TFLOPs>=1100": r["TFLOPs"] >= 1100
                                      for r in rows}}


def _moe_doc() -> dict:
    rows = [{"model": "20b", "T": 8192, "backend": b, "pct_fp8_peak": v} for b, v in [("triton_fp8", 42.0),
                                                                                      ("deepgemm_fp8", 60.2)]]
    rows.append({"model": "120b", "T": 1, "backend": "triton_fp8", "pct_copy_bw": 58.0})
    return {"rows": rows, "targets": {"moe_20b_T8192_triton_fp8_pct_fp8_peak>=50": False,
                                      "moe_20b_T8192_deepgemm_fp8_pct_fp8_peak>=50": True,
                                      "moe_120b_T1_pct_copy_bw>=60": False}}


def test_goals_per_shape_and_size_met_by_any_backend():
    targets = kernel_targets({"kernels_gemm.json": _gemm_doc(), "kernels_moe.json": _moe_doc()})
    assert len(targets) == 7 and not any("not found" in t.value for t in targets)
    missed = {t.group: t for t in missed_goals(targets)}
    assert set(missed) == {"dense_fp8_bias_M8192_o", "moe_120b_T1"}
    assert missed["dense_fp8_bias_M8192_o"].value.startswith("998.0")  # the closest backend is shown


def test_old_keys_without_shape_or_backend_still_resolve():
    doc = _gemm_doc()
    doc["targets"] = {"dense_fp8_bias_M8192_scaled_mm_TFLOPs>=1100": False}  # 2026-11-30: QKV implied
    (t,) = kernel_targets({"kernels_gemm.json": doc})
    assert t.value.startswith("950.0") and t.group == "dense_fp8_bias_M8192_qkv"


def test_a_verdict_that_disagrees_with_its_row_is_flagged():
    doc = _gemm_doc()
    doc["targets"] = {"dense_fp8_bias_M8192_o_scaled_mm_TFLOPs>=1100": True}
    (t,) = kernel_targets({"kernels_gemm.json": doc})
    assert "disagrees" in t.value


@pytest.mark.parametrize("folder", sorted(p.name for p in RESULTS.iterdir() if p.is_dir()))
def test_committed_results_render(folder: str):
    docs = load(RESULTS / folder)
    text, _, _ = render(RESULTS / folder, docs, [])
    assert "row not found" not in text and text == render(RESULTS / folder, docs, [])[0]


def _model_doc(preset: str, ms: float) -> dict:
    return {"args": {"preset": preset, "attention": "flashinfer"}, "world": 1,
            "prefill": {"rows": [{"tokens": 8192, "ms": ms, "TFLOPs": 1.0, "ratio_fp8_peak": 0.1,
                                  "tokens_per_s_per_gpu": 1.0, "usd_per_M_input": 0.01}]}}


def test_merged_page_keeps_the_newest_of_each_kind(tmp_path):
    import json

    from benchmarks.report import dated_folders, load_merged
    old, new = tmp_path / "2026-11-30", tmp_path / "2026-12-01"
    for folder, files in ((old, {"kernels_gemm.json": _gemm_doc(), "x2_kv_transfer.json": {"args": {}, "rows": []},
                                 "a_model.json": _model_doc("gpt-oss-20b", 138.0),
                                 "b_model.json": _model_doc("gpt-oss-120b", 170.0)}),
                          (new, {"kernels_gemm.json": _gemm_doc(), "c_model.json": _model_doc("gpt-oss-20b", 89.0),
                                 "d_model.json": _model_doc("gpt-oss-20b", 90.0)})):
        folder.mkdir()
        for name, doc in files.items():
            (folder / name).write_text(json.dumps(doc))
    assert dated_folders(tmp_path) == [new, old]
    docs, origin = load_merged(dated_folders(tmp_path))
    # same name: the newer file; same model configuration: the newer folder's runs (both of them);
    # kinds only the older folder has: kept, with their folder
    assert origin == {"kernels_gemm.json": new.name, "c_model.json": new.name, "d_model.json": new.name,
                      "x2_kv_transfer.json": old.name, "b_model.json": old.name}
    text, _, _ = render(tmp_path, docs, [], origin)
    assert f"`{old.name}/b_model.json`" in text and "a_model.json" not in text and "138" not in text
