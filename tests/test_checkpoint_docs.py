"""docs/checkpoints.md keeps a complete resume example for each backend (tests/test_docs_blocks.py runs
every block of the page)."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "checkpoints.md"


def test_the_page_has_a_resume_example_per_backend():
    blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.M | re.S)
    for backend in ("numpy", "torch", "jax"):
        assert any(
            f"import {backend}" in b and "opt.save(" in b and "opt.load(" in b and "assert" in b
            for b in blocks
        ), backend
