"""A vLLM worker extension for tests (``--worker-extension-cls tests.vllm.faults.FaultInjection``): a failure that only
a step can meet, on demand, reachable through vLLM's ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def before_each_step(engine: Any, before: Callable[[Any], None]) -> None:
    """From now on ``engine.step(work, ...)`` first calls ``before(work)``."""
    real = engine.step

    def step(work: Any, *args: Any, **kwargs: Any) -> Any:
        before(work)
        return real(work, *args, **kwargs)

    engine.step = step


class FaultInjection:
    """Methods vLLM adds to the plugin's worker (it must not define any the worker has)."""

    def arm_fault(self, marker: str) -> None:
        """From now on the engine's step raises, before it runs anything, whenever it is asked to run a sequence
        whose prompt starts with the token ids ``marker`` (a JSON list): what a graph or sampler failure of that
        request alone would do."""
        prefix = json.loads(marker)
        engine = self.runner.engine  # type: ignore[attr-defined]

        def check(work: Any) -> None:
            for seq_id in work:
                if engine.sequence(seq_id).tokens[: len(prefix)] == prefix:
                    raise RuntimeError(f"injected fault for {seq_id}")

        before_each_step(engine, check)

    def slow_steps(self, seconds: float) -> None:
        """From now on every engine step first waits ``seconds``: a stream of the tiny model then lasts long enough to
        be cut in the middle (unslowed, the engine core can finish it before the client has read its second event)."""
        import time

        before_each_step(self.runner.engine, lambda work: time.sleep(seconds))  # type: ignore[attr-defined]
