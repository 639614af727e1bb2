"""FLOPs, MFU, metric sinks (console, TensorBoard, wandb, JSON lines) and the loop's logging hooks."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import threading

import torch
import torch.distributed as dist

from megalite import profiling
from megalite.configs import LoggingConfig, ProfilingConfig
from megalite.errors import MegaliteError
from megalite.model.config import ModelConfig
from megalite.model.moe.config import parse_moe_layer_freq
from megalite.model.moe.router import AUX_LOSS_NAMES
from megalite.parallel.mappings import all_gather_flat
from megalite.profiling import Profiler

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

    Under context parallelism ``seq_length`` is still the whole ``--seq-length`` and the tokens
    multiplied in are whole sequences, over every GPU (tp x cp x dp x pp): each CP rank computes
    1/cp of each sequence's attention, so attention is counted once, not once per CP rank.
    """
    h = config.hidden_size
    hq = config.num_attention_heads * config.head_dim
    hkv = config.query_groups * config.head_dim
    gates = 3 if config.swiglu else 2
    attention = 2 * h * (hq + 2 * hkv) + 4 * seq_length * hq + 2 * hq * h
    dense_mlp = 2 * h * config.ffn_size * gates
    moe = config.moe
    moe_layers = sum(parse_moe_layer_freq(moe.moe_layer_freq, config.num_layers)) if moe else 0
    # MoE (Megatron's count): each token's top-k routed experts and the shared experts (active params)
    active = (
        moe.moe_ffn_hidden_size * moe.moe_router_topk + (moe.moe_shared_expert_intermediate_size or 0)
        if moe
        else 0
    )
    forward = (
        config.num_layers * attention
        + (config.num_layers - moe_layers) * dense_mlp
        + moe_layers * 2 * h * active * gates
        + 2 * h * padded_vocab_size
    )
    return 3.0 * forward


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # CPU: the process's peak resident set (KiB on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


WANDB_INSTALL = "pip install 'megalite[wandb]'"


# ---------------------------------------------------------------------------- sinks


# ------------------------------------------------------------------------------- output paths
def output_paths(
    logging_config: LoggingConfig, profile: ProfilingConfig, rank: int, logs_here: bool
) -> list[tuple[str, str, str]]:
    """``(flag, path, kind)`` of everything this rank will write besides checkpoints: ``kind`` "dir"
    (files are created in it) or "file" (appended to / written)."""
    out = []
    if logs_here:
        if logging_config.tensorboard_dir:
            out.append(("--tensorboard-dir", logging_config.tensorboard_dir, "dir"))
        if logging_config.metrics_file:
            out.append(("--metrics-file", logging_config.metrics_file, "file"))
        if logging_config.wandb_project:
            out.append(("--wandb-save-dir", wandb_init_kwargs(logging_config)["dir"], "dir"))
    if profile.profile and profile.profiles(rank):
        out.append(("--profile-dir", profiling.profile_dir(profile, logging_config.tensorboard_dir), "dir"))
    if profiling.records_memory_history(profile, rank):
        out.append(("--memory-snapshot-path", profiling.snapshot_path(profile, rank), "file"))
    return out


def path_problem(flag: str, path: str, kind: str) -> str | None:
    """Why this process cannot write ``path`` as a ``kind`` ("dir" / "file"), in one line; None if it can.
    A missing directory is created (as the writer would); a missing file is not."""
    try:
        if kind == "dir":
            if os.path.exists(path) and not os.path.isdir(path):
                return f"{flag} {path}: exists and is not a directory; pick a directory"
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, f".write_test.{os.getpid()}")
            open(probe, "w").close()  # an empty probe file: can this process create files here?
            os.unlink(probe)
            return None
        if os.path.isdir(path):
            return f"{flag} {path}: is a directory, not a file; name a file"
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        if not os.access(path if os.path.exists(path) else parent, os.W_OK):
            return f"{flag} {path}: not writable by this job (permission denied); pick a path it can write"
        return None
    except OSError as e:
        return f"{flag} {path}: cannot write there ({e.strerror or e}); pick a path this job can write"


def check_output_paths(
    logging_config: LoggingConfig, profile: ProfilingConfig, mesh, logs_here: bool
) -> None:
    """Collective, before the first step: every rank checks the paths it will write; the first
    problem on any rank stops every rank with the same line (no rank is left waiting)."""
    problems = [path_problem(*p) for p in output_paths(logging_config, profile, mesh.rank, logs_here)]
    mine = next((p for p in problems if p), None)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        mine = next((f"rank {r}: {p}" for r, p in enumerate(every) if p), None)
    if mine is not None:
        raise MegaliteError(mine)


