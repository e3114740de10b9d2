"""Publish on a schedule from the training loops people already have: Lightning, Hugging Face, plain loops.

    from tierstore.schedule import Schedule
    from tierstore.integrations import LightningCallback, TransformersCallback, ScheduledPublisher

    sched = Schedule("greedy", total_steps=5000, warmup_steps=500, max_publishes=20)
    trainer = lightning.Trainer(callbacks=[LightningCallback("policy", sched)])     # Lightning
    trainer = transformers.Trainer(..., callbacks=[TransformersCallback("policy", sched)])  # Hugging Face

    pub = ScheduledPublisher(model, "policy", sched)                                 # a plain loop
    for step, batch in enumerate(loader):
        pub.step(step, train_step(batch))
    pub.close()

Each reports every step's training loss to the `Schedule` and, when it says so, publishes the model
through `tierstore.stream` asynchronously: training waits only for the snapshot of the weights. The
publish's cost is measured as it happens and fed back to the schedule (the trainer's stall, and the time
until the version can be served: placing it, announcing it and reading its tensors back), so the plan is
made from this machine's numbers. With `repository=`, published versions are also saved to a
`tierstore.models.Repository` in the background (one that falls behind skips to the newest version due,
as `stream.Publisher`'s history does).

Lightning and transformers are optional: they are imported only when their callback is first used, and
`pip install 'tierstore[integrations]'` installs both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierstore._scheduled import ScheduledPublisher, _require

# LightningCallback and TransformersCallback are public too, imported on first access (see __getattr__).
__all__ = ["ScheduledPublisher"]


# The framework callbacks subclass the frameworks' base classes, so each is in a module of its own that
# imports its framework: imported on first access (see __getattr__), so that importing
# tierstore.integrations never imports Lightning or transformers. For type checkers and the API reference,
# which read the code without running it, they are names of this module.
if TYPE_CHECKING:
    from tierstore._lightning_callback import LightningCallback as LightningCallback
    from tierstore._transformers_callback import TransformersCallback as TransformersCallback

# Each lazy name: the framework it needs, and the module that defines it.
_LAZY: dict[str, tuple[str, str]] = {
    "LightningCallback": ("lightning.pytorch", "tierstore._lightning_callback"),
    "TransformersCallback": ("transformers", "tierstore._transformers_callback"),
}
_built: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name in _LAZY:
        if name not in _built:
            import importlib

            framework, module = _LAZY[name]
            # Asked first, so that a framework missing now is named even if the module was imported before.
            _require(framework, f"tierstore.integrations.{name}")
            _built[name] = getattr(importlib.import_module(module), name)
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
