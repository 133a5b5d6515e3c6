"""kvconform: executable specification and conformance kit for KV-cache offload connectors."""

__version__ = "0.1.0"
