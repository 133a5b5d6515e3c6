"""kvconform: executable specification and conformance kit for KV-cache offload connectors."""

from kvconform.common.version import KIT_VERSION as __version__

__all__ = ["__version__"]
