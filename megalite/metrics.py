"""FLOPs, MFU and metric sinks (console, TensorBoard, JSON lines)."""

from __future__ import annotations

import json
import os
import resource

import torch

from megalite.model.config import ModelConfig

# Dense bf16 peak TFLOP/s per GPU (no sparsity), by a substring of the device name.
_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "V100": 125.0,
}


def detect_peak_tflops(device: torch.device) -> float | None:
    """Peak dense TFLOP/s of the local GPU if it is a known model, else None (CPU: unknown)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def model_flops_per_token(config: ModelConfig, seq_length: int, padded_vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), counting matmuls only.

    Per layer and token, forward: QKV 2h(h_q + 2 h_kv), attention scores and
    weighted sum 2 * 2 s h_q (full s, as Megatron counts it, although causal
    attention only needs half), output projection 2 h_q h, MLP 2 h f (x3 with
    SwiGLU's gate). Plus the logits 2 h V. Activation recomputation is not
    counted: this is *model* FLOPs, the numerator of MFU.
    """
    h = config.hidden_size
    hq = config.num_attention_heads * config.head_dim
    hkv = config.query_groups * config.head_dim
    f = config.ffn_size
    per_layer = (
        2 * h * (hq + 2 * hkv) + 4 * seq_length * hq + 2 * hq * h + 2 * h * f * (3 if config.swiglu else 2)
    )
    forward = config.num_layers * per_layer + 2 * h * padded_vocab_size
    return 3.0 * forward


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # CPU: the process's peak resident set (KiB on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MetricSinks:
    """Where log lines go: console always; TensorBoard and JSON lines when asked.

    Only the logging rank creates one with files; the others get a silent one.
    """

    def __init__(self, enabled: bool, tensorboard_dir: str | None = None, metrics_file: str | None = None):
        self.enabled = enabled
        self.tb = None
        self.jsonl = None
        if not enabled:
            return
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise RuntimeError(
                    "--tensorboard-dir needs the tensorboard package: pip install 'megalite[tensorboard]'"
                ) from e
            self.tb = SummaryWriter(log_dir=tensorboard_dir)
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self.jsonl = open(metrics_file, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def console(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def record(self, kind: str, iteration: int, values: dict) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and value is not None:
                    self.tb.add_scalar(f"{kind}/{key}", value, iteration)
            self.tb.flush()
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"kind": kind, "iteration": iteration, **values}) + "\n")

    def write_record(self, record: dict) -> None:
        """One JSON line as given (e.g. the memory report's per-rank records)."""
        if self.enabled and self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")

    def scalar(self, tag: str, value: float, iteration: int) -> None:
        """One TensorBoard scalar under its full tag (e.g. ``memory/stage0/measured_params``)."""
        if self.enabled and self.tb is not None:
            self.tb.add_scalar(tag, value, iteration)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
