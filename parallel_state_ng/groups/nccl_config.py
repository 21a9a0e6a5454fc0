"""NCCL's rules for the communicator config of MCore's YAML, checked before any group exists.

MCore's ``nccl_communicator_config_path`` YAML (parsed: ``nccl_comm_cfgs``, group name ->
options) sets ``cga_cluster_size``, ``max_ctas`` and ``min_ctas`` of each group's
``ncclConfig_t``; MCore hands the values to torch as they are, and NCCL refuses some of them
when it creates the communicator: with a device-bound default group at init, with a lazy one at
the group's first collective, far from the cause. :func:`check_nccl_config` applies NCCL's
rules first and raises :class:`NcclConfigError` naming the group, the key and the rule.

The rules (:data:`NCCL_RULES`) are those of NCCL's ``parseCommConfig`` (``src/init.cc``), the
same from 2.17, the first release with these fields, to 2.29: a value set must be a positive
integer (``cga_cluster_size``: zero or more); ``min_ctas`` is compared with ``max_ctas`` as
given, an unset ``max_ctas`` being ``INT_MIN``, so ``min_ctas`` without ``max_ctas`` is refused
("Invalid config min/max channels attribute value 2/-2147483648", measured on NCCL 2.28.9).
Values over NCCL's caps (``max_ctas``/``min_ctas`` 32, ``cga_cluster_size`` 8) are capped by
NCCL, not refused, so they pass here. A rule carries the NCCL versions it holds for; the
installed version comes from ``torch.cuda.nccl.version()``; when torch has no NCCL (a CPU build)
the version is unknown and only rules that hold for every version apply (today: all of them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NcclConfigError",
    "NcclRule",
    "NCCL_RULES",
    "LEGACY_NCCL_DEFAULTS",
    "installed_nccl_version",
    "check_nccl_config",
]

NcclVersion = tuple[int, int, int]

#: 0.12's values for the config fields a configured group leaves out (release fact
#: ``nccl_config_defaults``): the values NCCL gets, so the values checked.
LEGACY_NCCL_DEFAULTS = {"cga_cluster_size": 4, "max_ctas": 32, "min_ctas": 1}
_INT_KEYS = ("cga_cluster_size", "max_ctas", "min_ctas")
#: The first NCCL release whose ``ncclConfig_t`` has these fields (torch sets them from 2.17 on).
FIRST_VERSION: NcclVersion = (2, 17, 0)


class NcclConfigError(ValueError):
    """A ``nccl_comm_cfgs`` value the NCCL at hand refuses (raised before any group exists)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class NcclRule:
    """One of NCCL's rules on a group's config.

    ``key``: the YAML key it is about; ``rule``: NCCL's rule in words, for the message;
    ``broken(cfg)``: whether a group's options break it; ``since``/``until``: the NCCL versions
    it holds for (``until`` ``None``: every later one).
    """

    key: str
    rule: str
    broken: Callable[[Mapping[str, Any]], bool]
    since: NcclVersion = FIRST_VERSION
    until: NcclVersion | None = None

    def holds_for(self, version: NcclVersion | None) -> bool:
        """Whether the rule applies under NCCL ``version`` (``None``: unknown, only rules for every version)."""
        if version is None:
            return self.since <= FIRST_VERSION and self.until is None
        return self.since <= version and (self.until is None or version <= self.until)


def _positive(key: str, minimum: int) -> NcclRule:
    return NcclRule(
        key,
        f"{key} must be an integer of at least {minimum} (NCCL refuses the communicator otherwise)",
        lambda cfg: key in cfg and not (_is_int(cfg[key]) and cfg[key] >= minimum),
    )


def _min_without_max(cfg: Mapping[str, Any]) -> bool:
    return "min_ctas" in cfg and "max_ctas" not in cfg


def _min_over_max(cfg: Mapping[str, Any]) -> bool:
    low, high = cfg.get("min_ctas"), cfg.get("max_ctas")
    return isinstance(low, int) and isinstance(high, int) and low > high


#: NCCL's rules, in the order they are checked (NCCL's own order).
NCCL_RULES: tuple[NcclRule, ...] = (
    _positive("cga_cluster_size", 0),
    _positive("min_ctas", 1),
    _positive("max_ctas", 1),
    NcclRule(
        "min_ctas",
        "min_ctas needs max_ctas in the same group: NCCL compares min_ctas with max_ctas as given, an unset "
        "max_ctas being INT_MIN, and refuses ('Invalid config min/max channels attribute value "
        "<min>/-2147483648'); set max_ctas too (NCCL caps it at 32)",
        _min_without_max,
    ),
    NcclRule(
        "min_ctas",
        "min_ctas must not exceed max_ctas (NCCL compares them as given, before capping either at 32)",
        _min_over_max,
    ),
)


def installed_nccl_version() -> NcclVersion | None:
    """The NCCL torch uses, as ``(major, minor, patch)``; ``None`` when torch has none (a CPU build)."""
    try:
        import torch

        version: Any = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL (AttributeError) or no CUDA runtime
        return None
    if isinstance(version, tuple):
        return (int(version[0]), int(version[1]), int(version[2]) if len(version) > 2 else 0)
    if _is_int(version):  # older torch: NCCL_VERSION_CODE, major*10000 + minor*100 + patch
        return (version // 10000, version // 100 % 100, version % 100)
    return None


def _version_text(version: NcclVersion | None) -> str:
    if version is None:
        return "NCCL version unknown (torch has no NCCL here): the rules of every NCCL release applied"
    return f"NCCL {'.'.join(map(str, version))}"


def check_nccl_config(
    nccl_comm_cfgs: Mapping[str, Any],
    *,
    source: str = "nccl_comm_cfgs",
    legacy_defaults: bool = False,
    version: NcclVersion | None | str = "installed",
) -> None:
    """Raise :class:`NcclConfigError` when NCCL would refuse a group's config in ``nccl_comm_cfgs``.

    Every group entry is checked (O(groups in the config)), with 0.12's defaults filled in first
    when ``legacy_defaults`` (MCore 0.12 sends them). ``source`` names where the config came
    from in the message (compat: the YAML's path). ``version``: the NCCL to check against
    (``"installed"``: :func:`installed_nccl_version`; ``None``: unknown).

    Raises:
        NcclConfigError: naming the source, the group, the key, its value and NCCL's rule; the
            first broken rule of the first group breaking one.
        TypeError: a group's options are not a mapping.
    """
    if version == "installed":
        version = installed_nccl_version()
    assert not isinstance(version, str), f"version must be 'installed', None or a tuple, got {version!r}"
    if version is not None and version < FIRST_VERSION:
        return  # no config fields in that NCCL: torch has none to set
    rules = [rule for rule in NCCL_RULES if rule.holds_for(version)]
    for group, options in nccl_comm_cfgs.items():
        if not isinstance(options, Mapping):
            raise TypeError(
                f"{source}: the options of group {group!r} must be a mapping of key to value, got {options!r}"
            )
        cfg = {**LEGACY_NCCL_DEFAULTS, **options} if legacy_defaults else options
        for rule in rules:
            if rule.broken(cfg):
                shown = ", ".join(f"{key}={cfg[key]!r}" for key in _INT_KEYS if key in cfg)
                raise NcclConfigError(
                    f"{source}: group {group!r}, key {rule.key!r} ({shown}): {rule.rule} [{_version_text(version)}]"
                )
