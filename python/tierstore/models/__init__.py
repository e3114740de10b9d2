"""The model repository: save and load models tensor by tensor, with partial loads, dedup across versions,
integrity checks and DStore's stable layer IDs for transfer learning.

    from tierstore.models import Repository
    repo = Repository("/lustre/models")
    v = repo.save("resnet50", model, metadata={"epoch": 10})
    repo.load("resnet50", into=model)                       # in place, every hash checked
    heads = repo.load("resnet50", keys=["fc.*"])             # reads only those bytes
    report = repo.load_matching(new_model, "resnet50")       # fills layers with equal stable IDs
    repo.verify(repair=True)                                 # checks every stored tensor
"""

from tierstore._core import IntegrityError
from tierstore.models.integrity import DamagedTensor, VerifyReport
from tierstore.models.layers import layer_ids
from tierstore.models.repository import MatchReport, Repository, RepositoryError, Version

__all__ = [
    "DamagedTensor",
    "IntegrityError",
    "MatchReport",
    "Repository",
    "RepositoryError",
    "VerifyReport",
    "Version",
    "layer_ids",
]
