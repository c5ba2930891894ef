"""``draftwise``'s public names: one list (``_EXPORTS``), which ``__all__``, the lazy lookup and the
typing-only imports all agree with."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

import draftwise


def _typing_imports() -> dict[str, str]:
    """Name -> module of the re-exports under ``if TYPE_CHECKING:`` in ``draftwise/__init__.py``."""
    tree = ast.parse(inspect.getsource(draftwise))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    found = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            assert alias.asname == alias.name, "re-exports keep their names (X as X)"
            found[alias.name] = node.module
    return found


def test_all_the_lazy_table_and_the_typing_imports_name_the_same_things():
    assert draftwise.__all__ == sorted(draftwise._EXPORTS)
    assert _typing_imports() == draftwise._EXPORTS


@pytest.mark.parametrize("name", draftwise.__all__)
def test_every_public_name_resolves_to_its_module_object(name):
    assert getattr(draftwise, name) is getattr(importlib.import_module(draftwise._EXPORTS[name]), name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        draftwise.nothing  # noqa: B018
