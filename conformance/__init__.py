"""The conformance kit: state machine, checks, vectors, pytest plugin and runner."""
