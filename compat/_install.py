"""Patching machinery behind :func:`compat.install` / :func:`compat.uninstall`."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

from parallel_state_ng.releases.inference_shards import SHARDS_MODULE as INFERENCE_TARGET

TARGET = "megatron.core.parallel_state"
GRID_TARGET = "megatron.core.hyper_comm_grid"

# (namespace dict, attribute name, original value) for every rebinding, to undo it.
_patches: list[tuple[dict, str, Any]] = []
# What sys.modules[TARGET] was before install (None: absent).
_saved_module: list[Any] = []
# (our HyperCommGrid, megatron's) while install(hyper_comm_grid=True) is in effect.
_grid_swap: list[tuple[Any, Any]] = []
# (our inference-shard function, megatron's) for each name served from the engine.
_inference_swap: list[tuple[Any, Any]] = []


def is_installed() -> bool:
    """Whether install() is in effect."""
    return bool(_saved_module)


def _replacement_map(old: ModuleType, new: ModuleType) -> dict[int, Any]:
    """id(old object) -> new object, for the module itself and every public name of it."""
    mapping: dict[int, Any] = {id(old): new}
    for name, value in vars(old).items():
        if name.startswith("__") or isinstance(value, ModuleType):
            continue
        if getattr(value, "__module__", None) != old.__name__:
            continue  # imports of the module (torch, typing names, ...) are shared, not ours
        if hasattr(new, name):
            mapping[id(value)] = getattr(new, name)
    return mapping


def _rebind_everywhere(old: ModuleType, new: ModuleType, record: bool, prefix: str = "") -> None:
    """Replace references to ``old``'s objects held in loaded modules' namespaces.

    Only modules whose name starts with ``prefix`` are touched; compat's own never are.
    """
    mapping = _replacement_map(old, new)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is old or mod is new or mod_name.split(".")[0] == "compat":
            continue
        if not mod_name.startswith(prefix):
            continue
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            replacement = mapping.get(id(value))
            if replacement is not None and value is not replacement:
                if record:
                    _patches.append((namespace, attr, value))
                namespace[attr] = replacement


class _TargetFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves compat as ``megatron.core.parallel_state`` when megatron is not loaded yet.

    An entry in ``sys.modules`` alone would make ``import megatron.core.parallel_state`` return
    compat without importing ``megatron`` and ``megatron.core`` first (the name is then
    unbound: ``megatron.core`` missing). Found through ``sys.meta_path``, the import system
    loads the parents first and binds the attribute on ``megatron.core``.
    """

    def find_spec(self, fullname, path=None, target=None):
        """A spec for TARGET while installed, else None."""
        if fullname == TARGET and _saved_module:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        """Compat's module object itself (its own ``__spec__`` is kept, see exec_module)."""
        from . import parallel_state as ours

        self._own_spec = ours.__spec__
        return ours

    def exec_module(self, module):
        """Nothing to execute; undo the import system's ``__spec__`` overwrite."""
        module.__spec__ = self._own_spec


_FINDER = _TargetFinder()


def _rebind_object(old: Any, new: Any) -> None:
    """Point every name bound to ``old`` in loaded modules (not compat's) at ``new``; recorded."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name.split(".")[0] == "compat":
            continue
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is old:
                _patches.append((namespace, attr, value))
                namespace[attr] = new


def _served_grid_class() -> type:
    """Our grid class with the served release's surface (``UnsupportedReleaseError`` before 0.14,
    whose releases have no ``HyperCommGrid``).
    """
    from parallel_state_ng.builders.grid_releases import hyper_comm_grid_class

    from .parallel_state import MEGATRON_RELEASE

    return hyper_comm_grid_class(MEGATRON_RELEASE)


def _install_grid(ours: type) -> None:
    """Redirect ``megatron.core.hyper_comm_grid.HyperCommGrid`` (and names bound to it) to ``ours``.

    The module is imported if megatron is installed and it is not loaded yet, so that later
    ``from megatron.core.hyper_comm_grid import HyperCommGrid`` gets ours too.
    """
    module = sys.modules.get(GRID_TARGET)
    if module is None:
        if importlib.util.find_spec("megatron") is None:
            return  # no megatron: nothing can import its grid
        module = importlib.import_module(GRID_TARGET)
    original = module.__dict__.get("HyperCommGrid", _MISSING)
    if original is ours:
        return
    if original is not _MISSING:
        _rebind_object(original, ours)
    if module.__dict__.get("HyperCommGrid") is not ours:
        _patches.append((module.__dict__, "HyperCommGrid", original))
        module.__dict__["HyperCommGrid"] = ours
    _grid_swap[:] = [(ours, original)]


def _served_inference() -> dict[str, Any]:
    """Megatron's inference-shard function names the served release has -> the engine's functions."""
    from parallel_state_ng.releases.inference_shards import SERVED_FUNCTIONS

    from .parallel_state import MEGATRON_RELEASE

    names = SERVED_FUNCTIONS.get(MEGATRON_RELEASE.series, ())
    if not names:
        return {}
    from parallel_state_ng.builders.inference import SERVED_AS

    return {name: SERVED_AS[name] for name in names}


def _patch_inference(module: ModuleType) -> None:
    """Point the served names of Megatron's shards ``module`` (and names bound to them) at ours."""
    for name, ours in _served_inference().items():
        original = module.__dict__.get(name, _MISSING)
        if original is ours:
            continue
        if original is not _MISSING:
            _rebind_object(original, ours)
        if module.__dict__.get(name) is not ours:
            _patches.append((module.__dict__, name, original))
            module.__dict__[name] = ours
        _inference_swap.append((ours, original))


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader of Megatron's shards module, then :func:`_patch_inference`."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec):
        """The real loader's module."""
        return self._loader.create_module(spec)

    def exec_module(self, module):
        """Execute the module, give it back its own loader, patch it while installed."""
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        if _saved_module:
            _patch_inference(module)


