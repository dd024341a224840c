"""Transformer building blocks, tensor-parallel aware."""
