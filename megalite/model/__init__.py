"""The GPT model (GPT-2 and Llama flavours) and its configuration."""

from megalite.model.config import ModelConfig, ModelConfigError
from megalite.model.gpt import GPTModel

__all__ = ["GPTModel", "ModelConfig", "ModelConfigError"]
