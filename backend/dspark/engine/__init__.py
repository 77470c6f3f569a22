"""The engine: scheduling, per-request sequences, KV pages and the step pipeline."""
