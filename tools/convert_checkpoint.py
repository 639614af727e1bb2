#!/usr/bin/env python
"""Convert checkpoints between megalite, Hugging Face transformers and Megatron-LM (GPT-2, Llama).

    # a megalite checkpoint (any TP/PP/DP layout it was saved in) -> transformers
    python tools/convert_checkpoint.py --input-format megalite --input SAVE \
        --output-format hf --output hf_model/
    # transformers (GPT2LMHeadModel / LlamaForCausalLM, safetensors) -> megalite
    python tools/convert_checkpoint.py --input-format hf --input hf_model/ \
        --output-format megalite --output SAVE2/

    # a Megatron-LM checkpoint (torch or torch_dist, any TP/PP/VP layout; format detected) -> megalite / HF
    python tools/convert_checkpoint.py --input MEGATRON_SAVE --output SAVE3/ --output-format megalite
    # ... with its Adam moments, step count, LR schedule and iteration: pretrain_gpt.py --load SAVE3
    # then continues the run (fp32 runs with Megatron's optimizer; bf16 / fp16 runs with
    # --use-distributed-optimizer, whose fp32 main params become the weights written)
    python tools/convert_checkpoint.py --input MEGATRON_SAVE --output SAVE3/ --output-format megalite \
        --include-optimizer
    # megalite (or HF) -> Megatron-LM torch_dist (or --ckpt-format torch) at a layout of your choice
    python tools/convert_checkpoint.py --input SAVE --output MEGATRON_SAVE2/ --output-format megatron \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    # ... with the run's optimizer state, schedule, iteration and samples, so Megatron-LM resumes it
    # (--load MEGATRON_SAVE2 --no-load-rng, and --use-distributed-optimizer for the second form)
    python tools/convert_checkpoint.py --input SAVE --output MEGATRON_SAVE2/ --output-format megatron \
        --include-optimizer [--use-distributed-optimizer]

--input-format is detected when left out (megalite, hf, or megatron: Megatron-LM's ``torch`` and
``torch_dist`` formats, told apart by their files). A Megatron checkpoint's model comes from its
stored ``args``; no model flags are needed (docs/checkpoints.md, "From and to Megatron-LM").

The HF side is a directory with config.json and model.safetensors (or a sharded
model.safetensors.index.json); ``AutoModelForCausalLM.from_pretrained(dir)``
loads what this writes. The megalite side is a model-only checkpoint stored
under logical names, so no target TP/PP size is needed: continue from it at any
layout with ``pretrain_gpt.py --load SAVE2 --finetune`` (or ``--no-load-optim
--no-load-rng``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

# Runnable as a plain script from a checkout: make the repository importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.checkpoint import files as ckpt_files  # noqa: E402
from megalite.checkpoint import hf  # noqa: E402
from megalite.cli import run_main  # noqa: E402
from megalite.data.progress import Progress  # noqa: E402
from megalite.errors import MegaliteError  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ConvertError(MegaliteError, ValueError):
    """Bad flags or inputs; printed as ``convert_checkpoint.py: error: ...``."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert_checkpoint.py",
        description="Convert checkpoints between megalite and Hugging Face transformers (GPT-2, Llama).",
        allow_abbrev=False,
    )
    p.add_argument("--input", required=True, help="Checkpoint directory to read.")
    p.add_argument(
        "--input-format",
        default=None,
        choices=["megalite", "hf", "megatron"],
        help="Format of --input (default: detected; megatron = Megatron-LM's torch or torch_dist).",
    )
    p.add_argument("--output", required=True, help="Directory to write (must not exist or be empty).")
    p.add_argument(
        "--output-format", required=True, choices=["megalite", "hf", "megatron"], help="Format of --output."
    )
    p.add_argument(
        "--ckpt-format",
        choices=["torch_dist", "torch"],
        default="torch_dist",
        help="megatron output: Megatron-LM's checkpoint format (its --ckpt-format; default torch_dist).",
    )
    p.add_argument(
        "--target-tensor-parallel-size", type=int, default=1, help="megatron output: the TP size to write."
    )
    p.add_argument(
        "--target-pipeline-parallel-size", type=int, default=1, help="megatron output: the PP size to write."
    )
    p.add_argument(
        "--target-expert-parallel-size",
        type=int,
        default=1,
        help="megatron output, MoE: the expert-parallel size of the torch files (torch_dist is global).",
    )
    p.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="megalite / megatron input: this iteration, not the latest.",
    )
    p.add_argument(
        "--include-optimizer",
        action="store_true",
        help="megatron input, megalite output (or megalite input, megatron output): carry the Adam moments, "
        "AdamW's step, the LR schedule, the iteration and the samples consumed (and a bf16 / fp16 run's fp32 "
        "main params and loss scaler), so pretrain_gpt.py --load "
        "OUTPUT (or Megatron-LM's --load OUTPUT --no-load-rng) continues the run (default: weights only).",
    )
    p.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="megatron output with --include-optimizer: write the distributed optimizer's state (torch_dist, "
        "its fully_reshardable layout, with the fp32 main params) for a Megatron-LM run with "
        "--use-distributed-optimizer (needed for bf16 runs; default: the fp32 non-distributed optimizer).",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="Cast the weights to this dtype on the way (default: keep the stored dtype).",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="hf output: split model.safetensors into shards of at most this size (e.g. 500MB, 5GB).",
    )
    return p


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise ConvertError(f"--max-shard-size {text!r}: expected a size such as 500MB or 5GB")
    scale = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}
    return max(1, int(float(m.group(1)) * scale[m.group(2)]))


