"""The default MoE backend (kernels/registry.py): DeepGEMM only where it runs whole FP8 experts on a
Hopper GPU with its toolchain, Triton otherwise, and the reason is said; the worker flags reach it."""

from __future__ import annotations

import argparse

import pytest
import torch

from kernels import deepgemm_sm90 as dg
from kernels.registry import auto_moe_backend, default_moe_backend


@pytest.mark.parametrize("gpu,fp8,whole,missing,want", [
    (False, True, True, None, "torch"),
    (True, False, True, None, "triton"),
    (True, True, False, None, "triton"),  # TP-sharded experts
    (True, True, True, "nvcc not found", "triton"),
    (True, True, True, None, "deepgemm"),
])
def test_default_moe_backend_policy(gpu, fp8, whole, missing, want):
    name, why = default_moe_backend(gpu, fp8, whole, missing)
    assert name == want and why
    if missing:
        assert missing in why


def test_auto_probes_deepgemm_only_where_it_could_be_chosen(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(dg, "unavailable_reason", lambda cfgs, dev: calls.append(dev) or "no headers")
    with caplog.at_level("INFO", logger="kernels.registry"):
        assert auto_moe_backend("cpu", True, True) == "torch"
        assert auto_moe_backend("cuda:1", True, False) == "triton"
        assert calls == []
        assert auto_moe_backend("cuda:1", True, True) == "triton"
    assert calls == [torch.device("cuda:1")]
    assert "DeepGEMM unavailable: no headers" in caplog.text
    monkeypatch.setattr(dg, "unavailable_reason", lambda cfgs, dev: None)
    assert auto_moe_backend("cuda:0", True, True) == "deepgemm"


def test_unavailable_reason_on_cpu():
    assert dg.unavailable_reason([], torch.device("cpu")) == "not a CUDA device"


def test_worker_flags_pick_the_default_per_rank(monkeypatch):
    from engine import worker_args
    seen = []
    monkeypatch.setattr(worker_args, "auto_moe_backend", lambda dev, fp8, whole: seen.append((dev, fp8, whole)) or "x")
    p = argparse.ArgumentParser()
    worker_args.add_worker_args(p, port=1, metrics_port=0)
    cfg = worker_args.engine_config(p.parse_args(["--device", "cuda", "--fp8", "--tp", "4", "--moe-mode", "ep"]),
                                    tp_rank=2)
    assert cfg.moe_backend == "x" and seen == [("cuda:2", True, True)]
    cfg = worker_args.engine_config(p.parse_args(["--device", "cuda", "--fp8", "--tp", "2"]), tp_rank=1)
    assert seen[-1] == ("cuda:1", True, False)
    cfg = worker_args.engine_config(p.parse_args(["--device", "cuda", "--moe-backend", "triton"]))
    assert cfg.moe_backend == "triton" and len(seen) == 2  # an explicit choice is not second-guessed


def _hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(dg, "_num_sms", lambda index: 132)


def test_unavailable_reason_names_what_is_missing(monkeypatch, tmp_path):
    _hopper(monkeypatch)
    monkeypatch.setenv("TANDEM_DEEPGEMM_INCLUDE", str(tmp_path / "nowhere"))
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    cfg = dg.DgConfig(128, 128)
    monkeypatch.setattr(dg, "include_dir", lambda: (_ for _ in ()).throw(dg.ConfigError("DeepGEMM headers not found")))
    assert dg.unavailable_reason([cfg], torch.device("cuda:0")) == "DeepGEMM headers not found"
    monkeypatch.setattr(dg, "include_dir", lambda: tmp_path)
    monkeypatch.setattr(dg, "_nvcc", lambda: (_ for _ in ()).throw(dg.ConfigError("nvcc not found (set NVCC)")))
    monkeypatch.setattr(dg, "library_path", lambda c, n, build=True: dg._nvcc())
    assert dg.unavailable_reason([cfg], torch.device("cuda:0")).startswith("nvcc not found")
    monkeypatch.setattr(dg, "library_path", lambda c, n, build=True: tmp_path / "broken.so")
    (tmp_path / "broken.so").write_bytes(b"not an ELF")  # a launcher that does not load
    dg._load.cache_clear()
    assert "broken.so" in dg.unavailable_reason([cfg], torch.device("cuda:0"))
    dg._load.cache_clear()
    assert dg.unavailable_reason([cfg], torch.device("cpu")) == "not a CUDA device"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "SM90" in dg.unavailable_reason([cfg], torch.device("cuda:0"))
