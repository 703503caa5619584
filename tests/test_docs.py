"""The READMEs, the documentation site and the package metadata say what the code does: the set-up commands CI
runs, the package page's quick start (run as written), the README's switch and defaults, an API reference
entry for every public name, user pages free of issue numbers and commits, the license and the typing marker."""

from __future__ import annotations

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


SETUP = [
    'pip install -c constraints.txt -e ".[demo]" && lossscale demo',
    'pip install -c constraints.txt -e ".[test]" && python -m pytest -q',
]
# The pages users read: README.md, the package page, and the site (docs/ without the two contributor pages,
# which mkdocs.yml excludes).
CONTRIBUTOR_PAGES = {"docs/architecture.md", "docs/testing.md"}


def _user_pages() -> list:
    import glob

    docs = sorted(
        os.path.relpath(p, ROOT).replace(os.sep, "/")
        for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    )
    return ["README.md", "README.pypi.md"] + [p for p in docs if p not in CONTRIBUTOR_PAGES]


def _sections(text: str) -> list:
    return re.findall(r"^## (.+)$", text, flags=re.MULTILINE)


def test_readme_reads_in_the_order_a_newcomer_needs_and_stays_short():
    text = _read("README.md")
    assert len(text.splitlines()) < 150
    title, pitch = text.split("\n\n")[:2]
    assert title == "# lossscale" and "torch.amp.GradScaler" in pitch and "```" not in pitch
    assert _blocks(text, "bash")[0] == "pip install .\n"  # the first command a user meets works today
    assert _sections(text)[:5] == [
        "Switch from torch",
        "Defaults that differ from torch's",
        "What no other scaler does",
        "From a checkout",
        "Documentation",
    ]
    assert text.index("```diff") < text.index("| keyword |") < text.index("## What no other scaler does")
    for picture in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):  # the demo's pictures, committed and small
        assert os.path.getsize(os.path.join(ROOT, picture)) < 150_000, picture
    for target in re.findall(r"\]\(((?:docs/|CONTRIBUTING)[^)#]+)", text):
        assert os.path.isfile(os.path.join(ROOT, target)), target


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/getting-started.md"])
def test_the_first_command_works_today_and_pip_install_lossscale_is_marked_as_the_future(page):
    """lossscale is not on PyPI: the front pages install from a checkout, and name `pip install lossscale`
    only in a sentence that says it is not available yet."""
    text = _read(page)
    assert _blocks(text, "bash")[0] == "pip install .\n", page
    before = text.split("```bash", 1)[0]
    assert "not on PyPI yet" in " ".join(before.split()) and "checkout" in before, page
    for paragraph in text.split("\n\n"):
        if re.search(r"pip install \"?lossscale\b", paragraph):
            assert "not yet available" in " ".join(paragraph.split()), (page, paragraph)


def test_readme_keeps_the_two_setup_commands_and_ci_runs_the_test_one():
    text = _read("README.md")
    checkout = text.split("## From a checkout", 1)[1]
    assert _blocks(checkout, "bash")[0].splitlines() == SETUP
    # CI runs that very line (quietly) in a venv it has just made, so it tests what a fresh machine gets.
    ci = _read(".ci/run").splitlines()
    # In a subshell, so that a failed install stops CI (`set -e` ignores the first command of an && list).
    line = ci.index("(" + SETUP[1].replace("pip install", "pip install -q", 1) + ")")
    made = next(i for i, c in enumerate(ci) if c.startswith('python -m venv "$work/test-env"'))
    assert ci[made + 1 : line] == ['source "$work/test-env/bin/activate"']


def test_ci_builds_the_site_strictly_in_its_own_fresh_venv_one_command_a_line():
    ci = _read(".ci/run").splitlines()
    made = ci.index('python -m venv "$work/docs-env"')
    # The documentation tools only: not the package, whose dependencies pull torch (the CUDA build from PyPI).
    assert ci[made + 1] == '"$work/docs-env/bin/pip" install -q -c constraints.txt -r docs/requirements.txt'
    tools = [r.split("#")[0].strip() for r in _read("docs/requirements.txt").splitlines() if r.split("#")[0].strip()]
    assert tools and not any(re.match(r"(torch|lossscale|-e|\.)", r) for r in tools), tools
    pinned = {re.split(r"[=<>\[ ]", r, maxsplit=1)[0].lower() for r in _read("constraints.txt").splitlines()}
    assert all(re.split(r"[=<>\[ ]", r, maxsplit=1)[0].lower() in pinned for r in tools), "pin them in constraints.txt"
    assert re.fullmatch(r'(NO_MKDOCS_2_WARNING=1 )?"\$work/docs-env/bin/mkdocs" build --strict .*', ci[made + 2])
    assert "strict: true" in _read("mkdocs.yml")


