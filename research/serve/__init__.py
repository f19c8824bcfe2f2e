"""An OpenAI-compatible HTTP server over the engine (``python -m research.serve``).

```python
from research import LLM
from research.serve import create_app

app = create_app(LLM("smollm2-135m"), served_model_name="smollm2-135m")  # any ASGI server runs it
```
"""

from research.serve.app import create_app
from research.serve.engine_loop import EngineLoop
from research.serve.errors import APIError

__all__ = ["APIError", "EngineLoop", "create_app"]
