"""The GPT model (GPT-2 and Llama flavours), its configuration, and its pipeline chunks."""

from megalite.model.config import ModelConfig, ModelConfigError
from megalite.model.gpt import GPTModel, build_model_chunks

__all__ = ["GPTModel", "ModelConfig", "ModelConfigError", "build_model_chunks"]
