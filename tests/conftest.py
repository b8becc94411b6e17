import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from hf_models import ARCHS, save_hf_model  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """arch -> (checkpoint dir, transformers model): one saved tiny random model per architecture."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: (root / arch, save_hf_model(arch, root / arch)) for arch in ARCHS}
