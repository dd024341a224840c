"""meshtron: PyTorch-native pre-training of large language models with Megatron-style parallelism."""

__version__ = "0.1.0"
