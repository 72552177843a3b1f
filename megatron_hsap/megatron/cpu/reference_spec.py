"""The CP=1 reference's ``HybridModel`` stack spec for CPU runs of Megatron's loop (tests and demos).

``--spec megatron_hsap.megatron.cpu.reference_spec REFERENCE_HYBRID_STACK_SPEC`` (added by
``command.megatron_flags`` to a ``--reference`` run with ``--hybrid-layer-pattern`` and no ``--spec`` of
its own): Megatron's ``hybrid_config_from_args`` imports the
object itself (``spec_utils.import_module`` reads the module's namespace, so it is a plain module
attribute). megatron-core's default hybrid stack spec is built from Transformer Engine modules; this
one has the same attention / MLA / MLP layers from megatron-core's local modules — local
``DotProductAttention`` with the dataloader's per-document mask, no HSAP module anywhere.
"""

from __future__ import annotations

from megatron_hsap.megatron.spec import _local_hybrid_stack_spec

__all__ = ["REFERENCE_HYBRID_STACK_SPEC"]

REFERENCE_HYBRID_STACK_SPEC = _local_hybrid_stack_spec()
