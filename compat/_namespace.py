"""The module namespace of ``compat.parallel_state``, as seen by the modules implementing it.

Megatron code reads and assigns the served release's globals (``_TENSOR_MODEL_PARALLEL_GROUP``,
...) on the facade module itself, and patches its functions there; the implementations must
see those values. They reach the facade's namespace through :data:`facade`, an attribute view
of that module's ``__dict__`` which the facade attaches when it is executed. The implementing
modules therefore never import the facade module (which imports them): the import graph has no
circle.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FacadeNamespace", "facade"]


class FacadeNamespace:
    """Attribute access to one module's namespace (``facade.X`` reads ``namespace["X"]``)."""

    __slots__ = ("_namespace",)

    def __init__(self) -> None:
        object.__setattr__(self, "_namespace", None)

    def attach(self, namespace: dict[str, Any]) -> None:
        """Serve ``namespace`` (the facade module's ``globals()``) from now on."""
        object.__setattr__(self, "_namespace", namespace)

    @property
    def namespace(self) -> dict[str, Any]:
        """The attached namespace.

        Raises:
            RuntimeError: nothing is attached yet (``compat.parallel_state`` was not imported).
        """
        namespace: dict[str, Any] | None = object.__getattribute__(self, "_namespace")
        if namespace is None:
            raise RuntimeError(
                "compat.parallel_state has not been imported: import it before calling compat's internals"
            )
        return namespace

    def __getattr__(self, name: str) -> Any:
        try:
            return self.namespace[name]
        except KeyError:
            raise AttributeError(f"compat.parallel_state has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self.namespace[name] = value


#: The namespace of ``compat.parallel_state`` (attached by that module).
facade = FacadeNamespace()
