"""Turning target logits into tokens: filtering, sampling, penalties and log-probabilities."""
