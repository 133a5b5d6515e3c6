"""Console output: written to a pipe or a CI log, no line is wrapped (issue 35, item 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvconform.console import PIPED_WIDTH


def test_output_to_a_pipe_is_not_wrapped(tmp_path: Path) -> None:
    """`kvconform run` with stdout and stderr pipes: the run's header, longer than rich's default 80 columns, is one
    line, as is the coverage line; the tables still render, within `PIPED_WIDTH` columns."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("COLUMNS", "LINES", "FORCE_COLOR", "FORCE_TERMINAL", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    script = Path(sys.executable).with_name("kvconform")
    done = subprocess.run([str(script), "run", "--adapter", "reference", "--profile", "smoke", "--scheduling", "sync",
                           "--database", "none"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    header = "kvconform: adapter reference 0.1.0, profile smoke, the profile's own seed, scheduling sync"
    assert len(header) > 80
    assert header in done.stderr.splitlines(), done.stderr
    coverage = next(line for line in done.stdout.splitlines() if line.startswith("kvconform spec "))
    assert coverage.endswith("model-only"), done.stdout
    table = [line for line in done.stdout.splitlines() if line.startswith(("┃", "│", "┏", "└"))]
    assert any("│ clause" in line or "┃ clause" in line for line in table), done.stdout
    assert all(len(line) <= PIPED_WIDTH for line in table), done.stdout
