"""``compile_plan`` pinned to the configured ``P_intra × P_inter`` topology (``flatten="never"``), for the
tests that exercise its SAP programs, its all-to-all and head chunks: by default ``compile_plan``
may plan a batch inside one node as ``1 × P`` or ``P × 1`` instead (``plan/flatten.py``; those
plans: ``tests/plan/test_flatten.py``)."""

from __future__ import annotations

from functools import partial

from megatron_hsap.plan import compile_plan as _compile_plan

compile_plan = partial(_compile_plan, flatten="never")
