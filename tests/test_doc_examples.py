"""Every Python example in README.md and the documentation site (docs/**/*.md) runs, on CPU, as written.

The convention (CONTRIBUTING.md, "Examples in the docs"):

- A page's ```python blocks run top to bottom in one fresh interpreter, sharing their names, as a reader
  pastes them one after the other. So a page's first block builds what its later blocks use (a tiny model,
  a few random batches), and nothing is downloaded.
- A block that cannot run on a CPU-only machine in one process (it needs CUDA, torchrun, several ranks, or
  a framework object the page cannot build in a few seconds) starts with a visible first line
  ``# compile-only: <why, and what runs it instead>``. Such a block is compiled, not run.
- A block followed by a paragraph that is exactly ``It prints:`` and a ```text block shows its output: the
  text block must be what the block writes to stdout, exactly.

docs/architecture.md and docs/testing.md are contributor pages outside the site (mkdocs.yml excludes them);
their blocks are left out here.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "# compile-only:"
NOT_SITE = {"docs/architecture.md", "docs/testing.md"}
# ```python / ```py fences at the start of a line (indented fences inside lists count too).
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?:python|py)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL
)


def pages() -> list:
    found = ["README.md"] + sorted(
        os.path.relpath(p, ROOT).replace(os.sep, "/")
        for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    )
    return [p for p in found if p not in NOT_SITE]


def blocks(page: str) -> list:
    """``(first line number, source)`` of each Python block of ``page``, dedented."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        text = fh.read()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start("body")) + 1
        out.append((line, textwrap.dedent(m.group("body"))))
    return out


# "It prints:" right after a Python block (blank lines only between), then the text block it prints
# (used with .match(text, pos), which anchors at pos).
SHOWN = re.compile(r"[ \t]*\n\n?It prints:\n\n```text\n(?P<out>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def shown_outputs(page: str) -> dict:
    """``{first line number: the output the page shows}`` for each Python block followed by ``It prints:``."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        text = fh.read()
    out = {}
    for m in FENCE.finditer(text):
        shown = SHOWN.match(text, m.end())
        if shown:
            out[text.count("\n", 0, m.start("body")) + 1] = shown.group("out")
    return out


def compile_only(source: str) -> bool:
    return source.lstrip().startswith(MARKER)


def runnable_pages() -> list:
    return [p for p in pages() if any(not compile_only(src) for _, src in blocks(p))]


def marked_blocks() -> list:
    return [
        pytest.param(page, line, src, id=f"{page}:{line}")
        for page in pages()
        for line, src in blocks(page)
        if compile_only(src)
    ]


# The child: read the page's blocks as JSON from stdin, run each in one namespace, with the page and the
# block's line in every traceback (compile() names the "file"). What each block prints is passed on to
# stdout and also written, by first line, as JSON to the file named by argv[1].
_RUNNER = """
import contextlib, io, json, sys
page, todo = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
printed = {}
for line, source in todo:
    code = compile("\\n" * (line - 1) + source, page, "exec")
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            exec(code, namespace)
    finally:
        sys.stdout.write(buffer.getvalue())
        printed[line] = buffer.getvalue()
        with open(sys.argv[1], "w", encoding="utf-8") as fh:
            json.dump(printed, fh)
"""


def run_page(page: str, tmp_path) -> tuple:
    """Run ``page``'s Python blocks as :data:`_RUNNER` does, in a fresh interpreter on the CPU, nothing
    downloaded; return ``(stdout, {first line number: what that block printed})``. Fails the calling test,
    with the output, if a block raises."""
    todo = [(line, src) for line, src in blocks(page) if not compile_only(src)]
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        MPLBACKEND="Agg",
    )
    printed_file = tmp_path / "printed.json"
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(printed_file)],
        input=json.dumps([page, todo]),
        text=True,
        capture_output=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, f"{page}: an example failed\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    printed = {int(line): out for line, out in json.loads(printed_file.read_text(encoding="utf-8")).items()}
    return done.stdout, printed


@pytest.mark.parametrize("page", runnable_pages())
def test_the_page_examples_run_on_cpu(page, tmp_path):
    _, printed = run_page(page, tmp_path)
    for line, shown in shown_outputs(page).items():
        assert printed[line] == shown, f"{page}:{line}: the page shows\n{shown}\nbut the block prints\n{printed[line]}"


@pytest.mark.parametrize("page,line,source", marked_blocks())
def test_compile_only_blocks_say_why_and_compile(page, line, source):
    reason = source.lstrip().splitlines()[0][len(MARKER) :].strip()
    assert len(reason) >= 10, f"{page}:{line}: say why the block cannot run, after {MARKER!r}"
    compile("\n" * (line - 1) + source, page, "exec")


def test_every_page_is_collected_and_the_convention_is_documented():
    assert "docs/getting-started.md" in runnable_pages() and "docs/how-to/distributed.md" in pages()
    assert sum(len(blocks(p)) for p in pages()) >= 40
    with open(os.path.join(ROOT, "CONTRIBUTING.md"), encoding="utf-8") as fh:
        assert MARKER in fh.read(), "CONTRIBUTING.md must document the compile-only convention"


def test_shown_outputs_are_found_only_right_after_their_block(tmp_path, monkeypatch):
    page = "a\n\n```python\nprint(1)\n```\n\nIt prints:\n\n```text\n1\n```\n\n```python\nx = 2\n```\n\ntext\n\n"
    page += "It prints:\n\n```text\n3\n```\n"
    (tmp_path / "page.md").write_text(page, encoding="utf-8")
    with monkeypatch.context() as patched:
        patched.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
        assert shown_outputs("page.md") == {4: "1\n"}
    for page in ("docs/how-to/spikes.md", "docs/how-to/audit.md"):  # the pages whose point is what they print
        assert shown_outputs(page), page


def test_the_fence_parser_finds_indented_blocks_and_skips_other_languages():
    text = "a\n\n```python\nx = 1\n```\n\n- item\n\n    ```py\n    y = 2\n    ```\n\n```bash\nls\n```\n"
    found = [textwrap.dedent(m.group("body")) for m in FENCE.finditer(text)]
    assert found == ["x = 1\n", "y = 2\n"]
