"""Finding adapters by name (entry-point group `kvconform.adapters`) or as `module:factory`, the module found from the
current directory too."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from kvconform.adapters.contract import KVConnectorAdapter

ENTRY_POINT_GROUP = "kvconform.adapters"


class AdapterNotFound(Exception):
    """The adapter name or `module:factory` string does not lead to an adapter; the message says why."""


def available() -> dict[str, str]:
    """Return registered adapter names and the `module:attr` each points at."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def resolve(spec: str) -> Callable[[], KVConnectorAdapter]:
    """Return the factory named by `spec`: a registered name or `module:factory`."""
    registered = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if spec in registered:
        return _checked(registered[spec].load, spec)
    if ":" not in spec:
        names = ", ".join(sorted(registered)) or "none"
        raise AdapterNotFound(f"unknown adapter {spec!r}: not a registered name ({names}) and not module:factory")
    module_name, _, attr = spec.partition(":")
    return _checked(lambda: _load_attr(module_name, attr, spec), spec)


def on_path_from_current_directory() -> None:
    """Make modules in the current directory importable, as `python -m` does: a user's `module:attr` is found there."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def _load_attr(module_name: str, attr: str, spec: str) -> object:
    on_path_from_current_directory()
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any import failure is the user's configuration error
        raise AdapterNotFound(f"cannot import {module_name!r} for adapter {spec!r} (the current directory "
                              f"{os.getcwd()} included): {error}") from error
    target: object = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise AdapterNotFound(f"module {module_name!r} has no attribute {attr!r} (adapter {spec!r})")
        target = getattr(target, part)
    return target


def _checked(load: Callable[[], object], spec: str) -> Callable[[], KVConnectorAdapter]:
    factory = load()
    if not callable(factory):
        raise AdapterNotFound(f"adapter {spec!r} points at {factory!r}, which is not callable")

    def build() -> KVConnectorAdapter:
        adapter = factory()
        if not isinstance(adapter, KVConnectorAdapter):
            raise AdapterNotFound(f"adapter {spec!r} built {type(adapter).__name__}, not a KVConnectorAdapter")
        return adapter

    return build
