"""The public modules say what is public: each has `__all__`, every name in it exists and has a
docstring, and `help()` of the framework modules lists their functions, not what they import."""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = {"mfa_native": None, "mfa_native.reference": None, "mfa_native.torch": "torch", "mfa_native.mlx": "mlx.core"}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_public_name_exists_and_has_a_docstring(name):
    if MODULES[name]:
        pytest.importorskip(MODULES[name])
    module = importlib.import_module(name)
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    undocumented = [n for n in module.__all__ if not (inspect.getdoc(getattr(module, n)) or "").strip()]
    assert undocumented == []
    assert not {"np", "mx", "torch", "Op", "Call"} & set(module.__all__)
