"""The demo's workload and claim logic: the shift is invisible to FP32, verdicts follow the measurements."""

from __future__ import annotations

import math

import pytest
import torch

from lossscale.demo import claims as C
from lossscale.demo.workload import RunResult, RunSpec, TrainConfig, load_digits_data, reference_grads, train

pytest.importorskip("sklearn")
# As the demo does: 64-wide matrices gain nothing from a second thread, and lose a lot on a busy machine.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    return load_digits_data(0)


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
    assert (
        C.lost_fraction(
            reference_grads(TrainConfig(shift_log2=0), data),
            reference_grads(TrainConfig(shift_log2=0), data, fp16=True),
        )
        < 0.05
    )


def test_runspec_validates_clip_order():
    with pytest.raises(ValueError, match="clip="):
        RunSpec("x", "x", clip="sometimes")
    with pytest.raises(ValueError, match="make_scaler"):
        RunSpec("x", "x", clip="clip_scaled")


def test_clip_runs_record_norms(data):
    import lossscale

    spec = RunSpec(
        "w",
        "w",
        make_scaler=lambda model: lossscale.GradScaler("cpu", policy="static", init_scale=2.0**10),
        clip="clip_scaled",
        epochs=1,
    )
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
    r = C.c2_underflow_stalls(
        TrainConfig(),
        _fake_run("fp32", 0.97),
        _fake_run("noscale", 0.96),
        ref,
        {"w": torch.tensor([0.0, 1e-3])},
        chance=0.1,
    )
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
    r = C.c6_dynamic_scaling(
        _fake_run("fp32", 0.95), dynamic, _fake_run("torch", 0.95), _fake_run("adaptive", 0.95), growth_interval=1
    )
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
    assert [spec.name for spec in main] == [
        "fp32",
        "fp16_noscale",
        "static",
        "dynamic",
        "torch_default",
        "adaptive",
        "clip_right",
        "clip_wrong",
    ]
    for spec in main + [spec for _, spec in sweep]:
        if spec.make_scaler is None or spec.name == "torch_default":
            continue
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        scaler = spec.make_scaler(model)
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
    for words in (
        "On purpose",
        "multiplies the loss by 2^-20",
        "learning rate by 2^20",
        "underflow cliff",
        "FP32 is unaffected",
    ):
        assert words in text, words
    assert max(len(line) for line in text.splitlines()) <= 110


# ---------------------------------------------------------------------------------------------- bad batches
def test_bad_steps_are_picked_per_seed():
    from lossscale.demo.bad_batches import pick_bad_steps

    a = pick_bad_steps(200, 0.1, seed=0)
    assert a == pick_bad_steps(200, 0.1, seed=0) and a == sorted(set(a)) and len(a) == 20
    assert all(0 <= s < 200 for s in a)
    assert a != pick_bad_steps(200, 0.1, seed=1)
    assert pick_bad_steps(200, 0.0, seed=0) == []
    with pytest.raises(ValueError, match="frac=1.5"):
        pick_bad_steps(200, 1.5, seed=0)


def test_runspec_diagnose_needs_a_scaler():
    with pytest.raises(ValueError, match="diagnose"):
        RunSpec("x", "x", diagnose=True)


@pytest.fixture(scope="module")
def bad(data):
    """The bad-batch section's three runs, small: 2 epochs, a quarter of the batches corrupt."""
    from lossscale.demo import bad_batches as B
    from lossscale.demo.workload import steps_per_epoch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tc = TrainConfig(epochs=2)
        steps = B.pick_bad_steps(2 * steps_per_epoch(tc, data), 0.25, seed=0)
        runs = {spec.name: train(spec, tc, data) for spec in B.plan(steps, epochs=2)}
    finally:
        torch.set_num_threads(threads)
    return B.BadBatches(runs, B.figures(runs, steps), epochs=2, frac=0.25, wall_s=1.0)


def test_bad_batches_cost_torch_the_scale_and_lossscale_nothing(bad):
    f = bad.figures
    n_bad, bad_steps = f["n_bad"], f["bad_steps"]
    assert n_bad == round(0.25 * f["n_steps"]) >= 8
    r = f["runs"]
    # Both skip exactly the corrupt steps; the clean run skips none.
    assert f["skipped_steps"]["bad_torch"] == f["skipped_steps"]["bad_lossscale"] == bad_steps
    assert f["skipped_steps"]["bad_clean"] == []
    # torch halves on every one of them, from its 2^16.
    assert r["bad_torch"]["first_scale"] == 2.0**16
    assert r["bad_torch"]["final_scale"] == 2.0 ** (16 - n_bad) and r["bad_torch"]["backoffs"] == n_bad
    # lossscale: the clean run's scale at every step, no backoff, and every corrupt step counted as a bad loss.
    assert bad.runs["bad_lossscale"].series("loss_scale") == bad.runs["bad_clean"].series("loss_scale")
    assert f["lossscale_steps_off_clean_scale"] == 0
    assert r["bad_lossscale"]["final_scale"] == r["bad_clean"]["final_scale"] == 2.0**16
    assert r["bad_lossscale"]["backoffs"] == 0 and r["bad_lossscale"]["min_scale"] == 2.0**16
    assert r["bad_lossscale"]["bad_loss_steps"] == n_bad and r["bad_clean"]["bad_loss_steps"] == 0
    assert r["bad_torch"]["bad_loss_steps"] is None  # torch has no such counter
    # Only the corrupt batches were touched: the clean run carries no "injected" flag at all.
    assert [s["step"] for s in bad.runs["bad_lossscale"].steps if s["injected"]] == bad_steps
    assert all("injected" not in s for s in bad.runs["bad_clean"].steps)


