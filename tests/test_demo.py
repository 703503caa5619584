"""The demo's workload and claim logic: the shift is invisible to FP32, verdicts follow the measurements."""

from __future__ import annotations

import math

import pytest
import torch

from lossscale.demo import claims as C
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


def test_verdict_logic():
    r = C.ClaimResult("C9", "t", "c")
    assert r.verdict == C.NOT_HELD  # nothing checked: nothing shown
    r.check("a", True, "")
    assert r.verdict == C.HELD
    r.check("b", False, "")
    assert r.verdict == C.NOT_HELD
    assert r.to_dict()["verdict"] == C.NOT_HELD
    assert [c["passed"] for c in r.to_dict()["checks"]] == [True, False]


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


def test_c6_fails_without_the_measurements_its_checks_need():
    """A run without telemetry (no overflow line) or without activation probes is NOT HELD, not excused."""
    scales = [2.0**16, 2.0**17, 2.0**18, 2.0**17, 2.0**18, 2.0**17, 2.0**18]
    dynamic = _fake_run("dynamic", 0.95, steps=len(scales))
    for s, scale in zip(dynamic.steps, scales):
        s["loss_scale"] = scale
    for i in (3, 5):
        dynamic.steps[i - 1]["skipped"] = True  # the step before each backoff overflowed
    r = C.c6_dynamic_scaling(_fake_run("fp32", 0.95), dynamic, _fake_run("torch", 0.95),
                             _fake_run("adaptive", 0.95), growth_interval=1)
    checks = {c.name: c for c in r.checks}
    assert checks["the scale finds the overflow line by itself"].passed
    hover = checks["and hovers just below it"]
    assert not hover.passed and "no overflow line measured" in hover.detail
    beats = checks["the adaptive policy beats torch's default"]
    assert not beats.passed and "adaptive and torch default run" in beats.detail
    assert r.verdict == C.NOT_HELD


def test_demo_scalers_record_telemetry_every_step():
    """C6's overflow line is the scaler's own per-step headroom: every lossscale run of the demo records it.

    Read through ``scaler.metrics()`` after ``step()``, as the demo's observer does.  The weight
    gradients grow 16x per step, so a figure that was not refreshed on a step would repeat the last one.
    """
    from lossscale.demo import run

    main, sweep = run.plan(run.DemoConfig.quick_preset(), observe=None)
    assert [spec.name for spec in main] == ["fp32", "fp16_noscale", "static", "dynamic", "torch_default", "adaptive",
                                            "clip_right", "clip_wrong"]
    for spec in main + [spec for _, spec in sweep]:
        if spec.make_scaler is None or spec.name == "torch_default":
            continue
        scaler = spec.make_scaler()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        headroom = []
        for k in range(3):
            x = torch.full((2, 4), 2.0 ** (4 * k))
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            # Divided by the scale: the scaled gradients stay near 1 at any scale (no overflow).
            loss = out.float().sum() / scaler.get_scale()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            headroom.append(scaler.metrics().get("grad/headroom_bits"))
            scaler.update()
        assert all(isinstance(h, float) for h in headroom) and len(set(headroom)) == 3, (spec.name, headroom)


# ---------------------------------------------------------------------------------------------- the page
def test_formats_table_is_an_html_table_that_fits_the_page():
    """Issue 12: C1's formats table was ~200 characters of preformatted text and ran off the page."""
    from lossscale import formats
    from lossscale.demo import render
    from lossscale.report import html

    sec = render._claim_section(C.c1_fp16_facts())
    assert sec.pre is None and sec.grid_wrap
    header, rows = sec.grid
    assert header[:3] == ["format", "layout", "max"] and len(header) >= 7
    assert [r[0] for r in rows] == list(formats.FORMATS)
    # Nothing lost in the parse: each row holds the words of its text line, in order.
    lines = formats.table().splitlines()[2:]
    assert [" ".join(" ".join(r).split()) for r in rows] == [" ".join(line.split()) for line in lines]
    page = html._section(sec)
    assert '<table class="wrap">' in page and "<pre>" not in page


def test_text_table_grid_declines_what_it_cannot_parse():
    from lossscale.demo.render import text_table_grid

    assert text_table_grid("just a line") is None
    assert text_table_grid("a  b\nno dashes here\n1  2") is None
    assert text_table_grid("a   bb\n--  --\n1   22\n") == (["a", "bb"], [["1", "22"]])


def test_header_says_what_the_shift_is_for_in_plain_words():
    """Issue 12: "loss x 2^-20 with lr / 2^-20" was cryptic (dividing by 2^-20 multiplies)."""
    from lossscale.demo import run

    text = "\n".join(run.header(run.DemoConfig.quick_preset(), 22))
    assert "lr / 2^-" not in text
    for words in ("On purpose", "multiplies the loss by 2^-20", "learning rate by 2^20", "underflow cliff",
                  "FP32 is unaffected"):
        assert words in text, words
    assert max(len(line) for line in text.splitlines()) <= 110
