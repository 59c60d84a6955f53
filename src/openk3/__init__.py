"""openk3: the Kimi K3 architecture in PyTorch (reference model, fast GPU paths, training, inference, cost model)."""

from openk3.config import PRESETS, ConfigError, K3Config, get_preset

__version__ = "0.1.0"

__all__ = [
    "K3Config",
    "ConfigError",
    "PRESETS",
    "get_preset",
    "K3ForCausalLM",
    "K3Model",
    "K3Cache",
    "__version__",
]


def __getattr__(name):  # lazy: importing the config must not import the model
    if name in ("K3ForCausalLM", "K3Model", "K3Output"):
        from openk3 import model

        return getattr(model, name)
    if name == "K3Cache":
        from openk3.cache import K3Cache

        return K3Cache
    raise AttributeError(f"module 'openk3' has no attribute {name!r}")
