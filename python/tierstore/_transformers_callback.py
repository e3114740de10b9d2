"""`tierstore.integrations.TransformersCallback`, in a module of its own: it subclasses transformers'
`TrainerCallback`, so `tierstore.integrations` imports this module (and transformers) only when the class
is first asked for."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tierstore._scheduled import ScheduledPublisher, _require
from tierstore.schedule import Schedule

tf = _require("transformers", "tierstore.integrations.TransformersCallback")

__all__ = ["TransformersCallback"]


class TransformersCallback(tf.TrainerCallback):  # type: ignore[misc, name-defined]
    """A Hugging Face `TrainerCallback` that publishes the model on `schedule`.

    The Trainer hands callbacks the training loss only when it logs it: the schedule sees the loss
    every `logging_steps` steps (set `logging_steps=1` for a schedule that can pick any step), at
    `state.global_step`. Only the main process publishes.

    Args:
        name: the stream.
        schedule: decides when.
        final: at the end of training, publish the model if its last step was not published.
        repository: as for `ScheduledPublisher`.
        socket: as for `ScheduledPublisher`.
        metadata: as for `ScheduledPublisher`.
    """

    def __init__(
        self,
        name: str,
        schedule: Schedule,
        *,
        final: bool = True,
        repository: Any = None,
        socket: str | os.PathLike[str] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.name, self.schedule, self.final = name, schedule, final
        self._kw = {"repository": repository, "socket": socket, "metadata": metadata}
        self.publisher: ScheduledPublisher | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.is_world_process_zero and self.publisher is None and model is not None:
            self.publisher = ScheduledPublisher(model, self.name, self.schedule, **self._kw)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kw: Any
    ) -> None:
        if self.publisher is None or not logs or "loss" not in logs:
            return
        self.publisher.step(int(state.global_step), logs["loss"])

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.publisher is not None:
            self.publisher.last_step = int(state.global_step)
            self.publisher.close(final=self.final)
