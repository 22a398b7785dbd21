"""Benchmarks of oscar-hf on a GPU (and their CPU smoke modes), run from the repository root as
`python -m bench.<script>`; what they share is in `bench.harness`."""
