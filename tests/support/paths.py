"""Where things are: the repository root (a plain ``str`` path; scripts import as ``scripts.*`` from it)."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
