"""The examples: runnable as scripts, importable as `examples.<name>` from the repository root (the
GPU example and the tests reuse the toy example's target, drafter and head fit)."""
