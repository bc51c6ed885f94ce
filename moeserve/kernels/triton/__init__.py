"""Triton implementations of the kernels, each with its torch reference's signature.

Imported only for CUDA tensors (``kernels/backend.py``); nothing here is needed on CPU.
"""
