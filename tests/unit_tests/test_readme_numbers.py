"""The README's speed table quotes docs/performance.md's current (top) table: every number of each
README row is in the row of the same configuration there, so a re-measurement that updates
performance.md and not the README fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def first_table(text: str, after: str) -> dict:
    """{first cell: the row's numbers} of the first markdown table after the line starting `after`."""
    lines = text[text.index(after):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = [float(n.replace(",", "")) for n in NUMBER.findall(" ".join(cells[1:]))]
    return rows


def test_every_readme_speed_number_is_in_the_same_row_of_performance_md():
    readme = first_table((ROOT / "README.md").read_text(), "## Speed")
    current = first_table((ROOT / "docs" / "performance.md").read_text(), "The latest figures")
    assert len(readme) >= 3 and all(readme.values()), readme
    for configuration, numbers in readme.items():
        assert configuration in current, f"README row {configuration!r} is not a row of performance.md's top table"
        missing = [n for n in numbers if n not in current[configuration]]
        assert not missing, f"{configuration}: README's {missing} are not in performance.md's {current[configuration]}"
