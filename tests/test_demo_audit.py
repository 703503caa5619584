"""``lossscale audit-demo``: the audit names the overflowing module of the demo's GPT-2-shaped model, FP16
never trains without keep_fp32 and trains like FP32 with it, and ``on_forward_overflow="upcast"`` keeps it
in FP32 by itself; then a backward that overflows at any scale >= 1, where the default floor trains as
torch's scaler does and a floor at 1 does not; the report, its plots and summary.json."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest
import torch

import lossscale
from lossscale import cli
from lossscale.demo import backward_overflow
from lossscale.demo import fp32_fallback as demo

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``lossscale audit-demo --quick`` at 12 steps (the CLI's own path), and what it printed."""
    out = tmp_path_factory.mktemp("audit_demo")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo, "QUICK_STEPS", 12)
        with contextlib.redirect_stdout(printed):
            rc = cli.main(["audit-demo", "--quick", "--out", str(out)])
    with open(out / "summary.json", encoding="utf-8") as fh:
        return rc, out, json.load(fh), printed.getvalue()


def test_the_demo_holds_every_check(quick_run):
    rc, _, summary, printed = quick_run
    assert rc == 0 and summary["verdict"] == "HELD", summary["checks"]
    assert [c["passed"] for c in summary["checks"]] == [True] * 5
    assert summary["audit"]["keep_fp32"] == [demo.INJECTED] and summary["steps"] == 12
    fp16, kept, fp32 = (summary["runs"][k] for k in ("fp16", "fp16_keep_fp32", "fp32"))
    assert all(s for s in fp16["skipped"]) and not any(kept["skipped"])
    assert kept["loss"][-1] < kept["loss"][0] - 1.0
    assert kept["loss"][-1] == pytest.approx(fp32["loss"][-1], rel=0.05)
    assert any("non-finite before any scaling" in w for w in fp16["warnings"])  # the scaler's own words
    upcast = summary["runs"]["fp16_upcast"]
    assert upcast["upcast"] == [demo.INJECTED] and upcast["skipped"][:3] == [True, True, False]
    assert any("now runs in FP32" in w for w in upcast["warnings"])
    assert "KEEP FP32 (output overflows)" in printed and "done in" in printed and "HELD" in printed


def test_the_report_has_its_page_plots_and_summary(quick_run):
    _, out, summary, _ = quick_run
    for png in ("fp32_fallback_loss.png", "fp32_fallback_amax.png", "backward_overflow_loss.png"):
        with open(out / png, "rb") as fh:
            assert fh.read(8) == PNG
    page = (out / "index.html").read_text(encoding="utf-8")
    for piece in (
        "fp32_fallback_loss.png",
        "fp32_fallback_amax.png",
        "lossscale.keep_fp32",
        demo.INJECTED,
        "HELD",
        "on_forward_overflow",
        "backward_overflow_loss.png",
        "on_backward_overflow",
    ):
        assert piece in page
    modules = {m["name"]: m for m in summary["audit"]["modules"]}
    assert modules[demo.INJECTED]["fp32_amax"] > lossscale.formats.FP16.max
    assert not math.isfinite(modules[demo.INJECTED]["fwd_amax"])


def test_the_backward_section_prints_what_it_measured(quick_run):
    """The backward section's table and checks, read back from what the command printed, against the
    runs in summary.json: every printed figure is a measured one, and every verdict follows from them."""
    rc, _, summary, printed = quick_run
    section = summary["backward"]
    runs, steps = section["runs"], section["config"]["steps"]
    taken = {name: sum(not s for s in r["skipped"]) for name, r in runs.items()}
    lines = printed.splitlines()
    start = lines.index(section["lines"][0])
    assert lines[start : start + len(section["lines"])] == section["lines"]  # printed as kept
    header = next(line for line in section["lines"] if line.startswith("  loss at step"))
    shown = [int(s) for s in header.split()[3:]]  # the steps whose loss the table gives
    for name, (short, label) in backward_overflow.DEMO_RUNS.items():
        row, loss_row = (line for line in section["lines"] if line.startswith(f"  {short} "))
        assert row.endswith(label) and f" {taken[name]} of {steps} " in row
        if name != "fp32":
            assert f" {runs[name]['scale'][-1]:g} " in row
        assert loss_row.split()[-len(shown) :] == [f"{runs[name]['loss'][s]:.4g}" for s in shown]
    # The verdicts, from the runs: the default floor trains at least as much as torch's scaler, a floor at
    # 1 trains not at all, the upcast at least as much as torch's, FP32 lowest.
    expected = [
        taken["lossscale"] >= taken["torch"],
        taken["lossscale_min_scale_1"] == 0,
        taken["lossscale_upcast"] >= taken["torch"] and bool(runs["lossscale_upcast"]["upcast_modules"]),
        all(r["loss"][-1] >= runs["fp32"]["loss"][-1] for r in runs.values()),
    ]
    assert [c["passed"] for c in section["checks"]] == expected == [True] * 4
    for c in section["checks"]:
        assert f"  pass  {c['check']}: {c['detail']}" in printed
    assert f"{taken['lossscale']} and {taken['torch']} of {steps}" in section["checks"][0]["detail"]
    assert rc == 0 and summary["verdict"] == "HELD"


def test_the_mini_gpt_runs_its_linears_in_fp16_on_a_float32_residual_stream():
    model = demo.injected_model()
    dtypes = {}
    for name in ("h.0.mlp.c_fc", "h.0", "ln_f"):
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: dtypes.update({name: o.dtype}))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(demo.markov_batches(1)[0])
    assert dtypes == {"h.0.mlp.c_fc": torch.float16, "h.0": torch.float32, "ln_f": torch.float32}


def test_the_synthetic_language_follows_its_two_successors():
    batch = demo.markov_batches(1, seed=3, batch_size=64)[0]
    pairs = {(int(a), int(b)) for row in batch for a, b in zip(row[:-1], row[1:])}
    successors = {}
    for a, b in pairs:
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 2


def test_the_command_is_listed_and_checks_its_folder_first(tmp_path, capsys, monkeypatch):
    assert "audit-demo" in cli.build_parser().format_help()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setattr(demo, "_run", lambda *a, **k: pytest.fail("trained before checking --out"))
    assert cli.main(["audit-demo", "--out", str(blocker)]) == 2
    assert capsys.readouterr().err.startswith(f"lossscale audit-demo: --out {blocker}: ")
    monkeypatch.setattr(cli, "_missing_demo_deps", lambda need_sklearn=True: ["matplotlib"])
    assert cli.main(["audit-demo"]) == 2
    assert "pip install -c constraints.txt -e '.[demo]'" in capsys.readouterr().err


def test_gitignore_covers_the_default_report_folder():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, ".gitignore"), encoding="utf-8") as fh:
        ignored = {line.strip() for line in fh}
    subs = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    assert subs["audit-demo"].get_default("out").rstrip("/") + "/" in ignored
