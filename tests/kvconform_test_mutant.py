"""`module:factory` entry to the seed-bug mutant, for command-line tests."""

from kvconform.conformance.mutants import MUTANTS


def make():
    return MUTANTS["skip-flag-ignored"].adapter()
