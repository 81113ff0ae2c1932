"""Profiler ranges that cost nothing when no profiler records.

`torch.profiler.record_function` enters the dispatcher even with no profiler running (~5 us on this CPU, more
on a loaded serving host): a piecewise mixed step opened 53 of them per launch (mixed-host-profile-1, H100:
~0.5 ms of a ~10 ms launch by cProfile). `label(name)` opens one only while a profiler is on
(benchmarks/profile_decode.py, mixed_step.py --profile), so the traces keep their names.
"""

from __future__ import annotations

import contextlib

import torch

_NONE = contextlib.nullcontext()  # reusable: enter and exit do nothing
_enabled = torch._C._autograd._profiler_enabled  # ~0.03 us; True while torch.profiler (or autograd's) records


def label(name: str):
    """A named profiler range (record_function) while a profiler records, else a no-op context."""
    return torch.profiler.record_function(name) if _enabled() else _NONE
