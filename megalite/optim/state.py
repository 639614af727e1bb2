"""Optimizer state for checkpoints: AdamW's moments and steps, the loss scaler, the fp32 main copies.

:meth:`OptimizerState.state_dict` is this rank's whole state in one dict, AdamW's part in the format
one ``torch.optim.AdamW`` over every main param writes, however many parts step them. The checkpoint
(:mod:`megalite.checkpoint.optimizer_state`) goes per model param: :meth:`~OptimizerState.main_param_state`,
:meth:`~OptimizerState.gather_state_dp_zero`, :meth:`~OptimizerState.load_adamw_state`.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.errors import ArgumentError
from megalite.optim.base import MainParam, MainParams
from megalite.optim.step import AdamWStep

# Keys of a param group that choose torch's implementation: a loaded checkpoint keeps this run's.
_KERNEL_KEYS = ("fused", "foreach", "capturable")


class OptimizerState:
    """Reads and writes the state of the main params ``params``, stepped by ``adamw``, and ``grad_scaler``'s."""

    def __init__(self, params: MainParams, adamw: AdamWStep, grad_scaler):
        self.params = params
        self.adamw = adamw
        self.grad_scaler = grad_scaler

    def main_param_state(self, m: MainParam, kind: str) -> torch.Tensor:
        """``kind`` of main param ``m``, shaped like it: "main" (the fp32 main param itself), or an
        AdamW moment, "exp_avg" / "exp_avg_sq" (zeros before the first step)."""
        if kind == "main":
            return m.main.detach()
        state = self.adamw.state_of(m)
        return state[kind].detach() if kind in state else torch.zeros_like(m.main)

    def gather_state_dp_zero(self, kinds: list[str]) -> dict[tuple[str, nn.Parameter], torch.Tensor]:
        """``{(kind, model param): fp32 tensor shaped like the param}`` for each ``kind`` of
        :meth:`main_param_state`, on every DP rank; a collective over DP when the main params are
        DP shards (Megatron's get_parameter_state_dp_zero). Copies under the nvme tier (its tensors
        go back to the disk when this returns)."""
        with self.adamw.resident():
            out = self.params.gather(self.main_param_state, kinds)
            return {k: v.clone() for k, v in out.items()} if self.adamw.nvme is not None else out

    def _groups(self, groups: list[dict]) -> tuple[list[dict], list[list[int]], list[int]]:
        """Per param group, its settings and the numbers of its main params in one AdamW over them all
        (group by group; ``self.adamw.mains[numbered[n]]`` is number n)."""
        group_of = self.adamw.group_of
        numbered = sorted(range(len(group_of)), key=group_of.__getitem__)
        members = [
            [n for n, i in enumerate(numbered) if group_of[i] == g] for g in range(len(self.adamw.settings))
        ]
        return [{k: v for k, v in g.items() if k != "params"} for g in groups], members, numbered

    def state_dict(self) -> dict:
        """This rank's optimizer state (AdamW state of its main params, loss scaler, fp32 copies)."""
        with self.adamw.resident():
            return self._state_dict()

    def _state_dict(self) -> dict:
        settings, members, numbered = self._groups(self.adamw.parts[0].param_groups)
        state = {n: s for n, i in enumerate(numbered) if (s := self.adamw.state_of(self.adamw.mains[i]))}
        if self.adamw.nvme is not None:  # its tensors go back to the disk: copies
            state = {
                n: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for n, s in state.items()
            }
        return {
            "optimizer": {
                "state": state,
                "param_groups": [{**s, "params": m} for s, m in zip(settings, members)],
            },
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "main_params": [m.main.detach().clone() for m in self.params.params if m.is_copy],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        with self.adamw.resident(), self.params.shards_resident():
            self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["optimizer"]
        settings, members, numbered = self._groups(saved["param_groups"])
        if [len(g["params"]) for g in saved["param_groups"]] != list(map(len, members)):
            raise ArgumentError(
                "optimizer checkpoint's param groups differ in size from this model's: "
                "was it saved with another parallel layout or --decoupled-lr setting?"
            )
        mains = self.adamw.mains
        self.load_adamw_state({mains[numbered[int(n)]].main: s for n, s in saved["state"].items()}, settings)
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        copies = [m for m in self.params.params if m.is_copy]
        values = state_dict["main_params"]
        if len(values) != len(copies):
            raise ArgumentError(
                f"optimizer checkpoint has {len(values)} fp32 main params, this model has {len(copies)}: "
                "was it saved with another --fp16/--bf16 setting or parallel layout?"
            )
        self.adamw.write_main_params(copies, values)
        self.params.copy_to_model()

    def load_adamw_state(self, states: dict[nn.Parameter, dict], settings: list[dict] | None = None) -> None:
        """Install AdamW state, ``{main param: {"step", "exp_avg", "exp_avg_sq"}}``, by torch's load
        (each tensor onto its main param's device); main params left out start afresh. The param groups
        keep this run's settings, or take ``settings`` (a checkpoint's) but for the implementation: a
        checkpoint of the fused kernel resumes under foreach and the other way round. Each ``step``
        goes to the CPU: torch moves it onto the param's device for the fused kernel, and foreach
        wants it on the CPU (on the GPU it would cost a host sync per param and step)."""
        for part in self.adamw.parts:
            own = part.state_dict()["param_groups"]
            if settings is not None:
                own = [
                    {**s, **{k: g[k] for k in _KERNEL_KEYS if k in g}, "params": g["params"]}
                    for s, g in zip(settings, own)
                ]
            params = [p for g in part.param_groups for p in g["params"]]
            state = {
                i: {k: v.cpu() if k == "step" and torch.is_tensor(v) else v for k, v in states[p].items()}
                for i, p in enumerate(params)
                if p in states
            }
            part.load_state_dict({"state": state, "param_groups": own})
