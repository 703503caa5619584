"""The benchmark script runs end to end (a smoke test: tiny sizes, nothing timed is asserted)."""

import importlib.util
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def test_bench_scaler_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_scaler", os.path.join(HERE, "..", "benchmarks", "bench_scaler.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        bench.main(["--quick", "--sizes", "4000x4", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "bench_scaler_quick.json").read_text())
    size = results["sizes"][0]
    assert set(bench.GOALS) <= set(size["rows"])
    assert all(r["ratio"] > 0 for r in size["rows"].values())
    # Syncs are counts, not timings: these hold on any machine.
    assert size["syncs"]["fused_adam clip"] == {"torch": 0, "lossscale": 0}
    assert size["syncs"]["sgd clip"]["lossscale"] <= size["syncs"]["sgd clip"]["torch"]
    assert "| clip |" in (tmp_path / "bench_scaler_quick.md").read_text()


def test_bench_host_smoke(capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_host", os.path.join(HERE, "..", "benchmarks", "bench_host.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        bench.main(["--sweep-mb", "1", "--repeats", "3"])
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| warm") or "sweep" in line]
    assert len(rows) == 2 and all(float(r.split("|")[4]) > 0 for r in rows)  # the ratio column
