"""Benchmarks of the kit and the reference: `kvconform bench`.

Every figure is a rate or a ratio measured in the same run, never a timed test.
"""