def log(msg: str) -> None:
    print(f"[convert] {msg}", flush=True)


def describe(config) -> str:
    try:
        flavour = hf.hf_flavour(config)
    except MegaliteError:  # no transformers counterpart (e.g. --qk-layernorm): only an HF output refuses it
        flavour = "megalite"
    return (
        f"{flavour}: {config.num_layers} layers, hidden {config.hidden_size}, heads "
        f"{config.num_attention_heads} (kv groups {config.query_groups}), ffn {config.ffn_size}, "
        f"vocab {config.vocab_size}, {'untied' if config.untie_embeddings_and_output_weights else 'tied'} "
        "output layer"
    )


def read_megalite(path: str, iteration: int | None):
    """(logical state dict, ModelConfig) of a megalite checkpoint, whatever layout saved it.

    ``load_model`` gives fp32 weights; they are cast back to the dtype the checkpoint
    stored (e.g. bf16 from a ``--bf16`` run), so the export is not twice the size.
    """
    from megalite.checkpoint import load_model

    folder, _ = ckpt_files.resolve(path, iteration, flag="--input")
    stored = str(ckpt_files.read_metadata(folder).get("params_dtype", "torch.float32"))
    dtype = {str(t): t for t in DTYPES.values()}.get(stored, torch.float32)
    model, config = load_model(folder)
    return {k: v.to(dtype) for k, v in hf.logical_state_dict(model).items()}, config


def read_megalite_optimizer(path: str, iteration: int | None, config, distributed: bool):
    """The optimizer state of a megalite checkpoint, for a Megatron-LM output."""
    from megalite.checkpoint.megatron_export_optim import read_megalite_optimizer as read

    folder, _ = ckpt_files.resolve(path, iteration, flag="--input")
    opt = read(folder, config, distributed)
    kind = "distributed optimizer (fully_reshardable)" if distributed else "fp32 optimizer"
    log(f"optimizer: Adam moments, AdamW step {opt.step}, {opt.consumed_train_samples} samples consumed; "
        f"written as Megatron-LM's {kind} at iteration {opt.iteration}")  # fmt: skip
    return opt


def write_megalite(state: dict, config, path: str, iteration: int = 0, progress=None) -> str:
    from megalite.checkpoint import save_model_checkpoint

    return str(save_model_checkpoint(state, config, path, iteration=iteration, progress=progress))


