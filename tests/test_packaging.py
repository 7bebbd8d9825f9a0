"""Installing statechat does not confuse other libraries: our top-level `kernels` package is
not mistaken for Hugging Face's `kernels` hub package by transformers."""

from __future__ import annotations

import subprocess
import sys


def test_transformers_does_not_see_hf_kernels():
    code = (
        "import kernels, transformers.utils.import_utils as iu;"
        "print(iu.is_kernels_available())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
