"""The documentation's worked examples, as the tests run them."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_block(page: str, heading: str, level: int = 2) -> str:
    """The first Python block under the heading of `level` that starts with `heading`
    in `docs/<page>`."""
    marker = "#" * level + " "
    sections = re.split(rf"^{marker}", (DOCS / page).read_text(), flags=re.M)
    (section,) = [s for s in sections if s.startswith(heading)]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)
