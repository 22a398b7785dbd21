"""Experiments that still answer open questions, run from the repository root as
`python -m experiments.<folder>.<name>`; shared code comes from `bench.harness`."""
