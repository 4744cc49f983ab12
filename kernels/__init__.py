"""Deferred-RoPE attention kernels (Triton) and their pure-PyTorch references.

Importing this package never imports Triton; the Triton kernels load on first use.
"""
