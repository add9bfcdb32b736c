"""Hardware diagnostics: checks that prove, on a given machine, what a backend assumes.

    >>> import torch
    >>> from radiance_ar.diagnostics import cu_free_check
    >>> for r in cu_free_check.standard_checks(torch.device("cuda", 0)): print(r)
"""

from __future__ import annotations

import json


def write_json(path: str | None, records) -> None:
    """Write a diagnostic's records to ``path`` as JSON (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
