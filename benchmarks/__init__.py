"""Benchmarks and asset builders only we run (`python -m benchmarks.NAME`): not shipped in the wheel."""