@contextlib.contextmanager
def _writing(flag: str, path: str | None):
    """An OSError writing ``flag``'s files (a full disk, a quota, a vanished mount) as one line naming
    the flag, the path and the cause, not a traceback from inside the writer."""
    try:
        yield
    except OSError as e:
        raise MegaliteError(
            f"{flag} {path}: writing failed ({e.strerror or e}); free space or pick another {flag}, then "
            "rerun (a --save checkpoint resumes the run)"
        ) from None


def _quiet_tensorboard_thread() -> None:
    """TensorBoard's writer thread (``_AsyncWriterThread``) keeps an OSError it hits (a full disk, its
    folder removed) and re-raises it at the next ``add_scalar`` / ``flush`` / ``close``, where
    :func:`_writing` makes it one line naming ``--tensorboard-dir``; but it also hands it to
    ``threading.excepthook``, which prints a traceback. Installed once: that thread's OSErrors print
    nothing there (any other thread or exception goes to the previous hook)."""
    previous = threading.excepthook
    if getattr(previous, "megalite_tensorboard", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.megalite_tensorboard = True
    threading.excepthook = hook


def _open_jsonl(path: str):
    """``--metrics-file`` for appending, after cutting what a killed run left of its last line: a
    JSON-lines log holds whole lines only (a kill mid-line would glue that half to the next run's first)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    f = open(path, "a+b")  # noqa: SIM115 - closed below
    try:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(max(0, size - 65536))
            tail = f.read()
            if not tail.endswith(b"\n"):
                cut = tail.rfind(b"\n")
                f.truncate(size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= 65536 else size))
    finally:
        f.close()
    return open(path, "a", buffering=1)  # noqa: SIM115 - closed in MetricSinks.close()


class MetricSinks:
    """Where metrics go: console always; TensorBoard, wandb and JSON lines when asked.

    Only the logging rank (the last stage's first rank: it holds the loss)
    writes; the others get a silent one. Two sets of names reach TensorBoard
    and wandb: ours, ``train/loss``, ``train/mfu``, ... once per log line
    (:meth:`record`, also the JSON lines), and Megatron-LM's, ``lm loss``,
    ``learning-rate``, ``grad-norm``, ... (:meth:`scalars`), each also
    ``"<tag> vs samples"`` over consumed samples, so dashboards built for
    Megatron work unchanged.
    """

    def __init__(self, config: LoggingConfig, enabled: bool):
        self.enabled = enabled
        self.tb = self.wandb = self.jsonl = None
        if not enabled:
            return
        if config.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise MegaliteError(
                    "--tensorboard-dir needs the tensorboard package: pip install 'megalite[tensorboard]'"
                ) from e
            _quiet_tensorboard_thread()
            self.tb = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=config.tensorboard_queue_size)
        if config.wandb_project:
            self.wandb = _wandb_start(wandb_init_kwargs(config))
        if config.metrics_file:
            self.jsonl = _open_jsonl(config.metrics_file)

    @classmethod
    def open(cls, config: LoggingConfig, enabled: bool, mesh) -> MetricSinks:
        """The sinks ``config`` asks for on the logging rank; if they cannot open, every rank stops.

        One flag is all-reduced over the world once, so a failure on the logging
        rank (wandb not logged in, ...) ends the job instead of leaving the other
        ranks waiting in the first collective until the timeout.
        """
        error = sinks = None
        try:
            sinks = cls(config, enabled)
        except MegaliteError as e:
            error = e
        if dist.is_initialized() and dist.get_world_size() > 1:
            failed = mesh.tensor([0.0 if error is None else 1.0])
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if error is None and failed.item() > 0:
                sinks.close()
                raise MegaliteError("the logging rank could not open --tensorboard-dir / --wandb-project")
        if error is not None:
            raise error
        return sinks

    @property
    def writes_scalars(self) -> bool:
        """True where Megatron-named scalars have somewhere to go (TensorBoard or wandb)."""
        return self.tb is not None or self.wandb is not None

    def console(self, line: str) -> None:
        """A metric line: the run's output on stdout, not a log record (no level hides it)."""
        if self.enabled:
            print(line, flush=True)

    def record(self, kind: str, iteration: int, values: dict) -> None:
        """One log line's values under our names: ``kind/key`` to TensorBoard and wandb, JSON lines."""
        if not self.enabled:
            return
        numbers = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
        if self.tb is not None:
            with _writing("--tensorboard-dir", self.tb.log_dir):
                for tag, value in numbers.items():
                    self.tb.add_scalar(tag, value, iteration)
                self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=iteration)
        if self.jsonl is not None:
            with _writing("--metrics-file", self.jsonl.name):
                self.jsonl.write(json.dumps({"kind": kind, "iteration": iteration, **values}) + "\n")

    def write_record(self, record: dict) -> None:
        """One JSON line as given (e.g. the memory report's per-rank records)."""
        if self.enabled and self.jsonl is not None:
            with _writing("--metrics-file", self.jsonl.name):
                self.jsonl.write(json.dumps(record) + "\n")

    def scalar(self, tag: str, value: float, iteration: int) -> None:
        """One TensorBoard scalar under its full tag (e.g. ``memory/stage0/measured_params``)."""
        self.scalars(iteration, {tag: value})  # TensorBoard and wandb alike

    def scalars(self, iteration: int, values: dict, samples: int | None = None) -> None:
        """Megatron-named scalars at ``iteration``; with ``samples`` also ``"<tag> vs samples"``."""
        if not self.enabled:
            return
        values = {k: v for k, v in values.items() if v is not None}
        if self.tb is not None:
            with _writing("--tensorboard-dir", self.tb.log_dir):
                for tag, value in values.items():
                    self.tb.add_scalar(tag, value, iteration)
                    if samples is not None:
                        self.tb.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.log(values, step=iteration)

    def close(self) -> None:
        tb, jsonl = self.tb, self.jsonl
        self.tb = self.jsonl = None
        if tb is not None:
            with _writing("--tensorboard-dir", tb.log_dir):
                tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if jsonl is not None:
            with _writing("--metrics-file", jsonl.name):
                jsonl.close()


def wandb_init_kwargs(config: LoggingConfig) -> dict:
    """``wandb.init`` arguments, as Megatron-LM builds them (the run's flags are the config)."""
    save_dir = config.wandb_save_dir or (os.path.join(config.save, "wandb") if config.save else "wandb")
    kwargs = {"dir": save_dir, "project": config.wandb_project, "name": config.wandb_exp_name}
    kwargs["config"] = dict(config.flags)
    if config.wandb_entity:
        kwargs["entity"] = config.wandb_entity
    return kwargs


def _wandb_start(init_kwargs: dict):
    try:
        import wandb
    except ImportError as e:
        raise MegaliteError(f"--wandb-project needs the wandb package: {WANDB_INSTALL}") from e
    os.makedirs(init_kwargs["dir"], exist_ok=True)
    try:
        run = wandb.init(**init_kwargs)
    except Exception as e:  # not logged in, no network, bad entity: wandb's own message, on one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MegaliteError(
            f"--wandb-project {init_kwargs['project']}: wandb.init failed ({first}); run `wandb login`, "
            "or set WANDB_MODE=offline to keep the run on disk (sync it later with `wandb sync`)"
        ) from e
    return run


