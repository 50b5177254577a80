"""A griffe extension for the API reference (mkdocs.yml): the public names of a
kvstate package without ``__all__`` are those it re-exports as ``from .x import a as a``
(PEP 484's explicit re-export, which mypy reads the same way). Griffe takes every
imported name for private; where a module has ``__all__``, that alone still decides."""

from __future__ import annotations

import ast
from typing import Any

import griffe


class RedundantAliases(griffe.Extension):
    def on_module_members(
        self, *, node: ast.AST | griffe.ObjectNode, mod: griffe.Module, **kwargs: Any
    ) -> None:
        if mod.exports is not None or not isinstance(node, ast.Module):
            return
        for statement in node.body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                for name in statement.names:
                    if name.asname == name.name and name.name in mod.members:
                        mod.members[name.name].public = True
