"""Plots on synthetic data, the HTML writer, the telemetry JSONL schema and ``lossscale report``."""

from __future__ import annotations

import json
import math
import re

import pytest

from lossscale import cli
from lossscale.report import html, schema

pytest.importorskip("matplotlib")
from lossscale.report import plots  # noqa: E402
from lossscale.report.run_report import render_run_report, summarize  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(8) == PNG


def _size(path):
    from matplotlib.image import imread

    return imread(str(path)).shape[:2]


# ---------------------------------------------------------------------------------------------- plots
def test_number_line(tmp_path):
    fmt = {
        "name": "fp16",
        "max": 65504.0,
        "smallest_normal": 2.0**-14,
        "smallest_subnormal": 2.0**-24,
        "flush_threshold": 2.0**-25,
    }
    before = {e: 100 - abs(e + 30) * 8 for e in range(-40, -20)}
    after = {e + 16: c for e, c in before.items()}
    p = plots.plot_number_line(str(tmp_path / "n.png"), fmt, before, after, scale_log2=16)
    assert _is_png(p)
    h, w = _size(p)
    assert w > h > 200
    # The line alone (no histogram) still draws.
    assert _is_png(plots.plot_number_line(str(tmp_path / "n0.png"), fmt, {}, None))


def test_layer_flush_curves_sweep_clip(tmp_path):
    assert _is_png(
        plots.plot_layer_flush(
            str(tmp_path / "l.png"),
            ["fc1", "fc2", "fc3"],
            {"no scaling": [1.0, 1.0, 0.99], "S=2^16": [0.003, None, 0.0]},
        )
    )
    runs = {
        name: {"label": name, "epoch": [0, 1, 2], "train_loss": [2.3, 1.0, float("nan")], "test_acc": [0.1, 0.5, 0.9]}
        for name in ("fp32", "fp16_noscale", "mystery")
    }
    assert _is_png(plots.plot_curves(str(tmp_path / "c.png"), runs, chance=0.1))
    assert _is_png(
        plots.plot_sweep(
            str(tmp_path / "s.png"),
            [0, 8, 16, 24],
            [0.1, 0.9, 0.95, 0.1],
            [0.0, 0.0, 0.0, 1.0],
            fp32_acc=0.96,
            flushed_frac=[1.0, 0.2, 0.0, None],
            overflow_frac=[0, 0, 0, 0.01],
            window=(8, 16),
            chance=0.1,
        )
    )
    clip = {
        n: {"label": n, "epoch": [0, 1], "test_acc": [0.3, 0.9], "step": [0, 1, 2], "norm_ratio": [1.0, 0.5, None]}
        for n in ("clip_right", "clip_wrong")
    }
    assert _is_png(plots.plot_clip_order(str(tmp_path / "k.png"), clip))


def _pixels_of(path, rgb) -> int:
    import numpy as np
    from matplotlib.image import imread

    img = (imread(str(path))[..., :3] * 255).round().astype(int)
    return int((np.abs(img - np.array(rgb)).sum(axis=-1) <= 3).sum())


def test_layer_flush_shows_small_shares(tmp_path):
    """Issue 12: 0-0.3% bars on a linear 0-100 axis were invisible; on a log axis a 0.3% bar is a bar."""
    red = (0xD6, 0x27, 0x28)  # the first series' colour
    full = plots.plot_layer_flush(str(tmp_path / "full.png"), ["fc1"], {"run": [1.0]})
    small = plots.plot_layer_flush(str(tmp_path / "small.png"), ["fc1"], {"run": [0.003]})
    tiny = plots.plot_layer_flush(str(tmp_path / "tiny.png"), ["fc1"], {"run": [2e-6]})
    none = plots.plot_layer_flush(str(tmp_path / "none.png"), ["fc1"], {"run": [0.0]})
    legend = _pixels_of(none, red)  # no bar: the legend patch alone
    bar = lambda p: _pixels_of(p, red) - legend  # noqa: E731
    assert bar(full) > 1000
    assert bar(small) > 0.2 * bar(full)  # linear axis: 0.003
    assert bar(tiny) > 0.05 * bar(full)  # the axis reaches down to it


