"""Set-up of the cluster tests (their local Ray, `ray_local`, is in tests/conftest.py).

The folder goes on sys.path so the tests import `cluster_helpers` by name (importlib mode puts
no test folder there). Actors run the kernels' torch reference path (TRITON_INTERPRET=0): the
Triton interpreter is exercised by the kernel and model tests, not through four processes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
