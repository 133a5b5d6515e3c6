"""`python -m kvconform.benchmarks`: the same command as `kvconform bench`."""

from kvconform.cli import bench_command

bench_command(prog_name="python -m kvconform.benchmarks")
