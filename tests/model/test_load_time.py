"""Loading a model does not import torch's compiler (torch._dynamo): built on the meta device,
the embedding's normal_ init and the rotary table's arange went through torch's reference ops,
which import it, 0.6 s of every start on the CPU (the app's, each worker process's)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, torch
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
assert loaded.model.model.rotary.inv_freq.abs().sum() > 0  # (computed after to_empty)
print("torch._dynamo" in sys.modules)
"""


def test_loading_the_embedded_model_leaves_torch_s_compiler_unimported():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
