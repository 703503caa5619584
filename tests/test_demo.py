"""The demo's workload and claim logic: the shift is invisible to FP32, verdicts follow the measurements."""

from __future__ import annotations

import math

import pytest
import torch

from lossscale.demo import _apis, claims as C
from lossscale.demo.workload import RunResult, RunSpec, TrainConfig, load_digits_data, reference_grads, train

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def data():
    return load_digits_data(0)


@pytest.fixture(autouse=True)
def one_thread():
    """As the demo does: 64-wide matrices gain nothing from a second thread, and lose a lot on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _steps(run: RunResult, key: str):
    return [s[key] for s in run.steps]


def test_the_shift_leaves_fp32_training_bitwise_unchanged(data):
    runs = [train(RunSpec("fp32", "FP32", fp16=False), TrainConfig(epochs=1, shift_log2=k), data) for k in (0, 20)]
    assert _steps(runs[0], "loss") == _steps(runs[1], "loss")
    assert runs[0].final_acc == runs[1].final_acc
    assert runs[0].unchanged_frac == runs[1].unchanged_frac


def test_the_shift_moves_fp16_gradients_off_the_cliff(data):
    cfg = TrainConfig(shift_log2=20)
    ref = reference_grads(cfg, data)
    fp16 = reference_grads(cfg, data, fp16=True)
    scaled = reference_grads(cfg, data, fp16=True, scale=2.0**20)
    assert C.lost_fraction(ref, fp16) > 0.99
    assert C.lost_fraction(ref, scaled) < 0.01
    # Unshifted, FP16 keeps nearly everything even without scaling.
    assert C.lost_fraction(reference_grads(TrainConfig(shift_log2=0), data),
                           reference_grads(TrainConfig(shift_log2=0), data, fp16=True)) < 0.05


def test_runspec_validates_clip_order():
    with pytest.raises(ValueError, match="clip="):
        RunSpec("x", "x", clip="sometimes")
    with pytest.raises(ValueError, match="make_scaler"):
        RunSpec("x", "x", clip="clip_scaled")


def test_clip_runs_record_norms(data):
    import lossscale

    spec = RunSpec("w", "w", make_scaler=lambda: lossscale.GradScaler("cpu", policy="static", init_scale=2.0**10),
                   clip="clip_scaled", epochs=1)
    run = train(spec, TrainConfig(epochs=1), data)
    assert all(s["clip_fired"] for s in run.steps)
    ratios = [s["applied_norm"] / s["true_norm"] for s in run.steps]
    assert max(ratios) < 2.0**-6  # crushed by about the scale


def test_lost_fraction_counts_only_lost_nonzero_entries():
    ref = {"w": torch.tensor([0.0, 1.0, 2.0, 3.0])}
    got = {"w": torch.tensor([0.0, 0.0, 2.0, 0.0])}
    assert C.lost_fraction(ref, got) == pytest.approx(2 / 3)
    assert C.lost_fraction({"w": torch.zeros(3)}, {"w": torch.zeros(3)}) == 0.0


def test_scale_moves_and_envelope():
    assert C.scale_moves([1, 2, 4, 2, 2, 4]) == (1, 3)
    assert C.overflow_envelope([8.0, None, 4.0, 16.0, None], 2) == [8.0, 8.0, 4.0, 4.0, 16.0]
    assert C.overflow_envelope([None, None], 3) == [None, None]


def test_roundtrip_is_exact_only_for_powers_of_two():
    g = torch.randn(10000) * 1e-9
    assert C._roundtrip_mismatch(g, 2.0**16) == 0.0
    assert C._roundtrip_mismatch(g, 1e5) > 0.05


def test_c1_is_measured_from_formats_and_torch_casts():
    r = C.c1_fp16_facts()
    assert r.verdict == C.HELD
    assert r.figures["cast_flush_threshold"] == 0.0
    assert r.figures["cast_above_flush_threshold"] == 2.0**-24
    assert math.isinf(r.figures["cast_overflow_threshold"])


def test_c1_is_pending_without_formats(monkeypatch):
    monkeypatch.setattr(_apis, "formats", lambda: None)
    r = C.c1_fp16_facts()
    assert r.verdict == C.PENDING and r.waiting_on == ["formats"]


def test_verdict_logic():
    r = C.ClaimResult("C9", "t", "c")
    assert r.verdict == C.PENDING  # nothing checked yet
    r.check("a", True, "")
    assert r.verdict == C.HELD
    r.check("b", None, "", waits_on="stats")
    assert r.verdict == C.PENDING and r.waiting_on == ["stats"]
    r.check("c", False, "")
    assert r.verdict == C.NOT_HELD
    assert r.to_dict()["verdict"] == C.NOT_HELD


def _fake_run(name, acc, steps=4, **step_fields):
    run = RunResult(name, name)
    run.steps = [{"step": i, "loss": 1.0, "loss_scale": 1.0, "skipped": False, **step_fields} for i in range(steps)]
    run.epochs = [{"epoch": 0, "step": steps, "train_loss": 1.0, "test_acc": acc}]
    run.final_acc = acc
    run.unchanged_frac = 0.0
    return run


def test_c2_is_not_held_when_fp16_learns_anyway():
    ref = {"w": torch.tensor([1e-9, 1e-3])}
    r = C.c2_underflow_stalls(TrainConfig(), _fake_run("fp32", 0.97), _fake_run("noscale", 0.96), ref,
                              {"w": torch.tensor([0.0, 1e-3])}, chance=0.1)
    assert r.verdict == C.NOT_HELD
    assert [c.passed for c in r.checks] == [True, False, False]


def test_c4_verdict_follows_the_clip_measurements():
    right = _fake_run("r", 0.95, clip_fired=False, true_norm=1.0, applied_norm=1.0)
    wrong = _fake_run("w", 0.10, clip_fired=True, true_norm=1.0, applied_norm=1e-5)
    assert C.c4_clip_order(_fake_run("fp32", 0.96), right, wrong, 2.0**16, 1.0).verdict == C.HELD
    mild = _fake_run("w", 0.90, clip_fired=True, true_norm=1.0, applied_norm=0.5)
    assert C.c4_clip_order(_fake_run("fp32", 0.96), right, mild, 2.0**16, 1.0).verdict == C.NOT_HELD


def test_histogram_reads_binades_and_shifts_with_the_scale():
    stats = _apis.stats()
    if stats is None:
        pytest.skip("lossscale.stats not in this build")
    gs = stats.grad_stats([torch.tensor([2.0**-30, 1.5 * 2.0**-30, 1.0, 0.0, float("inf")])], scale=1.0)
    assert _apis.histogram(gs) == {-30: 2, 0: 1}
    assert _apis.histogram(gs.at(2.0**10)) == {-20: 2, 10: 1}
    assert _apis.nonzero_frac(gs) == pytest.approx(2 / 3)  # both 2^-30 values flush, 1.0 does not


def test_demo_reports_pending_when_optional_apis_are_missing(monkeypatch, tmp_path):
    """Without stats/hooks/telemetry/adaptive the demo still runs; what needs them is PENDING, not faked."""
    from lossscale.demo import run

    for name in ("stats", "hooks", "telemetry_kwargs"):
        monkeypatch.setattr(_apis, name, lambda: None)
    monkeypatch.setattr(_apis, "adaptive_available", lambda: False)
    summary = run.run_demo(str(tmp_path), quick=True, progress=False, log=lambda line: None, epochs=2,
                           sweep_log2=(0, 16, 40), sweep_epochs=1)
    claims = summary["claims"]
    assert claims["C5"]["verdict"] in ("PENDING", "NOT HELD") and "stats" in claims["C5"]["waiting_on"]
    # (A 3-epoch run may fail other checks; the point is that these are not decided without their APIs.)
    pending = {c["name"] for c in claims["C6"]["checks"] if c["passed"] is None}
    assert pending == {"and hovers just below it", "the adaptive policy beats torch's default"}
    assert set(claims["C6"]["waiting_on"]) == {"telemetry", "adaptive"}
    assert "adaptive" not in summary["runs"]
    assert "flushed_frac" not in claims["C5"]["figures"]
    assert (tmp_path / "index.html").is_file() and not (tmp_path / "layer_flush.png").exists()
    assert "Pending" in (tmp_path / "index.html").read_text()