def test_scale_trajectory_and_telemetry(tmp_path):
    steps = list(range(50))
    scale = [2.0 ** (16 + min(s // 5, 8)) for s in steps]
    skipped = [s in (41, 46) for s in steps]
    line = [2.0**23 * (1.5 if s % 3 else 1.0) if not k else None for s, k in zip(steps, skipped)]
    runs = {
        "dynamic": {
            "label": "dyn",
            "step": steps,
            "loss_scale": scale,
            "skipped": skipped,
            "line": line,
            "envelope": line,
        },
        "torch_default": {"label": "torch", "step": steps, "loss_scale": [2.0**16] * 50, "skipped": [False] * 50},
    }
    assert _is_png(plots.plot_scale_trajectory(str(tmp_path / "t.png"), runs))
    sampled = [0.01 if s % 5 == 0 else None for s in steps]
    p = plots.plot_telemetry(
        str(tmp_path / "tel.png"),
        steps,
        scale,
        skipped,
        flushed={"all": sampled},
        headroom={"all": [3.0] * 50, "fc1": [4.0] * 50},
    )
    assert _is_png(p)
    assert _is_png(plots.plot_telemetry(str(tmp_path / "bare.png"), steps, scale, skipped))


def test_plotting_leaves_no_pyplot_state(tmp_path):
    import sys

    plots.plot_curves(str(tmp_path / "c.png"), {"fp32": {"epoch": [0], "train_loss": [1.0], "test_acc": [0.5]}})
    if "matplotlib.pyplot" in sys.modules:
        import matplotlib.pyplot as plt

        assert plt.get_fignums() == []


# ---------------------------------------------------------------------------------------------- html
def test_html_escapes_and_links(tmp_path):
    sec = html.Section(
        "C1 <fp16>",
        verdict="HELD",
        claim="a < b & c",
        text=["x <script>"],
        figures=[("max", "65504")],
        checks=[("ok", True, "d"), ("later", False, "missed")],
        images=[("a.png", "cap")],
        pre="t<able>",
        anchor="C1",
    )
    path = html.write_html(
        str(tmp_path / "i.html"), "T & T", [sec], subtitle="s", summary=[("C1", "C1 x", "HELD", "figure")], footer="f"
    )
    text = open(path, encoding="utf-8").read()
    assert "<script>" not in text and "x &lt;script&gt;" in text
    assert 'href="#C1"' in text and 'id="C1"' in text and 'src="a.png"' in text
    assert ">pass<" in text and ">fail<" in text and "HELD" in text


# ---------------------------------------------------------------------------------------------- schema
def _records(n=30, backoff_at=(12, 20)):
    recs = [{"meta": {"run": "synthetic", "format": "fp16"}}]
    scale = 2.0**16
    skipped_steps = 0
    for step in range(n):
        skipped = step in backoff_at
        skipped_steps += skipped
        recs.append(
            {
                "step": step,
                "loss_scale": scale,
                "skipped": skipped,
                "skipped_steps": skipped_steps,
                "loss": 2.0 / (1 + step),
                "grad/flushed_frac": 0.01 * (step % 3),
                "grad/headroom_bits": -math.inf if skipped else 2.0 + step % 4,
                "act/flushed_frac": 0.02 if step % 5 == 0 else None,
                "act/fc1/flushed_frac": 0.03 if step % 5 == 0 else None,
                "act/fc2/headroom_bits": 5.0,
                "grad/fc1.weight/flushed_frac": 0.0,
                "other": "kept out",
            }
        )
        if skipped:
            scale /= 2
        elif step % 5 == 4:
            scale *= 2
    return recs


def test_schema_parses_columns_layers_and_meta():
    tel = schema.parse_records(_records())
    assert len(tel) == 30 and tel.meta == {"run": "synthetic", "format": "fp16"}
    assert sum(tel.skipped) == 2
    assert tel.metrics["grad/headroom_bits"][12] == -math.inf
    assert set(tel.layer_series("act", "flushed_frac")) == {"fc1"}
    assert set(tel.layer_series("param", "flushed_frac")) == {"fc1.weight"}
    assert tel.layer_series("act", "headroom_bits")["fc2"] == [5.0] * 30


def test_schema_derives_skipped_from_the_counter_and_reads_nonfinite_strings():
    recs = [
        {"step": i, "loss_scale": 8.0, "skipped_steps": c, "grad/headroom_bits": h}
        for i, (c, h) in enumerate([(0, 1.0), (1, "-inf"), (1, "nan"), (2, None)])
    ]
    tel = schema.parse_records(recs)
    assert tel.skipped == [False, True, False, True]
    assert tel.metrics["grad/headroom_bits"][1] == -math.inf and math.isnan(tel.metrics["grad/headroom_bits"][2])
    assert schema.parse_records([{"step": 0, "loss_scale": 1.0, "last_step_skipped": True}]).skipped == [True]


@pytest.mark.parametrize(
    "rec, match",
    [
        ({"loss_scale": 1.0, "step": -1}, "step=-1"),
        ({"step": 0}, "missing"),
        ({"step": 0, "loss_scale": 0.0}, "loss_scale"),
        ({"step": 0, "loss_scale": 1.0, "skipped": "no"}, "skipped"),
        ({"step": 0, "loss_scale": 1.0, "grad/flushed_frac": 1.5}, r"\[0, 1\]"),
        ({"step": 0, "loss_scale": 1.0, "grad/headroom_bits": "lots"}, "number"),
    ],
)
def test_schema_errors_name_the_line_and_key(rec, match):
    with pytest.raises(ValueError, match=match) as e:
        schema.parse_records([rec], source="run.jsonl")
    assert "run.jsonl:1" in str(e.value)


def test_jsonl_round_trip_is_strict_json(tmp_path):
    path = tmp_path / "run.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        schema.write_jsonl(fh, _records())
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    tel = schema.read_jsonl(str(path))
    assert tel.metrics["grad/headroom_bits"][12] is None  # -inf was written as null
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "loss_scale": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        schema.read_jsonl(str(bad), strict=True)
    empty = tmp_path / "meta_only.jsonl"
    empty.write_text('{"meta": {}}\n')
    with pytest.raises(ValueError, match="no step records"):
        schema.read_jsonl(str(empty))


def _killed_run(tmp_path, n=12):
    """What a real run leaves: a NaN scale as JsonlLogger writes it, a bad value, a truncated last line."""
    path = tmp_path / "killed.jsonl"
    lines = [schema.dumps_record(r) for r in _records(n, backoff_at=(3,))]
    lines[5] = re.sub(r'"loss_scale":[0-9.]+', '"loss_scale":"nan"', lines[5])  # JsonlLogger's NaN
    lines[7] = lines[7].replace('"loss":', '"loss":"lots","x":')  # a record with a non-number
    lines[-1] = lines[-1][: len(lines[-1]) // 2]  # killed mid-write
    path.write_text("\n".join(lines))  # no newline after the truncated line
    return path


def test_read_jsonl_skips_and_counts_bad_lines_with_one_warning(tmp_path):
    """Issue 12: one bad line (a killed run's truncated last line) refused the whole file."""
    path = _killed_run(tmp_path)
    with pytest.warns(
        UserWarning,
        match=r"killed.jsonl: skipped 2 bad line\(s\) \(line 8: .*loss='lots'.*"
        r"line 13: not a JSON object",
    ):
        tel = schema.read_jsonl(str(path))
    assert [i for i, _ in tel.bad_lines] == [8, 13]
    assert len(tel) == 10 and 6 not in tel.step and 11 not in tel.step  # lines 8 and 13 hold steps 6 and 11
    assert math.isnan(tel.loss_scale[4]) and tel.step[4] == 4  # "nan" read as NaN, the record kept
    with pytest.raises(ValueError, match=r"killed.jsonl:8: loss='lots'"):
        schema.read_jsonl(str(path), strict=True)


@pytest.mark.parametrize("logged", ['"nan"', "null", "NaN", '"inf"'])
def test_a_broken_scale_is_read_as_logged(logged):
    tel = schema.parse_records([json.loads('{"step": 0, "loss_scale": %s}' % logged)])
    assert math.isnan(tel.loss_scale[0]) or tel.loss_scale[0] == math.inf


def test_all_bad_lines_still_refuse_the_file(tmp_path):
    path = tmp_path / "junk.jsonl"
    path.write_text('{"step": 0, "loss_scale": -1}\n{"step": 1\n')
    with pytest.raises(ValueError, match=r"no step records.*2 bad lines skipped, first: line 1: loss_scale=-1"):
        schema.read_jsonl(str(path))


def test_report_on_a_killed_run(tmp_path, capsys):
    path = _killed_run(tmp_path)
    out = tmp_path / "rep"
    assert cli.main(["report", str(path), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "lossscale report: warning: " in captured.err
    assert "skipped 2 bad line(s)" in captured.err and "; 2 bad line(s) skipped" in captured.out
    saved = json.loads((out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    figures = saved["figures"]
    assert figures["bad_lines"] == 2 and figures["nonfinite_scales"] == 1
    assert figures["steps"] == 11 and figures["records"] == 10  # steps 0..10; step 6's line was bad
    assert figures["scale_max"] == 2.0**17 and [b["line"] for b in saved["bad_lines"]] == [8, 13]
    assert "line 13: not a JSON object" in (out / "index.html").read_text()


def test_report_figures_name_the_series_they_are_over(tmp_path):
    """Issue 12: act_flushed_frac_max (over the aggregate key) sat beside larger per-layer means, unlabelled."""
    path = tmp_path / "run.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        schema.write_jsonl(fh, _records())
    render_run_report(str(path), str(tmp_path / "rep"))
    text = (tmp_path / "rep" / "index.html").read_text()
    assert "act_flushed_frac_max: max over steps of act/flushed_frac (all watched modules together)" in text
    assert "act_flushed_frac_mean: mean over steps of act/flushed_frac (all watched modules together)" in text
    assert "act_flushed_frac_mean_per_layer[fc1]: mean over steps of act/fc1/flushed_frac (fc1 alone)" in text
    assert (
        "param_flushed_frac_mean_per_layer[fc1.weight]: mean over steps of grad/fc1.weight/flushed_frac" in text
    )  # the key as logged (issue 21: it said param/...)
    assert "grad_headroom_bits_min_clean: min over unskipped steps of grad/headroom_bits" in text
    assert "A small layer&#x27;s mean can therefore exceed the overall max" in text


@pytest.mark.parametrize("where", ["file", "under_a_file", "proc"])
def test_report_out_is_checked_before_reading(tmp_path, capsys, where):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = {"file": blocker, "under_a_file": blocker / "sub", "proc": "/proc/nope"}[where]
    # The input does not exist either: the --out error comes first, before any reading.
    assert cli.main(["report", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lossscale report: --out {out}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_check_out_dir_creates_the_folder(tmp_path):
    assert html.check_out_dir(str(tmp_path / "new" / "deeper")) == str(tmp_path / "new" / "deeper")
    assert (tmp_path / "new" / "deeper").is_dir()


# ---------------------------------------------------------------------------------------------- report
def test_report_on_a_generated_jsonl(tmp_path):
    path = tmp_path / "run.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        schema.write_jsonl(fh, _records())
    out = tmp_path / "rep"
    summary = render_run_report(str(path), str(out))
    assert summary["steps"] == 30 and summary["skipped_steps"] == 2 and summary["backoffs"] == 2
    assert summary["growths"] == summarize(schema.read_jsonl(str(path)))["growths"] > 0
    assert summary["act_flushed_frac_mean_per_layer"]["fc1"] == pytest.approx(0.03)
    assert summary["act_flushed_frac_mean"] == pytest.approx(0.02)  # the overall series, not replaced
    for name in ("index.html", "summary.json", "telemetry.png", "layers_act.png", "layers_param.png"):
        assert (out / name).is_file(), name
    assert _is_png(out / "telemetry.png")
    saved = json.loads((out / "summary.json").read_text())
    assert saved["meta"]["run"] == "synthetic" and saved["figures"]["steps"] == 30
    assert "synthetic" in (out / "index.html").read_text()


def test_report_cli(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        schema.write_jsonl(fh, _records(10, backoff_at=(3,)))
    assert cli.main(["report", str(path), "--out", str(tmp_path / "o")]) == 0
    assert "1 skipped" in capsys.readouterr().out
    assert cli.main(["report", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o2")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_report_reads_the_telemetry_logger(tmp_path):
    """A run recorded with GradScaler(telemetry=...) and lossscale's JsonlLogger renders as is."""
    torch = pytest.importorskip("torch")
    import lossscale

    telemetry = pytest.importorskip("lossscale.telemetry")
    if not hasattr(telemetry, "JsonlLogger"):
        pytest.skip("no JsonlLogger in this build")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler(
        "cpu", init_scale=2.0**30, growth_interval=2, max_scale=None, telemetry=1, on_stuck="ignore"
    )
    path = tmp_path / "logged.jsonl"
    with telemetry.JsonlLogger(str(path)) as log:
        for step in range(12):
            x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            log.log(step, scaler.metrics(), loss=loss.item())  # before update(): the scale the step ran with
            scaler.update()
    summary = render_run_report(str(path), str(tmp_path / "rep"))
    assert summary["steps"] == 12
    tel = schema.read_jsonl(str(path))
    assert "grad/headroom_bits" in tel.metrics and "grad/flushed_frac" in tel.metrics


# ------------------------------------------------------------------------------ a run logged every 10
def _sparse_run(tmp_path, n_steps=440, every=10, skips=(15, 35, 40, 212)):
    """What a 440-step run writes with ``if step % 10 == 0: log.log(step, scaler.metrics())``."""
    recs, count, scale = [], 0, 2.0**16
    for step in range(n_steps):
        if step in skips:
            count += 1
            scale /= 2
        if step % every == 0:
            recs.append(
                {
                    "step": step,
                    "loss_scale": scale,
                    "last_step_skipped": step in skips,
                    "skipped_steps": count,
                    "grad/flushed_frac": 0.0,
                    "grad/headroom_bits": 3.0,
                    "grad/0/flushed_frac": 0.01,
                    "grad/0/headroom_bits": 2.0,
                }
            )
    path = tmp_path / "every10.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        schema.write_jsonl(fh, recs)
    return path


def test_report_counts_steps_from_the_step_numbers_not_the_records(tmp_path, capsys):
    """Issue 21: ``lossscale report`` said "44 steps" for a 440-step run logged every 10 (it counted records)."""
    path = _sparse_run(tmp_path)
    figures = summarize(schema.read_jsonl(str(path)))
    assert (figures["steps"], figures["records"], figures["log_every"]) == (431, 44, 10)  # steps 0..430
    assert (figures["first_step"], figures["last_step"]) == (0, 430)
    # The counter sees the skips between records (15, 35, 212); the records' flags only step 40's.
    assert figures["skipped_steps"] == 4 and figures["skipped_records"] == 1
    assert figures["skipped_frac"] == 4 / 431
    assert cli.main(["report", str(path), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("431 steps (0..430, 44 records, one every 10), 4 skipped, "), out
    assert "between records" in out and "44 steps" not in out
    assert "431 steps (0..430, 44 records, one every 10)" in (tmp_path / "rep" / "index.html").read_text()


def test_every_step_logged_reads_as_before(tmp_path):
    tel = schema.parse_records(_records())
    figures = summarize(tel)
    assert (figures["steps"], figures["records"], figures["log_every"]) == (30, 30, 1)
    assert figures["skipped_steps"] == figures["skipped_records"] == 2
    # Without the counter only the flags can be counted.
    no_counter = [{k: v for k, v in r.items() if k != "skipped_steps"} for r in _records()]
    assert summarize(schema.parse_records(no_counter))["skipped_steps"] == 2


def test_report_legends_name_the_key_as_logged(tmp_path, monkeypatch):
    """Issue 21: the legend said ``param/0/...`` where the JSONL key is ``grad/0/...``."""
    drawn = {}

    def fake_plot(path, steps, scales, skipped, flushed=None, headroom=None, title=""):
        drawn[path.rsplit("/", 1)[-1]] = (dict(flushed or {}), dict(headroom or {}))
        open(path, "wb").close()

    monkeypatch.setattr(plots, "plot_telemetry", fake_plot)
    out = tmp_path / "rep"
    render_run_report(str(_sparse_run(tmp_path)), str(out))
    flushed, headroom = drawn["layers_param.png"]
    assert set(flushed) == {"0 (grad/0/flushed_frac)", "all together (grad/flushed_frac)"}
    assert set(headroom) == {"0 (grad/0/headroom_bits)", "all together (grad/headroom_bits)"}
    text = (out / "index.html").read_text()
    assert "param/0" not in text and "one layer each (grad/&lt;layer&gt;/...)" in text
    assert (
        schema.read_jsonl(str(_sparse_run(tmp_path))).layer_key("param", "0", "flushed_frac") == "grad/0/flushed_frac"
    )


# ------------------------------------------------------------------ input a report must survive (issue 19)
def _write_lines(path, lines):
    with open(path, "wb") as fh:
        for line in lines:
            fh.write(line if isinstance(line, bytes) else (line + "\n").encode())


def test_a_line_that_is_not_utf8_is_one_bad_line(tmp_path):
    path = tmp_path / "run.jsonl"
    _write_lines(path, [schema.dumps_record(r) for r in _records(5)] + [b"\xff\xfe not text\n"])
    with pytest.warns(UserWarning, match=r"line \d+: not UTF-8"):
        tel = schema.read_jsonl(str(path))
    assert len(tel.step) == 5


def test_deeply_nested_json_is_one_bad_line(tmp_path):
    path = tmp_path / "run.jsonl"
    _write_lines(path, [schema.dumps_record(r) for r in _records(5)] + ["[" * 100_000 + "]" * 100_000])
    with pytest.warns(UserWarning, match=r"line \d+: nested too deeply"):
        tel = schema.read_jsonl(str(path))
    assert len(tel.step) == 5


def test_a_layer_named_like_mathtext_is_drawn_as_written(tmp_path):
    path = tmp_path / "run.jsonl"
    recs = [
        {"step": i, "loss_scale": 65536.0, "act/$\\foo$/flushed_frac": 0.1, "act/$\\foo$/headroom_bits": 3.0}
        for i in range(5)
    ]
    _write_lines(path, [schema.dumps_record(r) for r in recs])
    render_run_report(str(path), str(tmp_path / "out"))
    assert (tmp_path / "out" / "layers_act.png").exists()


_HUGE = 10**399  # a 400-digit JSON integer: valid JSON, beyond every float and int64


@pytest.mark.parametrize(
    "field, line",
    [
        ("loss_scale", '{"step": 5, "loss_scale": %d}' % _HUGE),
        ("step", '{"step": %d, "loss_scale": 1024}' % _HUGE),
        ("grad/amax", '{"step": 5, "loss_scale": 1024, "grad/amax": %d}' % _HUGE),
        ("skipped_steps", '{"step": 5, "loss_scale": 1024, "skipped_steps": %d}' % _HUGE),
        ("act/", '{"step": 5, "loss_scale": 1024, "act/\\ud800/flushed_frac": 0.1}'),  # a lone surrogate
        ("'model'", '{"meta": {"model": "\\ud800"}}'),
    ],
)
def test_a_huge_integer_or_a_lone_surrogate_is_one_bad_line_naming_the_field(tmp_path, capsys, field, line):
    # Before: an OverflowError traceback (the integers) or one from matplotlib (the surrogate).
    main = cli.main
    path = tmp_path / "run.jsonl"
    good = [schema.dumps_record(r) for r in _records(5)]
    _write_lines(path, good + [line])
    assert main(["report", str(path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"line {len(good) + 1}: " in err and field in err
    # Alone in its file, it is the one-line error that refuses the file (exit status 2).
    _write_lines(path, [line])
    assert main(["report", str(path), "--out", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 1: " in err and field in err
    with pytest.raises(ValueError, match=f"run.jsonl:1: .*{re.escape(field)}"):
        schema.read_jsonl(str(path), strict=True)


def test_an_integer_beyond_the_digits_python_reads_is_one_bad_line(tmp_path):
    path = tmp_path / "run.jsonl"
    good = [schema.dumps_record(r) for r in _records(5)]
    _write_lines(path, good + ['{"step": 5, "loss_scale": 1%s}' % ("0" * 5000)])
    with pytest.warns(UserWarning, match=rf"line {len(good) + 1}: not readable as JSON \(Exceeds the limit"):
        tel = schema.read_jsonl(str(path))
    assert len(tel.step) == 5
