"""Rules the test suite keeps about itself, checked on its own source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ITERATORS = {"product", "permutations", "combinations", "chain", "zip", "map", "filter"}


def one_shot_parametrizations(source: str) -> list[int]:
    """Lines where `pytest.mark.parametrize` is given an iterator (consumed once; pytest 10
    refuses it) instead of a list or tuple."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "parametrize" and len(node.args) > 1:
            values = node.args[1]
            called = values.func if isinstance(values, ast.Call) else None
            name = getattr(called, "attr", None) or getattr(called, "id", None)
            if isinstance(values, ast.GeneratorExp) or name in ITERATORS:
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda p: p.name)
def test_parametrize_takes_lists_not_iterators(path):
    assert one_shot_parametrizations(path.read_text()) == [], f"{path.name}: wrap the values in list(...)"


def test_the_rule_sees_an_iterator():
    source = "@pytest.mark.parametrize('a, b', itertools.product([1], [2]))\ndef test(a, b): pass\n"
    assert one_shot_parametrizations(source) == [1]
    assert one_shot_parametrizations(source.replace("itertools.product(", "list(itertools.product(")
                                     .replace("]))", "])))")) == []
