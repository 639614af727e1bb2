"""The one compiled loop of the data path: Megatron's blending rule, in C, through ``ctypes``.

Megatron-Core compiles its dataset helpers (``helpers.cpp``, pybind11) with ``make``
on first use. We need only the blending loop, so it is 20 lines of C, compiled
with the system C compiler (``$CC``, else ``cc``) into a per-user cache the first
time it is needed and loaded with ``ctypes``: no build step at install time, no
pybind11, and the package stays pure Python. ``-ffp-contract=off`` keeps
``w * t - taken`` two rounded float64 operations (no fused multiply-add), as in
Megatron's x86 build and in our Python loop, so the indices are the same bytes.

When no compiler is found, ``load_native_blending()`` returns ``None`` once with a
warning, and the caller runs the Python loop (same result, ~100x slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from functools import lru_cache

import numpy as np

from megalite import log

logger = log.get_logger(__name__)

BLENDING_C = r"""
#include <stdint.h>

/* Megatron-Core's build_blending_indices (helpers.cpp), continued from counts[] at sample t0:
   sample t goes to the dataset with the largest weight[k] * max(t, 1) - counts[k], the first on ties. */
void megalite_blending_indices(int16_t *dataset_index, int64_t *sample_index, const double *weights,
                               int32_t num_datasets, int64_t t0, int64_t steps, int64_t *counts) {
    for (int64_t t = t0; t < t0 + steps; ++t) {
        double td = t > 1 ? (double)t : 1.0;
        int32_t best = 0;
        double best_error = weights[0] * td - (double)counts[0];
        for (int32_t k = 1; k < num_datasets; ++k) {
            double error = weights[k] * td - (double)counts[k];
            if (error > best_error) {
                best_error = error;
                best = k;
            }
        }
        dataset_index[t] = (int16_t)best;
        sample_index[t] = counts[best];
        counts[best] += 1;
    }
}
"""

_FLAGS = ["-O2", "-ffp-contract=off", "-shared", "-fPIC"]


def cache_dir() -> str:
    """``$MEGALITE_CACHE_DIR``, else ``$XDG_CACHE_HOME/megalite``, else ``~/.cache/megalite``."""
    if os.environ.get("MEGALITE_CACHE_DIR"):
        return os.environ["MEGALITE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megalite")


def _compile(source: str, name: str) -> str | None:
    """Compile ``source`` into a shared library in the cache; its path, or None (with the reason logged)."""
    compiler = shlex.split(os.environ.get("CC") or "cc")
    tag = hashlib.sha256(
        "\0".join([source, *compiler, *_FLAGS, platform.machine(), sys.platform]).encode()
    ).hexdigest()[:16]
    for directory in (cache_dir(), os.path.join(tempfile.gettempdir(), f"megalite-{os.getuid()}")):
        lib = os.path.join(directory, f"{name}-{tag}.so")
        if os.path.isfile(lib):
            return lib
        try:
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                src = os.path.join(tmp, f"{name}.c")
                with open(src, "w") as f:
                    f.write(source)
                out = os.path.join(tmp, f"{name}.so")
                subprocess.run(
                    [*compiler, *_FLAGS, "-o", out, src], check=True, capture_output=True, timeout=120
                )
                os.replace(out, lib)  # atomic: ranks compiling at once each install a whole file
            return lib
        except OSError as err:  # no compiler, or an unwritable directory: try the next place
            reason = f"{err}"
        except subprocess.SubprocessError as err:
            reason = getattr(err, "stderr", b"").decode(errors="replace").strip()[:300] or str(err)
            break
    logger.warning(
        "blending index: cannot compile the C loop (%s); using the Python loop, ~1 s per million "
        "samples (install a C compiler, or set CC, to make it ~100x faster)",
        reason,
    )
    return None


@lru_cache(maxsize=1)
def load_native_blending():
    """``fn(dataset_index, sample_index, weights, n, t0, steps, counts)`` in C, or None."""
    if os.environ.get("MEGALITE_NO_NATIVE"):
        return None
    lib_path = _compile(BLENDING_C, "blending")
    if lib_path is None:
        return None
    fn = ctypes.CDLL(lib_path).megalite_blending_indices
    array = lambda dtype: np.ctypeslib.ndpointer(dtype, flags="C_CONTIGUOUS")
    fn.argtypes = [
        array(np.int16),
        array(np.int64),
        array(np.float64),
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_int64,
        array(np.int64),
    ]
    fn.restype = None
    return fn
