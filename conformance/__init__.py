"""The conformance kit: state machine, checks, scenarios, pytest plugin and runner."""
