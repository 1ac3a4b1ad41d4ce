"""The report as one HTML page a reviewer opens (`kopt export RUN --format html`, report.html): the
report.md text (header, per-shape table, held-out and rounds tables, machine and toolchain) with its
charts inline, the diff of the best against the baseline, and the run's history folded away. One file,
no network: styles inline, charts as data URIs, nothing fetched.

report.md is the one source of the words; this module renders the subset of Markdown it writes
(headings, paragraphs, lists, tables, images, `code` and **bold**).
"""

from __future__ import annotations

import base64
import html
import re

STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 72rem; margin: 2rem auto;
       padding: 0 1rem; color: #1b1f24; background: #fff; }
h1 { font-size: 1.6rem; border-bottom: 2px solid #d0d7de; padding-bottom: .3rem; }
h2 { font-size: 1.25rem; margin-top: 2rem; border-bottom: 1px solid #d0d7de; padding-bottom: .2rem; }
table { border-collapse: collapse; margin: .6rem 0; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d0d7de; padding: .25rem .6rem; text-align: left; }
th { background: #f6f8fa; }
code { background: #f6f8fa; padding: .05rem .3rem; border-radius: 4px; font-size: .92em; }
pre { background: #f6f8fa; padding: .8rem; overflow-x: auto; font-size: 13px; line-height: 1.35; }
pre .add { color: #116329; background: #dafbe1; } pre .del { color: #82071e; background: #ffebe9; }
pre .hunk { color: #6639ba; }
figure { display: inline-block; margin: .5rem 1rem .5rem 0; } figure img { max-width: 100%; width: 34rem; }
figcaption { font-size: .85rem; color: #57606a; }
strong { color: #82071e; }
details summary { cursor: pointer; font-weight: 600; margin: 1rem 0; }
"""


def render_html(markdown: str, charts: dict[str, bytes], diff: str = "", history: str = "", title: str = "") -> str:
    """The page: `markdown` (render_markdown's report) as HTML with `charts` (file name -> PNG) inline
    where it links them, then the best's `diff` and the run's `history` (each left out where empty)."""
    body = _blocks(markdown, charts)
    if diff.strip():
        body.append("<h2>Diff of the best against the baseline</h2>")
        body.append(f"<pre class='diff'>{''.join(_diff_line(line) for line in diff.splitlines())}</pre>")
    if history.strip():
        body.append(f"<details><summary>History (every round, prompt and response)</summary>"
                    f"<pre>{html.escape(history)}</pre></details>")  # fmt: skip
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><meta name='viewport' "
            f"content='width=device-width, initial-scale=1'><title>{html.escape(title or 'kopt report')}</title>"
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")  # fmt: skip


def _blocks(markdown: str, charts: dict[str, bytes]) -> list[str]:
    out: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            out.append(_table(rows))
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{_inline(lines[i][2:])}</li>")
                i += 1
            out.append(f"<ul>{''.join(items)}</ul>")
        elif re.fullmatch(r"!\[[^\]]*\]\([^)]+\)", line.strip()):
            figures = []
            while i < len(lines) and re.fullmatch(r"!\[[^\]]*\]\([^)]+\)", lines[i].strip()):
                caption, name = re.fullmatch(r"!\[([^\]]*)\]\(([^)]+)\)", lines[i].strip()).groups()
                figures.append(_figure(name, caption, charts))
                i += 1
            out.append("<div class='charts'>" + "".join(figures) + "</div>")
        else:
            para = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|", "- ", "![")):
                para.append(lines[i])
                i += 1
            out.append(f"<p>{_inline(' '.join(para))}</p>")
    return out


def _table(rows: list[list[str]]) -> str:
    head, body = rows[0], [r for r in rows[1:] if not all(set(c) <= {"-", ":"} for c in r)]
    cells = "".join(f"<th>{_inline(c)}</th>" for c in head)
    trs = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{trs}</tbody></table>"


def _figure(name: str, caption: str, charts: dict[str, bytes]) -> str:
    png = charts.get(name)
    if png is None:
        return f"<figure><figcaption>{html.escape(caption)} ({html.escape(name)}: not available)</figcaption></figure>"
    data = base64.b64encode(png).decode()
    return (f"<figure><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _inline(text: str) -> str:
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    return out


def _diff_line(line: str) -> str:
    kind = ("add" if line.startswith("+") and not line.startswith("+++") else
            "del" if line.startswith("-") and not line.startswith("---") else
            "hunk" if line.startswith("@@") else "")  # fmt: skip
    text = html.escape(line)
    return f"<span class='{kind}'>{text}</span>\n" if kind else f"{text}\n"
