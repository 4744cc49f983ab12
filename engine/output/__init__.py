"""Outputs: sampling, detokenizing, stop strings and the loop guard, per-request output processing."""
