"""Put first on PYTHONPATH by `tierstore run`: every Python process of the job hooks torch's DataLoader
for sampler-aware prefetch (`tierstore.auto_order`) when it imports it, and only then imports tierstore,
so a process that never loads a DataLoader pays nothing. Then runs the `sitecustomize` this one stands in
front of, if there is one."""

import importlib.machinery
import importlib.util
import os
import sys


class _WhenTorchLoads:
    def find_spec(self, name, path, target=None):
        if name != "torch.utils.data.dataloader":
            return None
        sys.meta_path.remove(self)
        try:
            from tierstore import auto_order
        except Exception:  # tierstore cannot load here: the job runs without the hook
            return None
        return auto_order.after_import().find_spec(name, path, target)


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


if os.environ.get("TIERSTORE_SAMPLER_PREFETCH", "").strip().lower() not in ("off", "0", "false", "no"):
    sys.meta_path.insert(0, _WhenTorchLoads())
_chain()