class _InferenceFinder(importlib.abc.MetaPathFinder):
    """Finds Megatron's shards module on first import while installed, to patch it once loaded."""

    def find_spec(self, fullname, path=None, target=None):
        """The module's own spec with a patching loader, for INFERENCE_TARGET while installed."""
        if fullname != INFERENCE_TARGET or not _saved_module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


_INFERENCE_FINDER = _InferenceFinder()


def _install_inference() -> None:
    """Serve the release's inference-shard functions from the engine (0.19+; nothing before).

    A loaded shards module is patched now; otherwise at its first import (no megatron import
    here: the module imports all of ``megatron.core``).
    """
    if not _served_inference():
        return
    module = sys.modules.get(INFERENCE_TARGET)
    if module is not None:
        _patch_inference(module)
    elif ("megatron" in sys.modules or importlib.util.find_spec("megatron") is not None) and (
        _INFERENCE_FINDER not in sys.meta_path
    ):
        sys.meta_path.insert(0, _INFERENCE_FINDER)


def install(hyper_comm_grid: bool = False) -> None:
    """See :func:`compat.install`."""
    grid = _served_grid_class() if hyper_comm_grid else None  # checked before anything changes
    if _saved_module:
        if grid is not None:
            _install_grid(grid)
        return
    from . import parallel_state as ours

    original = sys.modules.get(TARGET)
    _saved_module.append(original)
    if original is None and "megatron.core" not in sys.modules:
        sys.meta_path.insert(0, _FINDER)
    else:
        sys.modules[TARGET] = ours
    if original is not None:
        _rebind_everywhere(original, ours, record=True)
    parent = sys.modules.get("megatron.core")
    if parent is not None:
        for attr in ("parallel_state", "mpu"):
            if getattr(parent, attr, None) is not ours:
                _patches.append((parent.__dict__, attr, parent.__dict__.get(attr, _MISSING)))
                parent.__dict__[attr] = ours
    _install_inference()
    if grid is not None:
        _install_grid(grid)


class _Missing:
    """Marker: the attribute did not exist before install."""


_MISSING = _Missing()


def uninstall() -> None:
    """See :func:`compat.uninstall`."""
    if not _saved_module:
        return
    from . import parallel_state as ours

    original = _saved_module.pop()
    for finder in (_FINDER, _INFERENCE_FINDER):
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    for namespace, attr, value in reversed(_patches):
        if value is _MISSING:
            namespace.pop(attr, None)
        else:
            namespace[attr] = value
    _patches.clear()
    if original is None:
        sys.modules.pop(TARGET, None)
        # Modules imported while compat was installed bound compat's objects: give them
        # megatron's own, imported now that the real module can load.
        if importlib.util.find_spec("megatron") is not None and "megatron.core" in sys.modules:
            original = importlib.import_module(TARGET)
            parent = sys.modules["megatron.core"]
            parent.__dict__["parallel_state"] = original
            parent.__dict__["mpu"] = original
    else:
        sys.modules[TARGET] = original
    for ours_object, megatron_object in _grid_swap + _inference_swap:
        # Megatron modules imported while installed bound our grid or functions: give them megatron's.
        for mod_name, mod in list(sys.modules.items()):
            namespace = getattr(mod, "__dict__", None) if mod_name.startswith("megatron.") else None
            if isinstance(namespace, dict) and megatron_object is not _MISSING:
                for attr, value in list(namespace.items()):
                    if value is ours_object:
                        namespace[attr] = megatron_object
    _grid_swap.clear()
    _inference_swap.clear()
    if original is not None:
        # Megatron modules imported while compat was installed bound compat's objects.
        # (Other modules are left alone: they may use compat on purpose.)
        _rebind_everywhere(ours, original, record=False, prefix="megatron.")
