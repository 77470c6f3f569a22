"""Command-line tools: the `dspark` CLI and the GGUF import."""
