"""`tierstore.integrations.LightningCallback`, in a module of its own: it subclasses Lightning's
`Callback`, so `tierstore.integrations` imports this module (and Lightning) only when the class is first
asked for."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from tierstore._scheduled import ScheduledPublisher, _require
from tierstore.schedule import Schedule

pl = _require("lightning.pytorch", "tierstore.integrations.LightningCallback")

__all__ = ["LightningCallback"]


class LightningCallback(pl.Callback):  # type: ignore[misc, name-defined]
    """A Lightning callback that publishes the LightningModule on `schedule`.

    The loss is what `training_step` returns (a tensor, or a dict's `"loss"`), reported after every
    batch at `trainer.global_step`; only the global rank 0 process publishes.

    Args:
        name: the stream.
        schedule: decides when.
        select: what to publish from the LightningModule (default: all of it); e.g.
            `lambda m: m.net` to publish the network a consumer loads without the wrapper's prefix.
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
        select: Callable[[Any], Any] | None = None,
        final: bool = True,
        repository: Any = None,
        socket: str | os.PathLike[str] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.name, self.schedule, self.select, self.final = name, schedule, select, final
        self._kw = {"repository": repository, "socket": socket, "metadata": metadata}
        self.publisher: ScheduledPublisher | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero and self.publisher is None:
            target = self.select(pl_module) if self.select else pl_module
            self.publisher = ScheduledPublisher(target, self.name, self.schedule, **self._kw)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.publisher is None or outputs is None:
            return
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        self.publisher.step(int(trainer.global_step), loss)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.publisher is not None:
            self.publisher.close(final=self.final)
