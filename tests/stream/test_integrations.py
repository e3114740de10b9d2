"""The schedule callbacks in real, short CPU training runs (Lightning and Hugging Face transformers, on
scikit-learn's digits), with a consumer in another process receiving every version through the agent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.agents import child
from tierstore import integrations
from tierstore.models import Repository
from tierstore.schedule import Schedule

# A consumer process: every version in order through a Subscriber, and the model served by a HotModel;
# once the final version is served it answers the whole digits set with it.
CONSUMER = """
import json, sys, time, torch
from sklearn.datasets import load_digits
from tierstore import stream
torch.manual_seed(1)
{make_model}
X, y = load_digits(return_X_y=True)
seen = []
sub = stream.Subscriber("digits", on_update=lambda v: seen.append(
    [v.version, v.step, bool(v.metadata.get("final")), v.metadata.get("loss")]))
hot = stream.HotModel(model, "digits")
print("ready", flush=True)
end = time.monotonic() + 90
while not (seen and seen[-1][2]) and time.monotonic() < end:
    time.sleep(0.01)
acc = None
if seen and seen[-1][2]:
    hot.wait_version(seen[-1][0], timeout=30)
    with hot.serving() as m, torch.no_grad():
        acc = float((predict(m, X).argmax(1) == torch.tensor(y)).float().mean())
print(json.dumps({{"seen": seen, "acc": acc}}), flush=True)
"""

MLP = """
def make():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
model = make()
def predict(m, X):
    return m(torch.tensor(X / 16, dtype=torch.float32))
"""

WRAPPED = """
class Wrapped(torch.nn.Module):  # the keys of the Hugging Face model below: net.0.weight ...
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
model = Wrapped()
def predict(m, X):
    return m.net(torch.tensor(X / 16, dtype=torch.float32))
"""


def digits_model() -> Any:
    """A Hugging Face model small enough to learn the digits in a few seconds of CPU (transformers is
    imported here, not when the tests are collected: it takes seconds)."""
    import transformers

    class DigitsConfig(transformers.PretrainedConfig):
        model_type = "tierstore-test-digits"

        def __init__(self, hidden: int = 32, **kw: object) -> None:
            super().__init__(**kw)
            self.hidden = hidden

    class DigitsModel(transformers.PreTrainedModel):
        config_class = DigitsConfig

        def __init__(self, config: DigitsConfig) -> None:
            super().__init__(config)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, config.hidden), torch.nn.ReLU(), torch.nn.Linear(config.hidden, 10)
            )
            self.post_init()

        def forward(
            self, pixels: torch.Tensor, labels: torch.Tensor | None = None
        ) -> transformers.modeling_outputs.SequenceClassifierOutput:
            logits = self.net(pixels)
            loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
            return transformers.modeling_outputs.SequenceClassifierOutput(loss=loss, logits=logits)

    return DigitsModel(DigitsConfig())


def start_consumer(make_model: str, sock: Path) -> subprocess.Popen[str]:
    proc = child(CONSUMER.format(make_model=make_model), sock)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "ready", proc.stderr.read() if proc.stderr else ""
    return proc


def consumer_result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def check(
    result: dict[str, object], published: list[int], schedule: Schedule, warmup: int, budget: int
) -> None:
    seen = result["seen"]
    assert isinstance(seen, list)
    # Every version, in order, at the steps the schedule chose, then the final model.
    assert [v[0] for v in seen] == list(range(1, len(published) + 1))
    assert [v[1] for v in seen] == published
    assert published[:-1] == schedule.published and [v[2] for v in seen][-1]
    assert schedule.published[0] == warmup and 2 <= len(schedule.published) <= budget
    assert all(isinstance(v[3], float) for v in seen[:-1]), "each scheduled version records its loss"
    # The costs the plan used were measured on this run.
    assert schedule.costs.train_s > 0 and schedule.costs.publish_s > 0 and schedule.costs.load_s > 0


def digits_module() -> Any:
    """The Lightning module the test trains (Lightning is imported here, not at collection: it takes
    seconds)."""
    import lightning.pytorch as pl

    class Digits(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    return Digits()


# The framework callbacks in real training runs: `slow`, as importing Lightning or transformers alone takes
# seconds (most of each test); `make test-fast` runs the schedule through the plain-loop helper below.
@pytest.mark.slow
def test_lightning_callback_publishes_on_schedule_to_a_consumer_process(
    sock: Path,
    tmp_path: Path,
) -> None:
    import lightning.pytorch as pl
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    data = torch.utils.data.TensorDataset(torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    consumer = start_consumer(MLP, sock)
    sched = Schedule("greedy", total_steps=80, warmup_steps=20, max_publishes=5)
    cb = integrations.LightningCallback("digits", sched, select=lambda m: m.net, repository=tmp_path / "repo")
    trainer = pl.Trainer(
        max_steps=80,
        accelerator="cpu",
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(digits_module(), loader)
    published = cb.publisher.published_steps
    result = consumer_result(consumer)
    check(result, published, sched, warmup=20, budget=5)
    assert published[-1] == 80
    assert isinstance(result["acc"], float) and result["acc"] > 0.8, result
    # The history: versions saved to the repository as they were published.
    saved = Repository(tmp_path / "repo").versions("digits")
    assert saved and saved[-1].metadata["step"] == 80


@pytest.mark.slow
def test_transformers_callback_publishes_on_schedule_to_a_consumer_process(
    sock: Path,
    tmp_path: Path,
) -> None:
    import transformers
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rows = [
        {"pixels": torch.tensor(r / 16, dtype=torch.float32), "labels": int(label)}
        for r, label in zip(x, y, strict=True)
    ]
    consumer = start_consumer(WRAPPED, sock)
    sched = Schedule("fixed", total_steps=60, warmup_steps=15, max_publishes=4)
    cb = integrations.TransformersCallback("digits", sched)
    torch.manual_seed(0)
    model = digits_model()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=60,
        per_device_train_batch_size=32,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[cb]).train()
    assert cb.publisher is not None
    published = cb.publisher.published_steps
    result = consumer_result(consumer)
    check(result, published, sched, warmup=15, budget=4)
    assert published[-1] == 60 and sched.interval is not None
    # Publishing here costs little next to the staleness it removes: the fixed plan spends its budget on
    # an even spacing (re-planned after each refit, so a step or so apart).
    gaps = np.diff(sched.published)
    assert len(sched.published) == 4 and gaps.max() - gaps.min() <= 1, sched.published
    assert isinstance(result["acc"], float) and result["acc"] > 0.7, result


def test_a_plain_loop_publishes_through_the_helper(sock: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    sched = Schedule("greedy", total_steps=200, warmup_steps=30, max_publishes=6)
    with integrations.ScheduledPublisher(net, "plain", sched, metadata={"run": "t"}) as pub:
        for step in range(200):
            with torch.no_grad():
                net.weight += 0.001
            pub.step(step, torch.tensor(2.0 * np.exp(-step / 40) + 0.1))
        versions = pub.versions(timeout=30)
    assert [v.step for v in versions] == sched.published and len(versions) == 6
    assert versions[0].metadata["run"] == "t" and versions[0].step == 30
    gaps = np.diff(sched.published)
    assert gaps[0] < gaps[-1], sched.published


def test_a_missing_framework_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(integrations, "_built", {})
    with pytest.raises(ImportError, match=r"pip install 'tierstore\[integrations\]'"):
        integrations.TransformersCallback  # noqa: B018
