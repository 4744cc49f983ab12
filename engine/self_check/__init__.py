"""The start-up self-check: rotary tables and the K/V path against transformers."""
