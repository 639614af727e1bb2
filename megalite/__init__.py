"""megalite: Megatron-style 3D-parallel pretraining for GPT-family models.

The Python API (docs/python-api.md)::

    from megalite import RunConfig, pretrain

    run = RunConfig.from_flags(["--mock-data", "--vocab-size", "256", ...])  # pretrain_gpt.py's flags
    pretrain(dataclasses.replace(run, ...))                                   # one process, or torchrun

Both names are imported on first use, so ``import megalite.errors`` (and the tools) stay light.
"""

from megalite.version import __version__

__all__ = ["RunConfig", "__version__", "pretrain"]


def __getattr__(name: str):
    if name == "RunConfig":  # the configs' RunConfig with its constructor from the flags
        from megalite.arguments import RunConfig

        return RunConfig
    if name == "pretrain":
        from megalite.training import pretrain

        return pretrain
    raise AttributeError(f"module 'megalite' has no attribute {name!r}")
