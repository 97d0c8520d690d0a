"""README.md's Python blocks run as pasted: every ```python block, in order, in one
namespace, in a fresh directory. A block that imports an optional extra which is not
installed is skipped, with the reason; the blocks after it still run, so no block may use
names that only an optional block defines."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

#: Optional packages a README block may need: import name -> pip extra.
OPTIONAL = {"torch": "torch", "prometheus_client": "prometheus", "matplotlib": "plot"}


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def missing_extra(block: str) -> str | None:
    """Why ``block`` cannot run here (an optional package it imports is absent), or None."""
    for node in ast.walk(ast.parse(block)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top == "embstore" and name.startswith("embstore.torch"):
                top = "torch"
            if top in OPTIONAL and importlib.util.find_spec(top) is None:
                return f"{top} is not installed (pip install '.[{OPTIONAL[top]}]')"
    return None


def test_readme_has_python_blocks() -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 3
    assert all(b.strip() for b in blocks)


def test_readme_python_blocks_run_as_pasted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    skipped = []
    for i, block in enumerate(python_blocks(README.read_text())):
        why = missing_extra(block)
        if why is not None:
            skipped.append(f"block {i + 1}: {why}")
            continue
        code = compile(block, f"README.md python block {i + 1}", "exec")
        exec(code, namespace)  # noqa: S102 - running the documentation is the test
    if skipped:
        pytest.skip("; ".join(skipped))


def test_missing_extra_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert missing_extra("import torch") == "torch is not installed (pip install '.[torch]')"
    assert "torch" in (missing_extra("from embstore.torch import EmbeddingBagCollection") or "")
    assert missing_extra("import numpy as np") is None
