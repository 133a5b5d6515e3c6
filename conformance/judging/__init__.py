"""Judging: the seam (`judge`), one module per spec level with the checks it runs, and the levels' registry
(`levels`)."""
