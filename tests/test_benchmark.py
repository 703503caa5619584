"""The benchmark script runs end to end (a smoke test: tiny sizes, nothing timed is asserted)."""

import importlib.util
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(name: str, argv):
    """Load ``benchmarks/<name>.py`` and run its ``main(argv)``; torch's thread count is put back."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "..", "benchmarks", f"{name}.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    return bench


def test_bench_scaler_smoke(tmp_path):
    bench = _run("bench_scaler", ["--quick", "--sizes", "4000x4", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "bench_scaler_quick.json").read_text())
    size = results["sizes"][0]
    assert set(bench.GOALS) <= set(size["rows"])
    assert all(r["ratio"] > 0 for r in size["rows"].values())
    # Syncs are counts, not timings: these hold on any machine.
    assert size["syncs"]["fused_adam clip"] == {"torch": 0, "lossscale": 0}
    assert size["syncs"]["sgd clip"]["lossscale"] <= size["syncs"]["sgd clip"]["torch"]
    assert "| clip |" in (tmp_path / "bench_scaler_quick.md").read_text()


def test_bench_host_smoke(capsys):
    _run("bench_host", ["--sweep-mb", "1", "--repeats", "3"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| warm") or "sweep" in line]
    assert len(rows) == 2 and all(float(r.split("|")[4]) > 0 for r in rows)  # the ratio column