def test_bad_batch_diagnosis_names_the_loss_and_the_first_layer(bad):
    f = bad.figures
    d = f["first_diagnosis"]
    assert f["first_bad_step"] == f["bad_steps"][0]
    assert d["loss"] == "nan" and d["forward"] == "fc1" and d["scale"] == 2.0**16
    assert "`fc1`" in d["cause"] and "forward" in d["cause"] and "not the loss scale" in d["cause"]
    # Every skipped step was diagnosed, and each the same way.
    assert sum(f["causes"].values()) == f["n_bad"] and list(f["causes"]) == [d["cause"]]


def test_bad_batch_section_summary_and_terminal_lines(bad, tmp_path):
    """The report section, summary.json's "bad_batches" entry and the terminal lines show the measured figures."""
    import json
    from html import unescape

    from lossscale.demo import render
    from lossscale.demo.claims import p2, pct
    from lossscale.report import html

    f = bad.figures
    r = f["runs"]
    sec = render._bad_batch_section(bad, "caption")
    assert sec.anchor == "bad-batches" and sec.verdict is None  # a section, not a claim
    assert sec.images == [("bad_batches.png", "caption")]
    page = unescape(html._section(sec))
    for words in (
        f"{f['n_bad']} of the {f['n_steps']} batches",
        f"{p2(2.0**16)} -> {p2(r['bad_torch']['final_scale'])}",
        f"{p2(2.0**16)} throughout",
        pct(r["bad_torch"]["final_acc"]),
        pct(r["bad_lossscale"]["final_acc"]),
        pct(r["bad_clean"]["final_acc"]),
        "the clean run's scale at every step",
        "exactly the",
        f["first_diagnosis"]["cause"],
    ):
        assert words in page, words
    header, rows = sec.grid
    assert [row[0] for row in rows] == [bad.runs[n].label for n in ("bad_clean", "bad_torch", "bad_lossscale")]

    summary = {
        "claims": {},
        "runs": {},
        "config": {},
        "timings": {"total": 1.0},
        "bad_batches": render.bad_batch_summary(bad),
    }
    render.write_summary(summary, str(tmp_path))
    got = json.loads((tmp_path / "summary.json").read_text())["bad_batches"]
    assert got["figures"]["runs"]["bad_torch"]["final_scale"] == r["bad_torch"]["final_scale"]
    assert got["figures"]["first_diagnosis"]["forward"] == "fc1"
    assert got["runs"]["bad_lossscale"]["per_step"]["loss_scale"] == bad.runs["bad_lossscale"].series("loss_scale")
    assert [i for i, x in enumerate(got["runs"]["bad_torch"]["per_step"]["injected"]) if x] == f["bad_steps"]

    lines = render.terminal_summary(summary, str(tmp_path)).splitlines()
    text = " ".join(line.strip() for line in lines)
    assert f"bad batches ({f['n_bad']} of {f['n_steps']} with a NaN input row)" in text
    assert (
        f"torch's scale 2^16 -> {p2(r['bad_torch']['final_scale'])}" in text and "lossscale's 2^16 throughout" in text
    )
    assert "forward output of `fc1`" in text
    start = next(i for i, line in enumerate(lines) if line.startswith("bad batches ("))
    ours = lines[start : lines.index("", start)]
    assert 2 <= len(ours) <= 4 and max(len(line) for line in ours) <= 110, ours


def test_bad_batch_plot_is_a_png(bad, tmp_path):
    pytest.importorskip("matplotlib")
    from lossscale.report import plots

    runs = {
        n: {
            "label": r.label,
            "step": r.series("step"),
            "loss_scale": r.series("loss_scale"),
            "skipped": r.series("skipped"),
            "final_scale": r.final_scale,
            "epoch": [e["epoch"] for e in r.epochs],
            "test_acc": [e["test_acc"] for e in r.epochs],
        }
        for n, r in bad.runs.items()
    }
    path = plots.plot_bad_batches(str(tmp_path / "bad.png"), runs, chance=0.1)
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_bad_batch_summary_speaks_to_the_user_not_the_tracker(bad):
    """Issue 21: summary.json's bad-batch text began with "issue 13:", a tracker number a user cannot look up."""
    import json
    import re

    from lossscale.demo import render

    entry = render.bad_batch_summary(bad)
    assert entry["what"].startswith("bad batches: ")
    assert not re.search(r"\bissue \d", json.dumps(entry))
