"""The quick loop stays honest: every test that conftest.py marks slow or multiprocess by name still exists (a
renamed test would silently lose its mark and slow `pytest -m "not slow"` down)."""

from __future__ import annotations

import ast

import conftest
import pytest
from paths import TESTS


@pytest.mark.parametrize("name", conftest.SLOW + conftest.MULTIPROCESS)
def test_a_marked_test_exists(name: str) -> None:
    where, function = name.split("::")
    tree = ast.parse((TESTS / where).read_text(encoding="utf-8"))
    defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert function in defined, f"tests/{where} has no {function}: update conftest.py's marks"


def test_the_multiprocess_folders_exist() -> None:
    assert all((TESTS / folder).is_dir() for folder in conftest.MULTIPROCESS_FOLDERS)