def test_the_readme_diff_is_the_whole_switch_and_its_new_side_runs():
    """The diff's new side, with "cuda" read as this machine's device and a tiny model, trains."""
    import torch

    diff = _blocks(_read("README.md"), "diff")[0].splitlines()
    added = [line[1:] for line in diff if line.startswith("+")]
    assert added[:2] == [
        "import lossscale",
        "scaler = lossscale.GradScaler(model=model)      # model= only names parameters in reports",
    ]
    new_side = "\n".join(line[1:] for line in diff if not line.startswith("-"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)  # the same model and batch whichever tests ran before
    model = torch.nn.Linear(8, 4).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    namespace = dict(
        model=model,
        optimizer=optimizer,
        loss_fn=torch.nn.functional.cross_entropy,
        lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1),
        loader=[(torch.randn(4, 8, device=device), torch.randint(0, 4, (4,), device=device))] * 3,
    )
    exec(compile(new_side.replace('"cuda"', repr(device)), "README.md", "exec"), namespace)
    counters = namespace["scaler"].counters()
    # Unseeded, about 1 draw in 100 overflows the FP16 backward at 2**16 and skips a step (which holds
    # the LR schedule: the README's claim). Seeded, every step is taken; the check holds either way.
    assert counters["steps"] == 3 and counters["skipped_steps"] < 3
    assert namespace["lr_scheduler"].last_epoch == counters["steps"] - counters["skipped_steps"]


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


def _default_cells() -> dict:
    """The README's table of defaults that differ from torch's: keyword -> the default it states."""
    table = _read("README.md").split("## Defaults that differ from torch's", 1)[1].split("\n\n")[1]
    rows = [r.split("|")[1:-1] for r in table.splitlines()[2:]]
    return {cells[0].strip().strip("`"): cells[1].strip() for cells in rows}


def test_readme_defaults_table_states_the_code_defaults_and_each_restoring_keyword():
    """Every keyword in the table has the default the code has; the restoring keyword names it."""
    params = inspect.signature(lossscale.GradScaler.__init__).parameters
    policy = {f.name: f.default for f in dataclasses.fields(lossscale.DynamicPolicy)}
    code = {name: params[name].default if name in params else policy[name] for name in _default_cells()}
    assert set(code) == {"loss_check", "min_scale", "max_scale", "on_stuck", "device", "process_group"}
    for name, cell in _default_cells().items():
        stated = eval(re.match(r"`([^`]+)`", cell).group(1), {})
        assert stated == code[name], (name, stated, code[name])
    table = _read("README.md").split("## Defaults that differ from torch's", 1)[1].split("\n\n")[1]
    for row in table.splitlines()[2:]:
        name = row.split("|")[1].strip().strip("`")
        assert f"`{name}=" in row.split("|")[4], f"{name}: the restoring keyword is {row.split('|')[4]!r}"


def _reference_directives() -> set:
    import glob

    found = set()
    for page in glob.glob(os.path.join(ROOT, "docs", "reference", "*.md")):
        with open(page, encoding="utf-8") as fh:
            found |= set(re.findall(r"^::: ([\w.]+)$", fh.read(), flags=re.MULTILINE))
    return found


def _hand_written_entries() -> dict:
    """Reference entries written by hand, for public names mkdocstrings cannot render from lossscale's source
    (a re-export of torch's): ``{name: the section under its heading "## `lossscale.<name>`"}``."""
    import glob

    found = {}
    for page in glob.glob(os.path.join(ROOT, "docs", "reference", "*.md")):
        with open(page, encoding="utf-8") as fh:
            text = fh.read()
        for m in re.finditer(r"^#+ `lossscale\.(\w+)`\n(.*?)(?=^#|\Z)", text, flags=re.MULTILINE | re.DOTALL):
            found[m.group(1)] = m.group(2)
    return found


