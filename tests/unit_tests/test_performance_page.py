"""docs/performance.md is the current page (DESIGN.md section 7): a re-measurement replaces the figure there
and moves the old one to docs/performance_history.md, so the page stays short."""

from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "performance.md"
MAX_LINES = 400


def test_performance_page_stays_under_400_lines():
    lines = len(PAGE.read_text().splitlines())
    assert lines < MAX_LINES, (f"docs/performance.md has {lines} lines (limit {MAX_LINES}): move superseded "
                               "measurements to docs/performance_history.md")
