"""benchmarks/step_trace_summary.py: the loop figures NOTES quote, from a step trace."""

from __future__ import annotations

import gzip
import json

from benchmarks.step_trace_summary import load, main, summarize


def _rows() -> list[dict]:
    rows = []
    for no in range(1, 11):
        mixed = no % 5 == 0
        row = {"step": no, "t": no * 0.01, "seqs": 4, "tokens": 300 if mixed else 4, "chunks": int(mixed),
               "launch_ms": 9.0 if mixed else 2.0, "wait_ms": 1.0, "collected": no - 1 if no > 1 else None,
               "collected_gpu_ms": (17.0 if (no - 1) % 5 == 0 else 11.0) if no > 1 else None,
               "collected_first": no == 3}
        if no in (4, 5, 7):
            row["hold_ms"] = 3.0
        rows.append(row)
    rows.append({"step": 0, "t": 0.2, "seqs": 0, "tokens": 0, "chunks": 0, "launch_ms": 0, "wait_ms": 5.0,
                 "collected": 10, "collected_gpu_ms": 17.0, "collected_first": False})
    return rows


def test_summary_attributes_gpu_spans_to_the_collected_step_and_counts_holds():
    s = summarize(_rows(), skip=0.0)
    assert s["steps"] == 10 and s["steps_per_s"] == 100.0 and s["collected_first"] == 1
    assert s["decode"]["n"] == 8 and s["mixed"]["n"] == 2
    assert s["decode"]["gpu_ms_p50"] == 11.0 and s["mixed"]["gpu_ms_p50"] == 17.0  # steps 5 and 10 were mixed
    rows = [dict(r, collected_gpu_ms=30.0) if r["collected"] == 10 else r for r in _rows()]
    spans = summarize(rows, 0)
    assert spans["mixed"]["gpu_ms_p50"] == 23.5  # step 10's span, collected by the final collect-only iteration
    assert s["mixed"]["launch_ms_p50"] == 9.0 and s["decode"]["launch_ms_p50"] == 2.0
    assert s["held"] == {"n": 3, "hold_ms_p50": 3.0, "mixed_from_a_hold": 1}
    assert summarize(_rows(), skip=0.5)["steps"] == 5


def test_cli_reads_gzipped_traces(tmp_path, capsys):
    path = tmp_path / "decode-steps-1.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows())
    assert len(load(path)) == 11
    assert main([str(path), "--skip", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(str(path)) and json.loads(out.split(": ", 1)[1])["mixed"]["n"] == 2
