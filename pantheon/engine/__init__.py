"""The engine: loading, sampling, constraints, sessions. Its numba functions cache where pantheon/jit_cache.py
says, set before any of them is decorated."""

from pantheon import jit_cache

jit_cache.configure()
