"""megalite: Megatron-style 3D-parallel pretraining for GPT-family models."""

__version__ = "0.1.0"
