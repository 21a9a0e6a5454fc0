"""Build the functions of one release's API from the release data and one implementation each.

Each behaviour has one implementation taking the union of every release's parameters;
:func:`exact_function` serves it with exactly the release's signature (a generated wrapper
when they differ) and makes it honour the no-globals scopes
(:mod:`parallel_state_ng.builders.scope`). See docs/releases.md and docs/compat.md.
"""

from __future__ import annotations

import inspect
import keyword
import types
from collections.abc import Callable
from typing import Any

from parallel_state_ng.builders import scope
from parallel_state_ng.releases import parallel_state as api
from parallel_state_ng.releases.new_code_path import GRID_FREE_FUNCTIONS, INITIALIZATION_PROBES
from parallel_state_ng.releases.parallel_state import REQUIRED, Param

__all__ = ["exact_function", "serve", "shape_of", "guard_of"]

#: A served function's behaviour inside a no-globals scope: ``None`` (unaffected), ``"refuse"``
#: (raise) or ``("probe", answer)`` (return ``answer``).
Guard = str | tuple[str, bool] | None


def guard_of(name: str) -> Guard:
    """How the served function ``name`` behaves inside a no-globals scope (see :data:`Guard`)."""
    if name in GRID_FREE_FUNCTIONS:
        return None
    if name in INITIALIZATION_PROBES:
        return ("probe", INITIALIZATION_PROBES[name])
    return "refuse"


def shape_of(fn: Callable) -> tuple[Param, ...]:
    """``(name, default)`` of every parameter of ``fn`` (``REQUIRED`` without default).

    Raises:
        TypeError: ``fn`` has a parameter that is not positional-or-keyword.
    """
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            raise TypeError(
                f"{fn.__qualname__}: parameter {p.name!r} is {p.kind.name}; only positional-or-keyword is served"
            )
        out.append((p.name, REQUIRED if p.default is inspect.Parameter.empty else p.default))
    return tuple(out)


def _same(a: tuple[Param, ...], b: tuple[Param, ...]) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and type(x[1]) is type(y[1]) and x[1] == y[1] for x, y in zip(a, b, strict=True)
    )


def _copy(fn: Callable, name: str, module: str) -> Callable:
    copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__doc__, copy.__module__, copy.__qualname__ = fn.__doc__, module, name
    copy.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    return copy


def serve(release: Any, module: str, implementations: dict[str, Callable]) -> dict[str, Callable]:
    """Every public function of ``release``, built on ``implementations`` (name -> function).

    An implementation takes the union of every release's parameters, with defaults meaning
    what releases without a parameter do (``with_gtp_remat=False`` before 0.19).

    Raises:
        KeyError: a function of the release has no implementation.
    """
    out = {}
    for name, params in api.functions(release).items():
        if name not in implementations:
            raise KeyError(f"compat has no implementation of {name} (megatron-core {release})")
        out[name] = exact_function(name, params, implementations[name], module, guard_of(name))
    return out


def exact_function(name: str, params: tuple[Param, ...], impl: Callable, module: str, guard: Guard = None) -> Callable:
    """A function named ``name`` with exactly ``params`` that runs ``impl``.

    ``impl`` must accept every name in ``params`` as a keyword. Without a ``guard``, returns
    ``impl`` itself (a copy named ``name``) when its signature equals ``params``; otherwise, or
    with a ``guard``, a generated wrapper (no ``__wrapped__``, so ``inspect.signature`` reports
    the wrapper's own parameters) that first checks the no-globals scope as ``guard`` says and
    forwards by keyword: positional calls and Python's own ``TypeError`` are the release's.
    """
    impl_params = shape_of(impl)
    accepted = {n for n, _ in impl_params}
    unknown = [n for n, _ in params if n not in accepted]
    if unknown:
        raise TypeError(f"implementation of {name} does not accept {unknown}")
    same = _same(impl_params, params)
    if same and guard is None:
        return _copy(impl, name, module)
    for n, _ in params:
        if not n.isidentifier() or keyword.iskeyword(n) or n.startswith("__psng"):
            raise ValueError(f"cannot serve parameter name {n!r} of {name}")
    namespace: dict[str, Any] = {"__psng_impl": impl, "__psng_refusing": scope.REFUSING}
    header, forward = [], []
    for i, (n, default) in enumerate(params):
        if default is REQUIRED:
            header.append(n)
        else:
            namespace[f"__psng_d{i}"] = default
            header.append(f"{n}=__psng_d{i}")
        forward.append(n if same else f"{n}={n}")
    check = ""
    if guard == "refuse":
        namespace["__psng_refuse"] = scope.refuse
        check = f"    if __psng_refusing:\n        __psng_refuse({name!r})\n"
    elif isinstance(guard, tuple) and guard[0] == "probe":
        check = f"    if __psng_refusing:\n        return {bool(guard[1])!r}\n"
    elif guard is not None:
        raise ValueError(f"guard of {name} must be None, 'refuse' or ('probe', bool), got {guard!r}")
    source = f"def {name}({', '.join(header)}):\n{check}    return __psng_impl({', '.join(forward)})\n"
    exec(compile(source, f"<compat.{name}>", "exec"), namespace)  # noqa: S102 - generated from data
    fn = namespace[name]
    fn.__doc__ = impl.__doc__
    fn.__module__ = module
    fn.__qualname__ = name
    if same:
        fn.__annotations__ = dict(getattr(impl, "__annotations__", {}))
    return fn
