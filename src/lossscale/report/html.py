"""A small, self-contained HTML writer for the reports (inline CSS; images are the PNGs beside it)."""

from __future__ import annotations

import html
import os
import tempfile
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

__all__ = ["Section", "write_html", "check_out_dir", "VERDICTS"]

#: Verdicts a section may carry, and their badge colours.
VERDICTS = {"HELD": "#1a7f37", "NOT HELD": "#cf222e"}

_CSS = """
body{font:15px/1.5 -apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#1f2328;max-width:1080px;
margin:0 auto;padding:24px 28px 60px;background:#fff}
h1{font-size:26px;margin:0 0 4px} h2{font-size:20px;margin:34px 0 6px;padding-top:14px;border-top:1px solid #d0d7de}
.sub{color:#59636e;margin:0 0 18px}
.badge{display:inline-block;padding:1px 9px;border-radius:12px;color:#fff;font-size:13px;font-weight:600;
vertical-align:middle;margin-left:8px}
.claim{background:#f6f8fa;border-left:4px solid #8c959f;padding:8px 12px;margin:8px 0 12px}
table{border-collapse:collapse;margin:8px 0 12px;font-size:14px}
td,th{border:1px solid #d0d7de;padding:4px 10px;text-align:left;vertical-align:top}
th{background:#f6f8fa} td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.wrap{font-size:13px} table.wrap td.num{white-space:normal}
.ok{color:#1a7f37;font-weight:600} .bad{color:#cf222e;font-weight:600} .wait{color:#9a6700;font-weight:600}
figure{margin:10px 0 18px} figure img{max-width:100%;border:1px solid #d0d7de}
figcaption{color:#59636e;font-size:13px} pre{background:#f6f8fa;padding:10px;overflow-x:auto;font-size:11.5px}
.method{color:#333}
.foot{color:#59636e;font-size:13px;margin-top:40px}
"""


@dataclass
class Section:
    """One report section (a claim, or a group of plots).

    Attributes:
        title: heading.
        verdict: "HELD", "NOT HELD" or None (no badge).
        claim: the statement under test (shown boxed).
        text: paragraphs (plain text; escaped).
        figures: ``(figure, value)`` rows of the measurement table.
        checks: ``(check, passed, detail)`` rows that decide the verdict.
        images: ``(png file name relative to the report, caption)``.
        grid: a comparison table ``(header, rows)`` of strings, or None.
        grid_wrap: let the grid's value cells wrap (a wide table that must fit the page).
        pre: preformatted text (e.g. a format table), or None.
        anchor: HTML id.
    """

    title: str
    verdict: Optional[str] = None
    claim: str = ""
    text: List[str] = field(default_factory=list)
    figures: List[Tuple[str, str]] = field(default_factory=list)
    checks: List[Tuple[str, Optional[bool], str]] = field(default_factory=list)
    images: List[Tuple[str, str]] = field(default_factory=list)
    grid: Optional[Tuple[Sequence[str], Sequence[Sequence[str]]]] = None
    grid_wrap: bool = False
    pre: Optional[str] = None
    anchor: str = ""


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)


def _badge(verdict: Optional[str]) -> str:
    if not verdict:
        return ""
    return f'<span class="badge" style="background:{VERDICTS.get(verdict, "#59636e")}">{_e(verdict)}</span>'


def _section(sec: Section) -> str:
    out = [f'<h2 id="{_e(sec.anchor)}">{_e(sec.title)}{_badge(sec.verdict)}</h2>']
    if sec.claim:
        out.append(f'<div class="claim"><b>Claim.</b> {_e(sec.claim)}</div>')
    out.extend(f"<p>{_e(p)}</p>" for p in sec.text)
    if sec.figures:
        out.append("<table><tr><th>measured</th><th>value</th></tr>")
        out.extend(f'<tr><td>{_e(k)}</td><td class="num">{_e(v)}</td></tr>' for k, v in sec.figures)
        out.append("</table>")
    if sec.grid:
        header, rows = sec.grid
        cls = ' class="wrap"' if sec.grid_wrap else ""
        out.append(f"<table{cls}><tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>")
        for row in rows:
            cells = [f"<td>{_e(row[0])}</td>"] + [f'<td class="num">{_e(c)}</td>' for c in row[1:]]
            out.append("<tr>" + "".join(cells) + "</tr>")
        out.append("</table>")
    if sec.checks:
        out.append("<table><tr><th>check</th><th>result</th><th>from the measurement</th></tr>")
        for name, ok, detail in sec.checks:
            cls, word = ("ok", "pass") if ok else ("bad", "fail")
            out.append(f'<tr><td>{_e(name)}</td><td class="{cls}">{word}</td><td>{_e(detail)}</td></tr>')
        out.append("</table>")
    if sec.pre:
        out.append(f"<pre>{_e(sec.pre)}</pre>")
    for src, caption in sec.images:
        out.append(f'<figure><img src="{_e(src)}" alt="{_e(caption)}"><figcaption>{_e(caption)}</figcaption></figure>')
    return "\n".join(out)


def check_out_dir(path) -> str:
    """Make sure ``path`` is a folder this process can write into, creating it if needed; return it.

    The commands call it before any work, so that a bad ``--out`` fails at once in one line instead
    of after a minute of training.

    Raises:
        ValueError: one line naming ``path`` and what is wrong (a file is in the way, the folder
            cannot be created, or it cannot be written to).
    """
    p = os.fspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"{p}: is a file, not a folder; pass a folder for the report (it is created if missing)")
    try:
        os.makedirs(p, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):  # the only sure test of "writable" (root ignores mode bits)
            pass
    except OSError as e:
        raise ValueError(f"{p}: cannot write the report there ({e.strerror or e}); pass a writable folder") from None
    return p


def write_html(
    path: str,
    title: str,
    sections: Sequence[Section],
    *,
    subtitle: str = "",
    summary: Sequence[Tuple[str, str, Optional[str], str]] = (),
    footer: str = "",
) -> str:
    """Write ``path``: a title, an optional summary table, the sections, a footer. Returns ``path``.

    ``summary``: ``(anchor, title, verdict, key figure)`` rows, linked to their sections.
    """
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width,initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
    ]
    if subtitle:
        parts.append(f'<p class="sub">{_e(subtitle)}</p>')
    if summary:
        parts.append("<table><tr><th>claim</th><th>verdict</th><th>measured</th></tr>")
        for anchor, name, verdict, figure in summary:
            cls = {"HELD": "ok", "NOT HELD": "bad"}.get(verdict or "", "wait")
            parts.append(
                f'<tr><td><a href="#{_e(anchor)}">{_e(name)}</a></td><td class="{cls}">{_e(verdict or "")}'
                f"</td><td>{_e(figure)}</td></tr>"
            )
        parts.append("</table>")
    parts.extend(_section(s) for s in sections)
    if footer:
        parts.append(f'<p class="foot">{_e(footer)}</p>')
    parts.append("</body></html>\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(parts))
    return path