def test_the_api_reference_covers_every_public_name():
    import enum
    import importlib
    import types

    directives = _reference_directives()
    by_hand = _hand_written_entries()
    for name in lossscale.__all__:
        obj = getattr(lossscale, name)
        path = obj.__name__ if isinstance(obj, types.ModuleType) else f"{obj.__module__}.{obj.__qualname__}"
        if path.startswith("lossscale."):
            assert path in directives, f"lossscale.{name}: no '::: {path}' in docs/reference/"
            continue
        # Re-exported from torch: griffe cannot follow it into torch, so the entry is written by hand, saying
        # where it comes from and, for an enum, every member with its value.
        assert name in by_hand, f"lossscale.{name} ({path}): no heading '## `lossscale.{name}`' in docs/reference/"
        assert f"`lossscale.{name} is {path}`" in by_hand[name], name
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            rows = re.findall(rf"^\| `{name}\.(\w+)` \| (\S+) \|", by_hand[name], flags=re.MULTILINE)
            assert rows == [(m.name, repr(m.value)) for m in obj], (name, rows)
    integrations = importlib.import_module("lossscale.integrations")
    page = _read("docs/reference/integrations.md")
    for module_name in integrations.__all__:
        path = f"lossscale.integrations.{module_name}"
        assert path in directives, path
        module = importlib.import_module(path)
        for name in module.__all__:  # a member rendered, or a class built on first access described in its module
            assert re.search(
                rf"^::: {re.escape(path)}\n(    .*\n)*?      members: \[[^\]]*\b{name}\b", page, flags=re.MULTILINE
            ) or f"``{name}(" in (module.__doc__ or ""), f"{path}.{name}"


@pytest.mark.parametrize("page", _user_pages())
def test_user_pages_name_no_issue_commit_or_seed_and_date_only_measurements(page):
    text = _read(page)
    assert not re.search(r"\b(issue|session|PR) #?\d+", text, flags=re.IGNORECASE), page
    assert not re.search(r"#\d{3,}", text), f"{page}: an issue or pull-request number"
    assert not re.search(r"\bthe seed\b", text, flags=re.IGNORECASE), page
    commits = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not commits, f"{page}: commit hashes {commits}"
    for line in text.splitlines():
        if re.search(r"\b20\d\d-\d\d-\d\d\b", line):
            assert re.search(r"measured|Run on|committed", line), f"{page}: a date that dates no measurement: {line}"
        assert len(line) <= (400 if line.startswith("|") or line.startswith("Run on") else 200), f"{page}: {line[:60]}"


@pytest.mark.parametrize("page", _user_pages() + ["CONTRIBUTING.md", *sorted(CONTRIBUTOR_PAGES)])
def test_headings_carry_no_attribute_lists_which_github_shows_as_text(page):
    """The pages render on GitHub as they are (CONTRIBUTING.md): a heading's anchor is mkdocs' automatic slug,
    not an attr_list ``{ #anchor }``, which GitHub prints as part of the heading."""
    text = re.sub(r"^```.*?^```", "", _read(page), flags=re.MULTILINE | re.DOTALL)
    marked = [line for line in text.splitlines() if re.match(r"#+ ", line) and re.search(r"\{\s*[#.:]", line)]
    assert not marked, f"{page}: {marked}"


def test_every_site_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", _read("mkdocs.yml"), flags=re.MULTILINE))
    site = {p[len("docs/") :] for p in _user_pages() if p.startswith("docs/")}
    assert nav == site, (sorted(nav - site), sorted(site - nav))


def test_on_step_is_documented_beside_the_other_hooks():
    page = _read("docs/how-to/schedulers-and-hooks.md")
    assert "scaler.on_step(" in page and "handle.remove()" in page


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
    versions = {
        c.rsplit(" ", 1)[-1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")
    }
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in versions
    assert project["requires-python"] == f">={min(versions, key=lambda v: tuple(map(int, v.split('.'))))}"
    assert _read("LICENSE").lstrip().startswith("Apache License\n                           Version 2.0")
    assert os.path.isfile(os.path.join(os.path.dirname(lossscale.__file__), "py.typed"))
    assert meta["tool"]["setuptools"]["package-data"]["lossscale"] == ["py.typed"]
