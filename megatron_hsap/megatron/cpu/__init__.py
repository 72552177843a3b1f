"""Run Megatron's own ``pretrain()`` loop on CPU gloo ranks (tests and the CPU demo only).

Never imported on the GPU path: the spec, the core attention, batch sharding, the hooks and the
wrapper script do not import this package. :mod:`.device` redirects CUDA devices to the CPU and
stands in for ``torch.cuda``; :mod:`.loop` is the ``megatron-hsap pretrain-cpu`` command (docs/design.md §5).
"""
