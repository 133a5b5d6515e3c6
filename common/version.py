"""The kit's version as installed, from pyproject.toml's `version`: the one place reports and adapters read it."""

from importlib.metadata import version

KIT_VERSION = version("kvconform")
