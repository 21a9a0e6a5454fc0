"""The upgrade check of one file's ``megatron.core.hyper_comm_grid`` uses: :func:`grid_checks`.

Imports of the module (absent in a release) and method calls on the grids the file builds whose
method or keywords the new release lacks or moved (:mod:`parallel_state_ng.releases.hyper_comm_grid`).
"""

from __future__ import annotations

import ast
import inspect

from parallel_state_ng.releases import hyper_comm_grid as grid_facts
from parallel_state_ng.tools.port.source_scan import FileImports
from parallel_state_ng.tools.port.upgrade.parallel_state_uses import UseChecker
from parallel_state_ng.tools.port.upgrade.report import no_equivalent

__all__ = ["HYPER_COMM_GRID", "grid_checks"]

HYPER_COMM_GRID = "megatron.core.hyper_comm_grid"


# --------------------------------------------------------------------------- HyperCommGrid
def grid_checks(checker: UseChecker) -> None:
    """Imports of ``megatron.core.hyper_comm_grid`` and method calls on grids the file builds."""
    old, new, tree = checker.old, checker.new, checker.tree
    grid_names: set[str] = set()
    for alias, target in checker.bindings.items():
        if target in (HYPER_COMM_GRID, f"{HYPER_COMM_GRID}.HyperCommGrid") or target.startswith(HYPER_COMM_GRID + "."):
            grid_names.add(alias)
    imports = [n for n in checker.imports if _imports_grid(n, checker)]
    if not imports:
        return
    if not grid_facts.has_class(new) and grid_facts.has_class(old):
        for statement in imports:
            checker.grid_uses += 1
            checker.add(
                statement,
                "HyperCommGrid",
                ast.unparse(statement),
                f"{HYPER_COMM_GRID} does not exist in {new}",
                no_equivalent(old, new),
            )
        return
    if not grid_facts.has_class(old):
        return
    changed = grid_facts.differences(old, new)
    if not changed:
        return

    def is_class(expr: ast.expr) -> bool:
        qualified = _qualify(expr, checker.bindings)
        return qualified == f"{HYPER_COMM_GRID}.HyperCommGrid"

    instances: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and is_class(node.value.func):
            instances.update(ast.unparse(t) for t in node.targets)
        elif isinstance(node, ast.AnnAssign) and node.annotation is not None and is_class(node.annotation):
            instances.add(ast.unparse(node.target))
        elif isinstance(node, ast.arg) and node.annotation is not None and is_class(node.annotation):
            instances.add(node.arg)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if ast.unparse(node.func.value) not in instances or node.func.attr not in changed:
            continue
        method = node.func.attr
        before, after = changed[method]
        use = checker.text(node)
        if before is None:
            continue  # FROM lacks the method: not FROM's code
        checker.grid_uses += 1
        if after is None:
            checker.add(
                node, "HyperCommGrid", use, f"HyperCommGrid.{method} does not exist in {new}", no_equivalent(old, new)
            )
            continue

        def positional(sig: inspect.Signature) -> list[str]:
            return [p.name for p in list(sig.parameters.values())[1:] if p.kind is p.POSITIONAL_OR_KEYWORD]

        a, b = positional(before), positional(after)
        problems = [
            f"argument {i + 1} ({a[i]}) lands on {b[i] if i < len(b) else 'no parameter'} in {new}"
            for i in range(min(len(node.args), len(a)))
            if (b[i] if i < len(b) else None) != a[i]
        ]
        swallowed = any(p.kind is p.VAR_KEYWORD for p in after.parameters.values())
        dropped = [
            kw.arg for kw in node.keywords if kw.arg and kw.arg not in after.parameters and kw.arg in before.parameters
        ]
        problems += [
            f"keyword {k} does not exist in {new}" + (" (it would go to **kwargs)" if swallowed else "")
            for k in dropped
        ]
        if problems:
            fixes = (["pass the arguments by keyword"] if len(problems) > len(dropped) else []) + [
                f"drop {k}= ({no_equivalent(old, new)})" for k in dropped
            ]
            checker.add(node, "HyperCommGrid", use, "; ".join(problems), "; ".join(fixes))


def _imports_grid(node: ast.Import | ast.ImportFrom, file: FileImports) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == HYPER_COMM_GRID for a in node.names)
    module = file.module_of(node)
    return module == HYPER_COMM_GRID or (
        module == "megatron.core" and any(a.name == "hyper_comm_grid" for a in node.names)
    )


def _qualify(expr: ast.expr, bindings: dict[str, str]) -> str | None:
    if isinstance(expr, ast.Name):
        return bindings.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _qualify(expr.value, bindings)
        return None if base is None else f"{base}.{expr.attr}"
    return None
