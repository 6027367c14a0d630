"""vLLM's `vllm.general_plugins` entry point: the contract's checks in every vLLM process.

pyproject.toml registers it:

```toml
[project.entry-points."vllm.general_plugins"]
spec_schema = "spec_schema.engines.vllm_plugin:register"
```

vLLM's `load_general_plugins()` calls `register()` without arguments, once per process (the engine
core and each worker, before the worker builds its model runner). With SPEC_STRICT unset it does
nothing (nothing is imported or wrapped). Under SPEC_STRICT=1 or 2 it installs
`spec_schema.engines.vllm.install()`: the checks take their `SpecConfig` from the `vllm_config`
each model runner is built with, so `SPEC_STRICT=1` alone turns them on.
"""

from .. import _strict


def register() -> None:
    """Install the vLLM checks in this process when SPEC_STRICT is set; otherwise do nothing."""
    if not _strict.LEVEL:
        return
    from . import _vllm_install

    _vllm_install.install(None)
