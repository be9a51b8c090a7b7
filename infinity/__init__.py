"""infinity: train PyTorch models whose state is larger than GPU and host memory.

Parameters, gradients and optimizer state live on NVMe and are streamed through
pinned host buffers to the compute device just in time (ZeRO-Infinity).

The public API is loaded on first use, so importing a low layer (infinity.aio)
does not import the whole runtime.
"""

__all__ = [
    "Engine",
    "GatheredParameters",
    "InferenceEngine",
    "PreflightError",
    "__version__",
    "checkpointing",
    "estimate_memory",
    "initialize",
    "models",
    "zero",
]

_LAZY = {
    "Engine": ("infinity.engine", "Engine"),
    "initialize": ("infinity.inference", "initialize"),
    "InferenceEngine": ("infinity.inference", "InferenceEngine"),
    "GatheredParameters": ("infinity.zero.gathered", "GatheredParameters"),
    "estimate_memory": ("infinity.estimate", "estimate_memory"),
    "PreflightError": ("infinity.estimate", "PreflightError"),
    "zero": ("infinity.zero", None),
    "checkpointing": ("infinity.zero.checkpointing", None),  # deepspeed.checkpointing's API
    "models": ("infinity.models", None),
    "__version__": ("infinity._version", "version"),  # read once, from pyproject.toml's one source
}


# The loader's own imports stay inside it, so the module namespace holds only the public names.
def __getattr__(name: str) -> object:
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module 'infinity' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    if callable(value) and name == "__version__":
        value = value()
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public API, the subpackages imported so far, and the module's dunders."""
    import sys

    loaded = {n for n in globals() if f"{__name__}.{n}" in sys.modules}
    dunders = {n for n in globals() if n.startswith("__") and n.endswith("__")}
    return sorted(set(__all__) | loaded | dunders)
