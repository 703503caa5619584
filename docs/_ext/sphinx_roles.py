"""A griffe extension for the API reference (mkdocs.yml loads it): reST habits in docstrings, read as Markdown.

Some docstrings are written for `help()` and Sphinx: roles (:meth:`update`, :class:`~lossscale.X`), a
paragraph ending in "::" before an indented literal block, and bare doctest lines (">>> ..."), which
Markdown would show as the role's raw text, a stray "::" and nested block quotes. Before mkdocstrings
renders a docstring, this rewrites them: a role becomes a code span, "::" becomes ":" (the indented block
after it is Markdown's code block already), and a run of doctest lines at the left margin becomes a fenced
`pycon` block. The docstrings themselves stay as they are.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc):`~?([^`]+)`")
LITERAL = re.compile(r"::$", re.MULTILINE)


def _fence_doctests(text: str) -> str:
    out, block = [], []
    for line in text.split("\n") + [""]:
        if line.startswith(">>>") or (block and line.strip() and not line.startswith(" ")):
            block.append(line)
            continue
        if block:
            out += ["```pycon", *block, "```"]
            block = []
        out.append(line)
    return "\n".join(out[:-1])


def markdown(text: str) -> str:
    text = ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = LITERAL.sub(":", text)
    return _fence_doctests(text)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring griffe loads (see the module docstring)."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
