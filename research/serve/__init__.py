"""An OpenAI-compatible HTTP server over the engine (``python -m research.serve``).

```python
from research import LLM
from research.serve import create_app

app = create_app(LLM("smollm2-135m"), served_model_name="smollm2-135m")  # any ASGI server runs it
```
"""

from typing import Any

# Imported on first use: ``python -m research.serve --tensor-parallel-size N`` must ask XLA for
# its host devices before anything starts JAX.
_EXPORTS = {
    "create_app": "research.serve.app",
    "EngineLoop": "research.serve.engine_loop",
    "APIError": "research.serve.errors",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'research.serve' has no attribute {name!r}")


__all__ = ["APIError", "EngineLoop", "create_app"]
