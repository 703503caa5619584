"""The ``lossscale`` command: help, formats, the ``demo --quick`` smoke test, import weight."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from lossscale import cli

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

CLAIMS = ("C1", "C2", "C3", "C4", "C5", "C6")
PNGS = (
    "curves.png",
    "fp16_number_line.png",
    "gradients_unscaled.png",
    "gradients_scaled.png",
    "layer_flush.png",
    "clip_order.png",
    "static_sweep.png",
    "scale_trajectory.png",
    "telemetry_dynamic.png",
)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``lossscale demo --quick`` for every test of this module (it is the expensive part), and what it printed."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("quick")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = cli.main(["demo", "--quick", "--out", str(out), "--no-progress", "--seed", "0"])
    with open(out / "summary.json", encoding="utf-8") as fh:
        return rc, out, json.load(fh), printed.getvalue()


@pytest.fixture(scope="module")
def quick_report(quick_run):
    return quick_run[:3]


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in ("demo", "formats", "report", "digits"):
        assert word in text


def test_no_subcommand_prints_help_and_succeeds(capsys):
    """Issue 21: a bare ``lossscale`` printed the help and exited 2, as if the user had erred."""
    assert cli.main([]) == 0
    out = capsys.readouterr()
    assert "lossscale demo" in out.out and out.err == ""


def test_demo_help_reads_well(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = capsys.readouterr().out
    for opt in ("--quick", "--out", "--seed", "lossscale-report", "HELD"):
        assert opt in text


def test_formats_prints_the_table_and_the_cliff(capsys):
    assert cli.main(["formats"]) == 0
    text = capsys.readouterr().out
    for name in ("fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "65504", "2^-24", "2^-25"):
        assert name in text
    assert "cliff" in text and "1e-8 in fp16: 0;" in text


def test_formats_rejects_an_unknown_format_before_printing_anything(capsys):
    """Issue 21: ``formats --cliff fp64`` printed the whole table, then its error."""
    assert cli.main(["formats", "--cliff", "fp64"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("lossscale formats: --cliff: fmt='fp64' is not a known number format; use one of: ")


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", [["formats"], ["--help"], []], ids=["formats", "help", "bare"])
def test_a_closed_pipe_ends_quietly(argv, unbuffered):
    """Issue 21: ``lossscale formats | head -2`` printed a BrokenPipeError traceback.

    The reader is gone before the command writes, as when ``head`` has read its lines: the command
    says nothing on stderr and ends with SIGPIPE's status 141 (argparse's own help output ignores a
    failed write, so the help may still end with 0).
    """
    flags = ["-u"] if unbuffered else []  # -u: every print is a write, as when the output outgrows the pipe
    proc = subprocess.Popen(
        [sys.executable, *flags, "-m", "lossscale", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    status = proc.wait(timeout=60)
    assert err == "", err
    assert status == 141 if argv == ["formats"] else status in (0, 141), status


def test_import_stays_light():
    # (tqdm is not checked: torch itself imports it.)
    code = (
        "import sys, lossscale, lossscale.cli, lossscale.demo, lossscale.report; "
        "heavy = [m for m in ('matplotlib', 'sklearn') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "lossscale", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "lossscale demo" in done.stdout


def test_demo_without_the_extras_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_missing_demo_deps", lambda need_sklearn=True: ["scikit-learn"])
    assert cli.main(["demo", "--quick"]) == 2
    assert "pip install -c constraints.txt -e '.[demo]'" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["file", "under_a_file", "proc"])
def test_demo_out_is_checked_before_training(tmp_path, monkeypatch, capsys, where):
    """Issue 12: a bad --out trained for a minute first, then died with a traceback."""
    from lossscale.demo import run

    monkeypatch.setattr(run, "execute", lambda *a, **k: pytest.fail("trained before checking --out"))
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = {"file": blocker, "under_a_file": blocker / "sub", "proc": "/proc/nope"}[where]
    assert cli.main(["demo", "--quick", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lossscale demo: --out {out}: ") and err.count("\n") == 1, err
    with pytest.raises(ValueError, match=str(out)):
        run.run_demo(str(out), quick=True)  # the library entry point checks first too


def test_gitignore_covers_the_default_report_folders():
    """Issue 12: .gitignore had lossscale-report/ but not lossscale-run-report/ (``lossscale report``'s default)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ignored = {line.strip() for line in open(os.path.join(root, ".gitignore"), encoding="utf-8")}
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for cmd in ("demo", "report"):
        default = subs[cmd].get_default("out")
        assert default.rstrip("/") + "/" in ignored, (cmd, default)


# ---------------------------------------------------------------------------------------------- --quick
def test_quick_demo_terminal_output_reads_well(quick_run):
    """Issue 12: the header in plain words, the run rows in one column, the uncapped dynamic run explained."""
    printed = quick_run[3]
    assert "On purpose" in printed and "FP32 is unaffected" in printed and "lr / 2^-" not in printed
    rows = [line for line in printed.splitlines() if "  acc " in line]
    assert len(rows) >= 14
    assert len({line.index("  acc ") for line in rows}) == 1, rows  # the adaptive label overran the column
    assert "dynamic: uncapped (max_scale=None)" in printed
    assert "GradScaler's default cap of 2^24" in printed


def test_quick_demo_writes_the_report(quick_report):
    rc, out, summary = quick_report
    assert rc == 0
    for name in ("index.html", "summary.json", "dynamic.jsonl", *PNGS):
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
    for name in PNGS:
        with open(out / name, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    html = (out / "index.html").read_text(encoding="utf-8")
    for name in PNGS:
        assert f'src="{name}"' in html
    for cid in CLAIMS:
        assert f'id="{cid}"' in html


def test_quick_demo_verdicts_are_present_and_none_fails(quick_report):
    _, _, summary = quick_report
    assert set(summary["verdicts"]) == set(CLAIMS)
    for cid, claim in summary["claims"].items():
        assert claim["verdict"] in ("HELD", "NOT HELD")
        assert claim["checks"], cid
        passed = [c["passed"] for c in claim["checks"]]
        assert all(isinstance(p, bool) for p in passed), (cid, passed)
        # The verdict is computed from the checks, nothing else.
        assert claim["verdict"] == ("HELD" if all(passed) else "NOT HELD")
        assert claim["verdict"] != "NOT HELD", (cid, claim["checks"])


def test_quick_demo_figures_are_in_range(quick_report):
    _, _, s = quick_report
    runs = s["runs"]
    for name, r in runs.items():
        assert 0.0 <= r["final_acc"] <= 1.0, name
        assert 0 <= r["skipped_steps"] <= r["steps"]
        assert all(0.0 <= a <= 1.0 for a in r["epochs"]["test_acc"])
    # The controlled shift: FP32 learns, FP16 without scaling does not, scaling recovers.
    assert runs["fp32"]["final_acc"] > 0.85
    assert runs["fp16_noscale"]["final_acc"] < 0.25
    assert runs["static"]["final_acc"] > runs["fp32"]["final_acc"] - 0.05
    c1 = s["claims"]["C1"]["figures"]
    assert (c1["max"], c1["smallest_normal"], c1["smallest_subnormal"], c1["flush_threshold"]) == (
        65504.0,
        2.0**-14,
        2.0**-24,
        2.0**-25,
    )
    c2 = s["claims"]["C2"]["figures"]
    assert 0.0 <= c2["band_frac"] <= 1.0 and c2["band_lost_frac"] == 1.0
    c3 = s["claims"]["C3"]["figures"]
    assert c3["pow2_roundtrip_mismatch_frac"] == 0.0 < c3["non_pow2_roundtrip_mismatch_frac"] < 1.0
    assert c3["scaled_lost_frac"] < c3["unscaled_lost_frac"]
    c4 = s["claims"]["C4"]["figures"]
    assert c4["wrong_clip_fired_frac"] == 1.0 and 0 < c4["wrong_median_norm_ratio"] < 0.01
    c5 = s["claims"]["C5"]["figures"]
    assert len(c5["log2_scales"]) == len(c5["acc"]) == len(c5["skipped_frac"])
    assert all(0.0 <= v <= 1.0 for v in c5["skipped_frac"] + c5["acc"])
    d = s["claims"]["C6"]["figures"]["dynamic"]
    assert d["max_scale"] > d["first_scale"] and d["backoffs"] >= 1
    for key in ("total", "fp32", "dynamic"):
        assert s["timings"][key] > 0
    json.dumps(s, allow_nan=False)  # strict JSON: no NaN or inf anywhere


def test_quick_demo_telemetry_feeds_lossscale_report(quick_report, tmp_path):
    _, out, summary = quick_report
    assert cli.main(["report", str(out / "dynamic.jsonl"), "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "summary.json").read_text())["figures"]
    run = summary["runs"]["dynamic"]
    assert got["steps"] == run["steps"] and got["skipped_steps"] == run["skipped_steps"]
    assert math.isclose(got["scale_last"], run["final_scale"])


def test_the_demo_outputs_name_no_tracker_issue(quick_run):
    """Issue 21: summary.json began a text with "issue 13:"; no output a user reads cites the tracker."""
    import re

    _, out, summary, printed = quick_run
    for name, text in (
        ("summary.json", json.dumps(summary)),
        ("index.html", (out / "index.html").read_text()),
        ("stdout", printed),
    ):
        found = re.findall(r".{0,40}\bissue \d+.{0,40}", text, flags=re.IGNORECASE)
        assert not found, (name, found)


def test_readme_explains_the_demo_shift_where_it_first_describes_the_demo():
    """Issue 12: the README's first paragraph about the demo says in plain words why the loss is shifted."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    first = next(p for p in text.split("\n\n") if "`lossscale demo`" in p)
    flat = " ".join(first.split())
    for words in (
        "On purpose",
        "multiplies the loss by 2^-20",
        "learning rate by 2^20",
        "underflow cliff",
        "FP32 is unaffected",
    ):
        assert words in flat, words


def _picture_command() -> tuple:
    """The command docs/concepts.md and CONTRIBUTING.md give for docs/assets/: (demo arguments, picture names)."""
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = set()
    for page in ("docs/concepts.md", "CONTRIBUTING.md"):
        with open(os.path.join(root, page), encoding="utf-8") as fh:
            found |= set(re.findall(r"^lossscale demo .*docs/assets/$", fh.read(), flags=re.MULTILINE))
    assert len(found) == 1, f"the two pages give different commands for the pictures: {found}"
    demo, copy = found.pop().split(" && ")
    names = re.fullmatch(r"cp /tmp/demo/\{([\w,]+)\}\.png docs/assets/", copy).group(1).split(",")
    return demo.split()[1:], names


def test_the_pictures_command_is_the_default_demo_and_copies_every_committed_picture():
    args, names = _picture_command()
    assert args == ["demo", "--out", "/tmp/demo"]  # the README's `lossscale demo`, at its default size
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert sorted(f"{n}.png" for n in names) == sorted(os.listdir(os.path.join(root, "docs", "assets")))


@pytest.mark.slow
def test_the_committed_pictures_are_what_the_documented_command_writes(tmp_path):
    """docs/assets/ holds, byte for byte, what the documented demo command writes (about a minute on 2 cores)."""
    import contextlib
    import io

    args, names = _picture_command()
    out = tmp_path / "demo"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main([a if a != "/tmp/demo" else str(out) for a in args] + ["--no-progress"]) == 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    differ = []
    for name in names:
        with (
            open(out / f"{name}.png", "rb") as new,
            open(os.path.join(root, "docs", "assets", f"{name}.png"), "rb") as old,
        ):
            if new.read() != old.read():
                differ.append(name)
    assert not differ, f"docs/assets/ differs from the demo's output: {differ}; regenerate (docs/concepts.md)"
