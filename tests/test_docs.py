"""The READMEs and the package metadata say what the code does: the set-up commands CI runs, the package
page's quick start (run as written), the GradScaler signature, the license and the typing marker."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import sys

import pytest

import lossscale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def _blocks(text: str, lang: str):
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_readme_starts_with_the_two_setup_commands_and_ci_runs_the_test_one():
    text = _read("README.md")
    first = text.split("\n\n")[1]
    assert first == _blocks(text, "bash")[0].join(["```bash\n", "```"]), "README.md must open with its commands"
    demo, tests = _blocks(text, "bash")[0].splitlines()
    assert demo == 'pip install -c constraints.txt -e ".[demo]" && lossscale demo'
    assert tests == 'pip install -c constraints.txt -e ".[test]" && python -m pytest -q'
    # CI runs that very line (quietly) in a venv it has just made, so it tests what a fresh machine gets,
    # in a subshell, so that a failed install stops CI (`set -e` ignores the first command of an && list).
    ci = _read(".ci/run").splitlines()
    line = ci.index("(" + tests.replace("pip install", "pip install -q", 1) + ")")
    made = next(i for i, c in enumerate(ci) if c.startswith('python -m venv "$work/test-env"'))
    assert ci[made + 1 : line] == ['source "$work/test-env/bin/activate"']


def test_the_package_page_starts_with_pip_install_and_its_quick_start_runs():
    text = _read("README.pypi.md")
    assert text.startswith("# lossscale\n\n```bash\npip install lossscale\n```\n")
    quick = _blocks(text, "python")[0]
    assert len(quick.splitlines()) <= 16
    namespace = {}
    exec(compile(quick, "README.pypi.md", "exec"), namespace)  # as a user pastes it (on CPU here)
    scaler = namespace["scaler"]
    assert scaler.counters()["steps"] == 20
    assert "-e" not in text.split("## Contributing")[0], "development commands belong in Contributing"


def _signature_block() -> str:
    block = next(b for b in _blocks(_read("README.md"), "python") if b.startswith("GradScaler(device=None"))
    return re.sub(r"#.*", "", block).replace("*,", "")


def test_readme_signature_lists_every_argument_with_its_default():
    """Issue 21: the README's signature omitted ``loss_check`` and ``trace``."""
    call = ast.parse(_signature_block(), mode="eval").body
    documented = {kw.arg: eval(compile(ast.Expression(kw.value), "README.md", "eval"), {}) for kw in call.keywords}
    params = inspect.signature(lossscale.GradScaler.__init__).parameters
    own = [n for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD]
    policy = {f.name: f.default for f in dataclasses.fields(lossscale.DynamicPolicy)}
    assert list(documented)[: len(own)] == own
    assert {k: documented[k] for k in policy} == policy  # torch's four and the dynamic policy's own
    for name in own:
        default = params[name].default
        if name not in policy:  # the four torch-named ones default to the policy's (a sentinel here)
            assert documented[name] == default, name


def test_package_metadata_license_and_typing_marker():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        meta = tomllib.load(fh)
    project = meta["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert project["readme"]["file"] == "README.pypi.md"
    assert any(r.startswith("setuptools>=77") for r in meta["build-system"]["requires"])  # PEP 639 strings
    assert "Typing :: Typed" in project["classifiers"]
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639: the string only
    versions = {c.rsplit(" ", 1)[-1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")}
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in versions
    assert project["requires-python"] == f">={min(versions, key=lambda v: tuple(map(int, v.split('.'))))}"
    assert _read("LICENSE").lstrip().startswith("Apache License\n                           Version 2.0")
    assert os.path.isfile(os.path.join(os.path.dirname(lossscale.__file__), "py.typed"))
    assert meta["tool"]["setuptools"]["package-data"]["lossscale"] == ["py.typed"]
