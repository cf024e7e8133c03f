"""`lowmem-ft report RUN_DIR` redraws memory.png from memory.jsonl; a wrong directory is one line, exit 2."""

from __future__ import annotations

import json

from lowmem_ft import cli


def test_report_redraws_plot_and_prints_summary(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"event": "start", "step": 0, "predicted_peak_gb": 1.0, "budget_gb": 8, "safety_margin_gb": 1},
        {"step": 1, "phase": "forward", "rss_gb": 0.5},
        {"step": 1, "phase": "optimizer", "rss_gb": 0.7},
    ]
    (run / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "measured peak 0.70 GB (host RSS) in optimizer of step 1" in out
    assert f"plot: {run / 'memory.png'}" in out
    assert (run / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_report_of_a_directory_without_memory_log(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowmem-ft report: error:") and "no memory.jsonl" in err and "\n" not in err
