"""The oldest and the newest release of each integrated framework, each tested in a fresh venv.

    python benchmarks/compat.py                          # every framework; ~2-4 min per venv on 2 cores
    python benchmarks/compat.py --frameworks accelerate  # one
    python benchmarks/compat.py --dry-run                # which versions it would test, nothing installed

Why: ``constraints.txt`` pins what CI tests, so CI stays green when a framework publishes a release
that breaks lossscale; users with the package's open ranges get that release at once. This script is
the check that looks on purpose. For each framework named in the ``integrations`` extra of
``pyproject.toml`` it picks the oldest and the newest release its range allows (final releases that
install on this Python, from ``pip index versions``), makes a venv, installs the checkout's test extra
with that release (torch from ``constraints.txt``, everything else resolved afresh, as a user who pins
only that framework would get), and runs the framework's tests (``TESTS`` below). It prints a table,
framework / version / result, and writes it between the markers in ``docs/compatibility.md`` with the
date. Not part of CI: an upstream release must not block a landing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "compatibility.md")
BEGIN, END = "<!-- compat:begin -->", "<!-- compat:end -->"

# The tests that drive each framework (run from the checkout, in the framework's venv).
TESTS = {
    # (test_integrations_deepspeed.py drives accelerate's DeepSpeed plugin and the Trainer on DeepSpeed too)
    "accelerate": ["tests/test_integrations_accelerate.py", "tests/test_integrations_skip.py",
                   "tests/test_health.py", "tests/test_integrations_examples.py", "tests/test_integrations_deepspeed.py"],
    "transformers": ["tests/test_integrations_transformers.py", "tests/test_integrations_skip.py",
                     "tests/test_health.py", "tests/test_integrations_examples.py",
                     "tests/test_integrations_deepspeed.py"],
    "lightning": ["tests/test_integrations_lightning.py", "tests/test_integrations_skip.py",
                  "tests/test_health.py", "tests/test_integrations_examples.py"],
    "tensorboard": ["tests/test_integrations_loggers.py"],
    "deepspeed": ["tests/test_integrations_deepspeed.py"],
    "megatron-core": ["tests/test_integrations_megatron.py"],
    "timm": ["tests/test_integrations_ema_update.py"],
}


def frameworks() -> dict:
    """``{name: Requirement}`` from the ``integrations`` extra of pyproject.toml."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    return {Requirement(r).name: Requirement(r) for r in extras["integrations"]}


def torch_pin() -> str:
    """The torch line of constraints.txt (the CPU wheel on disk): every venv here installs it."""
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        return next(line.strip() for line in f if line.startswith("torch=="))


def released(name: str) -> list:
    """The final releases of ``name`` that pip would install on this Python, oldest first."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True,
                         text=True, check=True).stdout
    found = re.search(r"Available versions: (.*)", out)
    if found is None:
        raise RuntimeError(f"pip index versions {name} listed no versions:\n{out}")
    versions = [Version(v.strip()) for v in found.group(1).split(",")]
    return sorted(v for v in versions if not v.is_prerelease and not v.is_devrelease)


def allowed(requirement: Requirement) -> list:
    """The releases the requirement's range allows, oldest first."""
    found = [v for v in released(requirement.name) if requirement.specifier.contains(v)]
    if not found:
        raise RuntimeError(f"no release of {requirement.name} satisfies {requirement.specifier}")
    return found


def ends(requirement: Requirement) -> list:
    """The oldest and newest releases the requirement's range allows (one if they coincide)."""
    found = allowed(requirement)
    return sorted({found[0], found[-1]})


#: How many older releases to try when the newest cannot be installed here (a dependency of it missing
#: from this machine's package index): the row then says so and tests the newest that installs.
FALLBACKS = 3


def check(name: str, version: Version, keep: bool) -> tuple:
    """Install the test extra with ``name==version`` in a fresh venv and run its tests.
    Returns (passed, summary line)."""
    work = tempfile.mkdtemp(prefix=f"compat-{name}-{version}-")
    venv = os.path.join(work, "venv")
    python = os.path.join(venv, "bin", "python")
    pins = os.path.join(work, "constraints.txt")
    with open(pins, "w") as f:
        f.write(f"{torch_pin()}\n{name}=={version}\n")
    extras = "test,integrations"
    steps = [
        [sys.executable, "-m", "venv", venv],
        [python, "-m", "pip", "install", "-q", "-c", pins, "-e", f"{ROOT}[{extras}]", f"{name}=={version}"],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            if not keep:
                subprocess.run(["rm", "-rf", work])
            return False, "install failed: " + _last_line(done.stderr or done.stdout)
    tests = [t for t in TESTS.get(name, []) if os.path.exists(os.path.join(ROOT, t))]
    if not tests:
        return False, "no tests for it in TESTS"
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                          capture_output=True, text=True)
    summary = _last_line(done.stdout)
    if not keep:
        subprocess.run(["rm", "-rf", work])
    return done.returncode == 0, summary


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def table(rows: list) -> str:
    out = ["| framework | version | range | result | tests |", "|---|---|---|---|---|"]
    for name, version, spec, passed, summary in rows:
        out.append(f"| {name} | {version} | `{spec}` | {'passed' if passed else '**failed**'} | {summary} |")
    return "\n".join(out)


def write_doc(text: str) -> None:
    """Replace what stands between the markers of docs/compatibility.md with ``text``."""
    with open(DOC) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise RuntimeError(f"{DOC} has no {BEGIN} ... {END} section to write the table into")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(DOC, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", nargs="*", help="names from the integrations extra (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="list the versions, install nothing")
    parser.add_argument("--keep", action="store_true", help="keep the venvs (their paths are printed)")
    parser.add_argument("--no-doc", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    known = frameworks()
    chosen = args.frameworks or list(known)
    unknown = [n for n in chosen if n not in known]
    if unknown:
        parser.error(f"not in the integrations extra: {', '.join(unknown)} (known: {', '.join(known)})")
    rows = []
    for name in chosen:
        releases = allowed(known[name])
        for version in ends(known[name]):
            if args.dry_run:
                print(f"{name} {version}")
                continue
            started = datetime.datetime.now()
            passed, summary = check(name, version, args.keep)
            if summary.startswith("install failed") and version == releases[-1]:
                note = f"{version} does not install here ({summary[len('install failed: '):]})"
                for older in list(reversed(releases[:-1]))[:FALLBACKS]:
                    passed, summary = check(name, older, args.keep)
                    if not summary.startswith("install failed"):
                        version, summary = older, f"{note}; the newest that does: {summary}"
                        break
                else:
                    summary = note
            took = (datetime.datetime.now() - started).total_seconds()
            print(f"{name} {version}: {'passed' if passed else 'FAILED'} ({summary}; {took:.0f} s)", flush=True)
            rows.append((name, version, known[name].specifier, passed, summary))
    if args.dry_run:
        return 0
    text = (f"Run on {datetime.date.today().isoformat()} with `python benchmarks/compat.py` (Python "
            f"{sys.version.split()[0]}, {torch_pin()} CPU; each row a fresh venv with only torch and that "
            "version pinned):\n\n" + table(rows))
    print(text)
    if not args.no_doc:
        write_doc(text)
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
