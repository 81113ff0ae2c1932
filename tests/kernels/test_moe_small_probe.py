"""benchmarks/moe_small_probe.py's bare weight stream (the few-token MoE's grid and TMA boxes without its routing and
epilogue) sums every weight of its boxes, in the experts' own layout and in the tiled copy (tiled()), on the CPU
interpreter, and its copy of gate_up's K loop computes the routed experts' product: the probe times what it claims
to read."""

import torch

from benchmarks import moe_small_probe as probe


def test_stream_sums_both_layouts_and_the_loop_products():
    """The stream's sums in both layouts; gate_up's K loop with and without the kernel's preamble against fp32."""
    probe.smoke()


def test_tiled_layout_puts_each_box_in_one_contiguous_run():
    e, n, k, bn = 2, 48, 272, 16
    w = torch.randint(0, 0x40, (e, n, k), dtype=torch.uint8).view(torch.float8_e4m3fn)
    t = probe.tiled(w, bn).view(torch.uint8)
    kb = -(-k // probe.BK)
    assert t.shape == (e * (n // bn) * kb, bn, probe.BK)
    box = t[(1 * (n // bn) + 2) * kb + 1]  # expert 1, N tile 2, K box 1
    assert torch.equal(box, w.view(torch.uint8)[1, 2 * bn:3 * bn, probe.BK:2 * probe.BK])
    tail = t[kb - 1]  # the last K box of expert 0's first tile: k's tail, then zeros
    assert torch.equal(tail[:, :k % probe.BK], w.view(torch.uint8)[0, :bn, (kb - 1) * probe.BK:])
    assert not tail[:, k % probe.BK:].any()
