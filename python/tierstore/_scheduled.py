"""`ScheduledPublisher`, the engine of `tierstore.integrations`: publishing a model on the steps a `Schedule`
chooses. A module of its own below `integrations.py` and the framework callbacks, which all import it, so
that no import runs back up (`tierstore.integrations` is its public name).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from tierstore import stream
from tierstore.schedule import Schedule


def _require(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs the {module.split('.')[0]} package, which is not installed: "
            "pip install 'tierstore[integrations]'"
        ) from e


class ScheduledPublisher:
    """Publishes `model` to stream `name` at the steps `schedule` chooses; the plain-loop way in, and the
    engine of the framework callbacks.

    Args:
        model: the nn.Module (or state dict) to publish; it is snapshotted at each publish.
        name: the stream.
        schedule: decides when (see `tierstore.schedule.Schedule`).
        repository: a `tierstore.models.Repository` or its path: published versions are also saved there
            in the background (see `stream.Publisher`'s `history`).
        socket: the agent's socket (default: this user's).
        metadata: recorded with every version (the step and the loss are added).
        measure_load: read the first published version's tensors back from shared memory and count that
            in the schedule's load time (a consumer's load does the same reading).
    """

    def __init__(
        self,
        model: Any,
        name: str,
        schedule: Schedule,
        *,
        repository: Any = None,
        socket: str | os.PathLike[str] | None = None,
        metadata: Mapping[str, Any] | None = None,
        measure_load: bool = True,
    ) -> None:
        self.model = model
        self.name = name
        self.schedule = schedule
        self.metadata = dict(metadata or {})
        self._publisher = stream.Publisher(name, socket=socket, history=repository)
        self._measure_load = measure_load
        self._lock = threading.Lock()
        # (step, the publish's Future) for every publish, in order.
        self.publishes: list[tuple[int, Future[stream.StreamVersion]]] = []
        self.errors: list[str] = []
        self.last_step: int | None = None

    def step(self, step: int, loss: Any, model: Any = None) -> Future[stream.StreamVersion] | None:
        """Reports this step's loss; publishes (asynchronously) if the schedule says so.

        Args:
            step: the training step.
            loss: the training loss (a float or a 0-d tensor).
            model: what to publish, if not the model given to the constructor.

        Returns:
            The publish's Future when this step was published, else None.
        """
        self.last_step = step
        value = float(loss.detach()) if hasattr(loss, "detach") else float(loss)
        if not self.schedule.should_publish(step, value):
            return None
        return self.publish(step, value, model)

    def publish(
        self, step: int, loss: float | None = None, model: Any = None, *, final: bool = False
    ) -> Future[stream.StreamVersion]:
        """Publishes now, whatever the schedule says (the callbacks use it for the final model)."""
        meta = {**self.metadata, "step": step, **({"loss": loss} if loss is not None else {})}
        if final:
            meta["final"] = True
        t0 = time.perf_counter()
        fut = self._publisher.publish(
            self.model if model is None else model, step=step, metadata=meta, sync=False
        )
        stalled = time.perf_counter() - t0
        assert isinstance(fut, Future)
        self.schedule.observe(publish_s=stalled)
        first = not self.publishes
        self.publishes.append((step, fut))
        fut.add_done_callback(lambda f: self._done(f, t0 + stalled, first))
        return fut

    def _done(self, fut: Future[stream.StreamVersion], snapshotted: float, first: bool) -> None:
        if fut.exception() is not None:
            with self._lock:
                self.errors.append(f"publish of {self.name}: {fut.exception()}")
            return
        load = time.perf_counter() - snapshotted
        if first and self._measure_load:
            t0 = time.perf_counter()
            v = fut.result()
            try:
                for t in v.state_dict("numpy").values():
                    t.copy()
            except TypeError:  # a dtype numpy lacks (bfloat16): read it as torch does
                for t in v.state_dict("torch").values():
                    t.clone()
            load += time.perf_counter() - t0
        self.schedule.observe(load_s=load)

    @property
    def published_steps(self) -> list[int]:
        return [s for s, _ in self.publishes]

    def versions(self, timeout: float | None = None) -> list[stream.StreamVersion]:
        """The versions published so far (waits for those still in flight)."""
        return [f.result(timeout) for _, f in self.publishes]

    def close(self, *, final: bool = False) -> None:
        """Waits for the publishes in flight and the repository saves, then disconnects.

        Args:
            final: publish the model as it is now first, unless its last step was just published (the
                schedule plans no publish at the last step; consumers that outlive training want it).
        """
        if final and self.last_step is not None and self.last_step not in self.published_steps:
            self.publish(self.last_step, final=True)
        self._publisher.close()

    def __enter__(self) -> ScheduledPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
