"""Shared helpers: where the committed fixtures are, and directory comparison."""

from __future__ import annotations

import filecmp
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"


def cases():
    """The merge cases whose expected directories transformers wrote."""
    with open(FIXTURES / "expected" / "cases.json") as f:
        return [c for c in json.load(f)["cases"] if "expected_dir" in c]


def same_tree(a: Path, b: Path) -> list:
    """Names of files that differ or exist on one side only (empty when identical).
    unshard's record of a merge (unshard.json) is compared only when both sides
    have one: transformers writes none."""
    left = sorted(p.name for p in a.iterdir())
    right = sorted(p.name for p in b.iterdir())
    if ("unshard.json" in left) != ("unshard.json" in right):
        left = [n for n in left if n != "unshard.json"]
        right = [n for n in right if n != "unshard.json"]
    problems = sorted(set(left) ^ set(right))
    for name in sorted(set(left) & set(right)):
        if not filecmp.cmp(a / name, b / name, shallow=False):
            problems.append(name)
    return problems


@pytest.fixture
def slow_engine(monkeypatch):
    """Slows every block the engine writes, so that a cancellation lands mid-merge."""
    monkeypatch.setenv("UNSHARD_TEST_WINDOW_DELAY_MS", "150")
    yield


def leftovers(parent: Path, name: str) -> list:
    """Staging directories of `name` left in `parent`."""
    return [p.name for p in parent.iterdir() if p.name != name and name in p.name]


__all__ = ["ROOT", "FIXTURES", "cases", "same_tree", "leftovers", "os"]