def detect_input_format(path: str) -> str:
    """megalite, hf or megatron, from the files in ``path``."""
    from megalite.checkpoint import megatron

    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    if megatron.detect_format(path) is not None:
        return "megatron"
    return "megalite"


def read_megatron(path: str, iteration: int | None, include_optimizer: bool = False):
    """(logical state dict, ModelConfig, (iteration, TrainingProgress) or None) of a Megatron-LM
    checkpoint, format detected; the progress with ``include_optimizer``."""
    from megalite.checkpoint import TrainingProgress, megatron
    from megalite.checkpoint.megatron_optim import read_megatron_optimizer

    ckpt = megatron.read_megatron(path, iteration)
    layout = ", ".join(f"{k} {v}" for k, v in ckpt.layout.items())
    log(
        f"Megatron-LM {ckpt.fmt} checkpoint {ckpt.folder} (iteration {ckpt.iteration}{'; ' + layout if layout else ''})"
    )
    if not include_optimizer:
        return ckpt.state, ckpt.config, None
    opt = read_megatron_optimizer(ckpt)
    log(f"optimizer: Adam moments, AdamW step {opt.step}, {opt.consumed_train_samples} samples consumed")
    progress = TrainingProgress(
        opt.moments, opt.step, opt.scheduler, opt.consumed_train_samples, opt.grad_scaler
    )
    if opt.main is None:
        return ckpt.state, ckpt.config, (int(ckpt.iteration or 0), progress)
    # bf16 / fp16 run: its fp32 main params are the weights written (a --bf16 / --fp16 run's masters)
    log("optimizer: fp32 main params of the distributed optimizer (written as the fp32 weights)")
    return opt.main, ckpt.config, (int(ckpt.iteration or 0), progress)


def check_optimizer_flags(args: argparse.Namespace) -> None:
    directions = (("megatron", "megalite"), ("megalite", "megatron"))
    if args.include_optimizer and (args.input_format, args.output_format) not in directions:
        raise ConvertError(
            "--include-optimizer carries a run's optimizer state from Megatron-LM to megalite or from megalite "
            "to Megatron-LM: give --input-format megatron --output-format megalite, or the reverse"
        )
    if args.include_optimizer and args.dtype not in (None, "fp32"):
        raise ConvertError(
            f"--include-optimizer keeps the fp32 weights (its main params): drop --dtype {args.dtype}"
        )
    if args.use_distributed_optimizer and not (args.include_optimizer and args.output_format == "megatron"):
        raise ConvertError(
            "--use-distributed-optimizer picks the layout of the optimizer state written to Megatron-LM: "
            "use it with --output-format megatron --include-optimizer"
        )
    if args.use_distributed_optimizer and args.ckpt_format != "torch_dist":
        raise ConvertError(
            "--use-distributed-optimizer: megalite writes the distributed optimizer's state in torch_dist "
            "(fully_reshardable), not the legacy distrib_optim.pt: use --ckpt-format torch_dist"
        )


