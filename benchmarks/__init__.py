"""The benchmarks of jax_markov: scripts, each run from the repository root as
`python3 benchmarks/<name>.py` (see its docstring). A package so that the scripts and the tests
import them as `from benchmarks import gpu_timing`; the repository root is not part of the installed
jax_markov, so a script run this way puts the root at the end of sys.path (after site-packages,
where an installed jax_markov with its compiled modules comes first) and the tests do the same in
tests/conftest.py."""
