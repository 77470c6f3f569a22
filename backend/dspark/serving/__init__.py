"""Serving through Triton: the engine process, launcher, model config, metrics and the OpenAI frontend."""
