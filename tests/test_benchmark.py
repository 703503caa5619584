"""The benchmark script runs end to end (a smoke test: tiny sizes, nothing timed is asserted)."""

import importlib.util
import json
import os
import subprocess
import sys

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


def test_compat_picks_the_ends_of_each_range_and_writes_its_table(tmp_path, monkeypatch):
    # No venv is made and nothing is downloaded: the release list is given, the doc is a copy.
    spec = importlib.util.spec_from_file_location("compat", os.path.join(HERE, "..", "benchmarks", "compat.py"))
    compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compat)
    from packaging.requirements import Requirement
    from packaging.version import Version

    monkeypatch.setattr(compat, "released", lambda name: [Version(v) for v in ("0.9", "1.0.0", "1.4.2", "2.0")])
    assert compat.ends(Requirement("x>=1.0,<2")) == [Version("1.0.0"), Version("1.4.2")]
    assert set(compat.frameworks()) >= {"accelerate", "transformers", "lightning"}
    assert all(name in compat.TESTS for name in compat.frameworks())  # every framework has its tests named
    doc = tmp_path / "integrations.md"
    doc.write_text(f"before\n{compat.BEGIN}\nold\n{compat.END}\nafter\n")
    monkeypatch.setattr(compat, "DOC", str(doc))
    compat.write_doc(compat.table([("x", Version("1.0.0"), ">=1.0,<2", False, "1 failed, 3 passed")]))
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| x | 1.0.0 | `>=1.0,<2` | **failed** | 1 failed, 3 passed |" in text


def test_bench_iteration_smoke(tmp_path):
    bench = _run("bench_iteration", ["--quick", "--pairs", "2", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "bench_iteration_quick.json").read_text())
    rows = results["rows"]
    assert len(rows) == len(bench.OPTIMIZERS) * len(bench.CLIPS) * 2
    assert all(r["ratio"] > 0 and r["optimizer_side_ratio"] > 0 for r in rows)
    # Syncs are counts, not timings: these hold on any machine.
    assert all(r["syncs"]["lossscale"] <= r["syncs"]["torch"] for r in rows)
    assert all(r["syncs"]["lossscale"] == 0 for r in rows if r["optimizer"] == "adamw_fused")
    assert "| gpt2 | adamw_fused | own clip |" in (tmp_path / "bench_iteration_quick.md").read_text()


def test_bench_beyond_smoke(tmp_path):
    bench = _run("bench_beyond", ["--quick", "--pairs", "1", "--out", str(tmp_path)])
    rows = {r["row"]: r for r in json.loads((tmp_path / "bench_beyond_quick.json").read_text())["rows"]}
    assert set(rows) == set(bench.ROWS) and all(r["ratio"] > 0 for r in rows.values())
    # Syncs are counts: one read per micro-batch for the drop, none for the others (fused AdamW).
    assert rows["bad_microbatch='drop'"]["syncs"] == {"feature": bench.MICRO_BATCHES, "default": 0}
    assert all(r["syncs"] == {"feature": 0, "default": 0} for name, r in rows.items() if "drop" not in name)
    assert json.loads((tmp_path / "bench_beyond_quick.json").read_text())["check_setup_ms"] > 0


def test_bench_moe_clip_smoke(tmp_path):
    # Its own process: the ranks it spawns import the script by name, which _run's loading does not give.
    script = os.path.join(HERE, "..", "benchmarks", "bench_moe_clip.py")
    subprocess.run([sys.executable, script, "--quick", "--pairs", "2", "--out", str(tmp_path)], check=True, timeout=120)
    result = json.loads((tmp_path / "bench_moe_clip_quick.json").read_text())
    assert result["ratio"] > 0 and result["meta"]["ranks"] == 2
    assert "expert_parallel=(experts, group)" in (tmp_path / "bench_moe_clip_quick.md").read_text()


def test_bench_optimizer_side_smoke(tmp_path):
    _run("bench_optimizer_side", ["--quick", "--out", str(tmp_path)])
    text = (tmp_path / "optimizer_side_quick.md").read_text()
    for kind in ("adamw_foreach", "adamw_fused", "sgd"):
        assert f"| {kind} | lossscale |" in text and f"| {kind} | torch |" in text


def test_gpu_check_says_so_without_cuda(capsys):
    if torch.cuda.is_available():
        return
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(HERE, "..", "benchmarks", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main([]) == 2 and "no CUDA device" in capsys.readouterr().err
