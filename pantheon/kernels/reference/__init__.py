"""Plain numpy reference implementations of the kernels, for tests and benchmarks."""
