"""The report page (frontend/report_html.py): report.md's subset of Markdown as HTML, charts inline, the
diff coloured, text escaped, nothing fetched. tests/test_cli.py checks a real run's page (and renders it in
headless Chromium where one is installed)."""

from __future__ import annotations

import base64

from frontend.report_html import render_html

MD = """# kopt report: k (cpu)

- run: `r` (Temporal run `t`)

## Best: `c` (round 1), geomean speedup 1.100x

| shape | dtype | baseline us | best us | speedup |
| --- | --- | --- | --- | --- |
| T=1 | float16 | 10.00 | 9.00 | 1.111 |

**OVERFIT: the best wins <script>alert(1)</script>.**

![per-shape speedup](speedup.png)
![% of speed of light](sol.png)
"""
PNG = b"\x89PNG\r\n\x1a\n" + b"0" * 16


def test_the_page_has_the_reports_tables_charts_and_diff_and_fetches_nothing():
    page = render_html(MD, {"speedup.png": PNG}, "--- a/k\n+++ b/k\n@@ -1 +1 @@\n-old\n+new <b>\n", "round 1 ...",
                       title="kopt report: k (cpu)")
    assert "<h1>kopt report: k (cpu)</h1>" in page and "<li>run: <code>r</code>" in page
    assert "<th>baseline us</th>" in page and "<td>1.111</td>" in page and "| --- |" not in page
    assert "<strong>OVERFIT: the best wins &lt;script&gt;alert(1)&lt;/script&gt;.</strong>" in page
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")  # nothing runs, nothing fetched
    assert f"<img alt='speedup.png' src='data:image/png;base64,{base64.b64encode(PNG).decode()}'>" in page
    assert "sol.png: not available" in page  # a chart matplotlib did not draw: said, not a broken image
    assert "<span class='del'>-old</span>" in page and "<span class='add'>+new &lt;b&gt;</span>" in page
    assert "<details><summary>History" in page and "round 1 ..." in page


def test_no_history_and_no_diff_leave_their_sections_out():
    page = render_html("# kopt run x (running: no report yet)", {})
    assert "<h1>kopt run x (running: no report yet)</h1>" in page
    assert "Diff of the best" not in page and "<details>" not in page
