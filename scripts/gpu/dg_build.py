"""Builds the DeepGEMM launchers the default GPU paths load (on a machine with nvcc; the GPU runs
carry them as .cache/dgcarry, scripts/pack_deepgemm_carry.sh): the MoE's grouped GEMMs and the dense
linears of gpt-oss-20b/120b at TP1 and TP2 (both ranks), whose N and K are compiled in. Sets already
built are reused (the cache key covers source, flags and DeepGEMM version)."""
from __future__ import annotations

import time

from engine.build import dense_shapes
from kernels import deepgemm_linear as dl
from kernels import deepgemm_sm90 as dg
from kernels import moe_dg
from kernels.registry import make_backends
from model.config import preset
from model.gpt_oss import GptOss
from model.parallel import ParallelConfig

H200_SMS = 132


def main() -> None:
    shapes = []
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        for tp, rank in ((1, 0), (2, 0), (2, 1)):
            model = GptOss(preset(name), make_backends("torch", "torch", "torch"), fp8=True, device="meta",
                           parallel=ParallelConfig(tp_size=tp, tp_rank=rank))
            shapes += dense_shapes(model)
    cfgs = [moe_dg.GATE_UP, moe_dg.DOWN, *dl.launcher_configs(dict.fromkeys(shapes))]
    for cfg in dict.fromkeys(cfgs):
        t0 = time.time()
        path = dg.library_path(cfg, H200_SMS)
        print(f"{cfg} {path.name} {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