def convert(args: argparse.Namespace) -> None:
    from megalite.arguments.spec import NON_NEGATIVE, POSITIVE, check_rules

    positive_target = {f"--target-{d}-parallel-size": POSITIVE for d in ("tensor", "pipeline", "expert")}
    check_rules(args, {"--ckpt-step": NON_NEGATIVE, **positive_target})
    if not os.path.isdir(args.input):
        raise ConvertError(f"--input {args.input}: no such directory")
    if args.input_format is None:
        args.input_format = detect_input_format(args.input)
    if args.input_format == args.output_format != "megatron":  # megatron -> megatron: another layout / format
        raise ConvertError(
            f"--input-format and --output-format are both {args.input_format}: nothing to convert "
            "(megalite checkpoints load at any layout as they are)"
        )
    looks_hf = os.path.isfile(os.path.join(args.input, "config.json"))
    looks_megalite = any(
        os.path.isfile(os.path.join(args.input, name)) for name in (ckpt_files.TRACKER, ckpt_files.METADATA)
    )
    if args.input_format == "megalite" and looks_hf and not looks_megalite:
        raise ConvertError(
            f"--input {args.input} holds a transformers checkpoint (config.json): use --input-format hf"
        )
    if args.input_format != "megatron" and detect_input_format(args.input) == "megatron":
        raise ConvertError(
            f"--input {args.input} holds a Megatron-LM checkpoint: use --input-format megatron (or leave it out)"
        )
    if args.input_format == "hf" and looks_megalite and not looks_hf:
        raise ConvertError(f"--input {args.input} holds a megalite checkpoint: use --input-format megalite")
    if os.path.exists(args.output) and (not os.path.isdir(args.output) or os.listdir(args.output)):
        raise ConvertError(f"--output {args.output} exists and is not an empty directory; pick a new one")
    check_optimizer_flags(args)
    max_shard = parse_size(args.max_shard_size)
    start = time.perf_counter()
    # read, convert, write: a live line on a terminal, one line per step in logs
    bar = Progress("convert", total=3, unit="steps", quiet_seconds=0)

    resume = None
    if args.input_format == "hf":
        log(f"reading transformers checkpoint {args.input}")
        hf_state, hf_config = hf.read_hf_checkpoint(args.input)
        state, config = hf.hf_to_megalite(hf_state, hf_config)
    elif args.input_format == "megatron":
        state, config, resume = read_megatron(args.input, args.ckpt_step, args.include_optimizer)
    else:
        step = "latest" if args.ckpt_step is None else f"iteration {args.ckpt_step}"
        log(f"reading megalite checkpoint {args.input} ({step})")
        state, config = read_megalite(args.input, args.ckpt_step)
        if args.include_optimizer:
            resume = read_megalite_optimizer(
                args.input, args.ckpt_step, config, args.use_distributed_optimizer
            )
    bar.update(1)
    if args.dtype is not None:
        state = {k: v.to(DTYPES[args.dtype]) for k, v in state.items()}
    n_params = sum(t.numel() for t in state.values())
    log(f"model: {describe(config)}; {n_params:,} parameters")

    if args.output_format == "hf":
        hf_state, hf_config = hf.megalite_to_hf(state, config)
        # The model identity survives the config it is written as, or nothing is written.
        lost = ckpt_files.model_differences(config, hf.config_from_hf(hf_config))
        if lost:
            raise ConvertError(
                f"--output-format hf: a transformers config cannot express this model ({'; '.join(lost)}); "
                "the converted model would compute another function"
            )
        bar.update(1)
        log(f"writing transformers checkpoint ({hf_config['architectures'][0]}) to {args.output}")
        with ckpt_files.staged_output(args.output) as out:
            files = hf.write_hf_checkpoint(str(out), hf_state, hf_config, max_shard_bytes=max_shard)
        log(f"wrote config.json and {', '.join(files)}")
    elif args.output_format == "megatron":
        from megalite.checkpoint.megatron_export import write_megatron

        bar.update(1)
        tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
        ep = args.target_expert_parallel_size
        log(f"writing Megatron-LM {args.ckpt_format} checkpoint (tp {tp}, pp {pp}, ep {ep}) to {args.output}")
        with ckpt_files.staged_output(args.output) as out:
            folder = write_megatron(state, config, out, args.ckpt_format, tp, pp, ep=ep, optim=resume)
        log(f"wrote {Path(args.output) / folder.name}")
    else:
        bar.update(1)
        log(f"writing megalite checkpoint to {args.output}")
        with ckpt_files.staged_output(args.output) as out:
            where = Path(write_megalite(state, config, str(out), *(resume or ())))
        log(f"wrote {Path(args.output) / where.relative_to(out)}")
    bar.update(1, params=n_params)
    bar.close()
    log(f"done in {time.perf_counter() - start:.1f} s")


def main(argv: list[str] | None = None) -> int:
    # Bad flags or inputs (all MegaliteErrors): one line on stderr, exit 2; bugs keep their traceback.
    return run_main("convert_checkpoint.py", lambda a: convert(build_parser().parse_args(a)), argv)


if __name__ == "__main__":
    sys.exit(main())