# ---------------------------------------------------------------------------- the loop's hooks
def memory_scalars(device: torch.device) -> dict:
    """Megatron's mem-* tags from the CUDA allocator; on CPU the process's peak RSS."""
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return {
            "mem-reserved-bytes": s["reserved_bytes.all.current"],
            "mem-allocated-bytes": s["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": s["allocated_bytes.all.peak"],
            "mem-allocated-count": s["allocation.all.current"],
        }
    return {"mem-max-rss-bytes": peak_memory_mb(device) * 2**20}


class TrainingMonitor:
    """Megatron-LM's logging and profiling around ``training.train``'s loop.

    Built from the run's configs (``--record-memory-history`` was started
    by ``setup`` before the model); the loop calls ``before_step`` / ``after_step`` around each
    step on every rank, ``at_log`` at each log line (it returns extra values
    for the line) and ``at_eval`` after an evaluation. With none of its flags
    set, a step costs a few integer tests: no host sync, no collective.
    """

    def __init__(self, config: LoggingConfig, profile: ProfilingConfig, rank: int):
        self.config = config
        self.rank = rank
        self.profiler = Profiler(profile, rank, config.tensorboard_dir)
        self.sinks: MetricSinks | None = None
        self._started = False
        self._samples = 0
        self._params_norm: tuple[int, float] | None = None  # (iteration, norm)
        self._num_zeros: int | None = None
        self._window_steps = 0  # steps since the last log line: the timers' normaliser
        profiling.set_timing_level(config.timing_log_level)

    def before_step(self, state, sinks: MetricSinks) -> None:
        if not self._started:
            self._started = True
            self.sinks = sinks
            self._samples = state.consumed_train_samples
            state.optimizer.log_num_zeros_in_grad = self.config.log_num_zeros_in_grad
            self.profiler.start()
        self.profiler.before_step(state.iteration)

    def after_step(self, state, step: dict) -> None:
        c, it = self.config, state.iteration
        self.profiler.after_step(it)
        self._window_steps += 1
        self._num_zeros = step.get("num_zeros")
        batch_size = state.consumed_train_samples - self._samples
        self._samples = state.consumed_train_samples
        if it % c.tensorboard_log_interval != 0:
            return
        # A collective, so every rank decides alike (from flags); without a writer at_log computes it.
        if c.log_params_norm and (c.tensorboard_dir or c.wandb_project):
            self._params_norm = (it, state.optimizer.params_norm())
        if not self.sinks.writes_scalars:
            return
        tags = {
            "learning-rate": state.scheduler.get_lr(),
            "batch-size": batch_size,
            "lm loss": None if step.get("loss") is None else float(step["loss"]),  # a device scalar
            "loss-scale": state.optimizer.get_loss_scale() if c.log_loss_scale_to_tensorboard else None,
            "world-size": state.mesh.world_size if c.log_world_size_to_tensorboard else None,
            "grad-norm": step.get("grad_norm"),
            "num-zeros": self._num_zeros,
            "params-norm": self._params_norm[1] if self._params_norm and self._params_norm[0] == it else None,
            **{k: step.get(k) for k in AUX_LOSS_NAMES},  # MoE: Megatron's tags
        }
        self.sinks.scalars(it, tags, samples=state.consumed_train_samples)
        if self.sinks.wandb is not None:
            self.sinks.wandb.log({"samples vs steps": state.consumed_train_samples}, step=it)
        if c.log_memory_to_tensorboard:
            self.sinks.scalars(it, memory_scalars(state.mesh.device))

    def at_log(self, state, values: dict) -> dict:
        """Extra values for the log line (params norm, num zeros); iteration-time / throughput tags."""
        c, it = self.config, state.iteration
        extra = {}
        if c.log_params_norm:
            if self._params_norm is None or self._params_norm[0] != it:
                self._params_norm = (it, state.optimizer.params_norm())  # a collective: every rank
            extra["params_norm"] = self._params_norm[1]
        if c.log_num_zeros_in_grad:
            extra["num_zeros"] = self._num_zeros
        if c.log_timers_to_tensorboard and self.sinks is not None:
            tags = {"iteration-time": values["iteration_time_s"]}
            if c.log_throughput:
                tags["throughput"] = values["tflops_per_device"]
            self.sinks.scalars(it, tags)
        if c.timing_log_level > 0:
            self._log_timers(state)
        self._window_steps = 0
        self.profiler.dump_memory_snapshot()
        return extra

    def _log_timers(self, state) -> None:
        """Megatron's timer report: ms per step of each timer over the log window, across ranks.

        A collective over every rank (one all-gather). A rank that never entered a timer (p2p at
        pp 1) has no value for it, as in Megatron. The console gets ``--timing-log-option``'s view;
        with --log-timers-to-tensorboard, TensorBoard / wandb get ``<name>-time``, the max over ranks.
        """
        names = profiling.timer_names(self.config.timing_log_level)
        mine = profiling.take_timers()
        steps = max(self._window_steps, 1)
        local = state.mesh.tensor([1000.0 * mine[n] / steps if n in mine else math.nan for n in names])
        everyone = local
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = local.new_empty(dist.get_world_size() * len(names))
            all_gather_flat(everyone, local, None)
        table = everyone.view(-1, len(names)).t().cpu().tolist()  # [timer][rank]
        option = self.config.timing_log_option
        lines, maxima = [], {}
        for name, values in zip(names, table):
            seen = [v for v in values if not math.isnan(v)]
            if not seen:
                continue
            maxima[f"{name}-time"] = max(seen)
            if option == "max":
                shown = f"{max(seen):.2f}"
            elif option == "minmax":
                shown = f"({min(seen):.2f}, {max(seen):.2f})"
            else:
                shown = "(" + ", ".join("-" if math.isnan(v) else f"{v:.2f}" for v in values) + ")"
            lines.append(f"    {name} {'.' * max(1, 48 - len(name))}: {shown}")
        if self.sinks is None or not lines:
            return
        title = {"max": "max time", "minmax": "(min, max) time", "all": "time"}[option]
        self.sinks.console(f"{title} across ranks (ms):\n" + "\n".join(lines))
        if self.config.log_timers_to_tensorboard:
            self.sinks.scalars(state.iteration, maxima)

    def before_eval(self) -> None:
        self.profiler.before_eval()

    def after_eval(self) -> None:
        self.profiler.after_eval()

    def at_eval(self, state, loss: float, ppl: float) -> None:
        if self.sinks is None:
            return
        samples = state.consumed_train_samples
        self.sinks.scalars(state.iteration, {"lm loss validation": loss}, samples=samples)
        if self.config.log_validation_ppl_to_tensorboard:
            self.sinks.scalars(state.iteration, {"lm loss validation ppl": ppl}, samples=samples)

    def close(self) -> None:
        self.profiler.close()
        profiling.set_timing_level(0)  # the timers belong to this run
