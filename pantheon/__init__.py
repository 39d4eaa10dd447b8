"""Pantheon: an OpenAI-compatible inference server for GGUF language models."""

__version__ = "0.1.0"
